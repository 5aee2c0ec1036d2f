//! The whole path on a GPU backend (`common::gpu`: wgpu by default, where on GPU-less
//! machines Mesa's software Vulkan driver, lavapipe, runs the same CubeCL kernels a GPU
//! would; `ONNX_TRAIN_TEST_GPU=cuda` with a CUDA build, `tools/gpu/check.sh`): the kit's
//! forward passes against onnxruntime, forward+backward and 10 AdamW steps against
//! PyTorch, and the runner end to end (evaluation, checkpoints, export, and the fused
//! multi-tensor AdamW it uses there) against the same run on the CPU, with checkpoints
//! resuming across the two; f16 with dynamic loss scaling (and bf16 where the GPU computes
//! in it: CUDA) against the same precision on the CPU; the fused CubeCL kernels (softmax
//! cross-entropy, unscale with the inf/NaN flag, multi-tensor Adam/AdamW/LAMB) against
//! their plain references; tensor parallelism with sequence parallelism, and ZeRO-3 with
//! its parameter chunks in host memory, on 2 thread ranks against one CPU process; ZeRO's
//! update on the device (burn-ort-dist's `zero_on_device` checks, run here on the GPU); with CUDA, NCCL through the real library. Without the GPU's driver these tests fail; they never pass silently.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

// Its own test binary, apart from `tests/integration`: `tools/gpu/pack.sh` ships it alone
// to a GPU machine, within the device tool's size limit.
#[path = "integration/common/mod.rs"]
mod common;

use std::path::Path;

use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_onnx_train::collective::CollectiveGroup;
use burn_onnx_train::kernels::{
    self, NonFiniteFlag, matmul_autocast, runs_cubecl, unscale_and_check,
    unscale_and_check_reference,
};
use burn_onnx_train::model::ChunkStore;
use burn_onnx_train::train::config::{
    LrConfig, OffloadTarget, OptimizerKind, ParamOffload, ScheduleKind, TrainingConfig,
};
use burn_onnx_train::train::layout::parallel_plan::ParallelPlan;
use burn_onnx_train::train::precision::Precision;
use burn_onnx_train::train::process::launch::launch;
use burn_onnx_train::train::{DeviceSpec, RunSummary};
use burn_onnx_train::value::{MAX_RANK, PhysTensor, padded};
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::activation_checks::{
    activation_problem, check_add_bias_residual, check_gelu_tanh, check_gelu_tanh_biased,
    check_gelu_tanh_biased_f16, check_layer_norm, check_layer_norm_f16_out, check_softmax,
    check_tanh,
};
use common::fused_checks::{
    Groups, check, check_clipped_with_a_replaced_value, check_cross_entropy,
    check_f16_cross_entropy, check_head_cross_entropy, check_scaled_update_skips_on_overflow,
    check_update_writes_in_place, host, host2,
};
use common::refkit_train::*;
use common::*;

/// `f32_tol` on a GPU that computes f32 matmuls in f32 (wgpu), `tf32_tol` on CUDA, where
/// CubeCL's tensor-core matmul runs f32 products on TF32 (10-bit operand mantissas, f32
/// accumulation: PyTorch's `allow_tf32`), as `matmuls_of_every_layout_match_the_cpu_on_gpu`
/// measures. References computed in f32 are then met to TF32's precision.
fn on_tf32(f32_tol: f32, tf32_tol: f32) -> f32 {
    if matches!(gpu_spec(), DeviceSpec::Cuda(_)) {
        tf32_tol
    } else {
        f32_tol
    }
}

/// Adam moves a parameter whose gradient is rounding noise by up to lr per update,
/// whatever the noise: under TF32 the bound of 10 updates at lr 1e-3.
const ADAM_NOISE_BOUND: f32 = 1e-2;

#[test]
fn forward_passes_match_onnxruntime_on_gpu() {
    let (device, tol) = (gpu(), on_tf32(1e-4, 1e-3));
    check_inference_within(&device, "mlp", "input.npy", "output_ort_legacy.npy", tol);
    check_inference_within(
        &device,
        "lenet_bn",
        "input.npy",
        "output_ort_legacy.npy",
        tol,
    );
    check_inference_within(
        &device,
        "squeezenet1_1_dynbatch",
        "input_other_shape.npy",
        "output_torch_other_shape.npy",
        tol,
    );
    check_inference_within(
        &device,
        "gpt2_tiny",
        "input.npy",
        "output_ort_legacy.npy",
        tol,
    );
}

#[test]
fn mlp_gradients_match_pytorch_on_gpu() {
    let tol = on_tf32(1e-4, 1e-3);
    check_gradients(Case::new("mlp", "mlp"), &gpu(), tol, tol);
}

#[test]
fn gpt2_tiny_gradients_match_pytorch_on_gpu() {
    let tol = on_tf32(1e-4, 1e-3);
    check_gradients(Case::new("gpt2_tiny", "gpt2_tiny"), &gpu(), tol, tol);
}

#[test]
fn padded_heads_on_gpu_give_pytorchs_loss_and_gradients() {
    // The pad kernel (a Gemm's transposed weight and bias, GPT-2's MatMul weight), the
    // loss kernels reading the first columns of wider rows, the gradient's slice a view.
    let tol = on_tf32(1e-4, 1e-3);
    check_gradients(
        Case::new("mlp", "mlp").with_padded_head(8),
        &gpu(),
        tol,
        tol,
    );
    let gpt2 = Case::new("gpt2_tiny", "gpt2_tiny").with_padded_head(96);
    check_gradients(gpt2, &gpu(), tol, tol);
}

#[test]
fn a_head_left_to_the_loss_on_gpu_gives_pytorchs_loss_gradients_and_eval_loss() {
    // The head's product and the cross-entropy a block of rows at a time, the padded
    // columns never read, both gradients given to the autodiff by the loss.
    let tol = on_tf32(1e-4, 1e-3);
    let gpt2 = || {
        Case::new("gpt2_tiny", "gpt2_tiny")
            .with_padded_head(96)
            .with_fused_head_loss()
    };
    check_gradients(gpt2(), &gpu(), tol, tol);
    check_eval_loss(gpt2(), &gpu(), tol);
}

/// Each f32 gradient of `loss` against PyTorch's `want` (by name): its largest error as a
/// fraction of the reference gradient's largest value.
fn gradient_errors(
    model: &OnnxModel,
    loss: Tensor<1>,
    want: &std::collections::HashMap<String, burn_onnx_train::value::host_tensor::HostTensor>,
) -> Vec<(String, f32)> {
    let grads = loss.backward();
    model
        .param_grads(&grads)
        .into_iter()
        .map(|(name, g)| {
            assert_eq!(g.tensor.dtype(), DType::F32, "{name}'s gradient");
            let (g, w) = (g.to_array().unwrap(), float(&want[&name]).clone());
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            (name, max_abs_diff(&g, &w) / scale)
        })
        .collect()
}

/// gpt2_tiny's kit loss and gradients under f16 autocast on the GPU, its head writing the
/// logits in `logits_in` (marked by [`OnnxModel::with_low_precision_logits`] for f16): the
/// loss's error against PyTorch's f32 loss, and each gradient's largest error against
/// PyTorch's as a fraction of that gradient's largest value.
fn f16_head_errors(logits_in: DType) -> (f32, Vec<(String, f32)>) {
    use burn_onnx_train::model::loss::{Logits, lm_cross_entropy};
    let model = Case::new("gpt2_tiny", "gpt2_tiny").load(&gpu().autodiff());
    let model = match logits_in {
        DType::F32 => model,
        _ => {
            let (model, marked) = model.with_low_precision_logits("logits");
            assert!(marked, "gpt2_tiny's head is a MatMul only the loss reads");
            model
        }
    };
    let ids = int(&npz(refkit("train/gpt2_tiny/batch.npz"))["input_ids"]).clone();
    let inputs = vec![("input_ids".into(), Value::Int(ids.clone()))];
    let out = model
        .forward_with(inputs, Mode::Train, 0, Some(FloatDType::F16))
        .unwrap();
    let Some(Value::Float(value)) = out.get("logits").cloned() else {
        panic!("no logits")
    };
    assert_eq!(value.tensor.dtype(), logits_in, "the logits' precision");
    let logits = Logits {
        value: value.into(),
        sharded: None,
        classes: None,
        uploads: out.uploads.clone(),
    };
    let loss = lm_cross_entropy(logits, &ids).unwrap();
    assert_eq!(loss.dtype(), DType::F32, "the loss's precision");
    let got = loss.clone().into_scalar::<f32>();
    let want = losses("gpt2_tiny")["loss0"].as_f64().unwrap() as f32;
    let want_grads = npz(refkit("train/gpt2_tiny/grads.npz"));
    let errors = gradient_errors(&model, loss, &want_grads);
    ((got - want).abs(), errors)
}

#[test]
fn f16_logits_from_the_head_give_pytorchs_loss_and_gradients_to_f16s_precision() {
    // The head writes its logits in f16, the loss reads them so and writes their gradient
    // so, which the head's backward products read with no cast: PyTorch's f32 loss and
    // gradients are met as closely as with the head's f32 logits (f16 operands already
    // bound both to ~1e-3).
    // Measured on lavapipe: loss errors 1.0e-5 and 1.3e-5, gradients' worst 1.0e-3 of
    // their scale both ways.
    for logits_in in [DType::F32, DType::F16] {
        let (loss_error, grad_errors) = f16_head_errors(logits_in);
        assert!(
            loss_error < 1e-4,
            "{logits_in:?} logits: loss off by {loss_error}"
        );
        for (name, error) in grad_errors {
            assert!(
                error < 2e-3,
                "{logits_in:?} logits: {name}'s gradient off by {error} of its scale"
            );
        }
    }
}

/// Dynamo's GPT-2 (each MLP a MatMul, an `Add` of its bias and a tanh `Gelu`, fused on
/// load into a biased `Gelu`; layer norms read by products; attention cores whose heads a
/// transpose and a reshape merge for a product) under f16 autocast on the GPU, with `low`
/// its MLP products, attention cores and norms marked by
/// [`OnnxModel::with_low_precision_mlp`], [`OnnxModel::with_low_precision_attention`] and
/// [`OnnxModel::with_low_precision_norms`]: the loss, and the loss's and each
/// gradient's largest error against PyTorch's f32 ones as a fraction of that gradient's
/// largest value.
fn f16_activation_errors(low: bool) -> (f32, f32, Vec<(String, f32)>) {
    let path = |f: &str| data(&format!("dynamo_gpt2/{f}"));
    let model = OnnxModel::load(path("gpt2_tied.onnx"), &gpu().autodiff()).unwrap();
    let model = if low {
        let (model, mlp) = model.with_low_precision_mlp();
        let (model, attention) = model.with_low_precision_attention();
        let (model, norms) = model.with_low_precision_norms();
        assert_eq!(
            (mlp, attention, norms),
            (2, 2, 5),
            "an MLP product and an attention core a layer; ln_1, ln_2, ln_f"
        );
        model
    } else {
        model
    };
    let ids = int(&npz(path("batch.npz"))["input_ids"]).clone();
    let inputs = vec![("input_ids".into(), Value::Int(ids.clone()))];
    let out = model
        .forward_with(inputs, Mode::Train, 0, Some(FloatDType::F16))
        .unwrap();
    let output = model.graph().outputs[0].name.clone();
    let Some(Value::Float(value)) = out.get(&output).cloned() else {
        panic!("no logits")
    };
    let logits = burn_onnx_train::model::loss::Logits {
        value: value.into(),
        sharded: None,
        classes: None,
        uploads: out.uploads.clone(),
    };
    let loss = burn_onnx_train::model::loss::lm_cross_entropy(logits, &ids).unwrap();
    let got = loss.clone().into_scalar::<f32>();
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path("losses.json")).unwrap()).unwrap();
    let want = refs["adamw_losses"][0].as_f64().unwrap() as f32;
    let want_grads = npz(path("grads.npz"));
    let errors = gradient_errors(&model, loss, &want_grads);
    (got, (got - want).abs(), errors)
}

