//! Values between pipeline stages over a [`Communicator`]'s `f32` point-to-point messages.
//!
//! Each value goes as two messages: a fixed header (kind, rank, [`Tag`], dims) and its
//! payload. Words are carried bit for bit (`f32::from_bits`), so integer values (token
//! ids, masks computed from the input) cross exactly: an `i64` takes two words. A float
//! value on a device the group sends from itself (NCCL's send and receive on CUDA devices:
//! `burn_ort_dist::DeviceSends`) goes from device to device, its header saying so; other
//! values go through host memory.
//!
//! Between two ranks the messages arrive in the order they were sent, but with virtual
//! stages one channel carries activations and gradients of several stages, in an order
//! the receiver does not run in; a [`Mailbox`] keeps what arrives before it is asked for,
//! by tag.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

use burn::tensor::{Device, FloatDType, Tensor};
use burn_ort_dist::{Communicator, DeviceSends};
use ndarray::{ArrayD, IxDyn};

use crate::error::{OnnxError, Result};
use crate::value::{FloatValue, MAX_RANK, Value, padded};

const HEADER: usize = 5 + MAX_RANK;
const FLOAT: u32 = 1;
const INT: u32 = 2;
const BOOL: u32 = 3;
/// A float value whose payload goes device to device ([`DeviceSends`]).
const FLOAT_ON_DEVICE: u32 = 4;

/// What a group of values is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flow {
    /// A training forward's activations.
    Activation = 1,
    /// A backward's gradients of those activations.
    Gradient = 2,
    /// An evaluation forward's activations.
    Eval = 3,
}

/// Which group of values a message belongs to: its flow, the stage that receives it, the
/// micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag {
    /// Activations, gradients or evaluation activations.
    pub flow: Flow,
    /// The stage that receives the message.
    pub stage: usize,
    /// The micro-batch its values belong to.
    pub micro: usize,
}

impl Tag {
    fn words(self) -> [f32; 3] {
        [
            word(self.flow as u32),
            word(self.stage as u32),
            word(self.micro as u32),
        ]
    }

    fn read(bits: &[u32]) -> Result<Tag> {
        let flow = match bits[0] {
            1 => Flow::Activation,
            2 => Flow::Gradient,
            3 => Flow::Eval,
            f => {
                return Err(wire_err(
                    "receiving a header",
                    format!("unknown flow {f}: the peer is not speaking this protocol"),
                ));
            }
        };
        Ok(Tag {
            flow,
            stage: bits[1] as usize,
            micro: bits[2] as usize,
        })
    }
}

fn word(x: u32) -> f32 {
    f32::from_bits(x)
}

fn wire_err(what: &str, e: impl std::fmt::Display) -> OnnxError {
    OnnxError::field("pipeline", format!("{what}: {e}"))
}

/// A value's payload: words through host memory, or a flat f32 tensor device to device.
enum Payload<'c> {
    Host(Vec<f32>),
    Device(Tensor<1>, &'c dyn DeviceSends),
}

/// The group's device-to-device messages when they work on `device`.
fn device_sends<'c>(comm: &'c dyn Communicator, device: &Device) -> Option<&'c dyn DeviceSends> {
    comm.device_sends().filter(|s| s.works_on(device))
}

/// Send `values` to rank `dest`, in order, tagged `tag`.
pub fn send_values(
    comm: &dyn Communicator,
    dest: usize,
    tag: Tag,
    values: &[&Value],
) -> Result<()> {
    for v in values {
        let shape = v.shape();
        let (kind, payload) = match v {
            Value::Sequence(_) | Value::Str(_) => {
                return Err(wire_err(
                    "sending an activation",
                    format!("a {} value crosses no pipeline stage", v.kind()),
                ));
            }
            Value::Float(f) if let Some(sends) = device_sends(comm, &f.tensor.device()) => {
                let t = f.tensor.clone().inner().cast(FloatDType::F32);
                let n = t.dims().iter().product::<usize>();
                (FLOAT_ON_DEVICE, Payload::Device(t.reshape([n]), sends))
            }
            Value::Float(f) => (
                FLOAT,
                Payload::Host(
                    burn_ort_dist::collective_host_values(f.tensor.clone())
                        .map_err(|e| wire_err("reading an activation", e))?,
                ),
            ),
            Value::Int(a) => (
                INT,
                Payload::Host(
                    a.iter()
                        .flat_map(|&x| [word(x as u64 as u32), word((x as u64 >> 32) as u32)])
                        .collect(),
                ),
            ),
            Value::Bool(a) => (
                BOOL,
                Payload::Host(a.iter().map(|&b| word(u32::from(b))).collect()),
            ),
        };
        let mut header = vec![word(kind), word(shape.len() as u32)];
        header.extend(tag.words());
        header.extend((0..MAX_RANK).map(|i| word(shape.get(i).copied().unwrap_or(0) as u32)));
        comm.send(&header, dest)
            .map_err(|e| wire_err("sending a header", e))?;
        match payload {
            Payload::Host(words) => comm.send(&words, dest),
            Payload::Device(t, sends) => sends.send(t, dest),
        }
        .map_err(|e| wire_err("sending a value", e))?;
    }
    Ok(())
}

/// Values that arrived before their receive asked for them, by sender and tag.
#[derive(Default)]
pub struct Mailbox {
    early: RefCell<HashMap<(usize, Tag), VecDeque<Value>>>,
}

impl Mailbox {
    /// Receive `count` values tagged `tag` from rank `src` (sent with [`send_values`]; float
    /// values land on `device`): those kept from earlier receives first, then from the
    /// channel, keeping the values of other tags.
    pub fn recv(
        &self,
        comm: &dyn Communicator,
        src: usize,
        tag: Tag,
        count: usize,
        device: &Device,
    ) -> Result<Vec<Value>> {
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let kept = self
                .early
                .borrow_mut()
                .get_mut(&(src, tag))
                .and_then(VecDeque::pop_front);
            if let Some(v) = kept {
                out.push(v);
                continue;
            }
            let (got, value) = recv_one(comm, src, device)?;
            if got == tag {
                out.push(value);
            } else {
                self.early
                    .borrow_mut()
                    .entry((src, got))
                    .or_default()
                    .push_back(value);
            }
        }
        Ok(out)
    }

    /// An error naming what arrived and was never asked for, if anything did.
    pub fn check_empty(&self) -> Result<()> {
        let early = self.early.borrow();
        match early.iter().find(|(_, q)| !q.is_empty()) {
            None => Ok(()),
            Some(((src, tag), q)) => Err(wire_err(
                "end of a batch",
                format!(
                    "{} value(s) {tag:?} from rank {src} were never received",
                    q.len()
                ),
            )),
        }
    }
}

/// One value from rank `src`, and its tag.
fn recv_one(comm: &dyn Communicator, src: usize, device: &Device) -> Result<(Tag, Value)> {
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
    let tag = Tag::read(&bits[2..5])?;
    let shape: Vec<usize> = bits[5..5 + rank].iter().map(|&d| d as usize).collect();
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
        FLOAT_ON_DEVICE => {
            let sends = device_sends(comm, device).ok_or_else(|| {
                wire_err(
                    "receiving a value",
                    "the peer sends device to device, this rank's group cannot receive so",
                )
            })?;
            let flat = sends
                .recv(n, src, device)
                .map_err(|e| wire_err("receiving a value", e))?;
            let physical = padded(&shape).map_err(|e| wire_err("shaping a value", e.0))?;
            Value::Float(FloatValue::new(flat.reshape(physical), shape.len()))
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
    Ok((tag, value))
}
