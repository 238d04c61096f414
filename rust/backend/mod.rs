//! Backends: what actually moves bytes.
//!
//! A backend enqueues the copies of one transfer on an ordered lane (one per [`Direction`]) and
//! makes that lane's completed sequence number reach the transfer's sequence number once the
//! copies are done. The engine reads completed sequence numbers without locks; the backend decides
//! how they are produced (a worker thread's atomic store on the host backend, a stream writing into
//! mapped pinned memory on CUDA).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::direction::Direction;
use crate::region::MemoryKind;
use crate::slab::SlabRef;

pub use crate::slab::HostAlloc;

pub mod cuda;
pub mod host;

/// Adds the time from [`AddElapsed::start`] to its drop to a counter, on every way out: the
/// host-time statistics of the engine (`submit_ns`, `prepare_ns`) and of the CUDA backend
/// (`driver_ns`).
pub(crate) struct AddElapsed<'a>(&'a AtomicU64, Instant);

impl<'a> AddElapsed<'a> {
    pub(crate) fn start(counter: &'a AtomicU64) -> Self {
        AddElapsed(counter, Instant::now())
    }
}

impl Drop for AddElapsed<'_> {
    fn drop(&mut self) {
        // Relaxed: a statistic.
        self.0
            .fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// A failure of the machinery below the engine: the driver, the worker, or an injected fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendError {
    /// The backend cannot run here (no driver, no device, a missing symbol), with the cause.
    Unavailable(String),
    /// A driver call failed.
    Driver {
        call: &'static str,
        code: i32,
        name: String,
    },
    /// A copy failed; `index` is the failing descriptor where the backend knows it.
    CopyFailed {
        index: Option<usize>,
        reason: String,
    },
    /// A fault injected on request (tests).
    Injected { index: usize },
    /// The memory cannot be used the way it was registered.
    BadMemory(String),
    /// Out of host memory for slabs or buffers.
    OutOfMemory { bytes: usize },
    /// The backend was shut down.
    ShutDown,
    /// The process forked after the backend was created; the CUDA context does not survive fork.
    Forked,
    /// An argument the backend cannot use (a legacy default stream for copies, say).
    InvalidArgument(String),
    /// Transfers the backend stopped waiting for (shutdown's deadline passed, or their lane
    /// failed): the device may still run them, so the memory they may reach is kept.
    StillInFlight { transfers: u64 },
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::Unavailable(why) => write!(f, "backend unavailable: {why}"),
            BackendError::Driver { call, code, name } => {
                write!(f, "{call} failed: {name} ({code})")
            }
            BackendError::CopyFailed {
                index: Some(i),
                reason,
            } => {
                write!(f, "copy failed at descriptor {i}: {reason}")
            }
            BackendError::CopyFailed {
                index: None,
                reason,
            } => write!(f, "copy failed: {reason}"),
            BackendError::Injected { index } => write!(f, "injected failure at descriptor {index}"),
            BackendError::BadMemory(why) | BackendError::InvalidArgument(why) => f.write_str(why),
            BackendError::OutOfMemory { bytes } => {
                write!(f, "could not allocate {bytes} bytes of host memory")
            }
            BackendError::ShutDown => f.write_str("the backend is shut down"),
            BackendError::StillInFlight { transfers } => write!(
                f,
                "{transfers} transfers were still in flight when the backend stopped waiting for \
                 them; the memory they may reach stays allocated"
            ),
            BackendError::Forked => f.write_str(
                "this engine was created in another process: a CUDA context does not survive \
                 fork(); create a new engine in the child",
            ),
        }
    }
}

impl std::error::Error for BackendError {}

/// What a backend reports about itself (`blockswap.info()`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendInfo {
    pub name: &'static str,
    /// Driver version as the driver reports it (e.g. 13000), 0 on the host backend.
    pub driver_version: i32,
    pub device: Option<String>,
    /// The copy path in use: `memcpy`, `cuMemcpyBatchAsync (12.8 ABI)`, `... (13.0 ABI)`,
    /// `cuMemcpyAsync loop`.
    pub copy_path: String,
    /// How completion is signalled.
    pub completion: &'static str,
}

