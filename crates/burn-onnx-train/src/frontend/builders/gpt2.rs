//! A GPT-2 language model built as an ONNX `ModelProto` from a [`Gpt2Config`], in pure Rust.
//!
//! It gives the GPT-2 example a default model when no exported file is at hand. The graph
//! has the same shape as what PyTorch exports for Hugging Face's `GPT2LMHeadModel`, and it
//! uses standard `ai.onnx` ops only (opset 17), so onnxruntime runs it too:
//!
//! * input `input_ids` (int64 `[batch, seq]`), output `logits` (float `[batch, seq, vocab]`);
//! * token plus position embeddings, positions from `Range(0, seq, 1)`;
//! * `n_layer` pre-LayerNorm blocks: causal self-attention (`c_attn` and `Split`, or
//!   separate `q_proj`/`k_proj`/`v_proj` with `separate_qkv`, heads by
//!   `Reshape`/`Transpose`, a `Where` mask, `Softmax`, `c_proj`) and an MLP (`c_fc`, tanh
//!   GELU written with primitive ops, `c_proj`), each with a residual `Add`;
//! * a final `ln_f` and an LM head tied to `transformer.wte.weight` through a `Transpose`
//!   node, so the embedding table is a single parameter.
//!
//! Initializers carry Hugging Face names (`transformer.h.0.attn.c_attn.weight`, ...) and
//! GPT-2's initialization: weights N(0, 0.02), residual projections (`c_proj`)
//! N(0, 0.02/sqrt(2 n_layer)), biases 0, LayerNorm gamma 1 and beta 0. The numbers come
//! from a self-contained SplitMix64 + Box-Muller generator, so a seed always yields the same
//! file. Scalars and shapes are `Constant` nodes: the only float initializers are weights.

use std::collections::HashMap;
use std::f64::consts::PI;
use std::path::Path;

use onnx_ir::{
    AttributeProto, AttributeType, GraphProto, ModelProto, NodeProto, TensorProto, TypeProto,
    ValueInfoProto,
};
use serde::{Deserialize, Serialize};

use crate::error::{OnnxError, Result};
use crate::onnx::export::{ExportOptions, write_model};
use crate::onnx::proto_presence::restore_default_attribute_values;
use crate::value::host_tensor::dtype;

/// `ai.onnx` opset the graph is written for (`Split` takes its sizes as an input).
pub const OPSET: i64 = 17;
/// ONNX IR version of the file (the one that goes with opset 17).
pub const IR_VERSION: i64 = 8;
/// `ModelProto.producer_name` of the built model.
pub const PRODUCER_NAME: &str = "burn-onnx-train gpt2 builder";

/// Standard deviation of GPT-2's weight initialization.
const INIT_STD: f64 = 0.02;
/// Attention score of masked (future) positions, as in Hugging Face (`finfo(float32).min`).
const MASK_VALUE: f32 = f32::MIN;

/// Hyper-parameters of the GPT-2 model to build (names as in Hugging Face's `GPT2Config`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Gpt2Config {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Number of attention heads; must divide `n_embd`.
    pub n_head: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Vocabulary size (rows of the tied embedding / LM head).
    pub vocab_size: usize,
    /// Longest sequence the position embedding covers.
    pub n_positions: usize,
    /// Epsilon of every LayerNormalization.
    pub layer_norm_epsilon: f32,
    /// Seed of the weight initialization.
    pub seed: u64,
    /// Separate `attn.q_proj` / `k_proj` / `v_proj` projections of the block input (as
    /// LLaMA- and BERT-style exports have them) instead of GPT-2's fused `c_attn` and its
    /// `Split`: the same function, another graph.
    #[serde(default)]
    pub separate_qkv: bool,
}

impl Default for Gpt2Config {
    /// A small GPT-2 with the real GPT-2 vocabulary: 2 layers, 4 heads, width 128.
    fn default() -> Self {
        Gpt2Config {
            n_layer: 2,
            n_head: 4,
            n_embd: 128,
            vocab_size: 50257,
            n_positions: 256,
            layer_norm_epsilon: 1e-5,
            seed: 42,
            separate_qkv: false,
        }
    }
}

