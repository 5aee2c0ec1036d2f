//! Forward pass of every reference model against onnxruntime's outputs
//! (`inference/<model>/output_ort_legacy.npy`), at both input shapes where the kit has two.

use super::common;

use burn_onnx_train::train::data::npy::read_npy;
use burn_onnx_train::value::host_tensor::HostTensor;
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::*;

#[test]
fn mlp_matches_onnxruntime() {
    check_inference(&eval_device(), "mlp", "input.npy", "output_ort_legacy.npy");
}

#[test]
fn mlp_other_batch_matches_pytorch() {
    check_inference(
        &eval_device(),
        "mlp",
        "input_other_shape.npy",
        "output_torch_other_shape.npy",
    );
}

#[test]
fn lenet_bn_matches_onnxruntime() {
    check_inference(
        &eval_device(),
        "lenet_bn",
        "input.npy",
        "output_ort_legacy.npy",
    );
    check_inference(
        &eval_device(),
        "lenet_bn",
        "input_other_shape.npy",
        "output_torch_other_shape.npy",
    );
}

#[test]
fn squeezenet_matches_onnxruntime() {
    check_inference(
        &eval_device(),
        "squeezenet1_1",
        "input.npy",
        "output_ort_legacy.npy",
    );
}

#[test]
fn squeezenet_dynamic_batch_matches_onnxruntime() {
    check_inference(
        &eval_device(),
        "squeezenet1_1_dynbatch",
        "input.npy",
        "output_ort_legacy.npy",
    );
    check_inference(
        &eval_device(),
        "squeezenet1_1_dynbatch",
        "input_other_shape.npy",
        "output_torch_other_shape.npy",
    );
}

#[test]
fn gpt2_tiny_matches_onnxruntime() {
    check_inference(
        &eval_device(),
        "gpt2_tiny",
        "input.npy",
        "output_ort_legacy.npy",
    );
    check_inference(
        &eval_device(),
        "gpt2_tiny",
        "input_other_shape.npy",
        "output_torch_other_shape.npy",
    );
}

#[test]
fn wrong_input_is_an_error_naming_the_input() {
    let device = eval_device();
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let bad = HostTensor::Float(ndarray::ArrayD::zeros(ndarray::IxDyn(&[2, 780])));
    let err = model
        .forward(
            vec![("input".into(), Value::from_host(&bad, &device).unwrap())],
            Mode::Eval,
        )
        .err()
        .unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("input 'input'") && msg.contains("784"),
        "{msg}"
    );
    let err = model.forward(vec![], Mode::Eval).err().unwrap();
    assert!(err.to_string().contains("not provided"), "{err}");
}

/// Without a `Mode`, a model follows Burn's module state: the autodiff module trains
/// (batch statistics, running statistics updated), its `valid()` copy infers.
#[test]
fn the_default_mode_follows_burns_train_and_valid_modules() {
    use burn::module::Module;
    let device = burn::tensor::Device::flex().autodiff();
    let model = OnnxModel::load(refkit("models/lenet_bn.onnx"), &device).unwrap();
    let input = read_npy(&refkit("inference/lenet_bn/input.npy")).unwrap();
    let feed = |d: &burn::tensor::Device| {
        let name = model.graph().inputs[0].name.clone();
        vec![(name, Value::from_host(&input, d).unwrap())]
    };
    let logits = |out: &burn_onnx_train::ForwardOutput| {
        let Some(Value::Float(f)) = out.first() else {
            panic!("float logits")
        };
        f.to_array().unwrap()
    };
    assert_eq!(model.default_mode(), Mode::Train);
    let trained = model.forward_default(feed(&device)).unwrap();
    let train = model.forward(feed(&device), Mode::Train).unwrap();
    assert!(
        !trained.state_updates.is_empty(),
        "batch norm updates its statistics"
    );
    assert_eq!(logits(&trained), logits(&train));

    let valid = model.valid();
    assert_eq!(valid.default_mode(), Mode::Eval);
    let inferred = valid.forward_default(feed(&valid.device())).unwrap();
    assert!(inferred.state_updates.is_empty());
    let want = npy_f32(refkit("inference/lenet_bn/output_ort_legacy.npy"));
    assert_close(
        "valid() vs onnxruntime",
        &logits(&inferred),
        &want,
        1e-4,
        1e-4,
    );
    assert_ne!(
        logits(&inferred),
        logits(&trained),
        "batch vs running statistics"
    );
}
