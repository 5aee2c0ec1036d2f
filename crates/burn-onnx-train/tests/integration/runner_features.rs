//! Config fields of the runner, each exercised end to end on gpt2_tiny or the MLP: frozen
//! and selected weights, `checkpoint_to_load_path`, a custom `checkpoints_dir`, MSE
//! training, `histogram_weights` and `norm_weights`, `num_train_epochs`, evaluation split
//! across thread ranks, and the checks that refuse a run before its first step.

use super::common;

use std::path::Path;
use std::sync::Arc;

use burn::tensor::Device;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::checkpoint::list_checkpoints;
use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind, ScheduleKind};
use burn_onnx_train::train::data::npy::write_npy;
use burn_onnx_train::train::data::{Dataset, ImageDataset, Target, TokenDataset};
use burn_onnx_train::train::process::launch::launch;
use burn_onnx_train::train::report::tensorboard::{EventKind, ValueKind, read_events, scalars};
use burn_onnx_train::train::{TrainingConfig, TrainingRunner};
use burn_onnx_train::{Mode, OnnxModel, Value};
use burn_ort_dist::LocalCommunicator;
use common::*;
use ndarray::{ArrayD, IxDyn};

const WPE: &str = "m.transformer.wpe.weight";
const WTE: &str = "m.transformer.wte.weight";

fn trained(out: &Path) -> Vec<(String, ArrayD<f32>)> {
    onnx_params(out.join("gpt2_tiny_trained.onnx"))
}

