//! The house rules "layers, no import cycles" (docs/architecture.md), checked on both
//! crates by `tools/import_cycles.py`: a top-level module importing from a layer above its
//! own, a top-level module in no layer, or a `use` cycle between files of a crate or
//! between its top-level modules fails the tests.

use std::path::Path;
use std::process::Command;

#[test]
fn both_crates_keep_their_layers_without_import_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("python3")
        .arg(root.join("tools/import_cycles.py"))
        .arg(root.join("crates/burn-onnx-train/src"))
        .arg(root.join("crates/burn-ort-dist/src"))
        .output()
        .expect("python3 runs tools/import_cycles.py");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("0 import cycle(s)"), "{text}");
}
