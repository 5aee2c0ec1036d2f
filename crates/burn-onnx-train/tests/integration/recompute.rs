//! Activation recomputation (`recompute_segments`): training segment by segment, with each
//! segment's forward re-run in backward, gives the plain run's losses and parameters, on
//! gpt2_tiny, a tied-embedding GPT-2 with AdamW and clipping, and LeNet with batch norm
//! (whose running statistics update once per step, not once per re-run).

use super::common;

use std::path::Path;
use std::sync::Arc;

use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::data::{Dataset, ImageDataset, Target, TokenDataset};
use burn_onnx_train::train::process::launch::launch;
use burn_onnx_train::train::{RunSummary, TrainingConfig};
use common::*;
use ndarray::{ArrayD, IxDyn};

/// Run `c` plain and with `segments` recomputed segments; the losses agree exactly (the
/// forward passes are the same arithmetic), every parameter within `atol` (gradients of
/// values used on both sides of a cut are summed in another order), and the plain run moved.
fn compare(c: TrainingConfig, data: Arc<dyn Dataset>, segments: usize, atol: f32) {
    let stem = c
        .model
        .model_path
        .file_stem()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let (plain, re) = (
        tempdir(&format!("rc-{stem}-plain")),
        tempdir(&format!("rc-{stem}-{segments}")),
    );
    let run = |out: &Path, n: usize| -> RunSummary {
        launch(
            {
                let mut cfg = c.clone();
                cfg.checkpoint.output_dir = out.to_path_buf();
                cfg.parallel.recompute_segments = n;
                cfg
            },
            data.clone(),
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let (a, b) = (run(&plain, 0), run(&re, segments));
    assert_eq!(
        a.losses[0], b.losses[0],
        "the first loss is the same forward pass"
    );
    for ((s, x), (_, y)) in a.losses.iter().zip(&b.losses) {
        assert!(
            (x - y).abs() <= 1e-5 * x.abs(),
            "update {s}: loss {x} vs {y}"
        );
    }
    let file = format!("{stem}_trained.onnx");
    for ((name, x), (_, y)) in onnx_params(plain.join(&file))
        .iter()
        .zip(onnx_params(re.join(&file)))
    {
        assert_close(&format!("{segments} segments: {name}"), &y, x, atol, 0.0);
    }
    assert_moved(&c.model.model_path, &plain.join(&file), 1e-3);
}

fn tokens(vocab: u64) -> Arc<dyn Dataset> {
    let mut next = lcg(11);
    Arc::new(
        TokenDataset::from_tokens((0..16 * 64).map(|_| (next() % vocab) as i64).collect(), 16)
            .unwrap(),
    )
}

#[test]
fn gpt2_tiny_recomputed_in_four_segments_trains_as_the_plain_pass() {
    let c = {
        let mut c = sgd_config(
            refkit("models/gpt2_tiny.onnx"),
            LossKind::LmCrossEntropy,
            "input_ids",
        );
        c.data.batch_size = 4;
        c.eval.eval_batch_size = 4;
        c
    };
    compare(c, tokens(1024), 4, 1e-6);
}

#[test]
fn a_tied_embedding_gpt2_with_adamw_and_clipping_recomputes_exactly_enough() {
    let model = small_gpt2("rc-tied", "gpt2_tied.onnx", 3, 2, 256);
    let c = {
        let mut c = sgd_config(model, LossKind::LmCrossEntropy, "input_ids");
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Adamw,
            ..Default::default()
        };
        c.lr = LrConfig {
            initial_lr: 3e-3,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.5;
        c.data.batch_size = 4;
        c.eval.eval_batch_size = 4;
        c.train.gradient_accumulation_steps = 2;
        c
    };
    compare(c, tokens(256), 3, 1e-5);
}

#[test]
fn lenet_batch_norm_statistics_update_once_per_step() {
    let mut next = lcg(2);
    let x = ArrayD::from_shape_fn(IxDyn(&[32, 1, 28, 28]), |_| (next() % 1000) as f32 / 1000.0);
    let y = ArrayD::from_shape_fn(IxDyn(&[32]), |_| (next() % 10) as i64);
    let data: Arc<dyn Dataset> = Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap());
    let c = {
        let mut c = sgd_config(
            refkit("models/lenet_bn.onnx"),
            LossKind::CrossEntropy,
            "input",
        );
        c.data.batch_size = 8;
        c.eval.eval_batch_size = 8;
        c.lr = LrConfig {
            initial_lr: 0.05,
            ..Default::default()
        };
        c
    };
    compare(c, data, 3, 1e-6);
}

#[test]
fn bad_segment_counts_are_config_errors() {
    let c = {
        let mut c = sgd_config(refkit("models/mlp.onnx"), LossKind::CrossEntropy, "input");
        c.checkpoint.output_dir = tempdir("rc-bad");
        c
    };
    assert!(
        {
            let mut cfg = c.clone();
            cfg.parallel.recompute_segments = 1;
            cfg
        }
        .validate(1)
        .unwrap_err()
        .to_string()
        .contains("config.parallel.recompute_segments")
    );
    // With a pipeline the segments are its stages: 3 with 2 stages is an error, 2 is not.
    assert!(
        {
            let mut cfg = c.clone();
            cfg.parallel.recompute_segments = 3;
            cfg.parallel.pipeline_parallel_size = 2;
            cfg
        }
        .validate(2)
        .unwrap_err()
        .to_string()
        .contains("config.parallel.recompute_segments")
    );
    assert!(
        {
            let mut cfg = c.clone();
            cfg.parallel.recompute_segments = 2;
            cfg.parallel.pipeline_parallel_size = 2;
            cfg
        }
        .validate(2)
        .is_ok()
    );
    let mut next = lcg(5);
    let x = ArrayD::from_shape_fn(IxDyn(&[16, 784]), |_| (next() % 1000) as f32 / 1000.0);
    let y = ArrayD::from_shape_fn(IxDyn(&[16]), |_| (next() % 10) as i64);
    let data: Arc<dyn Dataset> = Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap());
    let err = launch(
        {
            let mut cfg = c;
            cfg.parallel.recompute_segments = 9;
            cfg.data.batch_size = 4;
            cfg
        },
        data,
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("config.parallel.recompute_segments: 9 segments for a graph of 3 nodes"),
        "{err}"
    );
}
