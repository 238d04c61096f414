//! Copy kernels the core launches or hands a batch to: the part of a transfer a kernel moves
//! ([`KernelBatch`]), what moves it ([`PageKernel`]), and what a loaded kernel takes
//! ([`KernelSpec`], [`KernelParam`], [`KernelKind`]).

use std::fmt;

/// The part of a transfer a copy kernel moves: descriptors `[0, len)` of the slab, whose columns
/// start at `src`, `dst` and `size` (page-locked, device-mapped: the kernel reads them in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelBatch {
    pub src: u64,
    pub dst: u64,
    pub size: u64,
    pub len: usize,
    /// The largest size in the part, and the largest power of two (up to 16) dividing every
    /// address and size of it: they pick the kernel's specialisation.
    pub max_size: u64,
    pub alignment: u64,
    /// The stream to launch on (the lane's); 0 on the host backend.
    pub stream: u64,
}

/// Launches a copy kernel for a [`KernelBatch`] (the Python layer's Triton kernel).
pub type KernelLauncher<'a> = &'a (dyn Fn(KernelBatch) -> Result<(), String> + Sync);

/// What moves the small descriptors of a transfer's kernel route.
#[derive(Clone, Copy)]
pub enum PageKernel<'a> {
    /// A launcher the caller gives, called on the submitting thread with the batch.
    Launcher(KernelLauncher<'a>),
    /// A kernel loaded by [`crate::backend::Backend::load_kernel`], launched by the backend itself, no more than
    /// `launch_bytes` (counted as descriptors of the batch's largest size, at least one
    /// descriptor) per launch: a launch holds its SMs until it ends.
    Loaded { kernel: u32, launch_bytes: u64 },
}

impl PageKernel<'_> {
    /// The kernel as one that borrows nothing: `None` for a caller's launcher.
    #[must_use]
    pub fn owned(self) -> Option<PageKernel<'static>> {
        match self {
            PageKernel::Launcher(_) => None,
            PageKernel::Loaded {
                kernel,
                launch_bytes,
            } => Some(PageKernel::Loaded {
                kernel,
                launch_bytes,
            }),
        }
    }
}

impl fmt::Debug for PageKernel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageKernel::Launcher(_) => f.write_str("Launcher"),
            PageKernel::Loaded {
                kernel,
                launch_bytes,
            } => write!(f, "Loaded({kernel}, {launch_bytes} bytes a launch)"),
        }
    }
}

/// Work items per CTA the copy kernel's slicing aims for.
pub const ITEMS_PER_CTA: u64 = 4;
/// The most descriptors one program of the copy kernel copies side by side (its `ROWS`): 64
/// keeps a step's `block_bytes` in flight down to 512-byte pages (vLLM's canonical layout moves
/// fragments of 512 B-2 KiB). At 16, 512-byte fragments kept a quarter of it: 32 KiB steps held
/// 8 KiB, and the canonical layout's 512 B fragments reached 83 / 76 % of the link (GPU -> CPU /
/// CPU -> GPU) against 87 / 79 % at 64 (H100, 2026-11-27, `python benches/bench_canonical.py`
/// alternated twice; 1-2 KiB fragments unchanged).
pub const MAX_ROWS: u64 = 64;
/// Its `ROWS` where the descriptors' sizes are not known.
pub const DEFAULT_ROWS: u64 = 4;

/// How one launch of the copy kernel covers `n` descriptors (the Python launcher's and the
/// core's launches alike): `(grid, split, rows, row_bytes)`, programs, slices per descriptor,
/// descriptors a program copies side by side (`ROWS`) and bytes per row and step
/// (`BLOCK_BYTES`), so that a step moves `block_bytes`. Small descriptors go several to a step;
/// a descriptor is sliced into pieces of at least `row_bytes` where there are too few to give
/// each of `max_ctas` programs [`ITEMS_PER_CTA`] items. `max_size`: the largest descriptor
/// (`None`: unknown, taken as large); `total_bytes`: all of them (`None`: `n * max_size`).
#[must_use]
pub fn launch_plan(
    n: u64,
    max_ctas: u64,
    block_bytes: u64,
    max_size: Option<u64>,
    total_bytes: Option<u64>,
) -> (u64, u64, u64, u64) {
    let (max_ctas, block_bytes) = (max_ctas.max(1), block_bytes.max(16));
    let rows = match max_size {
        None => DEFAULT_ROWS,
        // block_bytes >> bit_length(max_size - 1): the rows of pages up to max_size a step holds.
        Some(m) => block_bytes
            .checked_shr(u64::BITS - m.saturating_sub(1).leading_zeros())
            .unwrap_or(0),
    };
    let rows = rows.clamp(1, MAX_ROWS.min(block_bytes / 16).max(1));
    let row_bytes = block_bytes / rows;
    let split = slices(n, max_ctas, rows, row_bytes, max_size, total_bytes);
    let grid = max_ctas.min(n.saturating_mul(split).div_ceil(rows));
    (grid, split, rows, row_bytes)
}