/// The part of a transfer a copy kernel moves: descriptors `[0, len)` of the slab, whose columns
/// start at `src`, `dst` and `size` (page-locked, device-mapped: the kernel reads them in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelBatch {
    pub src: u64,
    pub dst: u64,
    pub size: u64,
    pub len: usize,
    /// The largest size in the part, and the largest power of two (up to 16) dividing every
    /// address and size of it: they pick the kernel's specialisation.
    pub max_size: u64,
    pub alignment: u64,
    /// The stream to launch on (the lane's); 0 on the host backend.
    pub stream: u64,
}

/// Launches a copy kernel for a [`KernelBatch`] (the Python layer's Triton kernel).
pub type KernelLauncher<'a> = &'a (dyn Fn(KernelBatch) -> Result<(), String> + Sync);

/// What moves the small descriptors of a transfer's kernel route.
#[derive(Clone, Copy)]
pub enum PageKernel<'a> {
    /// A launcher the caller gives, called on the submitting thread with the batch.
    Launcher(KernelLauncher<'a>),
    /// A kernel loaded by [`Backend::load_kernel`], launched by the backend itself, no more than
    /// `launch_bytes` (counted as descriptors of the batch's largest size, at least one
    /// descriptor) per launch: a launch holds its SMs until it ends.
    Loaded { kernel: u32, launch_bytes: u64 },
}

impl fmt::Debug for PageKernel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageKernel::Launcher(_) => f.write_str("Launcher"),
            PageKernel::Loaded {
                kernel,
                launch_bytes,
            } => write!(f, "Loaded({kernel}, {launch_bytes} bytes a launch)"),
        }
    }
}

/// Slices per descriptor for a launch of a loaded kernel over `n` descriptors of at most
/// `max_size` bytes, by the rule of the Python layer's launcher (`blockswap.kernels.copy._plan`):
/// about four steps of `rows` items for each of `ctas` CTAs, a descriptor cut into slices of at
/// least `row_bytes` where there are too few descriptors to go round. A spec without
/// `row_bytes` (0) never slices.
#[must_use]
pub fn kernel_split(spec: &KernelSpec, n: u64, max_size: u64) -> u64 {
    let row_bytes = u64::from(spec.row_bytes);
    if row_bytes == 0 || n == 0 {
        return 1;
    }
    let target_items = 4 * u64::from(spec.ctas.max(1)) * u64::from(spec.rows.max(1));
    let item_bytes = row_bytes.max(n.saturating_mul(max_size) / target_items);
    max_size
        .div_ceil(row_bytes)
        .min(max_size.div_ceil(item_bytes))
        .max(1)
}

/// A value a kernel parameter takes at each launch (see [`KernelSpec`]). A page kernel (the
/// kernel route) reads descriptors: `srcs`, `dsts`, `sizes`, `count`, `split`, `src_base`,
/// `dst_base`. A staged kernel (the staged plan) reads block entries and a geometry (see
/// [`crate::table::staged`]) and computes every page's two addresses: `ids`, `rings`, `bases`,
/// `strides`, `offsets`, `count`, `segments`, `ring_base`, `ring_src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelParam {
    /// Address of the launch's first source / destination / size entry (the slab's columns).
    Srcs,
    Dsts,
    Sizes,
    /// Descriptors (page kernel) or blocks (staged kernel) in the launch.
    Count,
    /// Slices per descriptor: the kernel route's from [`kernel_split`].
    Split,
    /// Added by a page kernel to every source / destination address (0 from the core).
    SrcBase,
    DstBase,
    /// Address of the launch's first block entry's GPU block id / ring offset.
    Ids,
    Rings,
    /// Address of the group geometry's first segment's GPU base / GPU stride / offset in the row
    /// (one more offset follows the last segment's: the row's end).
    Bases,
    Strides,
    Offsets,
    /// Segments (pages per block) of the geometry.
    Segments,
    /// Added to every ring offset: the step's slot's address minus the step's first offset.
    RingBase,
    /// 1 where the ring is the source of the page copies (CPU -> GPU), 0 where the GPU pages are.
    RingSrc,
}

impl std::str::FromStr for KernelParam {
    type Err = String;

