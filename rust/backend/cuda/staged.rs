//! The staged plan's issuing: the steps of a staged transfer and its kernel launches (its
//! resources are in `stage`).

use crate::sync::{MutexExt, RwLockExt};
use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;

use super::driver::{check, MAX_KERNEL_PARAMS};
use super::resources::{order, Event, StreamHandle};
use super::shared::Shared;
use super::stage::{take_slot, EntryCopy, EntryUpload, LoadedKernel, Stage, StagedRun};
use crate::backend::{take_injected, BackendError};
use crate::direction::Direction;
use crate::kernel::{kernel_split, KernelBatch, KernelKind, KernelParam};
use crate::slab::SlabInner;
use crate::table::{StagedRequest, STAGED_RAMP};

/// What a staged kernel's launch reads besides its block entries: the group's geometry at slab
/// entry `table` (its header) with `segments` pages per block, the ring's offsets shifted by
/// `ring_base`, the ring the pages' source (`ring_src`, CPU -> GPU) or destination; `wide`: on
/// [`STAGED_RAMP`] times the kernel's CTAs (see [`Shared::step_kernel`]).
#[derive(Clone, Copy, Debug)]
struct StagedLaunch {
    table: usize,
    segments: u64,
    ring_base: u64,
    ring_src: bool,
    wide: bool,
    /// After the launch before it on the stream, the same transfer's (see
    /// [`crate::kernel::KernelSpec::chained`]).
    chain: bool,
}

impl Shared {
    /// Begins a staged transfer (see [`StagedRequest`]): its kernel and the lane's stage checked
    /// (the stage made on the lane's first staged transfer), the wait for the caller's stream
    /// GPU -> CPU, and CPU -> GPU the copy of its block entries to device memory. Its steps then
    /// go in by [`Self::staged_steps`], as many calls as the issuer likes, and
    /// [`Self::staged_end`] closes it; `Err` where nothing of it may run (then no step and no
    /// end).
    ///
    /// Per step, CPU -> GPU, the step's rows are copied into a ring slot on the lane's stream,
    /// then the kernel moves its pages from the slot into the GPU pages on the stage's stream;
    /// GPU -> CPU the kernel into the slot, then the rows out of it. Two slots: a step's copy
    /// across `PCIe` overlaps the previous step's kernel, also across transfers (the lane's
    /// stream never waits for a kernel of an earlier transfer, only for its slot, and CPU -> GPU
    /// for the descriptor buffer of the transfer before the previous one). The completion marker
    /// goes where [`CudaBackend::marker_stream`] says: after every kernel issued, whatever
    /// failed, so a slab is never handed back while a kernel may read it. `dep`: an event holding
    /// the caller's stream, which the kernels gathering GPU pages wait for. `behind`: an
    /// earlier transfer of the lane is still running, which the first steps overlap (see
    /// [`crate::table::STAGED_RAMP`]).
    pub(super) fn staged_begin(
        &self,
        lane: Direction,
        slab: &SlabInner,
        req: StagedRequest,
        dep: Option<&Event>,
        behind: bool,
    ) -> Result<StagedRun, BackendError> {
        let l = self.lane(lane);
        let Some(kernel) = req
            .kernel
            .and_then(|k| self.kernels.read_locked().get(k as usize).cloned())
            .filter(|k| k.kind == KernelKind::Staged)
        else {
            return Err(BackendError::InvalidArgument(format!(
                "the staged plan needs a staged kernel loaded by this engine (load_kernel), got \
                 {:?}",
                req.kernel
            )));
        };
        let mut stage = l.stage.locked();
        let st = Stage::made(&mut stage, self.ctx.raw, req.slot_bytes)?;
        if !req.direct {
            st.make_ring(self.ctx.raw)?;
        }
        let host_src = lane == Direction::HostToDevice;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let first = req.first_block;
        let steps = req.steps(src, dst, size, behind);
        let fail_at = take_injected(&self.fail_next).then_some(steps.len() / 2);
        let kstream = st.stream.handle();
        let mut run = StagedRun {
            kernel,
            steps,
            behind,
            next: 0,
            fail_at,
            cols: [0, 1, 2].map(|c| slab.column_addr(c)),
            desc: None,
            upload: None,
            kernel_slot: None,
        };
        if let Some(ev) = dep.filter(|_| !host_src && !req.direct) {
            // The event holds the caller's stream (CPU -> GPU kernels, and a direct transfer's,
            // follow the lane's stream, which waits for it).
            kstream.wait(ev)?;
        }
        if src.len() > first && host_src {
            // CPU -> GPU, the block entries and geometries go to device memory in one copy (see
            // `upload_entries`) on the lane's stream: a direct transfer's now (its kernels run
            // there), a staged one's after its first step's rows (the first kernel needs both;
            // the rows start as soon as they are issued).
            // The transfer's descriptor buffer (see `Stage::desc`): CPU -> GPU transfers take
            // the two in turn.
            let b = (st.transfers % 2) as usize;
            st.transfers += 1;
            let (n, cap) = (src.len() - first, slab.capacity());
            let copy = EntryCopy::new(first, n, cap);
            let dev = st.desc_buffer(self.ctx.raw, b, copy.device_bytes())?;
            run.cols = [0, 1, 2].map(|c| copy.column(dev, c));
            let upload = EntryUpload {
                copy,
                col0: slab.column_addr(0),
                dev,
                b,
            };
            if req.direct {
                // Once the kernels that last read the buffer are done.
                let lstream = l.stream.handle();
                lstream.wait(&st.desc_free[b])?;
                Self::upload_entries(lstream, upload)?;
                run.desc = Some(b);
            } else {
                run.upload = Some(upload);
            }
            st.desc_on_lane[b] = req.direct;
        }
        // GPU -> CPU, the kernels read the entries in the slab in place (`run.cols`): a copy of
        // them to the device is a CPU -> GPU copy, which queues on the copy engine behind every
        // row the other lane issued before it, and held each transfer's first kernel, so its
        // rows, until the loads ahead of it had crossed: offload and onload at once moved 55 GB/s,
        // one direction's worth (H200, 2026-11-30, `benches/bench_staged_side.py`).
        Ok(run)
    }

