//! Gradients of single-op models checked against central finite differences: the
//! independent reference for the backward pass of ops the PyTorch trajectories do not
//! cover (LayerNormalization over two axes, grouped/dilated Conv, Gemm with transposes,
//! training-mode BatchNormalization, ConvTranspose, Instance/GroupNormalization, PRelu,
//! Einsum, SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss with class weights and
//! ignored targets, Attention with grouped-query heads, RotaryEmbedding, RMSNormalization,
//! RNN/GRU/LSTM unrolled over time, weights read inside If branches and Loop/Scan bodies,
//! GridSample/AffineGrid/Col2Im/LpPool/ReverseSequence/Det, DFT/STFT, DeformConv, the
//! activations and trigonometry of session 13, ReduceL1/Prod/LogSum, CumProd, GatherND /
//! ScatterND / ScatterElements, TopK + Compress, LRN / LpNormalization / MVN, 3-D pooling,
//! cubic antialiased Resize, wrap Pad, DepthToSpace, CausalConvWithState, LinearAttention, 3-D
//! ConvTranspose, Einsum diagonals, FlexAttention with score_mod/prob_mod, the sequence ops). Fixtures: `tools/gen_op_fixtures.py`.
//! Also the batch-norm running-statistics update against numpy, at the top level and inside
//! If/Loop bodies.

use super::common;

use std::collections::HashMap;

use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::value::host_tensor::HostTensor;
use burn_onnx_train::value::{FloatValue, MAX_RANK, padded};
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::*;

/// Fixed pseudo-random weights, so every output element matters.
fn weight(i: usize) -> f32 {
    ((i * 7919 % 113) as f32 / 113.0) - 0.5
}

fn output(
    model: &OnnxModel,
    inputs: &HashMap<String, HostTensor>,
    device: &Device,
    mode: Mode,
) -> FloatValue {
    let feeds = inputs
        .iter()
        .map(|(k, v)| (k.clone(), Value::from_host(v, device).unwrap()))
        .collect();
    let out = model.forward(feeds, mode).unwrap();
    let Some(Value::Float(y)) = out.first().cloned() else {
        panic!("float output")
    };
    y
}

/// `sum(output * weights)`, differentiable.
fn objective(
    model: &OnnxModel,
    inputs: &HashMap<String, HostTensor>,
    device: &Device,
    mode: Mode,
) -> Tensor<1> {
    let y = output(model, inputs, device, mode);
    let w: Vec<f32> = (0..y.numel()).map(weight).collect();
    let w: Tensor<MAX_RANK> = Tensor::from_data(
        TensorData::new(w, padded(&y.shape()).unwrap().to_vec()),
        device,
    );
    (y.tensor * w).sum()
}

/// The same objective summed in f64 on the host, so the finite difference carries only the
/// rounding of the outputs themselves.
fn objective_f64(
    model: &OnnxModel,
    inputs: &HashMap<String, HostTensor>,
    device: &Device,
    mode: Mode,
) -> f64 {
    let y = output(model, inputs, device, mode).to_array().unwrap();
    y.iter()
        .enumerate()
        .map(|(i, v)| f64::from(*v) * f64::from(weight(i)))
        .sum()
}

fn check(case: &str, mode: Mode) {
    let arrays = npz(data(&format!("ops/{case}.npz")));
    let inputs: HashMap<String, HostTensor> = arrays
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("in_").map(|n| (n.to_string(), v.clone())))
        .collect();
    let path = data(&format!("ops/{case}.onnx"));
    let ad = train_device();
    let model = OnnxModel::load(&path, &ad).unwrap();
    let grads = objective(&model, &inputs, &ad, mode).backward();
    let grads = model.param_grads(&grads);
    assert!(!grads.is_empty(), "{case}: no trainable parameter");

    let dev = eval_device();
    let base = OnnxModel::load(&path, &dev).unwrap();
    let eps = 1e-2f32;
    for (name, g) in grads {
        let g = g.to_array().unwrap();
        let scale = g.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let p0 = base.param_by_name(&name).unwrap().to_array().unwrap();
        let n = p0.len();
        for k in (0..n).step_by((n / 8).max(1)) {
            let shifted = |delta: f32| {
                let mut p = p0.clone();
                *p.iter_mut().nth(k).unwrap() += delta;
                let v = FloatValue::from_array(&p, &dev).unwrap();
                let m = base
                    .clone()
                    .set_params(&HashMap::from([(name.clone(), v)]))
                    .unwrap();
                objective_f64(&m, &inputs, &dev, mode)
            };
            let fd = (shifted(eps) - shifted(-eps)) / (2.0 * eps as f64);
            let ad = *g.iter().nth(k).unwrap() as f64;
            // A 1% error in any gradient element larger than a tenth of the tensor's largest
            // would exceed this bound (checked by scaling the autodiff gradient by 1.01:
            // every case fails).
            let tol = 3e-3 * ad.abs() + 1e-3 * scale + 1e-5;
            assert!(
                (fd - ad).abs() <= tol,
                "{case}: d/d {name}[{k}]: autodiff {ad}, finite difference {fd} (tolerance {tol:.2e})"
            );
        }
    }
}