impl Gpt2Config {
    /// Check the config: every size is positive, `n_head` divides `n_embd`, epsilon is a
    /// positive finite number. Errors name the field (`gpt2.n_head`, ...).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("gpt2.n_layer", self.n_layer),
            ("gpt2.n_head", self.n_head),
            ("gpt2.n_embd", self.n_embd),
            ("gpt2.vocab_size", self.vocab_size),
            ("gpt2.n_positions", self.n_positions),
        ];
        for (field, value) in sizes {
            if value == 0 {
                return Err(OnnxError::field(field, "must be greater than 0"));
            }
            if i64::try_from(value).is_err() {
                return Err(OnnxError::field(
                    field,
                    format!("{value} does not fit an ONNX dimension"),
                ));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(OnnxError::field(
                "gpt2.n_head",
                format!("{} does not divide n_embd ({})", self.n_head, self.n_embd),
            ));
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon > 0.0) {
            let message = format!(
                "must be positive and finite, got {}",
                self.layer_norm_epsilon
            );
            return Err(OnnxError::field("gpt2.layer_norm_epsilon", message));
        }
        Ok(())
    }

    fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
}

/// Build the GPT-2 model described by `config` (validated first).
pub fn build_gpt2(config: &Gpt2Config) -> Result<ModelProto> {
    config.validate()?;
    let mut builder = Gpt2Builder {
        cfg: config,
        graph: GraphBuilder::default(),
        rng: SplitMix64(config.seed),
    };
    builder.language_model();
    let mut model = model_proto(builder.graph.finish(config));
    restore_default_attribute_values(&mut model);
    Ok(model)
}

/// Build the GPT-2 model described by `config` and write it to `path` (atomically; the
/// weights go to `<path>.data` when they pass protobuf's limit, as on export).
pub fn write_gpt2(config: &Gpt2Config, path: &Path) -> Result<()> {
    write_model(build_gpt2(config)?, path, ExportOptions::default())
}

fn model_proto(graph: GraphProto) -> ModelProto {
    let mut model = ModelProto {
        ir_version: IR_VERSION,
        producer_name: PRODUCER_NAME.into(),
        producer_version: env!("CARGO_PKG_VERSION").into(),
        graph: Some(graph).into(),
        ..Default::default()
    };
    // `OperatorSetIdProto` is not re-exported by onnx-ir: create it through the Vec's type.
    model.opset_import.resize_with(1, Default::default);
    model.opset_import[0].version = OPSET;
    model
}

/// SplitMix64: a tiny, well-mixed 64-bit generator, enough for weight initialization.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1), so that its logarithm is finite.
    fn open_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// `n` samples of N(0, std²) by Box-Muller (both values of each pair are used).
    fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let radius = std * (-2.0 * self.open_unit().ln()).sqrt();
            let angle = 2.0 * PI * self.open_unit();
            out.push((radius * angle.cos()) as f32);
            out.push((radius * angle.sin()) as f32);
        }
        out.truncate(n);
        out
    }
}

/// A dimension of a declared graph input or output.
#[derive(Clone, Copy)]
enum DimSpec {
    Symbolic(&'static str),
    Fixed(usize),
}

fn value_info(name: &str, elem_type: i32, dims: &[DimSpec]) -> ValueInfoProto {
    let mut ty = TypeProto::new();
    let tensor = ty.mut_tensor_type();
    tensor.elem_type = elem_type;
    let shape = tensor.shape.mut_or_insert_default();
    shape.dim.resize_with(dims.len(), Default::default);
    for (slot, dim) in shape.dim.iter_mut().zip(dims) {
        match dim {
            DimSpec::Symbolic(name) => slot.set_dim_param((*name).into()),
            DimSpec::Fixed(size) => slot.set_dim_value(*size as i64),
        }
    }
    ValueInfoProto {
        name: name.into(),
        type_: Some(ty).into(),
        ..Default::default()
    }
}

fn tensor_proto(name: &str, data_type: i32, dims: &[usize], raw: Vec<u8>) -> TensorProto {
    TensorProto {
        name: name.into(),
        data_type,
        dims: dims.iter().map(|&d| d as i64).collect(),
        raw_data: raw.into(),
        ..Default::default()
    }
}

fn attr_int(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        type_: AttributeType::INT.into(),
        i: value,
        ..Default::default()
    }
}

fn attr_ints(name: &str, values: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        type_: AttributeType::INTS.into(),
        ints: values.to_vec(),
        ..Default::default()
    }
}

fn attr_float(name: &str, value: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        type_: AttributeType::FLOAT.into(),
        f: value,
        ..Default::default()
    }
}

fn attr_tensor(name: &str, value: TensorProto) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        type_: AttributeType::TENSOR.into(),
        t: Some(value).into(),
        ..Default::default()
    }
}

