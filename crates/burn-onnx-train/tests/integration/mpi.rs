//! Data parallelism across processes under OpenMPI (feature `mpi`): `mpirun -np N
//! onnx-train train` with per-rank batch B ends with the same parameters as one process
//! with batch N*B (10 SGD updates, gpt2_tiny and the MLP), and so do pipelines (`--pp`) and
//! tensor parallelism (`--tp`), alone, as data-parallel replicas and with sequence
//! parallelism; a killed rank or
//! pipeline stage ends the job; gradients as f16 on the wire (`--allreduce-in-fp16`) follow
//! the f32 run on an odd ring.
#![cfg(feature = "mpi")]

use super::common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::data::npy::write_npy;
use burn_onnx_train::{FloatValue, Value};
use common::*;
use ndarray::{ArrayD, IxDyn};

/// Write shards and a config for `case` under `dir`; returns the config file.
fn setup(dir: &Path, case: &str, steps: usize) -> PathBuf {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut next = lcg(17);
    let (model, loss, input) = if case == "gpt2" {
        let ids: Vec<i64> = (0..16 * 64).map(|_| (next() % 1024) as i64).collect();
        write_npy(
            data.join("tokens.npy"),
            &Value::Int(ArrayD::from_shape_vec(IxDyn(&[ids.len()]), ids).unwrap()),
        )
        .unwrap();
        ("gpt2_tiny", LossKind::LmCrossEntropy, "input_ids")
    } else {
        let x = ArrayD::from_shape_fn(IxDyn(&[64, 784]), |_| (next() % 1000) as f32 / 1000.0 - 0.5);
        let y = ArrayD::from_shape_fn(IxDyn(&[64]), |_| (next() % 10) as i64);
        write_npy(
            data.join("images_0.npy"),
            &Value::Float(FloatValue::from_array(&x, &Device::flex()).unwrap()),
        )
        .unwrap();
        write_npy(data.join("labels_0.npy"), &Value::Int(y)).unwrap();
        ("mlp", LossKind::CrossEntropy, "input")
    };
    let c = {
        let mut c = sgd_config(refkit(&format!("models/{model}.onnx")), loss, input);
        c.data.train_data_dir = data;
        c.train.num_train_steps = steps;
        c
    };
    let path = dir.join("run.toml");
    std::fs::write(&path, c.to_toml().unwrap()).unwrap();
    path
}

fn onnx_train() -> &'static str {
    env!("CARGO_BIN_EXE_onnx-train")
}

/// Held by each test for its whole run: one MPI job at a time. OpenMPI's ranks busy-poll
/// while they wait, so two jobs side by side on a 2-core machine starve each other (a
/// 1-second job took minutes next to a 4-rank one).
fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static JOBS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    JOBS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn mpirun(np: usize) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args([
        "-k",
        "10",
        "300",
        "mpirun",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ])
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env("RAYON_NUM_THREADS", "1");
    cmd
}

