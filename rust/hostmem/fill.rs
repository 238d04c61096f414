//! Faulting host memory in from several threads, and page-locking it piece by piece as soon as a
//! piece is in: what makes a CPU tier of tens of GiB ready in seconds.
//!
//! Measured (H200 machine, `benches/probe_pinning.py`, docs/benchmarks.md): one thread faults
//! fresh anonymous huge pages in at 5-6 GiB/s, 16 threads taking 64 MiB items at 23.6 GiB/s;
//! registering memory that is already there runs at 20-37 GiB/s. So the threads fill items of
//! [`FILL_ITEM`] bytes while [`LOCK_THREADS`] others (the calling thread among them) page-lock
//! each piece once every item over it is in, lowest address first of the pieces that are, not
//! waiting for the pieces below: the registration of one piece overlaps the filling of the
//! others. `PinnedRows` in
//! 4 GiB pieces was ready at 27-31 GiB/s. vLLM's region (32 files in /dev/shm) was ready at
//! 13.1-14.6 GiB/s at 96 GiB on a two-H200 host, where vLLM's own one-thread fill makes 1.6 and
//! the order before (no file a thread, no `fallocate`) 6.6 (docs/results/2026-11-30-h200x2-fill).

use crate::sync::MutexExt;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::{AllocProgress, Pinner};
use crate::backend::BackendError;

/// The most bytes one thread faults in at a time (a work item).
pub const FILL_ITEM: u64 = 64 << 20;

/// Threads that page-lock pieces by default. The driver locks several pieces at once: eight
/// processes locking their 4,096 cells of 2 MiB each (vLLM's region of 64 GiB at eight ranks, one
/// H200) took 7.21 s from one thread each and 3.26 s from two; four, eight and sixteen were no
/// faster (3.49, 3.57, 4.29 s); one process locking 4 GiB pieces gained nothing and lost nothing.
/// Beside the fill the gain is smaller: 48 GiB at eight ranks was ready in 4.90 s with one lock
/// thread a rank, 4.68 s with two (docs/results/2026-12-02-h200-pin-threads).
pub const LOCK_THREADS: usize = 2;

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

/// Why [`fill_and_pin`] failed: the piece whose page-locking failed, or `None` where filling
/// failed. Either way no piece is left locked.
#[derive(Debug)]
pub struct FillError {
    pub piece: Option<usize>,
    pub error: BackendError,
}

/// Faults in `ranges` (`(start, bytes)`, disjoint, taken in the order given) from `threads`
/// threads in items of at most [`FILL_ITEM`] bytes, counting `progress.faulted`; with a
/// `pinner`, page-locks `pieces` (in address order, disjoint) from `lockers` threads (the
/// calling one among them), each as soon as every item over it is in (the lowest address first
/// of those that are), counting `progress.locked`. All or nothing: where a fill or a lock fails,
/// the pieces locked are unlocked again. Where the kernel cannot populate a range, `fallback`
/// says what happens instead.
///
/// `files`: empty, or one `(descriptor, offset)` per range, where the range is a shared mapping
/// of that file from that offset (a /dev/shm segment of vLLM's region). The threads then take a
/// file each at a time ([`spread`]), and each item's pages are allocated in the file first
/// (`fallocate`, size kept) and faulted in after: 32 files of 3 GiB from 32 threads took 1.9 s
/// to allocate and 2.1 s to fault in, against 6.1 s for the faults alone (`shmfill.txt` in
/// docs/results/2026-11-30-h200x2-fill). A file system without `fallocate` leaves it to the
/// faults, and so does a tmpfs mounted `huge=advise`, where only a fault through a mapping
/// advised `MADV_HUGEPAGE` allocates 2 MiB pages (the caller advises the mapping: vLLM's
/// worker does); a file that has no room for the pages fails the fill by name.
///
/// # Safety
/// Every range must be mapped, writable memory that stays mapped until the call returns, and
/// every piece memory the pinner may lock (see [`Pinner::pin`]); with [`Fallback::TouchZero`] no
/// byte of the ranges may hold anything but zero; each file's descriptor must stay open until
/// the call returns and be the file mapped there at that offset.
pub unsafe fn fill_and_pin(
    ranges: &[(u64, u64)],
    files: &[(i32, u64)],
    pieces: &[(u64, u64)],
    pinner: Option<&dyn Pinner>,
    (threads, lockers): (usize, usize),
    fallback: Fallback,
    progress: Option<&AllocProgress>,
) -> Result<(), FillError> {
    // SAFETY: the caller's contract.
    unsafe {
        fill_in_items(
            ranges,
            files,
            pieces,
            pinner,
            (threads, lockers),
            fallback,
            progress,
            FILL_ITEM,
        )
    }
}