/// Slices per descriptor of a launch (see [`launch_plan`]).
fn slices(
    n: u64,
    ctas: u64,
    rows: u64,
    row_bytes: u64,
    max_size: Option<u64>,
    total_bytes: Option<u64>,
) -> u64 {
    // Saturating: a CTA count past what a launch takes asks for the most items, not for none.
    let target_items = ITEMS_PER_CTA
        .saturating_mul(ctas.max(1))
        .saturating_mul(rows.max(1));
    match max_size {
        // Sizes unknown: enough items for every program; surplus slices find no chunk.
        None if n >= target_items => 1,
        None => target_items.div_ceil(n.max(1)),
        Some(m) => {
            let total = total_bytes.unwrap_or(n.saturating_mul(m));
            let item_bytes = row_bytes.max(total / target_items);
            m.div_ceil(row_bytes).min(m.div_ceil(item_bytes)).max(1)
        }
    }
}

/// Slices per descriptor for a launch of a loaded kernel over `n` descriptors of at most
/// `max_size` bytes: [`launch_plan`]'s rule with the kernel's own `rows` and `row_bytes`. A spec
/// without `row_bytes` (0) never slices.
#[must_use]
pub fn kernel_split(spec: &KernelSpec, n: u64, max_size: u64) -> u64 {
    let row_bytes = u64::from(spec.row_bytes);
    if row_bytes == 0 || n == 0 {
        return 1;
    }
    slices(
        n,
        u64::from(spec.ctas),
        u64::from(spec.rows),
        row_bytes,
        Some(max_size),
        None,
    )
}

/// A value a kernel parameter takes at each launch (see [`KernelSpec`]). A page kernel (the
/// kernel route) reads descriptors: `srcs`, `dsts`, `sizes`, `count`, `split`, `src_base`,
/// `dst_base`. A staged kernel (the staged plan) reads block entries and a geometry (see
/// `table/staged.rs`) and computes every page's two addresses: `ids`, `rings`, `bases`,
/// `strides`, `offsets`, `count`, `segments`, `ring_base`, `ring_src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelParam {
    /// Address of the launch's first source / destination / size entry (the slab's columns).
    Srcs,
    Dsts,
    Sizes,
    /// Descriptors (page kernel) or blocks (staged kernel) in the launch.
    Count,
    /// Slices per descriptor: the kernel route's from [`kernel_split`].
    Split,
    /// Added by a page kernel to every source / destination address (0 from the core).
    SrcBase,
    DstBase,
    /// Address of the launch's first block entry's GPU block id / ring offset.
    Ids,
    Rings,
    /// Address of the group geometry's first segment's GPU base / GPU stride / offset in the row
    /// (one more offset follows the last segment's: the row's end).
    Bases,
    Strides,
    Offsets,
    /// Segments (pages per block) of the geometry.
    Segments,
    /// Added to every ring offset: the step's slot's address minus the step's first offset.
    RingBase,
    /// 1 where the ring is the source of the page copies (CPU -> GPU), 0 where the GPU pages are.
    RingSrc,
}

impl std::str::FromStr for KernelParam {
    type Err = String;

    /// The names the Python layer gives (`blockswap.kernels`).
    fn from_str(s: &str) -> Result<Self, String> {
        use KernelParam::{
            Bases, Count, DstBase, Dsts, Ids, Offsets, RingBase, RingSrc, Rings, Segments, Sizes,
            Split, SrcBase, Srcs, Strides,
        };
        Ok(match s {
            "srcs" => Srcs,
            "dsts" => Dsts,
            "sizes" => Sizes,
            "count" => Count,
            "split" => Split,
            "src_base" => SrcBase,
            "dst_base" => DstBase,
            "ids" => Ids,
            "rings" => Rings,
            "bases" => Bases,
            "strides" => Strides,
            "offsets" => Offsets,
            "segments" => Segments,
            "ring_base" => RingBase,
            "ring_src" => RingSrc,
            other => {
                return Err(format!(
                    "kernel parameter {other:?} is none of srcs, dsts, sizes, count, split, \
                     src_base, dst_base (a page kernel) or ids, rings, bases, strides, offsets, \
                     count, segments, ring_base, ring_src (a staged kernel)"
                ))
            }
        })
    }
}

