//! The synchronisation primitives of the lock-free parts: completion lanes and the slab pool.
//!
//! A normal build re-exports std's atomics and crossbeam's `ArrayQueue` and adds nothing in
//! between. Built with `RUSTFLAGS="--cfg loom"` (`make loom`), the same names are loom's atomics
//! and a bounded queue loom can see into, so that `tests/loom.rs` explores every interleaving of
//! the protocols built on them, under the C11 memory model. loom cannot look inside crossbeam's
//! queue; the stand-in is a mutex around a `VecDeque`: bounded, FIFO and linearizable, which is
//! all the protocols assume of `ArrayQueue`.

#[cfg(not(loom))]
pub(crate) use crossbeam_queue::ArrayQueue;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use model::ArrayQueue;

#[cfg(loom)]
mod model {
    use std::collections::VecDeque;
    use std::fmt;

    /// `crossbeam_queue::ArrayQueue`'s interface over a loom mutex.
    pub(crate) struct ArrayQueue<T> {
        cap: usize,
        items: loom::sync::Mutex<VecDeque<T>>,
    }

    impl<T> ArrayQueue<T> {
        pub(crate) fn new(cap: usize) -> Self {
            assert!(cap > 0, "capacity must be non-zero");
            ArrayQueue {
                cap,
                items: loom::sync::Mutex::new(VecDeque::with_capacity(cap)),
            }
        }

        pub(crate) fn push(&self, value: T) -> Result<(), T> {
            let mut items = self.items.lock().unwrap();
            if items.len() == self.cap {
                return Err(value);
            }
            items.push_back(value);
            Ok(())
        }

        pub(crate) fn pop(&self) -> Option<T> {
            self.items.lock().unwrap().pop_front()
        }

        pub(crate) fn len(&self) -> usize {
            self.items.lock().unwrap().len()
        }
    }

    impl<T> fmt::Debug for ArrayQueue<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("ArrayQueue")
                .field("cap", &self.cap)
                .finish()
        }
    }
}