    /// Makes `lane`'s stage now (see [`crate::backend::Backend::prepare_staged`]): its stream and
    /// events, with `ring` its two slots of `slot` bytes, CPU -> GPU both descriptor buffers at
    /// their smallest (a transfer needing more grows its buffer, as before). The context is
    /// current.
    pub(super) fn prepare_stage(
        &self,
        lane: Direction,
        slot: u64,
        ring: bool,
    ) -> Result<(), BackendError> {
        let mut stage = self.lane(lane).stage.locked();
        let st = Stage::made(&mut stage, self.ctx.raw, slot)?;
        if ring {
            st.make_ring(self.ctx.raw)?;
        }
        if lane == Direction::HostToDevice {
            for b in 0..2 {
                st.desc_buffer(self.ctx.raw, b, 0)?;
            }
        }
        Ok(())
    }

    /// Issues the steps of `run` up to `until` (exclusive, at most all of them), after those
    /// issued before: GPU -> CPU step `k` is its kernel then its rows; CPU -> GPU it is its rows
    /// then the kernel of step `k - 1`, and the steps end with the last step's kernel (one step
    /// more than there are). CPU -> GPU, the next step's rows are queued before a step's kernel
    /// is launched: a launch can hold the issuing thread for tens of microseconds (the first of
    /// a burst), and the copy engine moves the next rows meanwhile instead of waiting for them.
    pub(super) fn staged_steps(
        &self,
        lane: Direction,
        slab: &SlabInner,
        req: &StagedRequest,
        run: &mut StagedRun,
        until: usize,
    ) -> Result<(), BackendError> {
        let l = self.lane(lane);
        let mut stage = l.stage.locked();
        let st = stage.as_mut().expect("made by staged_begin");
        let host_src = lane == Direction::HostToDevice;
        let lstream = l.stream.handle();
        let n = run.steps.len();
        if req.direct {
            while run.next < until.min(n) {
                let k = run.next;
                run.next += 1;
                if Some(k) == run.fail_at {
                    let index = req.first_block + run.steps[k].blocks.start;
                    return Err(BackendError::Injected { index });
                }
                Self::launch_geometries(lstream, slab, req, run, k, (0, host_src, false))?;
            }
            return Ok(());
        }
        let until = until.min(n + usize::from(host_src && n > 0));
        while run.next < until {
            let k = run.next;
            run.next += 1;
            if host_src {
                if k < n {
                    let slot = take_slot(st);
                    self.step_rows(lane, st, slab, run, k, slot)?;
                    if let Some(upload) = run.upload.take() {
                        lstream.wait(&st.desc_free[upload.b])?;
                        Self::upload_entries(lstream, upload)?;
                        run.desc = Some(upload.b);
                    }
                    // The kernel stream waits for this only when the step's kernel goes in.
                    st.ready[slot].record(lstream)?;
                    if let Some(prev) = run.kernel_slot.replace(slot) {
                        Self::step_kernel(lane, st, slab, req, run, k - 1, prev)?;
                    }
                } else if let Some(prev) = run.kernel_slot.take() {
                    Self::step_kernel(lane, st, slab, req, run, k - 1, prev)?;
                }
            } else {
                let slot = take_slot(st);
                Self::step_kernel(lane, st, slab, req, run, k, slot)?;
                self.step_rows(lane, st, slab, run, k, slot)?;
            }
        }
        Ok(())
    }

