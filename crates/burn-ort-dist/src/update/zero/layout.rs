//! The flat layout ZeRO partitions: every float parameter of a module, in the module's
//! visiting order (the same on every rank), and how it is cut among the ranks
//! ([`Partitioning`]):
//! - contiguous (stages 1 and 2): the parameters laid end to end in one `f32` buffer,
//!   padded to a multiple of the world size and cut into one contiguous shard per rank;
//! - per tensor (stage 3): every parameter cut on its own into `world` equal chunks (the
//!   last padded), rank `r` holding chunk `r` of each, so that it can be gathered for the
//!   node that reads it without touching the others.
//!
//! Either way a rank's shard is one buffer of [`FlatLayout::shard_len`] values, and
//! [`FlatLayout::cut`] / [`FlatLayout::join`] convert between shards and whole tensors
//! (checkpoints reshard through them).

use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};

use crate::error::{DistError, DistResult};

/// One parameter in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    /// The parameter.
    pub id: ParamId,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Where it starts in the flat buffer.
    pub offset: usize,
    /// Its element count.
    pub len: usize,
    /// Does it train (requires a gradient)? Frozen and state parameters are carried along
    /// untouched.
    pub trainable: bool,
}

/// Values of each of the `world` equal chunks of a `len`-value tensor under per-tensor
/// partitioning (the last chunk zero-padded to this length).
pub fn chunk_len(len: usize, world: usize) -> usize {
    len.div_ceil(world.max(1))
}

/// Chunk `rank` of `world` equal chunks of `whole` (per-tensor partitioning), the last
/// zero-padded to [`chunk_len`] values.
pub fn chunk_of(whole: &[f32], rank: usize, world: usize) -> Vec<f32> {
    let c = chunk_len(whole.len(), world);
    let start = (rank * c).min(whole.len());
    let mut part = whole[start..(start + c).min(whole.len())].to_vec();
    part.resize(c, 0.0);
    part
}

/// How the parameters are cut among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Partitioning {
    /// One contiguous range of the concatenated parameters per rank (ZeRO-1/2).
    #[default]
    Contiguous,
    /// Chunk `r` of every parameter on rank `r` (ZeRO-3).
    PerTensor,
}

/// The flat layout of a module across `world` ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatLayout {
    /// Parameters in visiting order.
    pub slots: Vec<Slot>,
    /// Elements of all parameters.
    pub len: usize,
    /// `len` rounded up to a multiple of `world`.
    pub padded: usize,
    /// Ranks sharing the buffer.
    pub world: usize,
    /// How it is cut.
    pub partitioning: Partitioning,
}

/// The part of one parameter inside a shard.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// Index into [`FlatLayout::slots`].
    pub slot: usize,
    /// Range within the shard.
    pub local: Range<usize>,
}

struct Describe(Vec<Slot>, usize);

impl ModuleVisitor for Describe {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let shape = t.dims().to_vec();
        let len = shape.iter().product();
        self.0.push(Slot {
            id: param.id,
            shape,
            offset: self.1,
            len,
            trainable: t.is_require_grad(),
        });
        self.1 += len;
    }
}

impl FlatLayout {
    /// The contiguous layout of `module` for `world` ranks.
    pub fn of<M: Module>(module: &M, world: usize) -> Self {
        Self::partitioned(module, world, Partitioning::Contiguous)
    }

    /// The layout of `module` for `world` ranks, cut as `partitioning` says.
    pub fn partitioned<M: Module>(module: &M, world: usize, partitioning: Partitioning) -> Self {
        let mut d = Describe(Vec::new(), 0);
        module.visit(&mut d);
        Self::from_slots(d.0, world, partitioning)
    }

    /// The layout of parameters `slots` (offsets are recomputed).
    pub fn from_slots(mut slots: Vec<Slot>, world: usize, partitioning: Partitioning) -> Self {
        let world = world.max(1);
        let mut len = 0;
        for s in &mut slots {
            s.offset = len;
            len += s.len;
        }
        let shard_len = match partitioning {
            Partitioning::Contiguous => len.div_ceil(world),
            Partitioning::PerTensor => slots.iter().map(|s| chunk_len(s.len, world)).sum(),
        };
        FlatLayout {
            slots,
            len,
            padded: shard_len * world,
            world,
            partitioning,
        }
    }

    /// Elements per shard.
    pub fn shard_len(&self) -> usize {
        self.padded / self.world
    }

