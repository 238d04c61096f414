//! Slabs: the host memory a transfer's descriptors live in, and the handles on it.
//!
//! A [`HostAlloc`] is host memory a backend hands out (page-locked and device-mapped on CUDA). A
//! [`Slab`] is one such allocation holding a transfer's three `u64` columns, owned by that
//! transfer; a [`SlabRef`] is the backend's handle on it while the transfer is in flight. The pool
//! ([`crate::pool`]) makes, reuses and frees slabs through a backend ([`crate::backend`]); both
//! use these types, and this module uses neither.

use std::ptr::NonNull;
use std::sync::OnceLock;

use crate::descriptor::Columns;
use crate::sync::{AtomicU64, AtomicU8, Ordering};

/// Host memory handed out by a backend: page-locked and device-mapped on CUDA.
///
/// Dropping one frees nothing (it leaks): only
/// [`Backend::free_host`](crate::backend::Backend::free_host) frees, once the owner knows
/// no device can touch the memory any more.
#[derive(Debug)]
pub struct HostAlloc {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a HostAlloc is a plain owned range of host memory; nothing about it is tied to a thread.
unsafe impl Send for HostAlloc {}
// SAFETY: shared references only expose the address and length.
unsafe impl Sync for HostAlloc {}

impl HostAlloc {
    /// # Safety
    /// `ptr` must point to `len` bytes that the creating backend owns until it frees them.
    #[must_use]
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> Self {
        HostAlloc { ptr, len }
    }

    #[must_use]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    #[must_use]
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Transfer status written by the backend into the slab while in flight.
pub(crate) const STATUS_OK: u8 = 0;
const STATUS_FAILED: u8 = 1;

/// The shared part of a slab. Its address is stable (boxed) for the life of the pool.
///
/// The fields are the pool's ([`crate::pool`]): it makes, resets and frees slabs. Everyone else
/// goes through the methods.
#[derive(Debug)]
pub struct SlabInner {
    pub(crate) alloc: HostAlloc,
    pub(crate) class: u32,
    pub(crate) cap: usize,
    pub(crate) len: usize,
    pub(crate) status: AtomicU8,
    pub(crate) device_ns: AtomicU64,
    pub(crate) error: OnceLock<String>,
}

impl SlabInner {
    fn column(&self, i: usize) -> *mut u64 {
        #[allow(clippy::cast_ptr_alignment)] // the allocation is 8-byte aligned (its layout says)
        let base = self.alloc.as_ptr().cast::<u64>();
        // SAFETY: the allocation holds 3 * cap u64s; i < 3.
        unsafe { base.add(i * self.cap) }
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

    /// Entries each column has room for (the columns lie this many entries apart).
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.cap
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

/// A slab owned by one transfer. Return it with [`Pool::release`](crate::pool::Pool::release).
///
/// The allocation is held through the raw pointer of `Box::into_raw`, never through a `Box`: the
/// slab is moved (into the lane's in-flight record) while the backend reads and writes the same
/// `SlabInner` through a [`SlabRef`], and moving a `Box` would assert unique ownership of memory
/// that handle still uses (undefined behaviour under Stacked and Tree Borrows; `cargo miri test`
/// checks it). The `Box` is rebuilt only when the slab comes home (`Slab::into_box`); a slab
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
    pub(crate) fn from_box(inner: Box<SlabInner>) -> Self {
        Slab(NonNull::from(Box::leak(inner)))
    }

    /// The allocation as a Box again, once no [`SlabRef`] of it can be used any more.
    pub(crate) fn into_box(self) -> Box<SlabInner> {
        let ptr = self.0.as_ptr();
        // SAFETY: `ptr` came from `Box::leak` in `from_box` and is owned by this Slab alone, which
        // this call consumes (a Slab has no Drop); the pool calls this only for a slab whose
        // transfer completed, so no SlabRef of it is used again.
        unsafe { Box::from_raw(ptr) }
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
    #[must_use]
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
    #[must_use]
    pub unsafe fn get(&self) -> &SlabInner {
        // SAFETY: the caller upholds the in-flight window; the allocation is not freed then, and
        // it is never reached through a Box while shared (see [`Slab`]).
        unsafe { self.0.as_ref() }
    }
}