    /// Step `k`'s rows across `PCIe` through ring slot `slot`, once the slot is free: CPU -> GPU
    /// on the lane's stream into the slot (the caller records the slot ready), GPU -> CPU after
    /// the step's kernel filled it, then the slot is free again.
    fn step_rows(
        &self,
        lane: Direction,
        st: &mut Stage,
        slab: &SlabInner,
        run: &StagedRun,
        k: usize,
        slot: usize,
    ) -> Result<(), BackendError> {
        let host_src = lane == Direction::HostToDevice;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let step = &run.steps[k];
        let shift = st.shift(slot, step);
        st.src.clear();
        st.dst.clear();
        st.size.clear();
        for i in step.rows.clone() {
            let at = dst[i].wrapping_add(shift);
            let (a, b) = if host_src { (src[i], at) } else { (at, src[i]) };
            st.src.push(a);
            st.dst.push(b);
            st.size.push(size[i]);
        }
        if Some(k) == run.fail_at {
            // The injected fault: a null address the driver refuses, as in `issue_copies`.
            let mid = st.dst.len() / 2;
            st.dst[mid] = 0;
        }
        let lstream = self.lane(lane).stream.handle();
        if host_src {
            // A slot never recorded free is waited for at once.
            lstream.wait(&st.free[slot])?;
        } else {
            lstream.wait(&st.ready[slot])?;
        }
        self.copy_arrays(lane, &st.src, &st.dst, &st.size, step.rows.start)?;
        if !host_src {
            st.free[slot].record(lstream)?;
        }
        Ok(())
    }

    /// Step `k`'s kernel on the stage's stream, one launch for each run of blocks of one group
    /// (one geometry): CPU -> GPU after the step's rows (`ready[slot]`), then the slot is free
    /// again; GPU -> CPU once the slot is free, then the slot is ready for the rows. The kernel
    /// computes every page's addresses from the block entries (`run.cols`: CPU -> GPU the
    /// stage's device copy of the slab's, not overwritten before the kernel ends, see
    /// `Stage::desc`; GPU -> CPU the slab's own, in flight until the marker after the kernel);
    /// the ids were checked at submission, the slot is this lane's.
    fn step_kernel(
        lane: Direction,
        st: &Stage,
        slab: &SlabInner,
        req: &StagedRequest,
        run: &StagedRun,
        k: usize,
        slot: usize,
    ) -> Result<(), BackendError> {
        let host_src = lane == Direction::HostToDevice;
        let step = &run.steps[k];
        let shift = st.shift(slot, step);
        let kstream = st.stream.handle();
        kstream.wait(if host_src {
            &st.ready[slot]
        } else {
            &st.free[slot]
        })?;
        // The kernel no copy overlaps (CPU -> GPU the last, GPU -> CPU the first unless an
        // earlier transfer's rows still cross) runs wide: the transfer waits for all of it, and
        // a ramp's step is as short on more CTAs.
        let wide = if host_src {
            k + 1 == run.steps.len()
        } else {
            k == 0 && !run.behind
        };
        Self::launch_geometries(kstream, slab, req, run, k, (shift, host_src, wide))?;
        if host_src {
            st.free[slot].record(kstream)
        } else {
            st.ready[slot].record(kstream)
        }
    }

