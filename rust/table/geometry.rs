//! What a table's geometry proves about its pages, once, at registration: whether two distinct
//! (segment, block) pages can share a byte (if not, unique destination ids prove a transfer's
//! destinations disjoint without sorting them), which segments share bytes in every block, and
//! whether two tables' pages can share a byte whatever the ids.

use super::BlockTable;

impl BlockTable {
    /// Whether the two tables' spans (`[lowest byte, end)` over every segment) share a byte.
    #[must_use]
    pub fn spans_overlap(&self, other: &BlockTable) -> bool {
        let ((a, b), (c, d)) = (self.span, other.span);
        a < d && c < b
    }

    /// Whether no page of this table shares a byte with a page of `other`, whatever the blocks:
    /// their spans apart, or the pages of their segments taken together disjoint by the
    /// geometry alone, as a table's own pages are proven (at the larger block count, which only
    /// adds pages). Two KV-cache groups' tables whose layers alternate in
    /// memory overlap by span and are apart by this rule; a transfer into both then needs no
    /// check of what it writes across them.
    #[must_use]
    pub fn apart_from(&self, other: &BlockTable) -> bool {
        if !self.spans_overlap(other) {
            return true;
        }
        let cat = |x: &[u64], y: &[u64]| [x, y].concat();
        let spans: Vec<(u64, u64)> = [self, other]
            .iter()
            .flat_map(|t| segment_spans(&t.bases, &t.strides, &t.nbytes, t.num_blocks))
            .collect();
        pages_disjoint(
            &spans,
            &cat(&self.bases, &other.bases),
            &cat(&self.strides, &other.strides),
            &cat(&self.nbytes, &other.nbytes),
            self.num_blocks.max(other.num_blocks),
        )
    }
}

/// Whether no two distinct pages of the segments `(bases, strides, nbytes)` over `num_blocks`
/// blocks share a byte (the rule a table's registration proves, for segments not yet
/// registered: one tensor's, as the Python layer reads them from its shape and strides).
#[must_use]
pub fn segments_disjoint(bases: &[u64], strides: &[u64], nbytes: &[u64], num_blocks: u64) -> bool {
    if bases.is_empty() {
        return true;
    }
    let spans = segment_spans(bases, strides, nbytes, num_blocks);
    pages_disjoint(&spans, bases, strides, nbytes, num_blocks.max(1))
}

/// Each segment's `(first byte, length)` over all `num_blocks` blocks (over block 0 where there
/// are none): `bases[s]` to the end of its last block's page.
#[must_use]
pub fn segment_spans(
    bases: &[u64],
    strides: &[u64],
    nbytes: &[u64],
    num_blocks: u64,
) -> Vec<(u64, u64)> {
    let last = num_blocks.saturating_sub(1);
    (0..bases.len())
        .map(|s| {
            (
                bases[s],
                last.saturating_mul(strides[s]).saturating_add(nbytes[s]),
            )
        })
        .collect()
}

/// The byte ranges `(start, length)` that `ranges` fall in: sorted by start, overlapping ranges
/// merged, ranges that only touch kept apart (they may be separate allocations, registered one
/// by one).
#[must_use]
pub fn merged_spans(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    let mut end = 0u64;
    for (start, len) in ranges {
        let reach = start.saturating_add(len);
        match out.last_mut() {
            Some(last) if start < end => {
                end = end.max(reach);
                last.1 = end - last.0;
            }
            _ => {
                out.push((start, len));
                end = reach;
            }
        }
    }
    out
}

/// Whether no two distinct (segment, block) pages share a byte, by the geometry alone. `spans`:
/// each segment's `(first byte, length)` over all its blocks. The segments fall into clusters
/// whose spans overlap (a tensor's segments), clusters lying apart from each other; the pages are
/// disjoint where every cluster of more than one segment [`interleaved`]. This covers segments
/// apart (a cluster each), a block-major cache (one cluster) and several tensors each holding
/// several segments in every block (vLLM's canonical fragments: a cluster per layer tensor).
pub(super) fn pages_disjoint(
    spans: &[(u64, u64)],
    bases: &[u64],
    strides: &[u64],
    nbytes: &[u64],
    num_blocks: u64,
) -> bool {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_unstable_by_key(|&s| spans[s]);
    let mut cluster: Vec<usize> = Vec::new();
    let mut reach = 0u64;
    let mut rest = order.into_iter().peekable();
    while let Some(s) = rest.next() {
        if cluster.is_empty() {
            reach = spans[s].0;
        }
        cluster.push(s);
        reach = reach.max(spans[s].0 + spans[s].1);
        // The cluster ends where the next span starts at or past the furthest end so far.
        if rest.peek().is_none_or(|&n| spans[n].0 >= reach) {
            if cluster.len() > 1 {
                let pick = |v: &[u64]| cluster.iter().map(|&i| v[i]).collect::<Vec<u64>>();
                if !interleaved(&pick(bases), &pick(strides), &pick(nbytes), num_blocks) {
                    return false;
                }
            }
            cluster.clear();
        }
    }
    true
}

/// Whether the segments interleave without sharing a byte: one block stride `T` for all, and
/// every page inside one period `[b0, b0 + T)` from the lowest base `b0`, the pages' offsets in it
/// pairwise disjoint. Page `(s, b)` is then `[b0 + b * T + off_s, + nbytes_s)`, so distinct pairs
/// never share a byte: how a block-major cache (a block's pages in one chunk) is laid out.
fn interleaved(bases: &[u64], strides: &[u64], nbytes: &[u64], num_blocks: u64) -> bool {
    let t = strides[0];
    if num_blocks > 1 && strides.iter().any(|&s| s != t) {
        return false;
    }
    let b0 = *bases.iter().min().expect("at least one segment");
    let mut offs: Vec<(u64, u64)> = bases
        .iter()
        .zip(nbytes)
        .map(|(&b, &z)| (b - b0, z))
        .collect();
    offs.sort_unstable();
    let in_period = num_blocks == 1 || offs.iter().all(|&(o, z)| o.saturating_add(z) <= t);
    in_period && offs.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0)
}

/// Two segments (the lower first) whose pages of one block share bytes in every block: one
/// block stride, and page ranges that overlap at block 0, as layers that view one tensor have.
/// `None` where there are none; pages that overlap for some blocks only are found per transfer
/// (see [`check_written`]).
pub(super) fn shared_segments(
    bases: &[u64],
    strides: &[u64],
    nbytes: &[u64],
    num_blocks: u64,
) -> Option<(usize, usize)> {
    // With one block, every page is at block 0: the strides do not matter.
    let stride = |s: usize| if num_blocks > 1 { strides[s] } else { 0 };
    let mut order: Vec<usize> = (0..bases.len()).collect();
    order.sort_unstable_by_key(|&s| (stride(s), bases[s], s));
    // Among segments of one stride in order of their bases, one overlaps an earlier one exactly
    // when it starts before the furthest end so far (`reach`, and the segment that has it).
    let mut reach: Option<(u64, u64, usize)> = None;
    for &s in &order {
        let end = bases[s] + nbytes[s];
        match reach {
            Some((t, far, r)) if t == stride(s) && bases[s] < far => {
                return Some((r.min(s), r.max(s)))
            }
            Some((t, far, _)) if t == stride(s) && far >= end => {}
            _ => reach = Some((stride(s), end, s)),
        }
    }
    None
}
