//! ZeRO-3's update in place on the host: when every chunk the module holds is an f32
//! tensor of the CPU (Flex) backend, the update writes each chunk's own buffer instead of
//! copying the shard into a flat vector and making new tensors from it. The chunks are
//! taken out of the module, lent to the update as one slice per piece, and put back: no
//! second copy of the shard exists, and chunks that live in a memory-mapped file
//! (parameters on disk) are written there.

use burn::backend::DType;
use burn::backend::flex::{Flex, FlexTensor};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;

use super::layout::Piece;

/// A module's chunks, taken out of it in visiting order, with what putting them back needs.
pub struct HostChunks {
    chunks: Vec<Taken>,
}

struct Taken {
    values: FlexTensor,
    autodiff: bool,
    require_grad: bool,
}

impl HostChunks {
    /// The chunks of `module` taken out (each parameter left empty), or the module as it
    /// was when any parameter is not an f32 tensor on the CPU.
    pub fn take<M: Module>(module: M) -> Result<(M, HostChunks), M> {
        let mut check = AllOnHost(true);
        module.visit(&mut check);
        if !check.0 {
            return Err(module);
        }
        let mut take = Take(Vec::new());
        let module = module.map(&mut take);
        Ok((module, HostChunks { chunks: take.0 }))
    }

    /// One slice per piece (`pieces[k]` of chunk `pieces[k].slot`, its first
    /// `local.len()` values: the rest is the last rank's padding).
    pub fn piece_values(&mut self, pieces: &[Piece]) -> Vec<&mut [f32]> {
        let mut lent: Vec<Option<&mut [f32]>> = self
            .chunks
            .iter_mut()
            .map(|c| Some(c.values.storage_mut::<f32>()))
            .collect();
        pieces
            .iter()
            .map(|p| {
                let whole = lent[p.slot].take().expect("one piece per chunk");
                &mut whole[..p.local.len()]
            })
            .collect()
    }

    /// `module` (as [`Self::take`] left it) with its chunks back.
    pub fn put_back<M: Module>(self, module: M) -> M {
        module.map(&mut PutBack(self.chunks.into_iter()))
    }
}

/// Whether every parameter is an f32 CPU tensor.
struct AllOnHost(bool);

impl ModuleVisitor for AllOnHost {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        self.0 &= matches!(
            t.device().inner().as_dispatch(),
            burn::backend::DispatchDevice::Flex(_)
        ) && t.dtype() == DType::F32;
    }
}

/// Takes each parameter's tensor out, contiguous and owned (a copy only when it was a view
/// or shared).
struct Take(Vec<Taken>);

impl ModuleMapper for Take {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| {
            let (device, require_grad) = (t.device(), t.is_require_grad());
            let flex = t
                .inner()
                .try_into_primitive::<Flex>()
                .expect("checked: a CPU tensor");
            let n = flex.layout().num_elements();
            let values = if flex.layout().contiguous_offsets() == Some((0, n))
                && flex.storage::<f32>().len() == n
            {
                flex
            } else {
                flex.to_contiguous()
            };
            self.0.push(Taken {
                values,
                autodiff: device.is_autodiff(),
                require_grad,
            });
            Tensor::<D>::empty([0; D], &device).set_require_grad(require_grad)
        })
    }
}

/// Puts the taken chunks back, in visiting order.
struct PutBack(std::vec::IntoIter<Taken>);

impl ModuleMapper for PutBack {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let c = self.0.next().expect("a chunk per parameter");
        param.map(|_| {
            let t = Tensor::<D>::from_primitive::<Flex>(c.values);
            let t = if c.autodiff { Tensor::from_inner(t) } else { t };
            t.set_require_grad(c.require_grad)
        })
    }
}