/// What a loaded kernel is for, by its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    /// Descriptors `(src, dst, size)`: the kernel route ([`PageKernel::Loaded`]).
    Pages,
    /// Block entries and a geometry: the staged plan ([`crate::table::StagedRequest::kernel`]).
    Staged,
}

impl KernelKind {
    /// The kind of a kernel taking `params`, or why it is none: every parameter at most once,
    /// and each kind's own all there, none of the other's.
    pub fn of(params: &[KernelParam]) -> Result<Self, String> {
        use KernelParam::{
            Bases, Count, DstBase, Dsts, Ids, Offsets, RingBase, RingSrc, Rings, Segments, Sizes,
            Split, SrcBase, Srcs, Strides,
        };
        const PAGES: &[KernelParam] = &[Srcs, Dsts, Sizes, Count];
        const STAGED: &[KernelParam] = &[
            Ids, Rings, Bases, Strides, Offsets, Count, Segments, RingBase, RingSrc,
        ];
        for (i, p) in params.iter().enumerate() {
            if params[..i].contains(p) {
                return Err(format!("kernel parameter {p:?} is named twice"));
            }
        }
        let has_all = |want: &[KernelParam]| want.iter().all(|p| params.contains(p));
        let only = |allowed: &[KernelParam]| params.iter().all(|p| allowed.contains(p));
        if has_all(PAGES) && only(&[Srcs, Dsts, Sizes, Count, Split, SrcBase, DstBase]) {
            Ok(KernelKind::Pages)
        } else if has_all(STAGED) && only(STAGED) {
            Ok(KernelKind::Staged)
        } else {
            Err(format!(
                "kernel parameters {params:?} are neither a page kernel's (srcs, dsts, sizes, \
                 count; split, src_base, dst_base optional) nor a staged kernel's (ids, rings, \
                 bases, strides, offsets, count, segments, ring_base, ring_src)"
            ))
        }
    }
}

/// A compiled copy kernel the backend launches itself with `cuLaunchKernel`, no Python and no
/// launcher between: a page kernel for the kernel route ([`PageKernel::Loaded`]), the kernel of
/// [`KernelBatch`], or a staged kernel for the staged plan (see [`KernelParam`] and
/// `blockswap.kernels`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSpec {
    /// The `CUfunction`, loaded in the device's primary context by whoever compiled it; it must
    /// stay loaded while the backend lives.
    pub function: u64,
    /// Threads per CTA, and bytes of dynamic shared memory.
    pub threads: u32,
    pub shared: u32,
    /// The kernel's leading parameters, each 8 bytes, those of one [`KernelKind`]; any parameter
    /// after them must be an 8-byte pointer the kernel ignores when null (Triton's scratch
    /// pointers with no scratch).
    pub params: Vec<KernelParam>,
    /// Descriptors a CTA copies side by side (the kernel's `ROWS`), and the most CTAs.
    pub rows: u32,
    pub ctas: u32,
    /// Bytes one row moves per step (the kernel's `BLOCK_BYTES`): what a slice of a descriptor
    /// is made of where the kernel route splits descriptors ([`kernel_split`]); 0: never.
    pub row_bytes: u32,
    /// The kernel lets the launch after it on its stream start once each of its programs is on
    /// its last work, and waits at its end for the launch before it to end (programmatic
    /// dependent launch, compute capability 9.0 on): the core then launches a direct transfer's
    /// launches after its first with programmatic stream serialization, one launch's start
    /// overlapping the tail of the one before. Each launch boundary of 8 MiB launches cost
    /// CPU -> GPU 2.5-4 points of the link without it (H100, 2026-11-27,
    /// `python benches/probe_direct.py`, docs/benchmarks.md).
    pub chained: bool,
}