/// `onnx-train train --config cfg --output-dir out ARGS` under `mpirun -np np` (0: as one
/// plain process); asserts it succeeds.
fn train_run(np: usize, cfg: &Path, out: &Path, args: &[&str]) {
    let mut cmd = if np == 0 {
        Command::new(onnx_train())
    } else {
        let mut c = mpirun(np);
        c.arg(onnx_train());
        c
    };
    let run = cmd
        .args(["train", "--config", cfg.to_str().unwrap()])
        .args(["--output-dir", out.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}

fn equivalence(case: &str, np: usize, per_rank: usize) {
    grid_equivalence(case, np, 1, 1, per_rank);
}

/// `mpirun -np dp*tp*pp ... --dp dp --tp tp --pp pp` with per-replica batch B against one
/// process with batch dp*B.
fn grid_equivalence(case: &str, dp: usize, tp: usize, pp: usize, per_rank: usize) {
    grid_equivalence_with(case, dp, tp, pp, per_rank, &[]);
}

/// [`grid_equivalence`] with `extra` flags for the parallel run; returns the directory
/// (`one/`, `many/` output directories).
fn grid_equivalence_with(
    case: &str,
    dp: usize,
    tp: usize,
    pp: usize,
    per_rank: usize,
    extra: &[&str],
) -> PathBuf {
    let np = dp * tp * pp;
    let dir = tempdir(&format!("mpi-{case}-{dp}x{tp}x{pp}{}", extra.join("")));
    let cfg = setup(&dir, case, 10);
    train_run(
        0,
        &cfg,
        &dir.join("one"),
        &["--batch-size", &(dp * per_rank).to_string()],
    );
    let (per_rank, dp, tp, pp) = (
        per_rank.to_string(),
        dp.to_string(),
        tp.to_string(),
        pp.to_string(),
    );
    train_run(
        np,
        &cfg,
        &dir.join("many"),
        &[
            "--batch-size",
            &per_rank,
            "--dp",
            &dp,
            "--tp",
            &tp,
            "--pp",
            &pp,
        ]
        .into_iter()
        .chain(extra.iter().copied())
        .collect::<Vec<_>>(),
    );
    let file = format!(
        "{}_trained.onnx",
        if case == "gpt2" { "gpt2_tiny" } else { "mlp" }
    );
    for ((name, a), (_, b)) in onnx_params(dir.join("one").join(&file))
        .iter()
        .zip(onnx_params(dir.join("many").join(&file)))
    {
        assert_close(
            &format!("mpirun -np {np} --dp {dp} --tp {tp} --pp {pp} {case}: {name}"),
            &b,
            a,
            1e-5,
            0.0,
        );
    }
    let initial = refkit(&format!(
        "models/{}.onnx",
        if case == "gpt2" { "gpt2_tiny" } else { "mlp" }
    ));
    assert_moved(&initial, &dir.join("one").join(&file), 1e-3);
    dir
}

/// `mpirun -np N ... --zero STAGE` ends where `--zero 0` does (10 AdamW updates with
/// clipping on gpt2_tiny; ZeRO's sharded update follows Burn's arithmetic), within `atol`.
fn zero_equivalence(np: usize, stage: usize, atol: f32) {
    let dir = tempdir(&format!("mpi-zero-{np}-{stage}"));
    let cfg = setup(&dir, "gpt2", 10);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("kind = \"sgd\"", "kind = \"adamw\"")
        .replace("max_grad_norm = 0.0", "max_grad_norm = 1.0")
        .replace("initial_lr = 0.1", "initial_lr = 0.001");
    std::fs::write(&cfg, text).unwrap();
    for (out, zero) in [("zero0", 0), ("zeroN", stage)] {
        let (n, zero) = (np.to_string(), zero.to_string());
        let args = ["--batch-size", "1", "--dp", &n, "--zero", &zero];
        train_run(np, &cfg, &dir.join(out), &args);
    }
    let file = "gpt2_tiny_trained.onnx";
    for ((name, a), (_, b)) in onnx_params(dir.join("zero0").join(file))
        .iter()
        .zip(onnx_params(dir.join("zeroN").join(file)))
    {
        assert_close(
            &format!("mpirun -np {np} --zero {stage}: {name}"),
            &b,
            a,
            atol,
            0.0,
        );
    }
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &dir.join("zeroN").join(file),
        1e-3,
    );
    let perf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("zeroN/perf.json")).unwrap()).unwrap();
    assert_eq!(
        perf["optimizer_state_bytes"].as_array().unwrap().len(),
        np,
        "one figure per rank"
    );
}

