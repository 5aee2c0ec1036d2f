//! The GPT-2 builder (`builders::gpt2`): the built model loads in our importer with Hugging
//! Face parameter names and one tied embedding; its logits match an independent f64
//! implementation of GPT-2 written here from the initializer values (as built, and with
//! larger random weights so that every part of the graph matters); attention is causal;
//! bad configs are errors naming the field; a seed gives the same file; the initialization
//! follows GPT-2; onnxruntime (when `ONNX_TRAIN_PYTHON` is set) agrees with our importer.

use super::common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use burn_onnx_train::frontend::builders::gpt2::{
    Gpt2Config, IR_VERSION, OPSET, PRODUCER_NAME, build_gpt2, write_gpt2,
};
use burn_onnx_train::graph::Dim;
use burn_onnx_train::train::data::npy::write_npy;
use burn_onnx_train::{Graph, Mode, OnnxModel, ParamRole, Value};
use common::*;
use ndarray::{ArrayD, IxDyn, s};
use onnx_ir::{Message, ModelProto};

/// The tiny config of the reference comparison.
fn tiny() -> Gpt2Config {
    Gpt2Config {
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        vocab_size: 11,
        n_positions: 16,
        layer_norm_epsilon: 1e-5,
        seed: 7,
        separate_qkv: false,
    }
}

/// A small multi-layer config.
fn small() -> Gpt2Config {
    Gpt2Config {
        n_layer: 2,
        n_head: 4,
        n_embd: 16,
        vocab_size: 37,
        n_positions: 12,
        layer_norm_epsilon: 1e-5,
        seed: 3,
        separate_qkv: false,
    }
}

fn load(model: ModelProto) -> OnnxModel {
    OnnxModel::from_graph(Graph::from_proto(model, None).unwrap(), &eval_device()).unwrap()
}

fn logits(model: &OnnxModel, ids: &ArrayD<i64>) -> ArrayD<f32> {
    let out = model
        .forward(
            vec![("input_ids".into(), Value::Int(ids.clone()))],
            Mode::Eval,
        )
        .unwrap();
    let Some(Value::Float(l)) = out.get("logits") else {
        panic!("no float output `logits`")
    };
    l.to_array().unwrap()
}

/// Token ids of shape `[batch, seq]`, spread over the vocabulary.
fn token_ids(batch: usize, seq: usize, vocab: usize) -> ArrayD<i64> {
    let v: Vec<i64> = (0..batch * seq)
        .map(|i| ((i * 7 + 3 * (i / seq) + 1) % vocab) as i64)
        .collect();
    ArrayD::from_shape_vec(IxDyn(&[batch, seq]), v).unwrap()
}

/// Every initializer, decoded from its little-endian f32 `raw_data`.
fn weights(model: &ModelProto) -> HashMap<String, Vec<f64>> {
    model
        .graph
        .initializer
        .iter()
        .map(|t| {
            assert_eq!(t.data_type, 1, "{} should be float32", t.name);
            let v = t
                .raw_data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                .collect();
            (t.name.clone(), v)
        })
        .collect()
}

/// Replace every weight by uniform noise (LayerNorm gammas around 1) of a size that makes
/// attention scores, the mask and the GELU curvature visible in the logits.
fn perturb(model: &mut ModelProto, seed: u64) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    for t in &mut model.graph.mut_or_insert_default().initializer {
        let gamma = t.name.contains(".ln_") && t.name.ends_with(".weight");
        let n = t.raw_data.len() / 4;
        let values: Vec<f32> = (0..n)
            .map(|_| {
                if gamma {
                    1.0 + 0.5 * uniform()
                } else {
                    0.8 * uniform()
                }
            })
            .collect();
        t.raw_data = values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>()
            .into();
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn add_rows(h: &mut [Vec<f64>], delta: &[Vec<f64>]) {
    for (row, d) in h.iter_mut().zip(delta) {
        row.iter_mut().zip(d).for_each(|(x, y)| *x += y);
    }
}

fn softmax(x: &[f64]) -> Vec<f64> {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}

/// GPT-2 (Hugging Face `GPT2LMHeadModel`) in plain f64 loops over the initializers.
struct Reference<'a> {
    cfg: &'a Gpt2Config,
    w: HashMap<String, Vec<f64>>,
}