fn try_run(
    c: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
) -> Result<(), String> {
    let runner = TrainingRunner::new(c, Arc::new(LocalCommunicator), Device::flex().autodiff())
        .map_err(|e| e.to_string())?;
    runner
        .run(train, test)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn frozen_weights_stay_bit_identical_and_the_rest_moves() {
    let out = tempdir("feat-frozen");
    run_local({
        let mut c = gpt2_config(&out);
        c.model.weights_not_to_train = vec![WPE.into()];
        c
    });
    let init = onnx_params(refkit("models/gpt2_tiny.onnx"));
    for ((name, a), (_, b)) in init.iter().zip(trained(&out)) {
        if name == WPE {
            assert_eq!(a, &b, "frozen {name} changed");
        } else {
            assert!(max_abs_diff(a, &b) > 0.0, "{name} did not train");
        }
    }
}

#[test]
fn weights_to_train_trains_exactly_those() {
    let out = tempdir("feat-only");
    run_local({
        let mut c = gpt2_config(&out);
        c.model.weights_to_train = vec![WTE.into()];
        c
    });
    for ((name, a), (_, b)) in onnx_params(refkit("models/gpt2_tiny.onnx"))
        .iter()
        .zip(trained(&out))
    {
        assert_eq!(
            name == WTE,
            max_abs_diff(a, &b) > 0.0,
            "{name}: trained iff listed"
        );
    }
}

#[test]
fn checkpoint_to_load_path_resumes_from_that_checkpoint_in_a_custom_dir() {
    let (full, ckpts, resumed) = (
        tempdir("feat-ckpt-full"),
        tempdir("feat-ckpt-dir"),
        tempdir("feat-ckpt-resumed"),
    );
    let c = {
        let mut c = gpt2_config(&full);
        c.checkpoint.checkpoint_period = 2;
        c.checkpoint.max_num_checkpoints = 5;
        c.checkpoint.checkpoints_dir = Some(ckpts.clone());
        c
    };
    let first = run_local(c.clone());
    assert!(
        !full.join("checkpoints").exists(),
        "checkpoints go to checkpoints_dir, not <output_dir>/checkpoints"
    );
    assert_eq!(
        list_checkpoints(&ckpts)
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>(),
        vec![2, 4, 6]
    );
    // Resume from the step-2 checkpoint explicitly, although newer ones exist.
    let again = run_local({
        let mut cfg = c;
        cfg.checkpoint.output_dir = resumed.clone();
        cfg.checkpoint.checkpoints_dir = Some(resumed.join("ck"));
        cfg.checkpoint.checkpoint_to_load_path = Some(ckpts.join("ckpt-000000002"));
        cfg
    });
    assert_eq!(again.start_step, 2);
    assert_eq!(again.losses.len(), 4);
    assert_eq!(again.losses[3].1, first.losses[5].1);
    for ((name, a), (_, b)) in trained(&full).iter().zip(trained(&resumed)) {
        assert_eq!(
            a, &b,
            "{name} differs after resuming from checkpoint_to_load_path"
        );
    }
}

#[test]
fn resuming_a_checkpoint_of_an_incompatible_run_is_an_error() {
    let out = tempdir("feat-incompatible");
    let c = {
        let mut c = gpt2_config(&out);
        c.train.num_train_steps = 2;
        c.checkpoint.checkpoint_period = 2;
        c
    };
    run_local(c.clone());
    let err = try_run(
        {
            let mut cfg = c.clone();
            cfg.data.batch_size = 2;
            cfg.train.num_train_steps = 4;
            cfg
        },
        gpt2_tokens(),
        None,
    )
    .unwrap_err();
    assert!(
        err.contains("config.data.batch_size") && err.contains("ckpt-000000002"),
        "{err}"
    );
    // Two thread ranks continue it when they keep the global batch (2 x 2 = 4 x 1); the
    // same two ranks with batches of 4 would double it.
    let err = launch(
        {
            let mut cfg = c.clone();
            cfg.parallel.data_parallel_size = 2;
            cfg.train.num_train_steps = 4;
            cfg
        },
        gpt2_tokens(),
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("global batch of 8"), "{err}");
    let summary = launch(
        {
            let mut cfg = c;
            cfg.parallel.data_parallel_size = 2;
            cfg.data.batch_size = 2;
            cfg.train.num_train_steps = 4;
            cfg
        },
        gpt2_tokens(),
        None,
    )
    .unwrap();
    assert_eq!(summary.start_step, 2);
}

#[test]
fn mse_trains_end_to_end_with_the_loss_numpy_would_compute() {
    let mut next = lcg(3);
    let x = ArrayD::from_shape_fn(IxDyn(&[32, 784]), |_| (next() % 1000) as f32 / 1000.0 - 0.5);
    let t = ArrayD::from_shape_fn(IxDyn(&[32, 10]), |_| (next() % 1000) as f32 / 500.0 - 1.0);
    let data: Arc<dyn Dataset> =
        Arc::new(ImageDataset::new(x.clone(), Target::Values(t.clone())).unwrap());
    let out = tempdir("feat-mse");
    let c = {
        let mut c = gpt2_config(&out);
        c.model.model_path = refkit("models/mlp.onnx");
        c.model.input_name = "input".into();
        c.model.loss = LossKind::Mse;
        c.data.batch_size = 32;
        c.train.num_train_steps = 10;
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Sgd,
            momentum: 0.9,
            weight_decay: 0.0,
            ..Default::default()
        };
        c.lr = LrConfig {
            initial_lr: 0.05,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.0;
        c
    };
    let runner =
        TrainingRunner::new(c, Arc::new(LocalCommunicator), Device::flex().autodiff()).unwrap();
    let summary = runner.run(data, None).unwrap();
    // The first update's loss is mean((f(x) - t)^2) over the whole batch, in f64 on the host.
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &Device::flex()).unwrap();
    let y = model
        .forward(
            vec![(
                "input".into(),
                Value::Float(burn_onnx_train::FloatValue::from_array(&x, &Device::flex()).unwrap()),
            )],
            Mode::Eval,
        )
        .unwrap();
    let Some(Value::Float(y)) = y.first().cloned() else {
        panic!()
    };
    let y = y.to_array().unwrap();
    let want: f64 = y
        .iter()
        .zip(t.iter())
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
        .sum::<f64>()
        / y.len() as f64;
    assert!(
        (summary.losses[0].1 - want).abs() < 1e-5 * want.max(1.0),
        "{} vs {want}",
        summary.losses[0].1
    );
    assert!(
        summary.losses[9].1 < 0.9 * summary.losses[0].1,
        "MSE did not decrease: {:?}",
        summary.losses
    );
    assert_moved(
        &refkit("models/mlp.onnx"),
        &out.join("mlp_trained.onnx"),
        1e-3,
    );
}