/// `mpirun -np N ... --allreduce-in-fp16` (10 SGD updates of gpt2_tiny, no clipping,
/// gradients crossing as f16 over MPI point-to-point) follows the f32 run: every tensor's
/// update within 0.2%, not bit-identical.
fn fp16_gradients_follow_f32(np: usize, stage: usize) {
    let dir = tempdir(&format!("mpi-fp16-{np}-{stage}"));
    let cfg = setup(&dir, "gpt2", 10);
    for (out, extra) in [("f32", None), ("f16", Some("--allreduce-in-fp16"))] {
        let (n, zero) = (np.to_string(), stage.to_string());
        let mut args = vec!["--batch-size", "1", "--dp", &n, "--zero", &zero];
        args.extend(extra);
        train_run(np, &cfg, &dir.join(out), &args);
    }
    let file = "gpt2_tiny_trained.onnx";
    let initial = onnx_params(refkit("models/gpt2_tiny.onnx"));
    let mut identical = true;
    for (((name, a), (_, b)), (_, p)) in onnx_params(dir.join("f16").join(file))
        .iter()
        .zip(onnx_params(dir.join("f32").join(file)))
        .zip(&initial)
    {
        let rel = relative_update_error(p, a, &b);
        assert!(
            rel <= 2e-3,
            "mpirun -np {np} --zero {stage}: {name}: update off by {rel:.2e}"
        );
        identical &= a == b;
    }
    assert!(
        !identical,
        "mpirun -np {np}: bit-identical to f32: was f16 used?"
    );
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &dir.join("f16").join(file),
        1e-3,
    );
}

#[test]
fn mpi_f16_gradients_follow_the_f32_run() {
    let _serial = one_job_at_a_time();
    // Three ranks: an odd ring, where blocking sends must still meet receivers.
    fp16_gradients_follow_f32(3, 0);
    fp16_gradients_follow_f32(2, 3);
}

#[test]
fn mpi_zero_stages_match_replicated() {
    let _serial = one_job_at_a_time();
    // Two ranks add in one order whatever the algorithm: bit-identical. With four, OpenMPI's
    // reduce-scatter adds the ranks' gradients in another order than its all-reduce, and
    // AdamW turns last-bit differences of tiny gradients (rare embedding rows) into 3e-6 to
    // 1.2e-5 (measured on two machines with OpenMPI 4.1.4); a wrong shard or a missed
    // reduction moves weights by whole steps (lr 1e-3).
    // Stage 3 reduce-scatters each parameter's gradient on its own in backward.
    for (np, stage, atol) in [
        (2, 1, 1e-6),
        (2, 2, 1e-6),
        (2, 3, 1e-6),
        (4, 1, 1e-6),
        (4, 2, 2e-5),
        (4, 3, 2e-5),
    ] {
        zero_equivalence(np, stage, atol);
    }
}

#[test]
fn mpi_two_ranks_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    equivalence("gpt2", 2, 2);
}

#[test]
fn mpi_two_ranks_averaging_during_backward_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    // Segment by segment (3), and from per-parameter hooks in one backward pass (1).
    for segments in ["3", "1"] {
        let dir = grid_equivalence_with("gpt2", 2, 1, 1, 2, &["--overlap", segments]);
        let perf: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("many/perf.json")).unwrap()).unwrap();
        let busy = perf["avg_overlapped_sync_ms"].as_f64().unwrap();
        assert!(
            busy > 0.0,
            "--overlap {segments}: no gradient was averaged during backward: {perf}"
        );
    }
}

#[test]
fn mpi_four_ranks_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    equivalence("gpt2", 4, 1);
}

#[test]
fn mpi_two_pipeline_stages_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 1, 1, 2, 4);
}

#[test]
fn mpi_four_pipeline_stages_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 1, 1, 4, 4);
}

/// Interleaved 1F1B across processes: 2 ranks of 2 model chunks each (4 stages, the
/// messages of both chunks sharing each pair's channel).
#[test]
fn mpi_two_ranks_of_two_virtual_stages_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence_with("gpt2", 1, 1, 2, 4, &["--virtual-stages", "2"]);
}

#[test]
fn mpi_two_replicas_of_two_stages_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 2, 1, 2, 2);
    // ZeRO-3 within each stage's replicas: the export gathers each parameter's chunks in
    // the stage owning it and streams it to rank 0, one parameter at a time.
    grid_equivalence_with("gpt2", 2, 1, 2, 2, &["--zero", "3"]);
}