/// [`fill_and_pin`] in items of at most `item` bytes.
///
/// # Safety
/// As [`fill_and_pin`]'s.
#[allow(clippy::too_many_arguments)] // fill_and_pin's, and the item size
unsafe fn fill_in_items(
    ranges: &[(u64, u64)],
    files: &[(i32, u64)],
    pieces: &[(u64, u64)],
    pinner: Option<&dyn Pinner>,
    (threads, lockers): (usize, usize),
    fallback: Fallback,
    progress: Option<&AllocProgress>,
    item: u64,
) -> Result<(), FillError> {
    debug_assert!(files.is_empty() || files.len() == ranges.len());
    let items: Vec<Item> = ranges
        .iter()
        .enumerate()
        .flat_map(|(r, &(s, n))| {
            let file = files.get(r).copied();
            (0..n)
                .step_by(item as usize)
                .map(move |o| (s + o, item.min(n - o), file.map(|(fd, at)| (fd, at + o))))
        })
        .collect();
    // The pieces each item lies over, and how many items each piece still waits for.
    let spans = piece_spans(&items, pieces);
    let mut waits = vec![0usize; pieces.len()];
    for k in spans.iter().flat_map(Clone::clone) {
        waits[k] += 1;
    }
    // A piece over no item (filled by someone else, or left to the pinner) is ready at once.
    let ready: BinaryHeap<Reverse<usize>> = (0..pieces.len())
        .filter(|&k| waits[k] == 0)
        .map(Reverse)
        .collect();
    let waits: Vec<AtomicUsize> = waits.into_iter().map(AtomicUsize::new).collect();
    let faulted_only = faulted_only(files);
    let order = spread(&groups(&items), threads.max(1));
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let failed: Mutex<Option<BackendError>> = Mutex::new(None);
    // The pieces whose items are all in (lowest address first) with how many pieces the lockers
    // have taken, and the lockers' wake.
    let wake = (Mutex::new((ready, 0usize)), Condvar::new());
    let worker = || {
        loop {
            // Relaxed: an index handed out once; `waits` publishes what the item did.
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= items.len() || stop.load(Ordering::Relaxed) {
                break;
            }
            let i = order[k];
            let (start, n, file) = items[i];
            let file = file.filter(|f| !faulted_only.contains(&f.0));
            // SAFETY: inside a range the caller vouches is mapped and writable (and, for the
            // fallback's zeros, never written); its file, if any, the one mapped there.
            if let Err(e) = unsafe { fill(start, n, file, fallback) } {
                failed.locked().get_or_insert(e);
                // Never counted: no piece over it is locked.
                stop.store(true, Ordering::Relaxed);
                break;
            }
            if let Some(p) = progress {
                // Relaxed: a progress report only.
                p.faulted.fetch_add(n, Ordering::Relaxed);
            }
            // AcqRel: the last item of a piece to finish has seen every other item's fill.
            let done: Vec<usize> = spans[i]
                .clone()
                .filter(|&p| waits[p].fetch_sub(1, Ordering::AcqRel) == 1)
                .collect();
            if !done.is_empty() {
                let mut q = wake.0.locked();
                q.0.extend(done.into_iter().map(Reverse));
                wake.1.notify_all();
            }
        }
        // Whoever waits sees the end of the work too.
        let _g = wake.0.locked();
        wake.1.notify_all();
    };
    // The pieces locked, in the order they were, and the piece whose locking failed.
    let locked: Mutex<Vec<usize>> = Mutex::new(Vec::with_capacity(pieces.len()));
    let refused: Mutex<Option<(usize, BackendError)>> = Mutex::new(None);
    let lock_pieces = |pinner: &dyn Pinner| loop {
        let mut q = wake.0.locked();
        if q.1 == pieces.len() || stop.load(Ordering::Relaxed) {
            return;
        }
        let Some(Reverse(k)) = q.0.pop() else {
            // A bounded wait: the stop flag is set outside the lock.
            drop(wake.1.wait_timeout(q, Duration::from_millis(5)));
            continue;
        };
        q.1 += 1;
        drop(q);
        let (start, n) = pieces[k];
        // SAFETY: the caller vouches for the piece; every item over it is faulted in (or left
        // to the pinner by the fallback).
        if let Err(e) = unsafe { pinner.pin(start, n) } {
            stop.store(true, Ordering::Relaxed);
            refused.locked().get_or_insert((k, e));
            return;
        }
        locked.locked().push(k);
        if let Some(p) = progress {
            // Relaxed: a progress report only.
            p.locked.fetch_add(n, Ordering::Relaxed);
        }
    };
    std::thread::scope(|s| {
        // With a pinner `lockers` threads (the calling one among them) lock pieces and
        // `threads` others fill; without one the calling thread fills beside them.
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
            return;
        };
        for _ in 1..lockers.clamp(1, pieces.len().max(1)) {
            s.spawn(|| lock_pieces(pinner));
        }
        lock_pieces(pinner);
    });
    let locked = locked.into_value();
    let error = match refused.into_value() {
        Some((k, error)) => Some(FillError {
            piece: Some(k),
            error,
        }),
        None => failed
            .into_value()
            .map(|error| FillError { piece: None, error }),
    };
    match (error, pinner) {
        (None, _) => Ok(()),
        (Some(e), Some(pinner)) => {
            // All or nothing: undo the pieces locked before the failure.
            for &k in locked.iter().rev() {
                // SAFETY: locked above; nothing has been handed out yet.
                let _ = unsafe { pinner.unpin(pieces[k].0) };
            }
            Err(e)
        }
        (Some(e), None) => Err(e),
    }
}

