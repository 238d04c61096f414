//! The staged plan's resources: the kernels loaded for it, each lane's stage (ring, kernel
//! stream, events, device descriptor buffers), the copy of a transfer's entries to the device and
//! how far a staged transfer's issuing got.

use cudarc::driver::sys;

use super::resources::{DeviceMem, Event, Stream};
use crate::backend::BackendError;
use crate::direction::Direction;
use crate::kernel::{KernelKind, KernelSpec};
use crate::table::StagedStep;

/// A kernel the staged plan launches (see [`KernelSpec`]), checked against the driver's view of
/// its parameters when loaded.
#[derive(Clone, Debug)]
pub(super) struct LoadedKernel {
    pub(super) function: u64,
    pub(super) spec: KernelSpec,
    pub(super) kind: KernelKind,
    /// Parameters of the kernel in all: those of `spec.params`, then null pointers.
    pub(super) total: usize,
}

/// A staged transfer begun (`Shared::staged_begin`): its kernel, its steps and the next to
/// issue, where the kernels find its block entries (`cols`, see `staged_begin`), the
/// descriptor buffer they are in once their copy is queued (`None`: the slab's own columns, or
/// no entries), and that copy while it waits for the first step's rows (CPU -> GPU).
#[derive(Debug)]
pub(super) struct StagedRun {
    pub(super) kernel: LoadedKernel,
    pub(super) steps: Vec<StagedStep>,
    /// Begun while an earlier transfer of the lane still ran (its steps have no ramp).
    pub(super) behind: bool,
    pub(super) next: usize,
    pub(super) fail_at: Option<usize>,
    pub(super) cols: [u64; 3],
    pub(super) desc: Option<usize>,
    pub(super) upload: Option<EntryUpload>,
    /// CPU -> GPU: the slot of the step whose rows went in and whose kernel has not.
    pub(super) kernel_slot: Option<usize>,
}

impl StagedRun {
    /// Every step of the run went in, and it had one: GPU -> CPU each step's kernel and rows,
    /// CPU -> GPU each step's rows and kernel (one step more than there are: the last kernel).
    pub(super) fn whole(&self, lane: Direction) -> bool {
        let n = self.steps.len();
        n > 0
            && self.kernel_slot.is_none()
            && self.next >= n + usize::from(lane == Direction::HostToDevice)
    }
}

/// The ring slot the next step takes: the two in turn, across transfers.
pub(super) fn take_slot(st: &mut Stage) -> usize {
    let slot = (st.steps % 2) as usize;
    st.steps += 1;
    slot
}

/// The copy of a transfer's block entries into descriptor buffer `b` at `dev`, from the slab
/// whose first column is at `col0`.
#[derive(Clone, Copy, Debug)]
pub(super) struct EntryUpload {
    pub(super) copy: EntryCopy,
    pub(super) col0: u64,
    pub(super) dev: u64,
    pub(super) b: usize,
}

