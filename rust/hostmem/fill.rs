//! Faulting host memory in from several threads, and page-locking it piece by piece as soon as a
//! piece is in: what makes a CPU tier of tens of GiB ready in seconds.
//!
//! Measured (H200 machine, `benches/probe_pinning.py`, docs/benchmarks.md): one thread faults
//! fresh anonymous huge pages in at 5-6 GiB/s, 16 threads taking 64 MiB items at 23.6 GiB/s;
//! registering memory that is already there runs at 20-37 GiB/s. So the threads fill items of
//! [`FILL_ITEM`] bytes while the calling thread page-locks each piece once every item under its
//! end is in: the registration of one piece overlaps the filling of the next. `PinnedRows` in
//! 4 GiB pieces was ready at 27-29 GiB/s, vLLM's region (32 files in /dev/shm) at 10-11.5 GiB/s
//! against 2.2 GiB/s with vLLM's own one-thread fill.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::{AllocProgress, Pinner};
use crate::backend::BackendError;

/// The most bytes one thread faults in at a time (a work item).
pub const FILL_ITEM: u64 = 64 << 20;

/// Threads that fill by default: the host's cores, at most 16.
#[must_use]
pub fn fill_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(16)
}

/// What [`fill_and_pin`] does where the kernel cannot populate a range (`MADV_POPULATE_WRITE`,
/// Linux 5.14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Writes a zero to every OS page: only for memory nobody has written yet (a fresh private
    /// anonymous mapping, whose pages are zeros).
    TouchZero,
    /// Leaves the pages to be faulted in by their first use (the pinner faults them in).
    Skip,
}

/// Why [`fill_and_pin`] failed: the piece whose page-locking failed (every piece before it is
/// locked, none after), or `None` where filling failed (nothing is locked).
#[derive(Debug)]
pub struct FillError {
    pub piece: Option<usize>,
    pub error: BackendError,
}

/// Faults in `ranges` (`(start, bytes)`, in address order, disjoint) from `threads` threads in
/// items of at most [`FILL_ITEM`] bytes, counting `progress.faulted`; with a `pinner`, page-locks
/// `pieces` (in address order) on the calling thread, each as soon as every item that starts
/// below its end is in, counting `progress.locked`. Where the kernel cannot populate a range,
/// `fallback` says what happens instead.
///
/// # Safety
/// Every range must be mapped, writable memory that stays mapped until the call returns, and
/// every piece memory the pinner may lock (see [`Pinner::pin`]); with [`Fallback::TouchZero`] no
/// byte of the ranges may hold anything but zero.
pub unsafe fn fill_and_pin(
    ranges: &[(u64, u64)],
    pieces: &[(u64, u64)],
    pinner: Option<&dyn Pinner>,
    threads: usize,
    fallback: Fallback,
    progress: Option<&AllocProgress>,
) -> Result<(), FillError> {
    // SAFETY: the caller's contract.
    unsafe {
        fill_in_items(
            ranges, pieces, pinner, threads, fallback, progress, FILL_ITEM,
        )
    }
}