#[test]
fn histograms_and_norm_summaries_reach_tensorboard() {
    summaries_reach_tensorboard("feat-tb", 1, 0);
}

#[test]
fn weight_summaries_of_a_zero_3_run_are_of_the_whole_weights() {
    // Two thread ranks at ZeRO-3, the same global batch: rank 0 logs the norms and
    // histograms of the gathered weights, equal to one process's.
    summaries_reach_tensorboard("feat-tb-zero3", 2, 3);
}

/// Norms every display step and histograms at each evaluation, on `ranks` data-parallel
/// thread ranks at `zero_stage` (global batch 4 either way).
fn summaries_reach_tensorboard(tag: &str, ranks: usize, zero_stage: usize) {
    let out = tempdir(tag);
    burn_onnx_train::train::process::launch::launch(
        {
            let mut c = gpt2_config(&out);
            c.logging.log_dir = None;
            c.logging.display_loss_steps = 2;
            c.eval.evaluation_period = 3;
            c.logging.histogram_weights = vec![WPE.into()];
            c.logging.norm_weights = vec![WPE.into(), "*".into()];
            c.parallel.data_parallel_size = ranks;
            c.data.batch_size = 4 / ranks;
            c.parallel.zero_stage = zero_stage;
            c
        },
        gpt2_tokens(),
        Some(gpt2_tokens()),
    )
    .unwrap();
    let file = std::fs::read_dir(out.join("tensorboard"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let events = read_events(&file).unwrap();
    let s = scalars(&events);
    let norms: Vec<_> = s
        .iter()
        .filter(|(t, _, _)| *t == format!("norms/weight/{WPE}"))
        .collect();
    assert_eq!(
        norms.iter().map(|(_, step, _)| *step).collect::<Vec<_>>(),
        vec![2, 4, 6],
        "every display step"
    );
    assert!(
        s.iter()
            .any(|(t, step, v)| *t == format!("norms/gradient/{WTE}") && *step == 2 && *v > 0.0),
        "'*' selects every weight"
    );
    // The weight norm logged at update 2 is that of the weights after update 2: recompute it
    // from a 2-update run.
    let one = tempdir(&format!("{tag}-one"));
    run_local({
        let mut c = gpt2_config(&one);
        c.train.num_train_steps = 2;
        c
    });
    let w1 = trained(&one).into_iter().find(|(n, _)| n == WPE).unwrap().1;
    let want = w1.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
    assert!(
        (f64::from(norms[0].2) - want).abs() < 1e-4 * want,
        "{} vs {want}",
        norms[0].2
    );
    let histos: Vec<i64> = events
        .iter()
        .filter_map(|e| match &e.what {
            Some(EventKind::Summary(sm))
                if sm.value.iter().any(|v| {
                    v.tag == format!("weights/{WPE}")
                        && matches!(v.value, Some(ValueKind::Histo(_)))
                }) =>
            {
                Some(e.step)
            }
            _ => None,
        })
        .collect();
    assert_eq!(histos, vec![3, 6], "a histogram at each evaluation");
}

#[test]
fn epochs_set_the_number_of_updates() {
    let out = tempdir("feat-epochs");
    // 256 windows of 16 tokens, batch 4: 64 batches per epoch; accumulation 3 rounds down.
    let summary = run_local({
        let mut c = gpt2_config(&out);
        c.train.num_train_epochs = 1;
        c.train.num_train_steps = 1;
        c.train.gradient_accumulation_steps = 3;
        c
    });
    assert_eq!(summary.losses.len(), 21);
}

#[test]
fn evaluation_split_across_thread_ranks_equals_the_single_process_one() {
    let (one, two, rep) = (
        tempdir("feat-eval-1"),
        tempdir("feat-eval-2"),
        tempdir("feat-eval-rep"),
    );
    let base = |out: &Path, dp: usize| {
        let mut c = gpt2_config(out);
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Sgd,
            weight_decay: 0.0,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.0;
        c.data.batch_size = 4 / dp;
        c.parallel.data_parallel_size = dp;
        c.eval.evaluation_period = 3;
        c.eval.eval_batches = 5;
        c
    };
    let a = launch(base(&one, 1), gpt2_tokens(), Some(gpt2_tokens())).unwrap();
    let b = launch(base(&two, 2), gpt2_tokens(), Some(gpt2_tokens())).unwrap();
    let c = launch(
        {
            let mut c = base(&rep, 2);
            c.eval.eval_partitioned = false;
            c
        },
        gpt2_tokens(),
        Some(gpt2_tokens()),
    )
    .unwrap();
    assert_eq!(a.evals.len(), 2);
    for (x, y) in a
        .evals
        .iter()
        .zip(&b.evals)
        .chain(a.evals.iter().zip(&c.evals))
    {
        assert_eq!(x.step, y.step);
        assert!(
            (x.loss - y.loss).abs() < 1e-5,
            "eval loss {} vs {}",
            x.loss,
            y.loss
        );
    }
}

#[test]
fn tensors_past_the_devices_largest_buffer_are_named_before_the_first_step() {
    use burn_onnx_train::train::precision::Precision;
    use burn_onnx_train::train::preflight::check_fits_allocation;
    let mut c = gpt2_config(&tempdir("feat-fits"));
    let model = OnnxModel::load(&c.model.model_path, &Device::flex()).unwrap();
    // gpt2_tiny's largest parameter, its 1024 x 128 token table: 524,288 bytes in f32; the
    // logits of a 4 x 16-token micro-batch over 1024 columns: 262,144.
    check_fits_allocation(&c, &model, 524_288, "dev").unwrap();
    let err = check_fits_allocation(&c, &model, 524_287, "dev")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("model.model_path: parameter `")
            && err.contains(WTE)
            && err.contains("[1024, 128], 0.5 MB in f32")
            && err.contains("the device dev allocates at once (0.5 MB)"),
        "{err}"
    );
    // ZeRO-3 and tensor parallelism split the parameters: left to the run.
    c.parallel.zero_stage = 3;
    check_fits_allocation(&c, &model, 524_287, "dev").unwrap();
    c.parallel.zero_stage = 0;
    // 16 x 16 tokens: 1,048,576 bytes of f32 logits, past a 600,000-byte buffer.
    c.data.batch_size = 16;
    let err = check_fits_allocation(&c, &model, 600_000, "dev")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("data.batch_size: one micro-batch's logits (16 x 16 tokens x 1024 columns, 4 bytes each: 1.0 MB)")
            && err.contains("lower data.batch_size or data.seq_len"),
        "{err}"
    );
    // Under f16 autocast the head writes them in f16: 524,288 bytes fit.
    c.precision.dtype = Precision::F16;
    check_fits_allocation(&c, &model, 600_000, "dev").unwrap();
    // A Gemm head (the mlp's 10 classes, padded to 64 columns, read as a language model's
    // here) adds its bias in f32 and writes f32 logits under autocast too: 16 x 16 x 64 x 4
    // = 65,536 bytes (half that if counted as f16).
    c.model.model_path = refkit("models/mlp.onnx");
    c.model.output_name = "logits".into();
    let mlp = OnnxModel::load(&c.model.model_path, &Device::flex()).unwrap();
    // (its 784 x 256 weight is past these buffers: ZeRO-3 leaves the parameters to the run)
    c.parallel.zero_stage = 3;
    check_fits_allocation(&c, &mlp, 65_536, "dev").unwrap();
    let err = check_fits_allocation(&c, &mlp, 65_535, "dev")
        .unwrap_err()
        .to_string();
    assert!(err.contains("x 64 columns, 4 bytes each"), "{err}");
}

