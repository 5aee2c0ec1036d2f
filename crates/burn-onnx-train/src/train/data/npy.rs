//! NumPy `.npy` / `.npz` files in and out of interpreter values, for the CLI and the tests.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use ndarray::{ArrayD, IxDyn};
use npyz::{DType, NpyFile, TypeChar, WriterBuilder};

use crate::error::{OnnxError, Result};
use crate::util::atomic_file::write_atomic;
use crate::value::Value;
use crate::value::host_tensor::HostTensor;

fn bad(path: &Path, m: impl std::fmt::Display) -> OnnxError {
    OnnxError::Decode {
        path: path.to_path_buf(),
        what: ".npy/.npz array",
        message: m.to_string(),
    }
}

fn widen<T: Copy, U>(v: Vec<T>, f: impl Fn(T) -> U) -> Vec<U> {
    v.into_iter().map(f).collect()
}

fn read_array<R: Read>(npy: NpyFile<R>, path: &Path) -> Result<HostTensor> {
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let DType::Plain(ty) = npy.dtype() else {
        return Err(bad(path, "structured dtypes are not supported"));
    };
    let order_c = npy.order() == npyz::Order::C;
    if !order_c {
        return Err(bad(path, "Fortran-order arrays are not supported"));
    }
    let dims = IxDyn(&shape);
    let floats = |v: Vec<f32>| ArrayD::from_shape_vec(dims.clone(), v).map(HostTensor::Float);
    let ints = |v: Vec<i64>| ArrayD::from_shape_vec(dims.clone(), v).map(HostTensor::Int);
    let e = |e: std::io::Error| bad(path, e);
    let t = match (ty.type_char(), ty.size_field()) {
        (TypeChar::Float, 2) => floats(widen(npy.into_vec::<half::f16>().map_err(e)?, f32::from)),
        (TypeChar::Float, 4) => floats(npy.into_vec::<f32>().map_err(e)?),
        (TypeChar::Float, 8) => floats(widen(npy.into_vec::<f64>().map_err(e)?, |x| x as f32)),
        (TypeChar::Int, 1) => ints(widen(npy.into_vec::<i8>().map_err(e)?, i64::from)),
        (TypeChar::Int, 2) => ints(widen(npy.into_vec::<i16>().map_err(e)?, i64::from)),
        (TypeChar::Int, 4) => ints(widen(npy.into_vec::<i32>().map_err(e)?, i64::from)),
        (TypeChar::Int, 8) => ints(npy.into_vec::<i64>().map_err(e)?),
        (TypeChar::Uint, 1) => ints(widen(npy.into_vec::<u8>().map_err(e)?, i64::from)),
        (TypeChar::Uint, 2) => ints(widen(npy.into_vec::<u16>().map_err(e)?, i64::from)),
        (TypeChar::Uint, 4) => ints(widen(npy.into_vec::<u32>().map_err(e)?, i64::from)),
        // uint64 above i64::MAX wraps, as a C cast would.
        (TypeChar::Uint, 8) => ints(widen(npy.into_vec::<u64>().map_err(e)?, |x| x as i64)),
        (TypeChar::Bool, 1) => {
            ArrayD::from_shape_vec(dims.clone(), npy.into_vec::<bool>().map_err(e)?)
                .map(HostTensor::Bool)
        }
        (c, s) => return Err(bad(path, format!("unsupported dtype {c:?}{s}"))),
    }
    .map_err(|e| bad(path, e))?;
    Ok(t)
}

/// Read one `.npy` file.
pub fn read_npy(path: impl AsRef<Path>) -> Result<HostTensor> {
    let path = path.as_ref();
    let f = File::open(path).map_err(|e| OnnxError::io(path, e))?;
    let npy = NpyFile::new(BufReader::new(f)).map_err(|e| bad(path, e))?;
    read_array(npy, path)
}

