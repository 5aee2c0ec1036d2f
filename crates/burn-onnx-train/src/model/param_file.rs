//! ZeRO-3's parameter chunks on disk (`offload.offload_params = "disk"`, ZeRO-Infinity's
//! parameter offload to NVMe): a rank's chunks live in one memory-mapped file under the
//! offload directory, and each chunk *is* a CPU (Flex) tensor whose storage is its range of
//! the mapping, so the gather reads it there and the fused CPU update writes it there in
//! place. Each range's pages are released from the process after it is read
//! ([`ParamFile::release`]), after ZeRO's update writes it (the mapping is registered with
//! [`burn_ort_dist::storage::mapped`]) and after the update ([`ParamFile::settle`]): the kernel writes
//! them back to the file and pages them in again at the next read, so memory holds the
//! chunks being read or updated, not all of them. The file is unlinked as soon as it is
//! mapped (nothing is left behind, even after a kill); checkpoints hold the values.
//!
//! A parameter replaced by a new tensor (an optimizer that does not update in place, a
//! state update, loaded values) is copied back into its range by [`ParamFile::settle`],
//! unless a tensor still reading that range is alive somewhere (a clone taken earlier):
//! then it stays in memory until a later settle finds the range free.

use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

use burn::backend::DType;
use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::{Bytes, TensorData};
use burn_std::{AccessError, AccessPolicy, AllocationController, AllocationProperty};
use memmap2::MmapRaw;

use crate::value::{MAX_RANK, PhysTensor};

/// Byte alignment of every range (a cache line: the update's vector loads stay aligned).
const ALIGN: usize = 64;

/// One parameter chunk's place in the file.
#[derive(Debug)]
struct Range {
    /// Byte offset in the mapping.
    offset: usize,
    /// Values (f32).
    len: usize,
    /// Alive while a tensor over this range is (see [`MappedValues`]).
    live: Mutex<Weak<()>>,
}

/// How [`ParamFile::settle`] kept a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// It was in its range already (updated in place).
    InPlace,
    /// Its new values were copied into its range.
    CopiedBack,
    /// In memory: a tensor over its range is still alive.
    InMemory,
}

/// The file's mapping, registered for [`burn_ort_dist::storage::mapped::release`] while it exists
/// (the registration goes first: fields drop in order).
struct Mapping {
    _registered: burn_ort_dist::storage::mapped::Registered,
    map: MmapRaw,
}

impl Mapping {
    fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// A rank's parameter chunks in a memory-mapped file (see the module doc).
pub struct ParamFile {
    map: Arc<Mapping>,
    ranges: Vec<Arc<Range>>,
}

impl std::fmt::Debug for ParamFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ParamFile({} chunks, {} bytes on disk)",
            self.ranges.len(),
            self.map.len()
        )
    }
}

impl ParamFile {
    /// A new file under `dir` with a range for each of `lens` values (zeroed).
    pub fn create(dir: &Path, lens: &[usize]) -> std::io::Result<Self> {
        let mut offset = 0;
        let ranges: Vec<Arc<Range>> = lens
            .iter()
            .map(|&len| {
                let r = Range {
                    offset,
                    len,
                    live: Mutex::new(Weak::new()),
                };
                offset += (4 * len).div_ceil(ALIGN) * ALIGN;
                Arc::new(r)
            })
            .collect();
        let file = burn_ort_dist::storage::mapped::unlinked_file(
            dir,
            "parameters",
            offset.max(ALIGN) as u64,
        )?;
        let map = MmapRaw::map_raw(&file)?;
        Ok(ParamFile {
            map: Arc::new(Mapping {
                _registered: burn_ort_dist::storage::mapped::register(map.as_ptr(), map.len()),
                map,
            }),
            ranges,
        })
    }

    /// The same file seen by a part of the model that holds chunks `which` (a pipeline
    /// stage or a recomputed segment): its chunk `k` is this file's chunk `which[k]`.
    pub fn select(&self, which: &[usize]) -> ParamFile {
        ParamFile {
            map: self.map.clone(),
            ranges: which.iter().map(|&i| self.ranges[i].clone()).collect(),
        }
    }