#[test]
fn bad_data_and_configs_fail_before_the_first_step() {
    let out = tempdir("feat-preflight");
    let c = gpt2_config(&out);
    // Token ids beyond the embedding table.
    let big: Arc<dyn Dataset> = Arc::new(
        TokenDataset::from_tokens(
            (0..512)
                .map(|i| if i == 300 { 5000 } else { i % 1000 })
                .collect(),
            16,
        )
        .unwrap(),
    );
    let err = try_run(c.clone(), big, None).unwrap_err();
    assert!(
        err.contains("config.data.train_data_dir")
            && err.contains("5000")
            && err.contains(WTE)
            && err.contains("1024"),
        "{err}"
    );
    // A negative token id in a shard file: named with the file and its index there.
    let shards = out.join("negative-ids");
    std::fs::create_dir_all(&shards).unwrap();
    let ints = |v: Vec<i64>| Value::Int(ArrayD::from_shape_vec(IxDyn(&[v.len()]), v).unwrap());
    write_npy(shards.join("a.npy"), &ints((0..64).collect())).unwrap();
    write_npy(
        shards.join("b.npy"),
        &ints((0..64).map(|i| if i == 5 { -7 } else { i }).collect()),
    )
    .unwrap();
    let negative: Arc<dyn Dataset> = Arc::new(TokenDataset::load(&shards, 16).unwrap());
    let err = try_run(c.clone(), negative, None).unwrap_err();
    assert!(
        err.contains("token id -7 (index 5 of") && err.contains("b.npy) is negative"),
        "{err}"
    );
    // A class label beyond the classifier's declared classes (mlp: logits [batch, 10]).
    let images = out.join("labels");
    std::fs::create_dir_all(&images).unwrap();
    let pixels = ArrayD::from_shape_fn(IxDyn(&[8, 784]), |ix| (ix[1] % 7) as f32 / 7.0);
    let pixels = burn_onnx_train::FloatValue::from_array(&pixels, &Device::flex()).unwrap();
    write_npy(images.join("images_0.npy"), &Value::Float(pixels)).unwrap();
    write_npy(
        images.join("labels_0.npy"),
        &ints((0..8).map(|i| if i == 3 { 12 } else { i }).collect()),
    )
    .unwrap();
    let labelled: Arc<dyn Dataset> = Arc::new(ImageDataset::load(&images).unwrap());
    let mlp = {
        let mut cfg = c.clone();
        cfg.model.model_path = refkit("models/mlp.onnx");
        cfg.model.input_name = "input".into();
        cfg.model.output_name = "logits".into();
        cfg.model.loss = LossKind::CrossEntropy;
        cfg
    };
    let err = try_run(mlp, labelled, None).unwrap_err();
    assert!(
        err.contains("class label 12 (index 3 of")
            && err.contains("labels_0.npy) is outside the model's 10 classes (output 'logits')"),
        "{err}"
    );
    // Sequences longer than the model's learned positions (gpt2_tiny: wpe of 128 rows).
    let long = {
        let mut cfg = c.clone();
        cfg.data.seq_len = 129;
        cfg
    };
    let err = try_run(long, gpt2_tokens(), None).unwrap_err();
    assert!(
        err.contains("config.data.seq_len") && err.contains("129 tokens per sequence, but the model has 128 positions ('m.transformer.wpe.weight'"),
        "{err}"
    );
    // A loss that does not fit the data.
    let err = try_run(
        {
            let mut cfg = c.clone();
            cfg.model.loss = LossKind::Mse;
            cfg
        },
        gpt2_tokens(),
        None,
    )
    .unwrap_err();
    assert!(
        err.contains("config.model.loss") && err.contains("targets_"),
        "{err}"
    );
    // A test set that cannot fill one evaluation batch fails at start, not at the first evaluation.
    let small: Arc<dyn Dataset> =
        Arc::new(TokenDataset::from_tokens((0..48).collect(), 16).unwrap());
    let err = try_run(c.clone(), gpt2_tokens(), Some(small)).unwrap_err();
    assert!(err.contains("config.eval.eval_batch_size"), "{err}");
    assert!(list_checkpoints(&out.join("checkpoints")).is_empty());
    // A warm-up ratio the schedule would ignore.
    let bad = {
        let mut cfg = c.clone();
        cfg.lr = LrConfig {
            warmup_ratio: 0.1,
            mode: ScheduleKind::None,
            ..Default::default()
        };
        cfg
    };
    assert!(
        bad.validate(1)
            .unwrap_err()
            .to_string()
            .contains("lr.warmup_ratio")
    );
    // Weight lists name their own fields.
    let err = try_run(
        {
            let mut cfg = c.clone();
            cfg.model.weights_not_to_train = vec!["nope".into()];
            cfg
        },
        gpt2_tokens(),
        None,
    )
    .unwrap_err();
    assert!(
        err.contains("config.model.weights_not_to_train") && err.contains("'nope'"),
        "{err}"
    );
    let err = try_run(
        {
            let mut cfg = c.clone();
            cfg.logging.histogram_weights = vec!["nope".into()];
            cfg
        },
        gpt2_tokens(),
        None,
    )
    .unwrap_err();
    assert!(err.contains("config.logging.histogram_weights"), "{err}");
    // Pipeline micro-batches that do not divide the batch, and more stages than nodes.
    let pp = {
        let mut cfg = c.clone();
        cfg.parallel.pipeline_parallel_size = 2;
        cfg.parallel.num_pipeline_micro_batches = 3;
        cfg
    };
    assert!(
        pp.validate(2)
            .unwrap_err()
            .to_string()
            .starts_with("config.parallel.num_pipeline_micro_batches")
    );
    let pp = {
        let mut cfg = c.clone();
        cfg.model.model_path = refkit("models/mlp.onnx");
        cfg.model.input_name = "input".into();
        cfg.parallel.pipeline_parallel_size = 4;
        cfg.data.batch_size = 4;
        cfg
    };
    let err = launch(pp, gpt2_tokens(), None).err().unwrap().to_string();
    assert!(
        err.contains("config.parallel.pipeline_parallel_size") && err.contains("3 nodes"),
        "{err}"
    );
    // Images and labels that do not pair up.
    let err = ImageDataset::new(
        ArrayD::zeros(IxDyn(&[4, 3])),
        Target::Classes(ArrayD::zeros(IxDyn(&[5]))),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("do not pair up"), "{err}");
}