#[test]
fn f16_activations_only_products_read_give_pytorchs_loss_and_gradients_to_f16s_precision() {
    // The MLP's product writes its hidden activation in f16, the GELU reads it so and
    // writes f16 for the next product, the norms write f16 for their products, every
    // gradient comes back in its value's precision: PyTorch's f32 loss and gradients are
    // met as closely as with the f32 activations, and the loss moves by f16's rounding
    // (the path is taken).
    // Measured on lavapipe: loss 5.5622215 -> 5.5622234 (the norms' outputs were cast to
    // f16 by their products before: the forward is the MLP's change alone), off by 4.3e-6;
    // gradients' worst 1.7e-3 of their scale (the layer norms' weights, their incoming
    // gradient now rounded to f16 as PyTorch's autocast rounds it; 9.8e-4 with the MLP
    // alone).
    let (loss_f32, ..) = f16_activation_errors(false);
    let (loss_f16, loss_error, grad_errors) = f16_activation_errors(true);
    assert_ne!(
        loss_f16, loss_f32,
        "the f16 hidden activation changed nothing"
    );
    assert!(loss_error < 1e-4, "loss off by {loss_error}");
    for (name, error) in grad_errors {
        assert!(
            error < 4e-3,
            "{name}'s gradient off by {error} of its scale"
        );
    }
}

/// The nodes the plan marks [`LOW_PRECISION_RESULT`] in `model` (gpt2_tiny's run
/// otherwise) on `device`: each one's op type and the op types reading its output.
fn plan_marks(model: Option<&Path>, device: &Device) -> Vec<(String, Vec<String>)> {
    use burn_onnx_train::graph::attributes::LOW_PRECISION_RESULT;
    let graph = planned_graph("precision-plan", device, |c| {
        if let Some(path) = model {
            c.model.model_path = path.to_path_buf();
        }
    });
    let readers = |v: &str| {
        graph
            .nodes
            .iter()
            .filter(|n| n.inputs.iter().any(|i| i == v))
            .map(|n| n.op_type.clone())
            .collect::<Vec<_>>()
    };
    graph
        .nodes
        .iter()
        .filter(|n| n.attrs.get(LOW_PRECISION_RESULT).is_some())
        .map(|n| (n.op_type.clone(), readers(&n.outputs[0])))
        .collect()
}

#[test]
fn the_plan_marks_a_matmul_head_and_values_only_products_read_only_on_gpu() {
    let mark = |op: &str, readers: &[&str]| {
        let readers = readers.iter().map(|r| r.to_string()).collect::<Vec<_>>();
        (op.to_string(), readers)
    };
    let (head, mlp, norm, attention) = (
        mark("MatMul", &[]),
        mark("MatMul", &["Gelu"]),
        mark("LayerNormalization", &["MatMul"]),
        mark("Softmax", &["Transpose"]),
    );
    assert_eq!(plan_marks(None, &gpu().autodiff()), [head.clone()]);
    assert_eq!(
        plan_marks(None, &Device::flex().autodiff()),
        [],
        "the CPU keeps f32 logits"
    );
    // Dynamo's GPT-2: each layer's MLP product (its bias and GELU fused on load), attention
    // core (merged by a transpose and a reshape for its product) and layer norms (each read
    // by a product) too; gpt2_tiny's feed Gemms (left).
    let dynamo = data("dynamo_gpt2/gpt2_tied.onnx");
    let layer = [norm.clone(), attention, norm.clone(), mlp];
    assert_eq!(
        plan_marks(Some(&dynamo), &gpu().autodiff()),
        [&layer[..], &layer[..], &[norm, head]].concat()
    );
    assert_eq!(plan_marks(Some(&dynamo), &Device::flex().autodiff()), []);
    // The mlp's head is a Gemm (its bias added in f32 after the product): not marked.
    let mlp = OnnxModel::load(refkit("models/mlp.onnx"), &gpu().autodiff()).unwrap();
    let output = mlp.graph().outputs[0].name.clone();
    assert!(!mlp.with_low_precision_logits(&output).1);
}

/// The graph of the model the plan makes of GPT-2's test config (in the test directory
/// `tag`), changed by `change`, on `device`.
fn planned_graph(
    tag: &str,
    device: &Device,
    change: impl Fn(&mut TrainingConfig),
) -> burn_onnx_train::graph::Graph {
    let mut c = gpt2_config(&tempdir(tag));
    change(&mut c);
    let model = OnnxModel::load(&c.model.model_path, device).unwrap();
    let mut plan = ParallelPlan::new(&c, &burn_ort_dist::LocalCommunicator).unwrap();
    let parts = plan
        .parallelize(&c, model, &*gpt2_tokens(), device)
        .unwrap();
    parts.model.graph().clone()
}

/// The nodes of GPT-2's planned model marked to leave their product to the loss, with the
/// config changed by `change` first.
fn fused_heads(device: &Device, change: impl Fn(&mut TrainingConfig)) -> Vec<String> {
    use burn_onnx_train::graph::attributes::FUSED_HEAD_LOSS;
    planned_graph("fused-head-plan", device, change)
        .nodes
        .iter()
        .filter(|n| n.attrs.get(FUSED_HEAD_LOSS).is_some())
        .map(|n| n.op_type.clone())
        .collect()
}

#[test]
fn the_plan_leaves_the_head_to_the_loss_on_gpu_when_the_forward_is_one_pass() {
    let device = gpu().autodiff();
    assert_eq!(fused_heads(&device, |_| {}), ["MatMul"]);
    assert!(
        fused_heads(&Device::flex().autodiff(), |_| {}).is_empty(),
        "not on the CPU"
    );
    let off = fused_heads(&device, |c| c.model.fused_head_loss = false);
    assert!(off.is_empty(), "model.fused_head_loss = false");
    let segments = fused_heads(&device, |c| c.parallel.recompute_segments = 2);
    assert!(segments.is_empty(), "not with recomputation segments");
}

/// How a test's thread ranks make their collective group from their communicator.
type GroupOf<'a> =
    &'a (dyn Fn(std::sync::Arc<dyn burn_ort_dist::Communicator>) -> CollectiveGroup + Send + Sync);

/// `run` over groups that move device tensors themselves (`ThroughHost`: through the host
/// here, as NCCL moves them on CUDA) and over plain ones: both results, and how many device
/// collectives each rank's group made.
fn on_both_paths<T>(run: impl Fn(GroupOf) -> T) -> (T, T, Vec<usize>) {
    use burn_ort_dist::ThroughHost;
    let counters = std::sync::Mutex::new(Vec::new());
    let on_device = run(&|comm| {
        let through = std::sync::Arc::new(ThroughHost::over(comm));
        counters.lock().unwrap().push(through.clone());
        CollectiveGroup(through)
    });
    let on_host = run(&CollectiveGroup);
    let calls = counters.lock().unwrap().iter().map(|t| t.calls()).collect();
    (on_device, on_host, calls)
}

/// Megatron's `g` and `f`'s backward, ZeRO-3's parameter gather and its backward's
/// gradient scatter, and the vocabulary-parallel loss on 2 thread ranks over
/// `group_of(comm)`: each rank's values after them (`g`'s sum, `f`'s input gradient, the
/// gathered parameter, the chunk's gradient, the loss's rows and its logits' gradient).
fn model_collectives_on_gpu(group_of: GroupOf) -> Vec<[Vec<f32>; 6]> {
    use burn_onnx_train::collective::megatron::{tp_copy, tp_reduce};
    use burn_onnx_train::collective::param_gather::gather_param;
    let timeout = std::time::Duration::from_secs(120);
    let results = burn_ort_dist::run_threads(2, timeout, |comm| -> Result<_, String> {
        let r = comm.rank() as f32;
        let group = group_of(comm);
        let device = gpu().autodiff();
        let tensor = |values: Vec<f32>, shape: &[usize]| {
            let data = TensorData::new(values, padded(shape).unwrap());
            PhysTensor::from_data(data, &device)
        };
        let read = |t: PhysTensor| {
            host(t.flatten(0, MAX_RANK - 1))
                .iter()
                .copied()
                .collect::<Vec<f32>>()
        };
        // g: the sum over the ranks of i * (r + 1).
        let x = tensor((0..6).map(|i| i as f32 * (r + 1.0)).collect(), &[2, 3]);
        let summed = read(tp_reduce(x, &group));
        // f: identity forward; its input's gradient is the sum of the ranks' (r + 1).
        let x = tensor(vec![1.0; 6], &[2, 3]).require_grad();
        let y = tp_copy(x.clone(), &group).mul_scalar(r + 1.0).sum();
        let f_grad = read(x.grad(&y.backward()).unwrap());
        // ZeRO-3: a parameter of 5 values in chunks of 3 (rank 1's padded with a zero);
        // the loss weighs it by (r + 1) * [1..5], whose mean over the ranks is scattered.
        let mine: Vec<f32> = (0..3).map(|i| (3.0 * r + i as f32).min(4.0)).collect();
        let mine = match r == 1.0 {
            true => vec![mine[0], mine[1], 0.0],
            false => mine,
        };
        let chunk = tensor(mine, &[3]).require_grad();
        let whole = gather_param(chunk.clone(), padded(&[5]).unwrap(), &group);
        let gathered = read(whole.clone());
        let weights = tensor((1..=5).map(|i| i as f32 * (r + 1.0)).collect(), &[5]);
        let loss = (whole * weights).sum();
        let chunk_grad = read(chunk.grad(&loss.backward()).unwrap());
        // The vocabulary-parallel loss: 6 classes, 3 a rank, targets 1 and 4.
        let sharded = burn_onnx_train::collective::vocab::ShardedLogits {
            shard: burn_onnx_train::collective::vocab::VocabShard {
                output: "logits".into(),
                vocab: 6,
                start: 3 * r as usize,
                valid: 3,
            },
            group: group.clone(),
        };
        let logits: Tensor<2> =
            Tensor::from_data(TensorData::new(vocab_logits(r as usize), [2, 3]), &device)
                .require_grad();
        let nll = sharded.nll_rows(logits.clone(), &[1, 4]).unwrap();
        let rows = host(nll.clone().inner()).iter().copied().collect();
        let logits_grad = host2(logits.grad(&nll.sum().backward()).unwrap());
        let logits_grad = logits_grad.iter().copied().collect();
        Ok([summed, f_grad, gathered, chunk_grad, rows, logits_grad])
    });
    results.into_iter().map(Result::unwrap).collect()
}

/// Rank `r`'s slice of 2 rows of 6 classes' logits, 3 a rank.
fn vocab_logits(r: usize) -> Vec<f32> {
    (0..2)
        .flat_map(|row| (0..3).map(move |j| 0.5 * (row + 1) as f32 * (j + 3 * r) as f32 - r as f32))
        .collect()
}

/// The f64 closed form of [`vocab_logits`]' loss at targets 1 and 4: each row's `nll`, and
/// rank `r`'s slice of `softmax - one_hot`.
fn vocab_loss_closed_form(r: usize) -> (Vec<f32>, Vec<f32>) {
    let whole: Vec<Vec<f64>> = (0..2)
        .map(|row| {
            (0..2)
                .flat_map(|rank| vocab_logits(rank)[3 * row..3 * row + 3].to_vec())
                .map(f64::from)
                .collect()
        })
        .collect();
    let (mut nll, mut grad) = (Vec::new(), Vec::new());
    for (z, target) in whole.iter().zip([1, 4]) {
        let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
        nll.push((lse - z[target]) as f32);
        for j in 3 * r..3 * r + 3 {
            let hot = if j == target { 1.0 } else { 0.0 };
            grad.push(((z[j] - lse).exp() - hot) as f32);
        }
    }
    (nll, grad)
}

#[test]
fn tensor_parallel_and_zero_3_collectives_take_the_groups_device_path() {
    // A group that moves device tensors itself carries each collective once, with the
    // values of the host path.
    let (on_device, on_host, calls) = on_both_paths(model_collectives_on_gpu);
    let want = |r: usize| {
        let chunk_grad = match r {
            0 => vec![1.5, 3.0, 4.5],
            _ => vec![6.0, 7.5, 0.0],
        };
        [
            (0..6).map(|i| 3.0 * i as f32).collect::<Vec<_>>(),
            vec![3.0; 6],
            vec![0.0, 1.0, 2.0, 3.0, 4.0],
            chunk_grad,
        ]
    };
    let close = |what: &str, got: &[f32], want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}: {got:?} vs {want:?}"
            );
        }
    };
    for r in 0..2 {
        let (nll, grad) = vocab_loss_closed_form(r);
        for (path, got) in [("device", &on_device[r]), ("host", &on_host[r])] {
            assert_eq!(got[..4], want(r), "rank {r} on the {path} path");
            close(&format!("rank {r}'s loss rows, {path} path"), &got[4], &nll);
            close(
                &format!("rank {r}'s logits' gradient, {path} path"),
                &got[5],
                &grad,
            );
        }
    }
    // g, f's backward, the gather, its scatter; the loss's row maxima and its two sums.
    assert_eq!(calls, [7, 7], "one device collective each");
}

