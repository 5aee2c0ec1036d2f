//! Helpers shared by the integration tests: fixture paths, loading, comparisons.
#![allow(dead_code)]

pub mod activation_checks;

pub mod refkit_train;

pub mod counting;

pub mod fused_checks;

pub mod wire_checks;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use burn_onnx_train::train::data::npy::{read_npy, read_npz};
use burn_onnx_train::value::host_tensor::HostTensor;
use ndarray::ArrayD;

/// Path under the copied reference kit (`tests/data/refkit`).
pub fn refkit(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/refkit")
        .join(rel)
}

/// Path under `tests/data`.
pub fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(rel)
}

/// The GPU the GPU tests (`gpu.rs`, the fused kernels and optimizers) run on: the device
/// `ONNX_TRAIN_TEST_GPU` names (`wgpu`, `cuda`, `cuda:1`, ...), else `wgpu` when the binary
/// has it (Mesa's lavapipe on GPU-less machines), else `cuda`. `tools/gpu/check.sh` runs
/// the same test binaries once per GPU backend.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn gpu_spec() -> burn_onnx_train::train::DeviceSpec {
    let default = if cfg!(feature = "wgpu") {
        "wgpu"
    } else {
        "cuda"
    };
    let text = std::env::var("ONNX_TRAIN_TEST_GPU").unwrap_or_else(|_| default.into());
    text.parse()
        .unwrap_or_else(|e| panic!("ONNX_TRAIN_TEST_GPU: {e}"))
}

/// The Burn device of [`gpu_spec`].
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn gpu() -> Device {
    gpu_spec()
        .device(0)
        .unwrap_or_else(|e| panic!("ONNX_TRAIN_TEST_GPU: {e}"))
}

pub fn eval_device() -> Device {
    Device::flex()
}

pub fn train_device() -> Device {
    Device::flex().autodiff()
}

pub fn npy_f32(path: PathBuf) -> ArrayD<f32> {
    match read_npy(&path).unwrap_or_else(|e| panic!("{e}")) {
        HostTensor::Float(a) => a,
        other => panic!("{}: expected float, got {}", path.display(), other.kind()),
    }
}

pub fn npz(path: PathBuf) -> HashMap<String, HostTensor> {
    read_npz(&path).unwrap_or_else(|e| panic!("{e}"))
}

pub fn float(t: &HostTensor) -> &ArrayD<f32> {
    match t {
        HostTensor::Float(a) => a,
        other => panic!("expected float, got {}", other.kind()),
    }
}

pub fn int(t: &HostTensor) -> &ArrayD<i64> {
    match t {
        HostTensor::Int(a) => a,
        other => panic!("expected int, got {}", other.kind()),
    }
}

/// Largest absolute difference; panics on shape mismatch.
pub fn max_abs_diff(a: &ArrayD<f32>, b: &ArrayD<f32>) -> f32 {
    assert_eq!(a.shape(), b.shape(), "shape mismatch");
    a.iter()
        .zip(b.iter())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// How far the update `initial -> got` is from the update `initial -> want`, as the
/// relative L2 error `|got - want| / |want - initial|`.
pub fn relative_update_error(initial: &ArrayD<f32>, got: &ArrayD<f32>, want: &ArrayD<f32>) -> f64 {
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for ((g, w), p) in got.iter().zip(want.iter()).zip(initial.iter()) {
        err += f64::from(g - w).powi(2);
        norm += f64::from(w - p).powi(2);
    }
    (err / norm.max(1e-30)).sqrt()
}

/// Assert every element is within `atol + rtol * |expected|`.
pub fn assert_close(what: &str, got: &ArrayD<f32>, want: &ArrayD<f32>, atol: f32, rtol: f32) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape mismatch");
    let mut worst = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        let excess = (g - w).abs() - (atol + rtol * w.abs());
        assert!(!g.is_nan(), "{what}: NaN at {i}");
        if excess > worst.0 {
            worst = (excess, i);
        }
    }
    assert!(
        worst.0 <= 0.0,
        "{what}: element {} differs: got {}, want {} (atol {atol}, rtol {rtol}, max abs diff {})",
        worst.1,
        got.iter().nth(worst.1).unwrap(),
        want.iter().nth(worst.1).unwrap(),
        max_abs_diff(got, want)
    );
}