/// The indices of the `pieces` (in address order, disjoint) each item lies over, in part or whole.
fn piece_spans(items: &[Item], pieces: &[(u64, u64)]) -> Vec<std::ops::Range<usize>> {
    items
        .iter()
        .map(|&(start, n, _)| {
            pieces.partition_point(|&(s, m)| s + m <= start)
                ..pieces.partition_point(|&(s, _)| s < start + n)
        })
        .collect()
}

/// A work item: its start, its bytes, and the descriptor and offset of the file mapped there.
type Item = (u64, u64, Option<(i32, u64)>);

/// The descriptors among `files` whose pages only the faults allocate: files on a tmpfs
/// mounted `huge=advise`, where a fault through a mapping advised `MADV_HUGEPAGE` allocates a 2
/// MiB page and `fallocate` would have put 4 KiB pages there first ([`super::huge`]).
fn faulted_only(files: &[(i32, u64)]) -> Vec<i32> {
    let mut fds: Vec<i32> = files.iter().map(|f| f.0).collect();
    fds.sort_unstable();
    fds.dedup();
    fds.retain(|&fd| super::shmem_huge(fd) == Some(super::ShmemHuge::Advise));
    fds
}

/// Items a thread takes in a row within a window of [`spread`], where they lie in no file.
const STRIPE_ITEMS: usize = 4;

