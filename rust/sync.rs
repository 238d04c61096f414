//! The synchronisation primitives of the lock-free parts (completion lanes and the slab pool),
//! and the one rule for the crate's locks: a lock a panicking thread left poisoned is taken
//! anyway ([`MutexExt`], [`CondvarExt`], [`RwLockExt`]).
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

/// Locks taken whether or not a thread panicked holding them.
///
/// Every critical section in the crate writes whole values (a queue push, a field set, a
/// `take`), so a lock left poisoned by a panicking thread guards data that is still whole. One
/// lane's thread that panics fails its own transfers (the engine reports them failed); it must
/// not turn every later lock of a shared structure into a second panic. Poisoning is therefore
/// ignored everywhere, in one place: these methods.
pub(crate) trait MutexExt<T> {
    /// [`std::sync::Mutex::lock`], poisoned or not.
    fn locked(&self) -> std::sync::MutexGuard<'_, T>;
    /// [`std::sync::Mutex::try_lock`], poisoned or not: `None` only while another thread holds it.
    fn try_locked(&self) -> Option<std::sync::MutexGuard<'_, T>>;
    /// [`std::sync::Mutex::get_mut`], poisoned or not.
    fn value_mut(&mut self) -> &mut T;
    /// [`std::sync::Mutex::into_inner`], poisoned or not.
    fn into_value(self) -> T;
}

impl<T> MutexExt<T> for std::sync::Mutex<T> {
    fn locked(&self) -> std::sync::MutexGuard<'_, T> {
        self.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn try_locked(&self) -> Option<std::sync::MutexGuard<'_, T>> {
        match self.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn value_mut(&mut self) -> &mut T {
        self.get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn into_value(self) -> T {
        self.into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A condition variable's waits, poisoned or not (see [`MutexExt`]).
pub(crate) trait CondvarExt {
    /// [`std::sync::Condvar::wait`], poisoned or not.
    fn wait_locked<'a, T>(
        &self,
        guard: std::sync::MutexGuard<'a, T>,
    ) -> std::sync::MutexGuard<'a, T>;
    /// [`std::sync::Condvar::wait_timeout`], poisoned or not; the guard alone.
    fn wait_timeout_locked<'a, T>(
        &self,
        guard: std::sync::MutexGuard<'a, T>,
        timeout: std::time::Duration,
    ) -> std::sync::MutexGuard<'a, T>;
}

impl CondvarExt for std::sync::Condvar {
    fn wait_locked<'a, T>(
        &self,
        guard: std::sync::MutexGuard<'a, T>,
    ) -> std::sync::MutexGuard<'a, T> {
        self.wait(guard)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait_timeout_locked<'a, T>(
        &self,
        guard: std::sync::MutexGuard<'a, T>,
        timeout: std::time::Duration,
    ) -> std::sync::MutexGuard<'a, T> {
        self.wait_timeout(guard, timeout)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
    }
}

/// A read-write lock's guards, poisoned or not (see [`MutexExt`]).
pub(crate) trait RwLockExt<T> {
    /// [`std::sync::RwLock::read`], poisoned or not.
    fn read_locked(&self) -> std::sync::RwLockReadGuard<'_, T>;
    /// [`std::sync::RwLock::write`], poisoned or not.
    fn write_locked(&self) -> std::sync::RwLockWriteGuard<'_, T>;
}

impl<T> RwLockExt<T> for std::sync::RwLock<T> {
    fn read_locked(&self) -> std::sync::RwLockReadGuard<'_, T> {
        self.read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write_locked(&self) -> std::sync::RwLockWriteGuard<'_, T> {
        self.write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{CondvarExt, MutexExt, RwLockExt};
    use std::sync::{Condvar, Mutex, RwLock};
    use std::time::Duration;

    /// Poisons `m` by panicking in a thread that holds it after writing `value`.
    fn poison<T: Send>(m: &Mutex<T>, value: T) {
        std::thread::scope(|s| {
            let joined = s
                .spawn(|| {
                    let mut g = m.lock().unwrap();
                    *g = value;
                    panic!("a thread that panics holding the lock");
                })
                .join();
            assert!(joined.is_err());
        });
        assert!(m.is_poisoned());
    }

    #[test]
    fn a_poisoned_mutex_still_gives_the_value_last_written() {
        let mut m = Mutex::new(1_u32);
        poison(&m, 7);
        assert_eq!(*m.locked(), 7);
        assert_eq!(m.try_locked().map(|g| *g), Some(7));
        *m.value_mut() += 1;
        assert_eq!(m.into_value(), 8);
    }

    #[test]
    fn try_locked_is_none_only_while_another_holds_it() {
        let m = Mutex::new(());
        let g = m.locked();
        std::thread::scope(|s| {
            assert!(s.spawn(|| m.try_locked().is_none()).join().unwrap());
        });
        drop(g);
        assert!(m.try_locked().is_some());
    }

    #[test]
    fn waits_on_a_poisoned_mutex_return_its_guard() {
        let m = Mutex::new(0_u32);
        poison(&m, 3);
        let cv = Condvar::new();
        let g = cv.wait_timeout_locked(m.locked(), Duration::from_millis(1));
        assert_eq!(*g, 3);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    let _g = m.locked();
                    cv.notify_all();
                }
            });
            let g = cv.wait_locked(g);
            assert_eq!(*g, 3);
            done.store(true, std::sync::atomic::Ordering::Release);
        });
    }

    #[test]
    fn a_poisoned_rwlock_still_reads_and_writes() {
        let l = RwLock::new(vec![1]);
        std::thread::scope(|s| {
            let joined = s
                .spawn(|| {
                    let mut g = l.write().unwrap();
                    g.push(2);
                    panic!("a writer that panics holding the lock");
                })
                .join();
            assert!(joined.is_err());
        });
        assert!(l.is_poisoned());
        l.write_locked().push(3);
        assert_eq!(*l.read_locked(), vec![1, 2, 3]);
    }
}
