//! One-input ops with their own backward under Burn's autodiff: the fused activations
//! (`kernels`) and the collectives inside the model (`collective`) are each a forward on
//! the inner backend plus a function giving the input's gradient from the output's and
//! whatever the forward kept.

use std::fmt::Debug;

use burn::backend::Backend;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;

/// The backward of a one-input op: the input's gradient is `f(kept, g)`.
struct UnaryBackward<B: Backend, S>(Box<dyn FnOnce(S, FloatTensor<B>) -> FloatTensor<B> + Send>);

impl<B: Backend, S> Debug for UnaryBackward<B, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnaryBackward")
    }
}

impl<B: Backend, S: Clone + Send + Debug + 'static> Backward<B, 1> for UnaryBackward<B, S> {
    type State = S;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = parent {
            grads.register::<B>(node.id, (self.0)(ops.state, grad));
        }
    }
}

/// `forward(x)` under autodiff: the forward keeps `keep(input, output)` and the input's
/// gradient is `backward(kept, g)`. Without a tape only `forward` runs.
pub fn unary<B: Backend, C: CheckpointStrategy, S: Clone + Send + Debug + 'static>(
    x: FloatTensor<Autodiff<B, C>>,
    forward: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
    keep: impl FnOnce(&FloatTensor<B>, &FloatTensor<B>) -> S,
    backward: impl FnOnce(S, FloatTensor<B>) -> FloatTensor<B> + Send + 'static,
) -> FloatTensor<Autodiff<B, C>> {
    match UnaryBackward::<B, S>(Box::new(backward))
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let input = x.primitive().clone();
            let out = forward(input.clone());
            let kept = keep(&input, &out);
            prep.finish(kept, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.into_primitive())),
    }
}