/// [`fill_and_pin`] in items of at most `item` bytes.
///
/// # Safety
/// As [`fill_and_pin`]'s.
unsafe fn fill_in_items(
    ranges: &[(u64, u64)],
    pieces: &[(u64, u64)],
    pinner: Option<&dyn Pinner>,
    threads: usize,
    fallback: Fallback,
    progress: Option<&AllocProgress>,
    item: u64,
) -> Result<(), FillError> {
    let items: Vec<(u64, u64)> = ranges
        .iter()
        .flat_map(|&(s, n)| {
            (0..n)
                .step_by(item as usize)
                .map(move |o| (s + o, item.min(n - o)))
        })
        .collect();
    let done: Vec<AtomicBool> = items.iter().map(|_| AtomicBool::new(false)).collect();
    let order = spread(items.len(), threads.max(1));
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failed: Mutex<Option<BackendError>> = Mutex::new(None);
    let wake = (Mutex::new(()), Condvar::new());
    let worker = || {
        loop {
            // Relaxed: an index handed out once; `done` publishes what the item did.
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= items.len() || stop.load(Ordering::Relaxed) {
                break;
            }
            let i = order[k];
            let (start, n) = items[i];
            // SAFETY: inside a range the caller vouches is mapped and writable (and, for the
            // fallback's zeros, never written).
            if let Err(e) = unsafe { fill(start, n, fallback) } {
                let mut f = failed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                f.get_or_insert(e);
                // Never marked done: no piece over it is locked.
                stop.store(true, Ordering::Relaxed);
                break;
            }
            if let Some(p) = progress {
                // Relaxed: a progress report only.
                p.faulted.fetch_add(n, Ordering::Relaxed);
            }
            done[i].store(true, Ordering::Release);
            let _g = wake
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            wake.1.notify_all();
        }
        // Whoever waits sees the end of the work too.
        let _g = wake
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        wake.1.notify_all();
    };
    // Pieces locked, or the piece that failed.
    let locked = std::thread::scope(|s| {
        // With a pinner the calling thread locks pieces, so `threads` others fill; without one
        // it fills beside them.
        let others = if pinner.is_some() {
            threads.max(1)
        } else {
            threads.max(1) - 1
        };
        for _ in 0..others.min(items.len()) {
            s.spawn(worker);
        }
        let Some(pinner) = pinner else {
            worker();
            return Ok(0);
        };
        let mut filled = 0usize;
        for (k, &(start, n)) in pieces.iter().enumerate() {
            let end = start + n;
            while filled < items.len() && items[filled].0 < end {
                if done[filled].load(Ordering::Acquire) {
                    filled += 1;
                    continue;
                }
                if stop.load(Ordering::Relaxed) {
                    return Ok(k);
                }
                let g = wake
                    .0
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                // A bounded wait: a wake between the check above and this wait is not missed
                // for longer than this.
                drop(wake.1.wait_timeout(g, Duration::from_millis(5)));
            }
            // SAFETY: the caller vouches for the piece; its bytes are faulted in (or left to the
            // pinner by the fallback).
            if let Err(e) = unsafe { pinner.pin(start, n) } {
                stop.store(true, Ordering::Relaxed);
                return Err(FillError {
                    piece: Some(k),
                    error: e,
                });
            }
            if let Some(p) = progress {
                // Relaxed: a progress report only.
                p.locked.fetch_add(n, Ordering::Relaxed);
            }
        }
        Ok(pieces.len())
    })?;
    match failed
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        Some(error) => {
            if let Some(pinner) = pinner {
                // Undo the pieces locked before the fill failed.
                for &(start, _) in pieces[..locked].iter().rev() {
                    // SAFETY: locked above; nothing has been handed out yet.
                    let _ = unsafe { pinner.unpin(start) };
                }
            }
            Err(FillError { piece: None, error })
        }
        None => Ok(()),
    }
}

/// Items a thread takes in a row within a window of [`spread`].
const STRIPE_ITEMS: usize = 4;

/// The order in which `threads` threads take `n` items (in address order): windows of
/// `threads * STRIPE_ITEMS` items, each taken a stripe at a time, so that the items being filled
/// at once lie [`STRIPE_ITEMS`] items apart rather than side by side. A /dev/shm region split over
/// files (vLLM's 32 segments) fills per file one page at a time: 16 threads side by side share
/// two files, spread out they take sixteen. Windows come in address order, so the pieces of one
/// window are locked while the next is filled.
fn spread(n: usize, threads: usize) -> Vec<usize> {
    let window = threads * STRIPE_ITEMS;
    let mut order = Vec::with_capacity(n);
    for base in (0..n).step_by(window) {
        let len = window.min(n - base);
        let stripes = len.div_ceil(STRIPE_ITEMS);
        for i in 0..STRIPE_ITEMS {
            for t in 0..stripes {
                let k = t * STRIPE_ITEMS + i;
                if k < len {
                    order.push(base + k);
                }
            }
        }
    }
    order
}