    /// The names the Python layer gives (`blockswap.kernels`).
    fn from_str(s: &str) -> Result<Self, String> {
        use KernelParam::{
            Bases, Count, DstBase, Dsts, Ids, Offsets, RingBase, RingSrc, Rings, Segments, Sizes,
            Split, SrcBase, Srcs, Strides,
        };
        Ok(match s {
            "srcs" => Srcs,
            "dsts" => Dsts,
            "sizes" => Sizes,
            "count" => Count,
            "split" => Split,
            "src_base" => SrcBase,
            "dst_base" => DstBase,
            "ids" => Ids,
            "rings" => Rings,
            "bases" => Bases,
            "strides" => Strides,
            "offsets" => Offsets,
            "segments" => Segments,
            "ring_base" => RingBase,
            "ring_src" => RingSrc,
            other => {
                return Err(format!(
                    "kernel parameter {other:?} is none of srcs, dsts, sizes, count, split, \
                     src_base, dst_base (a page kernel) or ids, rings, bases, strides, offsets, \
                     count, segments, ring_base, ring_src (a staged kernel)"
                ))
            }
        })
    }
}

/// What a loaded kernel is for, by its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    /// Descriptors `(src, dst, size)`: the kernel route ([`PageKernel::Loaded`]).
    Pages,
    /// Block entries and a geometry: the staged plan ([`StagedRequest::kernel`]).
    Staged,
}

impl KernelKind {
    /// The kind of a kernel taking `params`, or why it is none: every parameter at most once,
    /// and each kind's own all there, none of the other's.
    pub fn of(params: &[KernelParam]) -> Result<Self, String> {
        use KernelParam::{
            Bases, Count, DstBase, Dsts, Ids, Offsets, RingBase, RingSrc, Rings, Segments, Sizes,
            Split, SrcBase, Srcs, Strides,
        };
        const PAGES: &[KernelParam] = &[Srcs, Dsts, Sizes, Count];
        const STAGED: &[KernelParam] = &[
            Ids, Rings, Bases, Strides, Offsets, Count, Segments, RingBase, RingSrc,
        ];
        for (i, p) in params.iter().enumerate() {
            if params[..i].contains(p) {
                return Err(format!("kernel parameter {p:?} is named twice"));
            }
        }
        let has_all = |want: &[KernelParam]| want.iter().all(|p| params.contains(p));
        let only = |allowed: &[KernelParam]| params.iter().all(|p| allowed.contains(p));
        if has_all(PAGES) && only(&[Srcs, Dsts, Sizes, Count, Split, SrcBase, DstBase]) {
            Ok(KernelKind::Pages)
        } else if has_all(STAGED) && only(STAGED) {
            Ok(KernelKind::Staged)
        } else {
            Err(format!(
                "kernel parameters {params:?} are neither a page kernel's (srcs, dsts, sizes, \
                 count; split, src_base, dst_base optional) nor a staged kernel's (ids, rings, \
                 bases, strides, offsets, count, segments, ring_base, ring_src)"
            ))
        }
    }
}

/// A compiled copy kernel the backend launches itself with `cuLaunchKernel`, no Python and no
/// launcher between: a page kernel for the kernel route ([`PageKernel::Loaded`]), the kernel of
/// [`KernelBatch`], or a staged kernel for the staged plan (see [`KernelParam`] and
/// `blockswap.kernels`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSpec {
    /// The `CUfunction`, loaded in the device's primary context by whoever compiled it; it must
    /// stay loaded while the backend lives.
    pub function: u64,
    /// Threads per CTA, and bytes of dynamic shared memory.
    pub threads: u32,
    pub shared: u32,
    /// The kernel's leading parameters, each 8 bytes, those of one [`KernelKind`]; any parameter
    /// after them must be an 8-byte pointer the kernel ignores when null (Triton's scratch
    /// pointers with no scratch).
    pub params: Vec<KernelParam>,
    /// Descriptors a CTA copies side by side (the kernel's `ROWS`), and the most CTAs.
    pub rows: u32,
    pub ctas: u32,
    /// Bytes one row moves per step (the kernel's `BLOCK_BYTES`): what a slice of a descriptor
    /// is made of where the kernel route splits descriptors ([`kernel_split`]); 0: never.
    pub row_bytes: u32,
}

impl KernelSpec {
    /// What the kernel is for, by its parameters (see [`KernelKind::of`]).
    pub fn kind(&self) -> Result<KernelKind, String> {
        KernelKind::of(&self.params)
    }
}

