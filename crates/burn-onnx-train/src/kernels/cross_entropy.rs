//! Softmax cross-entropy per row, `logsumexp(x_i) - x_i[t_i]`, as one differentiable op:
//! a forward kernel (per row: max, sum of exponentials, pick) and a backward kernel writing
//! `(softmax(x_i) - onehot(t_i)) * g_i` straight from the logits, so the `[rows, classes]`
//! probabilities never exist in forward. `#[cube]` kernels on CubeCL devices, row loops
//! on the CPU (Flex); `log_softmax` + `gather` for other dtypes, and as the reference the
//! kernels are tested against.
//!
//! Logits in a low precision (the head's product under autocast on a CubeCL device,
//! `crate::model::head_precision`) take the same kernels: they read the logits in their
//! precision, compute in f32, give the loss in f32 and write the logits' gradient in the
//! logits' precision, which is what the head's backward products read (llm.c's classifier
//! does the same in bf16), so no f32 copy of a `[rows, vocabulary]` tensor exists.
//!
//! A row may be wider than its classes ([`cross_entropy_rows_within`]): a head padded to an
//! aligned width (`model::padded_head`) writes logits for columns no class owns, which the
//! loss never reads and whose gradient is zero.

use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Int, Tensor};

use crate::kernels::runs_cubecl;

/// `-log_softmax(logits)[i, targets[i]]` for every row `i` of `logits` `[rows, classes]`;
/// `targets` `[rows]` must be in `0..classes`.
pub fn cross_entropy_rows(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let classes = logits.dims()[1];
    cross_entropy_rows_within(logits, targets, classes)
}

/// [`cross_entropy_rows`] over the first `classes` columns of each row (`targets` in
/// `0..classes`); the other columns are not read and get a zero gradient.
pub fn cross_entropy_rows_within(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    classes: usize,
) -> Tensor<1> {
    let width = logits.dims()[1];
    assert!(
        classes > 0 && classes <= width,
        "{classes} classes in rows of {width}"
    );
    if cross_entropy_fused_for(&logits) {
        return fused::cross_entropy_rows(logits, targets, classes);
    }
    match classes == width {
        true => cross_entropy_rows_reference(logits, targets),
        false => cross_entropy_rows_reference(logits.narrow(1, 0, classes), targets),
    }
}

/// Whether [`cross_entropy_rows_within`] runs the fused kernels on logits of this dtype
/// and device (f32 anywhere, f16 and bf16 on CubeCL devices), which
/// [`cross_entropy_rows_gradient`] needs.
pub fn cross_entropy_fused_for(logits: &Tensor<2>) -> bool {
    let low = matches!(logits.dtype(), DType::F16 | DType::BF16);
    logits.dtype() == DType::F32 || (low && runs_cubecl(&logits.device()))
}

/// The gradient over `logits` of the rows' loss ([`cross_entropy_rows_within`]) given its
/// gradient `grad` `[rows]`: `(softmax(x_i) - onehot(t_i)) * g_i` over the first `classes`
/// columns, zero past them, in the logits' precision; written over the logits when nothing
/// else holds them. Not differentiable itself; logits the fused kernels take only
/// ([`cross_entropy_fused_for`]).
pub fn cross_entropy_rows_gradient(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    grad: Tensor<1>,
    classes: usize,
) -> Tensor<2> {
    assert!(
        cross_entropy_fused_for(&logits),
        "no fused cross-entropy for {:?} logits on {:?}",
        logits.dtype(),
        logits.device()
    );
    fused::cross_entropy_rows_gradient(logits, targets, grad, classes)
}

/// The plain Burn composition of [`cross_entropy_rows`].
pub fn cross_entropy_rows_reference(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let n = targets.dims()[0];
    log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1]))
        .reshape([n])
        .neg()
}

mod fused {
    use burn::backend::AutodiffBackend;
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    use burn::backend::Cube;
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::flex::Flex;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn::backend::{Backend, backend_extension};
    use burn::tensor::{Int, Tensor};

    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    use crate::kernels::cube;
    use crate::kernels::host;