impl KernelSpec {
    /// What the kernel is for, by its parameters (see [`KernelKind::of`]).
    pub fn kind(&self) -> Result<KernelKind, String> {
        KernelKind::of(&self.params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_split_follows_the_python_launchers_rule() {
        // (n, max_size, ctas, rows, row_bytes) -> split, as `blockswap.kernels.copy._plan` gives.
        let spec = |ctas, rows, row_bytes| KernelSpec {
            function: 1,
            threads: 128,
            shared: 0,
            params: Vec::new(),
            rows,
            ctas,
            row_bytes,
            chained: false,
        };
        for (n, max_size, ctas, rows, row_bytes, split) in [
            (2560, 4096, 16, 8, 4096, 1),
            (4, 262_144, 16, 1, 32768, 8),
            (3, 100_000, 32, 1, 32768, 4),
            (1, 1 << 20, 16, 1, 16384, 64),
            (100, 65536, 16, 1, 32768, 1),
        ] {
            let s = spec(ctas, rows, row_bytes);
            assert_eq!(kernel_split(&s, n, max_size), split, "{n} x {max_size}");
        }
        // Without row_bytes, or with nothing to copy: never sliced.
        assert_eq!(kernel_split(&spec(16, 1, 0), 1, 1 << 20), 1);
        assert_eq!(kernel_split(&spec(16, 1, 32768), 0, 1 << 20), 1);
    }

    #[test]
    fn a_kernel_is_a_page_or_a_staged_kernel_by_its_parameters() {
        let parse = |names: &[&str]| -> Result<KernelKind, String> {
            let params = names
                .iter()
                .map(|n| n.parse::<KernelParam>())
                .collect::<Result<Vec<_>, _>>()?;
            KernelKind::of(&params)
        };
        let pages = [
            "srcs", "dsts", "sizes", "count", "split", "src_base", "dst_base",
        ];
        assert_eq!(parse(&pages), Ok(KernelKind::Pages));
        assert_eq!(parse(&pages[..4]), Ok(KernelKind::Pages));
        let staged = [
            "ids",
            "rings",
            "bases",
            "strides",
            "offsets",
            "count",
            "segments",
            "ring_base",
            "ring_src",
        ];
        assert_eq!(parse(&staged), Ok(KernelKind::Staged));
        // A name of neither, a parameter twice, one missing, the two kinds mixed: refused by name.
        let err = parse(&["srcs", "dsts", "sizes", "cnt"]).unwrap_err();
        assert!(err.contains("\"cnt\" is none of"), "{err}");
        let err = parse(&["srcs", "dsts", "sizes", "count", "srcs"]).unwrap_err();
        assert!(err.contains("Srcs is named twice"), "{err}");
        assert!(parse(&staged[..8]).unwrap_err().contains("neither"));
        let mut mixed = staged.to_vec();
        mixed.push("split");
        assert!(parse(&mixed).unwrap_err().contains("neither"));
    }

    #[test]
    fn a_launch_plan_keeps_block_bytes_of_loads_in_flight_per_program() {
        // (n, max_ctas, block_bytes, max_size, total_bytes) -> (grid, split, rows, row_bytes)
        assert_eq!(
            launch_plan(10_000, 16, 16384, Some(65536), None),
            (16, 1, 1, 16384)
        );
        assert_eq!(
            launch_plan(10_000, 16, 16384, Some(4096), None),
            (16, 1, 4, 4096)
        );
        assert_eq!(
            launch_plan(10_000, 16, 16384, Some(16), None),
            (16, 1, 64, 256)
        );
        assert_eq!(launch_plan(10_000, 16, 16384, None, None), (16, 1, 4, 4096));
        assert_eq!(
            launch_plan(1, 16, 16384, Some(1 << 30), None),
            (16, 64, 1, 16384)
        );
        assert_eq!(launch_plan(1, 16, 16384, None, None), (16, 256, 4, 4096));
        assert_eq!(
            launch_plan(100, 16, 16384, Some(1 << 20), Some(1 << 20)),
            (16, 64, 1, 16384)
        );
        // A CTA count past any launch's (the Python launchers bound theirs) plans, not divides
        // by a product wrapped to zero.
        assert_eq!(launch_plan(1, 1 << 62, 16, Some(8), None).1, 1);
        // The core's split for a loaded kernel is the launcher's for the same rows and bytes.
        let spec = KernelSpec {
            function: 0,
            threads: 128,
            shared: 0,
            params: vec![],
            rows: 1,
            ctas: 16,
            row_bytes: 16384,
            chained: false,
        };
        assert_eq!(
            kernel_split(&spec, 1, 1 << 30),
            launch_plan(1, 16, 16384, Some(1 << 30), None).1
        );
    }
}