#[test]
fn files_of_the_wrong_kind_are_named_as_what_they_should_be() {
    let dir = tempdir("feat-decode");
    let toml = dir.join("run.toml");
    std::fs::write(&toml, "batch_size = [").unwrap();
    let err = TrainingConfig::from_file(&toml).unwrap_err().to_string();
    assert!(
        err.contains("run.toml: not a valid training config"),
        "{err}"
    );
    let npy = dir.join("tokens.npy");
    std::fs::write(&npy, b"not numpy").unwrap();
    let err = burn_onnx_train::train::data::npy::read_npy(&npy)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokens.npy: not a valid .npy"), "{err}");
    let out = tempdir("feat-decode-ckpt");
    let c = {
        let mut c = gpt2_config(&out);
        c.train.num_train_steps = 2;
        c.checkpoint.checkpoint_period = 2;
        c
    };
    run_local(c.clone());
    let ckpt = out.join("checkpoints/ckpt-000000002");
    std::fs::write(ckpt.join("state.json"), b"{").unwrap();
    let more = {
        let mut cfg = c;
        cfg.train.num_train_steps = 4;
        cfg
    };
    // Against its manifest the file is damaged; with no older checkpoint, that is the error.
    let err = try_run(more.clone(), gpt2_tokens(), None).unwrap_err();
    assert!(
        err.contains("ckpt-000000002/state.json") && err.contains("the file is damaged"),
        "{err}"
    );
    // Without a manifest (a checkpoint of an older version) the decoder names it.
    std::fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let err = try_run(more, gpt2_tokens(), None).unwrap_err();
    assert!(
        err.contains("state.json: not a valid checkpoint state"),
        "{err}"
    );
}