pub fn losses(case: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(refkit(&format!("train/{case}/losses.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A fresh, empty directory for one test, named by `tag` under cargo's scratch directory for
/// integration tests (`target/tmp`): the next run of the same test empties and reuses it, so
/// runs do not pile up outputs (checkpoints, exported models) on the disk.
pub fn tempdir(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("onnx-train-{tag}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A deterministic pseudo-random stream (64-bit LCG, upper bits).
pub fn lcg(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        x >> 33
    }
}

/// The data-parallel equivalence runs: 10 updates of SGD (lr 0.1, momentum 0.9), no
/// clipping, no evaluation, no TensorBoard, quiet.
pub fn sgd_config(
    model: PathBuf,
    loss: burn_onnx_train::model::loss::LossKind,
    input: &str,
) -> burn_onnx_train::train::TrainingConfig {
    use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind};
    {
        let mut c = burn_onnx_train::train::TrainingConfig::default();
        c.model.model_path = model;
        c.model.input_name = input.into();
        c.model.output_name = "logits".into();
        c.model.loss = loss;
        c.data.seq_len = 16;
        c.train.num_train_steps = 10;
        c.eval.evaluation_period = 0;
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Sgd,
            momentum: 0.9,
            weight_decay: 0.0,
            ..Default::default()
        };
        c.lr = LrConfig {
            initial_lr: 0.1,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.0;
        c.logging.log_dir = Some(PathBuf::new());
        c.logging.progress = false;
        c
    }
}

/// Every parameter of an ONNX file, by initializer name, in file order.
pub fn onnx_params(path: PathBuf) -> Vec<(String, ArrayD<f32>)> {
    let m =
        burn_onnx_train::OnnxModel::load(&path, &Device::flex()).unwrap_or_else(|e| panic!("{e}"));
    m.param_infos()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                p.name.clone(),
                m.param_value(i).unwrap().to_array().unwrap(),
            )
        })
        .collect()
}

/// Every parameter of `trained` differs from `initial` somewhere, and the largest change over
/// all parameters exceeds `min_move`: a training run that silently updated nothing (or only
/// some parameters) cannot pass an equivalence test with it.
pub fn assert_moved(initial: &std::path::Path, trained: &std::path::Path, min_move: f32) {
    let before = onnx_params(initial.to_path_buf());
    let after = onnx_params(trained.to_path_buf());
    assert_eq!(
        before.len(),
        after.len(),
        "{}: parameter count",
        trained.display()
    );
    let mut largest = 0.0f32;
    for ((name, a), (_, b)) in before.iter().zip(&after) {
        let d = max_abs_diff(a, b);
        assert!(
            d > 0.0,
            "{}: parameter {name} did not move",
            trained.display()
        );
        largest = largest.max(d);
    }
    assert!(
        largest > min_move,
        "{}: parameters moved by at most {largest} (want > {min_move})",
        trained.display()
    );
}

/// The Python named by `var` (`ONNX_TRAIN_PYTHON`: onnxruntime + onnx; `TENSORBOARD_PYTHON`:
/// tensorboard) for a cross-check. Outside CI a missing one is reported and the check is
/// left out; with `CI` set (`.ci/run` provides both) a missing one fails the test.
pub fn python_for(var: &str, check: &str) -> Option<std::ffi::OsString> {
    match std::env::var_os(var) {
        Some(p) => Some(p),
        None if std::env::var_os("CI").is_some() => {
            panic!("{var} is not set, but CI must run the {check} cross-check")
        }
        None => {
            eprintln!("{var} not set: {check} cross-check left out (CI runs it)");
            None
        }
    }
}

/// Run the Python `script` with `args` under `python`: it must exit 0 and print a line
/// starting with `ok` (an independent reader's check of files we wrote).
pub fn python_says_ok(python: &std::ffi::OsStr, script: &str, args: &[&std::ffi::OsStr]) {
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with("ok"),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deterministic pseudo-random stream of 4096 tokens below gpt2_tiny's vocabulary, in
/// windows of 16.
pub fn gpt2_tokens() -> std::sync::Arc<dyn burn_onnx_train::train::data::Dataset> {
    let mut next = lcg(12345);
    let ids = (0..4096).map(|_| (next() % 1024) as i64).collect();
    std::sync::Arc::new(burn_onnx_train::train::data::TokenDataset::from_tokens(ids, 16).unwrap())
}

/// A quiet 6-update AdamW run of gpt2_tiny on 4 x 16 tokens writing into `out` (no
/// TensorBoard, no evaluation unless asked).
pub fn gpt2_config(out: &std::path::Path) -> burn_onnx_train::train::TrainingConfig {
    use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
    {
        let mut c = burn_onnx_train::train::TrainingConfig::default();
        c.model.model_path = refkit("models/gpt2_tiny.onnx");
        c.checkpoint.output_dir = out.to_path_buf();
        c.model.input_name = "input_ids".into();
        c.model.output_name = "logits".into();
        c.model.loss = burn_onnx_train::model::loss::LossKind::LmCrossEntropy;
        c.data.batch_size = 4;
        c.eval.eval_batch_size = 4;
        c.data.seq_len = 16;
        c.train.num_train_steps = 6;
        c.logging.display_loss_steps = 1;
        c.eval.evaluation_period = 0;
        c.eval.eval_batches = 2;
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Adamw,
            ..Default::default()
        };
        c.logging.log_dir = Some(PathBuf::new());
        c.logging.progress = false;
        c
    }
}

/// Run `c` in this process (one rank) on [`gpt2_tokens`], evaluating on the same stream.
pub fn run_local(c: burn_onnx_train::train::TrainingConfig) -> burn_onnx_train::train::RunSummary {
    let runner = burn_onnx_train::train::TrainingRunner::new(
        c,
        std::sync::Arc::new(burn_ort_dist::LocalCommunicator),
        Device::flex().autodiff(),
    )
    .unwrap();
    runner.run(gpt2_tokens(), Some(gpt2_tokens())).unwrap()
}

/// The refkit README's rule for optimizer trajectories: elements whose step-0 gradient
/// exceeds 1e-6 within `atol`; the others (which Adam moves by an arbitrary fraction of lr
/// under any rounding change) within 1e-4. `atol` 1e-5 tells AdamW's weight decay on from
/// off (it moves a weight by lr * wd * |w| ~ 1e-5 per step).
pub fn assert_close_where_grad(
    what: &str,
    got: &ArrayD<f32>,
    want: &ArrayD<f32>,
    grad0: &ArrayD<f32>,
    atol: f32,
) {
    assert_close_where_grad_within(what, got, want, grad0, atol, (1e-6, atol.max(1e-4)));
}

/// [`assert_close_where_grad`] with the elements whose step-0 gradient is at most
/// `tiny.0` held to `tiny.1`: Adam moves an element whose gradient is rounding noise by up
/// to lr per step whatever the noise, so under a coarser matmul (TF32 on CUDA, whose noise
/// reaches larger gradients) the bound is lr x steps.
pub fn assert_close_where_grad_within(
    what: &str,
    got: &ArrayD<f32>,
    want: &ArrayD<f32>,
    grad0: &ArrayD<f32>,
    atol: f32,
    tiny: (f32, f32),
) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape mismatch");
    assert_eq!(
        grad0.shape(),
        want.shape(),
        "{what}: gradient shape mismatch"
    );
    for (i, ((g, w), d)) in got.iter().zip(want.iter()).zip(grad0.iter()).enumerate() {
        let tol = if d.abs() > tiny.0 { atol } else { tiny.1 };
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g}, want {w} (|grad0| {}, tolerance {tol})",
            d.abs()
        );
    }
}