impl Reference<'_> {
    fn w(&self, name: &str) -> &[f64] {
        self.w
            .get(name)
            .unwrap_or_else(|| panic!("no initializer {name}"))
    }

    fn logits(&self, ids: &ArrayD<i64>) -> ArrayD<f32> {
        let (batch, seq) = (ids.shape()[0], ids.shape()[1]);
        let mut out = Vec::new();
        for row in ids.outer_iter() {
            let tokens: Vec<usize> = row.iter().map(|&t| t as usize).collect();
            for h in self.hidden(&tokens) {
                out.extend(self.head(&h).into_iter().map(|v| v as f32));
            }
        }
        ArrayD::from_shape_vec(IxDyn(&[batch, seq, self.cfg.vocab_size]), out).unwrap()
    }

    /// Final hidden states (after `ln_f`) of one sequence.
    fn hidden(&self, tokens: &[usize]) -> Vec<Vec<f64>> {
        let e = self.cfg.n_embd;
        let (wte, wpe) = (
            self.w("transformer.wte.weight"),
            self.w("transformer.wpe.weight"),
        );
        let mut h: Vec<Vec<f64>> = tokens
            .iter()
            .enumerate()
            .map(|(t, &id)| (0..e).map(|j| wte[id * e + j] + wpe[t * e + j]).collect())
            .collect();
        for layer in 0..self.cfg.n_layer {
            let p = format!("transformer.h.{layer}");
            let x: Vec<Vec<f64>> = h
                .iter()
                .map(|r| self.layer_norm(r, &format!("{p}.ln_1")))
                .collect();
            add_rows(&mut h, &self.attention(&x, &p));
            let x: Vec<Vec<f64>> = h
                .iter()
                .map(|r| self.layer_norm(r, &format!("{p}.ln_2")))
                .collect();
            let m: Vec<Vec<f64>> = x.iter().map(|r| self.mlp(r, &p)).collect();
            add_rows(&mut h, &m);
        }
        h.iter()
            .map(|r| self.layer_norm(r, "transformer.ln_f"))
            .collect()
    }

    fn layer_norm(&self, x: &[f64], prefix: &str) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + self.cfg.layer_norm_epsilon as f64).sqrt();
        let (g, b) = (
            self.w(&format!("{prefix}.weight")),
            self.w(&format!("{prefix}.bias")),
        );
        x.iter()
            .enumerate()
            .map(|(i, v)| (v - mean) * inv * g[i] + b[i])
            .collect()
    }

    /// HF `Conv1D`: `x @ W + b`, `W` stored `[n_in, n_out]` row-major.
    fn conv1d(&self, x: &[f64], prefix: &str) -> Vec<f64> {
        let (w, b) = (
            self.w(&format!("{prefix}.weight")),
            self.w(&format!("{prefix}.bias")),
        );
        let n_out = b.len();
        (0..n_out)
            .map(|o| {
                b[o] + x
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * w[i * n_out + o])
                    .sum::<f64>()
            })
            .collect()
    }

    /// Causal attention: position `t` attends to positions `0..=t` only.
    fn attention(&self, x: &[Vec<f64>], prefix: &str) -> Vec<Vec<f64>> {
        let (e, d) = (self.cfg.n_embd, self.cfg.n_embd / self.cfg.n_head);
        let qkv: Vec<Vec<f64>> = x
            .iter()
            .map(|r| self.conv1d(r, &format!("{prefix}.attn.c_attn")))
            .collect();
        let mut context = vec![vec![0.0; e]; x.len()];
        for head in 0..self.cfg.n_head {
            let cols = |part: usize| part * e + head * d..part * e + (head + 1) * d;
            for t in 0..x.len() {
                let q = &qkv[t][cols(0)];
                let scores: Vec<f64> = (0..=t)
                    .map(|u| dot(q, &qkv[u][cols(1)]) / (d as f64).sqrt())
                    .collect();
                for (u, p) in softmax(&scores).iter().enumerate() {
                    for (c, v) in context[t][head * d..(head + 1) * d]
                        .iter_mut()
                        .zip(&qkv[u][cols(2)])
                    {
                        *c += p * v;
                    }
                }
            }
        }
        context
            .iter()
            .map(|r| self.conv1d(r, &format!("{prefix}.attn.c_proj")))
            .collect()
    }

    fn mlp(&self, x: &[f64], prefix: &str) -> Vec<f64> {
        let hidden: Vec<f64> = self
            .conv1d(x, &format!("{prefix}.mlp.c_fc"))
            .into_iter()
            .map(gelu_tanh)
            .collect();
        self.conv1d(&hidden, &format!("{prefix}.mlp.c_proj"))
    }

    /// Tied LM head: one logit per vocabulary row of `wte`.
    fn head(&self, h: &[f64]) -> Vec<f64> {
        self.w("transformer.wte.weight")
            .chunks_exact(self.cfg.n_embd)
            .map(|row| dot(h, row))
            .collect()
    }
}