#[test]
fn dropout_masks_depend_on_the_seed_only_not_on_threads() {
    let path = data("ops/dropout_training_13.onnx");
    let arrays = npz(data("ops/dropout_training_13.npz"));
    let mask = |seed: u64| {
        let m = OnnxModel::load(&path, &Device::flex()).unwrap();
        let feeds: Vec<_> = arrays
            .iter()
            .filter_map(|(k, v)| {
                k.strip_prefix("in_")
                    .map(|n| (n.to_string(), Value::from_host(v, &Device::flex()).unwrap()))
            })
            .collect();
        let Some(Value::Float(y)) = m
            .forward_seeded(feeds, Mode::Train, seed)
            .unwrap()
            .first()
            .cloned()
        else {
            panic!()
        };
        y.to_array().unwrap().mapv(|v| v != 0.0)
    };
    let reference: Vec<_> = (0..4).map(mask).collect();
    assert_ne!(
        reference[0], reference[1],
        "different seeds, different masks"
    );
    let masks = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|seed| s.spawn(move || (0..5).map(|_| mask(seed)).collect::<Vec<_>>()))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (seed, runs) in masks.iter().enumerate() {
        for m in runs {
            assert_eq!(
                m, &reference[seed],
                "seed {seed}: a mask drawn on a racing thread differs"
            );
        }
    }
    let kept = reference[0].iter().filter(|k| **k).count() as f64 / reference[0].len() as f64;
    assert!(kept > 0.2 && kept < 0.9, "kept fraction {kept}");
}