/// The forward pass of kit model `model_name` on `device` for `inference/<model>/<input_file>`
/// against `inference/<model>/<expected_file>` (onnxruntime's or PyTorch's output).
pub fn check_inference(device: &Device, model_name: &str, input_file: &str, expected_file: &str) {
    // 1e-4 absolute, or relative for large logits.
    check_inference_within(device, model_name, input_file, expected_file, 1e-4);
}

/// [`check_inference`] within `tol` (absolute, or relative for large values).
pub fn check_inference_within(
    device: &Device,
    model_name: &str,
    input_file: &str,
    expected_file: &str,
    tol: f32,
) {
    use burn_onnx_train::{Mode, OnnxModel, Value};
    let device = device.clone();
    let model = OnnxModel::load(refkit(&format!("models/{model_name}.onnx")), &device).unwrap();
    let input = read_npy(&refkit(&format!("inference/{model_name}/{input_file}"))).unwrap();
    let input = Value::from_host(&input, &device).unwrap();
    let name = model.graph().inputs[0].name.clone();
    let out = model.forward(vec![(name, input)], Mode::Eval).unwrap();
    let Value::Float(got) = out.first().unwrap() else {
        panic!("float output expected")
    };
    let got = got.to_array().unwrap();
    let want = npy_f32(refkit(&format!("inference/{model_name}/{expected_file}")));
    assert_close(&format!("{model_name}/{input_file}"), &got, &want, tol, tol);
}

/// A GPT-2 from our builder (its embedding tied to the LM head: one initializer read by
/// Gather and MatMul), width 32 and 32 positions, written to `<tempdir(tag)>/<file>`.
pub fn small_gpt2(
    tag: &str,
    file: &str,
    n_layer: usize,
    n_head: usize,
    vocab_size: usize,
) -> PathBuf {
    use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};
    let path = tempdir(tag).join(file);
    write_gpt2(
        &Gpt2Config {
            n_layer,
            n_head,
            n_embd: 32,
            vocab_size,
            n_positions: 32,
            ..Default::default()
        },
        &path,
    )
    .unwrap();
    path
}

