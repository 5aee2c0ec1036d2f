//! `docs/config-reference.md` cannot drift from the config types: its keys are exactly
//! those of `TrainingConfig` (serialised by serde, independently of the generator), and
//! `tools/config_reference.py --check` finds it generated from the current doc comments.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use burn_onnx_train::train::TrainingConfig;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `section.key` of every table row under a `## [section]` heading of the page.
fn documented_keys(page: &str) -> BTreeSet<String> {
    let mut section = None;
    let mut keys = BTreeSet::new();
    for line in page.lines() {
        if let Some(name) = line
            .strip_prefix("## `[")
            .and_then(|l| l.strip_suffix("]`"))
        {
            section = Some(name.to_string());
        } else if let (Some(s), Some(rest)) = (&section, line.strip_prefix("| `")) {
            let key = rest.split('`').next().unwrap();
            keys.insert(format!("{s}.{key}"));
        }
    }
    keys
}

/// `section.key` of every field of the default config, as serde writes it.
fn config_keys() -> BTreeSet<String> {
    let value = serde_json::to_value(TrainingConfig::default()).unwrap();
    let mut keys = BTreeSet::new();
    for (section, fields) in value.as_object().unwrap() {
        for key in fields.as_object().unwrap().keys() {
            keys.insert(format!("{section}.{key}"));
        }
    }
    keys
}

#[test]
fn the_reference_lists_every_config_key_and_no_other() {
    let page = std::fs::read_to_string(root().join("docs/config-reference.md")).unwrap();
    let documented = documented_keys(&page);
    let actual = config_keys();
    assert!(actual.len() > 60, "{actual:?}");
    let missing: Vec<_> = actual.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&actual).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/config-reference.md lacks {missing:?} and lists keys no config has {unknown:?}: run python3 tools/config_reference.py"
    );
}

#[test]
fn the_reference_is_generated_from_the_current_doc_comments() {
    let out = Command::new("python3")
        .arg(root().join("tools/config_reference.py"))
        .arg("--check")
        .output()
        .expect("python3 runs tools/config_reference.py");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
