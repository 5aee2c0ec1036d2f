//! Values between pipeline stages over a [`Communicator`]'s `f32` point-to-point messages.
//!
//! Each value goes as two messages: a fixed header (kind, rank, dims) and its payload.
//! Words are carried bit for bit (`f32::from_bits`), so integer values (token ids, masks
//! computed from the input) cross exactly: an `i64` takes two words.

use burn::tensor::Device;
use burn_ort_dist::Communicator;
use ndarray::{ArrayD, IxDyn};

use crate::error::{OnnxError, Result};
use crate::value::{FloatValue, MAX_RANK, Value};

const HEADER: usize = 2 + MAX_RANK;
const FLOAT: u32 = 1;
const INT: u32 = 2;
const BOOL: u32 = 3;

fn word(x: u32) -> f32 {
    f32::from_bits(x)
}

fn wire_err(what: &str, e: impl std::fmt::Display) -> OnnxError {
    OnnxError::field("pipeline", format!("{what}: {e}"))
}

/// Send `values` to rank `dest`, in order.
pub fn send_values(comm: &dyn Communicator, dest: usize, values: &[&Value]) -> Result<()> {
    for v in values {
        let shape = v.shape();
        let (kind, payload): (u32, Vec<f32>) = match v {
            Value::Sequence(_) | Value::Str(_) => {
                return Err(wire_err(
                    "sending an activation",
                    format!("a {} value crosses no pipeline stage", v.kind()),
                ));
            }
            Value::Float(f) => (
                FLOAT,
                f.tensor
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|e| wire_err("reading an activation", format!("{e:?}")))?,
            ),
            Value::Int(a) => (
                INT,
                a.iter()
                    .flat_map(|&x| [word(x as u64 as u32), word((x as u64 >> 32) as u32)])
                    .collect(),
            ),
            Value::Bool(a) => (BOOL, a.iter().map(|&b| word(u32::from(b))).collect()),
        };
        let mut header = vec![word(kind), word(shape.len() as u32)];
        header.extend((0..MAX_RANK).map(|i| word(shape.get(i).copied().unwrap_or(0) as u32)));
        comm.send(&header, dest)
            .map_err(|e| wire_err("sending a header", e))?;
        comm.send(&payload, dest)
            .map_err(|e| wire_err("sending a value", e))?;
    }
    Ok(())
}

/// Receive `count` values sent by rank `src` with [`send_values`]; float values land on
/// `device`.
pub fn recv_values(
    comm: &dyn Communicator,
    src: usize,
    count: usize,
    device: &Device,
) -> Result<Vec<Value>> {
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let mut header = [0.0f32; HEADER];
        comm.recv(&mut header, src)
            .map_err(|e| wire_err("receiving a header", e))?;
        let bits: Vec<u32> = header.iter().map(|x| x.to_bits()).collect();
        let rank = bits[1] as usize;
        if rank > MAX_RANK {
            return Err(wire_err(
                "receiving a header",
                format!("rank {rank}: the peer is not speaking this protocol"),
            ));
        }
        let shape: Vec<usize> = bits[2..2 + rank].iter().map(|&d| d as usize).collect();
        let n: usize = shape.iter().product();
        let value = match bits[0] {
            FLOAT => {
                let mut buf = vec![0.0f32; n];
                comm.recv(&mut buf, src)
                    .map_err(|e| wire_err("receiving a value", e))?;
                let a = ArrayD::from_shape_vec(IxDyn(&shape), buf)
                    .map_err(|e| wire_err("shaping a value", e))?;
                Value::Float(
                    FloatValue::from_array(&a, device)
                        .map_err(|e| wire_err("uploading a value", e.0))?,
                )
            }
            INT => {
                let mut buf = vec![0.0f32; 2 * n];
                comm.recv(&mut buf, src)
                    .map_err(|e| wire_err("receiving a value", e))?;
                let v = buf
                    .chunks(2)
                    .map(|p| (u64::from(p[0].to_bits()) | (u64::from(p[1].to_bits()) << 32)) as i64)
                    .collect();
                Value::Int(
                    ArrayD::from_shape_vec(IxDyn(&shape), v)
                        .map_err(|e| wire_err("shaping a value", e))?,
                )
            }
            BOOL => {
                let mut buf = vec![0.0f32; n];
                comm.recv(&mut buf, src)
                    .map_err(|e| wire_err("receiving a value", e))?;
                let v = buf.iter().map(|x| x.to_bits() != 0).collect();
                Value::Bool(
                    ArrayD::from_shape_vec(IxDyn(&shape), v)
                        .map_err(|e| wire_err("shaping a value", e))?,
                )
            }
            k => {
                return Err(wire_err(
                    "receiving a header",
                    format!("unknown value kind {k}"),
                ));
            }
        };
        out.push(value);
    }
    Ok(out)
}
