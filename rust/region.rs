//! The memory blockswap knows about.
//!
//! Addresses handed in from Python are plain integers. Before any copy is issued, every source and
//! destination range of a transfer must lie inside one region registered here, of the kind its
//! direction needs: host memory (page-locked on the CUDA backend, which checks that at
//! registration) or device memory. A stray integer can therefore never reach a copy engine or a
//! `memcpy`.
//!
//! A large host buffer is registered in pieces (one driver registration of 512 GiB or more fails;
//! see [`crate::hostmem`]): adjacent regions, each piece after the first starting at a *seam*. A
//! block table may span several adjacent regions ([`RegionTable::cover`]), or have its pages in
//! regions with gaps between them ([`RegionTable::cover_pages`]: one rank's cells of a region
//! other ranks share), but no single copy ever crosses from one region into the next, and no 2-D
//! copy joins rows across a seam.

use std::fmt;

/// What a region holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory. On the CUDA backend it is page-locked: allocated by blockswap or registered
    /// with the driver, and checked when registered.
    Host,
    /// Device memory. On the host backend, host memory standing in for the device.
    Device,
}

impl MemoryKind {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Device => "device",
        }
    }

    #[must_use]
    pub fn parse(s: &str) -> Option<MemoryKind> {
        match s {
            "host" => Some(MemoryKind::Host),
            "device" => Some(MemoryKind::Device),
            _ => None,
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A registered range `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    pub kind: MemoryKind,
    /// The region begins a piece of memory registered with the driver on its own (a piece of a
    /// host buffer, see [`crate::hostmem`]): nothing before `start` is in the same driver
    /// registration, so no copy may join bytes across it.
    pub seam: bool,
}

/// A registration that cannot be made or undone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegionError {
    /// Zero bytes, or `start + len` overflows.
    Invalid { start: u64, len: u64 },
    /// The range overlaps a region already registered.
    Overlaps {
        start: u64,
        len: u64,
        existing: Region,
    },
    /// No region starts at this address.
    NotRegistered { start: u64 },
    /// Transfers are in flight: the region cannot be removed now.
    Busy { start: u64, in_flight: usize },
    /// A block table lies in the region: unregister the table first.
    UsedByTable { start: u64, table: u32 },
    /// The region is a piece of a registration made at another address (a host buffer registered
    /// in pieces): that registration is removed as a whole.
    PartOf { start: u64, registration: u64 },
    /// Other engines hold registrations in the host buffer at `start`: it cannot be freed.
    UsedElsewhere { start: u64, users: usize },
}

impl fmt::Display for RegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RegionError::Invalid { start, len } => {
                write!(
                    f,
                    "cannot register {len} bytes at {start:#x}: empty or overflowing range"
                )
            }
            RegionError::Overlaps {
                start,
                len,
                existing,
            } => write!(
                f,
                "[{start:#x}, +{len}) overlaps the registered {} region [{:#x}, {:#x})",
                existing.kind, existing.start, existing.end
            ),
            RegionError::NotRegistered { start } => {
                write!(f, "no registered region starts at {start:#x}")
            }
            RegionError::UsedByTable { start, table } => write!(
                f,
                "block table {table} lies in the region at {start:#x}: unregister the table first"
            ),
            RegionError::UsedElsewhere { start, users } => write!(
                f,
                "the host buffer at {start:#x} is registered with {users} other engine(s): \
                 unregister it there first"
            ),
            RegionError::PartOf {
                start,
                registration,
            } => write!(
                f,
                "the region at {start:#x} is a piece of the registration at {registration:#x}: \
                 unregister {registration:#x}"
            ),
            RegionError::Busy { start, in_flight } => write!(
                f,
                "region at {start:#x} cannot be removed while {in_flight} transfers are in flight"
            ),
        }
    }
}

impl std::error::Error for RegionError {}

/// Registered regions, sorted by start and pairwise disjoint.
#[derive(Clone, Debug, Default)]
pub struct RegionTable {
    regions: Vec<Region>,
}

impl RegionTable {
    /// Registers `[start, start + len)`.
    pub fn insert(&mut self, start: u64, len: u64, kind: MemoryKind) -> Result<(), RegionError> {
        self.insert_region(start, len, kind, false)
    }

    /// Registers `[start, start + len)` as a piece of host memory the driver registered on its
    /// own: its start is a seam (see [`Region::seam`]).
    pub fn insert_piece(
        &mut self,
        start: u64,
        len: u64,
        kind: MemoryKind,
    ) -> Result<(), RegionError> {
        self.insert_region(start, len, kind, true)
    }

    fn insert_region(
        &mut self,
        start: u64,
        len: u64,
        kind: MemoryKind,
        seam: bool,
    ) -> Result<(), RegionError> {
        let end = match start.checked_add(len) {
            Some(end) if len > 0 => end,
            _ => return Err(RegionError::Invalid { start, len }),
        };
        let at = self.regions.partition_point(|r| r.start < start);
        for neighbour in [at.checked_sub(1), Some(at)].into_iter().flatten() {
            if let Some(&r) = self.regions.get(neighbour) {
                if r.start < end && start < r.end {
                    return Err(RegionError::Overlaps {
                        start,
                        len,
                        existing: r,
                    });
                }
            }
        }
        self.regions.insert(
            at,
            Region {
                start,
                end,
                kind,
                seam,
            },
        );
        Ok(())
    }

    /// The region that starts at `start`, if any (a binary search: an engine may hold a region
    /// per row of a large cache).
    #[must_use]
    pub fn starting_at(&self, start: u64) -> Option<&Region> {
        self.index_of(start).map(|i| &self.regions[i])
    }

    fn index_of(&self, start: u64) -> Option<usize> {
        self.regions.binary_search_by_key(&start, |r| r.start).ok()
    }

    /// Removes the region that starts at `start`.
    pub fn remove(&mut self, start: u64) -> Result<Region, RegionError> {
        match self.index_of(start) {
            Some(i) => Ok(self.regions.remove(i)),
            None => Err(RegionError::NotRegistered { start }),
        }
    }

    /// The registered regions, in address order.
    #[must_use]
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.regions.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// The index of the region of `kind` that holds all of `[addr, addr + len)`, if any.
    ///
    /// `hint` carries the last hit between calls: the blocks of one transfer mostly fall in the
    /// same few regions, so the common case is two comparisons instead of a binary search.
    /// `addr + len` must not overflow (the caller checked).
    #[inline]
    pub fn locate(&self, addr: u64, len: u64, kind: MemoryKind, hint: &mut usize) -> Option<usize> {
        let end = addr + len;
        if let Some(r) = self.regions.get(*hint) {
            if r.start <= addr && end <= r.end && r.kind == kind {
                return Some(*hint);
            }
        }
        let at = self
            .regions
            .partition_point(|r| r.start <= addr)
            .checked_sub(1)?;
        let r = self.regions[at];
        if end <= r.end && r.kind == kind {
            *hint = at;
            Some(at)
        } else {
            None
        }
    }

    /// The seams strictly inside `(lo, hi)`, in address order.
    pub fn seams(&self, lo: u64, hi: u64) -> impl Iterator<Item = u64> + '_ {
        let from = self.regions.partition_point(|r| r.start <= lo);
        self.regions[from..]
            .iter()
            .take_while(move |r| r.start < hi)
            .filter(|r| r.seam)
            .map(|r| r.start)
    }

    /// The regions of `kind` that together hold all of `[addr, addr + len)`: their indices, each
    /// region starting where the one before it ends. `None` where a byte of the range lies in no
    /// region of `kind`. One index where a single region holds the range; the starts of the
    /// others are the boundaries inside the range. `len` must be positive and `addr + len` must
    /// not overflow (the caller checked).
    #[must_use]
    pub fn cover(&self, addr: u64, len: u64, kind: MemoryKind) -> Option<std::ops::Range<usize>> {
        self.cover_pages(addr, 0, 1, len, kind).ok()
    }

    /// Where the pages `[addr + b * stride, +size)`, `b` in `0..num_blocks`, each lie in regions
    /// of `kind` as [`Self::cover`] takes a range, with or without bytes between pages that no
    /// region holds (one rank's cells of a region other ranks share, each cell registered on its
    /// own): the indices from the first page's region to the last page's. `Err(b)`: page `b` is
    /// the first that is not inside registered memory of `kind`. `size` and `num_blocks` must be
    /// positive, `stride >= size` where there are several pages, and the last page must not
    /// overflow (the caller checked). The pages inside one run of adjacent regions are taken
    /// together, so the work grows with the regions met, not with `num_blocks`.
    pub fn cover_pages(
        &self,
        addr: u64,
        stride: u64,
        num_blocks: u64,
        size: u64,
        kind: MemoryKind,
    ) -> Result<std::ops::Range<usize>, u64> {
        let regions = &self.regions;
        // The first region that ends after the current page's start: pages go up, so it only
        // moves forward.
        let mut at = regions.partition_point(|r| r.end <= addr);
        let mut first = None;
        let mut last = at;
        let mut b = 0;
        while b < num_blocks {
            let page = addr + b * stride;
            while regions.get(at).is_some_and(|r| r.end <= page) {
                at += 1;
            }
            if !regions
                .get(at)
                .is_some_and(|r| r.start <= page && r.kind == kind)
            {
                return Err(b);
            }
            // The run of adjacent regions of `kind` from the one holding the page.
            let mut j = at;
            while regions
                .get(j + 1)
                .is_some_and(|n| n.start == regions[j].end && n.kind == kind)
            {
                j += 1;
            }
            let end = regions[j].end;
            if end - page < size {
                return Err(b);
            }
            // Every later page that ends inside the run is in it too; the next one is not.
            let through = match (end - size - addr).checked_div(stride) {
                Some(k) => k.min(num_blocks - 1),
                None => num_blocks - 1,
            };
            let reach = addr + through * stride + size;
            first.get_or_insert(at);
            last = at + regions[at..=j].partition_point(|r| r.start < reach) - 1;
            b = through + 1;
        }
        Ok(first.map_or(0..0, |f| f..last + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cover_pages_takes_the_pages_a_run_holds_together() {
        // Two cells of 256 bytes a row of 1 KiB, the second followed by an adjacent region
        // (one run), and a huge region after a gap.
        let mut t = RegionTable::default();
        for (start, len) in [
            (0x1000, 256),
            (0x1400, 256),
            (0x1500, 256),
            (0x2000, 1 << 62),
        ] {
            t.insert(start, len, MemoryKind::Host).unwrap();
        }
        // (first page, stride, pages, page bytes, kind) and what covers them.
        let host = MemoryKind::Host;
        let cases = [
            ((0x1000, 1024, 2, 256, host), Ok(0..2)),
            ((0x1000, 1024, 2, 512, host), Err(0)),
            ((0x1400, 256, 2, 256, host), Ok(1..3)),
            ((0x1000, 1024, 3, 256, host), Err(2)),
            ((0x1000, 1024, 2, 256, MemoryKind::Device), Err(0)),
        ];
        for ((a, stride, n, size, kind), want) in cases {
            assert_eq!(t.cover_pages(a, stride, n, size, kind), want, "{a:#x} {n}");
        }
        // 2^61 pages of a byte through one region, then a gap: answered at once, naming it.
        let n = 1u64 << 61;
        assert_eq!(t.cover_pages(0x2000, 1, n, 1, MemoryKind::Host), Ok(3..4));
        let after = 0x2000 + (1u64 << 62);
        assert_eq!(
            t.cover_pages(0x2000, 2, (1 << 61) + 4, 1, MemoryKind::Host),
            Err((after - 0x2000) / 2)
        );
    }

    #[test]
    fn insert_rejects_overlap_and_empty() {
        let mut t = RegionTable::default();
        t.insert(100, 100, MemoryKind::Host).unwrap();
        t.insert(300, 100, MemoryKind::Device).unwrap();
        t.insert(200, 100, MemoryKind::Host).unwrap(); // touching both neighbours is fine
        assert!(matches!(
            t.insert(150, 10, MemoryKind::Host),
            Err(RegionError::Overlaps { .. })
        ));
        assert!(matches!(
            t.insert(50, 51, MemoryKind::Host),
            Err(RegionError::Overlaps { .. })
        ));
        assert!(matches!(
            t.insert(399, 5, MemoryKind::Host),
            Err(RegionError::Overlaps { .. })
        ));
        assert_eq!(
            t.insert(0, 0, MemoryKind::Host),
            Err(RegionError::Invalid { start: 0, len: 0 })
        );
        assert!(matches!(
            t.insert(u64::MAX, 2, MemoryKind::Host),
            Err(RegionError::Invalid { .. })
        ));
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn locate_checks_bounds_and_kind() {
        let mut t = RegionTable::default();
        t.insert(100, 100, MemoryKind::Host).unwrap();
        t.insert(200, 100, MemoryKind::Device).unwrap();
        let mut hint = usize::MAX;
        assert_eq!(t.locate(100, 100, MemoryKind::Host, &mut hint), Some(0));
        assert_eq!(t.locate(150, 10, MemoryKind::Host, &mut hint), Some(0));
        assert_eq!(
            t.locate(150, 51, MemoryKind::Host, &mut hint),
            None,
            "crosses into the next region"
        );
        assert_eq!(
            t.locate(99, 2, MemoryKind::Host, &mut hint),
            None,
            "starts before"
        );
        assert_eq!(
            t.locate(250, 10, MemoryKind::Host, &mut hint),
            None,
            "wrong kind"
        );
        assert_eq!(t.locate(250, 10, MemoryKind::Device, &mut hint), Some(1));
        assert_eq!(
            t.locate(300, 1, MemoryKind::Device, &mut hint),
            None,
            "past the end"
        );
        assert_eq!(t.locate(0, 1, MemoryKind::Host, &mut hint), None);
    }

    #[test]
    fn cover_takes_adjacent_regions_of_one_kind() {
        let mut t = RegionTable::default();
        t.insert(100, 100, MemoryKind::Host).unwrap();
        t.insert(200, 50, MemoryKind::Host).unwrap();
        t.insert(250, 50, MemoryKind::Device).unwrap();
        t.insert(400, 100, MemoryKind::Host).unwrap();
        assert_eq!(t.cover(120, 50, MemoryKind::Host), Some(0..1));
        assert_eq!(t.cover(120, 100, MemoryKind::Host), Some(0..2));
        assert_eq!(t.cover(100, 150, MemoryKind::Host), Some(0..2));
        assert_eq!(t.cover(200, 50, MemoryKind::Host), Some(1..2));
        assert_eq!(
            t.cover(120, 140, MemoryKind::Host),
            None,
            "runs into device memory"
        );
        assert_eq!(t.cover(260, 10, MemoryKind::Device), Some(2..3));
        assert_eq!(t.cover(280, 130, MemoryKind::Device), None, "a gap");
        assert_eq!(t.cover(290, 20, MemoryKind::Host), None);
        assert_eq!(t.cover(300, 10, MemoryKind::Host), None, "in the gap");
        assert_eq!(t.cover(50, 60, MemoryKind::Host), None, "starts before");
        assert_eq!(t.cover(450, 51, MemoryKind::Host), None, "past the end");
        assert_eq!(RegionTable::default().cover(0, 1, MemoryKind::Host), None);
    }

    #[test]
    fn seams_are_the_starts_of_pieces() {
        let mut t = RegionTable::default();
        t.insert(100, 100, MemoryKind::Host).unwrap();
        t.insert_piece(200, 100, MemoryKind::Host).unwrap();
        t.insert_piece(300, 100, MemoryKind::Host).unwrap();
        t.insert(400, 100, MemoryKind::Host).unwrap();
        assert_eq!(t.seams(0, 1000).collect::<Vec<_>>(), [200, 300]);
        assert_eq!(t.seams(200, 300).count(), 0, "strictly inside");
        assert_eq!(t.seams(199, 301).collect::<Vec<_>>(), [200, 300]);
    }

    #[test]
    fn remove_only_registered_starts() {
        let mut t = RegionTable::default();
        t.insert(100, 100, MemoryKind::Host).unwrap();
        assert_eq!(
            t.remove(150),
            Err(RegionError::NotRegistered { start: 150 })
        );
        assert_eq!(t.remove(100).unwrap().end, 200);
        assert!(t.is_empty());
    }
}
