//! What a [`CudaBackend`](super::CudaBackend) is made with: the device, the copy call, the order of the
//! copies and how completion is observed.

use std::str::FromStr;
use std::time::Duration;

use crate::affinity::Cpus;
use crate::direction::Direction;
use crate::region::MemoryKind;

/// Which copy call a transfer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPath {
    /// The batch call where the driver has one, else the loop.
    Auto,
    /// The batch call; an error where the driver has none.
    Batch,
    /// One `cuMemcpyAsync` per descriptor.
    Loop,
}

impl FromStr for CopyPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CopyPath::Auto),
            "batch" => Ok(CopyPath::Batch),
            "loop" => Ok(CopyPath::Loop),
            _ => Err(format!(
                "copy_path must be 'auto', 'batch' or 'loop', not {s:?}"
            )),
        }
    }
}

/// When the copy engine may read a transfer's sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessOrder {
    /// In stream order: after everything issued before on the copy stream.
    Stream,
    /// Any time after the call, even before earlier stream work: only for sources nothing writes.
    Any,
}

impl FromStr for AccessOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stream" => Ok(AccessOrder::Stream),
            "any" => Ok(AccessOrder::Any),
            _ => Err(format!("must be 'stream' or 'any', not {s:?}")),
        }
    }
}

/// How completion is signalled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionMode {
    /// Stream memory operations where the device has them, else events.
    Auto,
    /// `cuStreamWriteValue64` into mapped pinned memory; polled with an atomic load.
    WriteValue,
    /// One event per transfer; polled with `cuEventQuery`.
    Event,
}

impl FromStr for CompletionMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CompletionMode::Auto),
            "write_value" => Ok(CompletionMode::WriteValue),
            "event" => Ok(CompletionMode::Event),
            _ => Err(format!(
                "completion must be 'auto', 'write_value' or 'event', not {s:?}"
            )),
        }
    }
}

/// Copies per driver call by default. While the lane's thread is inside a batch call, another
/// thread's driver calls wait (the model's kernel launches among them), and the GPU starts on a
/// batch only once the call carrying it returns. On the H100 (2026-11-24, `python
/// benches/probe_max_batch.py`), a bf16 GEMM's launch beside one transfer of 8,192 4 KiB /
/// 4,096 64 KiB / 512 1 MiB copies took 17 / 2.3 / 0.4 ms with 16,384 copies a call, 0.35 /
/// 0.26 / 0.36 ms with 64 (0.02 ms alone), and the transfers ran at 2.0 / 37 / 53 GB/s against
/// 8.2 / 51 / 54 GB/s: more copies a call gained nothing from 64 on (128: 7.8 / 52 / 54 GB/s,
/// launches 0.57 / 0.35 / 0.39 ms).
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Settings of a [`CudaBackend`](super::CudaBackend).
#[derive(Clone, Debug)]
pub struct CudaOptions {
    pub device: i32,
    pub copy_path: CopyPath,
    /// Descriptors per driver call; larger transfers are split (one 51,828-descriptor batch has
    /// been reported to crash a driver). Default `DEFAULT_MAX_BATCH` (64).
    pub max_batch: usize,
    /// Record timing events around each transfer, for device seconds in its result.
    pub timing: bool,
    /// Source access order per direction (lane order). Default: ANY for host sources (pinned
    /// memory nothing else writes), STREAM for device sources (live GPU memory).
    pub access_order: [AccessOrder; 4],
    pub completion: CompletionMode,
    /// A caller's stream per direction (raw `CUstream`), used instead of one of our own.
    pub streams: [Option<u64>; 4],
    /// Transfers in flight per direction the event rings hold (the engine's `max_in_flight`).
    pub max_in_flight: usize,
    /// Where a lane's thread holds no transfer, `submit` issues the start of a staged transfer
    /// (its first step) on the caller's thread and wakes the lane's thread for the rest, and,
    /// where every earlier transfer is complete, any other transfer whole: the caller pays those
    /// driver calls, and the copies start without a thread's wake-up in the way. A transfer that
    /// follows a busy one still goes to the lane's thread.
    pub idle_issue: bool,
    /// A lane's sleeping thread is woken when a transfer is announced ([`Backend::wake`]: the
    /// handlers announce one before they build its tables) instead of when it is queued: the
    /// thread's wake-up overlaps the caller's work, and the thread polls for the transfer (up
    /// to a millisecond, yielding its core) rather than sleeping.
    ///
    /// [`Backend::wake`]: crate::backend::Backend::wake
    pub early_wake: bool,
    /// How long a lane's thread stays ready after it issued a transfer: instead of sleeping
    /// until the next one, it wakes every [`KEEP_WARM_EVERY`] and makes one cheap driver call
    /// (`cuStreamQuery` on its stream), so that a transfer coming within this time finds it
    /// awake on a core that is not idle. Zero: the thread sleeps as soon as it has nothing to
    /// issue. After a pause the thread's first calls otherwise wait for its core to wake: on an
    /// H200 host, transfers 3-20 ms apart with the GPU and the caller busy in between (a
    /// serving loop) ended 15-133 µs sooner from the call with the thread kept warm, for 30-50
    /// ms of CPU a second for the two threads (4 and 16 KiB pages, `python
    /// benches/probe_keep_warm.py`; docs/benchmarks.md).
    pub keep_warm: Duration,
    /// The CPUs the lanes' threads run on (see [`crate::affinity`]); `None`: where the thread
    /// that made the backend may run.
    pub cpus: Option<Cpus>,
}

/// How often a lane's thread kept warm ([`CudaOptions::keep_warm`]) wakes: under the 200 µs a
/// virtual machine's idle core is commonly polled before the host deschedules it.
pub const KEEP_WARM_EVERY: Duration = Duration::from_micros(100);

/// [`CudaOptions::keep_warm`] by default.
pub const DEFAULT_KEEP_WARM: Duration = Duration::from_millis(100);

/// The longest [`CudaOptions::keep_warm`] an engine takes: an hour.
pub const MAX_KEEP_WARM: Duration = Duration::from_secs(3600);

impl CudaOptions {
    #[must_use]
    pub fn new(device: i32) -> Self {
        CudaOptions {
            device,
            copy_path: CopyPath::Auto,
            max_batch: DEFAULT_MAX_BATCH,
            timing: false,
            access_order: Direction::ALL.map(|d| match d.src_kind() {
                MemoryKind::Host => AccessOrder::Any,
                MemoryKind::Device => AccessOrder::Stream,
            }),
            completion: CompletionMode::Auto,
            streams: [None; 4],
            max_in_flight: 1024,
            idle_issue: false,
            early_wake: true,
            keep_warm: DEFAULT_KEEP_WARM,
            cpus: None,
        }
    }
}
