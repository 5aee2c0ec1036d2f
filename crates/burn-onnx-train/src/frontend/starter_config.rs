//! `onnx-train init MODEL.onnx`: a commented `run.toml` filled from the graph, for a user
//! who brings their own model: the input the batch feeds and the output the loss reads, a
//! loss guessed from that output's shape, `seq_len` up to the model's position table, the
//! vocabulary token ids must fit, and the knobs most runs set, with their defaults.

use std::path::Path;

use crate::graph::{TensorInfo, dims_text};
use crate::model::OnnxModel;
use crate::model::loss::LossKind;
use crate::train::config::TrainingConfig;
use crate::train::preflight::{positions, vocabulary};
use crate::value::host_tensor::dtype;

/// What the graph says about the run, and why.
struct Guess {
    input: String,
    output: String,
    loss: LossKind,
    /// The mask input, when the graph has one named as Hugging Face names it.
    mask: Option<String>,
    /// Why the loss was chosen.
    because: String,
}

/// The loss a graph output of this shape most likely trains with.
fn guess_loss(output: &TensorInfo) -> (LossKind, String) {
    let shape = dims_text(&output.dims);
    match output.dims.len() {
        0 => (
            LossKind::Graph,
            format!(
                "'{}' is a scalar: the graph computes its own loss",
                output.name
            ),
        ),
        3 => (
            LossKind::LmCrossEntropy,
            format!(
                "'{}' is {shape} (batch, sequence, vocabulary): next-token cross-entropy",
                output.name
            ),
        ),
        2 => (
            LossKind::CrossEntropy,
            format!(
                "'{}' is {shape} (batch, classes): cross-entropy against class ids",
                output.name
            ),
        ),
        _ => (
            LossKind::Mse,
            format!(
                "'{}' is {shape}: mean squared error against float targets of its shape",
                output.name
            ),
        ),
    }
}

fn guess(model: &OnnxModel) -> Guess {
    let g = model.graph();
    let required: Vec<&TensorInfo> = g.inputs.iter().filter(|i| !i.optional).collect();
    let mask = g
        .inputs
        .iter()
        .find(|i| i.name == "attention_mask")
        .map(|i| i.name.clone());
    // Token ids are integers; an image model's one input is a float.
    let input = required
        .iter()
        .find(|i| !dtype::is_float(i.elem_type) && Some(&i.name) != mask.as_ref())
        .or(required.first())
        .map_or_else(|| "input_ids".to_string(), |i| i.name.clone());
    let first_float = g.outputs.iter().find(|o| dtype::is_float(o.elem_type));
    let (output, (loss, because)) = match first_float {
        Some(o) => (o.name.clone(), guess_loss(o)),
        None => (
            "logits".to_string(),
            (
                LossKind::LmCrossEntropy,
                "no float output declared".to_string(),
            ),
        ),
    };
    Guess {
        input,
        output,
        loss,
        mask,
        because,
    }
}

/// `name (int64 [batch, seq])`, comma-separated.
fn listed(infos: &[TensorInfo]) -> String {
    let items: Vec<String> = infos
        .iter()
        .map(|i| {
            format!(
                "{} ({} {})",
                i.name,
                dtype::name(i.elem_type),
                dims_text(&i.dims)
            )
        })
        .collect();
    items.join(", ")
}

/// A TOML string literal.
fn quoted(text: &str) -> String {
    toml::Value::String(text.to_string()).to_string()
}

