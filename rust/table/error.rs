//! What a table or a block-id transfer that cannot be used reports.

use std::fmt;

use crate::region::MemoryKind;

/// A table or a block-id transfer that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TableError {
    /// A segment that is empty, overflows, or whose pages overlap the next block's.
    BadSegment { segment: usize, reason: String },
    /// A page of a segment (`len` bytes at `start`, the first such page) is not inside registered
    /// memory of the table's kind (one region, or adjacent regions of that kind).
    NotRegistered {
        segment: usize,
        start: u64,
        len: u64,
        kind: MemoryKind,
    },
    /// A segment's span lies in adjacent registered regions, but the page of `block` (`nbytes`
    /// at `page`) crosses `boundary`, where one region ends and the next begins: no copy may.
    Straddles {
        segment: usize,
        block: u64,
        page: u64,
        nbytes: u64,
        boundary: u64,
    },
    /// No table has this id.
    Unknown(u32),
    /// Transfers are in flight: the table cannot be removed now.
    Busy { table: u32, in_flight: usize },
    /// The table's memory is not of the kind the direction needs.
    WrongKind {
        table: u32,
        kind: MemoryKind,
        needed: MemoryKind,
    },
    /// The two tables' segments differ in number or size.
    Incompatible {
        src_segments: usize,
        dst_segments: usize,
        detail: String,
    },
    /// The id lists differ in length.
    LengthMismatch { src: usize, dst: usize },
    /// No block.
    Empty,
    /// A block id outside the table (negative ids arrive as huge ones), in the caller's units.
    OutOfRange {
        name: String,
        index: usize,
        id: i64,
        num_blocks: u64,
    },
    /// The same destination block twice in one transfer, in the caller's units.
    DuplicateDestination { name: String, index: usize, id: u64 },
    /// Two pages one transfer would write share bytes (`first` and `second`, as `(address,
    /// bytes)`): what lands there would depend on the order of the copies (on the GPU, a race
    /// between a kernel's CTAs). `table`: the destination table's name (may be empty); `within`:
    /// where the two pages come from. Every plan refuses it alike.
    OverlappingDestinations {
        table: String,
        first: (u64, u64),
        second: (u64, u64),
        within: Overlap,
    },
    /// Chunk ids that do not match the blocks on the other side (see [`super::chunk_blocks`]).
    ChunkCount {
        name: String,
        other: String,
        blocks: usize,
        unit: u64,
        skip: u64,
        got: usize,
    },
    /// A group's mapping that cannot be used: a skip of a whole chunk or more, chunk ids on both
    /// sides or on neither.
    BadChunking(String),
    /// An error in one KV-cache group of a transfer of several.
    InGroup {
        group: usize,
        error: Box<TableError>,
    },
}

/// Where the two pages of [`TableError::OverlappingDestinations`] come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// Two segments of the destination table that share memory in every block (layers that
    /// share one tensor): a transfer into the table writes those bytes twice whatever its ids,
    /// so the table can be a source only (known when it is registered, see
    /// [`super::BlockTable::shared_segments`]).
    Segments(usize, usize),
    /// Segments of the destination table whose pages overlap for some blocks only.
    Pages,
    /// Pages of two KV-cache groups whose destination tables share memory.
    Groups,
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TableError::BadSegment { segment, reason } => {
                write!(f, "block table segment {segment}: {reason}")
            }
            TableError::NotRegistered {
                segment,
                start,
                len,
                kind,
            } => write!(
                f,
                "block table segment {segment}: the page [{start:#x}, +{len}) is not inside \
                 registered {kind} memory"
            ),
            TableError::Straddles {
                segment,
                block,
                page,
                nbytes,
                boundary,
            } => write!(
                f,
                "block table segment {segment}: the page of block {block} ([{page:#x}, \
                 +{nbytes})) crosses the boundary at {boundary:#x} between two registered \
                 regions; a copy may not cross one (register the memory in pieces that end \
                 between pages)"
            ),
            TableError::Unknown(id) => write!(f, "no block table {id}"),
            TableError::Busy { table, in_flight } => write!(
                f,
                "block table {table} cannot be removed while {in_flight} transfers are in flight"
            ),
            TableError::WrongKind {
                table,
                kind,
                needed,
            } => {
                write!(
                    f,
                    "block table {table} is {kind} memory; this direction needs {needed}"
                )
            }
            TableError::Incompatible {
                src_segments,
                dst_segments,
                detail,
            } => write!(
                f,
                "block tables differ: {src_segments} source segments, {dst_segments} destination \
                 segments{detail}"
            ),
            TableError::LengthMismatch { src, dst } => {
                write!(f, "{src} source block ids but {dst} destination block ids")
            }
            TableError::Empty => f.write_str("empty transfer (no block)"),
            TableError::OutOfRange {
                name, index, id, ..
            } if *id < 0 => write!(
                f,
                "{name} block ids hold a negative block id ({id}, at position {index})"
            ),
            TableError::OutOfRange {
                name,
                index,
                id,
                num_blocks,
            } => write!(
                f,
                "{name} block ids hold block id {id}, out of range (at position {index}; there \
                 are {num_blocks} blocks)"
            ),
            TableError::DuplicateDestination { name, index, id } => write!(
                f,
                "{name} block id {id} is a destination more than once (again at position {index})"
            ),
            TableError::OverlappingDestinations {
                table,
                first: (a, m),
                second: (b, n),
                within,
            } => {
                let of = if table.is_empty() {
                    String::new()
                } else {
                    format!(" of the {table} table")
                };
                match within {
                    Overlap::Segments(s, t) => write!(
                        f,
                        "destination pages overlap: segments {s} and {t}{of} share memory \
                         ([{a:#x}, +{m}) and [{b:#x}, +{n}) in one block), so a transfer into it \
                         would write those bytes twice, in no fixed order; a table whose \
                         segments share memory (layers on one tensor) can be a source only"
                    ),
                    Overlap::Pages => write!(
                        f,
                        "destination pages of different segments{of} overlap: [{a:#x}, +{m}) \
                         and [{b:#x}, +{n}); the result would depend on the order of the copies"
                    ),
                    Overlap::Groups => write!(
                        f,
                        "destination pages of different groups overlap: [{a:#x}, +{m}) and \
                         [{b:#x}, +{n}); the result would depend on the order of the copies"
                    ),
                }
            }
            TableError::ChunkCount {
                name,
                other,
                blocks,
                unit,
                skip,
                got,
            } => write!(
                f,
                "{blocks} {other} blocks from sub-block {skip} of the first {name} block take \
                 ceil(({skip} + {blocks}) / {unit}) = {} {name} block ids ({unit} sub-blocks \
                 each), got {got}",
                if *blocks == 0 {
                    0
                } else {
                    (*skip as usize + blocks).div_ceil(*unit as usize)
                }
            ),
            TableError::BadChunking(reason) => f.write_str(reason),
            TableError::InGroup { group, error } => write!(f, "group {group}: {error}"),
        }
    }
}

impl std::error::Error for TableError {}
