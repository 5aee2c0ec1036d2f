//! Initializers stored as ONNX external data: read from one shared file at offsets (the
//! layout `onnx.save(..., save_as_external_data=True)` writes), with the same values as the
//! inline model; locations that escape the model's directory, truncated or missing data
//! files and dimension products that overflow are errors naming the tensor or file.

use super::common;

use std::path::{Path, PathBuf};

use burn_onnx_train::graph::initializer::Initializer;
use burn_onnx_train::train::process::launch::launch;
use burn_onnx_train::{Graph, OnnxModel};
use common::*;
use onnx_ir::{Message, ModelProto};

/// Copy refkit's MLP into `dir` with every initializer moved to `weights.bin` (after 16
/// bytes of padding, so offsets matter); `location` is what the model records.
fn external_mlp(dir: &Path, location: &str) -> PathBuf {
    external_copy("mlp", dir, location, 16)
}

/// [`external_mlp`] for refkit's model `name`, after `pad` bytes of padding (16 keeps
/// every f32 tensor 4-byte aligned, 18 none).
fn external_copy(name: &str, dir: &Path, location: &str, pad: usize) -> PathBuf {
    let bytes = std::fs::read(refkit(&format!("models/{name}.onnx"))).unwrap();
    let mut m = ModelProto::parse_from_bytes(&bytes).unwrap();
    let mut blob = vec![0u8; pad];
    for t in m.graph.as_mut().unwrap().initializer.iter_mut() {
        assert!(!t.raw_data.is_empty(), "fixture stores raw_data");
        let (offset, length) = (blob.len(), t.raw_data.len());
        blob.extend_from_slice(&t.raw_data);
        t.raw_data = Default::default();
        t.data_location = protobuf::EnumOrUnknown::from_i32(1);
        for (k, v) in [
            ("location", location.to_string()),
            ("offset", offset.to_string()),
            ("length", length.to_string()),
        ] {
            t.external_data.push(Default::default());
            let e = t.external_data.last_mut().unwrap();
            e.key = k.into();
            e.value = v;
        }
    }
    std::fs::write(dir.join("weights.bin"), &blob).unwrap();
    let path = dir.join("model.onnx");
    std::fs::write(&path, m.write_to_bytes().unwrap()).unwrap();
    path
}

fn load_err(path: &Path) -> String {
    OnnxModel::load(path, &eval_device())
        .err()
        .expect("loading must fail")
        .to_string()
}

