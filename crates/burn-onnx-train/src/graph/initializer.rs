//! An initializer as the loaded graph holds it: decoded into host memory, or (float32
//! data of a file, stored as the machine reads it) left in the file's mapping and read in
//! place. A model bigger than memory is loaded that way: nothing is copied at load, the
//! checks at load page each tensor in and release it again, and the parameters made from
//! it read the mapping too (`model/file_tensor.rs`), so a model sharded right after loading
//! (ZeRO-3) holds one whole parameter at a time, never the whole model.

use ndarray::{ArrayD, ArrayViewD, IxDyn};
use onnx_ir::TensorProto;

use crate::error::Result;
use crate::value::host_tensor::{ExternalData, HostTensor, MappedSlice, dims_of, dtype};

/// Float tensors of fewer values are decoded at load whatever their storage (the mapping
/// only pays for big ones).
const MAPPED_MIN_VALUES: usize = 1024;

/// One initializer's value (see the module doc).
#[derive(Clone)]
pub enum Initializer {
    /// Decoded into host memory.
    Host(HostTensor),
    /// Float32 values read in place from a mapped file.
    Mapped {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// Its bytes in the mapping (`MappedSlice::floats` reads them).
        data: MappedSlice,
    },
}

impl std::fmt::Debug for Initializer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Initializer::Host(t) => t.fmt(f),
            Initializer::Mapped { shape, .. } => write!(f, "Mapped(f32 {shape:?})"),
        }
    }
}

impl From<HostTensor> for Initializer {
    fn from(t: HostTensor) -> Self {
        Initializer::Host(t)
    }
}

impl Initializer {
    /// `proto` as the loader keeps it: left in place when its data is float32 raw data of
    /// at least `MAPPED_MIN_VALUES` values inside a mapped file (the model file's
    /// `model_map`, or `external` data) that reads as f32 in place; decoded otherwise.
    pub fn load(
        proto: &TensorProto,
        model_map: Option<&std::sync::Arc<memmap2::Mmap>>,
        external: Option<&ExternalData>,
    ) -> Result<Self> {
        if let Some(mapped) = Self::in_place(proto, model_map, external)? {
            return Ok(mapped);
        }
        let t = HostTensor::from_proto(proto, external)?;
        if let Some(m) = model_map.and_then(|m| MappedSlice::within(m, &proto.raw_data)) {
            m.release();
        }
        Ok(Initializer::Host(t))
    }

    fn in_place(
        proto: &TensorProto,
        model_map: Option<&std::sync::Arc<memmap2::Mmap>>,
        external: Option<&ExternalData>,
    ) -> Result<Option<Self>> {
        if proto.data_type != dtype::FLOAT {
            return Ok(None);
        }
        let (shape, numel) = dims_of(proto)?;
        if numel < MAPPED_MIN_VALUES {
            return Ok(None);
        }
        let data = match (proto.data_location.value(), external, model_map) {
            (1, Some(ext), _) => Some(ext.bytes(proto)?),
            (0, _, Some(map)) => MappedSlice::within(map, &proto.raw_data),
            _ => None,
        };
        Ok(data
            .filter(|d| d.floats().is_some_and(|v| v.len() == numel))
            .map(|data| Initializer::Mapped { shape, data }))
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Initializer::Host(t) => t.shape(),
            Initializer::Mapped { shape, .. } => shape,
        }
    }

    /// Family name, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Initializer::Host(t) => t.kind(),
            Initializer::Mapped { .. } => "float",
        }
    }

    /// The values of a float initializer, without copying (`None` for other families).
    /// Reading a mapped one pages it in: [`Self::release`] after.
    pub fn floats(&self) -> Option<ArrayViewD<'_, f32>> {
        match self {
            Initializer::Host(HostTensor::Float(a)) => Some(a.view()),
            Initializer::Host(_) => None,
            Initializer::Mapped { shape, data } => {
                let values = data.floats().expect("checked when it was mapped");
                Some(
                    ArrayViewD::from_shape(IxDyn(shape), values)
                        .expect("shape and length checked when it was mapped"),
                )
            }
        }
    }

    /// Drop a mapped initializer's pages from the resident set (they are read again from
    /// the file where needed); nothing for a decoded one.
    pub fn release(&self) {
        if let Initializer::Mapped { data, .. } = self {
            data.release();
        }
    }

    /// The value decoded into host memory (a copy of a mapped one).
    pub fn into_host(self) -> HostTensor {
        match self {
            Initializer::Host(t) => t,
            Initializer::Mapped { .. } => {
                let a: ArrayD<f32> = self.floats().expect("a float").to_owned();
                self.release();
                HostTensor::Float(a)
            }
        }
    }
}
