//! The memory an engine knows: registering and unregistering regions (host buffers in pieces),
//! pinning existing host memory, and host buffers the backend allocates; each refused while a
//! transfer or a block table may still reach it.

use super::{Engine, EngineError};
use crate::direction::Direction;
use crate::hostmem;
use crate::region::{MemoryKind, RegionError};
use crate::table::BlockTable;

/// One registration of host memory in [`crate::hostmem::HostBuffer`]s: the starts of its regions
/// (one per piece it covers) and the buffers it is a user of.
#[derive(Debug)]
pub(super) struct Parts {
    pub(super) starts: Vec<u64>,
    pub(super) end: u64,
    pub(super) buffers: Vec<u64>,
}

/// Refuses to remove the registration `[start, end)` while a block table lies in it.
fn no_table_in(tables: &[Option<BlockTable>], start: u64, end: u64) -> Result<(), EngineError> {
    let used = |t: &Option<BlockTable>| t.as_ref().is_some_and(|t| t.overlaps(start, end));
    match tables.iter().position(used) {
        Some(table) => Err(RegionError::UsedByTable {
            start,
            table: table as u32,
        }
        .into()),
        None => Ok(()),
    }
}

impl Engine {
    /// Registers `[start, start + len)` as memory of `kind` that transfers may read and write.
    ///
    /// Host memory in a [`crate::hostmem::HostBuffer`] is registered as one region per piece it
    /// covers (adjacent regions: a block table may span them, no copy crosses between them), and
    /// the buffer is not unpinned until [`Engine::unregister`] removes them all.
    ///
    /// # Safety
    /// The range must be memory of that kind that stays allocated, and that nothing else frees,
    /// until it is unregistered: copies will read and write any byte of it.
    pub unsafe fn register(
        &self,
        start: u64,
        len: u64,
        kind: MemoryKind,
    ) -> Result<(), EngineError> {
        self.check_usable()?;
        let end = start.checked_add(len).filter(|_| len > 0);
        let (parts, buffers) = match end {
            Some(_) if kind == MemoryKind::Host => hostmem::acquire(start, len),
            _ => (vec![(start, len, false)], Vec::new()),
        };
        let registered = self.register_parts(start, &parts, kind, &buffers);
        if registered.is_err() {
            hostmem::release(&buffers);
        }
        registered
    }

    /// Registers adjacent `parts` (`(start, bytes, seam)`, together `[start, ...)`) as one region
    /// each: all of them or none. Where there are several, or they lie in host buffers, they are
    /// recorded as one registration at `start`, a user of `buffers`.
    fn register_parts(
        &self,
        start: u64,
        parts: &[(u64, u64, bool)],
        kind: MemoryKind,
        buffers: &[u64],
    ) -> Result<(), EngineError> {
        for &(s, len, _) in parts {
            self.backend.check_region(s, len, kind)?;
        }
        let mut state = self.lock();
        for (i, &(s, len, seam)) in parts.iter().enumerate() {
            let inserted = if seam {
                state.regions.insert_piece(s, len, kind)
            } else {
                state.regions.insert(s, len, kind)
            };
            if let Err(e) = inserted {
                for &(done, _, _) in &parts[..i] {
                    state.regions.remove(done)?;
                }
                return Err(e.into());
            }
        }
        if parts.len() > 1 || !buffers.is_empty() {
            let (last, n, _) = parts[parts.len() - 1];
            let starts = parts.iter().map(|p| p.0).collect();
            let buffers = buffers.to_vec();
            let end = last + n;
            state.parts.insert(
                start,
                Parts {
                    starts,
                    end,
                    buffers,
                },
            );
        }
        Ok(())
    }

    /// Page-locks existing host memory (`cuMemHostRegister` on CUDA) and registers it as a host
    /// region. Undone by [`Engine::unregister`].
    ///
    /// # Safety
    /// As for [`Engine::register`].
    pub unsafe fn pin(&self, start: u64, len: u64) -> Result<(), EngineError> {
        self.check_usable()?;
        let mut state = self.lock();
        // Refuse an overlap before the driver sees the range.
        state.regions.insert(start, len, MemoryKind::Host)?;
        // SAFETY: the caller vouches for the range.
        if let Err(e) = unsafe { self.backend.pin_host(start, len) } {
            state.regions.remove(start)?;
            return Err(e.into());
        }
        state.pinned.insert(start);
        Ok(())
    }

