//! A parameter whose values still lie in the model file: a CPU (Flex) tensor whose storage
//! is the initializer's bytes in the file's read-only mapping
//! ([`crate::graph::initializer::Initializer::Mapped`]). Nothing is copied at load; the pages come in
//! where the tensor is read. The first write copies the values into ordinary memory (copy
//! on write: the file is never written), and when the tensor is dropped unwritten its pages
//! leave the resident set. A ZeRO-3 rank that cuts its chunk out of each such parameter
//! therefore holds one whole parameter at a time while it shards.

use std::mem::MaybeUninit;

use burn::backend::DType;
use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::{Bytes, Device, TensorData};
use burn_std::{AccessError, AccessPolicy, AllocationController, AllocationProperty};

use crate::value::PhysTensor;
use crate::value::host_tensor::MappedSlice;

/// `data`'s f32 values as a tensor of shape `shape` (the same element count) on `device`:
/// over the mapping on the CPU, uploaded from it on another device.
pub fn file_tensor(data: &MappedSlice, shape: Vec<usize>, device: &Device) -> PhysTensor {
    let values = data.floats().expect("an initializer mapped as f32");
    let len = std::mem::size_of_val(values);
    let controller = FileValues {
        data: data.clone(),
        copy: None,
    };
    // SAFETY: the controller's memory is the `len` initialized bytes of the mapped slice
    // (or, once written, a copy of them).
    let bytes = unsafe { Bytes::from_controller(Box::new(controller), len) };
    let data = TensorData::from_bytes(bytes, shape, DType::F32);
    if *device != Device::flex() {
        return PhysTensor::from_data(data, device);
    }
    let t = burn::tensor::Tensor::from_primitive::<Flex>(FlexTensor::from_data(data));
    if device.is_autodiff() {
        PhysTensor::from_inner(t)
    } else {
        t
    }
}

/// The memory of a [`file_tensor`]: the mapped bytes, or a private copy once written.
struct FileValues {
    data: MappedSlice,
    /// The values after the first write (f32 words: aligned for any f32 view).
    copy: Option<Vec<f32>>,
}

impl Drop for FileValues {
    fn drop(&mut self) {
        if self.copy.is_none() {
            self.data.release();
        }
    }
}

impl AllocationController for FileValues {
    fn alloc_align(&self) -> usize {
        std::mem::align_of::<f32>()
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::File
    }

    fn capacity(&self) -> usize {
        self.data.as_ref().len()
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        if self.copy.is_none() {
            let values = self.data.floats().expect("an initializer mapped as f32");
            self.copy = Some(values.to_vec());
            self.data.release();
        }
        let copy = self.copy.as_mut().expect("just made");
        let len = std::mem::size_of_val(copy.as_slice());
        // SAFETY: the copy's bytes, initialized f32 values, borrowed mutably with `self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast(), len) })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        let bytes: &[u8] = match &self.copy {
            // SAFETY: the copy's initialized bytes, borrowed with `self`.
            Some(c) => unsafe {
                std::slice::from_raw_parts(c.as_ptr().cast(), std::mem::size_of_val(c.as_slice()))
            },
            None => self.data.as_ref(),
        };
        // SAFETY: u8 and MaybeUninit<u8> have the same layout.
        Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len()) })
    }
}
