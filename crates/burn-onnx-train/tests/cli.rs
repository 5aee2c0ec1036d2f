//! The `onnx-train` command line: `inspect` lists what the file holds, `run` writes every
//! graph output as `.npy` (checked against onnxruntime), bad files exit non-zero with the
//! file named.

mod common;

use std::process::Command;

use common::*;

fn onnx_train(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-train")).args(args).output().unwrap()
}

#[test]
fn inspect_lists_inputs_ops_and_parameters() {
    let model = refkit("models/gpt2_tiny.onnx");
    let out = onnx_train(&["inspect", model.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("input_ids int64 [batch, seq]"), "{text}");
    assert!(text.contains("LayerNormalization       5"), "{text}");
    assert!(text.contains("m.transformer.wte.weight") && text.contains("[1024, 128]"), "{text}");
    assert!(text.contains("29 parameters (675328 trainable elements, 0 state, 0 constant)"), "{text}");
    assert!(text.contains("m.transformer.wte.weight") && text.contains("trainable: weight"), "{text}");
}

#[test]
fn run_writes_outputs_equal_to_onnxruntime() {
    let dir = std::env::temp_dir().join(format!("onnx-train-cli-{}", std::process::id()));
    let model = refkit("models/lenet_bn.onnx");
    let input = refkit("inference/lenet_bn/input.npy");
    let out = onnx_train(&[
        "run",
        model.to_str().unwrap(),
        "--input",
        &format!("input={}", input.display()),
        "--output-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = npy_f32(dir.join("logits.npy"));
    assert_close("lenet_bn via CLI", &got, &npy_f32(refkit("inference/lenet_bn/output_ort_legacy.npy")), 1e-4, 1e-4);
}

#[test]
fn bad_file_fails_with_its_name() {
    let out = onnx_train(&["inspect", "Cargo.toml"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("Cargo.toml") && err.contains("not a valid ONNX model"), "{err}");
}
