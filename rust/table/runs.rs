//! The block plan: a table pair's segments cut into runs that one 2-D copy per block moves
//! ([`block_runs`]), the copies written into a slab ([`expand_runs_into`]), and the rows those
//! copies cover ([`for_each_row`]) for a backend without 2-D copies, and where a cache takes
//! the block route by default ([`block_route`]).

use super::{check_ids, check_written, BlockTable, Overlap, Pair, TableError};
use crate::descriptor::{Columns, Prepared, Scratch};

/// The largest row pitch of a 2-D copy: `CU_DEVICE_ATTRIBUTE_MAX_PITCH` is 2^31 - 1 on the GPUs
/// this runs on, and the host backend keeps to the same plans.
pub const MAX_PITCH: u64 = (1 << 31) - 1;

/// The block route is taken where a block moves in at most this many 2-D copies: each copy costs
/// the host ~3 us and runs a few rows, and with 10-40 copies per block (layer tensors allocated
/// one by one, a run per driver allocation) it fell to 19-74 % of the link where the page route
/// held 81-91 % (H100, 2026-11-23, `python benches/bench_blocks.py`, docs/benchmarks.md).
pub const BLOCK_MAX_COPIES: usize = 2;

/// ...and where pages are at least this large. Below it, layers of one allocation take the
/// staged plan like separately allocated ones: head to head on the H100 (2026-11-24, `python
/// benches/bench_blocks.py --pages 16,32,64 --handlers blocks,staged --reps 15`, GPU->CPU /
/// CPU->GPU isolated), one 2-D copy per block reached 91 / 87 % at 16 KiB and 95 / 76 % at
/// 32 KiB where the staged plan reached 95 / 92 % and 96 / 97 %; at 64 KiB the block plan leads
/// (98 / 98 % against 97 / 94 %) and uses no SM at all. Earlier runs agree (staged 94-96 % at
/// 16 KiB against 81-94 %, docs/benchmarks.md). At 4 KiB one 2-D copy per block reached 69-75 %.
pub const BLOCK_MIN_PAGE: u64 = 64 * 1024;

/// Whether a cache of one or more KV-cache groups takes the block route in one direction:
/// `pairs` holds each group's (source, destination) tables as the direction moves them, the GPU
/// side the source where `gpu_src`. `Ok(why)` where every group has a block plan that saves a
/// copy (fewer runs than segments) and, unless `insist` (`path="blocks"`), one of at most
/// [`BLOCK_MAX_COPIES`] runs of pages of at least [`BLOCK_MIN_PAGE`], and no two groups' tables
/// share memory on either side (their 2-D copies could not be proven apart); `Err(why not)`
/// otherwise.
pub fn block_route(
    pairs: &[(&BlockTable, &BlockTable)],
    gpu_src: bool,
    insist: bool,
) -> Result<String, String> {
    if pairs.is_empty() {
        return Err("no KV-cache group".into());
    }
    let mut reasons = Vec::with_capacity(pairs.len());
    for (g, (src, dst)) in pairs.iter().enumerate() {
        let group = if pairs.len() > 1 {
            format!("group {g}: ")
        } else {
            String::new()
        };
        let runs = block_runs(src, dst)
            .ok_or_else(|| format!("{group}the two sides' pages differ: no block plan"))?;
        if runs.len() >= src.segments() {
            return Err(format!(
                "{group}{} 2-D copies per block save none of its {} pages",
                runs.len(),
                src.segments()
            ));
        }
        let (copies, page) = (runs.len(), runs[0].width);
        if !insist && copies > BLOCK_MAX_COPIES {
            return Err(format!(
                "{group}{copies} 2-D copies per block, more than {BLOCK_MAX_COPIES}"
            ));
        }
        if !insist && page < BLOCK_MIN_PAGE {
            return Err(format!(
                "{group}pages of {page} B, below {BLOCK_MIN_PAGE} B: the staged plan or the \
                 page route moves them faster"
            ));
        }
        let rows: Vec<String> = runs.iter().map(|r| r.rows.to_string()).collect();
        let mut pitch: Vec<u64> = runs
            .iter()
            .map(|r| if gpu_src { r.src_pitch } else { r.dst_pitch })
            .collect();
        pitch.sort_unstable();
        pitch.dedup();
        let pitch: Vec<String> = pitch.iter().map(u64::to_string).collect();
        reasons.push(format!(
            "{group}blocks: {copies} 2-D cop{} per block ({} pages of {page} B, GPU pitch {} B), \
             copy engines only",
            if copies == 1 { "y" } else { "ies" },
            rows.join("+"),
            pitch.join(", ")
        ));
    }
    for (side, name) in [(0, "source"), (1, "destination")] {
        let mut spans: Vec<(u64, u64)> = pairs
            .iter()
            .map(|p| if side == 0 { p.0.span } else { p.1.span })
            .collect();
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(format!(
                "two groups' {name} tables share memory: their 2-D copies could not be proven \
                 apart"
            ));
        }
    }
    Ok(reasons.join("; "))
}

