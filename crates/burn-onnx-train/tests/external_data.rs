//! Initializers stored as ONNX external data: read from one shared file at offsets (the
//! layout `onnx.save(..., save_as_external_data=True)` writes), with the same values as the
//! inline model; locations that escape the model's directory, truncated or missing data
//! files and dimension products that overflow are errors naming the tensor or file.

mod common;

use std::path::{Path, PathBuf};

use burn_onnx_train::OnnxModel;
use common::*;
use onnx_ir::{Message, ModelProto};

/// Copy refkit's MLP into `dir` with every initializer moved to `weights.bin` (after 16
/// bytes of padding, so offsets matter); `location` is what the model records.
fn external_mlp(dir: &Path, location: &str) -> PathBuf {
    let bytes = std::fs::read(refkit("models/mlp.onnx")).unwrap();
    let mut m = ModelProto::parse_from_bytes(&bytes).unwrap();
    let mut blob = vec![0u8; 16];
    for t in m.graph.as_mut().unwrap().initializer.iter_mut() {
        assert!(!t.raw_data.is_empty(), "fixture stores raw_data");
        let (offset, length) = (blob.len(), t.raw_data.len());
        blob.extend_from_slice(&t.raw_data);
        t.raw_data = Default::default();
        t.data_location = protobuf::EnumOrUnknown::from_i32(1);
        for (k, v) in [("location", location.to_string()), ("offset", offset.to_string()), ("length", length.to_string())] {
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
    OnnxModel::load(path, &eval_device()).err().expect("loading must fail").to_string()
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
    assert!(err.contains("fc1.weight") && err.contains("inside the model's directory"), "{err}");
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
    assert!(err.contains("external data") && err.contains("outside") && err.contains("weights.bin"), "{err}");
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
