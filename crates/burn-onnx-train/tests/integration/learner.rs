//! An `OnnxModel` trained by burn-train's `Learner` (feature `learner`, issue 29): refkit's
//! MLP as a classifier and gpt2_tiny as a language model, on the batches `onnx-train
//! train` draws, with Burn's SGD. The Learner's parameters end where our runner's do
//! (the same forward, loss and SGD steps), they moved, and the Learner's own validation
//! loss fell.

use super::common;

use std::path::Path;
use std::sync::Arc;

use burn::optim::SgdConfig;
use burn::tensor::Device;
use burn_onnx_train::OnnxModel;
use burn_onnx_train::frontend::learner::{OnnxClassifier, OnnxLanguageModel, batches};
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::TrainingConfig;
use burn_onnx_train::train::data::{Dataset, DistributedSampler, ImageDataset, Target};
use burn_onnx_train::train::process::launch::launch;
use burn_train::logger::InMemoryMetricLogger;
use burn_train::metric::LossMetric;
use burn_train::{InferenceStep, Learner, SupervisedTraining};
use common::*;
use ndarray::{ArrayD, IxDyn};

fn mlp_data() -> Arc<dyn Dataset> {
    let mut next = lcg(5);
    let x = ArrayD::from_shape_fn(IxDyn(&[64, 784]), |_| (next() % 1000) as f32 / 1000.0 - 0.5);
    let y = ArrayD::from_shape_fn(IxDyn(&[64]), |_| (next() % 10) as i64);
    Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap())
}

/// The batches `onnx-train train` draws for `c` on `data`, one per update, in order.
fn runner_order(c: &TrainingConfig, data: &Arc<dyn Dataset>) -> Vec<Vec<usize>> {
    let sampler = DistributedSampler {
        len: data.len(),
        batch_size: c.data.batch_size,
        rank: 0,
        world: 1,
        seed: c.train.seed,
        shuffle: true,
        balance: None,
        last_order: Default::default(),
    };
    (0..c.train.num_train_steps)
        .map(|k| sampler.batch_indices(k).unwrap())
        .collect()
}

/// Plain SGD at 0.1 for 10 updates, no clipping: what Burn's `SgdConfig::new()` does.
fn config(out: &Path, model: &str, loss: LossKind, input: &str) -> TrainingConfig {
    let mut c = sgd_config(refkit(model), loss, input);
    c.optimizer.momentum = 0.0;
    c.checkpoint.output_dir = out.to_path_buf();
    c
}

/// The Learner's parameters against the runner's trained file, and both moved from `initial`.
fn same_params(learned: &OnnxModel, trained_file: &Path, initial: &str) {
    for (name, want) in onnx_params(trained_file.to_path_buf()) {
        let got = learned.param_by_name(&name).unwrap().to_array().unwrap();
        assert_close(
            &format!("Learner vs runner: {name}"),
            &got,
            &want,
            1e-5,
            1e-5,
        );
    }
    assert_moved(&refkit(initial), trained_file, 1e-3);
}

#[test]
fn an_onnx_classifier_under_burns_learner_ends_where_the_runner_does() {
    let out = tempdir("learner-mlp-runner");
    let c = config(&out, "models/mlp.onnx", LossKind::CrossEntropy, "input");
    let data = mlp_data();
    launch(c.clone(), data.clone(), None).unwrap();
    let device = Device::flex().autodiff();
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let classifier = OnnxClassifier::new(model, "input", "logits");
    let order = runner_order(&c, &data);
    let probe = data.batch(&order[0]).unwrap();
    let before = InferenceStep::step(&classifier, probe.clone())
        .loss
        .into_scalar::<f32>();
    let result = SupervisedTraining::new(
        tempdir("learner-mlp"),
        batches(data.clone(), order.clone()),
        batches(data.clone(), order[..2].to_vec()),
    )
    .num_epochs(1)
    .with_metric_logger(InMemoryMetricLogger::new())
    .metric_train_numeric(LossMetric::new())
    .metric_valid_numeric(LossMetric::new())
    .with_application_logger(None)
    .launch(Learner::new(classifier, SgdConfig::new().init(), 0.1));
    assert!(result.error.is_none(), "{:?}", result.error);
    same_params(
        &result.model.model,
        &out.join("mlp_trained.onnx"),
        "models/mlp.onnx",
    );
    let after = InferenceStep::step(&result.model, probe)
        .loss
        .into_scalar::<f32>();
    assert!(after < before, "loss {before} -> {after}");
}

#[test]
fn an_onnx_language_model_under_burns_learner_ends_where_the_runner_does() {
    let out = tempdir("learner-gpt2-runner");
    let c = config(
        &out,
        "models/gpt2_tiny.onnx",
        LossKind::LmCrossEntropy,
        "input_ids",
    );
    let data = gpt2_tokens();
    launch(c.clone(), data.clone(), None).unwrap();
    let device = Device::flex().autodiff();
    let model = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let lm = OnnxLanguageModel::new(model, "input_ids", "logits");
    let order = runner_order(&c, &data);
    let probe = data.batch(&order[0]).unwrap();
    let before = InferenceStep::step(&lm, probe.clone())
        .loss
        .into_scalar::<f32>();
    let result = SupervisedTraining::new(
        tempdir("learner-gpt2"),
        batches(data.clone(), order.clone()),
        batches(data.clone(), order[..2].to_vec()),
    )
    .num_epochs(1)
    .with_metric_logger(InMemoryMetricLogger::new())
    .metric_train_numeric(LossMetric::new())
    .with_application_logger(None)
    .launch(Learner::new(lm, SgdConfig::new().init(), 0.1));
    assert!(result.error.is_none(), "{:?}", result.error);
    same_params(
        &result.model.model,
        &out.join("gpt2_tiny_trained.onnx"),
        "models/gpt2_tiny.onnx",
    );
    let after = InferenceStep::step(&result.model, probe)
        .loss
        .into_scalar::<f32>();
    assert!(after < before, "loss {before} -> {after}");
}