/// Sequence parallelism's three moves on 2 thread ranks over `group_of(comm)`, each as a
/// forward with its backward (gather/scatter, scatter/gather, slice/gather) on a
/// `[2, 4, 3]` tensor whose token axis is split in blocks of 2 (rank `r` holds token `r`
/// of each block): each rank's outputs and input gradients.
fn sequence_moves_on_gpu(group_of: GroupOf) -> Vec<Vec<Vec<f32>>> {
    use burn_onnx_train::collective::axis_split::AxisSplit;
    use burn_onnx_train::collective::sequence_parallel::{Move, SequenceStep, sequence_transfer};
    let timeout = std::time::Duration::from_secs(120);
    let results = burn_ort_dist::run_threads(2, timeout, |comm| -> Result<_, String> {
        let r = comm.rank() as f32;
        let group = group_of(comm);
        let device = gpu().autodiff();
        let read = |t: PhysTensor| host(t.flatten(0, MAX_RANK - 1)).iter().copied().collect();
        let axis = MAX_RANK - 2;
        let mut out = Vec::new();
        for (forward, backward, local) in [
            (Move::AllGather, Move::ReduceScatter, true),
            (Move::ReduceScatter, Move::AllGather, false),
            (Move::Slice, Move::AllGather, false),
        ] {
            let step = SequenceStep {
                split: AxisSplit::new(axis, 2),
                parts: 2,
                forward,
                backward,
                group: group.clone(),
            };
            let shape = if local { [2, 2, 3] } else { [2, 4, 3] };
            let n = shape.iter().product::<usize>();
            let values = (0..n).map(|i| i as f32 + 100.0 * r).collect();
            let x =
                PhysTensor::from_data(TensorData::new(values, padded(&shape).unwrap()), &device)
                    .require_grad();
            let y = sequence_transfer(x.clone(), step);
            let m = y.dims().iter().product::<usize>();
            let weights: Vec<f32> = (0..m).map(|i| (i % 7) as f32 + r).collect();
            let weights = PhysTensor::from_data(TensorData::new(weights, y.dims()), &device);
            let loss = (y.clone() * weights).sum();
            let grad = x.grad(&loss.backward()).unwrap();
            out.push(read(y));
            out.push(read(grad));
        }
        Ok(out)
    });
    results.into_iter().map(Result::unwrap).collect()
}

#[test]
fn sequence_parallel_moves_take_the_groups_device_path() {
    let (on_device, on_host, calls) = on_both_paths(sequence_moves_on_gpu);
    assert_eq!(
        on_device, on_host,
        "the device path's values are the host path's"
    );
    // The whole sequence interleaves the ranks' tokens: token 0 is rank 0's first, token 1
    // rank 1's first, token 2 rank 0's second.
    assert_eq!(
        &on_host[1][0][..9],
        &[0.0, 1.0, 2.0, 100.0, 101.0, 102.0, 3.0, 4.0, 5.0]
    );
    // Gathers and scatters, forward and backward: five; a slice moves nothing.
    assert_eq!(calls, [5, 5]);
}

#[test]
fn where_masked_attention_on_gpu_gives_pytorchs_loss_and_gradients() {
    // Dynamo's GPT-2 selects its scores with `Where(mask, scores, fill)`, each layer with a
    // mask of its own (`bitwise_not`, `bitwise_not_1`) holding the same values: on the GPU
    // each layer's attention is one fused node reading the mask's device form, made by the
    // first layer and shared by the second (`PassMemo`).
    let path = |f: &str| data(&format!("dynamo_gpt2/{f}"));
    let model = OnnxModel::load(path("gpt2_tied.onnx"), &gpu().autodiff()).unwrap();
    let masks = model
        .graph()
        .nodes
        .iter()
        .filter(|n| n.attrs.get("__attention_core").is_some())
        .map(|n| n.inputs[3].clone())
        .collect::<Vec<_>>();
    assert!(
        masks.len() == 2 && masks.iter().all(|m| !m.is_empty()),
        "{masks:?}"
    );
    let ids = int(&npz(path("batch.npz"))["input_ids"]).clone();
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path("losses.json")).unwrap()).unwrap();
    let loss = lm_loss(&model, &ids);
    let got = loss.clone().into_scalar::<f32>() as f64;
    let want = refs["adamw_losses"][0].as_f64().unwrap();
    assert!((got - want).abs() < 1e-4, "loss {got} vs PyTorch {want}");
    let grads0 = npz(path("grads.npz"));
    let tol = on_tf32(1e-5, 1e-4);
    let grads = loss.backward();
    for (name, g) in model.param_grads(&grads) {
        let w = float(&grads0[&name]);
        assert_close(
            &format!("grad {name}"),
            &g.to_array().unwrap(),
            w,
            tol,
            1e-3,
        );
    }
}

#[test]
fn a_value_the_device_could_not_make_reads_as_an_error() {
    // 2^36 f32 (256 GiB): past lavapipe's buffer limit and any GPU's memory. The fill is
    // launched into an allocation that failed; reading it back reports the device's error
    // where Burn's `into_data` panics.
    let huge = PhysTensor::ones([1 << 18, 1 << 18, 1, 1, 1, 1, 1, 1], &gpu());
    let err = burn_ort_dist::host_values(huge.clone()).unwrap_err();
    assert!(err.contains("the device could not produce it"), "{err}");
    let err = burn_onnx_train::value::FloatValue::new(huge, 1)
        .to_array()
        .unwrap_err();
    assert!(
        err.0.contains("the device could not produce it"),
        "{}",
        err.0
    );
}

#[test]
fn gpt2_tiny_adamw_10_steps_match_pytorch_on_gpu() {
    check_trajectory_within(
        Case::new("gpt2_tiny", "gpt2_tiny"),
        &gpu(),
        adamw(),
        1e-3,
        "adamw",
        on_tf32(1e-4, 1e-3) as f64,
        on_tf32(1e-4, 1e-3),
        // TF32's noise reaches gradients up to ~1e-4 of gpt2_tiny's (typically 1e-3..1e-2).
        (on_tf32(1e-6, 1e-4), on_tf32(1e-4, ADAM_NOISE_BOUND)),
    );
}

/// `rows` x 16 token ids of gpt2_tiny's vocabulary.
fn gpt2_tiny_ids(rows: usize) -> ndarray::ArrayD<i64> {
    ndarray::ArrayD::from_shape_fn(ndarray::IxDyn(&[rows, 16]), |ix| {
        ((ix[0] * 131 + ix[1] * 17) % 256) as i64
    })
}

/// The device `model`'s logits for `ids` come out on, and every parameter gradient of
/// `mean(logits^2)`.
fn mean_square_grads(
    model: &OnnxModel,
    ids: ndarray::ArrayD<i64>,
) -> (Device, Vec<(String, burn_onnx_train::value::FloatValue)>) {
    let out = model
        .forward(vec![("input_ids".into(), Value::Int(ids))], Mode::Train)
        .unwrap();
    let Some(Value::Float(logits)) = out.first().cloned() else {
        panic!("float logits")
    };
    let device = logits.tensor.device();
    let grads = (logits.tensor.clone() * logits.tensor).mean().backward();
    (device, model.param_grads(&grads))
}

/// Every parameter gradient of gpt2_tiny over 32 x 16 tokens and `mean(logits^2)`.
fn gpt2_tiny_grads_over_512_rows(device: &Device) -> Vec<(String, ndarray::ArrayD<f32>)> {
    let device = device.clone().autodiff();
    let model = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    mean_square_grads(&model, gpt2_tiny_ids(32))
        .1
        .into_iter()
        .map(|(name, g)| (name, g.to_array().unwrap()))
        .collect()
}

/// 512 rows: on CubeCL devices the gradients of the biases and LayerNorm scales are summed
/// in groups (`ops::broadcast::float_binary`); the CPU sums each in one reduction.
#[test]
fn bias_and_norm_gradients_over_512_rows_match_the_cpu() {
    let gpu_grads = gpt2_tiny_grads_over_512_rows(&gpu());
    let cpu_grads = gpt2_tiny_grads_over_512_rows(&Device::flex());
    assert_eq!(gpu_grads.len(), cpu_grads.len());
    let mut grouped = 0;
    for ((name, g), (_, c)) in gpu_grads.iter().zip(&cpu_grads) {
        let scale = c.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{name}: no gradient");
        let tol = on_tf32(1e-4, 2e-3) * scale;
        assert_close(
            &format!("{} vs CPU: grad {name}", gpu_spec()),
            g,
            c,
            tol,
            0.0,
        );
        grouped += usize::from(c.ndim() == 1);
    }
    assert!(
        grouped >= 10,
        "the biases and norm scales are among the gradients"
    );
}

/// 10 AdamW updates of gpt2_tiny with clipping, a warm-up schedule, evaluation every 5
/// updates and a checkpoint at 5, on `device`.
fn run_on(device: DeviceSpec, out: &Path) -> RunSummary {
    let c = {
        let mut c = gpt2_config(out);
        c.parallel.device = device;
        c.train.num_train_steps = 10;
        c.eval.evaluation_period = 5;
        c.checkpoint.checkpoint_period = 5;
        c.lr = LrConfig {
            warmup_ratio: 0.2,
            mode: ScheduleKind::Constant,
            ..Default::default()
        };
        c
    };
    launch(c, gpt2_tokens(), Some(gpt2_tokens())).unwrap()
}

/// `run_on`'s run with each update after the second replayed from a recording of the
/// third (`train.cuda_graph`), `accumulation` micro-steps an update.
fn recorded_run(recorded: bool, accumulation: usize, out: &Path) -> RunSummary {
    let mut c = gpt2_config(out);
    c.parallel.device = gpu_spec();
    c.train.num_train_steps = 10 * accumulation;
    c.train.gradient_accumulation_steps = accumulation;
    c.train.cuda_graph = recorded;
    // AdamW's decay factors follow the learning rate: a table written before each replay.
    c.optimizer.weight_decay = 0.1;
    c.eval.evaluation_period = 4;
    c.checkpoint.checkpoint_period = 5;
    c.lr = LrConfig {
        warmup_ratio: 0.2,
        mode: ScheduleKind::Cosine,
        ..Default::default()
    };
    launch(c, gpt2_tokens(), Some(gpt2_tokens())).unwrap()
}

#[test]
fn updates_replayed_from_a_recording_on_gpu_train_as_the_launched_ones() {
    // The replays read each batch's ids and targets and each update's learning rate from
    // the buffers written before them, and update the parameters in place: the same
    // losses, evaluations (between replays, as checkpoints) and parameters, to the bit, as
    // the updates launched kernel by kernel.
    for accumulation in [1, 2] {
        let (plain_out, graph_out) = (
            tempdir(&format!("gpu-plain-{accumulation}")),
            tempdir(&format!("gpu-graph-{accumulation}")),
        );
        let plain = recorded_run(false, accumulation, &plain_out);
        let graph = recorded_run(true, accumulation, &graph_out);
        let replayed = |s: &RunSummary| s.perf.as_ref().unwrap().replayed_updates;
        // The third update recorded (and replayed once), the 7 after it replays.
        assert_eq!((replayed(&plain), replayed(&graph)), (0, 7));
        assert_eq!(graph.losses.len(), 10);
        for ((step, g), (_, p)) in graph.losses.iter().zip(&plain.losses) {
            assert!(
                (g - p).abs() <= 1e-6 * p.abs(),
                "update {step}: loss {g} replayed, {p} launched"
            );
        }
        assert_eq!(graph.evals.len(), 3);
        for (g, p) in graph.evals.iter().zip(&plain.evals) {
            assert!(
                (g.loss - p.loss).abs() <= 1e-5,
                "evaluation at {}: {} vs {}",
                g.step,
                g.loss,
                p.loss
            );
        }
        let file = "gpt2_tiny_trained.onnx";
        assert_moved(
            &refkit("models/gpt2_tiny.onnx"),
            &graph_out.join(file),
            1e-3,
        );
        for ((name, g), (_, p)) in onnx_params(graph_out.join(file))
            .iter()
            .zip(onnx_params(plain_out.join(file)))
        {
            assert_eq!(g, &p, "replayed vs launched: {name}");
        }
    }
}

