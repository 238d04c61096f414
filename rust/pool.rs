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
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use crate::backend::{Backend, BackendError, HostAlloc};
use crate::descriptor::Columns;
use crate::sync::{ArrayQueue, AtomicU64, AtomicU8, AtomicUsize, Ordering};

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
                 use by transfers in flight (raise pool_bytes, or poll completions)"
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

/// Transfer status written by the backend into the slab while in flight.
const STATUS_OK: u8 = 0;
const STATUS_FAILED: u8 = 1;

/// The shared part of a slab. Its address is stable (boxed) for the life of the pool.
#[derive(Debug)]
pub struct SlabInner {
    alloc: HostAlloc,
    class: u32,
    cap: usize,
    len: usize,
    status: AtomicU8,
    device_ns: AtomicU64,
    error: OnceLock<String>,
}

impl SlabInner {
    fn column(&self, i: usize) -> *mut u64 {
        // SAFETY: the allocation holds 3 * cap u64s; i < 3.
        unsafe { (self.alloc.as_ptr() as *mut u64).add(i * self.cap) }
    }

    /// The descriptors in use, as the device reads them.
    pub fn src(&self) -> &[u64] {
        // SAFETY: column 0 holds cap >= len initialised u64s (the pool zeroes slabs on creation).
        unsafe { std::slice::from_raw_parts(self.column(0), self.len) }
    }

    pub fn dst(&self) -> &[u64] {
        // SAFETY: as for `src`, column 1.
        unsafe { std::slice::from_raw_parts(self.column(1), self.len) }
    }

    pub fn size(&self) -> &[u64] {
        // SAFETY: as for `src`, column 2.
        unsafe { std::slice::from_raw_parts(self.column(2), self.len) }
    }

    /// The address of column `i` (0 src, 1 dst, 2 size), for a device reading them in place.
    pub fn column_addr(&self, i: usize) -> u64 {
        assert!(i < 3);
        self.column(i) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records that the transfer failed. The first reason wins.
    pub fn set_failed(&self, reason: String) {
        let _ = self.error.set(reason);
        // Release: the reason is written before the status that announces it.
        self.status.store(STATUS_FAILED, Ordering::Release);
    }

    /// Records the device (or worker) time the copies took.
    pub fn set_device_ns(&self, ns: u64) {
        // Relaxed: published by the backend's completion store, which is Release.
        self.device_ns.store(ns, Ordering::Relaxed);
    }

    /// `None` when the transfer succeeded, else the reason.
    pub fn failure(&self) -> Option<&str> {
        // Acquire: pairs with the Release in `set_failed`.
        if self.status.load(Ordering::Acquire) == STATUS_FAILED {
            Some(self.error.get().map_or("transfer failed", |s| s.as_str()))
        } else {
            None
        }
    }

    pub fn device_ns(&self) -> u64 {
        self.device_ns.load(Ordering::Relaxed)
    }
}

/// A slab owned by one transfer. Return it with [`Pool::release`].
///
/// The allocation is held through the raw pointer of `Box::into_raw`, never through a `Box`: the
/// slab is moved (into the lane's in-flight record) while the backend reads and writes the same
/// `SlabInner` through a [`SlabRef`], and moving a `Box` would assert unique ownership of memory
/// that handle still uses (undefined behaviour under Stacked and Tree Borrows; `cargo miri test`
/// checks it). The `Box` is rebuilt only when the slab comes home ([`Slab::into_box`]); a slab
/// dropped instead of released (a panic unwinding past it) is leaked, since the device may still
/// read it.
#[derive(Debug)]
pub struct Slab(NonNull<SlabInner>);

// SAFETY: a Slab owns its SlabInner as a Box would (SlabInner is Send + Sync: atomics, a
// OnceLock, and columns written only through `&mut Slab`).
unsafe impl Send for Slab {}
// SAFETY: as above; `&Slab` only hands out `&SlabInner`.
unsafe impl Sync for Slab {}

impl Slab {
    fn from_box(inner: Box<SlabInner>) -> Self {
        Slab(NonNull::from(Box::leak(inner)))
    }

    /// The allocation as a Box again, once no [`SlabRef`] of it can be used any more.
    fn into_box(self) -> Box<SlabInner> {
        let ptr = self.0.as_ptr();
        // SAFETY: `ptr` came from `Box::leak` in `from_box` and is owned by this Slab alone, which
        // this call consumes (a Slab has no Drop); the pool calls this only for a slab whose
        // transfer completed, so no SlabRef of it is used again.
        unsafe { Box::from_raw(ptr) }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The three columns, writable, at full capacity.
    pub fn columns(&mut self) -> Columns<'_> {
        let cap = self.cap;
        // SAFETY: the three columns are disjoint ranges of one allocation of 3 * cap u64s, and
        // `&mut self` proves no one else (host or device) holds this slab.
        unsafe {
            Columns {
                src: std::slice::from_raw_parts_mut(self.column(0), cap),
                dst: std::slice::from_raw_parts_mut(self.column(1), cap),
                size: std::slice::from_raw_parts_mut(self.column(2), cap),
            }
        }
    }

    /// Sets how many descriptors are in use. Panics past the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap);
        // SAFETY: `&mut self`: the slab is not shared yet (no SlabRef is handed out before the
        // descriptors are written), so this write races with nothing.
        unsafe { (*self.0.as_ptr()).len = len };
    }

    /// A handle the backend keeps while the transfer is in flight.
    pub fn share(&self) -> SlabRef {
        SlabRef(self.0)
    }
}

impl std::ops::Deref for Slab {
    type Target = SlabInner;
    fn deref(&self) -> &SlabInner {
        // SAFETY: the pointer is valid for the life of the Slab (see `from_box`); everything
        // reached through `&SlabInner` is safe to share with the backend's SlabRef.
        unsafe { self.0.as_ref() }
    }
}

/// A backend's handle on an in-flight slab.
///
/// The engine keeps the [`Slab`] alive and unmodified until the backend's completion for the
/// transfer has been observed, so the handle is valid exactly as long as the backend may use it.
#[derive(Clone, Copy, Debug)]
pub struct SlabRef(NonNull<SlabInner>);

// SAFETY: SlabInner is Sync (atomics, OnceLock, and columns that are read-only while in flight);
// the handle is only dereferenced while the engine keeps the slab in flight (see `get`).
unsafe impl Send for SlabRef {}
// SAFETY: as above.
unsafe impl Sync for SlabRef {}

impl SlabRef {
    /// # Safety
    /// Only between [`Backend::submit`](crate::Backend::submit) receiving this handle and the
    /// backend publishing the transfer's completion.
    pub unsafe fn get(&self) -> &SlabInner {
        // SAFETY: the caller upholds the in-flight window; the allocation is not freed then, and
        // it is never reached through a Box while shared (see [`Slab`]).
        unsafe { self.0.as_ref() }
    }
}

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
            free: self.free.iter().map(|q| q.len()).sum(),
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
            self.0.inject_failures(count)
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
        // Installs the engine's fork hook, which counts fork generations.
        drop(crate::engine::Engine::new(
            Arc::new(HostBackend::new()),
            Default::default(),
        ));
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
                assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
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
