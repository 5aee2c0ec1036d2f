//! A Burn optimizer record (burn-pack bytes, what `ModuleOptimizer::into_bytes` writes) as a
//! safetensors file and back, so a checkpoint's replicated optimizer state
//! (`optimizer.safetensors`) opens in any safetensors tool: each state tensor under its
//! record key (`"<param id>.momentum.moment_1"`), and in the file's metadata
//! `format = burn-optimizer-record`, each tensor's parameter id (`param_id.<key>`), each
//! scalar such as a step count (`scalar.<key>`, typed: `u64:12`, `i64:-1`, `f64:0.5`,
//! `bool:true`) and each record path (`meta.<key>`). Files are written streaming
//! ([`write_safetensors`]), from the record's buffer or from where the moments lie.

use std::collections::BTreeMap;
use std::io::Write;

use burn::tensor::{Bytes, DType};
use safetensors::{Dtype, SafeTensors};

use crate::error::{DistResult, state_error};

/// The `format` metadata value of an optimizer record file.
pub(crate) const FORMAT: &str = "burn-optimizer-record";

fn to_safetensors_dtype(dtype: DType, name: &str) -> DistResult<Dtype> {
    Ok(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 | DType::Flex32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U64 => Dtype::U64,
        DType::U32 => Dtype::U32,
        DType::U16 => Dtype::U16,
        DType::U8 => Dtype::U8,
        other => {
            return Err(state_error(format!(
                "optimizer state '{name}' is {other:?}, which a safetensors file cannot hold"
            )));
        }
    })
}

fn to_burn_dtype(dtype: Dtype, name: &str) -> DistResult<DType> {
    Ok(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U64 => DType::U64,
        Dtype::U32 => DType::U32,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        other => {
            return Err(state_error(format!(
                "optimizer state '{name}' is {other:?}, not a type an optimizer record holds"
            )));
        }
    })
}

fn scalar_text(s: burn_pack::Scalar) -> String {
    match s {
        burn_pack::Scalar::Int(v) => format!("i64:{v}"),
        burn_pack::Scalar::UInt(v) => format!("u64:{v}"),
        burn_pack::Scalar::Float(v) => format!("f64:{v:?}"),
        burn_pack::Scalar::Bool(v) => format!("bool:{v}"),
    }
}

fn parse_scalar(key: &str, text: &str) -> DistResult<burn_pack::Scalar> {
    let bad = || {
        state_error(format!(
            "optimizer record: scalar '{key}' = '{text}' is not typed as u64:/i64:/f64:/bool:"
        ))
    };
    let (kind, value) = text.split_once(':').ok_or_else(bad)?;
    Ok(match kind {
        "i64" => burn_pack::Scalar::Int(value.parse().map_err(|_| bad())?),
        "u64" => burn_pack::Scalar::UInt(value.parse().map_err(|_| bad())?),
        "f64" => burn_pack::Scalar::Float(value.parse().map_err(|_| bad())?),
        "bool" => burn_pack::Scalar::Bool(value.parse().map_err(|_| bad())?),
        _ => return Err(bad()),
    })
}

/// One tensor of a file [`write_safetensors`] writes: its bytes, little-endian.
pub struct Entry<'a> {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// The data.
    pub data: &'a [u8],
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

/// Values converted to bytes per write by [`write_le_f32s`].
const WRITE_CHUNK: usize = 1 << 16;

/// Write `values` to `w` as little-endian f32 bytes, converted 64 Ki values at a time (a
/// tensor's data is never copied whole to be written).
pub fn write_le_f32s(w: &mut dyn Write, values: &[f32]) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(WRITE_CHUNK.min(values.len()) * 4);
    for chunk in values.chunks(WRITE_CHUNK) {
        bytes.clear();
        bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
        w.write_all(&bytes)?;
    }
    Ok(())
}

