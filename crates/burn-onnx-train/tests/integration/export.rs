//! Export round trip and malformed input.
//!
//! * An exported untrained model gives onnxruntime's reference output through our importer,
//!   and (with the `onnx` Python package) has exactly the original's nodes and attributes.
//! * After a few training steps, the exported file reloads to the same parameters and
//!   outputs; when a Python with onnxruntime is available (`ONNX_TRAIN_PYTHON`, set by
//!   `.ci/run`), onnxruntime itself runs the exported file and must agree.
//! * Truncated, corrupted and structurally invalid files are errors, never panics.

use super::common;

use std::path::Path;
use std::process::Command;

use burn::module::Module;
use burn::optim::{GradientsParams, SgdConfig};
use burn_onnx_train::model::loss::cross_entropy;
use burn_onnx_train::onnx::export::{export_bytes, export_onnx};
use burn_onnx_train::train::data::npy::{read_npy, write_npy};
use burn_onnx_train::{Graph, Mode, OnnxError, OnnxModel, Value};
use common::*;
use onnx_ir::{Message, ModelProto};

fn mlp_output(model: &OnnxModel, x: &Value) -> ndarray::ArrayD<f32> {
    let out = model
        .forward(vec![("input".into(), x.clone())], Mode::Eval)
        .unwrap();
    let Some(Value::Float(y)) = out.first() else {
        panic!()
    };
    y.to_array().unwrap()
}