#[test]
fn a_run_that_cannot_be_recorded_trains_as_usual() {
    // f16's loss scale reads the overflow flag each update: refused before the first. An
    // update offloaded to the CPU writes no device tables: found at the recording, after
    // the allocator was prepared for it (and given back). Either way, the same run.
    let run = |recorded: bool, case: usize, out: &Path| {
        let mut c = gpt2_config(out);
        c.parallel.device = gpu_spec();
        c.train.num_train_steps = 6;
        c.train.cuda_graph = recorded;
        match case {
            0 => c.precision.dtype = Precision::F16,
            _ => c.offload.offload_optimizer = OffloadTarget::Cpu,
        }
        launch(c, gpt2_tokens(), None).unwrap()
    };
    for case in 0..2 {
        let (plain_out, asked_out) = (
            tempdir(&format!("gpu-unrecorded-plain-{case}")),
            tempdir(&format!("gpu-unrecorded-asked-{case}")),
        );
        let (plain, asked) = (run(false, case, &plain_out), run(true, case, &asked_out));
        assert_eq!(
            asked.perf.as_ref().unwrap().replayed_updates,
            0,
            "case {case}"
        );
        assert_eq!(asked.losses, plain.losses, "case {case}");
    }
}

#[test]
fn the_runner_on_gpu_matches_the_cpu_run_and_its_checkpoint_resumes_on_the_cpu() {
    let (gpu_out, cpu_out) = (tempdir("gpu-run"), tempdir("gpu-cpu-run"));
    let gpu = run_on(gpu_spec(), &gpu_out);
    let cpu = run_on(DeviceSpec::Cpu, &cpu_out);
    // The collectives' host round trips are counted on a GPU only (for the process: the
    // tests running beside this one count into it too).
    let perf = |s: &RunSummary| s.perf.clone().expect("perf.json's report");
    let trips = |s: &RunSummary| perf(s).collective_host_round_trips_per_update;
    assert!(trips(&gpu).is_some() && trips(&cpu).is_none());
    assert_eq!(gpu.losses.len(), 10);
    for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
        assert!(
            (g - c).abs() < on_tf32(1e-4, 1e-3) as f64,
            "update {step}: loss {g} on {}, {c} on the CPU",
            gpu_spec()
        );
    }
    assert_eq!(gpu.evals.len(), 2);
    for (g, c) in gpu.evals.iter().zip(&cpu.evals) {
        assert!(
            (g.loss - c.loss).abs() < on_tf32(1e-4, 1e-3) as f64,
            "evaluation at {}: {} on {}, {} on the CPU",
            g.step,
            g.loss,
            gpu_spec(),
            c.loss
        );
    }
    let (gpu_model, cpu_model) = (
        gpu_out.join("gpt2_tiny_trained.onnx"),
        cpu_out.join("gpt2_tiny_trained.onnx"),
    );
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &gpu_model, 1e-3);
    let tol = on_tf32(1e-4, ADAM_NOISE_BOUND);
    let what = format!("{} vs CPU after 10 updates", gpu_spec());
    assert_same_params(&what, &gpu_model, &cpu_model, tol);

    // The GPU run's step-5 checkpoint (weights and AdamW moments) resumes on the CPU and
    // ends where the CPU run ends.
    let ckpt = gpu_out.join("checkpoints/ckpt-000000005");
    let resumed = resume_on(DeviceSpec::Cpu, ckpt, "gpu-resumed-on-cpu");
    let what = "resumed on the CPU from the GPU's checkpoint";
    assert_same_params(what, &resumed, &cpu_model, tol);

    // And the converse: the CPU run's checkpoint (Burn's AdamW record) resumes under the
    // fused update on the GPU.
    let ckpt = cpu_out.join("checkpoints/ckpt-000000005");
    let resumed = resume_on(gpu_spec(), ckpt, "cpu-resumed-on-gpu");
    let what = "resumed on the GPU from the CPU's checkpoint";
    assert_same_params(what, &resumed, &cpu_model, tol);
}

/// [`run_on`]'s run resumed on `device` from `ckpt` (its update 5); the trained model.
fn resume_on(device: DeviceSpec, ckpt: std::path::PathBuf, tag: &str) -> std::path::PathBuf {
    let out = tempdir(tag);
    let c = {
        let mut c = gpt2_config(&out);
        c.parallel.device = device;
        c.train.num_train_steps = 10;
        c.eval.evaluation_period = 5;
        c.lr = LrConfig {
            warmup_ratio: 0.2,
            mode: ScheduleKind::Constant,
            ..Default::default()
        };
        c.checkpoint.checkpoint_to_load_path = Some(ckpt);
        c
    };
    let again = launch(c, gpt2_tokens(), None).unwrap();
    assert_eq!(again.start_step, 5, "{tag}");
    out.join("gpt2_tiny_trained.onnx")
}

/// Every initializer of two exported models within `atol`.
fn assert_same_params(what: &str, got: &Path, want: &Path, atol: f32) {
    let want = onnx_params(want.to_path_buf());
    for ((name, g), (_, w)) in onnx_params(got.to_path_buf()).iter().zip(&want) {
        assert_close(&format!("{what}: {name}"), g, w, atol, 0.0);
    }
}

#[test]
fn data_parallel_and_zero_3_on_gpu_match_the_replicated_cpu_run() {
    // 2 thread ranks on the GPU handing each other device tensors: plain data parallelism
    // (gradients averaged on the device, then the fused, clipped AdamW on the GPU), ZeRO-1
    // and 2 updating their shards on the device, and ZeRO-3's parameter gather and its
    // reduce-scatter as CubeCL-backend ops, its update on the device.
    // Both thread ranks on the one GPU (a CUDA rank otherwise takes GPU `rank`).
    let spec = match gpu_spec() {
        DeviceSpec::Cuda(None) => DeviceSpec::Cuda(Some(0)),
        spec => spec,
    };
    let run = |device: DeviceSpec, zero_stage: usize, out: &Path| {
        let c = {
            let mut c = gpt2_config(out);
            c.parallel.device = device;
            c.parallel.data_parallel_size = 2;
            c.data.batch_size = 2;
            c.parallel.zero_stage = zero_stage;
            c.train.num_train_steps = 10;
            // Clipped: the fused update measures the gradients on the device first.
            c.train.max_grad_norm = 1.0;
            c
        };
        launch(c, gpt2_tokens(), None).unwrap()
    };
    let cpu_out = tempdir("gpu-zero3-cpu");
    let cpu = run(DeviceSpec::Cpu, 0, &cpu_out);
    let stages = [
        (0, "data parallelism"),
        (1, "ZeRO-1"),
        (2, "ZeRO-2"),
        (3, "ZeRO-3"),
    ];
    for (stage, what) in stages {
        let gpu_out = tempdir(&format!("gpu-zero{stage}"));
        let gpu = run(spec.clone(), stage, &gpu_out);
        ended_where_the_cpu_did(what, (&gpu, &gpu_out), (&cpu, &cpu_out));
    }
}

/// Thread ranks hand each other their GPU tensors (the thread group's device collectives
/// and sends): on 3 ranks, all-reduce (sum and mean), all-gather, reduce-scatter and a
/// ring of sends give the host collectives' values, on each rank's device.
#[test]
fn thread_ranks_exchange_gpu_tensors_with_the_host_collectives_values() {
    use burn_ort_dist::ReduceOp;
    let device = gpu();
    let results = burn_ort_dist::run_threads(
        3,
        std::time::Duration::from_secs(120),
        |comm| -> Result<_, String> {
            let (r, world) = (comm.rank(), comm.world_size());
            let values: Vec<f32> = (0..6).map(|i| (i * (r + 1)) as f32 + 0.5).collect();
            let t = Tensor::<1>::from_data(TensorData::new(values.clone(), [6]), &device);
            let err = |e: burn_ort_dist::DistError| e.to_string();
            let on_gpu = comm.device_collectives().filter(|d| d.works_on(&device));
            let moves = on_gpu.ok_or("the thread group moves GPU tensors")?;
            let sends = comm
                .device_sends()
                .ok_or("the thread group sends GPU tensors")?;
            let read = |t: Tensor<1>| -> Vec<f32> {
                assert_eq!(t.device(), device, "the result's device");
                t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
            };
            let mut got = Vec::new();
            let mut want = Vec::new();
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                got.push(read(moves.all_reduce(t.clone(), op).map_err(err)?));
                let mut host = values.clone();
                comm.all_reduce(&mut host, op).map_err(err)?;
                want.push(host);
                got.push(read(moves.reduce_scatter(t.clone(), op).map_err(err)?));
                let mut host = vec![0.0; 2];
                comm.reduce_scatter(&values, &mut host, op).map_err(err)?;
                want.push(host);
            }
            got.push(read(moves.all_gather(t.clone()).map_err(err)?));
            let mut host = vec![0.0; 6 * world];
            comm.all_gather(&values, &mut host).map_err(err)?;
            want.push(host);
            // A ring: each rank sends to the next and receives from the previous.
            sends.send(t, (r + 1) % world).map_err(err)?;
            let from = (r + world - 1) % world;
            got.push(read(sends.recv(6, from, &device).map_err(err)?));
            want.push((0..6).map(|i| (i * (from + 1)) as f32 + 0.5).collect());
            Ok((got, want))
        },
    );
    for (rank, r) in results.into_iter().enumerate() {
        let (got, want) = r.unwrap();
        assert_eq!(got, want, "rank {rank}");
    }
}

/// ZeRO-3 with its chunks in host memory (`offload_params = "cpu"`, ZeRO-Infinity's
/// parameter offload): the chunks live on the CPU device while the nodes compute on the
/// GPU (the logits come out there, the chunks' gradients come back to the host, equal to
/// the plain GPU model's), and 2 thread ranks on the GPU end where the replicated CPU run
/// does, with the chunks in host memory and in a file (`"disk"`).
#[test]
fn zero_3_with_its_chunks_in_host_memory_computes_on_the_gpu_and_matches_the_cpu() {
    use burn_onnx_train::collective::{CollectiveGroup, Collectives};
    let device = gpu().autodiff();
    let grads_of = |model: &OnnxModel| {
        let (logits_on, grads) = mean_square_grads(model, gpt2_tiny_ids(2));
        assert_eq!(logits_on, device, "the logits' device");
        grads
    };
    let plain = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let offloaded = plain
        .clone()
        .into_sharded(0, 1, ChunkStore::Host)
        .unwrap()
        .with_collectives(Collectives {
            tensor_parallel: None,
            sharding: Some(CollectiveGroup(std::sync::Arc::new(
                burn_ort_dist::LocalCommunicator,
            ))),
        });
    assert_eq!(offloaded.device(), device);
    for p in offloaded.params() {
        assert_eq!(
            p.val().device(),
            Device::flex().autodiff(),
            "a chunk's device"
        );
    }
    let want = grads_of(&plain);
    let got = grads_of(&offloaded);
    assert_eq!(got.len(), want.len());
    for ((name, g), (_, w)) in got.iter().zip(&want) {
        assert_eq!(
            g.tensor.device(),
            Device::flex(),
            "{name}: the gradient's device"
        );
        // One chunk of one: the whole parameter, flattened.
        let (g, w) = (g.to_array().unwrap(), w.to_array().unwrap());
        let g = g.into_shape_with_order(w.shape()).unwrap();
        assert_close(
            &format!("{name} (chunk in host memory)"),
            &g,
            &w,
            1e-5,
            1e-5,
        );
    }

    let spec = match gpu_spec() {
        DeviceSpec::Cuda(None) => DeviceSpec::Cuda(Some(0)),
        spec => spec,
    };
    let run = |device: DeviceSpec, zero_stage: usize, params: ParamOffload, out: &Path| {
        let mut c = gpt2_config(out);
        c.parallel.device = device;
        c.parallel.data_parallel_size = 2;
        c.data.batch_size = 2;
        c.parallel.zero_stage = zero_stage;
        c.offload.offload_params = params;
        c.train.num_train_steps = 10;
        launch(c, gpt2_tokens(), None).unwrap()
    };
    // The runner's plan takes the config's choice: its chunks are on the CPU.
    let mut c = gpt2_config(&tempdir("gpu-zero3-host-plan"));
    c.parallel.device = spec;
    c.parallel.zero_stage = 3;
    c.offload.offload_params = ParamOffload::Cpu;
    let plan = ParallelPlan::new(&c, &burn_ort_dist::LocalCommunicator).unwrap();
    let sharded = plan
        .replicate_or_shard(OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap())
        .unwrap();
    assert!(
        sharded
            .params()
            .iter()
            .all(|p| p.val().device() == Device::flex().autodiff())
    );
    let cpu_out = tempdir("gpu-zero3-host-cpu");
    let cpu = run(DeviceSpec::Cpu, 0, ParamOffload::None, &cpu_out);
    // In host memory, and in a file (`offload_params = "disk"`) read through the CPU.
    for (params, what) in [
        (ParamOffload::Cpu, "ZeRO-3 with chunks in host memory"),
        (ParamOffload::Disk, "ZeRO-3 with chunks on disk"),
    ] {
        let gpu_out = tempdir(&format!("gpu-zero3-{params:?}"));
        let gpu = run(spec, 3, params, &gpu_out);
        ended_where_the_cpu_did(what, (&gpu, &gpu_out), (&cpu, &cpu_out));
    }
}