/// Our importer's logits against the f64 reference on the same `ModelProto`.
fn check_against_reference(what: &str, cfg: &Gpt2Config, model: ModelProto) {
    let ids = token_ids(2, 5, cfg.vocab_size);
    let want = Reference {
        cfg,
        w: weights(&model),
    }
    .logits(&ids);
    let got = logits(&load(model), &ids);
    assert_close(what, &got, &want, 1e-4, 0.0);
    let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!(
        "{what}: max |ours - reference| = {:.3e}, max |logit| = {largest:.3}",
        max_abs_diff(&got, &want)
    );
}

fn expected_params(cfg: &Gpt2Config) -> Vec<(String, Vec<usize>)> {
    let e = cfg.n_embd;
    let mut out = vec![
        (
            "transformer.wte.weight".to_string(),
            vec![cfg.vocab_size, e],
        ),
        (
            "transformer.wpe.weight".to_string(),
            vec![cfg.n_positions, e],
        ),
    ];
    for i in 0..cfg.n_layer {
        let layer = [
            ("ln_1.weight", vec![e]),
            ("ln_1.bias", vec![e]),
            ("attn.c_attn.weight", vec![e, 3 * e]),
            ("attn.c_attn.bias", vec![3 * e]),
            ("attn.c_proj.weight", vec![e, e]),
            ("attn.c_proj.bias", vec![e]),
            ("ln_2.weight", vec![e]),
            ("ln_2.bias", vec![e]),
            ("mlp.c_fc.weight", vec![e, 4 * e]),
            ("mlp.c_fc.bias", vec![4 * e]),
            ("mlp.c_proj.weight", vec![4 * e, e]),
            ("mlp.c_proj.bias", vec![e]),
        ];
        out.extend(
            layer
                .into_iter()
                .map(|(n, s)| (format!("transformer.h.{i}.{n}"), s)),
        );
    }
    out.push(("transformer.ln_f.weight".into(), vec![e]));
    out.push(("transformer.ln_f.bias".into(), vec![e]));
    out
}

#[test]
fn default_model_loads_with_hf_parameter_names_and_one_tied_embedding() {
    let cfg = Gpt2Config::default();
    let proto = build_gpt2(&cfg).unwrap();
    assert_eq!(
        (proto.ir_version, proto.producer_name.as_str()),
        (IR_VERSION, PRODUCER_NAME)
    );
    let graph = Graph::from_proto(proto.clone(), None).unwrap();
    assert_eq!(graph.opset, OPSET);
    let sym = |s: &str| Dim::Symbolic(s.into());
    assert_eq!(graph.inputs.len(), 1);
    assert_eq!(
        (graph.inputs[0].name.as_str(), graph.inputs[0].elem_type),
        ("input_ids", 7)
    );
    assert_eq!(graph.inputs[0].dims, vec![sym("batch"), sym("seq")]);
    assert_eq!(graph.outputs.len(), 1);
    assert_eq!(
        (graph.outputs[0].name.as_str(), graph.outputs[0].elem_type),
        ("logits", 1)
    );
    assert_eq!(
        graph.outputs[0].dims,
        vec![sym("batch"), sym("seq"), Dim::Fixed(50257)]
    );

    let model = OnnxModel::from_graph(graph, &eval_device()).unwrap();
    let got: Vec<(String, Vec<usize>)> = model
        .param_infos()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    let want = expected_params(&cfg);
    assert_eq!(want.len(), 12 * cfg.n_layer + 4);
    assert_eq!(
        got, want,
        "parameters: HF names and shapes, no separate lm_head"
    );
    assert!(
        model
            .param_infos()
            .iter()
            .all(|p| p.role == ParamRole::Trainable)
    );
    assert_eq!(
        proto.graph.initializer.len(),
        want.len(),
        "every initializer is a weight"
    );

    // The head reads wte through a Transpose, and wte has no other reader than the embedding.
    let nodes = &proto.graph.node;
    let readers: Vec<&str> = nodes
        .iter()
        .filter(|n| n.input.iter().any(|i| i == "transformer.wte.weight"))
        .map(|n| n.op_type.as_str())
        .collect();
    assert_eq!(readers, ["Gather", "Transpose"]);
    let head = nodes.iter().find(|n| n.output == ["logits"]).unwrap();
    assert_eq!(head.op_type, "MatMul");
    let transpose = nodes
        .iter()
        .find(|n| n.output.contains(&head.input[1]))
        .unwrap();
    assert_eq!(transpose.op_type, "Transpose");
    assert_eq!(transpose.input, ["transformer.wte.weight"]);

    let ids = token_ids(1, 4, cfg.vocab_size);
    let out = logits(&model, &ids);
    assert_eq!(out.shape(), [1, 4, 50257]);
    assert!(out.iter().all(|v| v.is_finite()));
    eprintln!(
        "op counts: {:?}",
        Graph::from_proto(proto, None).unwrap().op_counts()
    );
}