#[test]
fn profile_times_every_forward_node_once_per_update_and_leaves_evaluation_out() {
    let out = tempdir("feat-profile");
    // 6 updates of 2 accumulated micro-batches, evaluating every 3 updates.
    run_local({
        let mut c = gpt2_config(&out);
        c.logging.profile = true;
        c.train.gradient_accumulation_steps = 2;
        c.train.num_train_steps = 12;
        c.eval.evaluation_period = 3;
        c
    });
    let p: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("profile.json")).unwrap()).unwrap();
    let nodes = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &Device::flex())
        .unwrap()
        .graph()
        .nodes
        .len();
    assert_eq!(p["updates"], 6);
    let by_node = p["by_node"].as_array().unwrap();
    assert_eq!(by_node.len(), nodes, "every node is timed");
    assert!(
        by_node.iter().all(|n| n["calls"] == 12),
        "two micro-batches per update, no evaluation passes"
    );
    let total = p["forward_ms_per_update"].as_f64().unwrap();
    let node_sum: f64 = by_node
        .iter()
        .map(|n| n["ms_per_update"].as_f64().unwrap())
        .sum();
    assert!(
        total > 0.0 && (node_sum - total).abs() < 1e-6 * total.max(1.0),
        "{node_sum} vs {total}"
    );
    let types = p["by_op_type"].as_array().unwrap();
    let share: f64 = types
        .iter()
        .map(|t| t["share_of_forward"].as_f64().unwrap())
        .sum();
    assert!((share - 1.0).abs() < 1e-9, "shares sum to {share}");
    assert!(
        types.iter().any(|t| t["op_type"] == "MatMul"),
        "MatMul timed"
    );
    assert_eq!(
        types
            .iter()
            .map(|t| t["nodes"].as_u64().unwrap() as usize)
            .sum::<usize>(),
        nodes
    );
    let sorted: Vec<f64> = by_node
        .iter()
        .map(|n| n["ms_per_update"].as_f64().unwrap())
        .collect();
    assert!(sorted.windows(2).all(|w| w[0] >= w[1]), "slowest first");
}