/// Consecutive segments of a table pair that one 2-D copy per block moves: `rows` pages of
/// `width` bytes, segment `first + r` of block `id` at `base(first) + id * stride + r * pitch` on
/// each side (the pitches may differ between the sides, the block strides between the segments
/// may not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub first: usize,
    pub rows: u64,
    pub width: u64,
    pub src_pitch: u64,
    pub dst_pitch: u64,
}

/// The block plan of a table pair: its segments cut, in table order, into [`Run`]s as long as
/// both sides allow. `None` where it cannot be used: the tables differ in pages. Where the
/// destination's segments may share bytes, each transfer's rows are checked as pages are
/// (see [`expand_runs_into`]).
///
/// A block then moves as `runs.len()` copies instead of `segments` descriptors: a block-major
/// CPU cache (every page of a block in one chunk) against layer tensors at one pitch is one run.
/// A run stays inside one driver allocation per side (see [`BlockTable::in_allocations`]), and
/// no block's run crosses a boundary between two registered regions on either side.
#[must_use]
pub fn block_runs(src: &BlockTable, dst: &BlockTable) -> Option<Vec<Run>> {
    if src.nbytes != dst.nbytes {
        return None;
    }
    let pitch = |t: &BlockTable, s: usize| {
        t.bases[s]
            .checked_sub(t.bases[s - 1])
            .filter(|&p| p >= t.nbytes[s] && p <= MAX_PITCH)
    };
    let mut runs: Vec<Run> = Vec::new();
    for s in 0..src.segments() {
        if let Some(r) = runs.last_mut() {
            let f = r.first;
            let same = src.nbytes[s] == r.width
                && src.strides[s] == src.strides[f]
                && dst.strides[s] == dst.strides[f]
                && src.allocations[s] == src.allocations[f]
                && dst.allocations[s] == dst.allocations[f];
            let (sp, dp) = (pitch(src, s), pitch(dst, s));
            let continues = match (sp, dp) {
                (Some(_), Some(_)) if same && r.rows == 1 => true,
                (Some(sp), Some(dp)) => same && sp == r.src_pitch && dp == r.dst_pitch,
                _ => false,
            } && src.run_in_one_region(f, s)
                && dst.run_in_one_region(f, s);
            if continues {
                if let (1, Some(sp), Some(dp)) = (r.rows, sp, dp) {
                    r.src_pitch = sp;
                    r.dst_pitch = dp;
                }
                r.rows += 1;
                continue;
            }
        }
        runs.push(Run {
            first: s,
            rows: 1,
            width: src.nbytes[s],
            src_pitch: src.nbytes[s],
            dst_pitch: src.nbytes[s],
        });
    }
    Some(runs)
}

/// Entries of a slab one 2-D copy takes (see [`expand_runs_into`]).
pub const PITCHED_ENTRIES: usize = 2;