/// The items (in the ranges' order) cut into the groups [`spread`] deals out: one per file, where
/// items lie in files (consecutive items of one descriptor), else stripes of [`STRIPE_ITEMS`].
fn groups(items: &[Item]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let fd = item.2.map(|f| f.0);
        let join = out.last().is_some_and(|g| {
            let first = items[g.start].2.map(|f| f.0);
            first == fd && (fd.is_some() || g.len() < STRIPE_ITEMS)
        });
        match out.last_mut() {
            Some(g) if join => g.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

/// The order in which `threads` threads take the items of `groups` (in the ranges' order):
/// windows of `threads` groups, each window dealt out one item of each group at a time, so that
/// the items being filled at once lie in different groups. A /dev/shm file takes its new pages
/// one at a time (the kernel serializes a file's page-cache inserts): in vLLM's region of 96 GiB
/// (32 files of 3 GiB), 16 threads in stripes of 4 items shared two files and faulted 6.0 GiB/s
/// in, a file each 14.8 GiB/s (two-H200 host, docs/results/2026-11-30-h200x2-fill). Windows come
/// in the ranges' order, so the pieces of one window are locked while the next fills; windows of
/// 8 or 16 files measured alike there, of 4 or 2 files slower. Ranks that share files start each
/// at a file of its own (the caller rotates its ranges: vLLM's region, `_vllm_region.py`).
fn spread(groups: &[std::ops::Range<usize>], threads: usize) -> Vec<usize> {
    let mut order = Vec::with_capacity(groups.last().map_or(0, |g| g.end));
    for window in groups.chunks(threads.max(1)) {
        let longest = window.iter().map(ExactSizeIterator::len).max().unwrap_or(0);
        for i in 0..longest {
            order.extend(window.iter().filter(|g| i < g.len()).map(|g| g.start + i));
        }
    }
    order
}

/// Faults in `[start, start + n)`, its pages first allocated in `file` (descriptor, offset) where
/// it is a shared mapping of one (see [`fill_and_pin`]).
///
/// # Safety
/// As [`fill_and_pin`]'s.
unsafe fn fill(
    start: u64,
    n: u64,
    file: Option<(i32, u64)>,
    fallback: Fallback,
) -> Result<(), BackendError> {
    if let Some((fd, at)) = file {
        allocate(fd, at, n)?;
    }
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

/// Allocates `[at, at + n)` of the file `fd` (its size kept): pages already there stay as they
/// are. Where the file system has no `fallocate` the faults allocate them instead.
fn allocate(fd: i32, at: u64, n: u64) -> Result<(), BackendError> {
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(at), libc::off_t::try_from(n)) else {
        return Err(super::no_memory(
            "allocate",
            n,
            "an offset past the file's range",
        ));
    };
    let err = loop {
        // SAFETY: a system call on a descriptor and numbers; it writes no memory of this
        // process, and allocates nothing over what the file holds (a byte already there is kept).
        if unsafe { libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, off, len) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        // A signal for this thread: tmpfs stops (what it allocated stays or is undone), and
        // the call over the same range does the rest.
        if err.kind() != std::io::ErrorKind::Interrupted {
            break err;
        }
    };
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS) => Ok(()),
        _ => Err(super::no_memory(
            "allocate",
            n,
            &format!(
                "fallocate on the file mapped there: {}",
                super::os_error(&err)
            ),
        )),
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

    /// `n` items of one byte each, in no file.
    fn anonymous(n: usize) -> Vec<Item> {
        (0..n as u64).map(|i| (i, 1, None)).collect()
    }

    /// [`fill_in_items`] where pages the kernel cannot populate are left alone, counting nothing,
    /// `threads` threads filling and as many locking.
    ///
    /// # Safety
    /// As [`fill_in_items`]'s.
    unsafe fn fill_skip(
        ranges: &[(u64, u64)],
        files: &[(i32, u64)],
        pieces: &[(u64, u64)],
        pinner: Option<&dyn Pinner>,
        threads: usize,
        item: u64,
    ) -> Result<(), FillError> {
        // SAFETY: the caller's contract.
        unsafe {
            fill_in_items(
                ranges,
                files,
                pieces,
                pinner,
                (threads, threads),
                Fallback::Skip,
                None,
                item,
            )
        }
    }

    /// The pieces `rec` saw locked, in order, checking that each was unlocked again, once, after
    /// the last lock.
    fn all_unlocked_again(rec: &Checker) -> Vec<u64> {
        let log = rec.log.lock().unwrap().clone();
        let pins: Vec<u64> = log.iter().filter(|e| e.0 == 'p').map(|e| e.1).collect();
        let mut unpins: Vec<u64> = log.iter().filter(|e| e.0 == 'u').map(|e| e.1).collect();
        assert!(
            log.iter().skip_while(|e| e.0 == 'p').all(|e| e.0 == 'u'),
            "unlocked after the last lock: {log:?}"
        );
        let mut sorted = pins.clone();
        sorted.sort_unstable();
        unpins.sort_unstable();
        assert_eq!(
            sorted, unpins,
            "every piece locked is unlocked once: {log:?}"
        );
        pins
    }

    #[test]
    fn items_are_taken_a_stripe_apart_within_windows_in_address_order() {
        let order = |n: usize, t: usize| spread(&groups(&anonymous(n)), t);
        // 2 threads: windows of 8 items, stripes of 4.
        assert_eq!(order(8, 2), [0, 4, 1, 5, 2, 6, 3, 7]);
        assert_eq!(order(11, 2), [0, 4, 1, 5, 2, 6, 3, 7, 8, 9, 10]);
        assert_eq!(order(3, 16), [0, 1, 2]);
        for (n, t) in [(0, 1), (1, 1), (100, 3), (257, 16)] {
            let mut o = order(n, t);
            o.sort_unstable();
            assert_eq!(
                o,
                (0..n).collect::<Vec<_>>(),
                "a permutation for {n} items, {t} threads"
            );
        }
    }

    #[test]
    fn items_of_files_are_dealt_out_a_file_each_within_windows_of_files() {
        // Three files of 3, 2 and 5 items (the second file twice: two ranges in it), then two
        // items in no file.
        let files = [(7, 3), (8, 1), (8, 1), (9, 5)];
        let mut items: Vec<Item> = files
            .iter()
            .flat_map(|&(fd, n)| (0..n).map(move |o| (0, 1, Some((fd, o)))))
            .chain([(0, 1, None), (0, 1, None)])
            .collect();
        for (i, item) in items.iter_mut().enumerate() {
            item.0 = i as u64;
        }
        let g = groups(&items);
        assert_eq!(g, [0..3, 3..5, 5..10, 10..12]);
        // 2 threads: the first two files side by side, then the third and the stripe.
        assert_eq!(spread(&g, 2), [0, 3, 1, 4, 2, 5, 10, 6, 11, 7, 8, 9]);
        // As many threads as files: one item of each at a time.
        assert_eq!(spread(&g, 4), [0, 3, 5, 10, 1, 4, 6, 11, 2, 7, 8, 9]);
    }

    #[test]
    fn each_piece_is_locked_once_when_every_item_over_it_is_in() {
        let page = super::super::os_page();
        let m = Map::new(64);
        // Pieces of 8 pages, items of 3 pages (so items straddle pieces), 4 threads filling and
        // 2 locking.
        let pieces: Vec<(u64, u64)> = (0..8).map(|k| (m.0 + k * 8 * page, 8 * page)).collect();
        for _ in 0..20 {
            fill_zeros_and_check(&m, &[(m.0, 64 * page)], &pieces, (4, 2), 3 * page);
        }
    }

    /// Fills `ranges` of `m` (a fresh private anonymous mapping) with `threads` and locks
    /// `pieces` (which the ranges cover) with a [`Checker`], in items of `item` bytes; checks
    /// that each piece was locked once, resident by then (a piece locked before its items were
    /// in would not be), and every byte counted; hands the pages back, so that the next call
    /// faults them in anew.
    fn fill_zeros_and_check(
        m: &Map,
        ranges: &[(u64, u64)],
        pieces: &[(u64, u64)],
        threads: (usize, usize),
        item: u64,
    ) {
        let rec = Checker::default();
        let progress = AllocProgress::default();
        // SAFETY: the mapping is private and anonymous, writable, alive until `m` drops, and
        // nothing writes it (its pages stay zeros after a fill).
        unsafe {
            fill_in_items(
                ranges,
                &[],
                pieces,
                Some(&rec),
                threads,
                Fallback::TouchZero,
                Some(&progress),
                item,
            )
        }
        .unwrap();
        let mut log = rec.log.lock().unwrap().clone();
        log.sort_unstable();
        let want: Vec<(char, u64, bool)> = pieces.iter().map(|&(s, _)| ('p', s, true)).collect();
        assert_eq!(log, want, "every piece once, resident when locked");
        let bytes: u64 = ranges.iter().map(|r| r.1).sum();
        assert_eq!(progress.get(), (0, bytes, bytes, 0));
        assert!(ranges.iter().all(|&(s, n)| Map::resident(s, n)));
        // SAFETY: the mapping's own pages, handed back.
        unsafe { libc::madvise(m.0 as *mut libc::c_void, m.1, libc::MADV_DONTNEED) };
    }

    #[test]
    fn ranges_out_of_address_order_fill_and_lock_every_piece() {
        let page = super::super::os_page();
        let m = Map::new(48);
        // The third, first and second thirds of the mapping, in that order (a rank that starts
        // at a file of its own); pieces of 4 pages in address order.
        let ranges: Vec<(u64, u64)> = [2, 0, 1]
            .iter()
            .map(|&k| (m.0 + k * 16 * page, 16 * page))
            .collect();
        let pieces: Vec<(u64, u64)> = (0..12).map(|k| (m.0 + k * 4 * page, 4 * page)).collect();
        for threads in [(1, 1), (3, 2)] {
            fill_zeros_and_check(&m, &ranges, &pieces, threads, 3 * page);
        }
        // The items are dealt out from the first range given.
        let items: Vec<Item> = ranges.iter().map(|&(s, n)| (s, n, None)).collect();
        assert_eq!(spread(&groups(&items), 1), [0, 1, 2]);
    }

    /// Locks nothing; records the thread of each pin as it starts, and the first `meet` pins
    /// wait (at most 10 s) until `meet` have started, recording whether they all had.
    #[derive(Debug)]
    struct Rendezvous {
        meet: usize,
        state: StdMutex<(usize, Vec<(std::thread::ThreadId, bool)>)>,
        all_in: std::sync::Condvar,
    }

    impl Pinner for Rendezvous {
        unsafe fn pin(&self, _start: u64, _len: u64) -> Result<(), BackendError> {
            let mut st = self.state.lock().unwrap();
            st.0 += 1;
            let k = st.1.len();
            st.1.push((std::thread::current().id(), true));
            self.all_in.notify_all();
            let (mut st, _) = self
                .all_in
                .wait_timeout_while(st, Duration::from_secs(10), |st| st.0 < self.meet)
                .unwrap();
            st.1[k].1 = st.0 >= self.meet;
            Ok(())
        }

        unsafe fn unpin(&self, _start: u64) -> Result<(), BackendError> {
            Ok(())
        }
    }

    #[test]
    fn lockers_lock_pieces_at_the_same_time() {
        let page = super::super::os_page();
        let m = Map::new(8);
        let pieces: Vec<(u64, u64)> = (0..8).map(|k| (m.0 + k * page, page)).collect();
        for lockers in [2, 3] {
            let rec = Rendezvous {
                meet: lockers,
                state: StdMutex::new((0, Vec::new())),
                all_in: std::sync::Condvar::new(),
            };
            // SAFETY: nothing to fill; the pinner touches no memory.
            unsafe {
                fill_in_items(
                    &[],
                    &[],
                    &pieces,
                    Some(&rec),
                    (1, lockers),
                    Fallback::Skip,
                    None,
                    page,
                )
            }
            .unwrap();
            let log = rec.state.into_inner().unwrap().1;
            assert_eq!(log.len(), pieces.len(), "every piece once");
            // The first `lockers` pins waited for each other, so they ran on as many threads.
            let first: std::collections::HashSet<_> = log[..lockers].iter().map(|e| e.0).collect();
            assert_eq!(first.len(), lockers, "{log:?}");
            assert!(log.iter().all(|e| e.1), "{log:?}");
        }
    }

    #[test]
    fn an_item_waits_on_every_piece_it_lies_over() {
        // Pieces [10, 20), [20, 30), [40, 50): a gap between the second and the third.
        let pieces = [(10, 10), (20, 10), (40, 10)];
        let items: Vec<Item> = [
            (0, 5),
            (5, 10),
            (12, 3),
            (15, 20),
            (30, 10),
            (45, 10),
            (60, 1),
        ]
        .iter()
        .map(|&(s, n)| (s, n, None))
        .collect();
        assert_eq!(
            piece_spans(&items, &pieces),
            [0..0, 0..1, 0..1, 0..2, 2..2, 2..3, 3..3]
        );
    }

    #[test]
    fn without_a_pinner_the_ranges_are_filled_and_nothing_else() {
        let page = super::super::os_page();
        let m = Map::new(32);
        // Two ranges with untouched pages between and after them.
        let ranges = [(m.0 + page, 5 * page), (m.0 + 10 * page, 7 * page)];
        for threads in [1, 3] {
            // SAFETY: as above.
            unsafe { fill_skip(&ranges, &[], &[], None, threads, 2 * page) }.unwrap();
            assert!(ranges.iter().all(|&(s, n)| Map::resident(s, n)));
        }
        assert!(!Map::resident(m.0 + 20 * page, 12 * page));
    }

    /// A shared mapping of a new memfd of `pages` OS pages; the descriptor stays open.
    fn shared_file(pages: usize) -> (i32, u64, usize) {
        let len = pages * super::super::os_page() as usize;
        // SAFETY: a new descriptor, sized, and a new shared mapping of it where the kernel
        // chooses; both live for the test's process.
        unsafe {
            let fd = libc::memfd_create(c"blockswap-fill".as_ptr(), 0);
            assert!(fd >= 0, "memfd_create");
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            (fd, p as u64, len)
        }
    }

    #[test]
    fn ranges_of_a_file_are_allocated_there_and_keep_what_it_holds() {
        let page = super::super::os_page();
        let (fd, at, len) = shared_file(32);
        // A byte written before the fill, in the second range.
        // SAFETY: inside the shared mapping, writable.
        unsafe { ((at + 20 * page + 7) as *mut u8).write_volatile(0xa5) };
        // Two ranges, their offsets in the file; pages 8-9 and 30-31 left alone.
        let ranges = [(at, 8 * page), (at + 10 * page, 20 * page)];
        let files = [(fd, 0), (fd, 10 * page)];
        for threads in [1, 3] {
            // SAFETY: the ranges are mapped from the file at those offsets, writable; the
            // descriptor is open.
            unsafe { fill_skip(&ranges, &files, &[], None, threads, 3 * page) }.unwrap();
            assert!(ranges.iter().all(|&(s, n)| Map::resident(s, n)));
        }
        // SAFETY: reads inside the mapping.
        let byte = |o: u64| unsafe { ((at + o) as *const u8).read_volatile() };
        assert_eq!(byte(20 * page + 7), 0xa5);
        assert_eq!(byte(20 * page + 8), 0);
        // SAFETY: a plain C struct, all zeros valid; then a stat of an open descriptor into it.
        let st = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            assert_eq!(libc::fstat(fd, &raw mut st), 0);
            st
        };
        assert_eq!(st.st_size as usize, len, "the file's size is kept");
        // SAFETY: the descriptor is this test's.
        unsafe { libc::close(fd) };
    }

    #[test]
    fn a_file_that_refuses_the_allocation_fails_the_fill_by_name() {
        let page = super::super::os_page();
        let (fd, at, _) = shared_file(4);
        // SAFETY: a path of the open memfd, opened again read-only: fallocate refuses it.
        let ro = unsafe {
            libc::open(
                format!("/proc/self/fd/{fd}\0").as_ptr().cast(),
                libc::O_RDONLY,
            )
        };
        assert!(ro >= 0, "open read-only");
        // SAFETY: as above; the fill fails before a fault.
        let e =
            unsafe { fill_skip(&[(at, 4 * page)], &[(ro, 0)], &[], None, 1, page) }.unwrap_err();
        assert_eq!(e.piece, None);
        let text = e.error.to_string();
        assert!(
            text.contains("could not allocate") && text.contains("fallocate"),
            "{text}"
        );
        // SAFETY: the descriptors are this test's.
        unsafe {
            libc::close(ro);
            libc::close(fd);
        }
    }

    #[test]
    fn a_refused_piece_is_named_and_the_pieces_locked_are_unlocked() {
        let page = super::super::os_page();
        let m = Map::new(16);
        let pieces: Vec<(u64, u64)> = (0..4).map(|k| (m.0 + k * 4 * page, 4 * page)).collect();
        for threads in [1, 2] {
            let rec = Checker {
                fail: Some(pieces[2].0),
                ..Checker::default()
            };
            // SAFETY: as above.
            let e =
                unsafe { fill_skip(&[(m.0, 16 * page)], &[], &pieces, Some(&rec), threads, page) }
                    .unwrap_err();
            assert_eq!(e.piece, Some(2));
            assert!(e.error.to_string().contains("refused"), "{}", e.error);
            let pins = all_unlocked_again(&rec);
            assert!(!pins.contains(&pieces[2].0));
            if threads == 1 {
                // One thread fills in address order: the pieces before it were locked.
                assert_eq!(pins, [pieces[0].0, pieces[1].0]);
            }
        }
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
        let e = unsafe { fill_skip(&[(m.0, 16 * page)], &[], &pieces, Some(&rec), 1, 4 * page) }
            .unwrap_err();
        assert_eq!(e.piece, None);
        assert!(e.error.to_string().contains("fault in"), "{}", e.error);
        let pins = all_unlocked_again(&rec);
        assert!(!pins.contains(&pieces[3].0));
    }
}