    /// Chunk `i` as a CPU tensor over its range (tracked by autodiff when `autodiff`), the
    /// physical vector shape ZeRO-3's chunks have.
    fn tensor(&self, i: usize, autodiff: bool) -> PhysTensor {
        let r = &self.ranges[i];
        let live = Arc::new(());
        *r.live.lock().expect("not poisoned") = Arc::downgrade(&live);
        let controller = MappedValues {
            map: self.map.clone(),
            offset: r.offset,
            bytes: 4 * r.len,
            _live: live,
        };
        // SAFETY: the controller's memory is the range's 4 * len bytes of the mapping, all
        // initialized (a file reads as zeros where it was never written).
        let bytes = unsafe { Bytes::from_controller(Box::new(controller), 4 * r.len) };
        let mut shape = vec![1; MAX_RANK];
        shape[MAX_RANK - 1] = r.len;
        let flex = FlexTensor::from_data(TensorData::from_bytes(bytes, shape, DType::F32));
        let t = burn::tensor::Tensor::from_primitive::<Flex>(flex);
        if autodiff {
            PhysTensor::from_inner(t)
        } else {
            t
        }
    }

    /// Chunk `i` written with `values` and returned as a tensor over its range.
    pub fn store(&self, i: usize, values: &[f32], autodiff: bool) -> PhysTensor {
        let r = &self.ranges[i];
        assert_eq!(values.len(), r.len, "chunk {i}: value count");
        // SAFETY: the range lies in the mapping, and no tensor over it is alive (the
        // callers check, or the range was never handed out).
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr(),
                self.map.ptr().add(r.offset).cast::<f32>(),
                r.len,
            );
        }
        self.release(i);
        self.tensor(i, autodiff)
    }

    /// Whether `t` reads chunk `i`'s range of the file.
    fn holds(&self, i: usize, t: &PhysTensor) -> bool {
        let r = &self.ranges[i];
        let Ok(flex) = t.clone().inner().try_into_primitive::<Flex>() else {
            return false;
        };
        flex.dtype() == DType::F32
            && flex.as_slice::<f32>().is_some_and(|s| {
                s.len() == r.len
                    && std::ptr::eq(s.as_ptr().cast::<u8>(), unsafe {
                        // SAFETY: the offset lies in the mapping.
                        self.map.ptr().add(r.offset).cast_const()
                    })
            })
    }

    /// Chunk `i` as it should be kept after `t` became its value: `t` itself when it reads
    /// the range (its pages released), else `t`'s values copied into the range, unless a
    /// tensor over the range is still alive elsewhere (then `t`, in memory, until a later
    /// settle).
    pub fn settle(&self, i: usize, t: PhysTensor) -> Result<(PhysTensor, Kept), String> {
        if self.holds(i, &t) {
            self.release(i);
            return Ok((t, Kept::InPlace));
        }
        let alive = self.ranges[i]
            .live
            .lock()
            .expect("not poisoned")
            .strong_count()
            > 0;
        if alive {
            return Ok((t, Kept::InMemory));
        }
        let values = burn_ort_dist::host_values(t.clone())?;
        let require = t.is_require_grad();
        let autodiff = t.device().is_autodiff();
        drop(t);
        let t = self.store(i, &values, autodiff).set_require_grad(require);
        Ok((t, Kept::CopiedBack))
    }

    /// Drop chunk `i`'s pages from this process's memory (see
    /// [`burn_ort_dist::storage::mapped::release`]).
    pub fn release(&self, i: usize) {
        let r = &self.ranges[i];
        // SAFETY: the range's values lie in the mapping; read only to take the address.
        let values = unsafe {
            std::slice::from_raw_parts(self.map.ptr().add(r.offset).cast::<f32>(), r.len)
        };
        burn_ort_dist::storage::mapped::release(values);
    }
}

/// The memory of a tensor over one range of the file: the mapping itself, so that reads
/// and in-place writes go to the file's pages. Never duplicated: a clone of its bytes (copy
/// on write of a shared tensor) is an ordinary buffer.
struct MappedValues {
    map: Arc<Mapping>,
    offset: usize,
    bytes: usize,
    _live: Arc<()>,
}

impl AllocationController for MappedValues {
    fn alloc_align(&self) -> usize {
        ALIGN
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        // SAFETY: the range lies in the mapping, which the Arc keeps alive, and no other
        // controller covers it (one tensor per range at a time: `ParamFile::settle`).
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.map.ptr().add(self.offset).cast(), self.bytes)
        })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        // SAFETY: as in `memory_mut`, read only.
        Ok(unsafe {
            std::slice::from_raw_parts(
                self.map.ptr().add(self.offset).cast_const().cast(),
                self.bytes,
            )
        })
    }
}