/// Read one `.npy` file as a graph value: numpy's strings (`<UN`) as a string tensor, the
/// rest as [`read_npy`] reads it, floats uploaded to `device`.
pub fn read_npy_value(path: impl AsRef<Path>, device: &burn::tensor::Device) -> Result<Value> {
    let path = path.as_ref();
    let f = File::open(path).map_err(|e| OnnxError::io(path, e))?;
    let npy = NpyFile::new(BufReader::new(f)).map_err(|e| bad(path, e))?;
    let strings = matches!(npy.dtype(), DType::Plain(t) if t.type_char() == TypeChar::UnicodeStr);
    if !strings {
        let host = read_array(npy, path)?;
        return Value::from_host(&host, device).map_err(|e| bad(path, e.0));
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let values = npy.into_vec::<String>().map_err(|e| bad(path, e))?;
    Ok(Value::Str(
        ArrayD::from_shape_vec(IxDyn(&shape), values).map_err(|e| bad(path, e))?,
    ))
}

/// Read every array of an `.npz` archive, by name.
pub fn read_npz(path: impl AsRef<Path>) -> Result<HashMap<String, HostTensor>> {
    let path = path.as_ref();
    let mut archive = npyz::npz::NpzArchive::open(path).map_err(|e| bad(path, e))?;
    let names: Vec<String> = archive.array_names().map(str::to_string).collect();
    let mut out = HashMap::new();
    for name in names {
        let npy = archive
            .by_name(&name)
            .map_err(|e| bad(path, e))?
            .ok_or_else(|| bad(path, format!("array '{name}' vanished")))?;
        out.insert(name.clone(), read_array(npy, path)?);
    }
    Ok(out)
}

/// Write a value as `.npy` (float32, int64 or bool), atomically (temporary file + rename),
/// so concurrent writers of the same file (ranks of one job) never expose a torn file.
pub fn write_npy(path: impl AsRef<Path>, value: &Value) -> Result<()> {
    let path = path.as_ref();
    let io = |e: std::io::Error| OnnxError::io(path, e);
    let mut bytes = std::io::Cursor::new(Vec::new());
    let shape: Vec<u64> = value.shape().iter().map(|&d| d as u64).collect();
    match value {
        Value::Sequence(_) => {
            return Err(bad(
                path,
                "a sequence is not one tensor: write its elements one by one",
            ));
        }
        Value::Float(v) => {
            let a = v.to_array().map_err(|e| bad(path, e.0))?;
            write_iter(&mut bytes, &shape, a.iter().copied()).map_err(io)?
        }
        Value::Int(a) => write_iter(&mut bytes, &shape, a.iter().copied()).map_err(io)?,
        Value::Bool(a) => write_iter(&mut bytes, &shape, a.iter().copied()).map_err(io)?,
        Value::Str(a) => write_strings(&mut bytes, &shape, a).map_err(io)?,
    }
    write_atomic(path, bytes.get_ref())
}

/// Write a value as `.npy` in the ONNX element type `elem_type` (a graph output's declared
/// type): the interpreter computes floats in f32 and integers in i64, and this narrows or
/// widens them as a C cast would (integers wrap). bfloat16, which `.npy` cannot hold, is
/// written as float32 holding the bfloat16-rounded values (nearest, ties to even), and so are
/// the float8, float4 and e8m0 types (their values, rounded to the type, not saturating); the 4- and
/// 2-bit integers are written as int8 (signed) or uint8 (unsigned) holding the wrapped value; an
/// unknown or absent type (0) writes the value as it is.
pub fn write_npy_as(path: impl AsRef<Path>, value: &Value, elem_type: i32) -> Result<()> {
    use crate::value::host_tensor::{dtype, low_precision};
    let path = path.as_ref();
    let io = |e: std::io::Error| OnnxError::io(path, e);
    let shape: Vec<u64> = value.shape().iter().map(|&d| d as u64).collect();
    let mut bytes = std::io::Cursor::new(Vec::new());
    let b = &mut bytes;
    match (value, elem_type) {
        (Value::Float(_), dtype::FLOAT) | (Value::Str(_), _) => return write_npy(path, value),
        (_, t) if dtype::is_float(t) => {
            let a = match value {
                Value::Sequence(_) | Value::Str(_) => {
                    return Err(bad(
                        path,
                        "a sequence is not one tensor: write its elements one by one",
                    ));
                }
                Value::Float(v) => v.to_array().map_err(|e| bad(path, e.0))?,
                Value::Int(a) => a.mapv(|x| x as f32),
                Value::Bool(a) => a.mapv(|x| if x { 1.0 } else { 0.0 }),
            };
            let it = a.iter().copied();
            match t {
                dtype::FLOAT16 => write_iter(b, &shape, it.map(half::f16::from_f32)),
                dtype::DOUBLE => write_iter(b, &shape, it.map(f64::from)),
                dtype::BFLOAT16 => {
                    write_iter(b, &shape, it.map(|x| half::bf16::from_f32(x).to_f32()))
                }
                t if low_precision::is_low_precision(t) => write_iter(
                    b,
                    &shape,
                    it.map(|x| low_precision::round_float(t, x, false, "nearest")),
                ),
                _ => write_iter(b, &shape, it),
            }
            .map_err(io)?
        }
        (_, t) if dtype::is_int(t) => {
            let a = value.clone().into_int().map_err(|e| bad(path, e.0))?;
            let it = a.iter().copied();
            match t {
                dtype::INT8 => write_iter(b, &shape, it.map(|x| x as i8)),
                dtype::INT16 => write_iter(b, &shape, it.map(|x| x as i16)),
                dtype::INT32 => write_iter(b, &shape, it.map(|x| x as i32)),
                dtype::UINT8 => write_iter(b, &shape, it.map(|x| x as u8)),
                dtype::UINT16 => write_iter(b, &shape, it.map(|x| x as u16)),
                dtype::UINT32 => write_iter(b, &shape, it.map(|x| x as u32)),
                dtype::UINT64 => write_iter(b, &shape, it.map(|x| x as u64)),
                dtype::INT4 | dtype::INT2 => write_iter(
                    b,
                    &shape,
                    it.map(|x| low_precision::convert_int(x, t) as i8),
                ),
                dtype::UINT4 | dtype::UINT2 => write_iter(
                    b,
                    &shape,
                    it.map(|x| low_precision::convert_int(x, t) as u8),
                ),
                _ => write_iter(b, &shape, it),
            }
            .map_err(io)?
        }
        (_, dtype::BOOL) => {
            let a = value.clone().into_bool().map_err(|e| bad(path, e.0))?;
            write_iter(b, &shape, a.iter().copied()).map_err(io)?
        }
        _ => return write_npy(path, value),
    }
    write_atomic(path, bytes.get_ref())
}

/// Write a 1-D array of `values` (any `.npy` element type) atomically.
pub fn write_npy_1d<T: npyz::AutoSerialize + Copy>(path: &Path, values: &[T]) -> Result<()> {
    let mut bytes = std::io::Cursor::new(Vec::new());
    write_iter(&mut bytes, &[values.len() as u64], values.iter().copied())
        .map_err(|e| OnnxError::io(path, e))?;
    write_atomic(path, bytes.get_ref())
}

/// Strings as numpy's `<UN` (UTF-32 code points, `N` the longest string's length).
fn write_strings<W: std::io::Write + Seek>(
    f: W,
    shape: &[u64],
    items: &ArrayD<String>,
) -> std::io::Result<()> {
    let width = items
        .iter()
        .map(|s| s.chars().count())
        .max()
        .unwrap_or(0)
        .max(1);
    let ty: npyz::TypeStr = format!("<U{width}")
        .parse()
        .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
    let mut w = npyz::WriteOptions::<String>::new()
        .dtype(DType::Plain(ty))
        .shape(shape)
        .writer(f)
        .begin_nd()?;
    w.extend(items.iter().cloned())?;
    w.finish()
}

fn write_iter<W: std::io::Write + Seek, T: npyz::AutoSerialize + Copy>(
    f: W,
    shape: &[u64],
    it: impl Iterator<Item = T>,
) -> std::io::Result<()> {
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(f)
        .begin_nd()?;
    w.extend(it)?;
    w.finish()
}