/// Little-endian f32 values (a safetensors F32 tensor's data, a raw state file), in order.
pub fn le_f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Write a safetensors file of `entries` (in this order) and `metadata` to `w`, streaming
/// the data from where it lies: the file never exists whole in memory.
pub fn write_safetensors(
    w: &mut dyn Write,
    entries: &[Entry<'_>],
    metadata: &BTreeMap<String, String>,
) -> DistResult<()> {
    let heads: Vec<Head> = entries
        .iter()
        .map(|e| Head {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            bytes: e.data.len(),
        })
        .collect();
    write_safetensors_with(w, &heads, metadata, |i, w| {
        w.write_all(entries[i].data)
            .map_err(|e| state_error(format!("cannot write the optimizer state: {e}")))
    })
}

/// A tensor's description in a safetensors header: name, type, shape, data bytes.
pub struct Head {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes of its data.
    pub bytes: usize,
}

/// Write a safetensors file of the tensors `heads` describe (in this order) and
/// `metadata` to `w`; `data(i, w)` writes tensor `i`'s bytes when its turn comes (so each
/// can be produced, written and dropped in turn).
pub fn write_safetensors_with(
    w: &mut dyn Write,
    heads: &[Head],
    metadata: &BTreeMap<String, String>,
    mut data: impl FnMut(usize, &mut dyn Write) -> DistResult<()>,
) -> DistResult<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0usize;
    for h in heads {
        let end = offset + h.bytes;
        header.insert(
            h.name.clone(),
            serde_json::json!({
                "dtype": dtype_name(h.dtype),
                "shape": h.shape,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut text = serde_json::to_vec(&header)
        .map_err(|e| state_error(format!("cannot write a safetensors header: {e}")))?;
    text.resize(text.len().next_multiple_of(8), b' ');
    let io = |e: std::io::Error| state_error(format!("cannot write a safetensors file: {e}"));
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&text).map_err(io)?;
    for i in 0..heads.len() {
        data(i, w)?;
    }
    Ok(())
}

/// Write the record `record` (burn-pack bytes) as a safetensors file to `w`; the tensors
/// are written from the record's own buffer.
pub fn write_record(record: Bytes, w: &mut dyn Write) -> DistResult<()> {
    let bad = |e: burn_pack::Error| state_error(format!("not a valid optimizer record: {e:?}"));
    let reader = burn_pack::Reader::from_bytes(record).map_err(bad)?;
    let mut metadata = BTreeMap::from([("format".to_string(), FORMAT.to_string())]);
    for (k, v) in reader.scalars() {
        metadata.insert(format!("scalar.{k}"), scalar_text(*v));
    }
    for (k, v) in reader.metadata() {
        metadata.insert(format!("meta.{k}"), v.clone());
    }
    let mut tensors = Vec::new();
    for t in reader.into_tensors().map_err(bad)? {
        let (name, dtype, shape, id, data) = t.into_parts().map_err(bad)?;
        if let Some(id) = id {
            metadata.insert(format!("param_id.{name}"), id.to_string());
        }
        tensors.push((
            name.clone(),
            to_safetensors_dtype(dtype, &name)?,
            shape.to_vec(),
            data,
        ));
    }
    let entries: Vec<Entry<'_>> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| Entry {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            data: &data[..],
        })
        .collect();
    write_safetensors(w, &entries, &metadata)
}

/// The safetensors file of the record `record` (burn-pack bytes), in memory (tests).
#[cfg(test)]
pub(crate) fn record_to_safetensors(record: Bytes) -> DistResult<Vec<u8>> {
    let mut out = Vec::new();
    write_record(record, &mut out)?;
    Ok(out)
}

/// The record (burn-pack bytes) a file of `record_to_safetensors` holds.
pub fn safetensors_to_record(file: &[u8]) -> DistResult<Bytes> {
    let (_, header) = SafeTensors::read_metadata(file)
        .map_err(|e| state_error(format!("not a safetensors file: {e}")))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    if metadata.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(state_error(format!(
            "a safetensors file without metadata format = {FORMAT}: not an optimizer record"
        )));
    }
    let file = SafeTensors::deserialize(file)
        .map_err(|e| state_error(format!("not a safetensors file: {e}")))?;
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        let id = match metadata.get(&format!("param_id.{name}")) {
            Some(id) => Some(id.parse::<u64>().map_err(|_| {
                state_error(format!(
                    "optimizer record: param_id.{name} = '{id}' is not an id"
                ))
            })?),
            None => None,
        };
        tensors.push(burn_pack::Tensor::new(
            name.clone(),
            to_burn_dtype(view.dtype(), &name)?,
            view.shape().to_vec(),
            id,
            Bytes::from_bytes_vec(view.data().to_vec()),
        ));
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, v) in &metadata {
        if let Some(key) = k.strip_prefix("scalar.") {
            writer = writer.with_scalar(key, parse_scalar(key, v)?);
        } else if let Some(key) = k.strip_prefix("meta.") {
            writer = writer.with_metadata(key, v);
        }
    }
    writer
        .into_bytes()
        .map_err(|e| state_error(format!("cannot rebuild the optimizer record: {e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record with a tensor of each kind of owner, a scalar of each type and a path
    /// survives the round trip unchanged, and the file is plain safetensors.
    #[test]
    fn a_record_round_trips_through_safetensors() {
        let values: Vec<u8> = [1.5f32, -2.0, 3.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let tensors = vec![
            burn_pack::Tensor::new(
                "7.momentum.moment_1".into(),
                DType::F32,
                vec![3],
                Some(7),
                Bytes::from_bytes_vec(values.clone()),
            ),
            burn_pack::Tensor::new(
                "free".into(),
                DType::U8,
                vec![2],
                None,
                Bytes::from_bytes_vec(vec![4, 5]),
            ),
        ];
        let record = burn_pack::Writer::new(tensors)
            .with_scalar("7.momentum.time", burn_pack::Scalar::UInt(12))
            .with_scalar("7.lr", burn_pack::Scalar::Float(0.1))
            .with_scalar("7.flag", burn_pack::Scalar::Bool(true))
            .with_scalar("7.neg", burn_pack::Scalar::Int(-3))
            .with_metadata("7.kind", "adam")
            .into_bytes()
            .unwrap();
        let file = record_to_safetensors(record).unwrap();
        let st = SafeTensors::deserialize(&file).unwrap();
        let m = st.tensor("7.momentum.moment_1").unwrap();
        assert_eq!(
            (m.dtype(), m.shape(), m.data()),
            (Dtype::F32, &[3usize][..], &values[..])
        );
        let back = burn_pack::Reader::from_bytes(safetensors_to_record(&file).unwrap()).unwrap();
        let scalars = back.scalars().clone();
        assert_eq!(scalars["7.momentum.time"], burn_pack::Scalar::UInt(12));
        assert_eq!(scalars["7.lr"], burn_pack::Scalar::Float(0.1));
        assert_eq!(scalars["7.flag"], burn_pack::Scalar::Bool(true));
        assert_eq!(scalars["7.neg"], burn_pack::Scalar::Int(-3));
        assert_eq!(back.metadata()["7.kind"], "adam");
        let mut got: Vec<_> = back
            .into_tensors()
            .unwrap()
            .into_iter()
            .map(|t| {
                let (n, d, s, id, b) = t.into_parts().unwrap();
                (n, d, s.to_vec(), id, b.to_vec())
            })
            .collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            got[0],
            (
                "7.momentum.moment_1".into(),
                DType::F32,
                vec![3],
                Some(7),
                values
            )
        );
        assert_eq!(
            got[1],
            ("free".into(), DType::U8, vec![2], None, vec![4, 5])
        );
    }

    #[test]
    fn a_safetensors_file_of_something_else_is_refused() {
        let file = safetensors::serialize(
            Vec::<(String, safetensors::tensor::TensorView)>::new(),
            None,
        )
        .unwrap();
        let e = safetensors_to_record(&file).unwrap_err().to_string();
        assert!(e.contains("not an optimizer record"), "{e}");
    }
}
