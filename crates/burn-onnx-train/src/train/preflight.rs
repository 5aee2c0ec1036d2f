//! Checks a run makes before its first step, so that a bad data set or config fails at
//! once with the field named, not hours into training: the loss fits the data's targets,
//! token ids fit the model's vocabulary, the test set fills an evaluation batch.

use super::config::TrainingConfig;
use super::data::{Dataset, TargetKind};
use super::evaluate::eval_batches;
use crate::error::{OnnxError, Result};
use crate::loss::LossKind;
use crate::model::OnnxModel;

/// The weights named by `histogram_weights` and `norm_weights` must be parameters.
pub fn check_weight_names(c: &TrainingConfig, model: &OnnxModel) -> Result<()> {
    for (field, names) in [
        ("histogram_weights", &c.histogram_weights),
        ("norm_weights", &c.norm_weights),
    ] {
        for name in names
            .iter()
            .filter(|n| !(field == "norm_weights" && *n == "*"))
        {
            if model.param_index(name).is_none() {
                return Err(OnnxError::field(
                    format!("config.{field}"),
                    format!(
                        "'{name}' is not a float parameter of {}",
                        c.model_path.display()
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
    for (field, data) in [("train_data_dir", Some(train)), ("test_data_dir", test)] {
        let Some(data) = data else { continue };
        let (want, needs) = match c.loss {
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
                "config.loss",
                format!(
                    "{:?} needs {needs}, but {field} holds {:?} targets",
                    c.loss,
                    data.target_kind()
                ),
            ));
        }
        if let (TargetKind::NextToken, Some(max), Some((table, rows))) =
            (want, data.max_id(), vocabulary(c, model))
        {
            if max >= rows as i64 || max < 0 {
                return Err(OnnxError::field(
                    format!("config.{field}"),
                    format!(
                        "token id {max} is outside the model's vocabulary: '{table}' has {rows} rows ({})",
                        c.model_path.display()
                    ),
                ));
            }
        }
    }
    if let Some(test) = test {
        eval_batches(c, test.len())?;
    }
    Ok(())
}

/// The embedding table the token input indexes, and its row count: the first `Gather`
/// (axis 0) whose indices are the graph input `config.input_name`, or a reshaped or cast
/// copy of it, and whose data is a parameter.
fn vocabulary(c: &TrainingConfig, model: &OnnxModel) -> Option<(String, usize)> {
    let mut ids = vec![c.input_name.as_str()];
    for n in &model.graph().nodes {
        let reads_ids = |slot: usize| {
            n.inputs
                .get(slot)
                .is_some_and(|i| ids.contains(&i.as_str()))
        };
        match n.op_type.as_str() {
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Cast" | "Identity"
                if reads_ids(0) =>
            {
                ids.extend(n.outputs.first().map(String::as_str));
            }
            "Gather" if reads_ids(1) && n.attrs.int("axis", 0).is_ok_and(|a| a == 0) => {
                let table = n.inputs.first()?;
                let i = model.param_index(table)?;
                return Some((table.clone(), *model.param_infos()[i].shape.first()?));
            }
            _ => {}
        }
    }
    None
}
