//! Host memory for large CPU caches: exactly the bytes asked for, one contiguous virtual range,
//! page-locked in pieces.
//!
//! A CPU KV cache is `rows` rows of `row_bytes` (a row: a CPU sub-block or chunk, every page it
//! holds). Allocated as one pinned tensor it costs more than it holds at serving sizes: torch's
//! pinned allocator rounds a request up to a power of two (a 40 GiB cache takes 64 GiB), and the
//! CUDA driver fails one registration of 512 GiB or more. A [`HostBuffer`] maps exactly the bytes
//! asked for (an anonymous mapping, zeroed) and page-locks it in pieces ([`plan_pieces`]): each a
//! whole number of rows, at most a given size, and ending on an OS page, since page-locking is
//! per page and two pieces must not share one.
//!
//! While a buffer is pinned its pieces are recorded in a process-wide table, and
//! [`crate::engine::Engine::register`] cuts a host registration at their boundaries: every
//! registered region lies inside one piece, a block table may span several adjacent ones
//! ([`crate::table`]), and no descriptor or 2-D copy crosses from one piece into the next. An
//! engine holding such a registration is a user of the buffer: the buffer is not unpinned while
//! it has users, and memory whose owner is dropped first is released by the last user to let go
//! (an engine that gave up on transfers in flight never lets go: the device may still write it).
//!
//! On the host backend the same code runs without a driver: nothing is page-locked, but the
//! pieces are recorded and cut registrations all the same, so the piece logic is tested without a
//! GPU.

use crate::sync::MutexExt;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::backend::BackendError;

/// One driver registration of this many bytes or more fails (`cuMemHostRegister`): no piece may
/// be this large.
pub const REGISTRATION_LIMIT: u64 = 512 << 30;

/// The largest piece by default (4 GiB): small enough that the pieces of a large buffer are
/// page-locked while the next ones are faulted in ([`fill_and_pin`]), which made 16-32 GiB ready
/// at 24-28 GiB/s against 13-16 GiB/s in one piece (H200 machine, `benches/probe_pinning.py`,
/// docs/benchmarks.md); far below [`REGISTRATION_LIMIT`].
pub const DEFAULT_PIECE_BYTES: u64 = 4 << 30;

/// What a [`HostBuffer`] cannot do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostBufferError {
    /// Rows, row bytes or the piece size that cannot make a buffer, with why.
    Size(String),
    /// Engines still hold registrations in the buffer: unregister them first.
    InUse { users: usize },
    /// The mapping or a driver call failed.
    Backend(BackendError),
}