/// One lane's staging resources, made on its first staged transfer: a ring of two slots in
/// device memory, a stream for the kernels (the lane's stream does the copies across `PCIe`) and
/// the events that hand each slot between the two.
#[derive(Debug)]
pub(super) struct Stage {
    /// Made by the lane's first transfer that stages rows ([`Self::make_ring`]): a lane whose
    /// transfers are all direct (vLLM's canonical layout) never holds the two slots' device
    /// memory, 32-128 MiB a direction.
    ring: Option<DeviceMem>,
    pub(super) slot: u64,
    pub(super) stream: Stream,
    /// Recorded on the lane's stream before a CPU -> GPU transfer's completion marker goes on
    /// the kernel stream (see [`CudaBackend::marker_stream`]).
    pub(super) lane_done: Event,
    /// Per slot: its copy (CPU -> GPU) or kernel (GPU -> CPU) is done; the other stream goes on.
    pub(super) ready: [Event; 2],
    /// Per slot: the last work on it is done; it may be filled again.
    pub(super) free: [Event; 2],
    /// Recorded on the kernel stream after a transfer's last step; the lane's stream waits for
    /// it before a completion marker it writes, so a transfer completes only once its kernels
    /// have.
    pub(super) join: Event,
    /// The lane's last completion marker went on the kernel stream: the next one written on
    /// the lane's stream waits for it (`join`), so markers stay in order.
    pub(super) marker_on_kernels: bool,
    /// Steps issued on the lane so far: the next takes slot `steps % 2`.
    pub(super) steps: u64,
    /// Device memory a CPU -> GPU lane's transfers copy their block entries and geometries into
    /// before their first kernel, so the kernels read them from HBM, not across the `PCIe` link
    /// the rows are crossing. Two, taken in turn by the lane's transfers (`transfers % 2`): a
    /// transfer copies its entries on the lane's stream, after its first step's rows (on the
    /// kernel stream the copy would queue on the copy engine behind the rows the lane's stream
    /// issued meanwhile, and hold the transfer's first kernel, then its third step's rows, for a
    /// whole step), while the previous transfer's last kernels still read the other buffer.
    /// GPU -> CPU kernels read their entries in the slab (see `Shared::staged_begin`).
    pub(super) desc: [Option<DeviceMem>; 2],
    pub(super) desc_bytes: [usize; 2],
    /// Per descriptor buffer: recorded on the kernel stream after the last kernel of the
    /// transfer that used it; the next transfer to fill it on the lane's stream waits for it.
    pub(super) desc_free: [Event; 2],
    /// Per descriptor buffer: its last transfer was direct, its kernels on the lane's stream,
    /// where `desc_free` is recorded after them (else on the kernel stream).
    pub(super) desc_on_lane: [bool; 2],
    /// CPU -> GPU transfers that copied their entries on the lane so far: the next takes
    /// descriptor buffer `transfers % 2` (GPU -> CPU transfers take none).
    pub(super) transfers: u64,
    /// Descriptor buffers outgrown while kernels may still read them: freed with the stage.
    pub(super) retired: Vec<DeviceMem>,
    /// The step's row copies, handed to the batch call.
    pub(super) src: Vec<u64>,
    pub(super) dst: Vec<u64>,
    pub(super) size: Vec<u64>,
}

/// The smallest device descriptor buffer a stage makes (it grows by powers of two).
const MIN_DESC_BYTES: usize = 64 << 10;

/// The copy of a staged transfer's block entries to the device: entries `[first, first + n)` of
/// each of the slab's three columns (`cap` entries apart), as the three rows of one 2-D copy into
/// three packed device columns. Only the entries in use cross: a slab's columns run to its
/// capacity, up to twice the entries a transfer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EntryCopy {
    /// Offset of the first entry copied from the slab's first column.
    pub(super) src_offset: u64,
    /// Bytes from one column to the next in the slab.
    pub(super) src_pitch: usize,
    /// Bytes of each row: one column's entries in use, packed on the device.
    pub(super) width: usize,
    first: u64,
}

impl EntryCopy {
    pub(super) fn new(first: usize, n: usize, cap: usize) -> Self {
        EntryCopy {
            src_offset: 8 * first as u64,
            src_pitch: 8 * cap,
            width: 8 * n,
            first: first as u64,
        }
    }

    /// The device bytes the three packed columns take.
    pub(super) fn device_bytes(&self) -> usize {
        3 * self.width
    }

    /// Where the kernels find column `c` on the device at `dev`, indexed by slab entry: entry
    /// `i` (`first <= i`) of column `c` is at `column(dev, c) + 8 * i`.
    pub(super) fn column(&self, dev: u64, c: usize) -> u64 {
        (dev + (c * self.width) as u64).wrapping_sub(8 * self.first)
    }
}

impl Stage {
    /// Slot `slot`'s address minus `step`'s first ring offset: a row's ring offset plus this is
    /// where it lies in the slot.
    pub(super) fn shift(&self, slot: usize, step: &StagedStep) -> u64 {
        let ring = self
            .ring
            .as_ref()
            .expect("made by staged_begin for a staged transfer");
        (ring.ptr + slot as u64 * self.slot).wrapping_sub(step.ring_start)
    }

