//! The descriptor buffer pool.
//!
//! A transfer's `(src, dst, size)` arrays live in a slab: one host allocation holding three `u64`
//! columns. Slabs come from the backend (page-locked and device-mapped on CUDA, so a copy kernel can
//! read descriptors without a host-to-device copy) and are reused: a slab is handed out per
//! transfer and comes back only when that transfer's completion proves the device no longer reads
//! it. Slab capacities are powers of two; the pool grows on demand up to a byte cap and then
//! refuses with [`PoolError::Exhausted`]. It never blocks, never hands out a slab in flight, and
//! allocates nothing per transfer once warm.

use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::backend::{Backend, BackendError};
use crate::slab::STATUS_OK;
use crate::sync::{ArrayQueue, AtomicU64, AtomicU8, AtomicUsize, Ordering};

pub use crate::slab::{Slab, SlabInner, SlabRef};

/// log2 of the smallest slab capacity: 256 descriptors, 6 KiB.
pub const MIN_CLASS: u32 = 8;
/// log2 of the largest slab capacity: 2^20 descriptors, 24 MiB.
pub const MAX_CLASS: u32 = 20;
/// Bytes per descriptor: three u64 columns.
pub const DESCRIPTOR_BYTES: usize = 24;

/// A slab request the pool cannot meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolError {
    /// Every slab is in flight and growing would pass the cap.
    Exhausted {
        requested: usize,
        in_use: usize,
        cap: usize,
    },
    /// More descriptors than the largest slab holds.
    TooLarge { descriptors: usize, max: usize },
    /// The slab for this many descriptors is larger than the whole pool: polling cannot help.
    ExceedsCap {
        descriptors: usize,
        bytes: usize,
        cap: usize,
    },
    /// The backend could not allocate.
    Backend(BackendError),
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::Exhausted {
                requested,
                in_use,
                cap,
            } => write!(
                f,
                "descriptor pool exhausted: {requested} more bytes wanted, {in_use} of {cap} in \
                 use by transfers in flight or finished but not yet polled (call get_finished, \
                 or raise pool_bytes)"
            ),
            PoolError::TooLarge { descriptors, max } => {
                write!(
                    f,
                    "{descriptors} descriptors do not fit one slab (at most {max})"
                )
            }
            PoolError::ExceedsCap {
                descriptors,
                bytes,
                cap,
            } => write!(
                f,
                "{descriptors} descriptors need a {bytes}-byte slab, more than the whole \
                 descriptor pool ({cap} bytes): raise pool_bytes or split the transfer"
            ),
            PoolError::Backend(e) => write!(f, "descriptor pool: {e}"),
        }
    }
}

impl std::error::Error for PoolError {}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Slabs allocated so far.
    pub slabs: usize,
    /// Slabs at home, ready to hand out.
    pub free: usize,
    /// Bytes of all slabs.
    pub bytes: usize,
    /// The byte cap.
    pub cap: usize,
}

/// The pool. Acquire and release are lock-free.
#[derive(Debug)]
pub struct Pool {
    backend: Arc<dyn Backend>,
    free: Vec<ArrayQueue<Box<SlabInner>>>,
    bytes: AtomicUsize,
    slabs: AtomicUsize,
    cap: usize,
    /// [`crate::fork::fork_generation`] when the pool was made: a pool dropped in a child
    /// forked since frees nothing (its slabs belong to the parent's driver state).
    generation: u64,
}

fn class_bytes(class: u32) -> usize {
    DESCRIPTOR_BYTES << class
}

impl Pool {
    /// A pool that allocates through `backend`, up to `cap` bytes in all.
    pub fn new(backend: Arc<dyn Backend>, cap: usize) -> Self {
        let free = (MIN_CLASS..=MAX_CLASS)
            .map(|c| ArrayQueue::new((cap / class_bytes(c)).clamp(1, 1 << 16)))
            .collect();
        Pool {
            backend,
            free,
            bytes: AtomicUsize::new(0),
            slabs: AtomicUsize::new(0),
            cap,
            generation: crate::fork::fork_generation(),
        }
    }

    /// The most descriptors one slab holds.
    #[must_use]
    pub const fn max_descriptors() -> usize {
        1 << MAX_CLASS
    }

