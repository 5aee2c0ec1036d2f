//! One forward+backward and ten optimizer steps on `train/mlp` and `train/gpt2_tiny` on the
//! CPU, against PyTorch's loss, gradients and parameters after 10 updates, with the
//! tolerances of the kit's README.

use super::common;

use common::refkit_train::*;
use common::*;

#[test]
fn mlp_loss_and_gradients_match_pytorch() {
    check_gradients(Case::new("mlp", "mlp"), &eval_device(), 1e-5, 1e-6);
}

#[test]
fn gpt2_tiny_loss_and_gradients_match_pytorch() {
    check_gradients(
        Case::new("gpt2_tiny", "gpt2_tiny"),
        &eval_device(),
        1e-5,
        1e-6,
    );
}

#[test]
fn mlp_sgd_momentum_10_steps_match_pytorch() {
    check_trajectory(
        Case::new("mlp", "mlp"),
        &eval_device(),
        sgd(),
        0.1,
        "sgd",
        1e-5,
        1e-6,
    );
}

#[test]
fn mlp_adamw_10_steps_match_pytorch() {
    check_trajectory(
        Case::new("mlp", "mlp"),
        &eval_device(),
        adamw(),
        1e-3,
        "adamw",
        1e-5,
        1e-5,
    );
}

#[test]
fn gpt2_tiny_sgd_momentum_10_steps_match_pytorch() {
    check_trajectory(
        Case::new("gpt2_tiny", "gpt2_tiny"),
        &eval_device(),
        sgd(),
        0.1,
        "sgd",
        1e-5,
        1e-6,
    );
}

#[test]
fn gpt2_tiny_adamw_10_steps_match_pytorch() {
    check_trajectory(
        Case::new("gpt2_tiny", "gpt2_tiny"),
        &eval_device(),
        adamw(),
        1e-3,
        "adamw",
        1e-5,
        1e-5,
    );
}

// Heads padded to aligned columns (`OnnxModel::with_padded_head`): the mlp's Gemm head
// (transposed weight and a bias) 10 -> 16 columns, GPT-2's MatMul head 1024 -> 1056; the
// loss and every gradient are still PyTorch's for the unpadded model.

#[test]
fn padded_heads_give_pytorchs_loss_and_gradients() {
    check_gradients(
        Case::new("mlp", "mlp").with_padded_head(8),
        &eval_device(),
        1e-5,
        1e-6,
    );
    check_gradients(
        Case::new("gpt2_tiny", "gpt2_tiny").with_padded_head(96),
        &eval_device(),
        1e-5,
        1e-6,
    );
}

// The head's product left to the loss (`OnnxModel::with_fused_head_loss`): GPT-2's padded
// MatMul head computed with the cross-entropy a block of rows at a time gives PyTorch's
// loss and gradients, the same loss in an evaluation pass, and trains as PyTorch does.

#[test]
fn a_head_left_to_the_loss_gives_pytorchs_loss_gradients_and_eval_loss_and_trains_so() {
    let case = || {
        Case::new("gpt2_tiny", "gpt2_tiny")
            .with_padded_head(96)
            .with_fused_head_loss()
    };
    check_gradients(case(), &eval_device(), 1e-5, 1e-6);
    check_eval_loss(case(), &eval_device(), 1e-5);
    check_trajectory(case(), &eval_device(), adamw(), 1e-3, "adamw", 1e-5, 1e-5);
}

#[test]
fn a_padded_head_trains_as_pytorch_does() {
    check_trajectory(
        Case::new("gpt2_tiny", "gpt2_tiny").with_padded_head(96),
        &eval_device(),
        adamw(),
        1e-3,
        "adamw",
        1e-5,
        1e-5,
    );
}