impl fmt::Display for HostBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostBufferError::Size(why) => f.write_str(why),
            HostBufferError::InUse { users } => write!(
                f,
                "the host buffer is registered with {users} engine(s): unregister it from them \
                 first (an engine that is shut down keeps its registrations until then, or until \
                 it is dropped)"
            ),
            HostBufferError::Backend(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for HostBufferError {}

impl From<BackendError> for HostBufferError {
    fn from(e: BackendError) -> Self {
        HostBufferError::Backend(e)
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The pieces of a buffer of `rows` rows of `row_bytes`: `(offset, bytes)` each, in order,
/// covering the buffer. One piece where the buffer fits in `max_piece_bytes`; otherwise as many
/// whole rows per piece as fit in it, rounded down so that every piece boundary falls on a multiple
/// of `page` bytes (the OS page: page-locking is per page), the last piece taking the rest.
///
/// Refused: no row or an empty row, a size past the address space, a piece size of 0 or of
/// [`REGISTRATION_LIMIT`] or more, a row larger than a piece, or rows whose page-aligned multiple
/// does not fit in a piece.
pub fn plan_pieces(
    rows: u64,
    row_bytes: u64,
    max_piece_bytes: u64,
    page: u64,
) -> Result<Vec<(u64, u64)>, HostBufferError> {
    let size = |why: String| Err(HostBufferError::Size(why));
    if rows == 0 || row_bytes == 0 {
        return size(format!(
            "a host buffer of {rows} rows of {row_bytes} bytes: both must be positive"
        ));
    }
    let total = match rows.checked_mul(row_bytes) {
        Some(t) if isize::try_from(t).is_ok() => t,
        _ => {
            return size(format!(
                "{rows} rows of {row_bytes} bytes are more than the address space holds"
            ))
        }
    };
    if max_piece_bytes == 0 || max_piece_bytes >= REGISTRATION_LIMIT {
        return size(format!(
            "piece_bytes must be from 1 to {} (one driver registration of {} bytes or more \
             fails), not {max_piece_bytes}",
            REGISTRATION_LIMIT - 1,
            REGISTRATION_LIMIT
        ));
    }
    if total <= max_piece_bytes {
        return Ok(vec![(0, total)]);
    }
    let fit = max_piece_bytes / row_bytes;
    if fit == 0 {
        return size(format!(
            "a row of {row_bytes} bytes does not fit in a piece of {max_piece_bytes} bytes (a row \
             is never split): raise piece_bytes"
        ));
    }
    // Rows per piece must be a multiple of `quantum` for its end to fall on a page.
    let page = page.max(1);
    let quantum = page / gcd(row_bytes, page);
    let per = fit / quantum * quantum;
    if per == 0 {
        return size(format!(
            "pieces of rows of {row_bytes} bytes end on a {page}-byte page every {quantum} rows \
             ({} bytes), more than a piece of {max_piece_bytes} bytes: raise piece_bytes",
            quantum * row_bytes
        ));
    }
    Ok((0..rows)
        .step_by(per as usize)
        .map(|first| (first * row_bytes, per.min(rows - first) * row_bytes))
        .collect())
}

/// How far [`HostBuffer::with_progress`] got, for another thread to report: of `total` bytes,
/// how many are faulted in (up to `total`), and of the `to_lock` bytes to page-lock (0 where
/// nothing is), how many are.
#[derive(Debug, Default)]
pub struct AllocProgress {
    total: AtomicU64,
    faulted: AtomicU64,
    locked: AtomicU64,
    to_lock: AtomicU64,
}

impl AllocProgress {
    /// Sets the bytes there are to fault in and to page-lock, and those already faulted in.
    pub fn start(&self, total: u64, faulted: u64, to_lock: u64) {
        // Relaxed: a progress report only.
        self.total.store(total, Ordering::Relaxed);
        self.faulted.store(faulted, Ordering::Relaxed);
        self.to_lock.store(to_lock, Ordering::Relaxed);
    }

    /// `(total, faulted, locked, to_lock)` bytes now.
    #[must_use]
    pub fn get(&self) -> (u64, u64, u64, u64) {
        // Relaxed: counters read for a report; they need not agree with each other.
        (
            self.total.load(Ordering::Relaxed),
            self.faulted.load(Ordering::Relaxed),
            self.locked.load(Ordering::Relaxed),
            self.to_lock.load(Ordering::Relaxed),
        )
    }
}

/// The host's available memory in bytes (`MemAvailable` in /proc/meminfo), where it can be read:
/// what an allocation that failed is measured against in its message.
#[must_use]
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

/// `bytes` in GiB with two decimals (`64.00 GiB`).
fn gib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // two decimals of a byte count
    let g = bytes as f64 / f64::from(1u32 << 30);
    format!("{g:.2} GiB")
}

/// An OS error as `errno 12 (Cannot allocate memory)`.
fn os_error(err: &std::io::Error) -> String {
    let text = err.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text);
    match err.raw_os_error() {
        Some(n) => format!("errno {n} ({text})"),
        None => text.to_string(),
    }
}

/// A host buffer that could not be mapped or page-locked, said the way a person sizing a cache
/// needs it: the size in GiB (and bytes), why, and what the host has available.
fn no_memory(what: &str, bytes: u64, why: &str) -> BackendError {
    let available = available_memory().map_or_else(|| "an unknown amount".to_string(), gib);
    BackendError::BadMemory(format!(
        "could not {what} {} ({bytes} bytes) of host memory: {why}; the host has {available} \
         available (MemAvailable)",
        gib(bytes)
    ))
}

/// The OS page size.
#[must_use]
pub fn os_page() -> u64 {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Page-locks host ranges with the driver (`cuMemHostRegister` on CUDA).
pub trait Pinner: Send + Sync + fmt::Debug {
    /// Page-locks `[start, start + len)`.
    ///
    /// # Safety
    /// The range must be mapped host memory that stays mapped until [`Pinner::unpin`].
    unsafe fn pin(&self, start: u64, len: u64) -> Result<(), BackendError>;

    /// Undoes [`Pinner::pin`] of the range starting at `start`.
    ///
    /// # Safety
    /// No copy may reach the range any more.
    unsafe fn unpin(&self, start: u64) -> Result<(), BackendError>;
}

impl Pinner for crate::backend::cuda::HostPinner {
    unsafe fn pin(&self, start: u64, len: u64) -> Result<(), BackendError> {
        // SAFETY: the caller's contract is the pinner's own.
        unsafe { crate::backend::cuda::HostPinner::pin(self, start, len) }
    }

    unsafe fn unpin(&self, start: u64) -> Result<(), BackendError> {
        // SAFETY: as above.
        unsafe { crate::backend::cuda::HostPinner::unpin(self, start) }
    }
}

/// The mapping of a buffer and the pieces pinned in it: released (unpinned, then unmapped) by its
/// owner, or by the last engine using it where the owner went first.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// `(start, bytes, pinned)` per piece.
    pieces: Vec<(u64, u64, bool)>,
    pinner: Option<Box<dyn Pinner>>,
}

// SAFETY: a Mapping is an owned range of host memory and a thread-safe pinner; nothing about it
// is tied to a thread.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Unpins every piece still pinned; the first failure is returned (its piece stays pinned).
    ///
    /// # Safety
    /// No copy may reach the memory any more.
    unsafe fn unpin(&mut self) -> Result<(), BackendError> {
        let Some(pinner) = &self.pinner else {
            return Ok(());
        };
        let mut first = Ok(());
        for (start, _, pinned) in &mut self.pieces {
            if *pinned {
                // SAFETY: pinned by `pin` at this start; the caller guarantees no copy reaches it.
                match unsafe { pinner.unpin(*start) } {
                    Ok(()) => *pinned = false,
                    Err(e) => {
                        if first.is_ok() {
                            first = Err(e);
                        }
                    }
                }
            }
        }
        first
    }

    /// Unpins, then unmaps. Where a piece cannot be unpinned the mapping is left in place (the
    /// driver still holds its pages): leaked, never unmapped under the driver.
    ///
    /// # Safety
    /// No copy and no reference may reach the memory any more.
    unsafe fn release(mut self) {
        // SAFETY: the caller's guarantee.
        if unsafe { self.unpin() }.is_err() {
            return;
        }
        self.pinner = None;
        // SAFETY: mapped by `map` with this length; nothing reaches it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A buffer's pieces in the process-wide table, while pinned (see the module's documentation).
#[derive(Debug)]
struct Live {
    id: u64,
    start: u64,
    end: u64,
    /// Starts of the pieces after the first.
    cuts: Vec<u64>,
    /// Engine registrations in the buffer.
    users: usize,
    /// The buffer's memory, where its owner was dropped while engines still used it: the last
    /// user releases it.
    orphan: Option<Mapping>,
}

/// The table of one process image: a forked child makes its own (see [`live`]).
struct Table {
    generation: u64,
    live: Mutex<Vec<Live>>,
}

static TABLE: AtomicPtr<Table> = AtomicPtr::new(ptr::null_mut());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn live() -> MutexGuard<'static, Vec<Live>> {
    // Every mutation is a single push, remove or field update: a poisoned lock holds consistent
    // data.
    table().live.locked()
}

/// This process image's table. A child forked while a thread of the parent held the parent's
/// table would wait for that lock forever, and the parent's buffers are not the child's (their
/// operations refuse in it): the child starts a table of its own on first use, and the parent's
/// is left as it is.
fn table() -> &'static Table {
    // Forks are counted from the first use of the table on, an engine made or not.
    crate::fork::install_fork_hook();
    let generation = crate::fork::fork_generation();
    let mut current = TABLE.load(Ordering::Acquire);
    loop {
        // SAFETY: a table is published once, whole, and never freed: a non-null pointer read
        // here stays valid for the life of the process.
        if let Some(t) = unsafe { current.as_ref() } {
            if t.generation == generation {
                return t;
            }
        }
        let fresh = Box::into_raw(Box::new(Table {
            generation,
            live: Mutex::new(Vec::new()),
        }));
        match TABLE.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // The table replaced (an earlier image's) is leaked: a thread that no longer exists
            // may hold its lock.
            // SAFETY: just published, never freed (above).
            Ok(_) => return unsafe { &*fresh },
            Err(other) => {
                // SAFETY: never published: this thread owns it alone.
                drop(unsafe { Box::from_raw(fresh) });
                current = other;
            }
        }
    }
}