/// Tensor parallelism inside pipeline stages across processes: each stage joins its
/// split weights on tp rank 0, which sends them to rank 0 for the export.
#[test]
fn mpi_two_tensor_parallel_ranks_of_two_stages_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 1, 2, 2, 4);
}

#[test]
fn mpi_two_tensor_parallel_ranks_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 1, 2, 1, 4);
}

#[test]
fn mpi_four_tensor_parallel_ranks_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 1, 4, 1, 4);
}

#[test]
fn mpi_two_replicas_of_two_tensor_parallel_ranks_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence("gpt2", 2, 2, 1, 2);
}

/// Megatron's sequence parallelism under mpirun: 2 replicas of 2 tp ranks whose LayerNorms
/// and residual adds run on half the sequence each.
#[test]
fn mpi_two_replicas_of_two_sequence_parallel_ranks_equal_one_process_gpt2_tiny() {
    let _serial = one_job_at_a_time();
    grid_equivalence_with("gpt2", 2, 2, 1, 2, &["--sequence-parallel"]);
}

#[test]
fn mpi_two_tensor_parallel_ranks_equal_one_process_mlp() {
    let _serial = one_job_at_a_time();
    grid_equivalence("mlp", 1, 2, 1, 8);
}

#[test]
fn mpi_two_ranks_equal_one_process_mlp() {
    let _serial = one_job_at_a_time();
    equivalence("mlp", 2, 4);
}

#[test]
fn mpi_four_ranks_equal_one_process_mlp() {
    let _serial = one_job_at_a_time();
    equivalence("mlp", 4, 2);
}