/// Faults in `[start, start + n)` (see [`fill_and_pin`]).
///
/// # Safety
/// As [`fill_and_pin`]'s.
unsafe fn fill(start: u64, n: u64, fallback: Fallback) -> Result<(), BackendError> {
    // SAFETY: advice over memory the caller vouches is mapped; the kernel faults the pages in
    // as a write would, without changing a byte.
    let r = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            n as usize,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match (err.raw_os_error(), fallback) {
        // A kernel without MADV_POPULATE_WRITE.
        (Some(libc::EINVAL), Fallback::TouchZero) => {
            let page = super::os_page();
            let mut at = start;
            while at < start + n {
                // SAFETY: inside the range, writable; a zero over the zero the caller vouches
                // is there changes nothing but faults the page in now.
                unsafe { (at as *mut u8).write_volatile(0) };
                at = (at / page + 1) * page;
            }
            Ok(())
        }
        (Some(libc::EINVAL), Fallback::Skip) => Ok(()),
        _ => Err(super::no_memory("fault in", n, &super::os_error(&err))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// A private anonymous mapping of `pages` OS pages, unmapped on drop.
    struct Map(u64, usize);

    impl Map {
        fn new(pages: usize) -> Self {
            let len = pages * super::super::os_page() as usize;
            // SAFETY: a new anonymous mapping where the kernel chooses.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Map(p as u64, len)
        }

        /// Whether every page of `[start, start + n)` is resident.
        fn resident(start: u64, n: u64) -> bool {
            let page = super::super::os_page();
            let mut v = vec![0u8; n.div_ceil(page) as usize];
            // SAFETY: `start` is page-aligned and inside a mapping; `v` holds a byte per page.
            let r =
                unsafe { libc::mincore(start as *mut libc::c_void, n as usize, v.as_mut_ptr()) };
            r == 0 && v.iter().all(|b| b & 1 == 1)
        }
    }

    impl Drop for Map {
        fn drop(&mut self) {
            // SAFETY: mapped by `new` with this length.
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
        }
    }

    /// Records pins and unpins, checking at each pin that the piece is resident; fails the pin
    /// of the piece starting at `fail`.
    #[derive(Debug, Default)]
    struct Checker {
        log: StdMutex<Vec<(char, u64, bool)>>,
        fail: Option<u64>,
    }

    impl Pinner for Checker {
        unsafe fn pin(&self, start: u64, len: u64) -> Result<(), BackendError> {
            if self.fail == Some(start) {
                return Err(BackendError::BadMemory("refused".into()));
            }
            self.log
                .lock()
                .unwrap()
                .push(('p', start, Map::resident(start, len)));
            Ok(())
        }

        unsafe fn unpin(&self, start: u64) -> Result<(), BackendError> {
            self.log.lock().unwrap().push(('u', start, true));
            Ok(())
        }
    }

    #[test]
    fn items_are_taken_a_stripe_apart_within_windows_in_address_order() {
        // 2 threads: windows of 8 items, stripes of 4.
        assert_eq!(spread(8, 2), [0, 4, 1, 5, 2, 6, 3, 7]);
        assert_eq!(spread(11, 2), [0, 4, 1, 5, 2, 6, 3, 7, 8, 9, 10]);
        assert_eq!(spread(3, 16), [0, 1, 2]);
        for (n, t) in [(0, 1), (1, 1), (100, 3), (257, 16)] {
            let mut o = spread(n, t);
            o.sort_unstable();
            assert_eq!(
                o,
                (0..n).collect::<Vec<_>>(),
                "a permutation for {n} items, {t} threads"
            );
        }
    }

    #[test]
    fn each_piece_is_locked_in_order_once_its_pages_are_in() {
        let page = super::super::os_page();
        let m = Map::new(64);
        // Pieces of 8 pages, items of 3 pages (so items straddle pieces), 4 threads.
        let pieces: Vec<(u64, u64)> = (0..8).map(|k| (m.0 + k * 8 * page, 8 * page)).collect();
        let rec = Checker::default();
        let progress = AllocProgress::default();
        // SAFETY: the mapping is fresh (zeros), writable, alive until `m` drops.
        unsafe {
            fill_in_items(
                &[(m.0, 64 * page)],
                &pieces,
                Some(&rec),
                4,
                Fallback::TouchZero,
                Some(&progress),
                3 * page,
            )
        }
        .unwrap();
        let log = rec.log.lock().unwrap().clone();
        let want: Vec<(char, u64, bool)> = pieces.iter().map(|&(s, _)| ('p', s, true)).collect();
        assert_eq!(log, want);
        assert_eq!(progress.get(), (0, 64 * page, 64 * page));
        assert!(Map::resident(m.0, 64 * page));
    }

    #[test]
    fn without_a_pinner_the_ranges_are_filled_and_nothing_else() {
        let page = super::super::os_page();
        let m = Map::new(32);
        // Two ranges with untouched pages between and after them.
        let ranges = [(m.0 + page, 5 * page), (m.0 + 10 * page, 7 * page)];
        for threads in [1, 3] {
            // SAFETY: as above.
            unsafe { fill_in_items(&ranges, &[], None, threads, Fallback::Skip, None, 2 * page) }
                .unwrap();
            assert!(ranges.iter().all(|&(s, n)| Map::resident(s, n)));
        }
        assert!(!Map::resident(m.0 + 20 * page, 12 * page));
    }

    #[test]
    fn a_refused_piece_is_named_and_the_pieces_before_it_stay_locked_for_the_caller() {
        let page = super::super::os_page();
        let m = Map::new(16);
        let pieces: Vec<(u64, u64)> = (0..4).map(|k| (m.0 + k * 4 * page, 4 * page)).collect();
        let rec = Checker {
            fail: Some(pieces[2].0),
            ..Checker::default()
        };
        // SAFETY: as above.
        let e = unsafe {
            fill_in_items(
                &[(m.0, 16 * page)],
                &pieces,
                Some(&rec),
                2,
                Fallback::Skip,
                None,
                page,
            )
        }
        .unwrap_err();
        assert_eq!(e.piece, Some(2));
        assert!(e.error.to_string().contains("refused"), "{}", e.error);
        let starts: Vec<u64> = rec.log.lock().unwrap().iter().map(|e| e.1).collect();
        assert_eq!(starts, [pieces[0].0, pieces[1].0]);
    }

    #[test]
    fn a_range_that_cannot_be_filled_fails_and_undoes_the_pieces_locked() {
        let page = super::super::os_page();
        let m = Map::new(16);
        // The last four pages a shared mapping of an empty file: their fill fails (a write
        // there is a bus error). Unmapped instead, the range could be handed to a mapping another
        // test makes meanwhile, and filled.
        let tail = m.0 + 12 * page;
        // SAFETY: a new file descriptor, closed below; the mapping replaces the tail of `m`,
        // which nothing reaches, and goes with it on drop.
        unsafe {
            let fd = libc::memfd_create(c"blockswap-empty".as_ptr(), 0);
            assert!(fd >= 0, "memfd_create");
            let p = libc::mmap(
                tail as *mut libc::c_void,
                (4 * page) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            );
            assert_eq!(p as u64, tail, "mmap over the tail");
            libc::close(fd);
        }
        let pieces: Vec<(u64, u64)> = (0..4).map(|k| (m.0 + k * 4 * page, 4 * page)).collect();
        let rec = Checker::default();
        // SAFETY: the mapped part is fresh; the fill of the rest fails before touching it.
        let e = unsafe {
            fill_in_items(
                &[(m.0, 16 * page)],
                &pieces,
                Some(&rec),
                1,
                Fallback::Skip,
                None,
                4 * page,
            )
        }
        .unwrap_err();
        assert_eq!(e.piece, None);
        assert!(e.error.to_string().contains("fault in"), "{}", e.error);
        let log = rec.log.lock().unwrap().clone();
        let pins: Vec<u64> = log.iter().filter(|e| e.0 == 'p').map(|e| e.1).collect();
        let mut unpins: Vec<u64> = log.iter().filter(|e| e.0 == 'u').map(|e| e.1).collect();
        unpins.reverse();
        assert_eq!(pins, unpins, "every piece locked is unlocked: {log:?}");
        assert!(!pins.contains(&pieces[3].0));
    }
}
