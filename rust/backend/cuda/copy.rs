//! The copies of a transfer on its lane's stream: the batch call or the loop, pitched rows.

use cudarc::driver::sys;

use super::driver::{error_name, Batch3dFn, BatchFn};
use super::shared::Shared;
use crate::backend::{take_injected, BackendError};
use crate::direction::Direction;
use crate::slab::SlabInner;

impl Shared {
    /// Issues the DMA copies of descriptors `[first, len)` of one transfer on the lane's stream.
    /// On failure, the index of the failing descriptor where it is known.
    pub(super) fn issue_copies(
        &self,
        lane: Direction,
        slab: &SlabInner,
        first: usize,
    ) -> Result<(), BackendError> {
        let (src, size) = (&slab.src()[first..], &slab.size()[first..]);
        let poisoned;
        let dst = if take_injected(&self.fail_next) {
            // The injected fault: a copy of the destinations with a null address in the middle,
            // which the driver refuses (CUDA_ERROR_INVALID_VALUE, measured on driver 580 for the
            // batch call and the loop) before touching memory. The slab itself is not modified.
            let mut d = slab.dst()[first..].to_vec();
            let mid = d.len() / 2;
            if let Some(x) = d.get_mut(mid) {
                *x = 0;
            }
            poisoned = d;
            &poisoned[..]
        } else {
            &slab.dst()[first..]
        };
        self.copy_arrays(lane, src, dst, size, first)
    }

    /// Issues the 1-D copies `(src[i], dst[i], size[i])` on the lane's stream, batched where the
    /// driver can; errors name descriptor `first + i`.
    pub(super) fn copy_arrays(
        &self,
        lane: Direction,
        src: &[u64],
        dst: &[u64],
        size: &[u64],
        first: usize,
    ) -> Result<(), BackendError> {
        let stream = self.lane(lane).stream.raw;
        let Some(batch) = self.batch else {
            for i in 0..src.len() {
                // SAFETY: every range was checked against registered memory before submission;
                // unified addressing lets cuMemcpyAsync infer each direction.
                let r = unsafe { sys::cuMemcpyAsync(dst[i], src[i], size[i] as usize, stream) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Err(BackendError::CopyFailed {
                        index: Some(first + i),
                        reason: format!("cuMemcpyAsync: {}", error_name(r)),
                    });
                }
            }
            return Ok(());
        };
        let mut attrs = self.attrs(lane);
        let mut attr_idx = 0usize;
        let chunk = self.opts.max_batch.max(1);
        let mut start = 0;
        while start < src.len() {
            let n = chunk.min(src.len() - start);
            // The driver takes mutable pointers but only reads the arrays during the call.
            let (d, s, z) = (
                dst[start..].as_ptr().cast_mut(),
                src[start..].as_ptr().cast_mut(),
                size[start..].as_ptr() as *mut usize,
            );
            let mut fail_idx = usize::MAX;
            // SAFETY: d, s, z point at n valid u64 descriptors (u64 == CUdeviceptr == usize on
            // 64-bit), read only during the call; one attribute applies to all from index 0; the
            // ranges were checked against registered memory; the stream is valid.
            let r = unsafe {
                match batch {
                    BatchFn::V12(f) => f(
                        d,
                        s,
                        z,
                        n,
                        &raw mut attrs,
                        &raw mut attr_idx,
                        1,
                        &raw mut fail_idx,
                        stream,
                    ),
                    BatchFn::V13(f) => f(d, s, z, n, &raw mut attrs, &raw mut attr_idx, 1, stream),
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                let index = if fail_idx < n {
                    Some(first + start + fail_idx)
                } else {
                    Self::find_bad_descriptor(&src[start..start + n], &dst[start..start + n])
                        .map(|i| first + start + i)
                };
                return Err(BackendError::CopyFailed {
                    index,
                    reason: format!("cuMemcpyBatchAsync: {}", error_name(r)),
                });
            }
            start += n;
        }
        Ok(())
    }

    /// Issues the 2-D copies of a pitched transfer (see [`crate::table::expand_runs_into`]) on
    /// the lane's stream, one `cuMemcpy2DAsync` each: rows of pages at one pitch per side, copy
    /// engines only. On failure, the index of the failing copy.
    pub(super) fn issue_pitched(
        &self,
        lane: Direction,
        slab: &SlabInner,
    ) -> Result<(), BackendError> {
        let stream = self.lane(lane).stream.raw;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let ops = src.len() / crate::table::PITCHED_ENTRIES;
        // The injected fault: a null destination in the middle copy, which the driver refuses.
        let poison = take_injected(&self.fail_next).then_some(ops / 2);
        if let Some(batch3d) = self.batch3d {
            return self.issue_pitched_batch(lane, batch3d, slab, poison);
        }
        for k in 0..ops {
            let e = crate::table::PITCHED_ENTRIES * k;
            // Unified addressing: the driver finds each side's kind (pinned host or device) from
            // the address, as cuMemcpyAsync does. (Not `mem::zeroed`: the memory-type enum has no
            // zero value.)
            let c = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                srcHost: std::ptr::null(),
                srcDevice: src[e],
                srcArray: std::ptr::null_mut(),
                srcPitch: src[e + 1] as usize,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                dstHost: std::ptr::null_mut(),
                dstDevice: if poison == Some(k) { 0 } else { dst[e] },
                dstArray: std::ptr::null_mut(),
                dstPitch: dst[e + 1] as usize,
                WidthInBytes: size[e] as usize,
                Height: size[e + 1] as usize,
            };
            // SAFETY: every row lies in a registered block table's pages (checked at registration
            // and submission); the struct is read during the call only; the stream is valid.
            let r = unsafe { sys::cuMemcpy2DAsync_v2(&raw const c, stream) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(BackendError::CopyFailed {
                    index: Some(k),
                    reason: format!("cuMemcpy2DAsync: {}", error_name(r)),
                });
            }
        }
        Ok(())
    }