    /// A slab with room for `n` descriptors: a free one of the smallest class that fits, a new one
    /// while under the cap (freeing idle slabs of other classes to make room), else a free one of
    /// a larger class.
    pub fn acquire(&self, n: usize) -> Result<Slab, PoolError> {
        let n = n.max(1);
        if n > Self::max_descriptors() {
            return Err(PoolError::TooLarge {
                descriptors: n,
                max: Self::max_descriptors(),
            });
        }
        let class = n.next_power_of_two().trailing_zeros().max(MIN_CLASS);
        let idx = (class - MIN_CLASS) as usize;
        let want = class_bytes(class);
        if want > self.cap {
            // No amount of polling frees room the pool never has.
            return Err(PoolError::ExceedsCap {
                descriptors: n,
                bytes: want,
                cap: self.cap,
            });
        }
        if let Some(inner) = self.free[idx].pop() {
            return Ok(Slab::from_box(inner));
        }
        loop {
            if self.reserve(want) {
                return self.allocate(class, want);
            }
            // Over the cap: a free slab of a larger class serves as is...
            for larger in &self.free[idx + 1..] {
                if let Some(inner) = larger.pop() {
                    return Ok(Slab::from_box(inner));
                }
            }
            // ...and one of a smaller class is freed to make room, until none is left at home.
            let Some(inner) = self.free[..idx].iter().rev().find_map(ArrayQueue::pop) else {
                break;
            };
            self.free_inner(*inner);
        }
        Err(PoolError::Exhausted {
            requested: want,
            in_use: self.bytes.load(Ordering::Relaxed),
            cap: self.cap,
        })
    }