/// Accumulates nodes and initializers. Nodes are named PyTorch-style after the current
/// scope (`/transformer/h.0/attn/MatMul_1`) and their outputs `<node>_output_<i>`.
#[derive(Default)]
struct GraphBuilder {
    nodes: Vec<NodeProto>,
    initializers: Vec<TensorProto>,
    scope: String,
    name_counts: HashMap<String, usize>,
    /// Constant-node outputs by their (type, dims, bytes), so equal constants are shared.
    constants: HashMap<(i32, Vec<i64>, Vec<u8>), String>,
}

impl GraphBuilder {
    fn unique_name(&mut self, op_type: &str) -> String {
        let base = format!("{}/{op_type}", self.scope);
        let count = self.name_counts.entry(base.clone()).or_default();
        let name = if *count == 0 {
            base
        } else {
            format!("{base}_{count}")
        };
        *count += 1;
        name
    }

    /// Add a node with explicit output names.
    fn push(
        &mut self,
        name: String,
        op_type: &str,
        inputs: &[&str],
        outputs: Vec<String>,
        attribute: Vec<AttributeProto>,
    ) {
        let input = inputs.iter().map(|s| s.to_string()).collect();
        self.nodes.push(NodeProto {
            name,
            op_type: op_type.into(),
            input,
            output: outputs,
            attribute,
            ..Default::default()
        });
    }

    /// Add a node with `N` generated outputs; returns their names.
    fn op_n<const N: usize>(
        &mut self,
        op_type: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
    ) -> [String; N] {
        let name = self.unique_name(op_type);
        let outputs: [String; N] = std::array::from_fn(|i| format!("{name}_output_{i}"));
        self.push(name, op_type, inputs, outputs.to_vec(), attributes);
        outputs
    }

    /// Add a single-output node; returns its output.
    fn op(&mut self, op_type: &str, inputs: &[&str], attributes: Vec<AttributeProto>) -> String {
        let [output] = self.op_n(op_type, inputs, attributes);
        output
    }

    /// A `Constant` node holding `value` (shared with an earlier equal constant).
    fn constant(&mut self, value: TensorProto) -> String {
        let key = (value.data_type, value.dims.clone(), value.raw_data.to_vec());
        if let Some(existing) = self.constants.get(&key) {
            return existing.clone();
        }
        let out = self.op("Constant", &[], vec![attr_tensor("value", value)]);
        self.constants.insert(key, out.clone());
        out
    }

    fn ints(&mut self, values: &[i64]) -> String {
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.constant(tensor_proto("", dtype::INT64, &[values.len()], raw))
    }

    fn int_scalar(&mut self, value: i64) -> String {
        self.constant(tensor_proto(
            "",
            dtype::INT64,
            &[],
            value.to_le_bytes().to_vec(),
        ))
    }

    fn float_scalar(&mut self, value: f32) -> String {
        self.constant(tensor_proto(
            "",
            dtype::FLOAT,
            &[],
            value.to_le_bytes().to_vec(),
        ))
    }

    /// A float initializer (a weight); returns its name.
    fn initializer(&mut self, name: &str, dims: &[usize], values: &[f32]) -> String {
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializers
            .push(tensor_proto(name, dtype::FLOAT, dims, raw));
        name.to_string()
    }

    fn finish(self, cfg: &Gpt2Config) -> GraphProto {
        let (batch, seq) = (DimSpec::Symbolic("batch"), DimSpec::Symbolic("seq"));
        let input = value_info("input_ids", dtype::INT64, &[batch, seq]);
        let output = value_info(
            "logits",
            dtype::FLOAT,
            &[batch, seq, DimSpec::Fixed(cfg.vocab_size)],
        );
        GraphProto {
            name: "gpt2".into(),
            node: self.nodes,
            initializer: self.initializers,
            input: vec![input],
            output: vec![output],
            ..Default::default()
        }
    }
}

/// Writes the GPT-2 graph into a [`GraphBuilder`], drawing weights in file order.
struct Gpt2Builder<'a> {
    cfg: &'a Gpt2Config,
    graph: GraphBuilder,
    rng: SplitMix64,
}