    /// The ring's two slots, made on the first call.
    pub(super) fn make_ring(&mut self, ctx: sys::CUcontext) -> Result<(), BackendError> {
        if self.ring.is_none() {
            let bytes = usize::try_from(self.slot.saturating_mul(2)).unwrap_or(usize::MAX);
            self.ring = Some(DeviceMem::alloc(ctx, bytes)?);
        }
        Ok(())
    }

    /// Descriptor buffer `b` (0 or 1), at least `bytes` long, for the transfer being issued. A
    /// buffer outgrown is kept until the stage goes: an earlier transfer's kernel may still
    /// read it.
    pub(super) fn desc_buffer(
        &mut self,
        ctx: sys::CUcontext,
        b: usize,
        bytes: usize,
    ) -> Result<u64, BackendError> {
        if self.desc[b].is_none() || self.desc_bytes[b] < bytes {
            let want = bytes.max(MIN_DESC_BYTES).next_power_of_two();
            let new = DeviceMem::alloc(ctx, want)?;
            if let Some(old) = self.desc[b].replace(new) {
                self.retired.push(old);
            }
            self.desc_bytes[b] = want;
        }
        Ok(self.desc[b].as_ref().expect("made above").ptr)
    }

    /// The lane's stage in `stage`, made with `slot`-byte slots where there is none yet; a
    /// stage whose slots are another size is refused (a lane's ring holds one slot size).
    pub(super) fn made(
        stage: &mut Option<Stage>,
        ctx: sys::CUcontext,
        slot: u64,
    ) -> Result<&mut Stage, BackendError> {
        if let Some(st) = stage.as_ref().filter(|st| st.slot != slot) {
            return Err(BackendError::InvalidArgument(format!(
                "this lane's staging slots are {} bytes, not the {slot} asked for",
                st.slot
            )));
        }
        if stage.is_none() {
            *stage = Some(Stage::new(ctx, slot)?);
        }
        Ok(stage.as_mut().expect("made above"))
    }

    fn new(ctx: sys::CUcontext, slot: u64) -> Result<Self, BackendError> {
        Ok(Stage {
            ring: None,
            slot,
            stream: Stream::create(ctx)?,
            lane_done: Event::create(ctx, false)?,
            ready: [Event::create(ctx, false)?, Event::create(ctx, false)?],
            free: [Event::create(ctx, false)?, Event::create(ctx, false)?],
            join: Event::create(ctx, false)?,
            marker_on_kernels: false,
            steps: 0,
            desc: [None, None],
            desc_bytes: [0, 0],
            desc_free: [Event::create(ctx, false)?, Event::create(ctx, false)?],
            desc_on_lane: [false; 2],
            transfers: 0,
            retired: Vec::new(),
            src: Vec::new(),
            dst: Vec::new(),
            size: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(steps: usize, next: usize, kernel_slot: Option<usize>) -> StagedRun {
        StagedRun {
            kernel: LoadedKernel {
                function: 0,
                spec: KernelSpec {
                    function: 0,
                    threads: 128,
                    shared: 0,
                    params: Vec::new(),
                    rows: 1,
                    ctas: 16,
                    row_bytes: 0,
                    chained: false,
                },
                kind: KernelKind::Staged,
                total: 0,
            },
            steps: (0..steps)
                .map(|i| StagedStep {
                    rows: i..i + 1,
                    blocks: i..i + 1,
                    ring_start: 0,
                })
                .collect(),
            behind: false,
            next,
            fail_at: None,
            cols: [0; 3],
            desc: None,
            upload: None,
            kernel_slot,
        }
    }

    #[test]
    fn a_run_is_whole_once_its_last_step_went_in_and_only_then() {
        let (d2h, h2d) = (Direction::DeviceToHost, Direction::HostToDevice);
        // GPU -> CPU: each step is its kernel then its rows; the last step's rows end it.
        assert!(run(3, 3, None).whole(d2h));
        assert!(!run(3, 2, None).whole(d2h));
        // CPU -> GPU: one step more than there are, the last kernel; not before it went in.
        assert!(!run(3, 3, Some(1)).whole(h2d));
        assert!(run(3, 4, None).whole(h2d));
        // A run with no step orders nothing: never whole.
        assert!(!run(0, 0, None).whole(d2h));
        assert!(!run(0, 1, None).whole(h2d));
    }
}
