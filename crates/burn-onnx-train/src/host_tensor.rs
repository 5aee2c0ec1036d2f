//! Tensors held on the host: ONNX initializers, constants and shape arithmetic.
//!
//! The interpreter keeps integer and boolean values (shapes, token ids, masks) on the host,
//! and reads every initializer into a [`HostTensor`] first. This file decodes ONNX
//! `TensorProto`s in every layout exporters use (`raw_data`, typed fields, external data)
//! and encodes trained values back.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;
use ndarray::{ArrayD, IxDyn};
use onnx_ir::TensorProto;

use crate::error::{OnnxError, Result};

/// ONNX `TensorProto.DataType` codes this crate reads.
pub mod dtype {
    /// float32
    pub const FLOAT: i32 = 1;
    /// uint8
    pub const UINT8: i32 = 2;
    /// int8
    pub const INT8: i32 = 3;
    /// uint16
    pub const UINT16: i32 = 4;
    /// int16
    pub const INT16: i32 = 5;
    /// int32
    pub const INT32: i32 = 6;
    /// int64
    pub const INT64: i32 = 7;
    /// bool
    pub const BOOL: i32 = 9;
    /// float16
    pub const FLOAT16: i32 = 10;
    /// float64
    pub const DOUBLE: i32 = 11;
    /// uint32
    pub const UINT32: i32 = 12;
    /// uint64
    pub const UINT64: i32 = 13;
    /// bfloat16
    pub const BFLOAT16: i32 = 16;

    /// Is this a floating point type (computed as f32 by the interpreter)?
    pub fn is_float(code: i32) -> bool {
        matches!(code, FLOAT | FLOAT16 | DOUBLE | BFLOAT16)
    }

    /// Is this an integer type (computed as i64 by the interpreter)?
    pub fn is_int(code: i32) -> bool {
        matches!(
            code,
            UINT8 | INT8 | UINT16 | INT16 | INT32 | INT64 | UINT32 | UINT64
        )
    }

    /// Bytes per element of a data type (0 for types this crate does not store).
    pub fn width(code: i32) -> usize {
        match code {
            UINT8 | INT8 | BOOL => 1,
            UINT16 | INT16 | FLOAT16 | BFLOAT16 => 2,
            FLOAT | INT32 | UINT32 => 4,
            INT64 | DOUBLE | UINT64 => 8,
            _ => 0,
        }
    }

    /// Human-readable name of a data type code.
    pub fn name(code: i32) -> String {
        match code {
            FLOAT => "float32".into(),
            UINT8 => "uint8".into(),
            INT8 => "int8".into(),
            UINT16 => "uint16".into(),
            INT16 => "int16".into(),
            INT32 => "int32".into(),
            INT64 => "int64".into(),
            BOOL => "bool".into(),
            FLOAT16 => "float16".into(),
            DOUBLE => "float64".into(),
            UINT32 => "uint32".into(),
            UINT64 => "uint64".into(),
            BFLOAT16 => "bfloat16".into(),
            other => format!("data type {other}"),
        }
    }
}

/// A tensor on the host, in one of the three element families the interpreter computes with.
#[derive(Debug, Clone, PartialEq)]
pub enum HostTensor {
    /// Any floating point type, widened or narrowed to f32.
    Float(ArrayD<f32>),
    /// Any integer type, widened to i64.
    Int(ArrayD<i64>),
    /// Booleans.
    Bool(ArrayD<bool>),
}