    /// The kernel launches of step `k` of `run` on `stream`: one for each run of its blocks that
    /// share a geometry (one group's, or equal ones), the ring's offsets shifted by `ring_base`
    /// (0 for a direct transfer, whose ring side holds host addresses), the ring the pages'
    /// source where `ring_src`, on more CTAs where `wide` (see [`StagedLaunch`]). The kernels
    /// read the entries at `run.cols`; the ids were checked at submission, and the
    /// ring side is this lane's slot or, direct, the host table's pages (registered memory).
    fn launch_geometries(
        stream: StreamHandle,
        slab: &SlabInner,
        req: &StagedRequest,
        run: &StagedRun,
        k: usize,
        (ring_base, ring_src, wide): (u64, bool, bool),
    ) -> Result<(), BackendError> {
        let (src, size) = (slab.src(), slab.size());
        let step = &run.steps[k];
        let first = req.first_block;
        let (mut b, end) = (first + step.blocks.start, first + step.blocks.end);
        while b < end {
            let table = size[b];
            let run_end = (b..end).find(|&i| size[i] != table).unwrap_or(end);
            let at = StagedLaunch {
                table: table as usize,
                segments: src[table as usize],
                ring_base,
                ring_src,
                wide,
                // A direct transfer's launches follow each other on the lane's stream, the
                // first after its entries' upload (see `staged_begin`); their pages are
                // pairwise disjoint (checked at submission).
                chain: req.direct && b > first,
            };
            Self::launch(
                &run.kernel,
                stream,
                run.cols,
                (b, (run_end - b) as u64, 1),
                Some(at),
            )?;
            b = run_end;
        }
        Ok(())
    }