#[test]
fn untrained_export_reproduces_onnxruntime_output() {
    let dir = tempdir("untrained");
    for name in ["mlp", "gpt2_tiny", "lenet_bn", "squeezenet1_1"] {
        let device = eval_device();
        let model = OnnxModel::load(refkit(&format!("models/{name}.onnx")), &device).unwrap();
        let path = dir.join(format!("{name}.onnx"));
        export_onnx(&model, &path).unwrap();
        let again = OnnxModel::load(&path, &device).unwrap();
        let x = Value::from_host(
            &read_npy(refkit(&format!("inference/{name}/input.npy"))).unwrap(),
            &device,
        )
        .unwrap();
        let input = again.graph().inputs[0].name.clone();
        let out = again.forward(vec![(input, x)], Mode::Eval).unwrap();
        let Some(Value::Float(y)) = out.first() else {
            panic!()
        };
        let want = npy_f32(refkit(&format!("inference/{name}/output_ort_legacy.npy")));
        assert_close(name, &y.to_array().unwrap(), &want, 1e-4, 1e-4);
        // With the onnx package: nodes, attributes (field presence included), opsets and
        // graph inputs/outputs are exactly the original's, and the file passes the checker.
        if let Some(python) = python_for("ONNX_TRAIN_PYTHON", "onnx.checker node identity") {
            let script =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/onnx_nodes_equal.py");
            let out = Command::new(python)
                .arg(script)
                .arg(refkit(&format!("models/{name}.onnx")))
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn trained_export_round_trips_through_importer_and_onnxruntime() {
    let dir = tempdir("trained");
    let device = train_device();
    let mut model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let batch = npz(refkit("train/mlp/batch.npz"));
    let x = Value::from_host(&batch["input"], &device).unwrap();
    let mut optim = SgdConfig::new().init();
    for _ in 0..3 {
        let out = model
            .forward(vec![("input".into(), x.clone())], Mode::Train)
            .unwrap();
        let Some(Value::Float(logits)) = out.first().cloned() else {
            panic!()
        };
        let loss = cross_entropy(logits, int(&batch["target"])).unwrap();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.1, model, grads);
    }
    let path = dir.join("mlp_trained.onnx");
    export_onnx(&model, &path).unwrap();

    let eval = eval_device();
    let reloaded = OnnxModel::load(&path, &eval).unwrap();
    let original = OnnxModel::load(refkit("models/mlp.onnx"), &eval).unwrap();
    for (i, info) in model.param_infos().iter().enumerate() {
        let trained = model.param_value(i).unwrap().to_array().unwrap();
        let back = reloaded
            .param_by_name(&info.name)
            .unwrap()
            .to_array()
            .unwrap();
        assert_eq!(
            trained, back,
            "{} changed on the way through the file",
            info.name
        );
        let before = original
            .param_by_name(&info.name)
            .unwrap()
            .to_array()
            .unwrap();
        assert!(
            max_abs_diff(&trained, &before) > 1e-4,
            "{} was not trained",
            info.name
        );
    }
    let x_eval = Value::from_host(&batch["input"], &eval).unwrap();
    let ours = mlp_output(&reloaded, &x_eval);
    let in_memory = mlp_output(&model.valid(), &x_eval);
    assert_close("reloaded vs in-memory", &ours, &in_memory, 1e-6, 0.0);

    // onnxruntime on the exported file, when a Python with onnxruntime is available.
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "onnxruntime export") else {
        return;
    };
    let input = dir.join("input.npy");
    write_npy(&input, &x_eval).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/ort_run.py");
    let status = Command::new(python)
        .arg(script)
        .arg(&path)
        .arg(dir.join("ort"))
        .arg(format!("input={}", input.display()))
        .status()
        .unwrap();
    assert!(status.success(), "onnxruntime failed on the exported file");
    let ort = npy_f32(dir.join("ort/logits.npy"));
    assert_close("onnxruntime on exported file", &ours, &ort, 1e-5, 1e-5);
}

fn load_err(bytes: &[u8]) -> Option<OnnxError> {
    Graph::from_bytes(bytes, Some(Path::new("bad.onnx"))).err()
}

#[test]
fn truncated_and_corrupted_files_are_errors() {
    let bytes = std::fs::read(refkit("models/gpt2_tiny.onnx")).unwrap();
    assert!(load_err(&[]).is_some(), "empty file");
    assert!(
        load_err(b"definitely not protobuf \xff\xff\xff").is_some(),
        "garbage"
    );
    for cut in [
        1,
        10,
        100,
        1000,
        bytes.len() / 3,
        bytes.len() / 2,
        bytes.len() - 7,
        bytes.len() - 1,
    ] {
        let err = load_err(&bytes[..cut])
            .unwrap_or_else(|| panic!("truncated at {cut} of {} loaded", bytes.len()));
        assert!(
            err.to_string().contains("bad.onnx") || matches!(err, OnnxError::Node { .. }),
            "{err}"
        );
    }
    // Flipped bytes: decoding may succeed or fail, but loading and running never panic.
    let device = eval_device();
    let ids = Value::Int(ndarray::ArrayD::zeros(ndarray::IxDyn(&[1, 4])));
    for seed in 0..24usize {
        let mut b = bytes.clone();
        for k in 0..8 {
            let i = (seed * 2_654_435_761 + k * 40_503) % b.len();
            b[i] ^= 0x5a;
        }
        if let Ok(g) = Graph::from_bytes(&b, None)
            && let Ok(m) = OnnxModel::from_graph(g, &device)
        {
            let _ = m.forward(vec![("input_ids".into(), ids.clone())], Mode::Eval);
        }
    }
}

fn mlp_proto() -> ModelProto {
    ModelProto::parse_from_bytes(&std::fs::read(refkit("models/mlp.onnx")).unwrap()).unwrap()
}

#[test]
fn structural_errors_name_the_node_or_field() {
    let mut m = mlp_proto();
    m.graph.as_mut().unwrap().node[1].op_type = "FancyRelu".into();
    let err = Graph::from_proto(m, None).unwrap_err().to_string();
    assert!(
        err.contains("FancyRelu") && err.contains("unsupported"),
        "{err}"
    );

    let mut m = mlp_proto();
    let node_name = m.graph.as_ref().unwrap().node[1].name.clone();
    m.graph.as_mut().unwrap().node[1].input[0] = "nowhere".into();
    let err = Graph::from_proto(m, None).unwrap_err().to_string();
    assert!(err.contains("nowhere") && err.contains(&node_name), "{err}");

    let mut m = mlp_proto();
    let init = &mut m.graph.as_mut().unwrap().initializer[0];
    let name = init.name.clone();
    init.raw_data = init.raw_data.slice(..init.raw_data.len() - 4);
    let err = Graph::from_proto(m, None).unwrap_err().to_string();
    assert!(err.contains(&name) && err.contains("raw_data"), "{err}");

    let mut m = mlp_proto();
    m.opset_import.clear();
    let err = Graph::from_proto(m, None).unwrap_err().to_string();
    assert!(err.contains("opset"), "{err}");

    let mut m = mlp_proto();
    m.graph.as_mut().unwrap().output[0].name = "ghost".into();
    let err = Graph::from_proto(m, None).unwrap_err().to_string();
    assert!(err.contains("ghost"), "{err}");

    // A recursive local function is an error, not a stack overflow.
    let mut m = mlp_proto();
    let relu = m.graph.as_ref().unwrap().node[1].clone();
    m.graph.as_mut().unwrap().node[1].domain = "custom".into();
    m.graph.as_mut().unwrap().node[1].op_type = "Forever".into();
    m.functions.push(Default::default());
    let f = m.functions.last_mut().unwrap();
    (f.domain, f.name, f.input, f.output) = (
        "custom".into(),
        "Forever".into(),
        relu.input.clone(),
        relu.output.clone(),
    );
    let mut body = m.graph.as_ref().unwrap().node[1].clone();
    body.name = "again".into();
    f.node.push(body);
    let err = Graph::from_proto(m, None).unwrap_err().to_string();
    assert!(err.contains("nest deeper"), "{err}");

    // A runtime shape error names the node.
    let mut m = mlp_proto();
    m.graph.as_mut().unwrap().node[0]
        .attribute
        .retain(|a| a.name != "transB");
    let model = OnnxModel::from_graph(Graph::from_proto(m, None).unwrap(), &eval_device()).unwrap();
    let x = Value::Float(
        burn_onnx_train::FloatValue::from_array(
            &ndarray::ArrayD::zeros(ndarray::IxDyn(&[2, 784])),
            &eval_device(),
        )
        .unwrap(),
    );
    let err = model
        .forward(vec![("input".into(), x)], Mode::Eval)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("Gemm") && err.contains("inner dimensions"),
        "{err}"
    );
    assert!(!export_bytes(&model).unwrap().is_empty());
}

