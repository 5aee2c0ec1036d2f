//! The flat layout ZeRO partitions: every float parameter of a module, in the module's
//! visiting order (the same on every rank), laid end to end in one `f32` buffer, padded to
//! a multiple of the world size and cut into one contiguous shard per rank.

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
    /// The layout of `module` for `world` ranks.
    pub fn of<M: Module>(module: &M, world: usize) -> Self {
        let mut d = Describe(Vec::new(), 0);
        module.visit(&mut d);
        let len = d.1;
        FlatLayout {
            slots: d.0,
            len,
            padded: len.div_ceil(world.max(1)) * world.max(1),
            world: world.max(1),
        }
    }

    /// Elements per shard.
    pub fn shard_len(&self) -> usize {
        self.padded / self.world
    }

    /// Rank `rank`'s range of the flat buffer.
    pub fn shard(&self, rank: usize) -> Range<usize> {
        let n = self.shard_len();
        rank * n..(rank + 1) * n
    }

    /// The parameters (or parts) inside rank `rank`'s shard, in order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
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

    /// The module's parameter values in rank `rank`'s shard (zeros in the padding), read
    /// tensor by tensor without forming the whole flat buffer.
    pub fn shard_params<M: Module>(&self, module: &M, rank: usize) -> DistResult<Vec<f32>> {
        let shard = self.shard(rank);
        let mut v = ShardOf {
            shard: shard.clone(),
            offset: 0,
            out: vec![0.0; shard.len()],
            error: None,
        };
        module.visit(&mut v);
        match v.error {
            Some(e) => Err(DistError::Invalid {
                rank,
                message: format!("cannot read a parameter: {e}"),
            }),
            None => Ok(v.out),
        }
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

fn host<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, String> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

struct ShardOf {
    shard: Range<usize>,
    offset: usize,
    out: Vec<f32>,
    error: Option<String>,
}

impl ModuleVisitor for ShardOf {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let n: usize = t.dims().iter().product();
        let (start, end) = (
            self.offset.max(self.shard.start),
            (self.offset + n).min(self.shard.end),
        );
        if start < end {
            match host(t) {
                Ok(v) => self.out[start - self.shard.start..end - self.shard.start]
                    .copy_from_slice(&v[start - self.offset..end - self.offset]),
                Err(e) => self.error = Some(e),
            }
        }
        self.offset += n;
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