    /// Queues the copy of a transfer's block entries into its descriptor buffer on `stream`,
    /// which the caller has ordered after the kernels of the transfer that last read the buffer
    /// (the kernel stream itself, or a stream that waited for `desc_free`). `cols[c] + 8 * i`
    /// is then where the kernels read entry `i` of column `c`.
    fn upload_entries(stream: StreamHandle, u: EntryUpload) -> Result<(), BackendError> {
        let c = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: u.col0 + u.copy.src_offset,
            srcArray: std::ptr::null_mut(),
            srcPitch: u.copy.src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: std::ptr::null_mut(),
            dstDevice: u.dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: u.copy.width,
            WidthInBytes: u.copy.width,
            Height: 3,
        };
        // SAFETY: the three rows (entries `[first, first + n)` of each column) lie in the
        // slab's pinned allocation, which outlives the copy (the lane's marker waits for the
        // kernel stream); `u.dev` holds at least the three rows (`desc_buffer`), and the kernels
        // of earlier transfers that read it come before this copy (the caller's promise, kept
        // by both callers); the struct is read during the call only.
        check("cuMemcpy2DAsync", unsafe {
            sys::cuMemcpy2DAsync_v2(&raw const c, stream.raw())
        })
    }

    /// Closes a staged transfer that began, whatever its steps did: its descriptor buffer may
    /// be filled again once every kernel issued has run.
    pub(super) fn staged_end(&self, lane: Direction, run: &StagedRun) {
        let Some(b) = run.desc else {
            return;
        };
        let l = self.lane(lane);
        let stage = l.stage.locked();
        let st = stage.as_ref().expect("made by staged_begin");
        // A direct transfer's kernels ran on the lane's stream.
        let stream = if st.desc_on_lane[b] {
            l.stream.handle()
        } else {
            st.stream.handle()
        };
        if st.desc_free[b].record(stream).is_err() {
            // The next transfer to fill the buffer could not wait for the kernels reading it:
            // they end first.
            let _ = stream.synchronize();
        }
    }

    /// The stream the completion marker of a transfer goes on, ordered after all of the
    /// transfer's work and after the lane's earlier markers. A staged CPU -> GPU transfer ends
    /// with kernels: its marker goes on the kernel stream, after the lane's stream (so the
    /// lane's stream goes on to the next transfer's rows at once), unless the lane's stream is
    /// the caller's, who expects the whole transfer on it. Any other marker goes on the lane's
    /// stream, after the kernel stream where a staged transfer or marker went there last.
    /// Where an ordering call fails, this waits for the kernel stream instead.
    ///
    /// `whole`: the staged transfer's every step went in (see [`StagedRun::whole`]). Its last
    /// step already waited for all of its work on the other stream: CPU -> GPU the last kernel
    /// for the slot's rows (the lane's stream runs in order, so for every row and the entries'
    /// copy before them), GPU -> CPU the last rows for the slot's kernel (the kernel stream runs
    /// in order). The marker then goes after it with no second wait between the streams, which
    /// would order nothing the last step does not (alternated with the build before on an H100,
    /// 2026-11-27: within the run-to-run spread, `benches/probe_one_copy.py`).
    pub(super) fn marker_stream(&self, lane: Direction, staged: bool, whole: bool) -> StreamHandle {
        let l = self.lane(lane);
        let lstream = l.stream.handle();
        let mut stage = l.stage.locked();
        let Some(st) = stage.as_mut() else {
            return lstream;
        };
        let kstream = st.stream.handle();
        let host_src = lane == Direction::HostToDevice;
        if staged
            && host_src
            && l.stream.owned
            && (whole || order(&st.lane_done, lstream, kstream).is_ok())
        {
            st.marker_on_kernels = true;
            return kstream;
        }
        // GPU -> CPU a whole staged transfer ends with rows on the lane's stream (see above).
        let ends_here = staged && whole && !host_src;
        if (staged && !ends_here) || st.marker_on_kernels {
            if order(&st.join, kstream, lstream).is_err() {
                let _ = kstream.synchronize();
            }
            st.marker_on_kernels = false;
        }
        lstream
    }

    /// Launches `k` on `stream` over entries `[p0, p0 + n)` of a transfer whose columns (src,
    /// dst, size) hold entry 0 at `cols`: a page kernel's descriptors, each cut in `split`
    /// slices, or (with `staged`) a staged kernel's block entries. The caller vouches that the
    /// kernel may read `cols` until it ends and that every address the entries name may be
    /// written or read as they say.
    fn launch(
        k: &LoadedKernel,
        stream: StreamHandle,
        cols: [u64; 3],
        (p0, n, split): (usize, u64, u64),
        staged: Option<StagedLaunch>,
    ) -> Result<(), BackendError> {
        if n == 0 {
            return Ok(());
        }
        let at = |c: usize, i: usize| cols[c].wrapping_add(8 * i as u64);
        // A geometry's segments start after its header (see `crate::table::staged`).
        let seg = staged.map_or(0, |g| g.table + 1);
        let mut vals = [0u64; MAX_KERNEL_PARAMS];
        for (v, p) in vals.iter_mut().zip(&k.spec.params) {
            *v = match p {
                KernelParam::Srcs | KernelParam::Ids => at(0, p0),
                KernelParam::Dsts | KernelParam::Rings => at(1, p0),
                KernelParam::Sizes => at(2, p0),
                KernelParam::Count => n,
                KernelParam::Split => split,
                KernelParam::SrcBase | KernelParam::DstBase => 0,
                KernelParam::Bases => at(0, seg),
                KernelParam::Strides => at(1, seg),
                KernelParam::Offsets => at(2, seg),
                KernelParam::Segments => staged.map_or(0, |g| g.segments),
                KernelParam::RingBase => staged.map_or(0, |g| g.ring_base),
                KernelParam::RingSrc => u64::from(staged.is_some_and(|g| g.ring_src)),
            };
        }
        // Work items: a descriptor's slices, or a block's pages.
        let items = n.saturating_mul(staged.map_or(split, |g| g.segments));
        let mut ptrs = [ptr::null_mut::<c_void>(); MAX_KERNEL_PARAMS];
        for (p, v) in ptrs.iter_mut().zip(vals.iter_mut()).take(k.total) {
            *p = std::ptr::from_mut::<u64>(v).cast();
        }
        let ctas = u64::from(k.spec.ctas)
            * if staged.is_some_and(|g| g.wide) {
                STAGED_RAMP as u64
            } else {
                1
            };
        let grid = items.div_ceil(u64::from(k.spec.rows)).min(ctas).max(1) as u32;
        if k.spec.chained && staged.is_some_and(|g| g.chain) {
            return Self::launch_chained(k, stream, grid, &mut ptrs);
        }
        // SAFETY: `function` was checked at load to take `total` 8-byte parameters, each read
        // from `vals` during the call; what the kernel reads and writes, the caller vouches for
        // (see above and the two callers: the staged plan's steps, `launch_pages`).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                k.function as sys::CUfunction,
                grid,
                1,
                1,
                k.spec.threads,
                1,
                1,
                k.spec.shared,
                stream.raw(),
                ptrs.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// [`Self::launch`] with programmatic stream serialization: the launch may start before the
    /// kernel before it on `stream` ends, once each of that kernel's programs has let it (a
    /// [`crate::kernel::KernelSpec::chained`] kernel does on its last work), and waits at its
    /// own end for that kernel, so that what follows on the stream still follows both.
    fn launch_chained(
        k: &LoadedKernel,
        stream: StreamHandle,
        grid: u32,
        ptrs: &mut [*mut c_void; MAX_KERNEL_PARAMS],
    ) -> Result<(), BackendError> {
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: k.spec.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: k.spec.shared,
            hStream: stream.raw(),
            attrs: &raw mut attr,
            numAttrs: 1,
        };
        // SAFETY: as `launch`'s call (its parameters in `ptrs`, read during the call); `config`
        // and its one attribute live across the call.
        check("cuLaunchKernelEx", unsafe {
            sys::cuLaunchKernelEx(
                &raw const config,
                k.function as sys::CUfunction,
                ptrs.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// The kernel route with a loaded kernel: `batch`'s descriptors by `kernel` on `stream`,
    /// at most `launch_bytes` (as descriptors of the batch's largest size, at least one) per
    /// launch, one launch after the other.
    pub(super) fn launch_pages(
        &self,
        stream: StreamHandle,
        batch: KernelBatch,
        kernel: u32,
        launch_bytes: u64,
    ) -> Result<(), BackendError> {
        let Some(k) = self
            .kernels
            .read_locked()
            .get(kernel as usize)
            .cloned()
            .filter(|k| k.kind == KernelKind::Pages)
        else {
            return Err(BackendError::InvalidArgument(format!(
                "the kernel route needs a page kernel loaded by this engine (load_kernel), got \
                 {kernel}"
            )));
        };
        let per = (launch_bytes / batch.max_size.max(1)).max(1);
        let cols = [batch.src, batch.dst, batch.size];
        let mut p0 = 0usize;
        while p0 < batch.len {
            let n = per.min((batch.len - p0) as u64);
            let split = kernel_split(&k.spec, n, batch.max_size);
            // The kernel reads the descriptors from the slab's pinned columns in place (mapped
            // memory, alive until the lane's marker after this launch is seen); every address
            // they name was checked against registered memory at submission.
            Self::launch(&k, stream, cols, (p0, n, split), None)?;
            p0 += n as usize;
        }
        Ok(())
    }
}
