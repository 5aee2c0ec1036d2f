//! Checks a run makes before its first step, so that a bad data set or config fails at
//! once with the field named, not hours into training: the loss fits the data's targets,
//! token ids fit the model's vocabulary and class labels its classes (every id checked
//! once, the offending one named with its file and index), the test set fills an
//! evaluation batch, the feeds and the output the config names are the graph's.
//! [`check_run`] makes them all without starting the run (`onnx-train train --check`).

use std::sync::Arc;

use burn::tensor::Device;

use super::config::{LoggingConfig, ModelConfig, TrainingConfig};
use super::data::documents::training_sampler;
use super::data::{Dataset, IdAt, TargetKind};
use super::evaluate::eval_batches;
use super::report::overview::RunOverview;
use crate::error::{OnnxError, Result};
use crate::graph::{Dim, TensorInfo};
use crate::model::OnnxModel;
use crate::model::loss::LossKind;

/// Every check a run makes before its first step, without starting it: epochs resolved
/// against the data, the model loaded on the CPU, its feeds, weights and the data checked
/// against it. Returns what the run would do.
pub fn check_run(
    mut c: TrainingConfig,
    train: &Arc<dyn Dataset>,
    test: Option<&dyn Dataset>,
) -> Result<RunOverview> {
    let sampler = training_sampler(
        &c.data,
        c.train.seed,
        train.as_ref(),
        0,
        c.parallel.data_parallel_size,
    );
    c.train.resolve_epochs(sampler.batches_per_epoch())?;
    sampler.batch_indices(0)?;
    let model = c.model.load_for_training(&Device::flex())?;
    check_model_and_data(&c, &model, train.as_ref(), test)?;
    Ok(RunOverview::new(&c, &model, train.as_ref()))
}

/// The checks of `model` (the whole model, loaded) and the data against `c`.
pub fn check_model_and_data(
    c: &TrainingConfig,
    model: &OnnxModel,
    train: &dyn Dataset,
    test: Option<&dyn Dataset>,
) -> Result<()> {
    check_feed_names(&c.model, model)?;
    check_weight_names(&c.logging, &c.model, model)?;
    check_data(c, model, train, test)
}

/// That `model`'s parameters and one micro-batch's logits fit the largest buffer `device`
/// allocates at once ([`check_fits_allocation`]); nothing to check where the
/// device has no such cap (the CPU).
pub fn check_fits_device(c: &TrainingConfig, model: &OnnxModel, device: &Device) -> Result<()> {
    match crate::kernels::largest_allocation(device) {
        Some(largest) => check_fits_allocation(c, model, largest, &c.parallel.device.to_string()),
        None => Ok(()),
    }
}

/// That `model`'s parameters (f32 on the device) and one micro-batch's logits fit in
/// `largest` bytes,
/// the largest buffer `device` allocates at once. CubeCL devices cap it (wgpu without
/// 64-bit indexing, lavapipe included: 128 MiB), and a tensor past it fails at its first
/// use with the device's I/O error, far from its cause; here the error names the tensor,
/// its bytes, the device's limit and what to change. Layouts that split the tensors
/// (tensor parallelism, ZeRO-3; pipelines' micro-batches for the logits) are left to the
/// run.
pub fn check_fits_allocation(
    c: &TrainingConfig,
    model: &OnnxModel,
    largest: u64,
    device: &str,
) -> Result<()> {
    let p = &c.parallel;
    let mb = |bytes: u64| bytes as f64 / 1e6;
    if p.horizontal_parallel_size <= 1 && p.zero_stage < 3 {
        for param in model.param_infos() {
            let bytes = param.shape.iter().product::<usize>() as u64 * 4;
            if bytes > largest {
                return Err(OnnxError::field(
                    "model.model_path",
                    format!(
                        "parameter `{}` ({:?}, {:.1} MB in f32) is larger than the largest buffer the device {device} allocates at once ({:.1} MB): train on a device without that cap (CUDA, or a Vulkan driver with 64-bit indexing), or split the parameter (parallel.horizontal_parallel_size, or ZeRO stage 3)",
                        param.name,
                        param.shape,
                        mb(bytes),
                        mb(largest)
                    ),
                ));
            }
        }
    }
    let lm = c.model.loss == LossKind::LmCrossEntropy;
    if !lm || p.horizontal_parallel_size > 1 || p.pipeline_parallel_size > 1 {
        return Ok(());
    }
    let Some(classes) = classes(&c.model.output_name, model) else {
        return Ok(());
    };
    // The check runs for CubeCL devices (the only ones with a largest buffer).
    let multiple = c.model.vocab_multiple(true).max(1);
    let columns = classes.next_multiple_of(multiple);
    // Under autocast a MatMul head writes the logits in f16/bf16; a Gemm head in f32.
    let low = c.precision.dtype.autocast().is_some()
        && model.has_low_precision_head(&c.model.output_name);
    let element = if low { 2 } else { 4 };
    let rows = c.data.batch_size * c.data.seq_len;
    let bytes = (rows * columns * element) as u64;
    if bytes > largest {
        return Err(OnnxError::field(
            "data.batch_size",
            format!(
                "one micro-batch's logits ({} x {} tokens x {columns} columns, {element} bytes each: {:.1} MB) are larger than the largest buffer the device {device} allocates at once ({:.1} MB): lower data.batch_size or data.seq_len (train.gradient_accumulation_steps keeps the update's batch), or train on a device without that cap (CUDA)",
                c.data.batch_size,
                c.data.seq_len,
                mb(bytes),
                mb(largest)
            ),
        ));
    }
    Ok(())
}

