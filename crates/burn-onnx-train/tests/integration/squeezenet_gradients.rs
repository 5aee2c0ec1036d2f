//! SqueezeNet 1.1's loss and gradients against PyTorch's (torchvision's own module with the
//! refkit file's weights, float64; `tools/gen_squeezenet_grads.py`): the whole CPU path of
//! a convolutional network through our kernels (im2col convolution with the folded ReLU,
//! max pooling, concatenation) on a batch of 2 images. PyTorch's own float32 gradients
//! differ from its float64 ones by up to 9e-4 of each tensor's largest value (ReLU and
//! max-pool decisions near ties), so each tensor is held to 5e-3 of its largest value.

use super::common;

use burn_onnx_train::model::loss::cross_entropy;
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::*;

#[test]
fn squeezenet_loss_and_gradients_match_pytorch() {
    let device = eval_device().autodiff();
    let model = OnnxModel::load(refkit("models/squeezenet1_1_dynbatch.onnx"), &device).unwrap();
    let batch = npz(data("squeezenet_grads/batch.npz"));
    let x = Value::from_host(&batch["input"], &device).unwrap();
    let out = model
        .forward(vec![("input".into(), x)], Mode::Train)
        .unwrap();
    let Some(Value::Float(logits)) = out.first().cloned() else {
        panic!("no float output")
    };
    let loss = cross_entropy(logits, int(&batch["target"])).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data("squeezenet_grads/loss.json")).unwrap())
            .unwrap();
    let got_loss = f64::from(
        loss.clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap()[0],
    );
    let want_loss = want["loss_fp64"].as_f64().unwrap();
    assert!(
        (got_loss - want_loss).abs() < 1e-4,
        "loss {got_loss} vs {want_loss}"
    );

    let grads = loss.backward();
    let got: std::collections::HashMap<String, _> = model.param_grads(&grads).into_iter().collect();
    let reference = npz(data("squeezenet_grads/grads.npz"));
    assert_eq!(reference.len(), 8);
    for (name, want) in &reference {
        let want = float(want);
        let got = got[name].to_array().unwrap();
        assert_eq!(got.shape(), want.shape(), "{name}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = max_abs_diff(&got, want);
        assert!(scale > 1e-6, "{name}: an all-zero reference gradient");
        assert!(
            worst <= 5e-3 * scale,
            "{name}: max |ours - PyTorch| {worst} against largest |gradient| {scale}"
        );
    }
}