/// A parallel run of gpt2_tiny on the GPU (`what`) against the CPU's: losses within 1e-4
/// (1e-3 on TF32), parameters moved and within Adam's noise bound of the CPU's.
fn ended_where_the_cpu_did(
    what: &str,
    (gpu, gpu_out): (&RunSummary, &Path),
    (cpu, cpu_out): (&RunSummary, &Path),
) {
    for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
        assert!(
            (g - c).abs() < on_tf32(1e-4, 1e-3) as f64,
            "update {step}: loss {g} on {} at {what}, {c} on the CPU",
            gpu_spec()
        );
    }
    let file = "gpt2_tiny_trained.onnx";
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &gpu_out.join(file), 1e-3);
    for ((name, g), (_, c)) in onnx_params(gpu_out.join(file))
        .iter()
        .zip(onnx_params(cpu_out.join(file)))
    {
        assert_close(
            &format!("{} {what} vs CPU: {name}", gpu_spec()),
            g,
            &c,
            on_tf32(1e-4, ADAM_NOISE_BOUND),
            1e-4,
        );
    }
}

#[test]
fn tensor_and_sequence_parallel_on_gpu_match_the_cpu_run() {
    // Megatron's f/g, the vocabulary-parallel loss and sequence parallelism's transfers and
    // gathered projections as CubeCL-backend ops: 2 thread ranks on the one GPU against one
    // process on the CPU.
    let spec = match gpu_spec() {
        DeviceSpec::Cuda(None) => DeviceSpec::Cuda(Some(0)),
        spec => spec,
    };
    let run = |device: DeviceSpec, tp: usize, out: &Path| {
        let c = {
            let mut c = gpt2_config(out);
            c.parallel.device = device;
            c.parallel.horizontal_parallel_size = tp;
            c.parallel.tensor_parallel_sequence = tp > 1;
            c.train.num_train_steps = 10;
            c
        };
        launch(c, gpt2_tokens(), None).unwrap()
    };
    let (gpu_out, cpu_out) = (tempdir("gpu-tp-seq"), tempdir("gpu-tp-seq-cpu"));
    let gpu = run(spec, 2, &gpu_out);
    let cpu = run(DeviceSpec::Cpu, 1, &cpu_out);
    assert_eq!(gpu.perf.as_ref().unwrap().world_size, 2);
    ended_where_the_cpu_did(
        "tp 2 with sequence parallelism",
        (&gpu, &gpu_out),
        (&cpu, &cpu_out),
    );
}

#[test]
fn low_precision_with_loss_scaling_on_gpu_matches_the_cpu() {
    // f16 computes its matmuls in half precision with a dynamic loss scale; bf16 only where
    // the backend computes in it (wgpu refuses it, see `precision.rs`). The GPU's and the
    // CPU's low-precision roundings differ, so the losses agree to 1%; the parameters move.
    let mut precisions = vec![Precision::F16];
    if matches!(gpu_spec(), DeviceSpec::Cuda(_)) {
        precisions.push(Precision::Bf16);
    }
    for precision in precisions {
        let run = |device: DeviceSpec, tag: &str| {
            let out = tempdir(&format!("gpu-{precision:?}-{tag}"));
            let c = {
                let mut c = gpt2_config(&out);
                c.parallel.device = device;
                c.precision.dtype = precision;
                c.train.num_train_steps = 10;
                c
            };
            (launch(c, gpt2_tokens(), None).unwrap(), out)
        };
        let (gpu, gpu_out) = run(gpu_spec(), "gpu");
        let (cpu, _) = run(DeviceSpec::Cpu, "cpu");
        assert_eq!(gpu.losses.len(), 10, "{precision:?}");
        for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
            assert!(
                (g - c).abs() <= 1e-2 * c.abs(),
                "{precision:?} update {step}: loss {g} on {}, {c} on the CPU",
                gpu_spec()
            );
        }
        assert_moved(
            &refkit("models/gpt2_tiny.onnx"),
            &gpu_out.join("gpt2_tiny_trained.onnx"),
            1e-3,
        );
    }
}

#[test]
fn the_fused_paths_are_taken_on_gpu_only() {
    assert!(runs_cubecl(&gpu()) && runs_cubecl(&gpu().autodiff()));
    assert!(!runs_cubecl(&Device::flex()) && !runs_cubecl(&Device::flex().autodiff()));
}

#[test]
fn fused_cross_entropy_on_gpu_matches_the_closed_form_and_the_plain_composition() {
    check_cross_entropy(&gpu());
}

#[test]
fn fused_cross_entropy_of_f16_logits_on_gpu_computes_in_f32_and_writes_f16() {
    check_f16_cross_entropy(&gpu());
}

#[test]
fn head_product_and_cross_entropy_by_blocks_on_gpu_match_the_closed_form() {
    check_head_cross_entropy(&gpu(), FloatDType::F32, on_tf32(1e-5, 2e-3) as f64);
    check_head_cross_entropy(&gpu(), FloatDType::F16, 3e-3);
}

/// The CubeCL kernels' tolerances against f64, as multiples of the CPU kernels' (GPU `exp`
/// and `tanh` may be a few ulp off, fast-math ones more).
const GPU_SLACK: f64 = 10.0;

#[test]
fn fused_tanh_and_gelu_on_gpu_match_the_f64_closed_form() {
    check_tanh(&gpu().autodiff(), GPU_SLACK);
    check_gelu_tanh(&gpu().autodiff(), GPU_SLACK);
    check_gelu_tanh_biased(&gpu().autodiff(), GPU_SLACK);
}

#[test]
fn bias_and_residual_added_in_one_op_on_gpu_match_the_f64_sums() {
    check_add_bias_residual(&gpu().autodiff());
}

#[test]
fn layer_norm_writing_f16_on_gpu_matches_the_f64_closed_form() {
    check_layer_norm_f16_out(&gpu().autodiff(), GPU_SLACK);
}

#[test]
fn f16_biased_gelu_on_gpu_matches_the_closed_form_of_its_rounded_input() {
    check_gelu_tanh_biased_f16(&gpu().autodiff());
}

#[test]
fn fused_softmax_on_gpu_matches_the_f64_closed_form() {
    // 70000 rows spill past one grid dimension (65535 cubes).
    check_softmax(
        &gpu().autodiff(),
        GPU_SLACK,
        &[(37, 1000), (5, 2), (3, 50257), (70_000, 3)],
    );
}

#[test]
fn fused_layer_norm_on_gpu_matches_the_f64_closed_form() {
    // Rows that are not a whole number of the parameter gradients' blocks (64 rows), rows
    // wider than a cube (256 units), one column.
    check_layer_norm(
        &gpu().autodiff(),
        GPU_SLACK,
        &[(77, 128), (3, 1000), (1, 5), (300, 768), (2, 1)],
    );
}

/// `softmax(where(keep, x * scale, fill) + bias)` over the last axis of `[2, 3, 7, cols]`
/// scores through `kernels::masked_softmax` on the GPU, `keep` at `keep_dims` and a bias
/// per key (both broadcast), and the gradient of `sum(w * y)`, against the f64 closed
/// form.
fn check_masked_softmax(cols: usize, keep_dims: [usize; 4], scale: f32, fill: f32) {
    let dims = [2, 3, 7, cols];
    let n: usize = dims.iter().product();
    let device = gpu().autodiff();
    let (x, w) = activation_problem(n / cols, cols);
    let mut next = lcg(41);
    let mut keep: Vec<f32> = (0..keep_dims.iter().product::<usize>())
        .map(|_| if next() % 4 == 0 { 0.0 } else { 1.0 })
        .collect();
    // A row with every score masked (its softmax is uniform over the fill).
    keep[..cols].iter_mut().for_each(|k| *k = 0.0);
    let keep_at = |i: usize| {
        let (mut rest, mut at, mut step) = (i, 0, 1);
        for d in (0..4).rev() {
            let coord = rest % dims[d];
            rest /= dims[d];
            if keep_dims[d] != 1 {
                at += coord * step;
            }
            step *= keep_dims[d];
        }
        keep[at] != 0.0
    };
    let tensor = |v: Vec<f32>, d: &[usize]| {
        PhysTensor::from_data(TensorData::new(v, padded(d).unwrap().to_vec()), &device)
    };
    let tx = tensor(x.clone(), &dims).require_grad();
    // A bias per key position, the same for every row.
    let bias: Vec<f32> = (0..cols).map(|j| (j % 5) as f32 * 0.3 - 0.6).collect();
    let tbias = tensor(bias.clone(), &[1, 1, 1, cols]);
    let tkeep = tensor(keep.clone(), &keep_dims);
    let y = kernels::masked_softmax(tx.clone(), tkeep, tbias, scale, fill);
    let grads = (y.clone() * tensor(w.clone(), &dims)).sum().backward();
    let got = |t: Tensor<MAX_RANK>| t.into_data().try_to_vec::<f32>().unwrap();
    let (y, g) = (got(y.inner()), got(tx.grad(&grads).unwrap()));
    let what = format!("masked softmax {dims:?} keep {keep_dims:?}");
    for r in 0..n / cols {
        let row = r * cols..(r + 1) * cols;
        let z: Vec<f64> = row
            .clone()
            .map(|i| {
                let b = f64::from(bias[i % cols]);
                match keep_at(i) {
                    true => f64::from(x[i]) * f64::from(scale) + b,
                    false => f64::from(fill) + b,
                }
            })
            .collect();
        let max = z.iter().fold(f64::MIN, |m, &v| m.max(v));
        let e: Vec<f64> = z.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let dot: f64 = row
            .clone()
            .map(|i| e[i - r * cols] / sum * f64::from(w[i]))
            .sum();
        for i in row {
            let p = e[i - r * cols] / sum;
            assert!(
                (f64::from(y[i]) - p).abs() <= 1e-6 * GPU_SLACK * p + 1e-12,
                "{what}: y[{i}] {} vs {p}",
                y[i]
            );
            let (want, bound) = match keep_at(i) {
                true => {
                    let s = f64::from(scale);
                    let bound = s * p * (f64::from(w[i]).abs() + dot.abs());
                    (s * p * (f64::from(w[i]) - dot), bound)
                }
                false => (0.0, 0.0),
            };
            assert!(
                (f64::from(g[i]) - want).abs() <= 1e-6 * GPU_SLACK * bound + 1e-12,
                "{what}: dx[{i}] {} vs {want}",
                g[i]
            );
        }
    }
}

/// Pieces of `[2, 5, 12]` values along `dim` through `kernels::narrow` on the GPU: each
/// piece holds its elements, and the gradient of `sum(w * piece)` over the first (read
/// transposed) and last pieces is `w` where those pieces were and zero elsewhere, exactly.
/// The pieces are cut from a parameter, or from an op's output (whose gradient the later
/// pieces add into in place), which another term of the loss may read whole too: its
/// gradient then arrives between the pieces' (an in-place write that overwrote instead of
/// adding fails here).
fn check_narrow(dim: usize, sizes: [usize; 3], from_op: bool, read_whole: bool) {
    let dims = [2, 5, 12];
    let device = gpu().autodiff();
    let n: usize = dims.iter().product();
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
    let phys = MAX_RANK - 3 + dim;
    let tensor = |v: Vec<f32>, d: &[usize]| {
        PhysTensor::from_data(TensorData::new(v, padded(d).unwrap().to_vec()), &device)
    };
    let tx = tensor(x.clone(), &dims).require_grad();
    // `x * 2` when cut from an op's output: the pieces' gradients reach `x` doubled.
    let (cut, scale) = match from_op {
        true => (tx.clone().mul_scalar(2.0), 2.0),
        false => (tx.clone(), 1.0),
    };
    let coord = |i: usize| [i / 60, i / 12 % 5, i % 12][dim];
    let mut want_grad = vec![0.0f32; n];
    let mut loss = None;
    let mut start = 0;
    let pieces = std::sync::Arc::new(kernels::SplitPieces::default());
    for (p, &len) in sizes.iter().enumerate() {
        let piece = kernels::narrow(cut.clone(), phys, start, len, &pieces);
        let inside: Vec<usize> = (0..n)
            .filter(|&i| (start..start + len).contains(&coord(i)))
            .collect();
        let got = piece
            .clone()
            .inner()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let want: Vec<f32> = inside.iter().map(|&i| x[i] * scale).collect();
        assert_eq!(got, want, "piece {p} along {dim}");
        let mut piece_dims = dims;
        piece_dims[dim] = len;
        let [_, rows, cols] = piece_dims;
        let term = match p {
            // Piece 0 is read transposed: its gradient arrives as a strided view.
            0 => {
                let w: Vec<f32> = (0..inside.len()).map(|k| k as f32 + 100.0).collect();
                for (j, &i) in inside.iter().enumerate() {
                    let (o, r, c) = (j / (rows * cols), j / cols % rows, j % cols);
                    want_grad[i] += w[(o * cols + c) * rows + r] * scale;
                }
                let transposed = piece.swap_dims(MAX_RANK - 2, MAX_RANK - 1);
                Some((transposed * tensor(w, &[dims[0], cols, rows])).sum())
            }
            // Piece 1 is not read: no gradient reaches it.
            1 => None,
            _ => {
                let w: Vec<f32> = (0..inside.len()).map(|j| j as f32 + p as f32).collect();
                for (&i, &wj) in inside.iter().zip(&w) {
                    want_grad[i] += wj * scale;
                }
                Some((piece * tensor(w, &piece_dims)).sum())
            }
        };
        loss = match (loss, term) {
            (Some(l), Some(t)) => Some(l + t),
            (l, t) => l.or(t),
        };
        start += len;
    }
    if read_whole {
        let w: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        for (g, v) in want_grad.iter_mut().zip(&w) {
            *g += v * scale;
        }
        loss = loss.map(|l| l + (cut.clone() * tensor(w, &dims)).sum());
    }
    let grads = loss.unwrap().backward();
    let got = tx
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(
        got, want_grad,
        "gradient along {dim} (from an op: {from_op}, read whole: {read_whole})"
    );
}