impl HostTensor {
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            HostTensor::Float(a) => a.shape(),
            HostTensor::Int(a) => a.shape(),
            HostTensor::Bool(a) => a.shape(),
        }
    }

    /// Family name, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            HostTensor::Float(_) => "float",
            HostTensor::Int(_) => "int",
            HostTensor::Bool(_) => "bool",
        }
    }

    /// Decode an ONNX `TensorProto` with inline data (`external` resolves external data;
    /// `None` makes external data an error).
    pub fn from_proto(proto: &TensorProto, external: Option<&ExternalData>) -> Result<Self> {
        let field = || format!("tensor '{}'", proto.name);
        let shape = proto
            .dims
            .iter()
            .map(|&d| {
                usize::try_from(d)
                    .map_err(|_| OnnxError::field(field(), format!("negative dimension {d}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let numel = checked_numel(&shape).ok_or_else(|| {
            OnnxError::field(
                field(),
                format!("dims {shape:?} overflow the address space"),
            )
        })?;
        let mapped = if proto.data_location.value() == 1 {
            let ext = external.ok_or_else(|| {
                OnnxError::field(
                    field(),
                    "external data, but the model was not loaded from a file",
                )
            })?;
            Some(ext.bytes(proto)?)
        } else {
            None
        };
        let raw: &[u8] = mapped.as_ref().map_or(&proto.raw_data[..], |m| m.as_ref());
        let code = proto.data_type;
        let t = if !raw.is_empty() {
            decode_raw(code, raw, numel).map_err(|m| OnnxError::field(field(), m))?
        } else {
            decode_typed(proto, numel).map_err(|m| OnnxError::field(field(), m))?
        };
        if let Some(m) = &mapped {
            m.release();
        }
        t.reshape(&shape).map_err(|m| OnnxError::field(field(), m))
    }

    fn reshape(self, shape: &[usize]) -> std::result::Result<Self, String> {
        let err = |e: ndarray::ShapeError| format!("data does not fit dims {shape:?}: {e}");
        Ok(match self {
            HostTensor::Float(a) => {
                HostTensor::Float(a.into_shape_with_order(IxDyn(shape)).map_err(err)?)
            }
            HostTensor::Int(a) => {
                HostTensor::Int(a.into_shape_with_order(IxDyn(shape)).map_err(err)?)
            }
            HostTensor::Bool(a) => {
                HostTensor::Bool(a.into_shape_with_order(IxDyn(shape)).map_err(err)?)
            }
        })
    }

    /// Write f32 values into `proto`, in the proto's own data type (f32, f16, bf16 or f64),
    /// as `raw_data`. Used by export to put trained weights back.
    pub fn write_float_into(values: &[f32], proto: &mut TensorProto) -> Result<()> {
        let field = format!("tensor '{}'", proto.name);
        let dims: Vec<usize> = proto.dims.iter().map(|&d| d.max(0) as usize).collect();
        let numel = checked_numel(&dims)
            .ok_or_else(|| OnnxError::field(&field, format!("dims {dims:?} overflow")))?;
        if numel != values.len() {
            return Err(OnnxError::field(
                field,
                format!("expected {numel} values, got {}", values.len()),
            ));
        }
        let bytes: Vec<u8> = match proto.data_type {
            dtype::FLOAT => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            dtype::FLOAT16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            dtype::BFLOAT16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            dtype::DOUBLE => values
                .iter()
                .flat_map(|v| (*v as f64).to_le_bytes())
                .collect(),
            other => {
                return Err(OnnxError::field(
                    field,
                    format!("cannot store floats as {}", dtype::name(other)),
                ));
            }
        };
        proto.float_data.clear();
        proto.double_data.clear();
        proto.int32_data.clear();
        proto.external_data.clear();
        proto.data_location = Default::default();
        proto.raw_data = bytes.into();
        Ok(())
    }
}

/// Drop the pages of `data` (a slice of `map`, already decoded) from this process's resident
/// set; the file keeps them, and a later read faults them back in. Other slices: no-op.
pub fn release_pages(map: &Mmap, data: &[u8]) {
    const PAGE: usize = 4096;
    let base = map.as_ptr() as usize;
    let start = data.as_ptr() as usize;
    if data.is_empty() || start < base || start + data.len() > base + map.len() {
        return;
    }
    let (from, to) = (
        (start - base).next_multiple_of(PAGE),
        (start - base + data.len()) / PAGE * PAGE,
    );
    if from < to {
        // SAFETY: a read-only file mapping: MADV_DONTNEED only drops clean page-cache pages
        // from our page tables; the next access reads the same file contents again.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from)
        };
    }
}

/// The product of `dims`, or `None` on overflow (a crafted file must not wrap it around).
pub fn checked_numel(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The external data files of one model: locations resolve inside the model's directory
/// only, and each file is memory-mapped once however many tensors it holds.
pub struct ExternalData {
    dir: PathBuf,
    files: RefCell<HashMap<PathBuf, Arc<Mmap>>>,
}

/// A tensor's bytes inside a mapped external file.
pub struct MappedSlice {
    map: Arc<Mmap>,
    range: std::ops::Range<usize>,
}

impl AsRef<[u8]> for MappedSlice {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }
}

impl MappedSlice {
    /// Drop these (decoded) pages from the resident set ([`release_pages`]).
    pub fn release(&self) {
        release_pages(&self.map, self.as_ref());
    }
}

impl ExternalData {
    /// External data of a model file in `dir`.
    pub fn new(dir: &Path) -> Self {
        ExternalData {
            dir: dir.to_path_buf(),
            files: RefCell::new(HashMap::new()),
        }
    }

    /// The bytes `proto`'s `external_data` entries point at.
    pub fn bytes(&self, proto: &TensorProto) -> Result<MappedSlice> {
        let field = format!("tensor '{}' external data", proto.name);
        let get = |key: &str| {
            proto
                .external_data
                .iter()
                .find(|e| e.key == key)
                .map(|e| e.value.clone())
        };
        let location =
            get("location").ok_or_else(|| OnnxError::field(&field, "no 'location' entry"))?;
        let parse = |key: &str| -> Result<Option<usize>> {
            get(key)
                .map(|v| {
                    v.parse::<usize>()
                        .map_err(|_| OnnxError::field(&field, format!("bad '{key}': {v}")))
                })
                .transpose()
        };
        let offset = parse("offset")?.unwrap_or(0);
        let length = parse("length")?;
        let relative = Path::new(&location);
        if relative.is_absolute()
            || !relative
                .components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(OnnxError::field(
                &field,
                format!("location '{location}' must be a path inside the model's directory"),
            ));
        }
        let path = self.dir.join(relative);
        let map = self.map(&path, &field)?;
        let end = match length {
            Some(l) => offset.checked_add(l),
            None => Some(map.len()),
        };
        match end {
            Some(end) if offset <= end && end <= map.len() => Ok(MappedSlice {
                map,
                range: offset..end,
            }),
            _ => Err(OnnxError::field(
                field,
                format!(
                    "offset {offset} length {length:?} outside {} ({} bytes)",
                    path.display(),
                    map.len()
                ),
            )),
        }
    }

    fn map(&self, path: &Path, field: &str) -> Result<Arc<Mmap>> {
        if let Some(m) = self.files.borrow().get(path) {
            return Ok(m.clone());
        }
        let real = path.canonicalize().map_err(|e| OnnxError::io(path, e))?;
        let dir = self
            .dir
            .canonicalize()
            .map_err(|e| OnnxError::io(&self.dir, e))?;
        if !real.starts_with(&dir) {
            return Err(OnnxError::field(
                field,
                format!(
                    "{} resolves outside the model's directory {}",
                    path.display(),
                    dir.display()
                ),
            ));
        }
        let file = File::open(&real).map_err(|e| OnnxError::io(path, e))?;
        // SAFETY: the map is read-only; a file truncated by another process while mapped
        // is outside what a model loader can defend against (as in every mmap-based loader).
        let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| OnnxError::io(path, e))?);
        let _ = map.advise(memmap2::Advice::Sequential);
        self.files
            .borrow_mut()
            .insert(path.to_path_buf(), map.clone());
        Ok(map)
    }
}