    /// Rank `rank`'s range of the contiguous flat buffer.
    pub fn shard(&self, rank: usize) -> Range<usize> {
        let n = self.shard_len();
        rank * n..(rank + 1) * n
    }

    /// Elements of slot `slot` each rank holds under per-tensor partitioning.
    pub fn chunk(&self, slot: usize) -> usize {
        chunk_len(self.slots[slot].len, self.world)
    }

    /// The parameters (or parts) inside rank `rank`'s shard, in order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        match self.partitioning {
            Partitioning::Contiguous => {
                let shard = self.shard(rank);
                self.slots
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| {
                        let (a, b) = (s.offset.max(shard.start), (s.offset + s.len).min(shard.end));
                        (a < b).then(|| Piece {
                            slot: i,
                            local: a - shard.start..b - shard.start,
                        })
                    })
                    .collect()
            }
            Partitioning::PerTensor => {
                let mut at = 0;
                let mut pieces = Vec::new();
                for (i, s) in self.slots.iter().enumerate() {
                    let c = self.chunk(i);
                    let valid = s.len.saturating_sub(rank * c).min(c);
                    if valid > 0 {
                        pieces.push(Piece {
                            slot: i,
                            local: at..at + valid,
                        });
                    }
                    at += c;
                }
                pieces
            }
        }
    }

    /// Rank `rank`'s shard of whole per-parameter vectors (`whole[i]` of slot `i`), padded
    /// with zeros.
    pub fn cut(&self, rank: usize, whole: &[&[f32]]) -> Vec<f32> {
        match self.partitioning {
            Partitioning::Contiguous => {
                let shard = self.shard(rank);
                let mut out = vec![0.0; shard.len()];
                for (s, w) in self.slots.iter().zip(whole) {
                    let (a, b) = (s.offset.max(shard.start), (s.offset + s.len).min(shard.end));
                    if a < b {
                        out[a - shard.start..b - shard.start]
                            .copy_from_slice(&w[a - s.offset..b - s.offset]);
                    }
                }
                out
            }
            Partitioning::PerTensor => whole
                .iter()
                .flat_map(|w| chunk_of(w, rank, self.world))
                .collect(),
        }
    }

    /// The whole per-parameter vectors from every rank's shard (`shards[r]` of rank `r`).
    pub fn join(&self, shards: &[Vec<f32>]) -> Vec<Vec<f32>> {
        match self.partitioning {
            Partitioning::Contiguous => {
                let flat: Vec<f32> = shards.concat();
                self.slots
                    .iter()
                    .map(|s| flat[s.offset..s.offset + s.len].to_vec())
                    .collect()
            }
            Partitioning::PerTensor => {
                let mut at = 0;
                let mut whole = Vec::with_capacity(self.slots.len());
                for (i, s) in self.slots.iter().enumerate() {
                    let c = self.chunk(i);
                    let mut v: Vec<f32> = shards
                        .iter()
                        .flat_map(|r| r[at..at + c].iter().copied())
                        .collect();
                    v.truncate(s.len);
                    whole.push(v);
                    at += c;
                }
                whole
            }
        }
    }

    /// The module's parameter values in rank `rank`'s shard (zeros in the padding), read
    /// tensor by tensor without forming the whole flat buffer.
    pub fn shard_params<M: Module>(&self, module: &M, rank: usize) -> DistResult<Vec<f32>> {
        let mut v = ShardOf::new(self.shard(rank));
        module.visit(&mut v);
        v.finish(rank, "a parameter")
    }

    /// Take the gradients out of `grads`, keeping rank `rank`'s shard of them (zeros where
    /// a parameter has none): the whole flat gradient is never formed.
    pub fn take_shard_grads<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
        rank: usize,
    ) -> DistResult<Vec<f32>> {
        let mut v = TakeShard {
            grads,
            shard: ShardOf::new(self.shard(rank)),
        };
        module.visit(&mut v);
        v.shard.finish(rank, "a gradient")
    }

    /// Take the gradients out of `grads` as flat tensors, one per slot (`None` where a
    /// parameter has none), without reading them.
    pub fn take_grad_tensors<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> Vec<Option<Tensor<1>>> {
        let mut v = TakeTensors {
            grads,
            out: Vec::with_capacity(self.slots.len()),
        };
        module.visit(&mut v);
        v.out
    }

    /// Take the gradients out of `grads` into one flat padded buffer (zeros where a
    /// parameter has none).
    pub fn take_grads<M: Module>(
        &self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> DistResult<Vec<f32>> {
        let mut v = TakeGrads {
            grads,
            out: Vec::with_capacity(self.padded),
            error: None,
        };
        module.visit(&mut v);
        finish(v.out, v.error, self.padded)
    }

    /// `module` with its parameters replaced by `flat` (layout order).
    pub fn scatter_params<M: Module>(&self, module: M, flat: &[f32]) -> M {
        module.map(&mut Unflatten { flat, offset: 0 })
    }
}