#[test]
fn split_pieces_on_gpu_hold_their_elements_and_write_their_gradients_in_place() {
    for (from_op, read_whole) in [(false, false), (true, false), (true, true), (false, true)] {
        check_narrow(2, [4, 4, 4], from_op, read_whole);
        check_narrow(2, [3, 4, 5], from_op, read_whole);
        check_narrow(1, [1, 3, 1], from_op, read_whole);
    }
}

#[test]
fn fused_masked_softmax_on_gpu_matches_the_f64_closed_form() {
    // A causal-style [seq, seq] mask over batch and heads, scaled by 1/8, filled with
    // f32::MIN (Hugging Face's mask value); rows wider than a cube.
    check_masked_softmax(64, [1, 1, 7, 64], 0.125, f32::MIN);
    check_masked_softmax(300, [1, 1, 7, 300], 0.125, f32::MIN);
    // A per-head key mask, a finite fill and a scale above one.
    check_masked_softmax(50, [1, 3, 1, 50], 1.7, -30.0);
}

/// The attention core's output and the gradients of Q, K and V against the f64 closed form,
/// in f32, (its products) in f16, and in f16 with the output written in f16 (its gradient
/// arriving so): `q [2, 3, 5, 4]`, K stored `[2, 3, 7, 4]` and read transposed as `kt`,
/// `v [2, 3, 7, 6]`, a causal-style mask shared by batch and heads, a bias per key, scale
/// 1/2; the loss `sum(out * w)`.
#[test]
fn attention_core_on_gpu_matches_the_f64_closed_form() {
    let f32_tol = on_tf32(1e-5, 2e-3).into();
    // Whole, and a slice of the batch at a time: the scores are 2 x 3 x 5 x 7 f32 (840
    // bytes), so a budget of 300 bytes cuts them into 2 slices along the first axis.
    for slice_bytes in [usize::MAX, 300] {
        check_attention_core((FloatDType::F32, FloatDType::F32), f32_tol, slice_bytes);
        check_attention_core((FloatDType::F16, FloatDType::F32), 2e-3, slice_bytes);
        check_attention_core((FloatDType::F16, FloatDType::F16), 2e-3, slice_bytes);
    }
}

fn check_attention_core(
    (compute, out_dtype): (FloatDType, FloatDType),
    tol: f64,
    slice_bytes: usize,
) {
    let (bh, t, s, d, e) = (6, 5, 7, 4, 6);
    let device = gpu().autodiff();
    let mut next = lcg(97);
    let mut draw = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let (q, k, v, w) = (
        draw(bh * t * d),
        draw(bh * s * d),
        draw(bh * s * e),
        draw(bh * t * e),
    );
    let keep: Vec<f32> = (0..t * s)
        .map(|ij| if ij % s <= ij / s + 2 { 1.0 } else { 0.0 })
        .collect();
    let bias: Vec<f32> = (0..s).map(|j| (j % 3) as f32 * 0.25 - 0.25).collect();
    let (scale, fill) = (0.5f32, f32::MIN);
    let tensor = |v: &[f32], dims: &[usize]| {
        PhysTensor::from_data(
            TensorData::new(v.to_vec(), padded(dims).unwrap().to_vec()),
            &device,
        )
    };
    let tq = tensor(&q, &[2, 3, t, d]).require_grad();
    let tk = tensor(&k, &[2, 3, s, d]).require_grad();
    let tv = tensor(&v, &[2, 3, s, e]).require_grad();
    let kt = tk.clone().swap_dims(MAX_RANK - 2, MAX_RANK - 1);
    let out = kernels::attention_core(
        tq.clone(),
        kt,
        tv.clone(),
        tensor(&keep, &[1, 1, t, s]),
        tensor(&bias, &[1, 1, 1, s]),
        scale,
        fill,
        (compute, out_dtype),
        slice_bytes,
    );
    assert_eq!(
        out.dtype(),
        DType::from(out_dtype),
        "the output's precision"
    );
    // The output's gradient arrives in the output's precision.
    let w = rounded_to(&w, out_dtype)
        .iter()
        .map(|&x| x as f32)
        .collect::<Vec<_>>();
    let wt = tensor(&w, &[2, 3, t, e]).cast(out_dtype);
    let grads = (out.clone() * wt).sum().backward();
    let got = |x: Tensor<MAX_RANK>| {
        x.cast(FloatDType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    let out = got(out.inner());
    let (gq, gk, gv) = (
        got(tq.grad(&grads).unwrap()),
        got(tk.grad(&grads).unwrap()),
        got(tv.grad(&grads).unwrap()),
    );
    // The closed form, from the operands as the products read them.
    let (q, k, v) = (
        rounded_to(&q, compute),
        rounded_to(&k, compute),
        rounded_to(&v, compute),
    );
    let what = format!("attention core in {compute:?} to {out_dtype:?}, slices of {slice_bytes} B");
    let close = |name: &str, got: f32, want: f64, size: f64| {
        assert!(
            (f64::from(got) - want).abs() <= tol * size.max(1.0),
            "{what}: {name} {got} vs {want}"
        );
    };
    for b in 0..bh {
        let (qb, kb, vb) = (&q[b * t * d..], &k[b * s * d..], &v[b * s * e..]);
        let wb = &w[b * t * e..];
        let mut p = vec![0.0f64; t * s];
        for i in 0..t {
            let z: Vec<f64> = (0..s)
                .map(|j| {
                    let dot: f64 = (0..d).map(|l| qb[i * d + l] * kb[j * d + l]).sum();
                    let masked = if keep[i * s + j] != 0.0 {
                        dot * f64::from(scale)
                    } else {
                        f64::from(fill)
                    };
                    masked + f64::from(bias[j])
                })
                .collect();
            let max = z.iter().fold(f64::MIN, |m, &x| m.max(x));
            let sum: f64 = z.iter().map(|x| (x - max).exp()).sum();
            for j in 0..s {
                p[i * s + j] = (z[j] - max).exp() / sum;
            }
        }
        // out = p v; dv = p^T w; dp = w v^T; ds = keep * scale * p (dp - sum(dp p)).
        let mut ds = vec![0.0f64; t * s];
        for i in 0..t {
            for c in 0..e {
                let want: f64 = (0..s).map(|j| p[i * s + j] * vb[j * e + c]).sum();
                close("out", out[(b * t + i) * e + c], want, 1.0);
            }
            let dp: Vec<f64> = (0..s)
                .map(|j| {
                    (0..e)
                        .map(|c| f64::from(wb[i * e + c]) * vb[j * e + c])
                        .sum()
                })
                .collect();
            let dot: f64 = (0..s).map(|j| dp[j] * p[i * s + j]).sum();
            for j in 0..s {
                if keep[i * s + j] != 0.0 {
                    ds[i * s + j] = f64::from(scale) * p[i * s + j] * (dp[j] - dot);
                }
            }
        }
        for j in 0..s {
            for c in 0..e {
                let want: f64 = (0..t)
                    .map(|i| p[i * s + j] * f64::from(wb[i * e + c]))
                    .sum();
                close("dv", gv[(b * s + j) * e + c], want, 1.0);
            }
            for l in 0..d {
                let want: f64 = (0..t).map(|i| ds[i * s + j] * qb[i * d + l]).sum();
                close("dk", gk[(b * s + j) * d + l], want, 1.0);
            }
        }
        for i in 0..t {
            for l in 0..d {
                let want: f64 = (0..s).map(|j| ds[i * s + j] * kb[j * d + l]).sum();
                close("dq", gq[(b * t + i) * d + l], want, 1.0);
            }
        }
    }
}

/// `values` rounded to `compute` (f16 or bf16; f32 leaves them), in f64.
fn rounded_to(values: &[f32], compute: FloatDType) -> Vec<f64> {
    values
        .iter()
        .map(|&v| match compute {
            FloatDType::BF16 => half::bf16::from_f32(v).to_f64(),
            FloatDType::F16 => half::f16::from_f32(v).to_f64(),
            _ => f64::from(v),
        })
        .collect()
}

/// Per batch, `x [m, k] x y [k, n]` in f64 (`x_at(b, i, l)`, `y_at(b, l, j)`), and each
/// entry's `sum |x| |y|` (the scale of its rounding errors).
fn product_f64(
    (batch, m, k, n): (usize, usize, usize, usize),
    x_at: impl Fn(usize, usize, usize) -> f64,
    y_at: impl Fn(usize, usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut scale) = (Vec::new(), Vec::new());
    for b in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|l| (x_at(b, i, l), y_at(b, l, j)));
                out.push(terms.clone().map(|(x, y)| x * y).sum());
                scale.push(terms.map(|(x, y)| (x * y).abs()).sum());
            }
        }
    }
    (out, scale)
}

fn assert_within_scale(what: &str, got: &[f32], (want, scale): &(Vec<f64>, Vec<f64>), tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * s + 1e-12,
            "{what}[{i}]: {g} vs {w} (sum |x||y| {s})"
        );
    }
}

/// How a `[batch, rows, cols]` operand is stored: as it is, or with two of its logical
/// dimensions swapped in memory and swapped back as a view (`(1, 2)`: a transposed weight,
/// as Gemm's transB; `(0, 1)` or `(0, 2)`: batch strides between the matrix strides, as
/// attention heads cut out of a `[b, t, h * d]` projection).
type Stored = Option<(usize, usize)>;

/// The offset in the stored buffer of logical entry `i` of a `dims` operand.
fn stored_offset(dims: [usize; 3], stored: Stored, i: usize) -> usize {
    let mut at = [i / (dims[1] * dims[2]), i / dims[2] % dims[1], i % dims[2]];
    let mut sdims = dims;
    if let Some((p, q)) = stored {
        at.swap(p, q);
        sdims.swap(p, q);
    }
    (at[0] * sdims[1] + at[1]) * sdims[2] + at[2]
}

/// `values` (logical order) stored as `stored` says, on `device`, tracked, and the logical
/// view of it.
fn stored_operand(
    values: &[f32],
    dims: [usize; 3],
    stored: Stored,
    device: &Device,
) -> (PhysTensor, PhysTensor) {
    let mut buffer = vec![0.0; values.len()];
    for (i, &v) in values.iter().enumerate() {
        buffer[stored_offset(dims, stored, i)] = v;
    }
    let mut shape = vec![1; MAX_RANK];
    shape[MAX_RANK - 3..].copy_from_slice(&dims);
    if let Some((p, q)) = stored {
        shape.swap(MAX_RANK - 3 + p, MAX_RANK - 3 + q);
    }
    let t = PhysTensor::from_data(TensorData::new(buffer, shape), device).require_grad();
    let view = match stored {
        Some((p, q)) => t.clone().swap_dims(MAX_RANK - 3 + p, MAX_RANK - 3 + q),
        None => t.clone(),
    };
    (t, view)
}

/// A stored gradient read back in logical order.
fn logical(stored_values: &[f32], dims: [usize; 3], stored: Stored) -> Vec<f32> {
    (0..stored_values.len())
        .map(|i| stored_values[stored_offset(dims, stored, i)])
        .collect()
}