/// Run `cmd` with its stderr read line by line; once the first update is logged (a
/// ` train ` line), send `signal` (`-TERM`, `-USR1`) to the process `target` picks for the
/// child's pid. The exit status and the whole stderr; fails when no update was logged.
pub fn signal_after_first_update(
    mut cmd: std::process::Command,
    signal: &str,
    target: impl FnOnce(u32) -> u32,
) -> (std::process::ExitStatus, String) {
    use std::io::BufRead;
    let mut child = cmd.stderr(std::process::Stdio::piped()).spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (mut log, mut target) = (String::new(), Some(target));
    for line in std::io::BufReader::new(stderr).lines() {
        let line = line.unwrap();
        if line.contains(" train ")
            && let Some(pick) = target.take()
        {
            let kill = std::process::Command::new("kill")
                .args([signal, &pick(child.id()).to_string()])
                .status()
                .unwrap();
            assert!(kill.success(), "kill {signal}");
        }
        log.push_str(&line);
        log.push('\n');
    }
    assert!(target.is_none(), "no update was logged:\n{log}");
    (child.wait().unwrap(), log)
}

/// What `train --auto` printed it chose (`--auto: FLAGS`, one line: only rank 0 chooses),
/// checked against the run's `perf.json` under `out`: a world of `world` processes and
/// the flags' ZeRO stage, pipeline stages, batch and accumulation, whose product with the
/// replicas is `global_batch`. Returns each flag's value.
pub fn auto_choice_ran(
    stderr: &str,
    out: &std::path::Path,
    world: u64,
    global_batch: u64,
) -> std::collections::HashMap<String, u64> {
    let choices: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("--auto: "))
        .collect();
    assert_eq!(choices.len(), 1, "one choice printed: {stderr}");
    let words: Vec<&str> = choices[0].split_whitespace().collect();
    let value: std::collections::HashMap<String, u64> = words
        .chunks(2)
        .filter_map(|w| Some((w[0].to_string(), w.get(1)?.parse().ok()?)))
        .collect();
    let perf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("perf.json")).unwrap()).unwrap();
    assert_eq!(perf["world_size"], world, "{choices:?} {perf}");
    for (key, flag) in [
        ("zero_stage", "--zero"),
        ("pipeline_stages", "--pp"),
        ("batch_size", "--batch-size"),
        ("gradient_accumulation_steps", "--accumulation"),
    ] {
        assert_eq!(
            perf[key].as_u64(),
            value.get(flag).copied(),
            "{key}: {choices:?} {perf}"
        );
    }
    assert_eq!(
        value["--dp"] * value["--tp"] * value["--pp"],
        world,
        "{choices:?}"
    );
    assert_eq!(
        value["--batch-size"] * value["--dp"] * value["--accumulation"],
        global_batch,
        "the global batch: {choices:?}"
    );
    value
}

/// The logits of a training-mode forward pass on token `ids` (input `input_ids`, output
/// `logits`; a tensor-parallel rank's slice when its head is split along the vocabulary).
pub fn lm_logits(
    model: &burn_onnx_train::OnnxModel,
    ids: &ArrayD<i64>,
) -> burn_onnx_train::model::loss::Logits {
    use burn_onnx_train::{Mode, Value};
    let out = model
        .forward(
            vec![("input_ids".into(), Value::Int(ids.clone()))],
            Mode::Train,
        )
        .unwrap();
    let Some(Value::Float(logits)) = out.get("logits").cloned() else {
        panic!("no logits")
    };
    burn_onnx_train::model::loss::Logits {
        value: logits.into(),
        sharded: out.sharded_logits.clone(),
        classes: None,
        uploads: out.uploads.clone(),
    }
}

/// The LM cross-entropy of a training-mode forward pass on token `ids` ([`lm_logits`]).
pub fn lm_loss(model: &burn_onnx_train::OnnxModel, ids: &ArrayD<i64>) -> burn::tensor::Tensor<1> {
    burn_onnx_train::model::loss::lm_cross_entropy(lm_logits(model, ids), ids).unwrap()
}

/// Thread groups that move device tensors themselves, through host memory
/// (`burn_ort_dist::ThroughHost`: the code paths NCCL's groups take on CUDA), each
/// remembered to count its device collectives and messages.
#[derive(Default)]
pub struct ThroughHostGroups(std::sync::Mutex<Vec<std::sync::Arc<burn_ort_dist::ThroughHost>>>);

impl ThroughHostGroups {
    /// `comm` wrapped (what `launch_threads_over` asks for).
    pub fn wrap(
        &self,
        comm: std::sync::Arc<dyn burn_ort_dist::Communicator>,
    ) -> std::sync::Arc<dyn burn_ort_dist::Communicator> {
        let group = std::sync::Arc::new(burn_ort_dist::ThroughHost::over(comm));
        self.0.lock().unwrap().push(group.clone());
        group
    }

    /// Each wrapped group's device collectives and messages so far (its sub-groups'
    /// included), in the order the ranks wrapped them.
    pub fn calls(&self) -> Vec<usize> {
        self.0.lock().unwrap().iter().map(|g| g.calls()).collect()
    }
}