    /// The 2-D copies of a pitched transfer as `cuMemcpy3DBatchAsync` calls (depth 1), up to
    /// `max_batch` copies a call: one driver call per transfer instead of one per block.
    fn issue_pitched_batch(
        &self,
        lane: Direction,
        batch3d: Batch3dFn,
        slab: &SlabInner,
        poison: Option<usize>,
    ) -> Result<(), BackendError> {
        let stream = self.lane(lane).stream.raw;
        let (src, dst, size) = (slab.src(), slab.dst(), slab.size());
        let ops = src.len() / crate::table::PITCHED_ENTRIES;
        let order = self.attrs(lane).srcAccessOrder;
        let operand = |ptr: u64, pitch: u64, rows: u64| sys::CUmemcpy3DOperand {
            type_: sys::CUmemcpy3DOperandType::CU_MEMCPY_OPERAND_TYPE_POINTER,
            op: sys::CUmemcpy3DOperand_st__bindgen_ty_1 {
                // Pointer operands count in bytes (element size 1): a row is `pitch` bytes, a
                // layer `rows` rows.
                ptr: sys::CUmemcpy3DOperand_st__bindgen_ty_1__bindgen_ty_1 {
                    ptr,
                    rowLength: pitch as usize,
                    layerHeight: rows as usize,
                    locHint: sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
                        id: 0,
                    },
                },
            },
        };
        let mut list: Vec<sys::CUDA_MEMCPY3D_BATCH_OP> = (0..ops)
            .map(|k| {
                let e = crate::table::PITCHED_ENTRIES * k;
                let rows = size[e + 1];
                let d = if poison == Some(k) { 0 } else { dst[e] };
                sys::CUDA_MEMCPY3D_BATCH_OP {
                    src: operand(src[e], src[e + 1], rows),
                    dst: operand(d, dst[e + 1], rows),
                    extent: sys::CUextent3D {
                        width: size[e] as usize,
                        height: rows as usize,
                        depth: 1,
                    },
                    srcAccessOrder: order,
                    flags: 0,
                }
            })
            .collect();
        let chunk = self.opts.max_batch.max(1);
        let mut start = 0;
        while start < ops {
            let n = chunk.min(ops - start);
            let list = list[start..].as_mut_ptr();
            let mut fail_idx = usize::MAX;
            // SAFETY: `list` holds n valid ops, read during the call only; every row lies in a
            // registered block table's pages, inside one driver allocation per side (block plans
            // keep to one); the stream is valid.
            let r = unsafe {
                match batch3d {
                    Batch3dFn::V12(f) => f(n, list, &raw mut fail_idx, 0, stream),
                    Batch3dFn::V13(f) => f(n, list, 0, stream),
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(BackendError::CopyFailed {
                    index: (fail_idx < n).then_some(start + fail_idx),
                    reason: format!("cuMemcpy3DBatchAsync: {}", error_name(r)),
                });
            }
            start += n;
        }
        Ok(())
    }
}