fn finish(mut out: Vec<f32>, error: Option<String>, padded: usize) -> DistResult<Vec<f32>> {
    if let Some(e) = error {
        return Err(DistError::Invalid {
            rank: 0,
            message: format!("cannot read a parameter or gradient: {e}"),
        });
    }
    out.resize(padded, 0.0);
    Ok(out)
}

/// A tensor's values as f32 on the host, for a collective (a counted round trip on a GPU).
pub(crate) fn host<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, String> {
    crate::collective_host_values(t)
}

struct ShardOf {
    shard: Range<usize>,
    offset: usize,
    out: Vec<f32>,
    error: Option<String>,
}

impl ShardOf {
    /// Zeros for `shard`, before the first tensor.
    fn new(shard: Range<usize>) -> Self {
        ShardOf {
            out: vec![0.0; shard.len()],
            shard,
            offset: 0,
            error: None,
        }
    }

    /// The shard read, or why `what` could not be read.
    fn finish(self, rank: usize, what: &str) -> DistResult<Vec<f32>> {
        match self.error {
            Some(e) => Err(DistError::Invalid {
                rank,
                message: format!("cannot read {what}: {e}"),
            }),
            None => Ok(self.out),
        }
    }

    /// The next tensor in layout order, of `n` values: its part inside the shard (read
    /// only when it has one; `None`: no tensor, zeros) copied out.
    fn next<const D: usize>(&mut self, n: usize, t: Option<Tensor<D>>) {
        let (start, end) = (
            self.offset.max(self.shard.start),
            (self.offset + n).min(self.shard.end),
        );
        if let Some(t) = t.filter(|_| start < end) {
            match host(t) {
                Ok(v) => self.out[start - self.shard.start..end - self.shard.start]
                    .copy_from_slice(&v[start - self.offset..end - self.offset]),
                Err(e) => self.error = Some(e),
            }
        }
        self.offset += n;
    }
}

impl ModuleVisitor for ShardOf {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        self.next(t.dims().iter().product(), Some(t));
    }
}

/// [`ShardOf`] over the gradients, each taken out of `grads` (and dropped) as it is read.
struct TakeShard<'a> {
    grads: &'a mut GradientsParams,
    shard: ShardOf,
}

impl ModuleVisitor for TakeShard<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let n = param.val().dims().iter().product();
        let g = self.grads.remove::<D>(param.id);
        self.shard.next(n, g);
    }
}

struct TakeGrads<'a> {
    grads: &'a mut GradientsParams,
    out: Vec<f32>,
    error: Option<String>,
}

impl ModuleVisitor for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let n: usize = param.val().dims().iter().product();
        match self.grads.remove::<D>(param.id).map(host) {
            Some(Ok(v)) => self.out.extend(v),
            Some(Err(e)) => self.error = Some(e),
            None => self.out.extend(std::iter::repeat_n(0.0, n)),
        }
    }
}

struct TakeTensors<'a> {
    grads: &'a mut GradientsParams,
    out: Vec<Option<Tensor<1>>>,
}

impl ModuleVisitor for TakeTensors<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let n: usize = param.val().dims().iter().product();
        self.out
            .push(self.grads.remove::<D>(param.id).map(|g| g.reshape([n])));
    }
}

struct Unflatten<'a> {
    flat: &'a [f32],
    offset: usize,
}

impl ModuleMapper for Unflatten<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (flat, offset) = (self.flat, self.offset);
        let mut len = 0;
        let param = param.map(|t| {
            let (require, device, shape) = (t.is_require_grad(), t.device(), t.dims());
            len = shape.iter().product();
            let values = flat[offset..offset + len].to_vec();
            Tensor::<D>::from_data(TensorData::new(values, shape), &device)
                .set_require_grad(require)
        });
        self.offset += len;
        param
    }
}
