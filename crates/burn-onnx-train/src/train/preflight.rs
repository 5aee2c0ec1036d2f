//! Checks a run makes before its first step, so that a bad data set or config fails at
//! once with the field named, not hours into training: the loss fits the data's targets,
//! token ids fit the model's vocabulary and class labels its classes (every id checked
//! once, the offending one named with its file and index), the test set fills an
//! evaluation batch.

use super::config::TrainingConfig;
use super::data::{Dataset, IdAt, TargetKind};
use super::evaluate::eval_batches;
use crate::error::{OnnxError, Result};
use crate::graph::Dim;
use crate::loss::LossKind;
use crate::model::OnnxModel;

/// The weights named by `histogram_weights` and `norm_weights` must be parameters.
pub fn check_weight_names(c: &TrainingConfig, model: &OnnxModel) -> Result<()> {
    for (field, names) in [
        ("logging.histogram_weights", &c.logging.histogram_weights),
        ("logging.norm_weights", &c.logging.norm_weights),
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
                        c.model.model_path.display()
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
            check_ids(c, model, field, want, &min, &max)?;
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
        eval_batches(c, test.len())?;
    }
    Ok(())
}

/// The smallest and largest token id or label of a data set against what the model takes.
fn check_ids(
    c: &TrainingConfig,
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
        TargetKind::NextToken => vocabulary(c, model)
            .map(|(table, rows)| (rows, format!("vocabulary: '{table}' has {rows} rows"))),
        _ => classes(c, model)
            .map(|n| (n, format!("{n} classes (output '{}')", c.model.output_name))),
    };
    match limit {
        Some((n, model_side)) if max.value >= n as i64 => bad(format!(
            "{what} {max} is outside the model's {model_side} ({})",
            c.model.model_path.display()
        )),
        _ => Ok(()),
    }
}

/// The position-embedding table and its row count: a `Gather` (axis 0) of a parameter at
/// indices made by a `Range` (through reshapes, casts and expansions), as exporters write
/// GPT-style learned positions.
fn positions(model: &OnnxModel) -> Option<(String, usize)> {
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

/// The class count of a classifier: the last declared dim of the output
/// `config.model.output_name`, when the file fixes it.
fn classes(c: &TrainingConfig, model: &OnnxModel) -> Option<usize> {
    let out = model
        .graph()
        .outputs
        .iter()
        .find(|o| o.name == c.model.output_name)?;
    match out.dims.last()? {
        Dim::Fixed(n) if *n > 0 => Some(*n),
        _ => None,
    }
}

/// The embedding table the token input indexes, and its row count: the first `Gather`
/// (axis 0) whose indices are the graph input `config.model.input_name`, or a reshaped or cast
/// copy of it, and whose data is a parameter.
fn vocabulary(c: &TrainingConfig, model: &OnnxModel) -> Option<(String, usize)> {
    let through = [
        "Reshape",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Cast",
        "Identity",
    ];
    gathered_table(model, vec![c.model.input_name.as_str()], None, &through)
}
