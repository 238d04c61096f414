//! Fork detection: a count of the forks this process image descends through, kept by a
//! `pthread_atfork` child handler. Engines, pools, backends and host buffers remember the count
//! they were made under and compare it with the current one to tell whether they came from a
//! parent process, whose page-locked memory and CUDA context the child cannot use.

use std::sync::atomic::{AtomicU64, Ordering};

/// Forks this process image descends through, counted in each child (`pthread_atfork`). An engine
/// remembers the count it was made under: nothing of an engine made before a fork works in the
/// child, while one made in the child does.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn mark_forked() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn install_fork_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a child handler that only adds to a static atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(mark_forked)) };
    });
}

/// The fork count of this process (0 in a process that never forked from one using blockswap).
/// Compare it with the count an object was made under to tell whether it came from a parent.
pub fn fork_generation() -> u64 {
    FORK_GENERATION.load(Ordering::Relaxed)
}

/// Whether this process is a fork of one that used blockswap.
#[must_use]
pub fn in_forked_child() -> bool {
    fork_generation() != 0
}
