//! Data parallelism with worker threads (`data_parallel_size` without mpirun): N ranks of
//! per-rank batch B end with the same parameters as one process with batch N*B, after 10
//! SGD updates, on gpt2_tiny and on the MLP.

use super::common;

use std::path::Path;
use std::sync::Arc;

use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::data::{Dataset, ImageDataset, Target, TokenDataset};
use burn_onnx_train::train::process::launch::launch;
use common::*;
use ndarray::{ArrayD, IxDyn};

/// The data-parallel run ends where the single process does, and both moved away from the
/// initial weights (by far more than the tolerance).
fn compare(initial: &Path, single: &Path, parallel: &Path, file: &str) {
    for ((name, a), (_, b)) in onnx_params(single.join(file))
        .iter()
        .zip(onnx_params(parallel.join(file)))
    {
        assert_close(&format!("{file}: {name}"), &b, a, 1e-5, 0.0);
    }
    assert_moved(initial, &single.join(file), 1e-3);
}

fn gpt2_case(ranks: usize, per_rank: usize) {
    let mut next = lcg(99);
    let data: Arc<dyn Dataset> = Arc::new(
        TokenDataset::from_tokens((0..16 * 96).map(|_| (next() % 1024) as i64).collect(), 16)
            .unwrap(),
    );
    let (one, many) = (
        tempdir(&format!("dp-gpt2-1-{ranks}")),
        tempdir(&format!("dp-gpt2-{ranks}")),
    );
    let base = |out: &Path| {
        let mut c = sgd_config(
            refkit("models/gpt2_tiny.onnx"),
            LossKind::LmCrossEntropy,
            "input_ids",
        );
        c.checkpoint.output_dir = out.to_path_buf();
        c
    };
    launch(
        {
            let mut c = base(&one);
            c.data.batch_size = ranks * per_rank;
            c
        },
        data.clone(),
        None,
    )
    .unwrap();
    let summary = launch(
        {
            let mut c = base(&many);
            c.data.batch_size = per_rank;
            c.parallel.data_parallel_size = ranks;
            c
        },
        data,
        None,
    )
    .unwrap();
    assert_eq!(summary.losses.len(), 10);
    assert_eq!(summary.perf.unwrap().world_size, ranks);
    compare(
        &refkit("models/gpt2_tiny.onnx"),
        &one,
        &many,
        "gpt2_tiny_trained.onnx",
    );
}

#[test]
fn gpt2_tiny_two_ranks_equal_one_process_with_double_batch() {
    gpt2_case(2, 2);
}

#[test]
fn gpt2_tiny_four_ranks_equal_one_process_with_quadruple_batch() {
    gpt2_case(4, 1);
}

#[test]
fn mlp_two_ranks_equal_one_process_with_double_batch() {
    let mut next = lcg(5);
    let x = ArrayD::from_shape_fn(IxDyn(&[64, 784]), |_| (next() % 1000) as f32 / 1000.0 - 0.5);
    let y = ArrayD::from_shape_fn(IxDyn(&[64]), |_| (next() % 10) as i64);
    let data: Arc<dyn Dataset> = Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap());
    let (one, many) = (tempdir("dp-mlp-1"), tempdir("dp-mlp-2"));
    let base = |out: &Path| {
        let mut c = sgd_config(refkit("models/mlp.onnx"), LossKind::CrossEntropy, "input");
        c.checkpoint.output_dir = out.to_path_buf();
        c
    };
    launch(
        {
            let mut c = base(&one);
            c.data.batch_size = 8;
            c
        },
        data.clone(),
        None,
    )
    .unwrap();
    launch(
        {
            let mut c = base(&many);
            c.data.batch_size = 4;
            c.parallel.data_parallel_size = 2;
            c
        },
        data,
        None,
    )
    .unwrap();
    compare(&refkit("models/mlp.onnx"), &one, &many, "mlp_trained.onnx");
}

#[test]
fn a_failing_rank_fails_the_whole_run() {
    // Rank-local data that cannot fill a batch fails on every rank at start-up.
    let data: Arc<dyn Dataset> =
        Arc::new(TokenDataset::from_tokens((0..64).collect(), 16).unwrap());
    let out = tempdir("dp-fail");
    let c = {
        let mut c = sgd_config(
            refkit("models/gpt2_tiny.onnx"),
            LossKind::LmCrossEntropy,
            "input_ids",
        );
        c.data.batch_size = 4;
        c.parallel.data_parallel_size = 2;
        c.checkpoint.output_dir = out.clone();
        c
    };
    let err = launch(c, data, None).err().unwrap().to_string();
    assert!(err.contains("config.data.batch_size"), "{err}");
}