    /// The fused op as a backend extension: forward and backward kernels on CubeCL and on
    /// Flex, and its own backward under autodiff.
    #[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
    pub trait CrossEntropyOps: Backend {
        /// Per-row loss `[rows]` of `logits` `[rows, width]` against `targets` `[rows]`,
        /// over the first `classes` columns.
        fn cross_entropy_rows(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self>;
        /// Gradient of the per-row loss with respect to the logits, given its gradient `grad`
        /// `[rows]` (zero past the first `classes` columns).
        fn cross_entropy_rows_backward(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            grad: FloatTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self>;
    }

    impl CrossEntropyOps for Flex {
        fn cross_entropy_rows(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self> {
            host::cross_entropy_forward(logits, targets, classes)
        }

        fn cross_entropy_rows_backward(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            grad: FloatTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self> {
            host::cross_entropy_backward(logits, targets, grad, classes)
        }
    }

    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    impl CrossEntropyOps for Cube {
        fn cross_entropy_rows(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self> {
            cube::cross_entropy_forward(logits, targets, classes)
        }

        fn cross_entropy_rows_backward(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            grad: FloatTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self> {
            cube::cross_entropy_backward(logits, targets, grad, classes)
        }
    }

    /// The backward of the rows' loss over their first `classes` columns.
    #[derive(Debug)]
    struct CrossEntropyBackward {
        classes: usize,
    }

    impl<B: Backend + CrossEntropyOps> Backward<B, 1> for CrossEntropyBackward {
        type State = (FloatTensor<B>, IntTensor<B>);

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [logits_node] = ops.parents;
            let grad = grads.consume::<B>(&ops.node);
            let (logits, targets) = ops.state;
            if let Some(node) = logits_node {
                grads.register::<B>(
                    node.id,
                    B::cross_entropy_rows_backward(logits, targets, grad, self.classes),
                );
            }
        }
    }

    impl<B: Backend + CrossEntropyOps, C: CheckpointStrategy> CrossEntropyOps for Autodiff<B, C> {
        fn cross_entropy_rows(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self> {
            match (CrossEntropyBackward { classes })
                .prepare::<C>([logits.node()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let x = logits.primitive().clone();
                    let out = B::cross_entropy_rows(x.clone(), targets.clone(), classes);
                    prep.finish((x, targets), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::cross_entropy_rows(
                    logits.into_primitive(),
                    targets,
                    classes,
                )),
            }
        }

        fn cross_entropy_rows_backward(
            logits: FloatTensor<Self>,
            targets: IntTensor<Self>,
            grad: FloatTensor<Self>,
            classes: usize,
        ) -> FloatTensor<Self> {
            // Only reached through the backward above, on the inner backend; as a forward op
            // of its own it is not differentiated again (first-order autodiff).
            let out = B::cross_entropy_rows_backward(
                logits.into_primitive(),
                targets,
                grad.into_primitive(),
                classes,
            );
            Autodiff::<B, C>::from_inner(out)
        }
    }

    pub fn cross_entropy_rows(
        logits: Tensor<2>,
        targets: Tensor<1, Int>,
        classes: usize,
    ) -> Tensor<1> {
        let out = <burn::backend::Dispatch as CrossEntropyOps>::cross_entropy_rows(
            logits.into_dispatch(),
            targets.into_dispatch(),
            classes,
        );
        Tensor::from_dispatch(out)
    }

    pub fn cross_entropy_rows_gradient(
        logits: Tensor<2>,
        targets: Tensor<1, Int>,
        grad: Tensor<1>,
        classes: usize,
    ) -> Tensor<2> {
        let out = <burn::backend::Dispatch as CrossEntropyOps>::cross_entropy_rows_backward(
            logits.into_dispatch(),
            targets.into_dispatch(),
            grad.into_dispatch(),
            classes,
        );
        Tensor::from_dispatch(out)
    }
}