fn vec1n<T>(numel: usize, v: Vec<T>) -> std::result::Result<ArrayD<T>, String> {
    ArrayD::from_shape_vec(IxDyn(&[numel]), v).map_err(|e| e.to_string())
}

fn check_len(raw: &[u8], numel: usize, width: usize) -> std::result::Result<(), String> {
    if numel.checked_mul(width) != Some(raw.len()) {
        return Err(format!(
            "raw_data has {} bytes, expected {} ({} elements x {} bytes)",
            raw.len(),
            numel * width,
            numel,
            width
        ));
    }
    Ok(())
}

fn decode_raw(code: i32, raw: &[u8], numel: usize) -> std::result::Result<HostTensor, String> {
    macro_rules! chunks {
        ($t:ty, $n:expr, $map:expr) => {{
            check_len(raw, numel, $n)?;
            raw.chunks_exact($n)
                .map(|c| $map(<$t>::from_le_bytes(c.try_into().unwrap())))
                .collect::<Vec<_>>()
        }};
    }
    Ok(match code {
        dtype::FLOAT => HostTensor::Float(vec1n(numel, chunks!(f32, 4, |x| x))?),
        dtype::DOUBLE => HostTensor::Float(vec1n(numel, chunks!(f64, 8, |x: f64| x as f32))?),
        dtype::FLOAT16 => HostTensor::Float(vec1n(
            numel,
            chunks!(u16, 2, |x| f16::from_bits(x).to_f32()),
        )?),
        dtype::BFLOAT16 => HostTensor::Float(vec1n(
            numel,
            chunks!(u16, 2, |x| bf16::from_bits(x).to_f32()),
        )?),
        dtype::INT64 => HostTensor::Int(vec1n(numel, chunks!(i64, 8, |x| x))?),
        dtype::INT32 => HostTensor::Int(vec1n(numel, chunks!(i32, 4, |x: i32| x as i64))?),
        dtype::INT16 => HostTensor::Int(vec1n(numel, chunks!(i16, 2, |x: i16| x as i64))?),
        dtype::UINT16 => HostTensor::Int(vec1n(numel, chunks!(u16, 2, |x: u16| x as i64))?),
        dtype::UINT32 => HostTensor::Int(vec1n(numel, chunks!(u32, 4, |x: u32| x as i64))?),
        dtype::UINT64 => HostTensor::Int(vec1n(numel, chunks!(u64, 8, |x: u64| x as i64))?),
        dtype::INT8 => HostTensor::Int(vec1n(numel, chunks!(i8, 1, |x: i8| x as i64))?),
        dtype::UINT8 => HostTensor::Int(vec1n(numel, chunks!(u8, 1, |x: u8| x as i64))?),
        dtype::BOOL => HostTensor::Bool(vec1n(numel, chunks!(u8, 1, |x: u8| x != 0))?),
        other => return Err(format!("unsupported data type {}", dtype::name(other))),
    })
}