/// The commented `run.toml` for `model` (loaded from `model_path`); it reads back as a
/// [`TrainingConfig`] that trains the model on token or image shards under `data/`.
pub fn starter_config(model: &OnnxModel, model_path: &Path) -> String {
    let g = guess(model);
    let defaults = TrainingConfig::default();
    let vocab = vocabulary(&g.input, model);
    let positions = positions(model);
    let seq_len = positions.as_ref().map_or(128, |(_, n)| (*n).min(1024));
    let stem = model_path
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let graph = model.graph();
    let loss = toml::Value::try_from(g.loss)
        .map_or_else(|_| "\"lm_cross_entropy\"".into(), |v| v.to_string());
    let mut t = String::new();
    t += &format!(
        "# Training config for {}, written by `onnx-train init`.\n",
        model_path.display()
    );
    t += "# Check it, then train:   onnx-train train --config run.toml --check\n";
    t += "#                         onnx-train train --config run.toml\n";
    t += "# Every field with its default: onnx-train train --config run.toml --print-config\n";
    t += "# Relative paths resolve against the working directory.\n\n";
    t += "[model]\n";
    t += &format!(
        "model_path = {}\n",
        quoted(&model_path.display().to_string())
    );
    t += &format!("# The graph's inputs: {}\n", listed(&graph.inputs));
    t += &format!("input_name = {}\n", quoted(&g.input));
    if let Some(mask) = &g.mask {
        t += "# Fed with 1 for a real token, 0 for padding (all ones for windows).\n";
        t += &format!("attention_mask_name = {}\n", quoted(mask));
    }
    t += &format!("# The graph's outputs: {}\n", listed(&graph.outputs));
    t += &format!("output_name = {}\n", quoted(&g.output));
    t += &format!("# Guessed: {}.\n", g.because);
    t += "# Others: lm_cross_entropy, cross_entropy, mse, graph.\n";
    t += &format!("loss = {loss}\n\n");
    t += "[data]\n";
    match g.loss {
        LossKind::LmCrossEntropy | LossKind::Graph => {
            t += "# Token shards tokens_NNNNN.npy, e.g. from\n";
            t += "#   onnx-train tokenize --tokenizer tokenizer.json --output data/train TEXT_FILES...\n";
            if let Some((table, n)) = &vocab {
                t += &format!("# Token ids must be below {n} (the rows of '{table}').\n");
            }
        }
        _ => {
            t += "# Image shards images_K.npy with labels_K.npy (class ids) or targets_K.npy (floats).\n"
        }
    }
    t += "train_data_dir = \"data/train\"\n";
    t += "# test_data_dir = \"data/test\"\n";
    t += &format!("batch_size = {}\n", defaults.data.batch_size);
    if matches!(g.loss, LossKind::LmCrossEntropy | LossKind::Graph) {
        match &positions {
            Some((table, n)) => {
                t += &format!("# Tokens per window: at most {n} (the rows of '{table}').\n")
            }
            None => t += "# Tokens per window.\n",
        }
        t += &format!("seq_len = {seq_len}\n");
    }
    t += "\n[train]\n";
    t += "num_train_steps = 1000\n";
    t += &format!(
        "gradient_accumulation_steps = {}\n",
        defaults.train.gradient_accumulation_steps
    );
    t += &format!("max_grad_norm = {:?}\n", defaults.train.max_grad_norm);
    t += "\n[optimizer]\n";
    t += "# sgd, adam, adamw or lamb.\n";
    t += "kind = \"adamw\"\n";
    t += &format!("weight_decay = {:?}\n", defaults.optimizer.weight_decay);
    t += "\n[lr]\n";
    t += "initial_lr = 3e-4\n";
    t += "warmup_ratio = 0.05\n";
    t += "# none, constant, linear, cosine or poly (after the warm-up).\n";
    t += "mode = \"cosine\"\n";
    t += "\n[parallel]\n";
    t += "# cpu, wgpu or cuda; data_parallel_size ranks (threads, or mpirun -np N).\n";
    t += &format!(
        "device = {}\n",
        quoted(&defaults.parallel.device.to_string())
    );
    t += "data_parallel_size = 1\n";
    t += "\n[checkpoint]\n";
    t += &format!("output_dir = {}\n", quoted(&format!("runs/{stem}")));
    t += "checkpoint_period = 500\n";
    t
}
