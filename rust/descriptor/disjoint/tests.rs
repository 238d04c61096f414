//! `check_disjoint` against a brute-force reference, over inputs shaped to land in each of its
//! strategies, with one scratch reused across calls the way an engine reuses it.
use super::*;
use proptest::prelude::*;

/// The first overlapping pair by address, by comparing every pair.
fn reference(dst: &[u64], size: &[u64]) -> bool {
    (0..dst.len()).any(|i| (0..i).any(|j| dst[i] < dst[j] + size[j] && dst[j] < dst[i] + size[i]))
}

fn agree(dst: &[u64], size: &[u64], scratch: &mut Scratch) -> Result<(), TestCaseError> {
    match check_disjoint(dst, size, scratch) {
        Ok(()) => prop_assert!(!reference(dst, size), "accepted an overlap"),
        Err(DescriptorError::OverlappingDestinations { first, second }) => {
            prop_assert!(reference(dst, size), "refused disjoint ranges");
            // The pair named is one that overlaps, in address order, and is in the input.
            prop_assert!(first.0 <= second.0 && second.0 < first.0 + first.1);
            let has = |r: (u64, u64)| dst.iter().zip(size).any(|(&d, &z)| (d, z) == r);
            prop_assert!(has(first) && has(second));
        }
        Err(e) => prop_assert!(false, "unexpected error {e:?}"),
    }
    Ok(())
}

/// [`agree`] for each batch in turn, with one scratch: what one batch leaves in it must not
/// change the answer for the next.
fn agree_in_turn(batches: &[(&[u64], &[u64])]) -> Result<(), TestCaseError> {
    let mut scratch = Scratch::default();
    batches
        .iter()
        .try_for_each(|&(dst, size)| agree(dst, size, &mut scratch))
}

/// Pages of a pool: slots of `page` bytes out of `4 * n`, a few nudged off the grid or
/// shortened, so some batches overlap. The bucket strategy's case.
fn slotted() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
    (1u64..5000, 2usize..200).prop_flat_map(|(page, n)| {
        let slot = (0..4 * n as u64, 0u64..8, 0u64..4);
        proptest::collection::vec(slot, n).prop_map(move |v| pages(page, v))
    })
}

/// Ranges of `(slot, nudge, cut)`: page `slot`, moved half a page off the grid where `nudge`
/// is 0 and a third shorter where `cut` is 0.
fn pages(page: u64, slots: Vec<(u64, u64, u64)>) -> (Vec<u64>, Vec<u64>) {
    slots
        .into_iter()
        .map(|(s, nudge, cut)| {
            let d = 0x1000_0000 + s * page + if nudge == 0 { page / 2 } else { 0 };
            (d, if cut == 0 { page - page / 3 } else { page })
        })
        .unzip()
}

/// Pages spread over a pool 64 or 4,096 times the batch, half of them possibly in a cluster
/// of neighbouring slots at its start (many keys to a bucket), a few nudged off the grid or
/// shortened: the packed keys' counting sort, sparse buckets and crowded ones.
fn sparse() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
    let spread = prop_oneof![Just(64u64), Just(4096)];
    (1u64..5000, 2usize..200, spread).prop_flat_map(|(page, n, spread)| {
        let wide = 0..spread * n as u64;
        let slot = (prop_oneof![wide, 0..n as u64 / 2 + 1], 0u64..16, 0u64..8);
        proptest::collection::vec(slot, n).prop_map(move |v| pages(page, v))
    })
}

/// Pages all of one size (odd, even, powers of two) on the slots of a pool 2, 64 or 600
/// times the batch, from a base off any grid, a few of them moved off the slots by a byte or
/// half a page; random slots, so some batches put two pages on one. The pages strategy.
fn equal_pages() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
    let page = prop_oneof![1u64..5000, (0u32..22).prop_map(|k| 1u64 << k)];
    let spread = prop_oneof![Just(2u64), Just(64), Just(600)];
    (page, 2usize..200, spread, 0u64..1 << 20).prop_flat_map(|(page, n, spread, base)| {
        let slot = (
            0..spread * n as u64,
            prop_oneof![30 => Just(0u64), 1 => Just(1), 1 => Just(page / 2)],
        );
        proptest::collection::vec(slot, n).prop_map(move |v| {
            let dst = v
                .iter()
                .map(|&(s, off)| 0x1000_0000 + base + s * page + off)
                .collect();
            (dst, vec![page; n])
        })
    })
}