#[test]
fn logits_match_an_independent_f64_reference() {
    let cfg = tiny();
    check_against_reference("tiny, as built", &cfg, build_gpt2(&cfg).unwrap());
    let mut perturbed = build_gpt2(&cfg).unwrap();
    perturb(&mut perturbed, 1);
    check_against_reference("tiny, large random weights", &cfg, perturbed);
    let cfg = small();
    let mut perturbed = build_gpt2(&cfg).unwrap();
    perturb(&mut perturbed, 2);
    check_against_reference("2 layers, 4 heads, large random weights", &cfg, perturbed);
}

#[test]
fn changing_a_later_token_leaves_earlier_logits_unchanged() {
    let cfg = tiny();
    let mut proto = build_gpt2(&cfg).unwrap();
    perturb(&mut proto, 5);
    let model = load(proto);
    let ids = token_ids(2, 6, cfg.vocab_size);
    let mut changed = ids.clone();
    changed
        .slice_mut(s![.., 3])
        .mapv_inplace(|t| (t + 4) % cfg.vocab_size as i64);
    let (a, b) = (logits(&model, &ids), logits(&model, &changed));
    let before = |x: &ArrayD<f32>| x.slice(s![.., ..3, ..]).to_owned().into_dyn();
    let after = |x: &ArrayD<f32>| x.slice(s![.., 3.., ..]).to_owned().into_dyn();
    assert_close(
        "positions before the change",
        &before(&b),
        &before(&a),
        1e-6,
        0.0,
    );
    for t in 3..6 {
        let diff = max_abs_diff(
            &a.slice(s![.., t, ..]).to_owned().into_dyn(),
            &b.slice(s![.., t, ..]).to_owned().into_dyn(),
        );
        assert!(
            diff > 1e-3,
            "position {t} should see the changed token (diff {diff})"
        );
    }
    assert!(max_abs_diff(&after(&a), &after(&b)) > 1e-2);
}

#[test]
fn config_validation_names_the_field() {
    assert!(Gpt2Config::default().validate().is_ok());
    let cases: [(fn(&mut Gpt2Config), &str); 7] = [
        (|c| c.n_layer = 0, "gpt2.n_layer"),
        (|c| c.n_head = 0, "gpt2.n_head"),
        (|c| c.n_head = 3, "gpt2.n_head"),
        (|c| c.n_embd = 0, "gpt2.n_embd"),
        (|c| c.vocab_size = 0, "gpt2.vocab_size"),
        (|c| c.n_positions = 0, "gpt2.n_positions"),
        (
            |c| c.layer_norm_epsilon = f32::NAN,
            "gpt2.layer_norm_epsilon",
        ),
    ];
    for (mutate, field) in cases {
        let mut cfg = tiny();
        mutate(&mut cfg);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{field}:")),
            "expected an error on {field}, got: {err}"
        );
        let build_err = build_gpt2(&cfg).unwrap_err().to_string();
        assert_eq!(build_err, err, "build_gpt2 validates first");
    }
    let mut cfg = tiny();
    cfg.layer_norm_epsilon = 0.0;
    assert!(
        cfg.validate()
            .unwrap_err()
            .to_string()
            .starts_with("gpt2.layer_norm_epsilon:")
    );
    let json = serde_json::to_string(&Gpt2Config::default()).unwrap();
    assert_eq!(
        serde_json::from_str::<Gpt2Config>(&json).unwrap(),
        Gpt2Config::default()
    );
}

