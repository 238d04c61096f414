use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn regions() -> RegionTable {
    let mut t = RegionTable::default();
    t.insert(0x100000, 0x100000, MemoryKind::Device).unwrap();
    t.insert(0x400000, 0x100000, MemoryKind::Host).unwrap();
    t
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 256 }))]

    /// Chunk ids map to the sub-blocks of expanding every chunk whole and keeping `blocks`
    /// of them from `skip`; any other number of chunk ids is refused.
    #[test]
    fn chunk_blocks_match_the_reference(
        unit in 1u64..6,
        chunks in proptest::collection::vec(0u64..8, 0..6),
        skip_seed in 0u64..64,
        cut in 0usize..6,
    ) {
        let t = BlockTable::new(vec![0x400000], vec![64], vec![64], 8 * unit, MemoryKind::Host,
            &regions()).unwrap().named("CPU", unit);
        let all: Vec<u64> = chunks.iter().flat_map(|&c| c * unit..c * unit + unit).collect();
        let skip = skip_seed % unit;
        // Every block count the chunks can hold from `skip`, and one too many or too few.
        let blocks = (all.len() as u64).saturating_sub(skip).saturating_sub(cut as u64) as usize;
        let mut out = Vec::new();
        let got = map_chunks(["CPU", "GPU"], t.unit, t.num_blocks / t.unit, &chunks, blocks, skip, &mut out);
        let need = if blocks == 0 { 0 } else { (skip as usize + blocks).div_ceil(unit as usize) };
        if need == chunks.len() {
            prop_assert!(got.is_ok());
            let want = if blocks == 0 { &[][..] } else { &all[skip as usize..skip as usize + blocks] };
            prop_assert_eq!(&out[..], want);
        } else {
            let is_count_error = matches!(got, Err(TableError::ChunkCount { .. }));
            prop_assert!(is_count_error);
        }
    }

    /// A table judged disjoint (spans apart, or pages interleaved inside one block stride, cluster
    /// by cluster of overlapping spans)
    /// has no two (segment, block) pages sharing a byte: the uniqueness of destination ids
    /// alone then proves a transfer's destinations disjoint.
    #[test]
    fn disjoint_tables_have_disjoint_pages(
        segs in prop::collection::vec((0u64..96, 1u64..40, 0u64..3, 0u64..3), 1..7),
        stride in 1u64..120,
        nb in 1u64..6,
    ) {
        // Segments around one of three places (tensors) 512 or 1,024 bytes apart: their spans
        // may lie apart, touch or overlap, so tables fall into one to three clusters.
        let bases: Vec<u64> = segs
            .iter()
            .map(|s| 0x100000 + s.3 * (512 + 512 * (s.2 % 2)) + s.0)
            .collect();
        let nbytes: Vec<u64> = segs.iter().map(|s| s.1).collect();
        let strides: Vec<u64> = segs.iter().map(|s| stride + s.2 * (s.2 % 2)).collect();
        let Ok(t) = BlockTable::new(bases, strides, nbytes, nb, MemoryKind::Device, &regions())
        else {
            return Ok(());
        };
        let mut pages: Vec<(u64, u64)> = (0..t.segments())
            .flat_map(|s| (0..nb).map(move |b| (s, b)))
            .map(|(s, b)| (t.bases[s] + b * t.strides[s], t.nbytes[s]))
            .collect();
        pages.sort_unstable();
        let apart = pages.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0);
        prop_assert!(!t.disjoint || apart, "{:?} judged disjoint", t);
    }

    /// Two tables judged apart share no byte between any page of one and any page of the other,
    /// whatever the blocks (what lets a transfer into both skip the check across them).
    #[test]
    fn tables_judged_apart_share_no_byte(
        a in prop::collection::vec((0u64..96, 1u64..40, 0u64..3), 1..4),
        b in prop::collection::vec((0u64..96, 1u64..40, 0u64..3), 1..4),
        stride in 1u64..120,
        nb in (1u64..6, 1u64..6),
    ) {
        let make = |segs: &[(u64, u64, u64)], nb: u64| {
            BlockTable::new(
                segs.iter().map(|s| 0x100000 + s.2 * 768 + s.0).collect(),
                vec![stride; segs.len()],
                segs.iter().map(|s| s.1).collect(),
                nb,
                MemoryKind::Device,
                &regions(),
            )
        };
        let (Ok(x), Ok(y)) = (make(&a, nb.0), make(&b, nb.1)) else {
            return Ok(());
        };
        let pages = |t: &BlockTable| -> Vec<(u64, u64)> {
            (0..t.segments())
                .flat_map(|s| (0..t.num_blocks).map(move |k| (s, k)))
                .map(|(s, k)| (t.bases[s] + k * t.strides[s], t.nbytes[s]))
                .collect()
        };
        let meet = pages(&x).iter().any(|&(p, z)| {
            pages(&y).iter().any(|&(q, w)| p < q + w && q < p + z)
        });
        prop_assert!(!x.apart_from(&y) || !meet, "{:?} and {:?} judged apart", x, y);
        prop_assert_eq!(x.apart_from(&y), y.apart_from(&x));
    }

    /// Whatever the ids (runs of consecutive blocks included), the expanded and coalesced
    /// descriptors move exactly the bytes of the naive per-(segment, block) expansion.
    #[test]
    fn expansion_is_the_naive_copy(
        pad in 0u64..3,
        page in 1u64..5,
        segs in 1usize..4,
        start in 0u64..8,
        runs in prop::collection::vec((0u64..48, 1u64..5), 1..6),
    ) {
        let nb = 64u64;
        let z = page * 16;
        let stride = z + pad * 16;
        let g = BlockTable::new(
            (0..segs as u64).map(|s| 0x100000 + s * nb * stride).collect(),
            vec![stride; segs], vec![z; segs], nb, MemoryKind::Device, &regions(),
        ).unwrap();
        let h = BlockTable::new(
            (0..segs as u64).map(|s| 0x400000 + s * nb * z).collect(),
            vec![z; segs], vec![z; segs], nb, MemoryKind::Host, &regions(),
        ).unwrap();
        let mut sid = vec![];
        for (first, len) in runs {
            sid.extend((first..first + len).filter(|&b| b < nb));
        }
        let did: Vec<u64> = (0..sid.len() as u64).map(|i| (start + i) % nb).collect();
        let n = segs * sid.len();
        let (mut a, mut b, mut c) = (vec![0; n], vec![0; n], vec![0; n]);
        let p = expand_into(Pair { src: &g, src_ids: &sid, dst: &h, dst_ids: &did }, true,
            Columns { src: &mut a, dst: &mut b, size: &mut c }, &mut Scratch::default()).unwrap();
        let mut got = BTreeMap::new();
        for i in 0..p.len {
            for k in 0..c[i] { got.insert(b[i] + k, a[i] + k); }
        }
        let mut want = BTreeMap::new();
        for s in 0..segs {
            for i in 0..sid.len() {
                for k in 0..z {
                    want.insert(h.bases[s] + did[i] * z + k, g.bases[s] + sid[i] * stride + k);
                }
            }
        }
        prop_assert_eq!(got, want);
        prop_assert_eq!(p.bytes, (n as u64) * z);
    }
}
