//! Reading a [`TrainingConfig`] from TOML or JSON, in sections or flat.
//!
//! A file may be written in sections (`[data] batch_size = 8`) or flat, ONNX Runtime
//! Training's way (`batch_size = 8`): every field keeps its ORT name inside its section, so
//! a flat key moves into the section that holds it before serde reads the table. ORT's
//! aliases are honoured too: `use_mixed_precision` / `use_bfloat16` (the precision),
//! `deepspeed_zero_stage`, `overlap_segments = 0 | 1 | N`, and a flat `precision = "bf16"`;
//! and Megatron's `sequence_parallel` and `virtual_pipeline_model_parallel_size`.
//! A field set both flat and in its section is an error naming it; a key no section has is
//! named with what was probably meant (`keys.rs`).

use std::path::Path;

use super::TrainingConfig;
use super::keys::{SECTIONS, unknown_key};
use crate::error::{OnnxError, Result};

/// Flat names that are not a field's own name: (flat key, section, field).
const ALIASES: &[(&str, &str, &str)] = &[
    ("precision", "precision", "dtype"),
    ("deepspeed_zero_stage", "parallel", "zero_stage"),
    ("overlap_segments", "parallel", "overlap"),
    ("sequence_parallel", "parallel", "tensor_parallel_sequence"),
    (
        "virtual_pipeline_model_parallel_size",
        "parallel",
        "pipeline_virtual_stages",
    ),
];

/// The (section, field) a flat key sets, if any.
fn home_of(key: &str) -> Option<(&'static str, &'static str)> {
    if let Some(&(_, section, field)) = ALIASES.iter().find(|(flat, ..)| *flat == key) {
        return Some((section, field));
    }
    SECTIONS.iter().find_map(|&(section, fields)| {
        fields
            .iter()
            .find(|f| **f == key)
            .map(|&field| (section, field))
    })
}

fn is_section(key: &str) -> bool {
    SECTIONS.iter().any(|(s, _)| *s == key)
}

/// `file` with its flat keys moved into their sections (see the module docs).
pub(super) fn sectioned(file: toml::Table) -> std::result::Result<toml::Table, String> {
    let (mut out, mut flat) = (toml::Table::new(), Vec::new());
    for (key, value) in file {
        match value {
            toml::Value::Table(t) if is_section(&key) => {
                out.insert(key, toml::Value::Table(t));
            }
            value => flat.push((key, value)),
        }
    }
    for (key, value) in flat {
        let Some((section, field)) = home_of(&key) else {
            out.insert(key, value);
            continue;
        };
        let table = out
            .entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(table) = table else {
            unreachable!("sections are tables")
        };
        if table.contains_key(field) {
            return Err(format!(
                "{key} is set twice: flat and as {section}.{field}; keep one"
            ));
        }
        table.insert(field.to_string(), value);
    }
    ort_precision_aliases(&mut out)?;
    Ok(out)
}

/// ORT's `use_mixed_precision` (f16) and `use_bfloat16` (with it: bf16) become
/// `precision.dtype`; an explicit dtype that disagrees with them is an error.
fn ort_precision_aliases(file: &mut toml::Table) -> std::result::Result<(), String> {
    let mut flag = |key: &str| match file.remove(key) {
        None => Ok(false),
        Some(toml::Value::Boolean(b)) => Ok(b),
        Some(other) => Err(format!("{key}: expected true or false, got {other}")),
    };
    let (mixed, bf16) = (flag("use_mixed_precision")?, flag("use_bfloat16")?);
    if bf16 && !mixed {
        return Err(
            "use_bfloat16 = true needs use_mixed_precision = true (or write precision = \"bf16\")"
                .into(),
        );
    }
    if !mixed {
        return Ok(());
    }
    let implied = if bf16 { "bf16" } else { "f16" };
    let section = file
        .entry("precision")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(section) = section else {
        unreachable!("sectioned() made it a table")
    };
    match section.get("dtype") {
        Some(p) if p.as_str() != Some(implied) => Err(format!(
            "precision = {p} contradicts use_mixed_precision/use_bfloat16, which mean \"{implied}\""
        )),
        _ => {
            section.insert("dtype".into(), implied.into());
            Ok(())
        }
    }
}

