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
    /// string
    pub const STRING: i32 = 8;
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
    /// float8 e4m3fn (no infinities; NaN is S.1111.111)
    pub const FLOAT8E4M3FN: i32 = 17;
    /// float8 e4m3fnuz (no infinities, no negative zero; NaN is 0x80)
    pub const FLOAT8E4M3FNUZ: i32 = 18;
    /// float8 e5m2 (IEEE-like)
    pub const FLOAT8E5M2: i32 = 19;
    /// float8 e5m2fnuz (no infinities, no negative zero; NaN is 0x80)
    pub const FLOAT8E5M2FNUZ: i32 = 20;
    /// uint4 (two per byte, low nibble first)
    pub const UINT4: i32 = 21;
    /// int4 (two per byte, low nibble first)
    pub const INT4: i32 = 22;
    /// float4 e2m1 (two per byte, low nibble first; no infinities, no NaN)
    pub const FLOAT4E2M1: i32 = 23;
    /// float8 e8m0 (a power of two 2^(e-127); 0xFF is NaN)
    pub const FLOAT8E8M0: i32 = 24;
    /// uint2 (four per byte, lowest bits first)
    pub const UINT2: i32 = 25;
    /// int2 (four per byte, lowest bits first)
    pub const INT2: i32 = 26;

    /// Is this a floating point type (computed as f32 by the interpreter)?
    pub fn is_float(code: i32) -> bool {
        matches!(
            code,
            FLOAT
                | FLOAT16
                | DOUBLE
                | BFLOAT16
                | FLOAT8E4M3FN
                | FLOAT8E4M3FNUZ
                | FLOAT8E5M2
                | FLOAT8E5M2FNUZ
                | FLOAT4E2M1
                | FLOAT8E8M0
        )
    }

    /// Is this an integer type (computed as i64 by the interpreter)?
    pub fn is_int(code: i32) -> bool {
        matches!(
            code,
            UINT8
                | INT8
                | UINT16
                | INT16
                | INT32
                | INT64
                | UINT32
                | UINT64
                | UINT4
                | INT4
                | UINT2
                | INT2
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
            STRING => "string".into(),
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
            FLOAT8E4M3FN => "float8e4m3fn".into(),
            FLOAT8E4M3FNUZ => "float8e4m3fnuz".into(),
            FLOAT8E5M2 => "float8e5m2".into(),
            FLOAT8E5M2FNUZ => "float8e5m2fnuz".into(),
            UINT4 => "uint4".into(),
            INT4 => "int4".into(),
            FLOAT4E2M1 => "float4e2m1".into(),
            FLOAT8E8M0 => "float8e8m0".into(),
            UINT2 => "uint2".into(),
            INT2 => "int2".into(),
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
        let (shape, numel) = dims_of(proto)?;
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

/// `a`'s values in row-major order, taking its buffer without a copy when it holds exactly
/// them in that order.
pub fn into_row_major_vec(a: ArrayD<f32>) -> Vec<f32> {
    let n = a.len();
    if !a.is_standard_layout() {
        return a.iter().copied().collect();
    }
    let (values, offset) = a.into_raw_vec_and_offset();
    match offset.unwrap_or(0) {
        0 if values.len() == n => values,
        o => values[o..o + n].to_vec(),
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

/// A tensor proto's dims and element count, checked (no negative dimension, no overflow).
pub fn dims_of(proto: &TensorProto) -> Result<(Vec<usize>, usize)> {
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
    Ok((shape, numel))
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

/// A tensor's bytes inside a mapped file (the model file or an external data file).
#[derive(Clone)]
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
    /// `data` as a slice of `map`, when it lies inside it.
    pub fn within(map: &Arc<Mmap>, data: &[u8]) -> Option<Self> {
        let (base, start) = (map.as_ptr() as usize, data.as_ptr() as usize);
        (start >= base && start + data.len() <= base + map.len()).then(|| MappedSlice {
            map: map.clone(),
            range: start - base..start - base + data.len(),
        })
    }

    /// The bytes read in place as little-endian f32 values, when they can be (a
    /// little-endian machine, 4-byte aligned, a whole number of values).
    pub fn floats(&self) -> Option<&[f32]> {
        let b = self.as_ref();
        let fits = cfg!(target_endian = "little")
            && b.len() % 4 == 0
            && (b.as_ptr() as usize) % std::mem::align_of::<f32>() == 0;
        // SAFETY: aligned, a whole number of f32 (any bit pattern is one), inside the
        // mapping the Arc keeps alive as long as `self`.
        fits.then(|| unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), b.len() / 4) })
    }

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
    if low_precision::is_low_precision(code) {
        return low_precision::decode_bytes(code, raw, numel);
    }
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
    if low_precision::is_low_precision(proto.data_type) {
        // One byte (of packed sub-byte values, or one float8) per int32_data entry.
        let bytes: Vec<u8> = proto.int32_data.iter().map(|&x| x as u8).collect();
        return low_precision::decode_bytes(proto.data_type, &bytes, numel);
    }
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

/// The ONNX low-precision element types (float8, float4, e8m0, 4- and 2-bit integers): their
/// storage, and rounding of f32 (and i64) values to them. The interpreter holds these floats as
/// f32 and these integers as i64; [`round_float`](low_precision::round_float) and
/// [`convert_int`](low_precision::convert_int) give the value a `Cast` to the type produces
/// (as the ONNX reference, on ml_dtypes).
pub mod low_precision {
    use super::{HostTensor, dtype, vec1n};

    /// Is `code` one of the types this module stores?
    pub fn is_low_precision(code: i32) -> bool {
        (dtype::FLOAT8E4M3FN..=dtype::INT2).contains(&code)
    }

    /// Bits per element of a low-precision type (0 for other types).
    pub fn bits(code: i32) -> usize {
        match code {
            dtype::UINT4 | dtype::INT4 | dtype::FLOAT4E2M1 => 4,
            dtype::UINT2 | dtype::INT2 => 2,
            c if is_low_precision(c) => 8,
            _ => 0,
        }
    }

    /// Decode `numel` values of type `code` from their packed bytes (sub-byte values low bits
    /// first; a final partial byte is padding).
    pub fn decode_bytes(
        code: i32,
        raw: &[u8],
        numel: usize,
    ) -> std::result::Result<HostTensor, String> {
        let b = bits(code);
        let per_byte = 8 / b;
        let need = numel.div_ceil(per_byte);
        if raw.len() != need {
            return Err(format!(
                "{} data has {} bytes, expected {need} ({numel} elements of {b} bits)",
                dtype::name(code),
                raw.len()
            ));
        }
        let mask = ((1u16 << b) - 1) as u8;
        let codes = (0..numel).map(|i| (raw[i / per_byte] >> ((i % per_byte) * b)) & mask);
        Ok(match code {
            dtype::UINT4 | dtype::UINT2 => {
                HostTensor::Int(vec1n(numel, codes.map(i64::from).collect())?)
            }
            dtype::INT4 | dtype::INT2 => {
                let shift = 8 - b;
                HostTensor::Int(vec1n(
                    numel,
                    codes
                        .map(|c| i64::from(((c << shift) as i8) >> shift))
                        .collect(),
                )?)
            }
            _ => HostTensor::Float(vec1n(
                numel,
                codes.map(|c| decode_float(code, c)).collect(),
            )?),
        })
    }

    /// (mantissa bits, exponent bias, largest finite value) of the float8 / float4 formats.
    fn format(code: i32) -> (i32, i32, f64) {
        match code {
            dtype::FLOAT8E4M3FN => (3, 7, 448.0),
            dtype::FLOAT8E4M3FNUZ => (3, 8, 240.0),
            dtype::FLOAT8E5M2 => (2, 15, 57344.0),
            dtype::FLOAT8E5M2FNUZ => (2, 16, 57344.0),
            dtype::FLOAT4E2M1 => (1, 1, 6.0),
            other => unreachable!("not a minifloat type: {other}"),
        }
    }

    /// The value of the bit pattern `c` of the float type `code` (float8, float4 or e8m0).
    pub fn decode_float(code: i32, c: u8) -> f32 {
        if code == dtype::FLOAT8E8M0 {
            return if c == 0xFF {
                f32::NAN
            } else {
                2f64.powi(i32::from(c) - 127) as f32
            };
        }
        let (mbits, bias, _) = format(code);
        let total = if code == dtype::FLOAT4E2M1 { 4 } else { 8 };
        let ebits = total - 1 - mbits;
        let sign = (c >> (total - 1)) & 1 == 1;
        let e = i32::from((c >> mbits) & ((1 << ebits) - 1) as u8);
        let m = i32::from(c & ((1 << mbits) - 1) as u8);
        match code {
            dtype::FLOAT8E4M3FN if e == 15 && m == 7 => return f32::NAN,
            dtype::FLOAT8E4M3FNUZ | dtype::FLOAT8E5M2FNUZ if c == 0x80 => return f32::NAN,
            dtype::FLOAT8E5M2 if e == 31 => {
                return match (m, sign) {
                    (0, false) => f32::INFINITY,
                    (0, true) => f32::NEG_INFINITY,
                    _ => f32::NAN,
                };
            }
            _ => {}
        }
        let v = if e == 0 {
            f64::from(m) * 2f64.powi(1 - bias - mbits)
        } else {
            f64::from((1 << mbits) + m) * 2f64.powi(e - bias - mbits)
        };
        (if sign { -v } else { v }) as f32
    }

    /// `x` rounded to the float type `code` (float8, float4 or e8m0), as `Cast` with
    /// `saturate` (and, for e8m0, `round_mode` "up", "down" or "nearest") does: nearest
    /// representable value, ties to even; with `saturate`, finite values (and infinities)
    /// beyond the largest finite value clamp to it (float4, which has no infinity or NaN,
    /// always saturates); without, they become infinity (e5m2) or NaN (the others). The fnuz
    /// types have no negative zero.
    pub fn round_float(code: i32, x: f32, saturate: bool, round_mode: &str) -> f32 {
        if code == dtype::FLOAT8E8M0 {
            return decode_float(code, e8m0_bits(x, saturate, round_mode));
        }
        let (mbits, bias, max) = format(code);
        let fnuz = matches!(code, dtype::FLOAT8E4M3FNUZ | dtype::FLOAT8E5M2FNUZ);
        if x.is_nan() {
            // ml_dtypes stores a NaN as float4 zero with the sign flipped.
            return match code {
                dtype::FLOAT4E2M1 if x.is_sign_negative() => 0.0,
                dtype::FLOAT4E2M1 => -0.0,
                _ => f32::NAN,
            };
        }
        let a = f64::from(x.abs());
        let min_exp = 1 - bias;
        let rounded = if a.is_infinite() {
            f64::INFINITY
        } else {
            let exp = if a > 0.0 {
                a.log2().floor() as i32
            } else {
                min_exp
            };
            // `log2` may be off by one at powers of two: fix the exponent exactly.
            let exp = if a > 0.0 && 2f64.powi(exp) > a {
                exp - 1
            } else if a > 0.0 && 2f64.powi(exp + 1) <= a {
                exp + 1
            } else {
                exp
            };
            let quantum = 2f64.powi(exp.max(min_exp) - mbits);
            (a / quantum).round_ties_even() * quantum
        };
        let magnitude = if rounded > max {
            if saturate || code == dtype::FLOAT4E2M1 {
                max
            } else if code == dtype::FLOAT8E5M2 {
                f64::INFINITY
            } else {
                return f32::NAN;
            }
        } else {
            rounded
        };
        let v = magnitude as f32;
        if x.is_sign_negative() && !(fnuz && v == 0.0) {
            -v
        } else {
            v
        }
    }

    /// The e8m0 bit pattern of `x`, as the ONNX reference `to_float8e8m0`: the biased f32
    /// exponent (sign ignored; zero and subnormals give 0, i.e. 2^-127), rounded by the
    /// mantissa per `round_mode`; NaN and infinity give 0xFF (NaN). With `saturate`, rounding
    /// never carries 0xFE (2^127) into 0xFF.
    pub fn e8m0_bits(x: f32, saturate: bool, round_mode: &str) -> u8 {
        let f = x.to_bits();
        let exponent = (f >> 23) & 0xFF;
        if exponent == 0xFF {
            return 0xFF;
        }
        let round_up = match round_mode {
            "nearest" => {
                let g = f & 0x40_0000 != 0;
                let r = f & 0x20_0000 != 0;
                let s = f & 0x1F_FFFF != 0;
                g && (r || s || exponent > 0)
            }
            "down" => false,
            _ => f & 0x7F_FFFF != 0,
        };
        let up = round_up && !(saturate && exponent == 0xFE);
        (exponent + u32::from(up)) as u8
    }

    /// An i64 converted to the 4- or 2-bit integer type `to` as the ONNX reference
    /// (`astype`): wrapped to the type's width, as a C cast.
    pub fn convert_int(v: i64, to: i32) -> i64 {
        let b = bits(to) as u32;
        let low = (v as u64) & ((1u64 << b) - 1);
        match to {
            dtype::INT4 | dtype::INT2 => ((low << (64 - b)) as i64) >> (64 - b),
            _ => low as i64,
        }
    }

    /// An f32 converted to the 4- or 2-bit integer type `to` as the ONNX reference
    /// (ml_dtypes `astype`): truncated toward zero, then wrapped; NaN and infinities give 0.
    pub fn convert_float_to_int(x: f32, to: i32) -> i64 {
        if !x.is_finite() {
            return 0;
        }
        convert_int(x.trunc() as i64, to)
    }
}

#[cfg(test)]
mod low_precision_tests {
    use super::low_precision::{convert_float_to_int, convert_int, decode_bytes, round_float};
    use super::{HostTensor, dtype};

    fn r(code: i32, x: f32, saturate: bool) -> f32 {
        round_float(code, x, saturate, "up")
    }

    #[test]
    fn float8e4m3fn_rounds_to_nearest_even_and_saturates() {
        let t = dtype::FLOAT8E4M3FN;
        // 1.0625 = 1 + 1/16 lies halfway between 1.0 (0 0111 000) and 1.125 (0 0111 001):
        // ties to the even mantissa 000.
        assert_eq!(r(t, 1.0625, true), 1.0);
        // 1.1875 lies halfway between 1.125 (mantissa 001) and 1.25 (010): to 010.
        assert_eq!(r(t, 1.1875, true), 1.25);
        // Largest finite: 0 1111 110 = 1.75 * 2^8 = 448; 464 is the tie with the NaN code
        // 0 1111 111 and goes to even 448; 465 overflows.
        assert_eq!(r(t, 464.0, false), 448.0);
        assert!(r(t, 465.0, false).is_nan());
        assert_eq!(r(t, 465.0, true), 448.0);
        assert_eq!(r(t, f32::NEG_INFINITY, true), -448.0);
        // Smallest subnormal: 0 0000 001 = 2^-9; 2^-10 is the tie with 0 and goes to +0 / -0.
        assert_eq!(r(t, 2f32.powi(-9), true), 2f32.powi(-9));
        assert_eq!(r(t, 2f32.powi(-10), true), 0.0);
        assert!(r(t, -(2f32.powi(-10)), true).is_sign_negative());
        // 3 * 2^-10 is the tie between 2^-9 (001) and 2^-8 (010): to 010.
        assert_eq!(r(t, 3.0 * 2f32.powi(-10), true), 2f32.powi(-8));
    }

    #[test]
    fn float8_fnuz_and_e5m2() {
        // e4m3fnuz: largest finite 0 1111 111 = 1.875 * 2^7 = 240; NaN is 1000 0000, so no
        // negative zero and no infinity: overflow without saturation is NaN.
        let t = dtype::FLOAT8E4M3FNUZ;
        assert_eq!(r(t, 250.0, true), 240.0);
        assert!(r(t, 250.0, false).is_nan());
        assert!(r(t, f32::INFINITY, false).is_nan());
        assert!(r(t, -0.0, true).is_sign_positive());
        // Smallest subnormal 0 0000 001 = 2^-10 (bias 8).
        assert_eq!(r(t, 2f32.powi(-10), true), 2f32.powi(-10));
        // e5m2: 0 11110 11 = 1.75 * 2^15 = 57344 is the largest finite; 61440 is the tie
        // with 2^16 (0 11111 00 = inf), even, so inf without saturation.
        let t = dtype::FLOAT8E5M2;
        assert_eq!(r(t, 61440.0, false), f32::INFINITY);
        assert_eq!(r(t, 61440.0, true), 57344.0);
        assert_eq!(r(t, 60000.0, false), 57344.0);
        // 1.125 is the tie between 1.0 (0 01111 00) and 1.25 (01): to 00.
        assert_eq!(r(t, 1.125, true), 1.0);
        assert_eq!(r(t, -1.375, true), -1.5);
        // e5m2fnuz: bias 16, overflow NaN, no negative zero.
        let t = dtype::FLOAT8E5M2FNUZ;
        assert!(r(t, 70000.0, false).is_nan());
        assert!(r(t, -0.0, false).is_sign_positive());
        assert_eq!(r(t, 2f32.powi(-17), true), 2f32.powi(-17)); // 0 00000 01
    }

    #[test]
    fn float4_and_e8m0() {
        // float4 e2m1 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6; always saturating.
        let t = dtype::FLOAT4E2M1;
        assert_eq!(r(t, 0.25, false), 0.0); // tie 0 (0 00 0) / 0.5 (0 00 1): even 0
        assert_eq!(r(t, 0.75, false), 1.0); // tie 0.5 (001) / 1.0 (010): even 1.0
        assert_eq!(r(t, 2.5, false), 2.0); // tie 2 (0 10 0) / 3 (0 10 1): even 2
        assert_eq!(r(t, 5.0, false), 4.0); // tie 4 (0 11 0) / 6 (0 11 1): even 4
        assert_eq!(r(t, 1e9, false), 6.0);
        assert_eq!(r(t, f32::NEG_INFINITY, false), -6.0);
        // e8m0: 2^(e-127). 5 = 1.25 * 2^2: "up" gives 8, "down" 4, "nearest" 4.
        let t = dtype::FLOAT8E8M0;
        assert_eq!(round_float(t, 5.0, true, "up"), 8.0);
        assert_eq!(round_float(t, 5.0, true, "down"), 4.0);
        assert_eq!(round_float(t, 5.0, true, "nearest"), 4.0);
        assert_eq!(round_float(t, 6.0, true, "nearest"), 8.0);
        assert_eq!(round_float(t, -4.0, true, "up"), 4.0);
        // 1.5 * 2^127 (exponent 0xFE): saturates at 2^127, else the NaN code 0xFF.
        let big = 1.5 * 2f32.powi(127);
        assert_eq!(round_float(t, big, true, "up"), 2f32.powi(127));
        assert!(round_float(t, big, false, "up").is_nan());
        assert!(round_float(t, f32::INFINITY, true, "up").is_nan());
    }

    #[test]
    fn small_ints_wrap() {
        assert_eq!(convert_int(8, dtype::INT4), -8);
        assert_eq!(convert_int(-9, dtype::INT4), 7);
        assert_eq!(convert_int(17, dtype::UINT4), 1);
        assert_eq!(convert_int(2, dtype::INT2), -2);
        assert_eq!(convert_int(-1, dtype::UINT2), 3);
        assert_eq!(convert_float_to_int(-20.0, dtype::INT4), -4);
        assert_eq!(convert_float_to_int(7.9, dtype::INT4), 7);
        assert_eq!(convert_float_to_int(f32::NAN, dtype::UINT4), 0);
    }

    #[test]
    fn decodes_packed_bytes() {
        // int4 0x9F: low nibble 1111 = -1, high 1001 = -7; 0x03: 3 (high nibble padding).
        let t = decode_bytes(dtype::INT4, &[0x9F, 0x03], 3).unwrap();
        assert_eq!(t, HostTensor::Int(ndarray::arr1(&[-1, -7, 3]).into_dyn()));
        // uint2 0b11_10_01_00 = 0xE4: 0, 1, 2, 3.
        let t = decode_bytes(dtype::UINT2, &[0xE4], 4).unwrap();
        assert_eq!(t, HostTensor::Int(ndarray::arr1(&[0, 1, 2, 3]).into_dyn()));
        let t = decode_bytes(dtype::INT2, &[0xE4], 4).unwrap();
        assert_eq!(
            t,
            HostTensor::Int(ndarray::arr1(&[0, 1, -2, -1]).into_dyn())
        );
        // float4 0x7B: low 1011 = -1.5, high 0111 = 6.
        let t = decode_bytes(dtype::FLOAT4E2M1, &[0x7B], 2).unwrap();
        assert_eq!(t, HostTensor::Float(ndarray::arr1(&[-1.5, 6.0]).into_dyn()));
        // e4m3fn 0x7E = 448, 0xC0 = 1 1000 000 = -2, 0x01 = 2^-9; e5m2 0x7C = inf;
        // e8m0 0x7F = 1.
        let t = decode_bytes(dtype::FLOAT8E4M3FN, &[0x7E, 0xC0, 0x01], 3).unwrap();
        assert_eq!(
            t,
            HostTensor::Float(ndarray::arr1(&[448.0, -2.0, 2f32.powi(-9)]).into_dyn())
        );
        let HostTensor::Float(a) = decode_bytes(dtype::FLOAT8E5M2, &[0x7C], 1).unwrap() else {
            panic!()
        };
        assert_eq!(a[[0]], f32::INFINITY);
        let HostTensor::Float(a) = decode_bytes(dtype::FLOAT8E8M0, &[0x7F], 1).unwrap() else {
            panic!()
        };
        assert_eq!(a[[0]], 1.0);
        assert!(decode_bytes(dtype::INT4, &[0x00], 3).is_err());
    }
}

#[cfg(test)]
mod row_major_tests {
    use ndarray::{ArrayD, IxDyn, s};

    use super::into_row_major_vec;

    /// `[[0, 1, 2], [3, 4, 5]]`.
    fn two_by_three() -> ArrayD<f32> {
        ArrayD::from_shape_vec(IxDyn(&[2, 3]), (0..6).map(|x| x as f32).collect()).unwrap()
    }

    #[test]
    fn row_major_values_of_plain_offset_and_transposed_arrays() {
        assert_eq!(into_row_major_vec(two_by_three()), [0., 1., 2., 3., 4., 5.]);
        // An owned array sliced in place starts past its buffer's first value.
        let mut tail = two_by_three();
        tail.slice_collapse(s![1.., ..]);
        assert_eq!(into_row_major_vec(tail), [3., 4., 5.]);
        let transposed = two_by_three().reversed_axes();
        assert_eq!(into_row_major_vec(transposed), [0., 3., 1., 4., 2., 5.]);
    }
}