/// `a [batch, m, k] x b [batch, k, n]` on the GPU, each operand stored as its `Stored`
/// says, computed in `compute` (`kernels::matmul` for f32, `matmul_autocast` otherwise):
/// the result and both gradients against f64 products of the operands rounded to `compute`
/// (the gradient rounded too).
fn check_gpu_matmul(compute: FloatDType, dims: (usize, usize, usize, usize), stored: [Stored; 2]) {
    let (batch, m, k, n) = dims;
    let device = gpu().autodiff();
    let mut next = lcg(29);
    let mut values = |count: usize| -> Vec<f32> {
        (0..count)
            .map(|_| (next() % 20001) as f32 / 10000.0 - 1.0)
            .collect()
    };
    let (a, b, w) = (
        values(batch * m * k),
        values(batch * k * n),
        values(batch * m * n),
    );
    let (a_dims, b_dims) = ([batch, m, k], [batch, k, n]);
    let (ta, ta_view) = stored_operand(&a, a_dims, stored[0], &device);
    let (tb, tb_view) = stored_operand(&b, b_dims, stored[1], &device);
    let mut w_shape = vec![1; MAX_RANK];
    w_shape[MAX_RANK - 3..].copy_from_slice(&[batch, m, n]);
    let tw = PhysTensor::from_data(TensorData::new(w.clone(), w_shape), &device);
    let y = match compute {
        FloatDType::F32 => kernels::matmul(ta_view, tb_view),
        low => matmul_autocast(ta_view, tb_view, low, FloatDType::F32),
    };
    assert_eq!(y.dtype(), DType::F32, "the result is f32");
    let grads = (y.clone() * tw).sum().backward();
    let got = |t: Tensor<MAX_RANK>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let y = got(y.inner());
    let da = logical(
        &got(ta.grad(&grads).expect("a's gradient")),
        a_dims,
        stored[0],
    );
    let db = logical(
        &got(tb.grad(&grads).expect("b's gradient")),
        b_dims,
        stored[1],
    );
    let (ar, br, gr) = (
        rounded_to(&a, compute),
        rounded_to(&b, compute),
        rounded_to(&w, compute),
    );
    // f32 accumulation of the rounded operands; an f16 or bf16 rounding of the result
    // (2^-11, 2^-8 of it) is well outside. f32 products may run on TF32 tensor cores
    // (CUDA), whose 2^-11 operand rounding the wider bound allows; a misread layout is
    // off by the values themselves.
    let tol = if compute == FloatDType::F32 {
        2e-3
    } else {
        1e-5
    };
    let what = format!("{compute:?} {dims:?} stored {stored:?}");
    let want_y = product_f64(
        (batch, m, k, n),
        |t, i, l| ar[t * m * k + i * k + l],
        |t, l, j| br[t * k * n + l * n + j],
    );
    assert_within_scale(&format!("{what}: a x b"), &y, &want_y, tol);
    // dA = g B^T, [m, n] x [n, k].
    let want_da = product_f64(
        (batch, m, n, k),
        |t, i, l| gr[t * m * n + i * n + l],
        |t, l, j| br[t * k * n + j * n + l],
    );
    assert_within_scale(&format!("{what}: dA"), &da, &want_da, tol);
    // dB = A^T g, [k, m] x [m, n].
    let want_db = product_f64(
        (batch, k, m, n),
        |t, i, l| ar[t * m * k + l * k + i],
        |t, l, j| gr[t * m * n + l * n + j],
    );
    assert_within_scale(&format!("{what}: dB"), &db, &want_db, tol);
}

#[test]
fn gpu_matmul_writes_f32_products_of_rounded_operands_and_their_gradients_in_any_layout() {
    // f32, f16 (lavapipe computes it), and bf16 where the backend does (CUDA).
    let mut computes = vec![FloatDType::F32, FloatDType::F16];
    if matches!(gpu_spec(), DeviceSpec::Cuda(_)) {
        computes.push(FloatDType::BF16);
    }
    for compute in computes {
        check_gpu_matmul(compute, (6, 37, 70, 19), [None, None]);
        check_gpu_matmul(compute, (1, 64, 128, 96), [None, Some((1, 2))]);
        // Heads' layouts: batch strides between the matrix strides, copied once.
        check_gpu_matmul(compute, (4, 33, 16, 21), [Some((0, 1)), Some((0, 2))]);
    }
}

#[test]
fn fused_unscale_matches_and_flags_inf_and_nan_across_gradients() {
    let device = gpu();
    let values: Vec<f32> = (0..3000).map(|i| (i as f32 - 1500.0) * 0.37).collect();
    let grad =
        |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), vec![v.len()]), &device);
    let mut flag = NonFiniteFlag::new(&device);
    let out = unscale_and_check(grad(&values), 0.25, &mut flag);
    let mut host_flag = false;
    let want = unscale_and_check_reference(grad(&values), 0.25, &mut host_flag);
    assert_eq!(host(out), host(want), "x 0.25 is exact: bit-identical");
    assert!(!flag.raised().unwrap() && !host_flag);

    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let mut flag = NonFiniteFlag::new(&device);
        // A clean gradient, then one with a single bad value in its tail: the flag is shared.
        let _ = unscale_and_check(grad(&values), 0.5, &mut flag);
        let mut v = values.clone();
        v[2999] = bad;
        let _ = unscale_and_check(grad(&v), 0.5, &mut flag);
        assert!(flag.raised().unwrap(), "{bad} not flagged");
    }
}

#[test]
fn gpu_fused_adamw_matches_burns_adamw_and_their_records_interchange() {
    check(OptimizerKind::Adamw, gpu().autodiff(), Groups::Default);
}

#[test]
fn gpu_fused_adam_matches_burns_adam_and_their_records_interchange() {
    check(OptimizerKind::Adam, gpu().autodiff(), Groups::Default);
}

#[test]
fn gpu_fused_clipped_step_matches_burns_and_notices_a_replaced_value() {
    check_clipped_with_a_replaced_value(OptimizerKind::Adamw, gpu().autodiff(), Groups::Default);
    check_clipped_with_a_replaced_value(OptimizerKind::Lamb, gpu().autodiff(), Groups::Default);
}

#[test]
fn gpu_fused_update_writes_the_parameters_in_place_unless_held() {
    check_update_writes_in_place(OptimizerKind::Adamw, gpu().autodiff());
    check_update_writes_in_place(OptimizerKind::Lamb, gpu().autodiff());
}

#[test]
fn gpu_fused_update_divides_loss_scaled_gradients_and_skips_itself_on_overflow() {
    check_scaled_update_skips_on_overflow(OptimizerKind::Adamw, gpu().autodiff(), Groups::Default);
    check_scaled_update_skips_on_overflow(OptimizerKind::Adam, gpu().autodiff(), Groups::Default);
    check_scaled_update_skips_on_overflow(OptimizerKind::Lamb, gpu().autodiff(), Groups::Default);
}

#[test]
fn gpu_fused_lamb_matches_burns_lamb_and_their_records_interchange() {
    check(OptimizerKind::Lamb, gpu().autodiff(), Groups::Default);
}

/// The fused update with its flat buffers cut into many groups, as on a device that
/// allocates less at once than a model's parameters take (64 KiB: gpt2_tiny's larger
/// tensors each alone, its small ones together): Burn's optimizer's results, plain,
/// clipped (the norm summed over every group) and loss-scaled, and records that
/// interchange with Burn's.
#[test]
fn gpu_fused_update_in_groups_matches_burns() {
    let groups = Groups::Bytes(64 << 10);
    check(OptimizerKind::Adamw, gpu().autodiff(), groups);
    check(OptimizerKind::Lamb, gpu().autodiff(), groups);
    check_clipped_with_a_replaced_value(OptimizerKind::Adamw, gpu().autodiff(), groups);
    check_scaled_update_skips_on_overflow(OptimizerKind::Lamb, gpu().autodiff(), groups);
}

/// NCCL through the real library (CUDA only): a group of one, started without MPI, through
/// our communicator and through the CUDA runtime's own collectives.
#[cfg(feature = "cuda")]
mod nccl {
    use std::sync::Arc;
    use std::time::Duration;

    use burn::tensor::{Device, Tensor, TensorData};
    use burn_ort_dist::{
        Communicator, DeviceGroup, LocalCommunicator, NcclCommunicator, check_collectives,
        run_threads,
    };

    fn nccl() -> NcclCommunicator {
        NcclCommunicator::single(0).unwrap_or_else(|e| panic!("NCCL on GPU 0: {e}"))
    }

    /// Every collective of the self-test on device buffers (host values copied to the GPU,
    /// NCCL, copied back), and again on a sub-group split from the group.
    #[test]
    fn a_group_of_one_passes_every_collective_on_the_gpu() {
        let comm = nccl();
        assert_eq!((comm.rank(), comm.world_size()), (0, 1));
        check_collectives(&comm).unwrap();
        let sub = comm.split(0, 0).unwrap();
        assert_eq!(sub.world_size(), 1);
        check_collectives(sub.as_ref()).unwrap();
    }

    /// The device path: NCCL reduces, gathers and scatters Burn CUDA tensors where they
    /// live (a group of one: each is the tensor itself, through the real library, its
    /// output buffers allocated beside the input).
    #[test]
    fn nccl_moves_cuda_tensors_where_they_live() {
        let comm = nccl();
        let device = Device::cuda(0);
        let on_device = comm
            .device_collectives()
            .expect("NCCL moves device tensors");
        assert!(on_device.works_on(&device) && !on_device.works_on(&Device::flex()));
        check_device_collectives_of_one(on_device, &device);
    }

    /// Each device collective of a group of one gives its input back, read after a kernel
    /// that follows it.
    fn check_device_collectives_of_one(
        on_device: &dyn burn_ort_dist::DeviceCollectives,
        device: &Device,
    ) {
        use burn_ort_dist::ReduceOp;
        let values: Vec<f32> = (0..10_000).map(|i| (i as f32 * 0.37).sin()).collect();
        let t = || Tensor::<1>::from_data(TensorData::new(values.clone(), [values.len()]), device);
        let results = [
            ("all-reduce mean", on_device.all_reduce(t(), ReduceOp::Mean)),
            ("all-reduce sum", on_device.all_reduce(t(), ReduceOp::Sum)),
            ("all-gather", on_device.all_gather(t())),
            (
                "reduce-scatter",
                on_device.reduce_scatter(t(), ReduceOp::Sum),
            ),
        ];
        for (what, result) in results {
            let got = result
                .unwrap()
                .add_scalar(1.0)
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            let want: Vec<f32> = values.iter().map(|v| v + 1.0).collect();
            assert_eq!(got, want, "{what} over a group of one is the tensor itself");
        }
    }

    /// Thread ranks' path (`DeviceGroup`): the CUDA runtime's own NCCL averages a bucket
    /// on its communication stream, after the kernel that wrote it and before the kernel
    /// that reads the mean (events, no device sync): 16M values, so a collective that did
    /// not wait would read a bucket still being written.
    #[test]
    fn the_runtimes_nccl_averages_a_bucket_between_the_kernels_around_it() {
        let device = Device::cuda(0);
        let group = DeviceGroup::over(Arc::new(LocalCommunicator), &device).unwrap();
        let reduce = group
            .device_collectives()
            .expect("the CUDA runtime moves data between its devices (NCCL)");
        assert!(reduce.works_on(&device) && !reduce.works_on(&Device::flex()));
        check_device_collectives_of_one(reduce, &device);
        let n = 1 << 24;
        let values: Vec<f32> = (0..n).map(|i| ((i % 977) as f32 * 0.37).sin()).collect();
        let bucket = Tensor::<1>::from_data(TensorData::new(values.clone(), [n]), &device);
        let mean = reduce
            .all_reduce(bucket.mul_scalar(3.0), burn_ort_dist::ReduceOp::Mean)
            .unwrap();
        let got = mean
            .add_scalar(1.0)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        for (i, (g, v)) in got.iter().zip(&values).enumerate() {
            assert!(
                (g - (v * 3.0 + 1.0)).abs() < 1e-6,
                "value {i}: {g}, want {}",
                v * 3.0 + 1.0
            );
        }
    }