#[test]
fn layer_norm_gradients() {
    check("layer_norm_last_axis_17", Mode::Eval);
    check("layer_norm_two_axes_17", Mode::Eval);
}

#[test]
fn conv_gradients() {
    check("conv1d_pads_13", Mode::Eval);
    check("conv2d_group_dilation_13", Mode::Eval);
    check("conv2d_same_upper_13", Mode::Eval);
}

#[test]
fn conv_transpose_gradients() {
    check("conv_transpose2d_13", Mode::Eval);
    check("conv_transpose1d_output_shape_13", Mode::Eval);
}

#[test]
fn instance_norm_and_prelu_gradients() {
    check("instance_norm_6", Mode::Eval);
    check("prelu_13", Mode::Eval);
}

#[test]
fn einsum_and_group_norm_gradients() {
    check("einsum_bilinear_12", Mode::Eval);
    check("group_norm_per_channel_21", Mode::Eval);
}

#[test]
fn gemm_gradients() {
    check("gemm_trans_alpha_13", Mode::Eval);
}

#[test]
fn loss_gradients() {
    check("sce_mean_weights_ignore_13", Mode::Eval);
    check("nllloss_sum_weights_12", Mode::Eval);
}

#[test]
fn attention_gradients() {
    // Grouped-query heads, causal over a non-square score matrix, a float mask.
    check("attention_gqa_causal_mask_23", Mode::Eval);
}

#[test]
fn rotary_embedding_gradients() {
    check("rotary_3d_partial_23", Mode::Eval);
    check("rotary_3d_interleaved_23", Mode::Eval);
}

#[test]
fn rms_norm_gradients() {
    check("rms_norm_two_axes_23", Mode::Eval);
}

#[test]
fn recurrent_gradients() {
    check("lstm_bidirectional_14", Mode::Eval);
    check("gru_linear_before_reset_14", Mode::Eval);
    check("rnn_reverse_seq_lens_14", Mode::Eval);
}

#[test]
fn batch_norm_training_gradients() {
    check("batch_norm_training_15", Mode::Train);
}

#[test]
fn batch_norm_train_mode_updates_running_statistics_like_pytorch() {
    let arrays = npz(data("ops/batch_norm_training_15.npz"));
    let device = eval_device();
    let model = OnnxModel::load(data("ops/batch_norm_training_15.onnx"), &device).unwrap();
    let x = Value::from_host(&arrays["in_x"], &device).unwrap();
    let out = model.forward(vec![("x".into(), x)], Mode::Train).unwrap();
    let model = model.apply_state(out.state_updates);
    for (param, key) in [("mean", "state_running_mean"), ("var", "state_running_var")] {
        let got = model.param_by_name(param).unwrap().to_array().unwrap();
        assert_close(param, &got, float(&arrays[key]), 1e-5, 1e-5);
    }
}

/// Training-mode batch norm inside an `If` branch and a 2-iteration `Loop` body, its running
/// statistics outer initializers: updated once through the branch, and in turn through the
/// iterations (the second reads the first's update), against numpy; the Loop's output is
/// the twice-normalised input.
#[test]
fn batch_norm_inside_if_and_loop_updates_running_statistics_like_pytorch() {
    for case in ["batch_norm_in_if_15", "batch_norm_in_loop_15"] {
        let arrays = npz(data(&format!("ops/{case}.npz")));
        let device = eval_device();
        let model = OnnxModel::load(data(&format!("ops/{case}.onnx")), &device).unwrap();
        let x = Value::from_host(&arrays["in_x"], &device).unwrap();
        let out = model.forward(vec![("x".into(), x)], Mode::Train).unwrap();
        let Some(Value::Float(y)) = out.first().cloned() else {
            panic!("float output")
        };
        assert_close(
            &format!("{case}: y"),
            &y.to_array().unwrap(),
            float(&arrays["train_y"]),
            1e-4,
            1e-4,
        );
        let model = model.apply_state(out.state_updates);
        for (param, key) in [("mean", "state_running_mean"), ("var", "state_running_var")] {
            let got = model.param_by_name(param).unwrap().to_array().unwrap();
            assert_close(
                &format!("{case}: {param}"),
                &got,
                float(&arrays[key]),
                1e-5,
                1e-5,
            );
        }
    }
}

/// Weights read inside subgraphs: through the taken `If` branch (MatMul), a 3-iteration
/// `Loop` body (trip count a graph constant) and a reversed `Scan` RNN cell, unrolled on
/// the tape.
/// Weights read through a sequence: SplitToSequence, SequenceAt, SequenceInsert,
/// SequenceErase and ConcatFromSequence (stacking) carry the gradients of the tensors they
/// hold.
#[test]
fn sequence_gradients() {
    check("sequence_weights_18", Mode::Eval);
}