/// Ranges of mixed sizes anywhere in a small span (packed keys) or the whole space (pairs).
fn scattered() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
    let span = prop_oneof![Just(1u64 << 16), Just(1u64 << 50), Just(u64::MAX / 2)];
    (span, 2usize..100).prop_flat_map(|(span, n)| {
        proptest::collection::vec((0..span, 1u64..1 << 14), n).prop_map(|v| v.into_iter().unzip())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 1024 }))]

    #[test]
    fn slotted_pages_agree_with_the_reference((d, z) in slotted(), (d2, z2) in slotted()) {
        agree_in_turn(&[(&d, &z), (&d2, &z2)])?;
    }

    #[test]
    fn sparse_pages_agree_with_the_reference((d, z) in sparse(), (d2, z2) in slotted()) {
        agree_in_turn(&[(&d, &z), (&d2, &z2), (&d, &z)])?;
    }

    #[test]
    fn equal_pages_agree_with_the_reference(
        (d, z) in equal_pages(), (d2, z2) in equal_pages(),
    ) {
        agree_in_turn(&[(&d, &z), (&d2, &z2), (&d, &z)])?;
    }

    #[test]
    fn scattered_ranges_agree_with_the_reference(
        (d, z) in scattered(), (d2, z2) in slotted(),
    ) {
        agree_in_turn(&[(&d, &z), (&d2, &z2)])?;
    }
}

#[test]
fn each_strategy_finds_a_late_overlap() {
    // 1,000 disjoint pages then one landing inside page 500, in shuffled order: the buckets
    // (span 4 n pages), packed keys (span 64 n pages) and pairs (span 2^45).
    for (stride, strategy) in [(4u64, "buckets"), (64, "keys"), (1 << 33, "pairs")] {
        let mut dst: Vec<u64> = (0..1000u64)
            .map(|i| (i * 7919 % 1000) * stride * 4096)
            .collect();
        let size = vec![4096u64; 1001];
        assert_eq!(
            check_disjoint(&dst[..1000], &size[..1000], &mut Scratch::default()),
            Ok(())
        );
        dst.push(500 * stride * 4096 + 4095);
        let got = check_disjoint(&dst, &size, &mut Scratch::default());
        assert_eq!(
            got,
            Err(DescriptorError::OverlappingDestinations {
                first: (500 * stride * 4096, 4096),
                second: (500 * stride * 4096 + 4095, 4096),
            }),
            "{strategy}"
        );
    }
}

#[test]
fn pages_on_one_grid_are_compared_by_their_sizes() {
    // 24 KiB pages (3 * 2^13) on every seventh slot of a pool, shuffled: disjoint.
    let page = 24 << 10;
    let mut dst: Vec<u64> = (0..1000u64).map(|i| (i * 7919 % 1000) * 7 * page).collect();
    let mut scratch = Scratch::default();
    assert_eq!(
        check_disjoint(&dst, &vec![page; 1000], &mut scratch),
        Ok(())
    );
    // A page one slot on from another is still disjoint; on the same slot it is not.
    dst.push(700 * page + page);
    assert_eq!(
        check_disjoint(&dst, &vec![page; 1001], &mut scratch),
        Ok(())
    );
    dst.push(700 * page);
    assert_eq!(
        check_disjoint(&dst, &vec![page; 1002], &mut scratch),
        Err(DescriptorError::OverlappingDestinations {
            first: (700 * page, page),
            second: (700 * page, page),
        })
    );
    // Off the grid by a third of a page: it overlaps its neighbour.
    *dst.last_mut().unwrap() = 700 * page + page / 3;
    assert!(check_disjoint(&dst, &vec![page; 1002], &mut scratch).is_err());
    // One page twice as long, on the same grid: it reaches into the next slot's page.
    let (dst, mut size) = (
        (0..64u64).map(|i| i * 4096).collect::<Vec<_>>(),
        vec![4096; 64],
    );
    size[10] = 8192;
    assert_eq!(
        check_disjoint(&dst, &size, &mut scratch),
        Err(DescriptorError::OverlappingDestinations {
            first: (10 * 4096, 8192),
            second: (11 * 4096, 4096),
        })
    );
}

#[test]
fn adjacent_pages_in_one_bucket_width_are_disjoint() {
    // Pages of 6,144 bytes: buckets are 4,096 wide, so neighbours share no bucket only by
    // luck; the check must compare ends, not buckets.
    let dst: Vec<u64> = (0..64u64).rev().map(|i| i * 6144).collect();
    assert_eq!(
        check_disjoint(&dst, &[6144; 64], &mut Scratch::default()),
        Ok(())
    );
    let mut short = dst.clone();
    short[10] += 1;
    assert!(check_disjoint(&short, &[6144; 64], &mut Scratch::default()).is_err());
}