/// `[start, start + len)` cut where a piece of a pinned buffer begins or ends inside it, as
/// `(start, bytes, seam)`: `seam` where the part begins at such a boundary (see
/// [`crate::region::Region::seam`]); and the buffers it overlaps, each counting one more user
/// until [`release`]. A range in no buffer comes back whole, with none. `len` must be positive and
/// `start + len` must not overflow.
pub(crate) fn acquire(start: u64, len: u64) -> (Vec<(u64, u64, bool)>, Vec<u64>) {
    let end = start + len;
    let mut cuts = Vec::new();
    let mut ids = Vec::new();
    let mut seam = false;
    for b in live().iter_mut().filter(|b| b.start < end && start < b.end) {
        b.users += 1;
        ids.push(b.id);
        let edges = [b.start, b.end].into_iter().chain(b.cuts.iter().copied());
        for c in edges {
            seam |= c == start;
            if start < c && c < end {
                cuts.push(c);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut parts = Vec::with_capacity(cuts.len() + 1);
    let mut at = start;
    for c in cuts {
        parts.push((at, c - at, seam));
        at = c;
        seam = true;
    }
    parts.push((at, end - at, seam));
    (parts, ids)
}

/// Holds the table's lock for `d` (tests: a thread forking meanwhile).
pub fn hold_table(d: std::time::Duration) {
    let _table = live();
    std::thread::sleep(d);
}

/// Records `[start, start + len)`, a buffer an engine allocated itself
/// ([`crate::engine::Engine::alloc_host`]), in the process-wide table: registrations of other
/// engines in it then count as its users ([`acquire`]), and its owner does not free it under
/// them ([`untrack`]). Returns its id.
pub(crate) fn track(start: u64, len: u64) -> u64 {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    live().push(Live {
        id,
        start,
        end: start + len,
        cuts: Vec::new(),
        users: 0,
        orphan: None,
    });
    id
}

/// Forgets buffer `id` (a [`HostBuffer`]'s, or [`track`]'s) where no engine holds a registration
/// in it, or anyway with `force` (its owner is going away, and raw registrations vouch for their
/// memory); else the number of those registrations.
pub(crate) fn untrack(id: u64, force: bool) -> Result<(), usize> {
    forget(&mut live(), id, force)
}

/// [`untrack`] in a table its caller holds locked.
fn forget(table: &mut Vec<Live>, id: u64, force: bool) -> Result<(), usize> {
    if let Some(i) = table.iter().position(|b| b.id == id) {
        if table[i].users > 0 && !force {
            return Err(table[i].users);
        }
        table.remove(i);
    }
    Ok(())
}

/// Undoes one [`acquire`] of each buffer in `ids`. The last user of a buffer whose owner is gone
/// releases its memory.
pub(crate) fn release(ids: &[u64]) {
    let mut freed = Vec::new();
    {
        let mut table = live();
        for id in ids {
            if let Some(i) = table.iter().position(|b| b.id == *id) {
                table[i].users -= 1;
                if table[i].users == 0 && table[i].orphan.is_some() {
                    freed.extend(table.remove(i).orphan);
                }
            }
        }
    }
    for m in freed {
        // SAFETY: its owner is gone and so is its last registration: nothing reaches it.
        unsafe { m.release() };
    }
}

/// A host buffer of `rows` rows of `row_bytes`, exactly that size, page-locked in pieces of whole
/// rows where a [`Pinner`] is given (see the module's documentation). Unpinned and unmapped when
/// dropped (or later, by the last engine still registered in it).
#[derive(Debug)]
pub struct HostBuffer {
    id: u64,
    addr: u64,
    len: u64,
    rows: u64,
    row_bytes: u64,
    /// `(start, bytes)` per piece.
    pieces: Vec<(u64, u64)>,
    /// `None` once handed over (drop) or in a forked child's copy.
    mapping: Mutex<Option<Mapping>>,
    /// [`crate::fork::fork_generation`] when made.
    generation: u64,
}

impl HostBuffer {
    /// Maps `rows * row_bytes` bytes and page-locks them with `pinner` in pieces of at most
    /// `max_piece_bytes` ([`plan_pieces`]); without a pinner nothing is page-locked, but the
    /// pieces are recorded all the same. A failure undoes everything done so far.
    pub fn new(
        rows: u64,
        row_bytes: u64,
        max_piece_bytes: u64,
        pinner: Option<Box<dyn Pinner>>,
    ) -> Result<Self, HostBufferError> {
        Self::with_progress(rows, row_bytes, max_piece_bytes, pinner, None)
    }

    /// [`HostBuffer::new`], counting in `progress` what is done: with a pinner, the memory is
    /// faulted in from [`fill_threads`] threads (the work `cuMemHostRegister` would otherwise do
    /// inside one call per piece, minutes for a large cache) while the pieces are page-locked one
    /// after the other as each is in ([`fill_and_pin`]), so another thread can report how far it
    /// got and how fast.
    pub fn with_progress(
        rows: u64,
        row_bytes: u64,
        max_piece_bytes: u64,
        pinner: Option<Box<dyn Pinner>>,
        progress: Option<&AllocProgress>,
    ) -> Result<Self, HostBufferError> {
        crate::fork::install_fork_hook();
        let plan = plan_pieces(rows, row_bytes, max_piece_bytes, os_page())?;
        let len = (rows * row_bytes) as usize;
        // SAFETY: a new anonymous private mapping where the kernel chooses; no existing memory is
        // touched.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            return Err(no_memory("map", len as u64, &os_error(&err)).into());
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| no_memory("map", len as u64, "mmap returned a null address"))?;
        let addr = ptr.as_ptr() as u64;
        if pinner.is_some() {
            // Advice only, so failures are ignored. Huge pages: fewer pages to fault in and lock.
            // Not inherited by a fork: the kernel would copy every pinned page into the child
            // at once (and the child's copy is none of the driver's business).
            // SAFETY: advice on the mapping just made; no memory is read or written.
            unsafe {
                libc::madvise(p, len, libc::MADV_HUGEPAGE);
                libc::madvise(p, len, libc::MADV_DONTFORK);
            }
        }
        if let Some(progress) = progress {
            let to_lock = if pinner.is_some() { len as u64 } else { 0 };
            progress.start(len as u64, 0, to_lock);
        }
        let mut mapping = Mapping {
            ptr,
            len,
            pieces: plan.iter().map(|&(o, n)| (addr + o, n, false)).collect(),
            pinner,
        };
        if let Some(pinner) = &mapping.pinner {
            let pieces: Vec<(u64, u64)> = mapping.pieces.iter().map(|&(s, n, _)| (s, n)).collect();
            // SAFETY: the mapping just made, private, anonymous (zeros) and written by nobody,
            // stays mapped until the pieces are unpinned.
            let filled = unsafe {
                fill_and_pin(
                    &[(addr, len as u64)],
                    &[],
                    &pieces,
                    Some(pinner.as_ref()),
                    (fill_threads(), LOCK_THREADS),
                    Fallback::TouchZero,
                    progress,
                )
            };
            if let Err(FillError { piece, error }) = filled {
                // Nothing is left locked.
                let why = match piece {
                    Some(i) => {
                        format!("piece {i} ({} at most) failed: {error}", gib(pieces[i].1))
                    }
                    None => error.to_string(),
                };
                // SAFETY: never shared: nothing reaches the memory.
                unsafe { mapping.release() };
                return Err(no_memory("page-lock", len as u64, &why).into());
            }
            for p in &mut mapping.pieces {
                p.2 = true;
            }
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let pieces: Vec<(u64, u64)> = mapping.pieces.iter().map(|&(s, n, _)| (s, n)).collect();
        live().push(Live {
            id,
            start: addr,
            end: addr + len as u64,
            cuts: pieces.iter().skip(1).map(|p| p.0).collect(),
            users: 0,
            orphan: None,
        });
        Ok(HostBuffer {
            id,
            addr,
            len: len as u64,
            rows,
            row_bytes,
            pieces,
            mapping: Mutex::new(Some(mapping)),
            generation: crate::fork::fork_generation(),
        })
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    pub fn row_bytes(&self) -> u64 {
        self.row_bytes
    }

    /// `(start, bytes)` of each piece, in address order.
    pub fn pieces(&self) -> &[(u64, u64)] {
        &self.pieces
    }

    fn mapping(&self) -> MutexGuard<'_, Option<Mapping>> {
        self.mapping.locked()
    }

    /// Whether the pieces are page-locked now (never on the host backend).
    pub fn is_pinned(&self) -> bool {
        self.mapping()
            .as_ref()
            .is_some_and(|m| m.pieces.iter().any(|p| p.2))
    }

    /// Engine registrations in the buffer now.
    pub fn users(&self) -> usize {
        live()
            .iter()
            .find(|b| b.id == self.id)
            .map_or(0, |b| b.users)
    }

    /// Unpins every piece now and forgets them (registrations are no longer cut at them); the
    /// memory stays mapped until the buffer is dropped. Refused while engines hold registrations
    /// in it. Idempotent.
    pub fn unpin(&self) -> Result<(), HostBufferError> {
        if crate::fork::fork_generation() != self.generation {
            return Err(BackendError::Forked.into());
        }
        let mut mapping = self.mapping();
        // The table stays locked until the driver has unlocked every piece: a registration
        // made in between would find no buffer there while the driver still reports the memory
        // page-locked, and be kept on memory that becomes pageable (a kernel reading it through
        // its device address would then fault). Registrations wait for the unpinning instead,
        // then find the memory pageable and are refused.
        let mut table = live();
        forget(&mut table, self.id, false).map_err(|users| HostBufferError::InUse { users })?;
        match mapping.as_mut() {
            // SAFETY: no engine holds a registration in it, so no copy can reach it.
            Some(m) => unsafe { m.unpin() }.map_err(Into::into),
            None => Ok(()),
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Not `lock`: a child forked while a thread of the parent held it would wait forever.
        let mapping = self.mapping.value_mut();
        let Some(mapping) = mapping.take() else {
            return;
        };
        if crate::fork::fork_generation() != self.generation {
            // A forked child's copy: the driver state and the pinner are the parent's.
            std::mem::forget(mapping);
            return;
        }
        {
            let mut table = live();
            if let Some(i) = table.iter().position(|b| b.id == self.id) {
                if table[i].users > 0 {
                    // Engines still hold registrations: the last one releases the memory.
                    table[i].orphan = Some(mapping);
                    return;
                }
                table.remove(i);
            }
        }
        // SAFETY: no engine holds a registration in it and its owner is going away.
        unsafe { mapping.release() };
    }
}

mod fill;
mod huge;
pub use fill::{fill_and_pin, fill_threads, Fallback, FillError, FILL_ITEM, LOCK_THREADS};
pub use huge::{shmem_huge, ShmemHuge};

#[cfg(test)]
mod tests;
