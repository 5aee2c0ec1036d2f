//! `loss = "graph"` (ORT Training's way): a model that ends in its own
//! `SoftmaxCrossEntropyLoss` trains with that loss, its `labels` input fed with the batch's
//! class ids. Checked against the same MLP ending in its logits with the runner's
//! cross-entropy attached (`tools/gen_graph_loss_fixtures.py`): the same losses at every
//! update and the same trained weights, which moved.

use super::common;

use std::path::Path;
use std::sync::Arc;

use burn::tensor::Device;
use burn_onnx_train::OnnxModel;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::data::{Dataset, ImageDataset, Target};
use burn_onnx_train::train::{TrainingConfig, TrainingRunner};
use common::*;

fn images() -> Arc<dyn Dataset> {
    let n = 32;
    let x = ndarray::Array::from_shape_fn((n, 8), |(i, j)| ((i * 8 + j) as f32 * 0.37).sin())
        .into_dyn();
    let labels = ndarray::Array::from_shape_fn(n, |i| (i * 7 % 4) as i64).into_dyn();
    Arc::new(ImageDataset::new(x, Target::Classes(labels)).unwrap())
}

fn train(model: &str, loss: LossKind, output: &str, out: &Path) -> Vec<(usize, f64)> {
    let c = {
        let mut c = TrainingConfig::default();
        c.model.model_path = data(&format!("graph_loss/{model}.onnx"));
        c.checkpoint.output_dir = out.to_path_buf();
        c.model.input_name = "input".into();
        c.model.output_name = output.into();
        c.model.loss = loss;
        c.data.batch_size = 8;
        c.train.num_train_steps = 6;
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Sgd,
            weight_decay: 0.0,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.0;
        c.lr = LrConfig {
            initial_lr: 0.5,
            ..Default::default()
        };
        c.logging.progress = false;
        c
    };
    let runner = TrainingRunner::new(
        c,
        Arc::new(burn_ort_dist::LocalCommunicator),
        Device::flex().autodiff(),
    )
    .unwrap();
    runner.run(images(), None).unwrap().losses
}

#[test]
fn a_graph_ending_in_its_loss_trains_as_the_attached_loss_would() {
    let (a, b) = (tempdir("graph-loss-own"), tempdir("graph-loss-attached"));
    let own = train("mlp_sce", LossKind::Graph, "loss", &a);
    let attached = train("mlp_logits", LossKind::CrossEntropy, "logits", &b);
    assert_eq!(own.len(), 6);
    for ((step, x), (_, y)) in own.iter().zip(&attached) {
        assert!(
            (x - y).abs() < 1e-5 * (1.0 + y.abs()),
            "update {step}: {x} vs {y}"
        );
    }
    assert!(own[5].1 < own[0].1, "the loss fell: {own:?}");
    let init = OnnxModel::load(data("graph_loss/mlp_logits.onnx"), &Device::flex()).unwrap();
    let (pa, pb) = (
        onnx_params(a.join("mlp_sce_trained.onnx")),
        onnx_params(b.join("mlp_logits_trained.onnx")),
    );
    for ((name, wa), (_, wb)) in pa.iter().zip(&pb) {
        assert_close(&format!("trained {name}"), wa, wb, 1e-5, 1e-5);
        let w0 = init.param_by_name(name).unwrap().to_array().unwrap();
        assert!(max_abs_diff(wa, &w0) > 1e-4, "{name} did not move");
    }
}

#[test]
fn a_label_name_without_the_graph_loss_is_refused() {
    let out = tempdir("graph-loss-refused");
    let c = {
        let mut c = TrainingConfig::default();
        c.model.model_path = data("graph_loss/mlp_logits.onnx");
        c.checkpoint.output_dir = out;
        c.model.loss = LossKind::CrossEntropy;
        c.model.label_name = Some("labels".into());
        c
    };
    let err = TrainingRunner::new(
        c,
        Arc::new(burn_ort_dist::LocalCommunicator),
        Device::flex().autodiff(),
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains("label_name"), "{err}");
}