/// The staged plan of a transfer (see [`crate::table::staged`]): the slab's first `rows`
/// entries are host rows `(address, ring offset, bytes)`, those from `first_block` on a block
/// entry per block, whose pages [`crate::table::staged_pages`] names, their ring side an offset
/// from the transfer's first row. The backend moves the rows across `PCIe` one copy each into (or
/// out of) the slots of its staging ring, a step of whole rows per slot, and the pages between a
/// slot and the GPU pages with `kernel` (by memcpy on the host backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedRequest {
    /// The host rows, the slab's first entries.
    pub rows: usize,
    /// Where the block entries start, and how many there are: the slab holds room for a row
    /// per block first (rows joined on the host leave the end of it unused).
    pub first_block: usize,
    /// Bytes of each of the two slots of a lane's ring; no row is larger.
    pub slot_bytes: u64,
    /// From [`Backend::load_kernel`], a [`KernelKind::Staged`] kernel; `None` where the backend
    /// copies pages with memcpy.
    pub kernel: Option<u32>,
}

impl StagedRequest {
    /// The transfer's steps ([`staged_steps`]) from the slab's destination and size columns:
    /// its rows' ring offsets and bytes, and its block entries' ring offsets.
    #[must_use]
    pub fn steps(&self, dst: &[u64], size: &[u64]) -> Vec<StagedStep> {
        let (r, first) = (self.rows, self.first_block);
        staged_steps(
            &dst[..r],
            &size[..r],
            &dst[first..2 * first],
            self.slot_bytes,
        )
    }
}

/// A step is cut to at most `ceil(rows / STAGED_MIN_STEPS)` rows, so that a transfer of enough
/// rows runs in at least this many steps over the two slots: one step's copy across `PCIe` then
/// overlaps the previous step's kernel. One step per transfer held 4 KiB pages to 54-81 % of the
/// link isolated, four 88-91 % (H100, `benches/probe_staged.py`, docs/benchmarks.md).
pub const STAGED_MIN_STEPS: usize = 4;

/// One step of a staged transfer: slab rows `rows`, block entries `blocks` (counted from the
/// first), and the ring offset of its first row (the slot's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedStep {
    pub rows: std::ops::Range<usize>,
    pub blocks: std::ops::Range<usize>,
    pub ring_start: u64,
}

/// Cuts a staged slab into steps (see [`StagedRequest`]): whole rows, at most `slot_bytes` and
/// `ceil(rows / STAGED_MIN_STEPS)` rows each; a step's blocks are those whose ring offset lies in
/// its rows. `block_ring`: the block entries' ring offsets. Rows and blocks come in ring order,
/// as the table code writes them.
#[must_use]
pub fn staged_steps(
    row_ring: &[u64],
    row_bytes: &[u64],
    block_ring: &[u64],
    slot_bytes: u64,
) -> Vec<StagedStep> {
    let rows = row_ring.len();
    let per = rows.div_ceil(STAGED_MIN_STEPS).max(1);
    let mut steps = Vec::with_capacity(STAGED_MIN_STEPS + 1);
    let (mut r, mut p) = (0usize, 0usize);
    while r < rows {
        let start = row_ring[r];
        let mut end = r;
        while end < rows && end - r < per && row_ring[end] + row_bytes[end] - start <= slot_bytes {
            end += 1;
        }
        // A row larger than a slot was refused before submission; never loop on one.
        let end = end.max(r + 1);
        let ring_end = row_ring[end - 1] + row_bytes[end - 1];
        let first = p;
        while p < block_ring.len() && block_ring[p] < ring_end {
            p += 1;
        }
        steps.push(StagedStep {
            rows: r..end,
            blocks: first..p,
            ring_start: start,
        });
        r = end;
    }
    steps
}

/// What a submission asks of the backend besides the copies.
#[derive(Clone, Copy, Default)]
pub struct SubmitRequest<'a> {
    /// A raw `CUstream` of the caller (`0` is the legacy default stream): the copies start only
    /// after the work issued on it so far.
    pub wait_stream: Option<u64>,
    /// Descriptors `[0, kernel.len)` go to this kernel, the rest to DMA.
    pub kernel: Option<(KernelBatch, PageKernel<'a>)>,
    /// The slab holds 2-D copies, two entries each (see [`crate::table::expand_runs_into`]),
    /// not `(src, dst, size)` descriptors. Never with `kernel`.
    pub pitched: bool,
    /// The slab holds a staged plan. Never with `kernel` or `pitched`.
    pub staged: Option<StagedRequest>,
}