fn decode_typed(proto: &TensorProto, numel: usize) -> std::result::Result<HostTensor, String> {
    let check = |len: usize, what: &str| {
        if len == numel {
            Ok(())
        } else {
            Err(format!("{what} has {len} values, dims say {numel}"))
        }
    };
    Ok(match proto.data_type {
        dtype::FLOAT => {
            check(proto.float_data.len(), "float_data")?;
            HostTensor::Float(vec1n(numel, proto.float_data.clone())?)
        }
        dtype::DOUBLE => {
            check(proto.double_data.len(), "double_data")?;
            HostTensor::Float(vec1n(
                numel,
                proto.double_data.iter().map(|&x| x as f32).collect(),
            )?)
        }
        // float16 and bfloat16 are stored bit-wise in int32_data.
        dtype::FLOAT16 => {
            check(proto.int32_data.len(), "int32_data")?;
            HostTensor::Float(vec1n(
                numel,
                proto
                    .int32_data
                    .iter()
                    .map(|&x| f16::from_bits(x as u16).to_f32())
                    .collect(),
            )?)
        }
        dtype::BFLOAT16 => {
            check(proto.int32_data.len(), "int32_data")?;
            HostTensor::Float(vec1n(
                numel,
                proto
                    .int32_data
                    .iter()
                    .map(|&x| bf16::from_bits(x as u16).to_f32())
                    .collect(),
            )?)
        }
        dtype::INT64 => {
            check(proto.int64_data.len(), "int64_data")?;
            HostTensor::Int(vec1n(numel, proto.int64_data.clone())?)
        }
        dtype::UINT32 | dtype::UINT64 => {
            check(proto.uint64_data.len(), "uint64_data")?;
            HostTensor::Int(vec1n(
                numel,
                proto.uint64_data.iter().map(|&x| x as i64).collect(),
            )?)
        }
        dtype::INT32 | dtype::INT16 | dtype::INT8 | dtype::UINT16 | dtype::UINT8 => {
            check(proto.int32_data.len(), "int32_data")?;
            HostTensor::Int(vec1n(
                numel,
                proto.int32_data.iter().map(|&x| x as i64).collect(),
            )?)
        }
        dtype::BOOL => {
            check(proto.int32_data.len(), "int32_data")?;
            HostTensor::Bool(vec1n(
                numel,
                proto.int32_data.iter().map(|&x| x != 0).collect(),
            )?)
        }
        other => return Err(format!("unsupported data type {}", dtype::name(other))),
    })
}