#[test]
fn control_flow_gradients() {
    check("if_weight_branch_16", Mode::Eval);
    check("loop_weight_carried_16", Mode::Eval);
    check("scan_weight_rnn_16", Mode::Eval);
}

/// `GridSample` with respect to both `X` and the grid: bilinear with zero padding, cubic
/// with border padding (aligned corners) and with reflection, 3-D linear with reflection;
/// nearest (grid fed, so only `X` trains).
#[test]
fn grid_sample_gradients() {
    check("gridsample_bilinear_zeros_16", Mode::Eval);
    check("gridsample_cubic_border_aligned_20", Mode::Eval);
    check("gridsample_cubic_reflection_20", Mode::Eval);
    check("gridsample_volumetric_linear_reflection_20", Mode::Eval);
    check("gridsample_nearest_reflection_20", Mode::Eval);
}

/// `AffineGrid` with respect to `theta`, 2-D and 3-D.
#[test]
fn affine_grid_gradients() {
    check("affine_grid_2d_20", Mode::Eval);
    check("affine_grid_3d_aligned_20", Mode::Eval);
}

/// `Col2Im` (overlapping blocks, dilations, pads), `LpPool` (p = 2 padded 2-D, p = 3
/// SAME_UPPER 1-D), `MaxUnpool`, `CenterCropPad`, `RoiAlign` (avg and max).
#[test]
fn image_op_gradients() {
    check("col2im_dilated_padded_18", Mode::Eval);
    check("lppool_2d_p2_18", Mode::Eval);
    check("lppool_1d_p3_same_upper_18", Mode::Eval);
    check("maxunpool_2d_11", Mode::Eval);
    check("center_crop_pad_18", Mode::Eval);
    check("roi_align_avg_16", Mode::Eval);
    check("roi_align_max_16", Mode::Eval);
}

/// `ReverseSequence` and `Det` (batched 3x3, pivoting on the host, elimination on the tape).
#[test]
fn reverse_sequence_and_det_gradients() {
    check("reverse_sequence_batch_major_10", Mode::Eval);
    check("det_batch_11", Mode::Eval);
}

/// `DFT` (real one-sided zero-padded, complex inverse truncated) and `STFT` with a window:
/// matrix products with host-built cosine/sine matrices.
#[test]
fn spectral_gradients() {
    check("dft_rfft_padded_20", Mode::Eval);
    check("dft_complex_inverse_17", Mode::Eval);
    check("stft_window_17", Mode::Eval);
}

/// `DeformConv`: bilinear samples at offset taps (groups, offset groups, mask, bias;
/// strides, dilations, pads), differentiable in X, W, the offsets, the mask and B.
#[test]
fn deform_conv_gradients() {
    check("deform_conv_groups_mask_19", Mode::Eval);
    check("deform_conv_strided_dilated_19", Mode::Eval);
}

#[test]
fn session_13_elementwise_and_reduction_gradients() {
    check("activations_s13", Mode::Eval);
    check("trig_hyperbolic_s13", Mode::Eval);
    check("reductions_s13", Mode::Eval);
    check("cumprod_exclusive_reverse_s13", Mode::Eval);
    check("local_norms_s13", Mode::Eval);
}

#[test]
fn session_13_indexing_and_layout_gradients() {
    check("gather_scatter_nd_s13", Mode::Eval);
    check("topk_compress_s13", Mode::Eval);
    check("pool3d_avg_dilated_s13", Mode::Eval);
    check("pool3d_max_s13", Mode::Eval);
    check("resize_cubic_antialias_s13", Mode::Eval);
    check("pad_wrap_s13", Mode::Eval);
    check("depth_to_space_crd_s13", Mode::Eval);
}

/// `CausalConvWithState` (SiLU, bias, past state) and `LinearAttention` (gated delta rule,
/// grouped query heads, past state): differentiable in every float input.
#[test]
fn causal_conv_and_linear_attention_gradients() {
    check("causal_conv_with_state_silu_27", Mode::Eval);
    check("linear_attention_gated_delta_gqa_27", Mode::Eval);
}

#[test]
fn conv_transpose_3d_and_einsum_diagonal_gradients() {
    check("conv_transpose3d_grad_ct", Mode::Eval);
    check("conv_transpose_output_shape_extra_ct", Mode::Eval);
    check("einsum_batch_diagonal_ct", Mode::Eval);
    check("einsum_diagonal_matmul_ct", Mode::Eval);
}

/// `FlexAttention` with grouped-query heads, a soft-capping `score_mod` that adds an
/// outer-scope weight (captured by the subgraph) and a scaling `prob_mod`: differentiable in
/// Q, K, V and the captured weight.
#[test]
fn flex_attention_gradients() {
    check("flex_attention_mods_gqa_fa", Mode::Eval);
}
