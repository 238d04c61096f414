//! A tensor's blocks as a table's segments: which bytes of a strided tensor (shape and strides
//! in elements, as torch gives them) are one block's pages, for a named KV-cache layout or an
//! explicit block dim. The Python layer reads shape and strides off its tensors and builds its
//! tables from what this returns; every rule about them lives here.

use super::segments_disjoint;

/// One tensor's segments: block 0's page of each (byte offsets from the tensor's data, the dims
/// before the block dim enumerated row-major), the block stride and page bytes they share, the
/// number of blocks, and the block dim (made non-negative).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSegments {
    pub offsets: Vec<u64>,
    pub block_stride: u64,
    pub nbytes: u64,
    pub num_blocks: u64,
    pub block_dim: usize,
}

/// The shape a named layout expects, or why `shape` is not one.
fn check_layout_shape(layout: &str, shape: &[u64]) -> Result<(), String> {
    let nd = shape.len();
    let (ok, expects) = match layout {
        "kv_split" => (nd >= 3 && shape[0] == 2, "[2, num_blocks, block_size, ...]"),
        "kv_fused" => (nd >= 3 && shape[1] == 2, "[num_blocks, 2, block_size, ...]"),
        "mla" => (nd == 3, "[num_blocks, block_size, head_size]"),
        "cross_layer" => (nd >= 2, "[num_blocks, num_layers, ...]"),
        _ => (true, ""),
    };
    if ok {
        Ok(())
    } else {
        Err(format!("layout '{layout}' expects {expects}"))
    }
}

/// The most segments (the product of the dims before the block dim) a tensor may make: a model's
/// layers times its heads stay far below it.
pub const MAX_TENSOR_SEGMENTS: u64 = 1 << 24;

/// The segments of a tensor of `shape` and `stride` (in elements of `item` bytes), its blocks
/// along `block_dim` (negative: from the end), in `layout`'s shape where one is named. Refused,
/// with the reason, where a page (the dims after the block dim) is not one dense run of bytes in
/// some dim order, where blocks or segments would share a byte, or where a dim is empty.
pub fn tensor_segments(
    layout: Option<&str>,
    shape: &[u64],
    stride: &[u64],
    item: u64,
    block_dim: i64,
) -> Result<TensorSegments, String> {
    if let Some(layout) = layout {
        check_layout_shape(layout, shape)?;
    }
    if stride.len() != shape.len() {
        return Err(format!(
            "{} strides for a shape of {} dims",
            stride.len(),
            shape.len()
        ));
    }
    let nd = i64::try_from(shape.len()).map_err(|_| "too many dims".to_owned())?;
    if !(-nd..nd).contains(&block_dim) {
        return Err(format!("block_dim {block_dim} out of range"));
    }
    // In range: non-negative once wrapped, and below the number of dims.
    let bd = usize::try_from(block_dim.rem_euclid(nd)).expect("in range");
    let page_elems = shape[bd + 1..]
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| {
            format!("the page (dims after block dim {bd}) holds more than 2**64 elements")
        })?;
    if page_elems == 0 {
        return Err(format!("the page (dims after block dim {bd}) is empty"));
    }
    // The page must cover one dense run of bytes, in any dim order.
    let mut dims: Vec<(u64, u64)> = (bd + 1..shape.len())
        .filter(|&d| shape[d] > 1)
        .map(|d| (stride[d], shape[d]))
        .collect();
    dims.sort_unstable();
    let mut expected = 1u64;
    for (st, sz) in dims {
        if st != expected {
            return Err(format!(
                "the page (dims {}..{}, after block dim {bd}) is not contiguous in memory, so one \
                 block's bytes are not one segment",
                bd + 1,
                shape.len() - 1
            ));
        }
        expected = expected.saturating_mul(sz);
    }
    let nbytes = page_elems.saturating_mul(item);
    let block_stride = stride[bd].saturating_mul(item);
    let num_blocks = shape[bd];
    if num_blocks > 1 && block_stride < nbytes {
        return Err(format!(
            "block stride {block_stride} B is smaller than the page ({nbytes} B), so blocks overlap"
        ));
    }
    // The dims before the block dim enumerate segments, row-major: counted, and a dim whose
    // segments share their bytes refused, before any is listed (a view expanded to 2**33 rows
    // holds no memory for them).
    let mut count = 1u64;
    for d in 0..bd {
        if shape[d] == 0 {
            return Err(format!("dim {d} (before the block dim) is empty"));
        }
        if shape[d] > 1 && stride[d] == 0 {
            return Err(format!(
                "dim {d} (before the block dim) has stride 0: its segments overlap, sharing their bytes"
            ));
        }
        count = count
            .checked_mul(shape[d])
            .filter(|&n| n <= MAX_TENSOR_SEGMENTS)
            .ok_or_else(|| {
                format!(
                    "the dims before block dim {bd} make more than {MAX_TENSOR_SEGMENTS} segments"
                )
            })?;
    }
    let mut offsets = vec![0u64];
    for d in 0..bd {
        let step = stride[d].saturating_mul(item);
        offsets = offsets
            .iter()
            .flat_map(|&o| (0..shape[d]).map(move |i| i.checked_mul(step)?.checked_add(o)))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                format!("the segments of the dims before block dim {bd} pass 2**64 bytes")
            })?;
    }
    let n = offsets.len();
    if n > 1
        && !segments_disjoint(
            &offsets,
            &vec![block_stride; n],
            &vec![nbytes; n],
            num_blocks,
        )
    {
        return Err(format!(
            "the segments of the dims before block dim {bd} overlap each other or other blocks"
        ));
    }
    Ok(TensorSegments {
        offsets,
        block_stride,
        nbytes,
        num_blocks,
        block_dim: bd,
    })
}