    /// Reserves `want` bytes of the cap. Relaxed suffices: the counter guards a budget, it
    /// publishes no memory; the update is atomic, so concurrent growth never passes the cap.
    fn reserve(&self, want: usize) -> bool {
        self.bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b + want <= self.cap).then_some(b + want)
            })
            .is_ok()
    }

    /// A new slab of `class` (`want` bytes already reserved).
    fn allocate(&self, class: u32, want: usize) -> Result<Slab, PoolError> {
        match self.backend.alloc_host(want) {
            Ok(alloc) => {
                // SAFETY: the allocation is `want` bytes, exclusively ours; zeroing makes every
                // column element initialised.
                unsafe { std::ptr::write_bytes(alloc.as_ptr(), 0, want) };
                self.slabs.fetch_add(1, Ordering::Relaxed);
                Ok(Slab::from_box(Box::new(SlabInner {
                    alloc,
                    class,
                    cap: 1 << class,
                    len: 0,
                    status: AtomicU8::new(STATUS_OK),
                    device_ns: AtomicU64::new(0),
                    error: OnceLock::new(),
                })))
            }
            Err(e) => {
                self.bytes.fetch_sub(want, Ordering::Relaxed);
                Err(PoolError::Backend(e))
            }
        }
    }

    /// Returns a slab whose transfer is complete: the device no longer reads it.
    pub fn release(&self, slab: Slab) {
        let mut inner = slab.into_box();
        inner.len = 0;
        inner.status.store(STATUS_OK, Ordering::Relaxed);
        inner.device_ns.store(0, Ordering::Relaxed);
        inner.error.take();
        let idx = (inner.class - MIN_CLASS) as usize;
        if let Err(inner) = self.free[idx].push(inner) {
            // The queue holds every slab of its class the cap allows, so this cannot happen; if it
            // ever did, freeing is still correct because the transfer is complete.
            self.free_inner(*inner);
        }
    }

    fn free_inner(&self, inner: SlabInner) {
        let bytes = inner.alloc.len();
        // SAFETY: the slab is home: its transfer completed, so no device or thread reads it.
        unsafe { self.backend.free_host(inner.alloc) };
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.slabs.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            slabs: self.slabs.load(Ordering::Relaxed),
            free: self.free.iter().map(ArrayQueue::len).sum(),
            bytes: self.bytes.load(Ordering::Relaxed),
            cap: self.cap,
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Only slabs at home are freed. A slab still out (its transfer never completed because the
        // device failed) is leaked on purpose: freeing memory a device may still read is worse.
        if crate::fork::fork_generation() != self.generation {
            // In a forked child the slabs are the parent's (page-locked through its CUDA context,
            // which the child cannot use): dropping a HostAlloc frees nothing, so leave them.
            return;
        }
        for q in std::mem::take(&mut self.free) {
            while let Some(inner) = q.pop() {
                self.free_inner(*inner);
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::slab::HostAlloc;

    fn pool(cap: usize) -> Pool {
        Pool::new(Arc::new(HostBackend::new()), cap)
    }

    #[test]
    fn reuses_released_slabs_without_growing() {
        let p = pool(1 << 20);
        let a = p.acquire(100).unwrap();
        assert_eq!(a.capacity(), 256);
        let addr = a.column_addr(0);
        p.release(a);
        let b = p.acquire(200).unwrap();
        assert_eq!(b.column_addr(0), addr, "the free slab is reused");
        assert_eq!(p.stats().slabs, 1);
        p.release(b);
        assert_eq!(
            p.stats(),
            PoolStats {
                slabs: 1,
                free: 1,
                bytes: 256 * 24,
                cap: 1 << 20
            }
        );
    }

    #[test]
    fn grows_to_the_cap_then_refuses() {
        let p = pool(3 * 256 * 24);
        let slabs: Vec<_> = (0..3).map(|_| p.acquire(10).unwrap()).collect();
        let addrs: std::collections::HashSet<_> = slabs.iter().map(|s| s.column_addr(0)).collect();
        assert_eq!(addrs.len(), 3, "no slab handed out twice");
        assert!(matches!(p.acquire(10), Err(PoolError::Exhausted { .. })));
        let mut slabs = slabs.into_iter();
        p.release(slabs.next().unwrap());
        let again = p.acquire(10).unwrap();
        assert!(matches!(p.acquire(10), Err(PoolError::Exhausted { .. })));
        p.release(again);
        slabs.for_each(|s| p.release(s));
        assert_eq!(p.stats().free, 3);
    }

    #[test]
    fn falls_back_to_a_larger_free_slab_at_the_cap() {
        let p = pool(512 * 24);
        let big = p.acquire(512).unwrap();
        p.release(big);
        let small = p.acquire(1).unwrap();
        assert_eq!(small.capacity(), 512);
        p.release(small);
    }

    #[test]
    fn refuses_oversized_batches() {
        let p = pool(1 << 30);
        assert!(matches!(
            p.acquire(Pool::max_descriptors() + 1),
            Err(PoolError::TooLarge { .. })
        ));
    }

    /// The host backend, counting the slabs freed through it.
    #[derive(Debug)]
    struct Counting(HostBackend, std::sync::atomic::AtomicUsize);

    impl Backend for Counting {
        fn info(&self) -> crate::backend::BackendInfo {
            self.0.info()
        }
        fn check_region(
            &self,
            start: u64,
            len: u64,
            kind: crate::region::MemoryKind,
        ) -> Result<(), BackendError> {
            self.0.check_region(start, len, kind)
        }
        fn alloc_host(&self, bytes: usize) -> Result<HostAlloc, BackendError> {
            self.0.alloc_host(bytes)
        }
        unsafe fn free_host(&self, alloc: HostAlloc) {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // SAFETY: forwarded from our caller.
            unsafe { self.0.free_host(alloc) }
        }
        fn submit(
            &self,
            lane: crate::Direction,
            seq: u64,
            slab: SlabRef,
            request: crate::backend::SubmitRequest<'_>,
        ) -> Result<crate::backend::Submitted, BackendError> {
            self.0.submit(lane, seq, slab, request)
        }
        fn completed(&self, lane: crate::Direction) -> u64 {
            self.0.completed(lane)
        }
        fn wait(
            &self,
            lane: crate::Direction,
            seq: u64,
            timeout: Option<std::time::Duration>,
        ) -> Result<bool, BackendError> {
            self.0.wait(lane, seq, timeout)
        }
        fn inject_failures(&self, count: u64) {
            self.0.inject_failures(count);
        }
        fn shutdown(&self, deadline: Option<std::time::Instant>) -> u64 {
            self.0.shutdown(deadline)
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot fork")]
    fn a_pool_dropped_in_a_forked_child_frees_nothing() {
        let backend = Arc::new(Counting(
            HostBackend::new(),
            std::sync::atomic::AtomicUsize::new(0),
        ));
        let freed = |b: &Counting| b.1.load(std::sync::atomic::Ordering::Relaxed);
        let p = Pool::new(backend.clone(), 1 << 20);
        let s = p.acquire(1).unwrap();
        p.release(s);
        let parents = Pool::new(backend.clone(), 1 << 20);
        let s = parents.acquire(1).unwrap();
        parents.release(s);
        // Counts fork generations (an engine installs it when it is made).
        crate::fork::install_fork_hook();
        // SAFETY: the child only drops a pool (lock-free queues, the heap, an atomic counter) and
        // leaves with `_exit`.
        match unsafe { libc::fork() } {
            0 => {
                drop(parents);
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(freed(&backend) as i32) };
            }
            -1 => panic!("fork failed"),
            child => {
                let mut status = 0;
                // SAFETY: waits for the child forked above.
                assert_eq!(unsafe { libc::waitpid(child, &raw mut status, 0) }, child);
                assert!(libc::WIFEXITED(status));
                assert_eq!(
                    libc::WEXITSTATUS(status),
                    0,
                    "the child freed the parent's slabs"
                );
            }
        }
        // In the process that made it, a pool frees its slabs.
        drop(p);
        assert_eq!(freed(&backend), 1);
        drop(parents);
        assert_eq!(freed(&backend), 2);
    }

    #[test]
    fn released_slab_forgets_its_failure() {
        let p = pool(1 << 20);
        let s = p.acquire(1).unwrap();
        s.set_failed("boom".into());
        assert_eq!(s.failure(), Some("boom"));
        p.release(s);
        let s = p.acquire(1).unwrap();
        assert_eq!(s.failure(), None);
        p.release(s);
    }
}
