//! Device tensors made from host values, kept by the values' content for a model's
//! lifetime: the indices of an embedding lookup (the batch's position ids are the same
//! every pass), a loss's per-row weights, the device form of a mask (the causal mask every
//! layer of every pass reads), one-element constants. A pass asks here before it uploads,
//! so an update uploads only what changed since the last (the batch's token ids and
//! targets), and a value that repeats costs a comparison of its bytes, not a conversion
//! and an upload.
//!
//! The device copies are never written after they are made (they are shared, so no op
//! mutates them in place), so equal content is the same value whichever pass asks. The
//! exception are seeds ([`DeviceUploads::seed_ints`]): the batch's values of a captured
//! update (`crate::train::update_graph`), written over their own device buffer before each
//! replay, since the replayed launches read them there; a pass finds them by content
//! like any copy, before any other.

use std::sync::Mutex;

use burn::tensor::{Device, Int, Tensor, TensorData};
use ndarray::ArrayD;

use super::PhysTensor;
use crate::error::OpResult;

/// How many entries that nothing pins are kept (the least recently used go first).
const KEPT: usize = 64;

/// A host value as an upload is asked for, borrowed.
#[derive(Clone, Copy)]
pub enum HostKey<'a> {
    /// Integers, flat (gather indices, targets).
    Ints(&'a [i64]),
    /// Floats, flat, compared by their bits (loss weights).
    Floats(&'a [f32]),
    /// A boolean mask (in any memory order) and what is made of it.
    Mask(&'a ArrayD<bool>, &'static str),
    /// One float, by its bits.
    Scalar(u32),
}

/// The owned form of a [`HostKey`] (equal when they hold the same values, a mask in any
/// memory order).
#[derive(PartialEq)]
enum Content {
    Ints(Vec<i64>),
    Floats(Vec<u32>),
    Mask(ArrayD<bool>, &'static str),
    Scalar(u32),
}

impl Content {
    fn of(key: HostKey) -> Self {
        match key {
            HostKey::Ints(v) => Content::Ints(v.to_vec()),
            HostKey::Floats(v) => Content::Floats(v.iter().map(|x| x.to_bits()).collect()),
            HostKey::Mask(m, form) => Content::Mask(m.clone(), form),
            HostKey::Scalar(b) => Content::Scalar(b),
        }
    }

    fn matches(&self, key: HostKey) -> bool {
        match (self, key) {
            (Content::Ints(a), HostKey::Ints(b)) => a.as_slice() == b,
            (Content::Floats(a), HostKey::Floats(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| *x == y.to_bits())
            }
            (Content::Mask(a, f), HostKey::Mask(b, g)) => *f == g && same_values(a, b),
            (Content::Scalar(a), HostKey::Scalar(b)) => *a == b,
            _ => false,
        }
    }
}

/// Whether two masks hold the same values at the same shape (a `memcmp` when both are
/// contiguous in the same order).
fn same_values(a: &ArrayD<bool>, b: &ArrayD<bool>) -> bool {
    if a.shape() != b.shape() {
        return false;
    }
    match (a.as_slice(), b.as_slice()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// A device tensor made from host content.
#[derive(Clone)]
pub enum Made {
    /// At the interpreter's physical rank (masks' forms, constants).
    Phys(PhysTensor),
    /// Flat integers.
    Ints(Tensor<1, Int>),
    /// Flat floats.
    Floats(Tensor<1>),
}

struct Entry {
    content: Content,
    device: Device,
    made: Made,
    /// A seed's name and micro-step: written over in place, never forgotten.
    seed: Option<(&'static str, usize)>,
    used: u64,
}

/// A model's device copies of host values, by content (see the module's doc).
#[derive(Default)]
pub struct DeviceUploads {
    entries: Mutex<(Vec<Entry>, u64)>,
    /// Device copies made so far (not found).
    made: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for DeviceUploads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceUploads({} kept)", self.len())
    }
}

impl DeviceUploads {
    /// The device tensor made from `key` on `device`: an earlier one of equal content, or
    /// `make`'s, kept.
    pub fn made(
        &self,
        key: HostKey,
        device: &Device,
        make: impl FnOnce() -> OpResult<Made>,
    ) -> OpResult<Made> {
        let mut guard = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let (entries, clock) = &mut *guard;
        *clock += 1;
        // Seeds first: a copy of equal content made before is not the buffer replays write.
        let found = |e: &Entry| &e.device == device && e.content.matches(key);
        let at = (entries.iter().position(|e| e.seed.is_some() && found(e)))
            .or_else(|| entries.iter().position(found));
        if let Some(e) = at.map(|i| &mut entries[i]) {
            e.used = *clock;
            return Ok(e.made.clone());
        }
        let made = make()?;
        self.made.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        entries.push(Entry {
            content: Content::of(key),
            device: device.clone(),
            made: made.clone(),
            seed: None,
            used: *clock,
        });
        forget_oldest(entries);
        Ok(made)
    }

    /// `values` as a flat integer tensor on `device`.
    pub fn ints(&self, values: &[i64], device: &Device) -> Tensor<1, Int> {
        let upload = || {
            let data = TensorData::new(values.to_vec(), [values.len()]);
            Ok(Made::Ints(Tensor::from_data(data, device)))
        };
        match self.made(HostKey::Ints(values), device, upload) {
            Ok(Made::Ints(t)) => t,
            _ => unreachable!("integer content is only ever made as integers"),
        }
    }

    /// `values` as a flat float tensor on `device`.
    pub fn floats(&self, values: &[f32], device: &Device) -> Tensor<1> {
        let upload = || {
            let data = TensorData::new(values.to_vec(), [values.len()]);
            Ok(Made::Floats(Tensor::from_data(data, device)))
        };
        match self.made(HostKey::Floats(values), device, upload) {
            Ok(Made::Floats(t)) => t,
            _ => unreachable!("float content is only ever made as floats"),
        }
    }

    /// The seed `name` of micro-step `micro` on `device` holding `values`: its device
    /// buffer written over in place (after the work queued before it) when it exists with
    /// as many values, else uploaded. A pass finds it by content before any other copy.
    pub fn seed_ints(&self, (name, micro): (&'static str, usize), values: &[i64], device: &Device) {
        let mut guard = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let (entries, clock) = &mut *guard;
        *clock += 1;
        let at = entries
            .iter()
            .position(|e| e.seed == Some((name, micro)) && &e.device == device);
        if let Some(e) = at.map(|i| &mut entries[i])
            && let (Made::Ints(t), Content::Ints(held)) = (&e.made, &mut e.content)
            && held.len() == values.len()
            && write_ints(t, values)
        {
            held.copy_from_slice(values);
            e.used = *clock;
            return;
        }
        if let Some(i) = at {
            entries.swap_remove(i);
        }
        let data = TensorData::new(values.to_vec(), [values.len()]);
        entries.push(Entry {
            content: Content::Ints(values.to_vec()),
            device: device.clone(),
            made: Made::Ints(Tensor::from_data(data, device)),
            seed: Some((name, micro)),
            used: *clock,
        });
    }

    /// Whether every seed's content differs from every other kept copy's (a pass finding
    /// a seed where it asks for another value of equal content would read the next
    /// batch's values there once replayed).
    pub fn seeds_distinct(&self) -> bool {
        let guard = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entries = &guard.0;
        entries.iter().enumerate().all(|(i, seed)| {
            seed.seed.is_none()
                || entries.iter().enumerate().all(|(j, other)| {
                    i == j || other.device != seed.device || seed.content != other.content
                })
        })
    }

    /// Every device copy kept, to hold alive while a captured update may read them.
    pub fn held(&self) -> Vec<Made> {
        let guard = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        guard.0.iter().map(|e| e.made.clone()).collect()
    }

    /// How many device copies were made so far (asked for and not found).
    pub fn made_so_far(&self) -> usize {
        self.made.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many device tensors are kept.
    pub fn len(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Write `values` over the flat integer tensor `t`'s own device buffer (CubeCL devices;
/// `false`, nothing written, elsewhere or where `t` is not a whole contiguous buffer of
/// as many values of a 32- or 64-bit integer type).
fn write_ints(t: &Tensor<1, Int>, values: &[i64]) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        use burn::backend::{BackendTensor, DType, DispatchTensorKind, TensorMetadata};
        use burn::tensor::Bytes;
        // An autodiff device's integers are its backend's, untracked.
        let mut kind = t.clone().into_dispatch().kind;
        while let DispatchTensorKind::Autodiff(inner) = kind {
            kind = *inner;
        }
        let DispatchTensorKind::Cube(BackendTensor::Int(cube)) = kind else {
            return false;
        };
        // The write starts where the handle does: the tensor's first value.
        let whole = cube.is_contiguous() && cube.shape().num_elements() == values.len();
        let bytes = match cube.dtype {
            DType::I64 => Bytes::from_elems(values.to_vec()),
            DType::I32 => Bytes::from_elems(values.iter().map(|&v| v as i32).collect::<Vec<_>>()),
            _ => return false,
        };
        if whole {
            cube.client.write(&cube.handle, bytes);
        }
        whole
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = (t, values);
        false
    }
}

/// Drop the least recently used entries past [`KEPT`] that are not seeds.
fn forget_oldest(entries: &mut Vec<Entry>) {
    while entries.iter().filter(|e| e.seed.is_none()).count() > KEPT {
        let oldest = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.seed.is_none())
            .min_by_key(|(_, e)| e.used)
            .map(|(i, _)| i)
            .expect("counted above");
        entries.swap_remove(oldest);
    }
}

#[cfg(test)]
mod tests {
    use ndarray::{ArrayD, IxDyn};

    use super::*;

    fn read_ints(t: Tensor<1, Int>) -> Vec<i64> {
        t.into_data().convert::<i64>().try_to_vec().unwrap()
    }

    #[test]
    fn equal_content_is_uploaded_once_across_passes() {
        let (uploads, device) = (DeviceUploads::default(), Device::flex());
        // The position ids of three passes: one upload.
        for _ in 0..3 {
            assert_eq!(
                read_ints(uploads.ints(&[0, 1, 2, 3], &device)),
                [0, 1, 2, 3]
            );
        }
        assert_eq!(uploads.len(), 1);
        // Other values, another length: their own copies.
        assert_eq!(
            read_ints(uploads.ints(&[0, 1, 2, 4], &device)),
            [0, 1, 2, 4]
        );
        assert_eq!(read_ints(uploads.ints(&[0, 1, 2], &device)), [0, 1, 2]);
        assert_eq!(uploads.len(), 3);
        // Floats by their bits: -0.0 is not 0.0, a NaN finds its copy.
        let read = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(read(uploads.floats(&[0.0, 1.0], &device)), [0.0, 1.0]);
        let negative = read(uploads.floats(&[-0.0, 1.0], &device));
        assert!(negative[0].is_sign_negative());
        assert!(read(uploads.floats(&[f32::NAN], &device))[0].is_nan());
        assert!(read(uploads.floats(&[f32::NAN], &device))[0].is_nan());
        assert_eq!(uploads.len(), 6);
        // The same integers as floats are not the integers' copy.
        let made = uploads.made(HostKey::Floats(&[0.0, 1.0, 2.0, 3.0]), &device, || {
            Ok(Made::Floats(Tensor::from_data([7.0f32], &device)))
        });
        assert!(matches!(made, Ok(Made::Floats(t)) if read(t.clone()) == [7.0]));
    }

    #[test]
    fn a_seed_is_found_before_a_copy_of_equal_content_and_keeps_its_place() {
        let (uploads, device) = (DeviceUploads::default(), Device::flex());
        // A copy of the content made before (as floats, to tell it from the seed).
        let other = uploads.made(HostKey::Ints(&[5, 6]), &device, || {
            Ok(Made::Floats(Tensor::from_data([7.0f32], &device)))
        });
        assert!(other.is_ok());
        uploads.seed_ints(("token ids", 0), &[5, 6], &device);
        assert_eq!(read_ints(uploads.ints(&[5, 6], &device)), [5, 6]);
        assert!(!uploads.seeds_distinct(), "the seed equals the copy");
        // Written again with the next batch: found by its new content, the old is gone.
        uploads.seed_ints(("token ids", 0), &[8, 9], &device);
        assert!(uploads.seeds_distinct());
        assert_eq!(read_ints(uploads.ints(&[8, 9], &device)), [8, 9]);
        let kept = uploads.len();
        // Seeds are never forgotten, whatever else is asked for.
        for k in 0..2 * KEPT as i64 {
            uploads.ints(&[100 + k], &device);
        }
        assert_eq!((kept, uploads.len()), (2, KEPT + 1));
        assert_eq!(read_ints(uploads.ints(&[8, 9], &device)), [8, 9]);
    }

    #[test]
    fn a_mask_is_found_by_values_and_form_and_the_oldest_copies_go_first() {
        let (uploads, device) = (DeviceUploads::default(), Device::flex());
        let mask = |v: &[bool]| ArrayD::from_shape_vec(IxDyn(&[2, 2]), v.to_vec()).unwrap();
        let made = |v: f32| Ok(Made::Floats(Tensor::from_data([v], &device)));
        let value = |m: OpResult<Made>| match m {
            Ok(Made::Floats(t)) => t.into_data().try_to_vec::<f32>().unwrap()[0],
            _ => panic!("not made"),
        };
        let causal = mask(&[true, false, true, true]);
        let key = |m, form| HostKey::Mask(m, form);
        assert_eq!(
            value(uploads.made(key(&causal, "keep"), &device, || made(1.0))),
            1.0
        );
        // The same values in another memory order: found.
        let transposed = mask(&[true, true, false, true]).reversed_axes();
        assert_eq!(
            value(uploads.made(key(&transposed, "keep"), &device, || made(2.0))),
            1.0
        );
        // Another form of it: made.
        assert_eq!(
            value(uploads.made(key(&causal, "drop"), &device, || made(3.0))),
            3.0
        );
        // Past the kept count the least recently used go: the causal mask's "keep",
        // used again now, stays; its "drop" goes.
        for k in 0..KEPT as i64 {
            uploads.ints(&[k], &device);
            if k == KEPT as i64 / 2 {
                uploads
                    .made(key(&causal, "keep"), &device, || made(9.0))
                    .ok();
            }
        }
        assert_eq!(uploads.len(), KEPT);
        assert_eq!(
            value(uploads.made(key(&causal, "keep"), &device, || made(4.0))),
            1.0
        );
        assert_eq!(
            value(uploads.made(key(&causal, "drop"), &device, || made(5.0))),
            5.0
        );
    }
}