#[test]
fn collectives_wait_30_minutes_by_default_on_thread_and_mpi_ranks_alike() {
    use burn_onnx_train::train::config::{DEFAULT_COLLECTIVE_TIMEOUT_S, ParallelConfig};
    use std::time::Duration;
    let mut p = ParallelConfig::default();
    assert_eq!(
        DEFAULT_COLLECTIVE_TIMEOUT_S, 1800,
        "torch.distributed's default"
    );
    assert_eq!(p.collective_wait_limit(), Some(Duration::from_secs(1800)));
    p.collective_timeout = Some(2.5);
    assert_eq!(
        p.collective_wait_limit(),
        Some(Duration::from_secs_f64(2.5))
    );
    p.collective_timeout = Some(0.0);
    assert_eq!(p.collective_wait_limit(), None, "0: no limit");
}

#[test]
fn a_run_with_its_head_padded_is_the_unpadded_run() {
    use burn_onnx_train::train::layout::parallel_plan::ParallelPlan;
    // The plan pads where the config asks (the CPU pads nothing by default).
    let padded_config = |out: &Path, multiple: Option<usize>| {
        let mut c = gpt2_config(out);
        c.model.pad_vocab_to_multiple_of = multiple;
        c.eval.evaluation_period = 3;
        c
    };
    let head_of = |multiple| {
        let c = padded_config(&tempdir("padded-head-plan"), multiple);
        let model = OnnxModel::load(&c.model.model_path, &Device::flex().autodiff()).unwrap();
        let mut plan = ParallelPlan::new(&c, &LocalCommunicator).unwrap();
        let parts = plan
            .parallelize(&c, model, &*gpt2_tokens(), &Device::flex().autodiff())
            .unwrap();
        parts.model.padded_head().map(|h| (h.classes, h.padded))
    };
    assert_eq!(head_of(Some(96)), Some((1024, 1056)));
    assert_eq!(head_of(None), None);
    assert_eq!(head_of(Some(64)), None, "1024 is a multiple of 64 already");

    // Trained with the head padded, the run is the unpadded run: its losses, evaluations
    // and exported parameters (of the source's shapes).
    let (a, b) = (tempdir("padded-head-run"), tempdir("unpadded-head-run"));
    let padded = run_local(padded_config(&a, Some(96)));
    let plain = run_local(padded_config(&b, Some(1)));
    assert_eq!(padded.losses.len(), 6);
    for ((step, p), (_, q)) in padded.losses.iter().zip(&plain.losses) {
        assert!(
            (p - q).abs() < 1e-5,
            "update {step}: loss {p} padded, {q} not"
        );
    }
    assert_eq!(padded.evals.len(), 2);
    for (p, q) in padded.evals.iter().zip(&plain.evals) {
        assert!((p.loss - q.loss).abs() < 1e-5, "evaluation at {}", p.step);
    }
    let source = onnx_params(refkit("models/gpt2_tiny.onnx"));
    let (got, want) = (trained(&a), trained(&b));
    assert_eq!(got.len(), source.len());
    for (((name, p), (_, q)), (_, s)) in got.iter().zip(&want).zip(&source) {
        assert_eq!(
            p.shape(),
            s.shape(),
            "{name}: exported in the source's shape"
        );
        // AdamW's normalised step carries the products' f32 summation order (1056 columns
        // against 1024) into the parameters: ~1e-5 after six updates.
        assert_close(&format!("padded vs unpadded: {name}"), p, q, 1e-4, 0.0);
    }
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &a.join("gpt2_tiny_trained.onnx"),
        1e-3,
    );
}