/// The graph inputs and output the config names exist: `model.input_name` (and the mask
/// and label inputs when set) among the inputs, `model.output_name` among the outputs. The
/// error lists what the graph has and the flag that sets the field.
fn check_feed_names(m: &ModelConfig, model: &OnnxModel) -> Result<()> {
    let graph = model.graph();
    let label = (m.loss == LossKind::Graph)
        .then(|| m.label_name.clone().unwrap_or_else(|| "labels".into()));
    let inputs = [
        ("input_name", Some(m.input_name.clone()), "--input-name"),
        (
            "attention_mask_name",
            m.attention_mask_name.clone(),
            "--set model.attention_mask_name=",
        ),
        ("label_name", label, "--set model.label_name="),
    ];
    let model_file = m.model_path.display();
    for (field, name, flag) in inputs {
        let Some(name) = name else { continue };
        if !graph.inputs.iter().any(|i| i.name == name) {
            return Err(not_in_graph(
                field,
                &name,
                "input",
                &graph.inputs,
                flag,
                &model_file,
            ));
        }
    }
    if !graph.outputs.iter().any(|o| o.name == m.output_name) {
        return Err(not_in_graph(
            "output_name",
            &m.output_name,
            "output",
            &graph.outputs,
            "--output-name",
            &model_file,
        ));
    }
    Ok(())
}

/// `config.model.<field>: '<name>' is not an <kind> of <file> (its <kind>s: a, b); set ...`.
fn not_in_graph(
    field: &str,
    name: &str,
    kind: &str,
    has: &[TensorInfo],
    flag: &str,
    file: &impl std::fmt::Display,
) -> OnnxError {
    let names: Vec<&str> = has.iter().map(|i| i.name.as_str()).collect();
    let fix = match names.as_slice() {
        [one] if flag.ends_with('=') => format!("; set it with {flag}{one}"),
        [one] => format!("; set it with {flag} {one}"),
        _ => format!("; set it with {} NAME", flag.trim_end_matches('=')),
    };
    OnnxError::field(
        format!("config.model.{field}"),
        format!(
            "'{name}' is not an {kind} of {file} (its {kind}s: {}){fix}",
            names.join(", ")
        ),
    )
}