/// Burn's `SafetensorsStore` with the ONNX-name adapters: `save_into` writes gpt2_tiny's
/// parameters under their ONNX initializer names with the initializers' shapes and values
/// (Python reads the file by the format's definition and compares each tensor with the
/// ONNX file's initializer of that name), and `load_from` takes a file Python wrote with
/// every value doubled back into the model.
#[test]
fn burn_store_saves_and_loads_by_onnx_names_with_logical_shapes() {
    use burn::store::{ModuleSnapshot, SafetensorsStore};
    use burn_onnx_train::model::named_store::{loading_by_onnx_names, saving_by_onnx_names};

    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "burn-store by ONNX names") else {
        return;
    };
    let onnx = refkit("models/gpt2_tiny.onnx");
    let dir = tempdir("named-store");
    let (saved, doubled) = (
        dir.join("saved.safetensors"),
        dir.join("doubled.safetensors"),
    );
    let mut model = OnnxModel::load(&onnx, &burn::tensor::Device::flex()).unwrap();
    let mut store = saving_by_onnx_names(&model, SafetensorsStore::from_file(&saved));
    model.save_into(&mut store).unwrap();
    let script = r#"
import json, struct, sys
import numpy as np, onnx
from onnx import numpy_helper
onnx_path, saved, doubled = sys.argv[1:4]
inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(onnx_path).graph.initializer}
raw = open(saved, "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
header.pop("__metadata__", None)
tensors = {}
for name, t in header.items():
    assert name in inits, f"{name} is no initializer"
    a, b = t["data_offsets"]
    v = np.frombuffer(raw[8 + n + a:8 + n + b], dtype="<f4").reshape(t["shape"])
    assert list(v.shape) == list(inits[name].shape), (name, v.shape, inits[name].shape)
    assert np.array_equal(v, inits[name]), name
    tensors[name] = v
assert len(tensors) == 28, len(tensors)
meta, offset, blobs = {}, 0, []
for name, v in tensors.items():
    b = (2 * v).astype("<f4").tobytes()
    meta[name] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [offset, offset + len(b)]}
    offset += len(b)
    blobs.append(b)
h = json.dumps(meta).encode()
h += b" " * (-len(h) % 8)
open(doubled, "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
print("ok", len(tensors))
"#;
    python_says_ok(
        &python,
        script,
        &[onnx.as_os_str(), saved.as_os_str(), doubled.as_os_str()],
    );
    let before: Vec<(String, ndarray::ArrayD<f32>)> = model
        .param_infos()
        .iter()
        .map(|i| {
            (
                i.name.clone(),
                model.param_by_name(&i.name).unwrap().to_array().unwrap(),
            )
        })
        .collect();
    let mut back = loading_by_onnx_names(&model, SafetensorsStore::from_file(&doubled)).unwrap();
    let result = model.load_from(&mut back).unwrap();
    assert!(
        result.errors.is_empty() && result.missing.is_empty(),
        "{result:?}"
    );
    for (name, was) in before {
        let now = model.param_by_name(&name).unwrap().to_array().unwrap();
        assert_eq!(now, was.mapv(|v| 2.0 * v), "{name}");
    }
}