#[test]
fn an_error_on_every_rank_is_printed_before_the_job_ends() {
    let _serial = one_job_at_a_time();
    // Images of 100 features where the mlp takes 784: every rank fails on its first batch
    // and prints why before MPI_Abort ends the job.
    let dir = tempdir("mpi-rank-error");
    let cfg = setup(&dir, "mlp", 2);
    let x = ArrayD::from_shape_fn(IxDyn(&[64, 100]), |_| 0.5f32);
    write_npy(
        dir.join("data/images_0.npy"),
        &Value::Float(FloatValue::from_array(&x, &Device::flex()).unwrap()),
    )
    .unwrap();
    let out = mpirun(2)
        .arg(onnx_train())
        .args([
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--output-dir",
            dir.join("out").to_str().unwrap(),
            "--dp",
            "2",
            "--batch-size",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // When both ranks abort at once, OpenMPI 4's mpirun can fail to unpack the abort's
    // help text ("ORTE_ERROR_LOG: Data unpack would read past end of buffer in file
    // .../show_help.c"), printing that instead of its "MPI_ABORT was invoked" message.
    let aborted = err.contains("MPI_ABORT")
        || (err.contains("ORTE_ERROR_LOG") && err.contains("show_help.c"));
    assert!(
        err.contains("input 'input': dim 1 must be 784, got 100") && aborted,
        "the rank's error must be printed before the job ends:\n{err}"
    );
    // Before the first update: EX_CONFIG, which `onnx-train launch` does not restart.
    assert_eq!(out.status.code(), Some(78), "{err}");
    let launched = Command::new("timeout")
        .args(["-k", "10", "300", onnx_train(), "launch", "--np", "2"])
        .args(["--max-restarts", "3", "--mpirun-arg=--oversubscribe", "--"])
        .args(["train", "--config", cfg.to_str().unwrap()])
        .args(["--output-dir", dir.join("launched").to_str().unwrap()])
        .args(["--dp", "2", "--batch-size", "1"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&launched.stderr);
    assert!(!launched.status.success(), "{err}");
    assert!(
        err.contains("failed before its first update") && !err.contains("restarting it"),
        "{err}"
    );
}

#[test]
fn mismatched_dp_and_world_size_fails_every_rank() {
    let _serial = one_job_at_a_time();
    let dir = tempdir("mpi-mismatch");
    let cfg = setup(&dir, "mlp", 4);
    let out = mpirun(2)
        .arg(onnx_train())
        .args(["train", "--config", cfg.to_str().unwrap(), "--dp", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("data_parallel_size"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Kill one rank of a running 2-rank job: mpirun must end the other and exit non-zero
/// within 30 seconds.
#[test]
fn a_killed_rank_ends_the_job_within_30_seconds() {
    let _serial = one_job_at_a_time();
    kill_one_of_two("mpi-kill", &["--dp", "2", "--batch-size", "1"]);
}

/// The same for a pipeline: the other stage, blocked on a receive from the killed one, ends.
#[test]
fn a_killed_stage_ends_the_pipeline_within_30_seconds() {
    let _serial = one_job_at_a_time();
    kill_one_of_two("mpi-kill-pp", &["--pp", "2", "--batch-size", "2"]);
}

fn kill_one_of_two(tag: &str, flags: &[&str]) {
    let (status, _, _) = signal_one_of_two(tag, flags, "-9");
    assert!(!status.success(), "a job with a killed rank must fail");
}

/// Stop one rank of a running 2-rank job for good (SIGSTOP: alive, silent) with a
/// 3-second `collective_timeout` and `extra` flags: the other rank must end the job within
/// 30 seconds. The stopped rank's world rank and the job's stderr.
fn stop_one_of_two(tag: &str, extra: &[&str]) -> (usize, String) {
    let flags = [
        &[
            "--dp",
            "2",
            "--batch-size",
            "1",
            "--set",
            "collective_timeout=3",
        ][..],
        extra,
    ]
    .concat();
    let (status, stopped, stderr) = signal_one_of_two(tag, &flags, "-STOP");
    assert!(
        !status.success(),
        "a job with a stopped rank must fail:\n{stderr}"
    );
    (stopped, stderr)
}

/// A stopped rank ends the job with an error naming the operation and the stopped rank.
#[test]
fn a_stopped_rank_ends_the_job_with_an_error_naming_it() {
    let _serial = one_job_at_a_time();
    let (stopped, stderr) = stop_one_of_two("mpi-stop", &[]);
    assert!(
        stderr.contains("collective timed out: all_reduce of "),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("never arrived: world rank(s) [{stopped}]")),
        "{stderr}"
    );
}

/// The same on two GPUs with NCCL carrying the gradients (`--device cuda`): the waiting
/// rank polls the NCCL operation's completion and ends the job with a timeout naming it.
/// Needs a machine with two GPUs (NCCL takes one per rank), so it is not run by default:
/// `cargo test --release --features mpi,cuda --test integration -- --ignored nccl`.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs two GPUs: cargo test --release --features mpi,cuda --test integration -- --ignored nccl"]
fn a_stopped_rank_ends_an_nccl_job_with_a_timeout_naming_the_operation() {
    let _serial = one_job_at_a_time();
    let (_, stderr) = stop_one_of_two("nccl-stop", &["--device", "cuda"]);
    assert!(
        stderr.contains("collective timed out: ncclAllReduce"),
        "{stderr}"
    );
}

/// Start a long 2-rank training job, send `signal` to one rank once both train, and wait
/// (at most 30 seconds) for the job to end. Returns mpirun's status, the signalled rank's
/// world rank, and the job's stderr.
fn signal_one_of_two(tag: &str, flags: &[&str], signal: &str) -> (ExitStatus, usize, String) {
    let dir = tempdir(tag);
    let cfg = setup(&dir, "gpt2", 100_000);
    let out_dir = dir.join("out");
    let log = dir.join("stderr.log");
    let mut job = mpirun(2)
        .arg(onnx_train())
        .args([
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--output-dir",
            out_dir.to_str().unwrap(),
        ])
        .args(flags)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Wait until both ranks are training: the ranks are the children of mpirun.
    let mpirun_pid = job.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    let ranks = loop {
        let pids = descendants_named(mpirun_pid, "onnx-train");
        if pids.len() == 2 {
            break pids;
        }
        assert!(Instant::now() < deadline, "ranks did not start");
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        job.try_wait().unwrap().is_none(),
        "the job ended before the signal"
    );
    let world_rank = world_rank_of(ranks[1]);
    let signalled_at = Instant::now();
    Command::new("kill")
        .args([signal, &ranks[1].to_string()])
        .status()
        .unwrap();
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        assert!(
            signalled_at.elapsed() < Duration::from_secs(30),
            "the job outlived a {signal} rank by 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "mpirun exited with {status} {:?} after kill {signal}",
        signalled_at.elapsed()
    );
    assert!(descendants_named(mpirun_pid, "onnx-train").is_empty());
    (status, world_rank, std::fs::read_to_string(&log).unwrap())
}

/// The MPI world rank of process `pid` (OpenMPI's `OMPI_COMM_WORLD_RANK`).
fn world_rank_of(pid: u32) -> usize {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"OMPI_COMM_WORLD_RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
        .expect("an OpenMPI rank")
}

/// Processes under `root` (transitively) whose command name is `name`.
fn descendants_named(root: u32, name: &str) -> Vec<u32> {
    let out = Command::new("ps")
        .args(["-eo", "pid=,ppid=,comm="])
        .output()
        .unwrap();
    let rows: Vec<(u32, u32, String)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((
                it.next()?.parse().ok()?,
                it.next()?.parse().ok()?,
                it.next()?.to_string(),
            ))
        })
        .collect();
    let mut tree = vec![root];
    let mut found = Vec::new();
    let mut i = 0;
    while i < tree.len() {
        for (pid, ppid, comm) in &rows {
            if *ppid == tree[i] {
                tree.push(*pid);
                if comm.starts_with(name) {
                    found.push(*pid);
                }
            }
        }
        i += 1;
    }
    found.sort();
    found
}

/// `onnx-train train` arguments for two data-parallel ranks of one sample each.
fn two_rank_train(cfg: &Path, out: &Path) -> Vec<String> {
    [
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--dp",
        "2",
        "--batch-size",
        "1",
    ]
    .map(String::from)
    .to_vec()
}

/// Preemption under MPI: SIGUSR1 to mpirun (which forwards it to the ranks; Slurm's
/// `--signal=USR1`) stops both ranks after the same update with a checkpoint and status
/// 75; the same job started again resumes there and ends bit-identical to a clean job.
#[test]
fn sigusr1_preempts_an_mpi_job_and_the_rerun_ends_bit_identical() {
    let _serial = one_job_at_a_time();
    let dir = tempdir("mpi-preempt");
    let cfg = setup(&dir, "gpt2", 200);
    let job = |out: &str| {
        let mut cmd = mpirun(2);
        cmd.arg(onnx_train())
            .args(two_rank_train(&cfg, &dir.join(out)))
            .args(["--display-loss-steps", "1"]);
        cmd
    };
    let clean = job("clean").output().unwrap();
    assert!(
        clean.status.success(),
        "{}",
        String::from_utf8_lossy(&clean.stderr)
    );

    let mut cut = job("cut");
    cut.stdout(Stdio::null());
    // timeout -> mpirun (OpenMPI's orterun) -> the ranks: mpirun forwards SIGUSR1.
    let (status, log) = signal_after_first_update(cut, "-USR1", |pid| {
        [
            descendants_named(pid, "mpirun"),
            descendants_named(pid, "orterun"),
        ]
        .concat()[0]
    });
    assert_eq!(status.code(), Some(75), "mpirun's status:\n{log}");
    let kept = burn_onnx_train::train::checkpoint::list_checkpoints(&dir.join("cut/checkpoints"));
    assert_eq!(kept.len(), 1, "{kept:?}");
    let stop = kept[0].0;
    assert!((1..200).contains(&stop), "stopped mid-run at {stop}");
    // Each rank process reports its stop, all after the checkpoint's update (the
    // checkpoint itself, written by both ranks together, is the proof that both stopped
    // there). mpirun ends the job at the first rank's status 75, so the other rank's line
    // can be cut off: at least one line, and none naming another update.
    let stopped = format!("stopped by SIGUSR1 after update {stop}: checkpoint written");
    assert!(
        log.matches(&stopped).count() >= 1
            && log.matches("stopped by SIGUSR1 after update").count()
                == log.matches(&stopped).count(),
        "the ranks stopped after the checkpoint's update:\n{log}"
    );

    let rerun = job("cut").output().unwrap();
    let log = String::from_utf8_lossy(&rerun.stderr);
    assert!(rerun.status.success() && log.contains("resumed"), "{log}");
    let file = "gpt2_tiny_trained.onnx";
    for ((name, a), (_, b)) in onnx_params(dir.join("clean").join(file))
        .iter()
        .zip(onnx_params(dir.join("cut").join(file)))
    {
        assert!(
            *a == b,
            "{name}: the resumed job differs from the clean one"
        );
    }
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &dir.join("clean").join(file),
        1e-4,
    );
}

/// `onnx-train launch`: a rank killed mid-run ends the MPI job; the wrapper starts it again,
/// it resumes from the newest checkpoint and ends exactly where an uninterrupted job does.
/// A 300-update gpt2_tiny config with a checkpoint every 20 updates under `dir`, and the
/// model of a clean two-rank run of it (`dir/clean`).
fn checkpointed_two_rank_run(dir: &Path) -> (PathBuf, PathBuf) {
    let cfg = setup(dir, "gpt2", 300);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("checkpoint_period = 0", "checkpoint_period = 20");
    std::fs::write(&cfg, text).unwrap();
    let clean = mpirun(2)
        .arg(onnx_train())
        .args(two_rank_train(&cfg, &dir.join("clean")))
        .output()
        .unwrap();
    assert!(
        clean.status.success(),
        "{}",
        String::from_utf8_lossy(&clean.stderr)
    );
    (cfg, dir.join("clean/gpt2_tiny_trained.onnx"))
}

/// `onnx-train launch --np 2 LAUNCH_ARGS -- train` (two ranks) into `dir/elastic`; once its
/// first checkpoint exists, `lose()` runs and one rank is killed. The launcher's status and
/// standard output.
fn launch_and_kill_a_rank(
    dir: &Path,
    cfg: &Path,
    launch_args: &[&str],
    lose: impl FnOnce(),
) -> (ExitStatus, String) {
    let mut job = Command::new("timeout")
        .args(["-k", "10", "600", onnx_train(), "launch", "--np", "2"])
        .args(launch_args)
        .args(["--mpirun-arg=--oversubscribe", "--"])
        .args(two_rank_train(cfg, &dir.join("elastic")))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !dir
        .join("elastic/checkpoints/ckpt-000000020/state.json")
        .is_file()
    {
        assert!(Instant::now() < deadline, "no checkpoint appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    lose();
    // timeout -> onnx-train launch -> mpirun -> the two ranks.
    let launcher = descendants_named(job.id(), "onnx-train")[0];
    let ranks = descendants_named(launcher, "onnx-train");
    assert_eq!(ranks.len(), 2, "two ranks under the launcher");
    Command::new("kill")
        .args(["-9", &ranks[1].to_string()])
        .status()
        .unwrap();
    let status = job.wait().unwrap();
    let mut stdout = String::new();
    std::io::Read::read_to_string(job.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    (status, stdout)
}

#[test]
fn launch_restarts_a_job_whose_rank_was_killed() {
    let _serial = one_job_at_a_time();
    let dir = tempdir("mpi-elastic");
    let (cfg, clean) = checkpointed_two_rank_run(&dir);
    let (status, stdout) = launch_and_kill_a_rank(&dir, &cfg, &["--max-restarts", "1"], || {});
    assert!(status.success(), "the restarted job must finish: {stdout}");
    assert!(stdout.contains("after 1 restart(s)"), "{stdout}");
    let elastic = dir.join("elastic/gpt2_tiny_trained.onnx");
    for ((name, a), (_, b)) in onnx_params(clean).iter().zip(onnx_params(elastic.clone())) {
        assert_eq!(
            a, &b,
            "{name}: the restarted job differs from the uninterrupted one"
        );
    }
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &elastic, 1e-3);
}

/// `--min-np 1`: the killed rank's host is lost for good (an `mpirun` that can no longer
/// place two ranks, as OpenMPI fails when a hostfile's host is down), so the restart at
/// two ranks fails too, and the job shrinks to one rank accumulating two micro-steps per
/// update: it finishes the 300 updates on the same samples, ending where the clean
/// two-rank run ends (up to the order of the gradient sums).
#[test]
fn launch_shrinks_a_job_that_lost_a_rank_for_good_and_keeps_the_global_batch() {
    let _serial = one_job_at_a_time();
    let dir = tempdir("mpi-elastic-shrink");
    let (cfg, clean) = checkpointed_two_rank_run(&dir);
    let lost = dir.join("host-lost");
    let cluster = dir.join("mpirun-on-a-cluster");
    std::fs::write(
        &cluster,
        format!(
            "#!/bin/sh\n# mpirun -np N ...: more than one rank cannot be placed once a host is lost\nif [ -e '{}' ] && [ \"$2\" != 1 ]; then echo \"no slots for $2 ranks: a host is lost\" >&2; exit 1; fi\nexec mpirun \"$@\"\n",
            lost.display()
        ),
    )
    .unwrap();
    let mut perms = std::fs::metadata(&cluster).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&cluster, perms).unwrap();
    let mpirun_arg = format!("--mpirun={}", cluster.display());
    let (status, stdout) = launch_and_kill_a_rank(
        &dir,
        &cfg,
        &["--max-restarts", "2", "--min-np", "1", &mpirun_arg],
        || std::fs::write(&lost, "").unwrap(),
    );
    assert!(status.success(), "the shrunk job must finish: {stdout}");
    assert!(stdout.contains("after 2 restart(s)"), "{stdout}");
    // The last attempt ran on one rank, accumulating the global batch's two micro-steps.
    let perf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("elastic/perf.json")).unwrap()).unwrap();
    assert_eq!(perf["world_size"], 1, "{perf}");
    assert_eq!(perf["gradient_accumulation_steps"], 2, "{perf}");
    let elastic = dir.join("elastic/gpt2_tiny_trained.onnx");
    for ((name, a), (_, b)) in onnx_params(clean).iter().zip(onnx_params(elastic.clone())) {
        let diff = max_abs_diff(a, &b);
        assert!(
            diff < 1e-4,
            "{name}: the shrunk job is {diff} from the uninterrupted one"
        );
    }
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &elastic, 1e-3);
}

/// `train --auto` under mpirun: rank 0 tries the layouts of the job's 2 processes (its
/// probes run as processes of their own, outside the job) while rank 1 waits, both run the
/// layout rank 0 printed, and the run keeps the configured global batch of 4.
#[test]
fn auto_under_mpirun_runs_the_layout_rank_0_chose_on_every_rank() {
    let _serial = one_job_at_a_time();
    let dir = tempdir("mpi-auto");
    let cfg = setup(&dir, "gpt2", 4);
    let out = dir.join("auto");
    let run = mpirun(2)
        .arg(onnx_train())
        .args(["train", "--config", cfg.to_str().unwrap()])
        .args(["--output-dir", out.to_str().unwrap()])
        .args(["--batch-size", "4", "--auto"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(run.status.success(), "{stderr}");
    auto_choice_ran(&stderr, &out, 2, 4);
    assert!(out.join("gpt2_tiny_trained.onnx").exists());
}