    /// Two thread ranks with a GPU each average on the devices, and a group split from
    /// theirs keeps the path. Needs a machine with two GPUs: the pack's
    /// `gpu-tests --ignored two_gpus` there.
    #[test]
    #[ignore = "needs two GPUs"]
    fn two_gpus_thread_ranks_average_on_the_devices() {
        let results = run_threads(2, Duration::from_secs(300), |comm| -> Result<(), String> {
            let rank = comm.rank();
            let device = Device::cuda(rank);
            let group = DeviceGroup::over(comm, &device).map_err(|e| e.to_string())?;
            let sub = group.split(0, rank).map_err(|e| e.to_string())?;
            for g in [group.as_ref(), sub.as_ref()] {
                let reduce = g.device_collectives().ok_or("no device all-reduce")?;
                let bucket = Tensor::<1>::full([1 << 20], (rank + 1) as f32, &device);
                let mean = reduce
                    .all_reduce(bucket, burn_ort_dist::ReduceOp::Mean)
                    .map_err(|e| e.to_string())?;
                let got = mean
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap();
                if got.iter().any(|&v| v != 1.5) {
                    return Err(format!("rank {rank}: the mean of 1 and 2 is not 1.5"));
                }
            }
            Ok(())
        });
        for r in results {
            r.unwrap();
        }
    }
}

/// Values `[rows, cols]` in [-1, 1) from a seeded generator.
fn uniform(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut next = lcg(seed);
    (0..rows * cols)
        .map(|_| (next() % 20_001) as f32 / 10_000.0 - 1.0)
        .collect()
}

fn matrix(v: &[f32], rows: usize, cols: usize, device: &Device) -> Tensor<2> {
    Tensor::<2>::from_data(TensorData::new(v.to_vec(), vec![rows, cols]), device)
}

/// `kernels::matmul` of `a [m, k]` and `b [k, n]` (`b` stored as `[n, k]` and transposed
/// when `b_transposed`, as a tied LM head's is) under autodiff: the product and the
/// gradients of `sum(product * r)` with respect to `a` and `b`.
fn product_and_gradients(
    device: &Device,
    (m, k, n): (usize, usize, usize),
    b_transposed: bool,
) -> [ndarray::ArrayD<f32>; 3] {
    let device = device.clone().autodiff();
    let lift = |t: Tensor<2>| t.unsqueeze::<MAX_RANK>();
    let a = lift(matrix(&uniform(m, k, 5), m, k, &device)).require_grad();
    let b = if b_transposed {
        lift(matrix(&uniform(n, k, 6), n, k, &device)).require_grad()
    } else {
        lift(matrix(&uniform(k, n, 6), k, n, &device)).require_grad()
    };
    let rhs = if b_transposed {
        b.clone().swap_dims(MAX_RANK - 2, MAX_RANK - 1)
    } else {
        b.clone()
    };
    let product = burn_onnx_train::kernels::matmul(a.clone(), rhs);
    let r = lift(matrix(&uniform(m, n, 7), m, n, &device));
    let grads = (product.clone() * r).sum().backward();
    let flat = |t: Tensor<MAX_RANK>| {
        let [.., rows, cols] = t.dims();
        host2(t.reshape([rows as i32, cols as i32]))
    };
    [
        flat(product.inner()),
        flat(a.grad(&grads).unwrap()),
        flat(b.grad(&grads).unwrap()),
    ]
}

/// Products whose column count is odd (an LM head over GPT-2's 50257 words: CubeCL's matmul
/// then reads and writes those rows without vectors) and one of a multiple of 8, through
/// `kernels::matmul` under autodiff: the product and both gradients against the CPU, for a
/// plain and a transposed (tied-embedding) right-hand side.
#[test]
fn products_with_odd_column_counts_and_their_gradients_match_the_cpu() {
    for (shape, b_transposed) in [
        ((48, 64, 1027), false),
        ((48, 64, 1027), true),
        ((33, 40, 2049), false),
        ((48, 64, 1024), false),
    ] {
        let got = product_and_gradients(&gpu(), shape, b_transposed);
        let want = product_and_gradients(&Device::flex(), shape, b_transposed);
        for ((what, g), w) in ["product", "grad a", "grad b"].iter().zip(&got).zip(&want) {
            let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0, "{what}: all zero");
            assert_close(
                &format!(
                    "{} {shape:?} (b transposed {b_transposed}): {what}",
                    gpu_spec()
                ),
                g,
                w,
                on_tf32(1e-5, 2e-3) * scale,
                0.0,
            );
        }
    }
}

#[test]
fn matmuls_of_every_layout_match_the_cpu_on_gpu() {
    // Each product against the CPU's f32, within 2e-3 of sum|a||b| per element: what TF32
    // (10-bit mantissa operands, f32 accumulation) can lose, which CUDA's tensor-core
    // kernels use for f32 as PyTorch does with `allow_tf32`. Operands come plain or as
    // transposed views (the layouts of Gemm's transA/transB and of the backward products).
    let (gpu_dev, cpu_dev) = (gpu(), Device::flex());
    let mut failures = Vec::new();
    for (m, k, n) in [
        (32, 784, 256),
        (32, 256, 10),
        (256, 32, 784),
        (10, 32, 256),
        (37, 1000, 3),
        (200, 300, 500),
        (1, 64, 64),
        (64, 64, 64),
    ] {
        let (a, b) = (uniform(m, k, 1), uniform(k, n, 2));
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            // A transposed view holds the same matrix: built as [k, m] then transposed.
            let operand = |v: &[f32], r: usize, c: usize, t: bool, d: &Device| {
                if t {
                    let mut vt = vec![0.0; r * c];
                    for i in 0..r {
                        for j in 0..c {
                            vt[j * r + i] = v[i * c + j];
                        }
                    }
                    matrix(&vt, c, r, d).transpose()
                } else {
                    matrix(v, r, c, d)
                }
            };
            let product =
                |d: &Device| host2(operand(&a, m, k, ta, d).matmul(operand(&b, k, n, tb, d)));
            // The interpreter's values have the physical rank (leading 1s): the batched form.
            let product6 = |d: &Device| {
                let lift = |t: Tensor<2>| t.unsqueeze::<MAX_RANK>();
                let p = lift(operand(&a, m, k, ta, d)).matmul(lift(operand(&b, k, n, tb, d)));
                host2(p.reshape([m as i32, n as i32]))
            };
            let (got, want) = (product(&gpu_dev), product(&cpu_dev));

            let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
            let scale =
                host2(matrix(&abs(&a), m, k, &cpu_dev).matmul(matrix(&abs(&b), k, n, &cpu_dev)));
            for (form, got) in [("rank 2", got), ("physical rank", product6(&gpu_dev))] {
                let worst = got
                    .iter()
                    .zip(&want)
                    .zip(&scale)
                    .enumerate()
                    .map(|(i, ((g, w), s))| ((g - w).abs() / s.max(1e-6), i))
                    .fold(
                        (0.0f32, 0),
                        |a, x| if x.0 > a.0 || x.0.is_nan() { x } else { a },
                    );
                eprintln!(
                    "{form} {m}x{k} . {k}x{n} (lhs transposed {ta}, rhs transposed {tb}): \
                     worst error {:.2e} of sum|a||b| at {}",
                    worst.0, worst.1
                );
                if !(worst.0 <= 2e-3) {
                    failures.push(format!(
                        "{form} {m}x{k}x{n} ta={ta} tb={tb}: {:.2e}",
                        worst.0
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "matmuls off on {}: {failures:#?}",
        gpu_spec()
    );
}

/// `offload_optimizer = "cpu"` (and `"disk"`) on a GPU device: the update runs on the CPU
/// against master parameters kept on the host. One update of the MLP through
/// `FusedAdam::on_host` leaves every parameter on the GPU, within 1e-6 of the update on the
/// device; and whole AdamW runs of gpt2_tiny with the moments in host memory and in a file
/// end where the on-device run ends, the two offloaded runs within 1e-4 of each other on
/// wgpu (the same host arithmetic; not bit for bit, because the GPU's backward is not
/// bit-reproducible from run to run and Adam amplifies its rounding noise; on CUDA within
/// Adam's noise bound), as does the offloaded run resumed from its checkpoint at update 3
/// (the master copy read again from the loaded model).
#[test]
fn moments_offloaded_from_the_gpu_update_on_the_host_and_the_model_stays_on_the_gpu() {
    use burn::optim::GradientsParams;
    use burn_ort_dist::ReplicaOptimizer;
    use burn_ort_dist::update::zero::flat_optim::Rule;

    let device = gpu().autodiff();
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let x = Value::from_host(
        &burn_onnx_train::value::host_tensor::HostTensor::Float(npy_f32(refkit(
            "inference/mlp/input.npy",
        ))),
        &device,
    )
    .unwrap();
    let grads = || {
        let out = model
            .forward(vec![("input".into(), x.clone())], Mode::Train)
            .unwrap();
        let Some(Value::Float(y)) = out.first().cloned() else {
            panic!("a float output")
        };
        let loss = y.tensor.powf_scalar(2.0).mean();
        GradientsParams::from_grads(loss.backward(), &model)
    };
    let rule = Rule::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
    };
    let fused = || burn_onnx_train::kernels::FusedAdam::new(rule, Default::default()).unwrap();
    let on_device = fused().step(1e-2, model.clone(), grads()).unwrap();
    let on_host = fused()
        .on_host()
        .step(1e-2, model.clone(), grads())
        .unwrap();
    let mut moved = 0.0f32;
    for (i, info) in model.param_infos().iter().enumerate() {
        let p = &on_host.params()[i];
        assert_eq!(p.val().device(), device, "{}: left the GPU", info.name);
        let (a, b) = (
            on_host.param_value(i).unwrap().to_array().unwrap(),
            on_device.param_value(i).unwrap().to_array().unwrap(),
        );
        assert!(
            max_abs_diff(&a, &b) < 1e-6,
            "{}: {}",
            info.name,
            max_abs_diff(&a, &b)
        );
        moved = moved.max(max_abs_diff(
            &a,
            &model.param_value(i).unwrap().to_array().unwrap(),
        ));
    }
    assert!(moved > 1e-3, "the update moved nothing ({moved})");

    let run = |tag: &str, offload: OffloadTarget, resume: Option<&Path>| {
        let out = tempdir(tag);
        let mut c = gpt2_config(&out);
        c.parallel.device = gpu_spec();
        c.train.num_train_steps = 6;
        c.checkpoint.checkpoint_period = 3;
        c.checkpoint.checkpoint_to_load_path = resume.map(|r| r.join("checkpoints/ckpt-000000003"));
        c.offload.offload_optimizer = offload;
        launch(c, gpt2_tokens(), None).unwrap();
        out
    };
    let model = |out: &Path| out.join("gpt2_tiny_trained.onnx");
    let plain = model(&run("gpu-offload-none", OffloadTarget::None, None));
    let host_run = run("gpu-offload-cpu", OffloadTarget::Cpu, None);
    let host = model(&host_run);
    let disk = model(&run("gpu-offload-disk", OffloadTarget::Disk, None));
    // The master parameters on the host are read again from the resumed model.
    let resumed = model(&run(
        "gpu-offload-cpu-resumed",
        OffloadTarget::Cpu,
        Some(&host_run),
    ));
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &host, 1e-3);
    assert_same_params(
        "moments on the host vs on the GPU",
        &host,
        &plain,
        on_tf32(1e-4, ADAM_NOISE_BOUND),
    );
    // Separate GPU runs: the backward is not reproducible from run to run (on CUDA TF32
    // and atomics), and Adam turns a gradient's rounding noise into up to lr of update
    // (seen: one wte element 9.5e-6 apart on an H100, one bias element 1.6e-6 apart on
    // lavapipe under the whole suite's load). 1e-4 still catches moments that are lost
    // or stale (an update off by ~lr = 1e-3 in every element).
    let same_arithmetic = on_tf32(1e-4, ADAM_NOISE_BOUND);
    assert_same_params(
        "moments in a file vs on the host",
        &disk,
        &host,
        same_arithmetic,
    );
    assert_same_params(
        "resumed at update 3 vs not stopped",
        &resumed,
        &host,
        same_arithmetic,
    );
}

/// The pipeline's wire on the GPU: values cross in their shapes over the thread group
/// (which hands GPU tensors over itself) and over `ThroughHost`'s device channel
/// (`common::wire_checks`).
#[test]
fn gpu_values_cross_the_pipeline_wire_over_both_groups() {
    common::wire_checks::values_cross_the_pipeline_wire_on_both_paths(&gpu().autodiff());
}

/// ZeRO's update on the device: burn-ort-dist's checks (stages 1-3, SGD/Adam/AdamW/LAMB
/// against Burn's optimizers, a checkpoint of the device state resuming), on the GPU.
#[path = "../../burn-ort-dist/tests/integration/zero_on_device.rs"]
mod zero_on_device;

/// The device `zero_on_device` runs on.
fn zero_device() -> Device {
    gpu()
}