/// A CPU tensor laid out like a GPU tensor (a mirror): the GPU tensor's `shape` with `blocks`
/// blocks along `block_dim`, and dense strides (in elements) in the GPU tensor's dim order in
/// memory (by its `stride`, larger outermost, ties in dim order), so page bytes match one to one
/// and no padding is kept; and the elements of one row of its memory: a page where every dim up
/// to the block dim steps over whole pages (rows of whole pages can be pinned in pieces), else
/// the whole tensor (at least one element).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mirror {
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
    pub row_elems: u64,
}

/// The mirror of a tensor of `shape` and `stride` (see [`Mirror`]); `block_dim` in range.
#[must_use]
pub fn mirror(shape: &[u64], stride: &[u64], block_dim: usize, blocks: u64) -> Mirror {
    let mut shape = shape.to_vec();
    shape[block_dim] = blocks;
    let mut order: Vec<usize> = (0..shape.len()).collect();
    order.sort_by_key(|&k| (std::cmp::Reverse(stride[k]), k));
    let mut strides = vec![0; shape.len()];
    let mut acc = 1u64;
    for &k in order.iter().rev() {
        strides[k] = acc;
        acc = acc.saturating_mul(shape[k].max(1));
    }
    let numel: u64 = shape.iter().product();
    let page: u64 = shape[block_dim + 1..].iter().product();
    let whole_pages = (0..=block_dim)
        .filter(|&d| shape[d] > 1)
        .all(|d| strides[d].is_multiple_of(page.max(1)));
    let row_elems = if page > 0 && whole_pages {
        page
    } else {
        numel.max(1)
    };
    Mirror {
        shape,
        strides,
        row_elems,
    }
}

/// Views of one KV-cache group's block-major CPU cache: one `(blocks, segments, page)` array of
/// elements in which every page of a sub-block (each tensor's segments in turn, the dims before
/// each block dim row-major) lies in one chunk. Each of `tensors` (its mirror's shape and strides
/// and its block dim) gets strides that keep its page dims as the mirror has them, step the block
/// dim over a whole chunk and the dims before it over pages, and the offset of its first
/// segment.
///
/// # Errors
/// The index of the first tensor whose pages differ in size from the first's: they cannot share
/// one cache.
pub fn block_major_views(tensors: &[(Vec<u64>, Vec<u64>, usize)]) -> Result<BlockMajor, usize> {
    let mut page = None;
    let mut firsts = Vec::with_capacity(tensors.len());
    let mut segments = 0u64;
    for (i, (shape, _, bd)) in tensors.iter().enumerate() {
        let pe: u64 = shape[bd + 1..].iter().product();
        if *page.get_or_insert(pe) != pe {
            return Err(i);
        }
        firsts.push(segments);
        segments += shape[..*bd].iter().product::<u64>();
    }
    let page = page.unwrap_or(0);
    let views = tensors
        .iter()
        .zip(firsts)
        .map(|((shape, strides, bd), first)| {
            let mut st = strides.clone();
            st[*bd] = segments * page;
            let mut acc = page;
            for d in (0..*bd).rev() {
                st[d] = acc;
                acc *= shape[d];
            }
            (st, first * page)
        })
        .collect();
    Ok(BlockMajor {
        segments,
        page_elems: page,
        views,
    })
}