/// Checks block ids as [`super::expand_into`] does and writes one 2-D copy per (block pair, run),
/// block by block, into `out`: copy `k` takes entries `2k` and `2k + 1`, `(src, dst, width)`
/// then `(src pitch, dst pitch, rows)`. A run whose rows are contiguous on both sides is written
/// as one row of `rows * width` bytes. `out` must have room for `2 * runs * ids` entries.
///
/// The copies write exactly the bytes [`super::expand_into`]'s descriptors write, and are held
/// to the same rule: disjoint where the destination table is (distinct ids, segments that share
/// no byte), else their rows checked.
pub fn expand_runs_into(
    pair: Pair<'_>,
    runs: &[Run],
    out: Columns<'_>,
    scratch: &mut Scratch,
) -> Result<Prepared, TableError> {
    check_ids(pair, scratch)?;
    let Pair {
        src,
        src_ids,
        dst,
        dst_ids,
    } = pair;
    let n = src_ids.len();
    assert!(
        out.src.len() >= PITCHED_ENTRIES * runs.len() * n,
        "slab too small"
    );
    let mut w = 0usize;
    let mut bytes = 0u64;
    let mut max_size = 0u64;
    let mut bitmask = 0u64;
    for (&si, &di) in src_ids.iter().zip(dst_ids) {
        for r in runs {
            let f = r.first;
            // In range by `check_ids`; the spans were proven not to overflow at registration.
            let (sa, da) = (
                src.bases[f] + si * src.strides[f],
                dst.bases[f] + di * dst.strides[f],
            );
            let (width, rows, sp, dp) = if r.src_pitch == r.width && r.dst_pitch == r.width {
                (r.width * r.rows, 1, r.width * r.rows, r.width * r.rows)
            } else {
                (r.width, r.rows, r.src_pitch, r.dst_pitch)
            };
            out.src[w] = sa;
            out.dst[w] = da;
            out.size[w] = width;
            out.src[w + 1] = sp;
            out.dst[w + 1] = dp;
            out.size[w + 1] = rows;
            w += PITCHED_ENTRIES;
            bitmask |= sa | da | width | if rows > 1 { sp | dp } else { 0 };
            max_size = max_size.max(width);
            bytes += width * rows;
        }
    }
    if !dst.disjoint {
        let (addrs, sizes) = written_rows(&out.src[..w], &out.dst[..w], &out.size[..w]);
        check_written(&dst.name, &addrs, &sizes, Overlap::Pages, scratch)?;
    }
    let alignment = 1u64 << (bitmask | max_size).trailing_zeros().min(4);
    Ok(Prepared {
        len: w,
        bytes,
        max_size,
        alignment,
        staged_rows: 0,
        staged_blocks_at: 0,
        staged_blocks: 0,
    })
}

/// Calls `copy(src, dst, bytes)` for every row of the 2-D copies in `len` slab entries written by
/// [`expand_runs_into`]: what a backend without 2-D copies does with them, and what tests compare.
pub fn for_each_row(
    src: &[u64],
    dst: &[u64],
    size: &[u64],
    mut copy: impl FnMut(usize, u64, u64, u64),
) {
    for k in 0..src.len() / PITCHED_ENTRIES {
        let e = PITCHED_ENTRIES * k;
        let (sa, da, width) = (src[e], dst[e], size[e]);
        let (sp, dp, rows) = (src[e + 1], dst[e + 1], size[e + 1]);
        for r in 0..rows {
            copy(k, sa + r * sp, da + r * dp, width);
        }
    }
}

/// The destination rows of the 2-D copies in slab entries written by [`expand_runs_into`], as
/// `(addresses, bytes)`: what they write.
pub(super) fn written_rows(src: &[u64], dst: &[u64], size: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let mut rows = (Vec::new(), Vec::new());
    for_each_row(src, dst, size, |_, _, d, bytes| {
        rows.0.push(d);
        rows.1.push(bytes);
    });
    rows
}
