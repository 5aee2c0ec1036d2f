//! The ONNX backend node tests (onnx 1.22.0's conformance suite, 1765 single-op models
//! with inputs and expected outputs) through `onnx-train run`: no test may panic, and the
//! pass count may not fall below the committed floor in `tools/node_suite_floor.txt`
//! (raise it as ops land). The harness is `tools/node_suite.py`; the per-test classes of
//! the last run are written to `target/node_suite.json`.

use super::common;

use std::path::PathBuf;
use std::process::Command;

#[test]
fn onnx_node_tests_pass_at_or_above_the_floor_without_panics() {
    let Some(python) = common::python_for("ONNX_TRAIN_PYTHON", "ONNX node-test suite") else {
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let floor = std::fs::read_to_string(root.join("tools/node_suite_floor.txt"))
        .expect("tools/node_suite_floor.txt");
    let floor = floor.trim().parse::<usize>().expect("a pass count");
    let out = Command::new(python)
        .arg(root.join("tools/node_suite.py"))
        .args(["--binary", env!("CARGO_BIN_EXE_onnx-train")])
        .args(["--floor", &floor.to_string()])
        .arg("--json")
        .arg(root.join("target/node_suite.json"))
        .output()
        .expect("run tools/node_suite.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "node suite below the floor {floor} or with panics:\n{stdout}\n{stderr}"
    );
}