/// The weights named by `histogram_weights` and `norm_weights` must be parameters.
pub fn check_weight_names(
    logging: &LoggingConfig,
    m: &ModelConfig,
    model: &OnnxModel,
) -> Result<()> {
    for (field, names) in [
        ("logging.histogram_weights", &logging.histogram_weights),
        ("logging.norm_weights", &logging.norm_weights),
    ] {
        for name in names
            .iter()
            .filter(|n| !(field == "logging.norm_weights" && *n == "*"))
        {
            if model.param_index(name).is_none() {
                return Err(OnnxError::field(
                    format!("config.{field}"),
                    format!(
                        "'{name}' is not a float parameter of {}",
                        m.model_path.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Check `train` and `test` against the config and the model.
pub fn check_data(
    c: &TrainingConfig,
    model: &OnnxModel,
    train: &dyn Dataset,
    test: Option<&dyn Dataset>,
) -> Result<()> {
    for (field, data) in [
        ("data.train_data_dir", Some(train)),
        ("data.test_data_dir", test),
    ] {
        let Some(data) = data else { continue };
        let (want, needs) = match c.model.loss {
            LossKind::Graph => continue,
            LossKind::LmCrossEntropy => (TargetKind::NextToken, "integer token shards"),
            LossKind::CrossEntropy => (
                TargetKind::Classes,
                "images_<k>.npy with integer labels_<k>.npy",
            ),
            LossKind::Mse => (
                TargetKind::Values,
                "images_<k>.npy with float targets_<k>.npy",
            ),
        };
        if data.target_kind() != want {
            return Err(OnnxError::field(
                "config.model.loss",
                format!(
                    "{:?} needs {needs}, but {field} holds {:?} targets",
                    c.model.loss,
                    data.target_kind()
                ),
            ));
        }
        if let Some((min, max)) = data.id_range() {
            check_ids(&c.model, model, field, want, &min, &max)?;
        }
    }
    if c.model.loss == LossKind::LmCrossEntropy
        && let Some((table, rows)) = positions(model)
        && c.data.seq_len > rows
    {
        return Err(OnnxError::field(
            "config.data.seq_len",
            format!(
                "{} tokens per sequence, but the model has {rows} positions ('{table}' of {})",
                c.data.seq_len,
                c.model.model_path.display()
            ),
        ));
    }
    if let Some(test) = test {
        eval_batches(&c.eval, test.len())?;
    }
    Ok(())
}

/// The smallest and largest token id or label of a data set against what the model takes.
fn check_ids(
    m: &ModelConfig,
    model: &OnnxModel,
    field: &str,
    kind: TargetKind,
    min: &IdAt,
    max: &IdAt,
) -> Result<()> {
    let what = if kind == TargetKind::NextToken {
        "token id"
    } else {
        "class label"
    };
    let bad = |m: String| Err(OnnxError::field(format!("config.{field}"), m));
    if min.value < 0 {
        return bad(format!("{what} {min} is negative"));
    }
    let limit = match kind {
        TargetKind::NextToken => vocabulary(&m.input_name, model)
            .map(|(table, rows)| (rows, format!("vocabulary: '{table}' has {rows} rows"))),
        _ => classes(&m.output_name, model)
            .map(|n| (n, format!("{n} classes (output '{}')", m.output_name))),
    };
    match limit {
        Some((n, model_side)) if max.value >= n as i64 => bad(format!(
            "{what} {max} is outside the model's {model_side} ({})",
            m.model_path.display()
        )),
        _ => Ok(()),
    }
}

/// The position-embedding table and its row count: a `Gather` (axis 0) of a parameter at
/// indices made by a `Range` (through reshapes, casts and expansions), as exporters write
/// GPT-style learned positions.
pub(crate) fn positions(model: &OnnxModel) -> Option<(String, usize)> {
    let through = [
        "Unsqueeze",
        "Reshape",
        "Squeeze",
        "Cast",
        "Expand",
        "Identity",
        "Slice",
    ];
    gathered_table(model, Vec::new(), Some("Range"), &through)
}

/// The first parameter `Gather`ed (axis 0) at indices derived from `from` (names, or the
/// outputs of `made_by` nodes) through nodes of the `through` op types, with its rows.
fn gathered_table<'m>(
    model: &'m OnnxModel,
    mut from: Vec<&'m str>,
    made_by: Option<&str>,
    through: &[&str],
) -> Option<(String, usize)> {
    for n in &model.graph().nodes {
        let derived = |slot: usize| {
            n.inputs
                .get(slot)
                .is_some_and(|i| from.contains(&i.as_str()))
        };
        if n.op_type == "Gather" && derived(1) && n.attrs.int("axis", 0).is_ok_and(|a| a == 0) {
            let table = n.inputs.first()?;
            let i = model.param_index(table)?;
            return Some((table.clone(), *model.param_infos()[i].shape.first()?));
        }
        if made_by == Some(n.op_type.as_str())
            || (through.contains(&n.op_type.as_str()) && derived(0))
        {
            from.extend(n.outputs.first().map(String::as_str));
        }
    }
    None
}

/// The class count of a classifier: the last declared dim of the output `output_name`
/// (`config.model.output_name`), when the file fixes it.
fn classes(output_name: &str, model: &OnnxModel) -> Option<usize> {
    let out = model
        .graph()
        .outputs
        .iter()
        .find(|o| o.name == output_name)?;
    match out.dims.last()? {
        Dim::Fixed(n) if *n > 0 => Some(*n),
        _ => None,
    }
}

/// The embedding table the token input indexes, and its row count: the first `Gather`
/// (axis 0) whose indices are the graph input `input_name` (`config.model.input_name`), or a
/// reshaped or cast copy of it, and whose data is a parameter.
pub(crate) fn vocabulary(input_name: &str, model: &OnnxModel) -> Option<(String, usize)> {
    let through = [
        "Reshape",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Cast",
        "Identity",
    ];
    gathered_table(model, vec![input_name], None, &through)
}
