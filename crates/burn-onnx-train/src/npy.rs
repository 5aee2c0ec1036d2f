//! NumPy `.npy` / `.npz` files in and out of interpreter values, for the CLI and the tests.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use ndarray::{ArrayD, IxDyn};
use npyz::{DType, NpyFile, TypeChar, WriterBuilder};

use crate::atomic_file::write_atomic;
use crate::error::{OnnxError, Result};
use crate::host_tensor::HostTensor;
use crate::value::Value;

fn bad(path: &Path, m: impl std::fmt::Display) -> OnnxError {
    OnnxError::Decode {
        path: path.to_path_buf(),
        what: ".npy/.npz array",
        message: m.to_string(),
    }
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
    let t = match (ty.type_char(), ty.size_field()) {
        (TypeChar::Float, 4) => HostTensor::Float(
            ArrayD::from_shape_vec(dims, npy.into_vec::<f32>().map_err(|e| bad(path, e))?)
                .map_err(|e| bad(path, e))?,
        ),
        (TypeChar::Float, 8) => {
            let v: Vec<f64> = npy.into_vec().map_err(|e| bad(path, e))?;
            HostTensor::Float(
                ArrayD::from_shape_vec(dims, v.into_iter().map(|x| x as f32).collect())
                    .map_err(|e| bad(path, e))?,
            )
        }
        (TypeChar::Int, 8) => HostTensor::Int(
            ArrayD::from_shape_vec(dims, npy.into_vec::<i64>().map_err(|e| bad(path, e))?)
                .map_err(|e| bad(path, e))?,
        ),
        (TypeChar::Int, 4) => {
            let v: Vec<i32> = npy.into_vec().map_err(|e| bad(path, e))?;
            HostTensor::Int(
                ArrayD::from_shape_vec(dims, v.into_iter().map(i64::from).collect())
                    .map_err(|e| bad(path, e))?,
            )
        }
        (TypeChar::Uint, 2) => {
            let v: Vec<u16> = npy.into_vec().map_err(|e| bad(path, e))?;
            HostTensor::Int(
                ArrayD::from_shape_vec(dims, v.into_iter().map(i64::from).collect())
                    .map_err(|e| bad(path, e))?,
            )
        }
        (TypeChar::Uint, 4) => {
            let v: Vec<u32> = npy.into_vec().map_err(|e| bad(path, e))?;
            HostTensor::Int(
                ArrayD::from_shape_vec(dims, v.into_iter().map(i64::from).collect())
                    .map_err(|e| bad(path, e))?,
            )
        }
        (TypeChar::Bool, 1) => {
            let v: Vec<bool> = npy.into_vec().map_err(|e| bad(path, e))?;
            HostTensor::Bool(ArrayD::from_shape_vec(dims, v).map_err(|e| bad(path, e))?)
        }
        (c, s) => return Err(bad(path, format!("unsupported dtype {c:?}{s}"))),
    };
    Ok(t)
}

/// Read one `.npy` file.
pub fn read_npy(path: impl AsRef<Path>) -> Result<HostTensor> {
    let path = path.as_ref();
    let f = File::open(path).map_err(|e| OnnxError::io(path, e))?;
    let npy = NpyFile::new(BufReader::new(f)).map_err(|e| bad(path, e))?;
    read_array(npy, path)
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
        Value::Float(v) => {
            let a = v.to_array().map_err(|e| bad(path, e.0))?;
            write_iter(&mut bytes, &shape, a.iter().copied()).map_err(io)?
        }
        Value::Int(a) => write_iter(&mut bytes, &shape, a.iter().copied()).map_err(io)?,
        Value::Bool(a) => write_iter(&mut bytes, &shape, a.iter().copied()).map_err(io)?,
    }
    write_atomic(path, bytes.get_ref())
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
