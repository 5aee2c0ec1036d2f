//! A scalar whose gradients over two tensors were worked out with it: `with_gradients(v,
//! a, b, da, db, unit)` is `v` in the forward, and under autodiff gives `a` the gradient
//! `da * g * unit` and `b` the gradient `db * g * unit`, for the scalar's own gradient `g`,
//! each computed in the given gradient's precision and written in its tensor's. For a
//! loss that computes its gradients while it computes its value, a block at a time, so the
//! tensors between its inputs and its value are never kept for a backward
//! (`head_cross_entropy.rs`: the head's logits); `unit` undoes a scale it computed them at.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Shape, TensorMetadata, backend_extension};
use burn::tensor::{FloatDType, Tensor};

use super::float_dtype;
use crate::value::PhysTensor;

/// The op as a backend extension: the identity on the inner backends, its backward under
/// autodiff.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait GivenGradientsOps: Backend {
    /// `value` (a one-element tensor); under autodiff `a` and `b` get `da` and `db` times
    /// the value's gradient and `unit`.
    fn with_gradients(
        value: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        da: FloatTensor<Self>,
        db: FloatTensor<Self>,
        unit: f32,
    ) -> FloatTensor<Self>;
}

impl GivenGradientsOps for Flex {
    fn with_gradients(
        value: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: f32,
    ) -> FloatTensor<Self> {
        value
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl GivenGradientsOps for Cube {
    fn with_gradients(
        value: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        _: f32,
    ) -> FloatTensor<Self> {
        value
    }
}

/// `d * g` for a one-element `g`, computed in `d`'s precision (`g` cast to it first: one
/// element) and written in `out`.
fn scaled<B: Backend>(d: FloatTensor<B>, g: FloatTensor<B>, out: FloatDType) -> FloatTensor<B> {
    let rank = d.shape().num_dims();
    let g = B::float_reshape(g, Shape::from(vec![1; rank]));
    let g = match float_dtype(d.dtype()) {
        FloatDType::F32 => g,
        low => B::float_cast(g, low),
    };
    let product = B::float_mul(d, g);
    match float_dtype(product.dtype()) == out {
        true => product,
        false => B::float_cast(product, out),
    }
}

/// The backward: each given gradient times the value's and the unit, in its tensor's
/// precision.
#[derive(Debug)]
struct GivenGradientsBackward {
    unit: f32,
    /// The precisions of `a` and `b`.
    dtypes: [FloatDType; 2],
}

impl<B: Backend> Backward<B, 2> for GivenGradientsBackward {
    /// `da` and `db`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [a_node, b_node] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        // One element, scaled once for both.
        let g = match self.unit {
            1.0 => g,
            unit => B::float_mul_scalar(g, unit.into()),
        };
        let (da, db) = ops.state;
        if let Some(node) = a_node {
            grads.register::<B>(node.id, scaled::<B>(da, g.clone(), self.dtypes[0]));
        }
        if let Some(node) = b_node {
            grads.register::<B>(node.id, scaled::<B>(db, g, self.dtypes[1]));
        }
    }
}

impl<B: Backend + GivenGradientsOps, C: CheckpointStrategy> GivenGradientsOps for Autodiff<B, C> {
    fn with_gradients(
        value: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        da: FloatTensor<Self>,
        db: FloatTensor<Self>,
        unit: f32,
    ) -> FloatTensor<Self> {
        let value = Autodiff::<B, C>::inner(value);
        let dtypes = [float_dtype(a.dtype()), float_dtype(b.dtype())];
        match (GivenGradientsBackward { unit, dtypes })
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (Autodiff::<B, C>::inner(da), Autodiff::<B, C>::inner(db)),
                value,
            ),
            OpsKind::UnTracked(prep) => prep.finish(value),
        }
    }
}

/// `value` (`[1]`) with `da * unit` and `db * unit` (shaped as `a` and `b`) as the
/// gradients of `a` and `b` per unit of its own gradient.
pub fn with_gradients(
    value: Tensor<1>,
    (a, da): (PhysTensor, PhysTensor),
    (b, db): (PhysTensor, PhysTensor),
    unit: f32,
) -> Tensor<1> {
    assert_eq!(a.dims(), da.dims(), "a gradient shaped as its tensor");
    assert_eq!(b.dims(), db.dims(), "a gradient shaped as its tensor");
    Tensor::from_dispatch(
        <burn::backend::Dispatch as GivenGradientsOps>::with_gradients(
            value.into_dispatch(),
            a.into_dispatch(),
            b.into_dispatch(),
            da.into_dispatch(),
            db.into_dispatch(),
            unit,
        ),
    )
}
