//! Tensor parallelism: the planner finds Megatron's blocks in gpt2_tiny (TorchScript
//! export, Gemm with fused Q/K/V), our builder's GPT-2 (MatMul + Add) and a dynamo export
//! (opset 18); on 2 and 4 thread ranks the logits and the gradients of every parameter
//! (each rank's part of the split ones) equal the single-process model's; a graph without
//! a block is an error that says so.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::tensor::Device;
use burn_onnx_train::builders::gpt2::{Gpt2Config, write_gpt2};
use burn_onnx_train::loss::lm_cross_entropy;
use burn_onnx_train::tensor_parallel::{AxisSplit, TensorParallel, collective};
use burn_onnx_train::{Mode, OnnxModel, Value};
use burn_ort_dist::run_threads;
use common::*;
use ndarray::{ArrayD, IxDyn};

fn ids(vocab: u64) -> ArrayD<i64> {
    let mut next = lcg(3);
    ArrayD::from_shape_vec(IxDyn(&[2, 16]), (0..32).map(|_| (next() % vocab) as i64).collect()).unwrap()
}

fn builder_gpt2(tag: &str) -> PathBuf {
    let path = tempdir(tag).join("gpt2.onnx");
    write_gpt2(&Gpt2Config { n_layer: 2, n_head: 4, n_embd: 32, vocab_size: 97, n_positions: 32, ..Default::default() }, &path).unwrap();
    path
}

fn sample(ids: &ArrayD<i64>) -> Vec<(String, Value)> {
    vec![("input_ids".into(), Value::Int(ids.clone()))]
}

/// Logits and `(name, gradient)` of every trainable parameter.
fn logits_and_grads(model: &OnnxModel, ids: &ArrayD<i64>) -> (ArrayD<f32>, Vec<(String, ArrayD<f32>)>) {
    let out = model.forward(sample(ids), Mode::Train).unwrap();
    let Some(Value::Float(logits)) = out.get("logits").cloned() else { panic!("no logits") };
    let loss = lm_cross_entropy(logits.clone(), ids).unwrap();
    let grads = loss.backward();
    let named = model.param_grads(&grads).into_iter().map(|(n, g)| (n, g.to_array().unwrap())).collect();
    (logits.to_array().unwrap(), named)
}

fn splits_of(path: &Path, tp: usize, ids: &ArrayD<i64>) -> TensorParallel {
    let model = OnnxModel::load(path, &Device::flex()).unwrap();
    TensorParallel::apply(model, sample(ids), 0, tp, false).unwrap_or_else(|e| panic!("{}: {e}", path.display())).1
}

#[test]
fn finds_the_blocks_of_three_exporters() {
    let x = ids(97);
    // gpt2_tiny: TorchScript export of HF GPT-2 (Conv1D as Gemm, fused q/k/v + Split).
    let t = splits_of(&refkit("models/gpt2_tiny.onnx"), 2, &x);
    assert_eq!(t.blocks.len(), 4, "attention and MLP of 2 layers: {:?}", t.blocks);
    assert_eq!(t.params["m.transformer.h.0.attn.c_attn.weight"], AxisSplit { axis: 1, period: 128 }, "q, k, v each split by heads");
    assert_eq!(t.params["m.transformer.h.0.attn.c_attn.bias"], AxisSplit { axis: 0, period: 128 });
    assert_eq!(t.params["m.transformer.h.1.mlp.c_fc.weight"], AxisSplit { axis: 1, period: 512 });
    assert_eq!(t.params["m.transformer.h.1.mlp.c_proj.weight"], AxisSplit { axis: 0, period: 512 });
    assert_eq!(t.params["m.transformer.h.0.attn.c_proj.weight"], AxisSplit { axis: 0, period: 128 });
    assert!(!t.params.contains_key("m.transformer.h.0.attn.c_proj.bias"), "the row-parallel bias stays whole");
    assert!(!t.params.keys().any(|k| k.contains("wte") || k.contains("ln_")), "{:?}", t.params.keys());
    // Our builder: MatMul + Add.
    let b = splits_of(&builder_gpt2("tp-plan-builder"), 2, &x);
    assert_eq!(b.blocks.len(), 4, "{:?}", b.blocks);
    assert_eq!(b.params.len(), 4 * 2 + 2 * 2, "column weights and biases, row weights: {:?}", b.params.keys());
    // Dynamo (opset 18).
    let d = splits_of(&data("dynamo_gpt2/gpt2_tied.onnx"), 2, &x);
    assert!(d.blocks.len() >= 2, "{:?}", d.blocks);
}

#[test]
fn a_graph_without_blocks_is_an_error() {
    let model = OnnxModel::load(refkit("models/squeezenet1_1.onnx"), &Device::flex()).unwrap();
    let x = burn_onnx_train::model::float_input(vec![0.1; 3 * 224 * 224], &[1, 3, 224, 224], &Device::flex()).unwrap();
    let name = model.graph().inputs[0].name.clone();
    let err = TensorParallel::apply(model, vec![(name, x)], 0, 2, false).err().expect("no block in a CNN").to_string();
    assert!(err.contains("no Megatron block") && err.contains("squeezenet1_1.onnx"), "{err}");
}

/// On `tp` thread ranks: logits equal the whole model's, and every gradient equals the
/// whole model's (for split parameters, this rank's part of it).
fn check_equivalence(path: &Path, tp: usize, vocab: u64) {
    let x = ids(vocab);
    let whole = OnnxModel::load(path, &Device::flex().autodiff()).unwrap();
    let (want_logits, want_grads) = logits_and_grads(&whole, &x);
    let results = run_threads(tp, Duration::from_secs(120), |comm| -> Result<(), String> {
        let rank = comm.rank();
        let model = OnnxModel::load(path, &Device::flex().autodiff()).map_err(|e| e.to_string())?;
        let (model, t) = TensorParallel::apply(model, sample(&x), rank, tp, false).map_err(|e| e.to_string())?;
        let _group = collective::enter(comm.clone());
        let (logits, grads) = logits_and_grads(&model, &x);
        assert_close(&format!("rank {rank} logits"), &logits, &want_logits, 2e-5, 1e-5);
        assert_eq!(grads.len(), want_grads.len());
        for ((name, got), (_, want)) in grads.iter().zip(&want_grads) {
            let want = match t.params.get(name) {
                Some(split) => split.slice(want, rank, tp),
                None => want.clone(),
            };
            assert_close(&format!("rank {rank} gradient of {name}"), got, &want, 2e-5, 1e-4);
        }
        Ok(())
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn gpt2_tiny_two_and_four_ranks_match_one_process() {
    check_equivalence(&refkit("models/gpt2_tiny.onnx"), 2, 1024);
    check_equivalence(&refkit("models/gpt2_tiny.onnx"), 4, 1024);
}

#[test]
fn builder_and_dynamo_gpt2_two_ranks_match_one_process() {
    check_equivalence(&builder_gpt2("tp-eq-builder"), 2, 97);
    check_equivalence(&builder_gpt2("tp-eq-builder4"), 4, 97);
    check_equivalence(&data("dynamo_gpt2/gpt2_tied.onnx"), 2, 97);
}