#[test]
fn external_initializers_load_with_the_inline_values() {
    let dir = tempdir("ext-ok");
    let model = OnnxModel::load(external_mlp(&dir, "weights.bin"), &eval_device()).unwrap();
    let inline = onnx_params(refkit("models/mlp.onnx"));
    assert_eq!(model.param_infos().len(), inline.len());
    for (name, want) in inline {
        let got = model.param_by_name(&name).unwrap().to_array().unwrap();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn locations_outside_the_model_directory_are_refused() {
    let dir = tempdir("ext-escape");
    let inner = dir.join("model");
    std::fs::create_dir_all(&inner).unwrap();
    let path = external_mlp(&inner, "../weights.bin");
    std::fs::copy(inner.join("weights.bin"), dir.join("weights.bin")).unwrap();
    let err = load_err(&path);
    assert!(
        err.contains("fc1.weight") && err.contains("inside the model's directory"),
        "{err}"
    );
    let abs = dir.join("weights.bin");
    let err = load_err(&external_mlp(&inner, abs.to_str().unwrap()));
    assert!(err.contains("inside the model's directory"), "{err}");
}

#[test]
fn a_symlink_out_of_the_model_directory_is_refused() {
    let dir = tempdir("ext-symlink");
    let inner = dir.join("model");
    std::fs::create_dir_all(&inner).unwrap();
    let path = external_mlp(&inner, "link.bin");
    std::fs::rename(inner.join("weights.bin"), dir.join("weights.bin")).unwrap();
    std::os::unix::fs::symlink(dir.join("weights.bin"), inner.join("link.bin")).unwrap();
    let err = load_err(&path);
    assert!(err.contains("outside the model's directory"), "{err}");
}

#[test]
fn truncated_and_missing_data_files_are_errors() {
    let dir = tempdir("ext-truncated");
    let path = external_mlp(&dir, "weights.bin");
    let blob = std::fs::read(dir.join("weights.bin")).unwrap();
    std::fs::write(dir.join("weights.bin"), &blob[..blob.len() / 2]).unwrap();
    let err = load_err(&path);
    assert!(
        err.contains("external data") && err.contains("outside") && err.contains("weights.bin"),
        "{err}"
    );
    std::fs::remove_file(dir.join("weights.bin")).unwrap();
    let err = load_err(&path);
    assert!(err.contains("weights.bin"), "{err}");
}

#[test]
fn overflowing_dimensions_are_an_error_not_a_wraparound() {
    let dir = tempdir("ext-overflow");
    let bytes = std::fs::read(refkit("models/mlp.onnx")).unwrap();
    let mut m = ModelProto::parse_from_bytes(&bytes).unwrap();
    m.graph.as_mut().unwrap().initializer[0].dims = vec![1 << 33, 1 << 33, 1 << 2];
    let path = dir.join("model.onnx");
    std::fs::write(&path, m.write_to_bytes().unwrap()).unwrap();
    let err = load_err(&path);
    assert!(err.contains("overflow"), "{err}");
}

fn mlp_logits(model: &OnnxModel, x: &burn_onnx_train::Value) -> ndarray::ArrayD<f32> {
    let out = model
        .forward(
            vec![("input".into(), x.clone())],
            burn_onnx_train::Mode::Eval,
        )
        .unwrap();
    let Some(burn_onnx_train::Value::Float(y)) = out.first().cloned() else {
        panic!()
    };
    y.to_array().unwrap()
}

#[test]
fn export_with_external_data_round_trips_and_runs_in_onnxruntime() {
    use burn_onnx_train::onnx::export::{ExportOptions, ExternalDataPolicy, export_onnx_with};
    let dir = tempdir("ext-export");
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &eval_device()).unwrap();
    let path = dir.join("mlp_ext.onnx");
    export_onnx_with(
        &model,
        &path,
        ExportOptions {
            external_data: ExternalDataPolicy::Always,
            ..Default::default()
        },
    )
    .unwrap();
    let data = std::fs::metadata(dir.join("mlp_ext.onnx.data"))
        .unwrap()
        .len();
    let graph = std::fs::metadata(&path).unwrap().len();
    assert!(
        data > 800_000 && graph < 10_000,
        "weights in the data file ({data} bytes), graph alone in the model ({graph} bytes)"
    );
    let reloaded = OnnxModel::load(&path, &eval_device()).unwrap();
    for (name, want) in onnx_params(refkit("models/mlp.onnx")) {
        assert_eq!(
            reloaded.param_by_name(&name).unwrap().to_array().unwrap(),
            want,
            "{name}"
        );
    }
    // A model read from external data and exported elsewhere, inline: its data comes along.
    let moved = tempdir("ext-export-moved");
    burn_onnx_train::onnx::export::export_onnx(&reloaded, moved.join("inline.onnx")).unwrap();
    assert!(!moved.join("inline.onnx.data").exists());
    assert_eq!(
        onnx_params(moved.join("inline.onnx")),
        onnx_params(refkit("models/mlp.onnx"))
    );

    // onnx.checker with the path (it follows external data) and onnxruntime on the file.
    let Some(python) = python_for(
        "ONNX_TRAIN_PYTHON",
        "onnx.checker / onnxruntime on external data",
    ) else {
        return;
    };
    let checked = std::process::Command::new(&python)
        .args([
            "-c",
            "import onnx, sys; onnx.checker.check_model(sys.argv[1], full_check=True)",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        checked.status.success(),
        "onnx.checker: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let batch = npz(refkit("train/mlp/batch.npz"));
    let x = burn_onnx_train::Value::from_host(&batch["input"], &eval_device()).unwrap();
    let input = dir.join("input.npy");
    burn_onnx_train::train::data::npy::write_npy(&input, &x).unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/ort_run.py");
    let ran = std::process::Command::new(&python)
        .arg(script)
        .arg(&path)
        .arg(dir.join("ort"))
        .arg(format!("input={}", input.display()))
        .output()
        .unwrap();
    assert!(
        ran.status.success(),
        "onnxruntime: {}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert_close(
        "onnxruntime on the external-data export",
        &npy_f32(dir.join("ort/logits.npy")),
        &mlp_logits(&reloaded, &x),
        1e-5,
        1e-5,
    );
}

#[test]
fn auto_export_switches_to_external_data_above_the_threshold() {
    use burn_onnx_train::onnx::export::{ExportOptions, export_onnx_with};
    let dir = tempdir("ext-threshold");
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &eval_device()).unwrap();
    // The MLP holds 814 KB of weights: the default threshold (1.8 GB) keeps them inline; a
    // threshold of 100 KB (standing in for protobuf's 2 GB) moves them out.
    export_onnx_with(&model, dir.join("small.onnx"), ExportOptions::default()).unwrap();
    assert!(!dir.join("small.onnx.data").exists());
    export_onnx_with(
        &model,
        dir.join("big.onnx"),
        ExportOptions {
            threshold_bytes: 100_000,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(dir.join("big.onnx.data").is_file());
    assert_eq!(
        onnx_params(dir.join("big.onnx")),
        onnx_params(dir.join("small.onnx"))
    );
}

#[test]
fn one_external_file_per_tensor_as_the_onnx_package_writes_it() {
    // tools/gen_train_refs.py: onnx.save_model(..., all_tensors_to_one_file=False).
    let model =
        OnnxModel::load(data("external/mlp_per_tensor/model.onnx"), &eval_device()).unwrap();
    let inline = onnx_params(data("optim/mlp_small.onnx"));
    assert_eq!(inline.len(), 4);
    for (name, want) in inline {
        assert_eq!(
            model.param_by_name(&name).unwrap().to_array().unwrap(),
            want,
            "{name}"
        );
    }
}

/// Names of the initializers `path`'s loader reads in place.
fn read_in_place(path: &Path) -> Vec<String> {
    Graph::load(path)
        .unwrap()
        .initializers
        .iter()
        .filter(|(_, t)| matches!(t, Initializer::Mapped { .. }))
        .map(|(n, _)| n.clone())
        .collect()
}

/// Float initializers of a data file are read in place (the loader maps them instead of
/// decoding them), and a model made of them trains exactly as the decoded model does (the
/// same data at unaligned offsets), in one process and sharded by ZeRO-3 over 2 thread
/// ranks, without writing the data file (the first write of a parameter copies it).
#[test]
fn parameters_read_in_place_from_a_data_file_train_as_decoded_ones_and_leave_it_unwritten() {
    let (dir, decoded_dir) = (tempdir("ext-in-place"), tempdir("ext-decoded"));
    let path = external_copy("gpt2_tiny", &dir, "weights.bin", 16);
    let decoded = external_copy("gpt2_tiny", &decoded_dir, "weights.bin", 18);
    let before = std::fs::read(dir.join("weights.bin")).unwrap();
    let mapped = read_in_place(&path);
    assert!(
        mapped.len() >= 4,
        "the big weights are read in place: {mapped:?}"
    );
    assert_eq!(
        read_in_place(&decoded),
        Vec::<String>::new(),
        "unaligned: decoded"
    );
    for (tag, ranks, zero) in [("one", 1, 0), ("zero3", 2, 3)] {
        let run = |model: &Path, out: &Path| {
            let mut c = gpt2_config(out);
            c.model.model_path = model.to_path_buf();
            c.parallel.data_parallel_size = ranks;
            c.parallel.zero_stage = zero;
            c.data.batch_size = 4 / ranks;
            launch(c, gpt2_tokens(), None).unwrap_or_else(|e| panic!("{e}"))
        };
        let (decoded_out, mapped_out) = (
            tempdir(&format!("ext-in-place-{tag}-decoded")),
            tempdir(&format!("ext-in-place-{tag}-mapped")),
        );
        let want = run(&decoded, &decoded_out);
        let got = run(&path, &mapped_out);
        assert_eq!(got.losses, want.losses, "{tag}: losses");
        let file = "model_trained.onnx";
        let trained = onnx_params(decoded_out.join(file));
        for ((name, x), (_, y)) in trained.iter().zip(onnx_params(mapped_out.join(file))) {
            assert_eq!(x, &y, "{tag}: {name}");
        }
        assert_moved(
            &refkit("models/gpt2_tiny.onnx"),
            &mapped_out.join(file),
            1e-3,
        );
    }
    assert!(
        std::fs::read(dir.join("weights.bin")).unwrap() == before,
        "training wrote the model's data file"
    );
}