/// A block-major cache's geometry ([`block_major_views`]): the segments of a sub-block, the
/// elements of a page, and each tensor's view as `(strides, offset)` in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMajor {
    pub segments: u64,
    pub page_elems: u64,
    pub views: Vec<(Vec<u64>, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_split_gives_a_k_and_a_v_segment_per_block() {
        // [2, blocks=4, block_size=16, heads=2, head_dim=8] in f16, dense.
        let shape = [2, 4, 16, 2, 8];
        let stride = [4 * 256, 256, 16, 8, 1];
        let s = tensor_segments(Some("kv_split"), &shape, &stride, 2, 1).unwrap();
        assert_eq!(s.offsets, vec![0, 2048]);
        assert_eq!(
            (s.block_stride, s.nbytes, s.num_blocks, s.block_dim),
            (512, 512, 4, 1)
        );
    }

    #[test]
    fn layouts_dims_and_overlaps_are_refused_with_the_reason() {
        let why = |l, shape: &[u64], stride: &[u64], bd| {
            tensor_segments(l, shape, stride, 2, bd).unwrap_err()
        };
        assert!(why(Some("kv_split"), &[3, 4, 16], &[64, 16, 1], 1).contains("expects [2,"));
        assert!(why(Some("mla"), &[4, 16], &[16, 1], 0).contains("expects [num_blocks,"));
        assert!(why(None, &[4, 16], &[16, 1], 2).contains("block_dim 2 out of range"));
        assert!(why(None, &[4, 0], &[16, 1], 0).contains("is empty"));
        // A page whose dims step over gaps, blocks closer than a page, K and V interleaved
        // into each other's bytes.
        assert!(why(None, &[4, 2, 8], &[32, 16, 1], 0).contains("not contiguous"));
        assert!(why(None, &[4, 16], &[8, 1], 0).contains("blocks overlap"));
        assert!(why(None, &[2, 4, 16], &[8, 32, 1], 1).contains("overlap each other"));
        // Views expanded (stride 0) or as_strided into more segments than any model makes, and
        // a page or offsets past 2**64, refused before a segment is listed.
        assert!(why(None, &[1 << 33, 2, 16], &[0, 16, 1], 1).contains("has stride 0"));
        assert!(why(None, &[1 << 30, 1 << 30, 2, 1], &[1, 1 << 30, 1, 1], 2)
            .contains("more than 16777216 segments"));
        assert!(why(None, &[2, 1 << 40, 1 << 40], &[1, 1, 1], 0).contains("more than 2**64"));
        assert!(why(None, &[4, 2, 1], &[1 << 62, 1, 1], 1).contains("pass 2**64 bytes"));
        // A negative block dim counts from the end; padding between blocks is fine.
        let s = tensor_segments(None, &[4, 16], &[32, 1], 2, -2).unwrap();
        assert_eq!((s.block_stride, s.nbytes, s.block_dim), (64, 32, 0));
    }

    #[test]
    fn a_mirror_keeps_the_dim_order_and_pins_in_pages() {
        // kv_split [2, blocks=4, 16, 2, 8] with padding between blocks (stride 300 > 256).
        let m = mirror(&[2, 4, 16, 2, 8], &[4 * 300, 300, 16, 8, 1], 1, 10);
        assert_eq!(m.shape, vec![2, 10, 16, 2, 8]);
        assert_eq!(m.strides, vec![2560, 256, 16, 8, 1]);
        assert_eq!(m.row_elems, 256);
        // Blocks outermost in memory though dim 1: the order follows the strides.
        let m = mirror(&[2, 4, 8], &[8, 16, 1], 1, 3);
        assert_eq!(m.strides, vec![8, 16, 1]);
        assert_eq!(m.row_elems, 8);
        // A dim before the block dim stepping inside a page: one row of the whole tensor.
        let m = mirror(&[4, 2, 8], &[2, 8 * 4 * 2, 1], 0, 5);
        assert_eq!(m.row_elems, 5 * 2 * 8);
    }

    #[test]
    fn block_major_views_step_a_chunk_per_block() {
        // Two kv_split layers [2, 6, 4, 8] (mirror strides): 2 segments each, pages of 32.
        let t = (vec![2, 6, 4, 8], vec![6 * 32, 32, 8, 1], 1);
        let b = block_major_views(&[t.clone(), t]).unwrap();
        assert_eq!((b.segments, b.page_elems), (4, 32));
        assert_eq!(b.views[0], (vec![32, 128, 8, 1], 0));
        assert_eq!(b.views[1], (vec![32, 128, 8, 1], 64));
        let mla = (vec![6, 4, 16], vec![64, 16, 1], 0);
        let why = block_major_views(&[(vec![2, 6, 4, 8], vec![192, 32, 8, 1], 1), mla]);
        assert_eq!(why.unwrap_err(), 1);
    }
}