impl fmt::Debug for SubmitRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubmitRequest")
            .field("wait_stream", &self.wait_stream)
            .field("kernel", &self.kernel)
            .field("pitched", &self.pitched)
            .field("staged", &self.staged)
            .finish()
    }
}

/// How [`Backend::submit`] went.
#[derive(Debug, PartialEq, Eq)]
pub enum Submitted {
    /// Every copy and the completion marker are enqueued.
    Ok,
    /// The copies failed to enqueue (the slab records why) but the completion marker is enqueued:
    /// the transfer completes, as failed, in order.
    CopyFailed,
}

/// Moves bytes for the engine. Implementations are shared between threads.
pub trait Backend: Send + Sync + fmt::Debug {
    fn info(&self) -> BackendInfo;

    /// The most transfers one lane of this backend holds in flight, at least 1. The engine sizes
    /// its lanes by its `max_in_flight` setting clamped to this. The default, [`MAX_IN_FLIGHT`],
    /// is the most any setting may ask for
    /// ([`EngineConfig::validate`](crate::engine::EngineConfig::validate)), so a backend keeping
    /// it holds whatever an engine lets into flight.
    fn max_in_flight(&self) -> usize {
        MAX_IN_FLIGHT
    }

    /// The start of the driver allocation holding `addr`, where the backend knows allocations:
    /// one 2-D copy must stay inside one allocation (the CUDA driver refuses a pitched copy whose
    /// rows lie in different ones), so block plans keep a run of pages to one. `None`: no such
    /// bound (host memory under `memcpy`).
    fn allocation_base(&self, _addr: u64) -> Option<u64> {
        None
    }

    /// Makes `spec` launchable by this backend's staged plans; returns its id for
    /// [`StagedRequest::kernel`]. The host backend copies pages with memcpy and keeps no kernel.
    fn load_kernel(&self, _spec: KernelSpec) -> Result<Option<u32>, BackendError> {
        Ok(None)
    }

    /// Checks that `[start, start + len)` is memory of `kind` this backend can copy from and to.
    /// Called once per registration, never per copy.
    fn check_region(&self, start: u64, len: u64, kind: MemoryKind) -> Result<(), BackendError>;

    /// Allocates host memory for descriptor slabs and buffers: page-locked, device-mapped and not
    /// write-combined on CUDA (the CPU reads results back from it).
    fn alloc_host(&self, bytes: usize) -> Result<HostAlloc, BackendError>;

    /// # Safety
    /// `alloc` came from [`Backend::alloc_host`] of this backend and nothing (host or device) will
    /// touch it again.
    unsafe fn free_host(&self, alloc: HostAlloc);

    /// Enqueues the copies described by `slab` on `lane`, then arranges for
    /// [`Backend::completed`]`(lane)` to reach `seq` once they are done. Sequence numbers of one
    /// lane are submitted in increasing order, one at a time (the engine holds its submit lock).
    ///
    /// The copies may be enqueued later, in order, by a thread of the backend's (the CUDA
    /// backend's issuing threads; the caller's stream is recorded here, at the call).
    ///
    /// `slab` stays valid and unmodified until `completed(lane) >= seq` has been observed, or
    /// [`Backend::lane_error`] has reported the lane failed. The backend records a failure and
    /// the GPU time in the slab before its completion is visible, and touches no slab of the
    /// lane once it reports the lane failed. An `Err` means nothing can be promised about `seq`
    /// (the engine fails the lane).
    /// `request` adds the ordering on a caller's stream and the kernel part of the transfer: the
    /// kernel moves descriptors `[0, kernel.len)`, DMA the rest, in one submission with one
    /// completion.
    fn submit(
        &self,
        lane: Direction,
        seq: u64,
        slab: SlabRef,
        request: SubmitRequest<'_>,
    ) -> Result<Submitted, BackendError>;

    /// The highest sequence number of `lane` whose copies are done. Lock-free and never blocking:
    /// this is read by every poll.
    fn completed(&self, lane: Direction) -> u64;

    /// Blocks, without spinning a core, until `completed(lane) >= seq` or `timeout` passes.
    /// Returns whether the sequence number was reached.
    fn wait(
        &self,
        lane: Direction,
        seq: u64,
        timeout: Option<Duration>,
    ) -> Result<bool, BackendError>;