    /// Removes the region starting at `start` (unpinning or freeing what blockswap pinned or
    /// allocated there). Refused while transfers are in flight.
    pub fn unregister(&self, start: u64) -> Result<(), EngineError> {
        let mut state = self.lock_here()?;
        if state.buffers.contains_key(&start) {
            drop(state);
            return self.free_host(start);
        }
        if let Some(p) = state.parts.get(&start) {
            no_table_in(&state.tables, start, p.end)?;
            self.check_idle(start)?;
            let p = state.parts.remove(&start).expect("looked up above");
            for s in p.starts {
                state.regions.remove(s)?;
            }
            drop(state);
            hostmem::release(&p.buffers);
            return Ok(());
        }
        if let Some((&registration, _)) =
            state.parts.iter().find(|(_, p)| p.starts.contains(&start))
        {
            return Err(RegionError::PartOf {
                start,
                registration,
            }
            .into());
        }
        // What is wrong with the request itself first; whether now is a good time last.
        let Some(&r) = state.regions.starting_at(start) else {
            return Err(RegionError::NotRegistered { start }.into());
        };
        no_table_in(&state.tables, start, r.end)?;
        self.check_idle(start)?;
        state.regions.remove(start)?;
        if state.pinned.remove(&start) {
            // SAFETY: pinned by `pin`, and nothing is in flight.
            unsafe { self.backend.unpin_host(start) }?;
        }
        Ok(())
    }

    pub(super) fn check_idle(&self, start: u64) -> Result<(), RegionError> {
        let in_flight = self.unfinished();
        if in_flight > 0 {
            return Err(RegionError::Busy {
                start,
                in_flight: in_flight as usize,
            });
        }
        Ok(())
    }

    /// Transfers whose copies are not complete yet.
    pub(super) fn unfinished(&self) -> u64 {
        Direction::ALL
            .iter()
            .map(|&d| {
                let lane = &self.lanes[d.lane()];
                (lane.next_seq() - 1).saturating_sub(self.backend.completed(d))
            })
            .sum()
    }

    /// Allocates `bytes` of host memory (page-locked on CUDA) and registers it as a host region.
    /// Returns its address.
    pub fn alloc_host(&self, bytes: usize) -> Result<u64, EngineError> {
        self.check_usable()?;
        let alloc = self.backend.alloc_host(bytes)?;
        let addr = alloc.addr();
        let mut state = self.lock();
        if let Err(e) = state.regions.insert(addr, bytes as u64, MemoryKind::Host) {
            drop(state);
            // SAFETY: just allocated, never shared.
            unsafe { self.backend.free_host(alloc) };
            return Err(e.into());
        }
        state
            .buffers
            .insert(addr, (alloc, hostmem::track(addr, bytes as u64)));
        Ok(addr)
    }

    /// Frees a buffer from [`Engine::alloc_host`]. Refused while a block table lies in it (a
    /// table is checked against registered memory once, when it is registered: its later
    /// transfers would copy to and from freed memory) and while transfers are in flight.
    pub fn free_host(&self, addr: u64) -> Result<(), EngineError> {
        let mut state = self.lock_here()?;
        let Some((alloc, id)) = state.buffers.get(&addr) else {
            return Err(RegionError::NotRegistered { start: addr }.into());
        };
        let id = *id;
        no_table_in(&state.tables, addr, addr + alloc.len() as u64)?;
        self.check_idle(addr)?;
        // Another engine's registration in it would copy to and from freed memory.
        hostmem::untrack(id, false)
            .map_err(|users| RegionError::UsedElsewhere { start: addr, users })?;
        state.regions.remove(addr)?;
        let (alloc, _) = state.buffers.remove(&addr).expect("checked above");
        drop(state);
        // SAFETY: unregistered under the submit lock with nothing in flight: no copy can use it.
        unsafe { self.backend.free_host(alloc) };
        Ok(())
    }
}
