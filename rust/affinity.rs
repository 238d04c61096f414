//! The CPUs an engine's threads run on (the engine option `cpus`).
//!
//! A thread starts with the CPU affinity of the thread that made it, so an engine made on a
//! thread bound to one CPU gets issuing threads bound to that same CPU: they then share it with
//! the caller, and a transfer waits for the caller to give the CPU up: an isolated 4 KiB-page
//! transfer took 5.8-5.9 ms instead of 0.28-0.30 ms on an H200 host whose caller polled for its
//! result (`benches/probe_cpus.py`; docs/tuning.md, `cpus`). [`Cpus`] binds them elsewhere;
//! [`current`] tells the bindings when to warn.

use std::io;

/// A checked set of CPU ids: at least one, each below `CPU_SETSIZE`, sorted, no repeats, and
/// a set this process may bind a thread to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cpus(Vec<usize>);

/// The largest CPU id an affinity mask holds, plus one.
#[allow(clippy::cast_sign_loss)] // a positive constant
pub const CPU_LIMIT: usize = libc::CPU_SETSIZE as usize;

impl Cpus {
    /// The set of `ids`, tried on a thread of its own (the caller's affinity is left alone);
    /// `Err` names what is wrong with them, or the system's reason for refusing them.
    pub fn new(ids: Vec<usize>) -> Result<Self, String> {
        let cpus = Self::ids_checked(ids)?;
        let me = cpus.clone();
        let tried = std::thread::Builder::new()
            .name("blockswap-cpus".into())
            .spawn(move || me.bind_current())
            .map_err(|e| format!("cannot start a thread to try cpus: {e}"))?
            .join()
            .map_err(|_| "the thread trying cpus panicked".to_owned())?;
        tried.map_err(|e| {
            format!(
                "cpus {:?}: this process may not run a thread there ({e})",
                cpus.0
            )
        })?;
        Ok(cpus)
    }

    fn ids_checked(mut ids: Vec<usize>) -> Result<Self, String> {
        if ids.is_empty() {
            return Err("cpus must name at least one CPU".into());
        }
        if let Some(&bad) = ids.iter().find(|&&c| c >= CPU_LIMIT) {
            return Err(format!(
                "cpus must be CPU ids from 0 to {}, not {bad}",
                CPU_LIMIT - 1
            ));
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(Cpus(ids))
    }

    /// The ids, sorted.
    #[must_use]
    pub fn ids(&self) -> &[usize] {
        &self.0
    }

    /// The mask of these CPUs.
    fn mask(&self) -> libc::cpu_set_t {
        // SAFETY: `cpu_set_t` is a plain bit array, valid zeroed; CPU_SET writes a bit below
        // CPU_SETSIZE (checked in `ids_checked`, the only way to a `Cpus`) of the local set.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in &self.0 {
                libc::CPU_SET(c, &mut set);
            }
            set
        }
    }

    /// Binds the calling thread to these CPUs. `Err` where the system refuses (none of them is
    /// online and permitted to this process).
    pub fn bind_current(&self) -> io::Result<()> {
        let set = self.mask();
        // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of the local set
        // during the call (pid 0: the calling thread).
        let rc = unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Binds `thread`, which the caller started and has not joined, to these CPUs: done when
    /// this returns, so nothing the thread does after it runs elsewhere.
    pub fn bind<T>(&self, thread: &std::thread::JoinHandle<T>) -> io::Result<()> {
        use std::os::unix::thread::JoinHandleExt;
        let set = self.mask();
        // SAFETY: the handle is not joined (we borrow it), so its pthread_t names a live or
        // exited-but-unjoined thread, which pthread_setaffinity_np may be given; it reads
        // `size_of::<cpu_set_t>()` bytes of the local set during the call.
        let rc = unsafe {
            libc::pthread_setaffinity_np(
                thread.as_pthread_t(),
                std::mem::size_of::<libc::cpu_set_t>(),
                &raw const set,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(rc))
        }
    }
}

/// Binds `thread`, an engine's thread just started, to `cpus` where given ([`Cpus::bind`]). The
/// set was tried when it was made, so a refusal now (a CPU taken offline since) leaves the thread
/// where it started rather than failing the engine.
pub fn bind_started<T>(cpus: Option<&Cpus>, thread: &std::thread::JoinHandle<T>) {
    if let Some(cpus) = cpus {
        let _ = cpus.bind(thread);
    }
}

/// The CPUs the calling thread may run on, where the system says.
#[must_use]
pub fn current() -> Option<Vec<usize>> {
    // SAFETY: as in `Cpus::bind_current`; sched_getaffinity writes at most
    // `size_of::<cpu_set_t>()` bytes into the local set, and CPU_ISSET reads bits below
    // CPU_SETSIZE of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) != 0 {
            return None;
        }
        Some(
            (0..CPU_LIMIT)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        )
    }
}

#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_sorted_and_deduplicated() {
        assert!(Cpus::new(vec![]).unwrap_err().contains("at least one"));
        let e = Cpus::new(vec![0, CPU_LIMIT]).unwrap_err();
        assert!(e.contains(&CPU_LIMIT.to_string()), "{e}");
        assert_eq!(Cpus::ids_checked(vec![3, 1, 3]).unwrap().ids(), &[1, 3]);
    }

    #[test]
    fn a_thread_bound_runs_on_those_cpus_only() {
        let mine = current().expect("the calling thread's affinity");
        let one = Cpus::new(vec![*mine.last().unwrap()]).unwrap();
        let seen = std::thread::spawn(move || {
            one.bind_current().unwrap();
            current()
        })
        .join()
        .unwrap();
        assert_eq!(seen, Some(vec![*mine.last().unwrap()]));
        // The caller's own affinity is untouched.
        assert_eq!(current(), Some(mine));
    }

    #[test]
    fn a_thread_started_is_bound_by_its_handle_before_it_goes_on() {
        let mine = current().expect("the calling thread's affinity");
        let first = Cpus::new(vec![mine[0]]).unwrap();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            wait.recv().unwrap();
            current()
        });
        first.bind(&t).unwrap();
        go.send(()).unwrap();
        assert_eq!(t.join().unwrap(), Some(vec![mine[0]]));
        assert_eq!(current(), Some(mine));
    }

    #[test]
    fn cpus_outside_the_system_are_refused() {
        // CPU_LIMIT - 1 exists on no machine this runs on.
        let e = Cpus::new(vec![CPU_LIMIT - 1]).unwrap_err();
        assert!(e.contains(&(CPU_LIMIT - 1).to_string()), "{e}");
    }
}