    /// A fatal, asynchronous error of `lane`, if the backend has seen one (a faulted stream, a
    /// dead context): every transfer not yet complete on that lane has failed.
    fn lane_error(&self, _lane: Direction) -> Option<BackendError> {
        None
    }

    /// Device time of transfer `seq` of `lane`, once complete, where the backend measures it.
    fn device_ns(&self, _lane: Direction, _seq: u64) -> Option<u64> {
        None
    }

    /// Nanoseconds spent inside the driver's copy calls so far (0 where there is no driver): lets
    /// a benchmark split submission time into the driver's share and blockswap's own.
    fn driver_ns(&self) -> u64 {
        0
    }

    /// Page-locks existing host memory so the device can reach it (`cuMemHostRegister`).
    ///
    /// # Safety
    /// The range must be allocated host memory that outlives the registration.
    unsafe fn pin_host(&self, _start: u64, _len: u64) -> Result<(), BackendError> {
        Ok(())
    }

    /// Undoes [`Backend::pin_host`].
    ///
    /// # Safety
    /// No transfer may be in flight on the range.
    unsafe fn unpin_host(&self, _start: u64) -> Result<(), BackendError> {
        Ok(())
    }

    /// A test hook: the next `count` transfers fail at a descriptor in the middle of their copy
    /// list (on CUDA, of their DMA part), the way a real fault would: the host backend stops its
    /// worker there; the CUDA backend hands the driver a null address there, which it refuses.
    /// The transfer must then complete as failed, in order, with its slab returned.
    fn inject_failures(&self, count: u64);

    /// Stops the backend once everything submitted is done, waiting no later than `deadline`
    /// (`None`: no bound). Past it, every transfer still in flight is reported failed through
    /// [`Backend::lane_error`], and no memory it may reach is freed or unpinned, then or later,
    /// while it may still run. Returns how many transfers were left in flight (0 when all
    /// finished). Idempotent.
    fn shutdown(&self, deadline: Option<Instant>) -> u64;
}

/// The most transfers in flight per direction an engine setting may ask for, whatever the
/// backend, and the default of [`Backend::max_in_flight`]: the host backend's one queue holds the
/// jobs of all four lanes.
pub const MAX_IN_FLIGHT: usize = host::QUEUE_DEPTH / 4;

/// `max_in_flight` as a backend keeping the default [`Backend::max_in_flight`] takes it: at
/// least 1, at most [`MAX_IN_FLIGHT`], as the engine clamps it for such a backend. A backend
/// sizing rings by it (the CUDA backend) holds every transfer the engine lets into flight, and no
/// more.
#[must_use]
pub fn clamp_in_flight(max_in_flight: usize) -> usize {
    max_in_flight.clamp(1, MAX_IN_FLIGHT)
}

/// Whether the backend named `name` is the CUDA one: `"cuda"`, or `"auto"` where a CUDA driver
/// can be loaded; `"host"` is the memcpy backend. Any other name is refused by name.
pub fn is_cuda(name: &str) -> Result<bool, String> {
    match name {
        "host" => Ok(false),
        "cuda" => Ok(true),
        "auto" => Ok(cuda::driver_available().is_ok()),
        other => Err(format!(
            "backend must be 'auto', 'host' or 'cuda', not {other:?}"
        )),
    }
}