#[test]
fn a_seed_gives_the_same_file_and_write_gpt2_writes_it() {
    let cfg = small();
    let bytes = build_gpt2(&cfg).unwrap().write_to_bytes().unwrap();
    assert_eq!(
        build_gpt2(&cfg).unwrap().write_to_bytes().unwrap(),
        bytes,
        "same seed, same bytes"
    );
    let other = build_gpt2(&Gpt2Config {
        seed: cfg.seed + 1,
        ..cfg.clone()
    })
    .unwrap();
    assert_ne!(
        weights(&other)["transformer.wte.weight"],
        weights(&build_gpt2(&cfg).unwrap())["transformer.wte.weight"]
    );

    let dir = tempdir("gpt2-builder-write");
    let path = dir.join("gpt2.onnx");
    write_gpt2(&cfg, &path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    let loaded = OnnxModel::load(&path, &eval_device()).unwrap();
    assert_eq!(loaded.param_infos().len(), 12 * cfg.n_layer + 4);
    let err = write_gpt2(&Gpt2Config { n_head: 5, ..cfg }, &dir.join("bad.onnx")).unwrap_err();
    assert!(err.to_string().starts_with("gpt2.n_head:"));
    assert!(!dir.join("bad.onnx").exists());
    std::fs::remove_dir_all(dir).ok();
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (
        mean,
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt(),
    )
}

#[test]
fn initialization_follows_gpt2() {
    let cfg = Gpt2Config::default();
    let w = weights(&build_gpt2(&cfg).unwrap());
    let residual = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    for (name, values) in &w {
        let want_std = if name.ends_with("c_proj.weight") {
            residual
        } else if ["wte.weight", "wpe.weight", "c_attn.weight", "c_fc.weight"]
            .iter()
            .any(|s| name.ends_with(s))
        {
            0.02
        } else {
            let fill = if name.contains("ln_") && name.ends_with(".weight") {
                1.0
            } else {
                0.0
            };
            assert!(
                values.iter().all(|&v| v == fill),
                "{name} should be all {fill}"
            );
            continue;
        };
        let (mean, std) = mean_std(values);
        let tol = 6.0 / (2.0 * values.len() as f64).sqrt();
        assert!(
            (std / want_std - 1.0).abs() < tol,
            "{name}: std {std}, want {want_std}"
        );
        assert!(
            mean.abs() < 6.0 * want_std / (values.len() as f64).sqrt(),
            "{name}: mean {mean}"
        );
    }
}

/// Run `tools/ort_run.py` on `model` with `ids`; returns onnxruntime's logits.
fn ort_logits(
    python: &std::ffi::OsStr,
    model: &Path,
    ids: &ArrayD<i64>,
    dir: &Path,
) -> ArrayD<f32> {
    let input = dir.join("input_ids.npy");
    write_npy(&input, &Value::Int(ids.clone())).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/ort_run.py");
    let out = dir.join("ort");
    let feed = format!("input_ids={}", input.display());
    let status = Command::new(python)
        .arg(script)
        .arg(model)
        .arg(&out)
        .arg(feed)
        .status()
        .unwrap();
    assert!(
        status.success(),
        "onnxruntime failed on {}",
        model.display()
    );
    npy_f32(out.join("logits.npy"))
}

#[test]
fn onnxruntime_agrees_with_our_importer() {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "onnxruntime GPT-2 builder") else {
        return;
    };
    let dir = tempdir("gpt2-builder-ort");
    let (cfg, default) = (small(), Gpt2Config::default());
    let built = dir.join("built.onnx");
    write_gpt2(&cfg, &built).unwrap();
    let built_default = dir.join("default.onnx");
    write_gpt2(&default, &built_default).unwrap();
    let mut proto = build_gpt2(&cfg).unwrap();
    perturb(&mut proto, 9);
    let perturbed = dir.join("perturbed.onnx");
    std::fs::write(&perturbed, proto.write_to_bytes().unwrap()).unwrap();
    let cases = [
        (built, cfg.vocab_size),
        (perturbed, cfg.vocab_size),
        (built_default, default.vocab_size),
    ];
    for (path, vocab) in cases {
        let ids = token_ids(2, 7, vocab);
        let ours = logits(&OnnxModel::load(&path, &eval_device()).unwrap(), &ids);
        let ort = ort_logits(&python, &path, &ids, &dir);
        assert_close(
            &format!("onnxruntime on {}", path.display()),
            &ours,
            &ort,
            1e-4,
            0.0,
        );
        eprintln!(
            "onnxruntime on {}: max |ours - ort| = {:.3e}",
            path.display(),
            max_abs_diff(&ours, &ort)
        );
    }
    std::fs::remove_dir_all(dir).ok();
}