/// Overlay `top` on `base`, merging tables recursively.
fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// `error` (a type or value the config cannot take, which serde reports without the key)
/// with the key of `file` (sectioned) that causes it: each field of each section is tried
/// alone over `base`, and the first that fails is named (`data.batch_size: invalid type:
/// string "eight", expected usize`).
fn name_the_field(base: &toml::Table, file: &toml::Table, error: toml::de::Error) -> String {
    let fails = |alone: toml::Table| {
        let mut one = base.clone();
        merge(&mut one, alone);
        toml::Value::Table(one).try_into::<TrainingConfig>().err()
    };
    let single = |k: &str, v: &toml::Value| toml::Table::from_iter([(k.to_string(), v.clone())]);
    for (key, value) in file {
        if let toml::Value::Table(section) = value {
            for (k, v) in section {
                if let Some(e) = fails(single(key, &toml::Value::Table(single(k, v)))) {
                    return format!("{key}.{k}: {}", e.message());
                }
            }
        }
        if let Some(e) = fails(single(key, value)) {
            return format!("{key}: {}", e.message());
        }
    }
    error.to_string()
}

/// `base` with the sectioned table `file` laid over it, read as a config; errors name the
/// field and go through `bad`.
fn over(
    base: &TrainingConfig,
    file: toml::Table,
    bad: impl Fn(String) -> OnnxError,
) -> Result<TrainingConfig> {
    if let Some(message) = unknown_key(&file) {
        return Err(bad(message));
    }
    let base: toml::Table = toml::Table::try_from(base).map_err(|e| bad(e.to_string()))?;
    let mut merged = base.clone();
    merge(&mut merged, file.clone());
    toml::Value::Table(merged)
        .try_into()
        .map_err(|e: toml::de::Error| bad(name_the_field(&base, &file, e)))
}

impl TrainingConfig {
    /// Read a `.toml` or `.json` file (by extension).
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_file_over(TrainingConfig::default(), path)
    }

    /// `base` with the fields that the `.toml` / `.json` file at `path` sets replaced (nested
    /// tables merge field by field): how a front end's defaults meet a user's config file.
    pub fn from_file_over(base: TrainingConfig, path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| OnnxError::io(path, e))?;
        let bad = |m: String| OnnxError::Decode {
            path: path.to_path_buf(),
            what: "training config",
            message: m,
        };
        let file: toml::Table = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?,
            _ => toml::from_str(&text).map_err(|e| bad(e.to_string()))?,
        };
        over(&base, sectioned(file).map_err(bad)?, bad)
    }

    /// `self` with `KEY=VALUE` overrides (`--set`): dotted keys reach into sections
    /// (`data.batch_size=4`, `optimizer.kind=sgd`), flat ORT names find theirs
    /// (`batch_size=4`); a value is TOML (`0.5`, `true`, `[1, 2]`, `"text"`) or else taken
    /// as a string. A key the config does not have is an error naming it.
    pub fn with_overrides(self, sets: &[String]) -> Result<Self> {
        if sets.is_empty() {
            return Ok(self);
        }
        let bad = |m: String| OnnxError::field("--set", m);
        let mut overrides = toml::Table::new();
        for set in sets {
            let Some((key, text)) = set.split_once('=') else {
                return Err(bad(format!("{set:?} is not KEY=VALUE")));
            };
            let text = text.trim();
            let mut value = toml::from_str::<toml::Table>(&format!("v = {text}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or_else(|| toml::Value::String(text.to_string()));
            let parts: Vec<&str> = key.trim().split('.').collect();
            for part in parts[1..].iter().rev() {
                value = toml::Value::Table(toml::Table::from_iter([(part.to_string(), value)]));
            }
            let one = toml::Table::from_iter([(parts[0].to_string(), value)]);
            merge(&mut overrides, sectioned(one).map_err(bad)?);
        }
        over(&self, overrides, bad)
    }

    /// Parse TOML held in memory (a checkpoint's copy of its run's config, sectioned or
    /// flat as older runs wrote it); `source` names where it came from in errors.
    pub fn from_toml(text: &str, source: &Path) -> Result<Self> {
        let bad = |message: String| OnnxError::Decode {
            path: source.to_path_buf(),
            what: "training config",
            message,
        };
        let file: toml::Table = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        toml::Value::Table(sectioned(file).map_err(bad)?)
            .try_into()
            .map_err(|e: toml::de::Error| bad(e.to_string()))
    }

    /// Serialise as TOML, in sections (written next to checkpoints so a run documents
    /// itself).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(|e| OnnxError::field("config", e.to_string()))
    }
}