impl Gpt2Builder<'_> {
    fn normal_weight(&mut self, name: &str, dims: &[usize], std: f64) -> String {
        let values = self.rng.normals(dims.iter().product(), std);
        self.graph.initializer(name, dims, &values)
    }

    fn filled_weight(&mut self, name: &str, dims: &[usize], value: f32) -> String {
        self.graph
            .initializer(name, dims, &vec![value; dims.iter().product()])
    }

    /// HF `Conv1D`: `x @ W + b` with `W` of shape `[n_in, n_out]`.
    fn conv1d(&mut self, x: &str, prefix: &str, n_in: usize, n_out: usize, std: f64) -> String {
        let w = self.normal_weight(&format!("{prefix}.weight"), &[n_in, n_out], std);
        let b = self.filled_weight(&format!("{prefix}.bias"), &[n_out], 0.0);
        let y = self.graph.op("MatMul", &[x, &w], vec![]);
        self.graph.op("Add", &[&y, &b], vec![])
    }

    fn layer_norm(&mut self, x: &str, prefix: &str) -> String {
        let gamma = self.filled_weight(&format!("{prefix}.weight"), &[self.cfg.n_embd], 1.0);
        let beta = self.filled_weight(&format!("{prefix}.bias"), &[self.cfg.n_embd], 0.0);
        let attrs = vec![
            attr_int("axis", -1),
            attr_float("epsilon", self.cfg.layer_norm_epsilon),
        ];
        self.graph
            .op("LayerNormalization", &[x, &gamma, &beta], attrs)
    }

    /// The whole model: embeddings, blocks, `ln_f`, tied LM head.
    fn language_model(&mut self) {
        self.graph.scope = "/transformer".into();
        let wte = self.normal_weight(
            "transformer.wte.weight",
            &[self.cfg.vocab_size, self.cfg.n_embd],
            INIT_STD,
        );
        let wpe = self.normal_weight(
            "transformer.wpe.weight",
            &[self.cfg.n_positions, self.cfg.n_embd],
            INIT_STD,
        );
        let positions = self.positions();
        let mask = self.causal_mask(&positions);
        let tokens = self
            .graph
            .op("Gather", &[&wte, "input_ids"], vec![attr_int("axis", 0)]);
        let places = self
            .graph
            .op("Gather", &[&wpe, &positions], vec![attr_int("axis", 0)]);
        let mut h = self.graph.op("Add", &[&tokens, &places], vec![]);
        for layer in 0..self.cfg.n_layer {
            h = self.block(&h, layer, &mask);
        }
        self.graph.scope = "/transformer/ln_f".into();
        let h = self.layer_norm(&h, "transformer.ln_f");
        self.lm_head(&h, &wte);
    }

    /// `Range(0, seq, 1)` with `seq = Shape(input_ids)[1]`.
    fn positions(&mut self) -> String {
        let shape = self.graph.op("Shape", &["input_ids"], vec![]);
        let one = self.graph.int_scalar(1);
        let seq = self
            .graph
            .op("Gather", &[&shape, &one], vec![attr_int("axis", 0)]);
        let zero = self.graph.int_scalar(0);
        self.graph.op("Range", &[&zero, &seq, &one], vec![])
    }

    /// `[seq, seq]` boolean, true where the key position is at or before the query's.
    fn causal_mask(&mut self, positions: &str) -> String {
        let (axis0, axis1) = (self.graph.ints(&[0]), self.graph.ints(&[1]));
        let rows = self.graph.op("Unsqueeze", &[positions, &axis1], vec![]);
        let cols = self.graph.op("Unsqueeze", &[positions, &axis0], vec![]);
        self.graph.op("LessOrEqual", &[&cols, &rows], vec![])
    }

    fn block(&mut self, h: &str, layer: usize, mask: &str) -> String {
        let prefix = format!("transformer.h.{layer}");
        self.graph.scope = format!("/transformer/h.{layer}/ln_1");
        let x = self.layer_norm(h, &format!("{prefix}.ln_1"));
        self.graph.scope = format!("/transformer/h.{layer}/attn");
        let a = self.attention(&x, &prefix, mask);
        self.graph.scope = format!("/transformer/h.{layer}");
        let h = self.graph.op("Add", &[h, &a], vec![]);
        self.graph.scope = format!("/transformer/h.{layer}/ln_2");
        let x = self.layer_norm(&h, &format!("{prefix}.ln_2"));
        self.graph.scope = format!("/transformer/h.{layer}/mlp");
        let m = self.mlp(&x, &prefix);
        self.graph.scope = format!("/transformer/h.{layer}");
        self.graph.op("Add", &[&h, &m], vec![])
    }

    fn residual_std(&self) -> f64 {
        INIT_STD / ((2 * self.cfg.n_layer) as f64).sqrt()
    }

    /// Causal multi-head self-attention of `[batch, seq, n_embd]` input.
    fn attention(&mut self, x: &str, prefix: &str, mask: &str) -> String {
        let e = self.cfg.n_embd;
        let [q, k, v] = if self.cfg.separate_qkv {
            ["q_proj", "k_proj", "v_proj"]
                .map(|p| self.conv1d(x, &format!("{prefix}.attn.{p}"), e, e, INIT_STD))
        } else {
            let qkv = self.conv1d(x, &format!("{prefix}.attn.c_attn"), e, 3 * e, INIT_STD);
            let sizes = self.graph.ints(&[e as i64; 3]);
            self.graph
                .op_n("Split", &[&qkv, &sizes], vec![attr_int("axis", -1)])
        };
        let q = self.split_heads(&q, &[0, 2, 1, 3]);
        let k = self.split_heads(&k, &[0, 2, 3, 1]);
        let v = self.split_heads(&v, &[0, 2, 1, 3]);
        let scores = self.graph.op("MatMul", &[&q, &k], vec![]);
        let scale = self
            .graph
            .float_scalar((1.0 / (self.cfg.head_dim() as f64).sqrt()) as f32);
        let scores = self.graph.op("Mul", &[&scores, &scale], vec![]);
        let masked = self.graph.float_scalar(MASK_VALUE);
        let scores = self.graph.op("Where", &[mask, &scores, &masked], vec![]);
        let probs = self
            .graph
            .op("Softmax", &[&scores], vec![attr_int("axis", -1)]);
        let context = self.graph.op("MatMul", &[&probs, &v], vec![]);
        let context = self.graph.op(
            "Transpose",
            &[&context],
            vec![attr_ints("perm", &[0, 2, 1, 3])],
        );
        let merged = self.graph.ints(&[0, 0, e as i64]);
        let context = self.graph.op("Reshape", &[&context, &merged], vec![]);
        let std = self.residual_std();
        self.conv1d(&context, &format!("{prefix}.attn.c_proj"), e, e, std)
    }

    /// `[batch, seq, n_embd]` to `[batch, seq, n_head, head_dim]`, then transposed by `perm`.
    fn split_heads(&mut self, x: &str, perm: &[i64]) -> String {
        let heads = self
            .graph
            .ints(&[0, 0, self.cfg.n_head as i64, self.cfg.head_dim() as i64]);
        let x = self.graph.op("Reshape", &[x, &heads], vec![]);
        self.graph
            .op("Transpose", &[&x], vec![attr_ints("perm", perm)])
    }

    fn mlp(&mut self, x: &str, prefix: &str) -> String {
        let e = self.cfg.n_embd;
        let hidden = self.conv1d(x, &format!("{prefix}.mlp.c_fc"), e, 4 * e, INIT_STD);
        let hidden = self.gelu_tanh(&hidden);
        let std = self.residual_std();
        self.conv1d(&hidden, &format!("{prefix}.mlp.c_proj"), 4 * e, e, std)
    }

    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, GPT-2's `gelu_new`.
    fn gelu_tanh(&mut self, x: &str) -> String {
        let three = self.graph.float_scalar(3.0);
        let cubic = self.graph.float_scalar(0.044715);
        let sqrt_2_over_pi = self.graph.float_scalar((2.0 / PI).sqrt() as f32);
        let (one, half) = (self.graph.float_scalar(1.0), self.graph.float_scalar(0.5));
        let cube = self.graph.op("Pow", &[x, &three], vec![]);
        let cube = self.graph.op("Mul", &[&cube, &cubic], vec![]);
        let inner = self.graph.op("Add", &[x, &cube], vec![]);
        let inner = self.graph.op("Mul", &[&inner, &sqrt_2_over_pi], vec![]);
        let t = self.graph.op("Tanh", &[&inner], vec![]);
        let t = self.graph.op("Add", &[&t, &one], vec![]);
        let half_x = self.graph.op("Mul", &[x, &half], vec![]);
        self.graph.op("Mul", &[&half_x, &t], vec![])
    }

    /// `logits = h @ wte^T`: the head shares the embedding initializer through a `Transpose`.
    fn lm_head(&mut self, h: &str, wte: &str) {
        self.graph.scope = "/lm_head".into();
        let head = self
            .graph
            .op("Transpose", &[wte], vec![attr_ints("perm", &[1, 0])]);
        let name = self.graph.unique_name("MatMul");
        self.graph
            .push(name, "MatMul", &[h, &head], vec!["logits".into()], vec![]);
    }
}