/// Takes one injected failure from `counter`, if any is left.
pub(crate) fn take_injected(counter: &std::sync::atomic::AtomicU64) -> bool {
    use std::sync::atomic::Ordering;
    // Relaxed: a test hook counter, ordered by nothing else.
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_steps_take_whole_rows_within_a_slot() {
        // 10 rows of 3 blocks, 96 bytes a row (blocks of 32 bytes).
        let rows: Vec<u64> = (0..10).map(|i| i * 96).collect();
        let bytes = vec![96u64; 10];
        let blocks: Vec<u64> = (0..30).map(|p| p * 32).collect();
        for slot in [96u64, 100, 200, 288, 1 << 20] {
            let steps = staged_steps(&rows, &bytes, &blocks, slot);
            // Every row and block once, in order; each step within a slot.
            let (mut r, mut p) = (0, 0);
            for s in &steps {
                assert_eq!((s.rows.start, s.blocks.start), (r, p));
                assert_eq!(s.ring_start, rows[s.rows.start]);
                assert_eq!(s.blocks.len(), 3 * s.rows.len());
                assert!(96 * s.rows.len() as u64 <= slot, "{s:?} in {slot}");
                (r, p) = (s.rows.end, s.blocks.end);
            }
            assert_eq!((r, p), (10, 30));
            // At least STAGED_MIN_STEPS steps; no more than the slot forces.
            let per = (slot / 96).min(10usize.div_ceil(STAGED_MIN_STEPS) as u64);
            assert_eq!(steps.len(), 10usize.div_ceil(per as usize), "slot {slot}");
        }
    }

    #[test]
    fn kernel_split_follows_the_python_launchers_rule() {
        // (n, max_size, ctas, rows, row_bytes) -> split, as `blockswap.kernels.copy._plan` gives.
        let spec = |ctas, rows, row_bytes| KernelSpec {
            function: 1,
            threads: 128,
            shared: 0,
            params: Vec::new(),
            rows,
            ctas,
            row_bytes,
        };
        for (n, max_size, ctas, rows, row_bytes, split) in [
            (2560, 4096, 16, 8, 4096, 1),
            (4, 262_144, 16, 1, 32768, 8),
            (3, 100_000, 32, 1, 32768, 4),
            (1, 1 << 20, 16, 1, 16384, 64),
            (100, 65536, 16, 1, 32768, 1),
        ] {
            let s = spec(ctas, rows, row_bytes);
            assert_eq!(kernel_split(&s, n, max_size), split, "{n} x {max_size}");
        }
        // Without row_bytes, or with nothing to copy: never sliced.
        assert_eq!(kernel_split(&spec(16, 1, 0), 1, 1 << 20), 1);
        assert_eq!(kernel_split(&spec(16, 1, 32768), 0, 1 << 20), 1);
    }

    #[test]
    fn a_kernel_is_a_page_or_a_staged_kernel_by_its_parameters() {
        let parse = |names: &[&str]| -> Result<KernelKind, String> {
            let params = names
                .iter()
                .map(|n| n.parse::<KernelParam>())
                .collect::<Result<Vec<_>, _>>()?;
            KernelKind::of(&params)
        };
        let pages = [
            "srcs", "dsts", "sizes", "count", "split", "src_base", "dst_base",
        ];
        assert_eq!(parse(&pages), Ok(KernelKind::Pages));
        assert_eq!(parse(&pages[..4]), Ok(KernelKind::Pages));
        let staged = [
            "ids",
            "rings",
            "bases",
            "strides",
            "offsets",
            "count",
            "segments",
            "ring_base",
            "ring_src",
        ];
        assert_eq!(parse(&staged), Ok(KernelKind::Staged));
        // A name of neither, a parameter twice, one missing, the two kinds mixed: refused by name.
        let err = parse(&["srcs", "dsts", "sizes", "cnt"]).unwrap_err();
        assert!(err.contains("\"cnt\" is none of"), "{err}");
        let err = parse(&["srcs", "dsts", "sizes", "count", "srcs"]).unwrap_err();
        assert!(err.contains("Srcs is named twice"), "{err}");
        assert!(parse(&staged[..8]).unwrap_err().contains("neither"));
        let mut mixed = staged.to_vec();
        mixed.push("split");
        assert!(parse(&mixed).unwrap_err().contains("neither"));
    }

    #[test]
    fn a_backend_is_named_auto_host_or_cuda() {
        assert_eq!(is_cuda("host"), Ok(false));
        assert_eq!(is_cuda("cuda"), Ok(true));
        assert_eq!(is_cuda("auto"), Ok(cuda::driver_available().is_ok()));
        assert!(is_cuda("gpu").unwrap_err().contains("not \"gpu\""));
    }

    #[test]
    fn max_in_flight_is_clamped_in_one_place() {
        assert_eq!(clamp_in_flight(0), 1);
        assert_eq!(clamp_in_flight(7), 7);
        assert_eq!(clamp_in_flight(usize::MAX), MAX_IN_FLIGHT);
        assert_eq!(MAX_IN_FLIGHT, host::QUEUE_DEPTH / 4);
    }

    #[test]
    fn the_host_backend_holds_what_any_setting_may_ask_for() {
        assert_eq!(host::HostBackend::new().max_in_flight(), MAX_IN_FLIGHT);
    }
}
