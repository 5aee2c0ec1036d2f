//! The `onnx-train` command line: `inspect` lists what the file holds, its pipeline cut
//! and its tensor-parallel split, `run` writes every graph output as `.npy` (checked
//! against onnxruntime), bad files exit non-zero with the file named, `train` flags reach
//! the config, a pipelined checkpoint exports the whole model, a torchrun launch is
//! refused, and SIGTERM mid-run stops both ranks after one update with a checkpoint that
//! the same command resumes from, ending bit-identical to an uninterrupted run (its
//! `metrics.jsonl` too).

use super::common;

use std::process::Command;

use common::*;

fn onnx_train(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-train"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn inspect_lists_inputs_ops_and_parameters() {
    let model = refkit("models/gpt2_tiny.onnx");
    let out = onnx_train(&["inspect", model.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("input_ids int64 [batch, seq]"), "{text}");
    assert!(text.contains("LayerNormalization       5"), "{text}");
    assert!(
        text.contains("m.transformer.wte.weight") && text.contains("[1024, 128]"),
        "{text}"
    );
    assert!(
        // 29 initializers; the transposed copy of the embedding (lm_head) trains as it.
        text.contains("28 parameters (544256 trainable elements, 0 state, 0 constant)"),
        "{text}"
    );
    assert!(
        text.contains("m.transformer.wte.weight") && text.contains("trainable: weight"),
        "{text}"
    );
}

#[test]
fn run_writes_outputs_equal_to_onnxruntime() {
    let dir = tempdir("cli-run");
    let model = refkit("models/lenet_bn.onnx");
    let input = refkit("inference/lenet_bn/input.npy");
    let out = onnx_train(&[
        "run",
        model.to_str().unwrap(),
        "--input",
        &format!("input={}", input.display()),
        "--output-dir",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = npy_f32(dir.join("logits.npy"));
    assert_close(
        "lenet_bn via CLI",
        &got,
        &npy_f32(refkit("inference/lenet_bn/output_ort_legacy.npy")),
        1e-4,
        1e-4,
    );
}

#[test]
fn bad_file_fails_with_its_name() {
    let out = onnx_train(&["inspect", "Cargo.toml"]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("Cargo.toml") && err.contains("not a valid ONNX model"),
        "{err}"
    );
}

/// Token shards and a 4-update config for gpt2_tiny under `dir`, checkpointing every 2.
/// `ids` as the token shard `dir/data/tokens.npy` and, in `dir/run.toml`, the quiet
/// gpt2_tiny config of `gpt2_config` reading it, as `edit` changes it.
fn token_run(
    dir: &std::path::Path,
    ids: Vec<i64>,
    edit: impl FnOnce(&mut burn_onnx_train::train::TrainingConfig),
) -> std::path::PathBuf {
    use burn_onnx_train::train::data::npy::write_npy;

    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    write_npy(
        data.join("tokens.npy"),
        &burn_onnx_train::Value::Int(
            ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&[ids.len()]), ids).unwrap(),
        ),
    )
    .unwrap();
    let mut c = gpt2_config(&dir.join("out"));
    c.data.train_data_dir = data;
    edit(&mut c);
    let path = dir.join("run.toml");
    std::fs::write(&path, c.to_toml().unwrap()).unwrap();
    path
}

fn train_setup(dir: &std::path::Path) -> std::path::PathBuf {
    let mut next = lcg(7);
    let ids: Vec<i64> = (0..16 * 32).map(|_| (next() % 1024) as i64).collect();
    token_run(dir, ids, |c| {
        c.train.num_train_steps = 4;
        c.checkpoint.checkpoint_period = 2;
        c.logging.display_loss_steps = 2;
    })
}

#[test]
fn print_config_shows_the_effective_config_and_a_run_writes_it() {
    use burn_onnx_train::train::TrainingConfig;
    let dir = tempdir("cli-print-config");
    let cfg = train_setup(&dir);
    let out = onnx_train(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--dp",
        "2",
        "--print-config",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = TrainingConfig::from_toml(&String::from_utf8_lossy(&out.stdout), &cfg).unwrap();
    assert_eq!(
        printed.parallel.data_parallel_size, 2,
        "the flag over the file"
    );
    assert_eq!(
        printed.train.num_train_steps, 4,
        "the file over the defaults"
    );
    assert!(!dir.join("out").exists(), "nothing ran");
    // --set reaches any field, in sections too; an unknown key is named.
    let out = onnx_train(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "optimizer.kind=sgd",
        "--set",
        "lr.initial_lr = 0.25",
        "--set",
        "zero_stage=1",
        "--print-config",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let set = TrainingConfig::from_toml(&String::from_utf8_lossy(&out.stdout), &cfg).unwrap();
    assert_eq!(
        (
            set.optimizer.kind,
            set.lr.initial_lr,
            set.parallel.zero_stage
        ),
        (burn_onnx_train::train::config::OptimizerKind::Sgd, 0.25, 1)
    );
    let out = onnx_train(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "no_such=1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no_such"), "{err}");
    // A run writes what it uses (epochs resolved, flags applied) to its output directory.
    let out = onnx_train(&["train", "--config", cfg.to_str().unwrap(), "--dp", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = dir.join("out/config.toml");
    let used = TrainingConfig::from_file(&written).unwrap();
    assert_eq!(used.to_toml().unwrap(), printed.to_toml().unwrap());
    // A file that leaves the checkpoint period out checkpoints every 500 updates (the
    // library's default is never).
    let minimal = dir.join("minimal.toml");
    std::fs::write(
        &minimal,
        format!(
            "model_path = {:?}\ntrain_data_dir = {:?}\n",
            used.model.model_path, used.data.train_data_dir
        ),
    )
    .unwrap();
    let out = onnx_train(&[
        "train",
        "--config",
        minimal.to_str().unwrap(),
        "--print-config",
    ]);
    let printed =
        TrainingConfig::from_toml(&String::from_utf8_lossy(&out.stdout), &minimal).unwrap();
    assert_eq!(printed.checkpoint.checkpoint_period, 500);
    assert_eq!(TrainingConfig::default().checkpoint.checkpoint_period, 0);
}

#[test]
fn resume_never_latest_or_a_path_and_overwrite() {
    let dir = tempdir("cli-resume");
    let cfg = train_setup(&dir);
    let cfg = cfg.to_str().unwrap();
    let run = |extra: &[&str]| {
        let out = onnx_train(&[&["train", "--config", cfg][..], extra].concat());
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let exported = || onnx_params(dir.join("out/gpt2_tiny_trained.onnx"));
    let (ok, log) = run(&[]);
    assert!(ok && !log.contains("resumed"), "{log}");
    let first = exported();
    // Checkpoints at updates 2 and 4 are there: starting over must be asked for.
    let (ok, log) = run(&["--resume", "never"]);
    assert!(!ok && log.contains("--overwrite"), "{log}");
    let (ok, log) = run(&["--resume", "never", "--overwrite"]);
    assert!(
        ok && !log.contains("resumed") && log.contains("deleted"),
        "{log}"
    );
    assert!(exported() == first, "a fresh run again, the same result");
    // From a given checkpoint: update 2 of this run, then on to the same end.
    let ckpt = dir.join("out/checkpoints/ckpt-000000002");
    let (ok, log) = run(&["--resume", ckpt.to_str().unwrap()]);
    assert!(
        ok && log.contains("resumed") && log.contains("update=2"),
        "{log}"
    );
    assert!(
        exported() == first,
        "resumed from update 2, the same result"
    );
    // The default, latest: the newest checkpoint is the last update, nothing to train.
    let (ok, log) = run(&["--resume", "latest"]);
    assert!(ok && log.contains("already at the last update"), "{log}");
}

#[test]
fn a_torchrun_launch_is_refused_with_the_mpirun_command() {
    // What torchrun sets for rank 1 of 2: without the refusal both processes would train
    // alone into one output directory.
    let dir = tempdir("cli-torchrun");
    let cfg = train_setup(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_onnx-train"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .envs([
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("torchrun") && log.contains("mpirun -np 2 onnx-train train"),
        "{log}"
    );
    assert!(
        !dir.join("out/checkpoints").exists(),
        "nothing trained or written"
    );
}

#[test]
fn an_srun_step_without_pmix_is_refused_and_a_batch_script_is_not() {
    // What `srun -n 2` (no --mpi=pmix) sets for task 1: refused with the srun command.
    let dir = tempdir("cli-srun");
    let cfg = train_setup(&dir);
    let run = |env: &[(&str, &str)]| {
        Command::new(env!("CARGO_BIN_EXE_onnx-train"))
            .args(["train", "--config", cfg.to_str().unwrap()])
            .envs(env.iter().copied())
            .output()
            .unwrap()
    };
    let slurm_job = [
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "1"),
    ];
    let step: Vec<_> = slurm_job
        .iter()
        .copied()
        .chain([("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "2")])
        .collect();
    let out = run(&step);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("task 1 of 2") && log.contains("srun --mpi=pmix -n 2 onnx-train train"),
        "{log}"
    );
    assert!(!dir.join("out/checkpoints").exists(), "nothing trained");
    // The batch script of the same allocation (SLURM_NTASKS but no step) trains.
    let out = run(&[
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_PROCID", "0"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `onnx-train train` on `cfg` with two thread ranks, 60 updates, no periodic checkpoint,
/// a loss line every update, into `out`.
fn preemptible_run(cfg: &std::path::Path, out: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_onnx-train"));
    cmd.args(["train", "--config", cfg.to_str().unwrap()])
        .args(["--output-dir", out.to_str().unwrap()])
        .args(["--dp", "2", "--steps", "60", "--checkpoint-period", "0"])
        .args(["--display-loss-steps", "1"]);
    cmd
}

#[test]
fn sigterm_stops_every_rank_with_a_checkpoint_and_the_rerun_ends_bit_identical() {
    let dir = tempdir("cli-preempt");
    let cfg = train_setup(&dir);
    let whole = dir.join("whole");
    let out = preemptible_run(&cfg, &whole).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The same run, sent SIGTERM once its first update is logged.
    let cut = dir.join("cut");
    let (status, log) = signal_after_first_update(preemptible_run(&cfg, &cut), "-TERM", |pid| pid);
    assert_eq!(status.code(), Some(75), "the preempted status:\n{log}");
    assert!(log.contains("stopped by SIGTERM after update"), "{log}");
    let kept = burn_onnx_train::train::checkpoint::list_checkpoints(&cut.join("checkpoints"));
    assert_eq!(
        kept.len(),
        1,
        "one checkpoint, at the stop: {kept:?}\n{log}"
    );
    let stop = kept[0].0;
    assert!((1..60).contains(&stop), "stopped mid-run, at update {stop}");
    assert!(
        !cut.join("gpt2_tiny_trained.onnx").exists(),
        "a preempted run exports nothing"
    );

    // The same command again resumes at the stop and ends where the whole run did.
    let out = preemptible_run(&cfg, &cut).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("resumed"), "{log}");
    let (a, b) = (
        onnx_params(whole.join("gpt2_tiny_trained.onnx")),
        onnx_params(cut.join("gpt2_tiny_trained.onnx")),
    );
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name}: the resumed run differs from the whole one");
    }
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &whole.join("gpt2_tiny_trained.onnx"),
        1e-3,
    );
    // metrics.jsonl: one line per update, the resumed run's continuing the stopped one's.
    let train_lines = |dir: &std::path::Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|j| j["kind"] == "train")
            .map(|j| (j["step"].as_u64().unwrap(), j["loss"].as_f64().unwrap()))
            .collect()
    };
    let (a, b) = (train_lines(&whole), train_lines(&cut));
    assert_eq!(
        a.iter().map(|l| l.0).collect::<Vec<_>>(),
        (1..=60).collect::<Vec<_>>()
    );
    assert_eq!(a, b, "the same losses, each step once");
}

#[test]
fn train_logs_its_run_and_export_rebuilds_the_model_from_a_checkpoint() {
    let dir = tempdir("cli-train");
    let cfg = train_setup(&dir);
    let out = onnx_train(&["train", "--config", cfg.to_str().unwrap()]);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert_eq!(
        log.matches(" train ").count(),
        2,
        "a loss line every display_loss_steps (2 of 4 updates):\n{log}"
    );
    assert!(
        log.contains("train step 4/4: loss ")
            && log.contains("checkpoint")
            && log.contains("exported"),
        "{log}"
    );
    let exported = dir.join("from_ckpt.onnx");
    let ckpt = dir.join("out/checkpoints/ckpt-000000004");
    let out = onnx_train(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--output",
        exported.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for ((name, a), (_, b)) in onnx_params(dir.join("out/gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(exported))
    {
        assert_eq!(
            a, &b,
            "{name}: the checkpoint export differs from the run's export"
        );
    }
    // The checkpoint of step 2 differs: the export really reads the checkpoint.
    let early = dir.join("early.onnx");
    let ckpt2 = dir.join("out/checkpoints/ckpt-000000002");
    assert!(
        onnx_train(&[
            "export",
            "--checkpoint",
            ckpt2.to_str().unwrap(),
            "--output",
            early.to_str().unwrap(),
            "--model",
            refkit("models/gpt2_tiny.onnx").to_str().unwrap()
        ])
        .status
        .success()
    );
    assert_ne!(
        onnx_params(early),
        onnx_params(dir.join("out/gpt2_tiny_trained.onnx"))
    );
    // A few flipped bytes in the checkpoint's model: export refuses it, naming the file.
    let model = ckpt2.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&model, bytes).unwrap();
    let refused = dir.join("refused.onnx");
    let out = onnx_train(&[
        "export",
        "--checkpoint",
        ckpt2.to_str().unwrap(),
        "--output",
        refused.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !refused.exists(), "{err}");
    assert!(
        err.contains("ckpt-000000002/model.safetensors") && err.contains("damaged"),
        "{err}"
    );
}

#[test]
fn inspect_prints_the_pipeline_cut() {
    let model = refkit("models/gpt2_tiny.onnx");
    let out = onnx_train(&["inspect", model.to_str().unwrap(), "--stages", "2"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    assert!(text.contains("pipeline: 2 stages"), "{text}");
    assert!(
        text.contains("stage 0: nodes 0..") && text.contains("stage 1: nodes "),
        "{text}"
    );
    assert!(
        text.contains("..230 ("),
        "the last stage ends at the last of 230 nodes (Constants fold away, each 8-node GELU is one, each attention's scaling Mul, mask Add, two products and probabilities' Cast fold into its Softmax, the lm_head reads the embedding through a Transpose):\n{text}"
    );
    let out = onnx_train(&["inspect", model.to_str().unwrap(), "--stages", "500"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("500 stages for a graph of 230 nodes"));
}

#[test]
fn inspect_prints_the_tensor_parallel_split() {
    let model = refkit("models/gpt2_tiny.onnx");
    let out = onnx_train(&["inspect", model.to_str().unwrap(), "--tp", "2"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("tensor parallel: 2 ranks, 4 column-parallel projection(s)"),
        "{text}"
    );
    assert!(
        text.contains("split m.transformer.h.0.attn.c_attn.weight [128, 384]: axis 1, period 128"),
        "{text}"
    );
    assert!(
        text.contains("split m.transformer.h.1.mlp.c_proj.weight [512, 128]: axis 0, period 512"),
        "{text}"
    );
    assert!(text.contains("parameter elements per rank: "), "{text}");
}

#[test]
fn a_pipelined_checkpoint_exports_the_whole_model() {
    // `--pp 2` on threads writes a checkpoint with one model file per stage; `export
    // --checkpoint` merges them into the run's own export, bit for bit.
    let dir = tempdir("cli-pp");
    let cfg = train_setup(&dir);
    let out = onnx_train(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--pp",
        "2",
        "--micro-batches",
        "2",
        "--pipeline-schedule",
        "gpipe",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ckpt = dir.join("out/checkpoints/ckpt-000000004");
    assert!(ckpt.join("model-stage-1.safetensors").is_file());
    let exported = dir.join("from_ckpt.onnx");
    export_checkpoint(&ckpt, &exported);
    let (run, merged) = (
        onnx_params(dir.join("out/gpt2_tiny_trained.onnx")),
        onnx_params(exported),
    );
    assert_eq!(run.len(), merged.len());
    for ((name, a), (_, b)) in run.iter().zip(&merged) {
        assert_eq!(
            a, b,
            "{name}: the checkpoint export differs from the run's export"
        );
    }
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &dir.join("out/gpt2_tiny_trained.onnx"),
        1e-3,
    );

    // `--safetensors`: the same merged weights as one Hugging Face-style file, read here
    // by its published layout (u64 header length, JSON header, little-endian data).
    let weights = dir.join("from_ckpt.safetensors");
    let out = onnx_train(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--output",
        weights.to_str().unwrap(),
        "--safetensors",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = std::fs::read(&weights).unwrap();
    let header_len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + header_len]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt");
    let data = &file[8 + header_len..];
    for (name, a) in &run {
        let entry = &header[name.as_str()];
        assert_eq!(entry["dtype"], "F32", "{name}");
        let shape: Vec<usize> = serde_json::from_value(entry["shape"].clone()).unwrap();
        assert_eq!(shape, a.shape(), "{name}: logical shape");
        let [from, to]: [usize; 2] = serde_json::from_value(entry["data_offsets"].clone()).unwrap();
        let values: Vec<f32> = data[from..to]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(values, a.iter().copied().collect::<Vec<_>>(), "{name}");
    }
    assert_eq!(
        header.as_object().unwrap().len(),
        run.len() + 1,
        "every parameter and the metadata"
    );
}

#[test]
fn flags_override_the_config_file_only_when_given() {
    use burn_onnx_train::frontend::flags::ConfigFlags;
    use burn_onnx_train::train::TrainingConfig;
    let dir = tempdir("cli-flags");
    let file = dir.join("run.toml");
    std::fs::write(&file, "batch_size = 3\n[lr]\nwarmup_ratio = 0.2\n").unwrap();
    let defaults = {
        let mut c = TrainingConfig::default();
        c.data.batch_size = 8;
        c.data.seq_len = 64;
        c.train.num_train_steps = 400;
        c.lr = burn_onnx_train::train::config::LrConfig {
            initial_lr: 5e-4,
            ..Default::default()
        };
        c
    };
    let flags = ConfigFlags {
        config: Some(file.clone()),
        ..Default::default()
    };
    let c = flags.apply(defaults.clone()).unwrap();
    assert_eq!(
        (c.data.batch_size, c.data.seq_len, c.train.num_train_steps),
        (3, 64, 400),
        "the file sets batch_size only"
    );
    assert_eq!(
        (c.lr.warmup_ratio, c.lr.initial_lr),
        (0.2, 5e-4),
        "nested tables merge field by field"
    );
    let flags = ConfigFlags {
        config: Some(file),
        batch_size: Some(5),
        steps: Some(10),
        accumulation: Some(2),
        ..Default::default()
    };
    let c = flags.apply(defaults).unwrap();
    assert_eq!(
        (
            c.data.batch_size,
            c.train.num_train_steps,
            c.train.gradient_accumulation_steps,
            c.train.num_updates()
        ),
        (5, 20, 2, 10),
        "--steps counts updates"
    );
}

#[test]
fn gpt2_builds_a_model_and_export_rewrites_it_with_external_data() {
    let dir = tempdir("cli-gpt2");
    let model = dir.join("tiny.onnx");
    let out = onnx_train(&[
        "gpt2",
        "--output",
        model.to_str().unwrap(),
        "--layers",
        "1",
        "--heads",
        "2",
        "--width",
        "16",
        "--vocab",
        "64",
        "--positions",
        "16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let moved = dir.join("ext/tiny.onnx");
    let out = onnx_train(&[
        "export",
        "--model",
        model.to_str().unwrap(),
        "--output",
        moved.to_str().unwrap(),
        "--external-data",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        dir.join("ext/tiny.onnx.data").is_file(),
        "weights in external data"
    );
    assert_eq!(onnx_params(moved), onnx_params(model.clone()));
    let out = onnx_train(&["export", "--output", dir.join("x.onnx").to_str().unwrap()]);
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("--checkpoint, --model")
    );
}

#[test]
fn an_empty_config_names_the_fields_it_needs() {
    let dir = tempdir("cli-empty-config");
    let cfg = dir.join("empty.toml");
    std::fs::write(&cfg, "").unwrap();
    let out = onnx_train(&["train", "--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("config.model.model_path") && err.contains("is required"),
        "{err}"
    );
    std::fs::write(&cfg, "model_path = \"m.onnx\"\n").unwrap();
    let out = onnx_train(&["train", "--config", cfg.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("config.data.train_data_dir") && err.contains("is required"),
        "{err}"
    );
}

#[test]
fn a_deepspeed_config_sets_its_fields_and_names_the_keys_it_cannot_honour() {
    let dir = tempdir("cli-deepspeed");
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, "model_path = \"m.onnx\"\nnum_train_steps = 40\n").unwrap();
    let ds = dir.join("ds.json");
    let print = |json: &str| {
        std::fs::write(&ds, json).unwrap();
        onnx_train(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--deepspeed",
            ds.to_str().unwrap(),
            "--print-config",
        ])
    };
    let out = print(
        r#"{
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "steps_per_print": 5,
        "fp16": {"enabled": true, "loss_scale": 0, "loss_scale_window": 500},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100, "warmup_max_lr": 3e-4, "warmup_type": "linear"}},
        "tensorboard": {"enabled": true, "output_path": "tb", "job_name": "ds"}
    }"#,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c: toml::Table = toml::from_str(&text).unwrap();
    let get = |k: &str| {
        let (section, field) = k.split_once('.').unwrap();
        c[section][field].clone()
    };
    assert_eq!(get("data.batch_size").as_integer(), Some(8));
    assert_eq!(
        get("train.gradient_accumulation_steps").as_integer(),
        Some(2)
    );
    assert_eq!(get("train.max_grad_norm").as_float(), Some(0.5));
    assert_eq!(get("logging.display_loss_steps").as_integer(), Some(5));
    assert_eq!(get("precision.dtype").as_str(), Some("f16"));
    assert_eq!(get("precision.loss_scale").as_float(), Some(0.0));
    assert_eq!(
        get("precision.loss_scale_growth_interval").as_integer(),
        Some(500)
    );
    assert_eq!(get("parallel.zero_stage").as_integer(), Some(2));
    // 100 updates of 2 micro-steps; warm-up 10 of 100 updates; DeepSpeed's Adam is AdamW.
    assert_eq!(get("train.num_train_steps").as_integer(), Some(200));
    assert_eq!(get("logging.log_dir").as_str(), Some("tb/ds"));
    let (o, lr) = (
        c["optimizer"].as_table().unwrap(),
        c["lr"].as_table().unwrap(),
    );
    assert_eq!(o["kind"].as_str(), Some("adamw"));
    assert_eq!(o["beta2"].as_float().map(|b| b as f32), Some(0.95));
    assert_eq!(o["weight_decay"].as_float().map(|w| w as f32), Some(0.1));
    assert_eq!(lr["initial_lr"].as_float(), Some(3e-4));
    assert_eq!(lr["mode"].as_str(), Some("linear"));
    assert_eq!(lr["warmup_ratio"].as_float(), Some(0.1));
    // ZeRO-Infinity's NVMe offload of the optimizer state is the state on disk.
    let out = print(
        r#"{"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/nvme"}}}"#,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c: toml::Table = toml::from_str(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(c["offload"]["offload_optimizer"].as_str(), Some("disk"));
    assert_eq!(c["offload"]["offload_dir"].as_str(), Some("/tmp/nvme"));
    // ZeRO-Infinity's CPU offload of ZeRO-3's parameters.
    let out = print(r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}"#);
    let c: toml::Table = toml::from_str(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(c["offload"]["offload_params"].as_str(), Some("cpu"));
    // ... and its NVMe offload of them: the chunks on disk, in the one offload directory.
    let out = print(
        r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp/nvme"}}}"#,
    );
    let c: toml::Table = toml::from_str(&String::from_utf8_lossy(&out.stdout)).unwrap();
    assert_eq!(c["offload"]["offload_params"].as_str(), Some("disk"));
    assert_eq!(c["offload"]["offload_dir"].as_str(), Some("/tmp/nvme"));
    // What it cannot honour is an error naming the key.
    for (json, key) in [
        (
            r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}"#,
            "zero_optimization.offload_param.device",
        ),
        (
            r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"}, "offload_param": {"device": "nvme", "nvme_path": "/b"}}}"#,
            "zero_optimization.offload_param.nvme_path",
        ),
        (
            r#"{"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}"#,
            "zero_optimization.offload_optimizer.device",
        ),
        (
            r#"{"zero_optimization": {"stage": 2, "zero_quantized_weights": true}}"#,
            "zero_optimization.zero_quantized_weights",
        ),
        (r#"{"prescale_gradients": true}"#, "prescale_gradients"),
        (
            r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}"#,
            "warmup_type",
        ),
        (
            r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}"#,
            "train_batch_size 64",
        ),
    ] {
        let out = print(json);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("ds.json") && err.contains(key),
            "{key}: {err}"
        );
    }
}

/// A GPT-2 of 4 layers x 256 wide with 8192 words (5.3 M parameters) and 64 windows of
/// 128 random tokens in `dir`, with a config of 8 x 128 tokens per micro-step: big enough
/// that parameters, moments and the tape, not the runtime, make a run's peak memory.
fn plan_setup(dir: &std::path::Path) -> std::path::PathBuf {
    gpt2_run(dir, 4, 256, 8192, 128)
}

/// A GPT-2 of `layers` x `width` (4 heads), `vocab` words and `seq` positions on random
/// tokens, 8 samples a micro-batch, 6 updates: its run config under `dir`.
fn gpt2_run(
    dir: &std::path::Path,
    layers: usize,
    width: usize,
    vocab: usize,
    seq: usize,
) -> std::path::PathBuf {
    use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};

    let model = dir.join("gpt2.onnx");
    write_gpt2(
        &Gpt2Config {
            n_layer: layers,
            n_head: 4,
            n_embd: width,
            vocab_size: vocab,
            n_positions: seq,
            ..Default::default()
        },
        &model,
    )
    .unwrap();
    let mut next = lcg(11);
    let ids: Vec<i64> = (0..64 * seq)
        .map(|_| (next() % vocab as u64) as i64)
        .collect();
    token_run(dir, ids, |c| {
        c.model.model_path = model;
        c.data.batch_size = 8;
        c.data.seq_len = seq;
        c.train.num_train_steps = 6;
        c.checkpoint.checkpoint_period = 0;
    })
}

/// `onnx-train plan` against real runs of the same layouts (one process, ranks as
/// threads): every rank's parameter and gradient bytes equal what the run's update
/// strategy reports in `perf.json`, its optimizer state within 2% (Burn's record adds its
/// keys), and the predicted peak of the process within 15% of the peak resident set the
/// kernel measured for the run with one rank. With several ranks as threads of one
/// process the same command's peak spreads from run to run (what each thread's allocator
/// heap keeps: 511-686 MiB over 16 runs of `--tp 2` alone, and a plan 36% above its run
/// while the whole test suite loaded the machine), so there the check is 50%: it still
/// catches a plan that forgets a replica or a micro-batch. `--memory-per-rank` says
/// whether it fits (exit status 3 when not).
#[test]
fn plan_predicts_each_layouts_memory_against_its_measured_run() {
    let dir = tempdir("cli-plan");
    let cfg = plan_setup(&dir);
    let cfg = cfg.to_str().unwrap();
    let out = dir.join("out");
    for (layout, tolerance) in [
        (&[][..], 0.15),
        (&["--recompute", "2"][..], 0.15),
        (&["--accumulation", "2"][..], 0.15),
        (&["--zero", "1", "--dp", "2"][..], 0.50),
        (&["--tp", "2"][..], 0.50),
        (&["--pp", "2"][..], 0.50),
        (&["--tp", "2", "--pp", "2"][..], 0.50),
    ] {
        let _ = std::fs::remove_dir_all(&out);
        let run = onnx_train(&[&["train", "--config", cfg][..], layout].concat());
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let perf: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("perf.json")).unwrap()).unwrap();
        let plan = onnx_train(&[&["plan", "--config", cfg, "--json"][..], layout].concat());
        assert!(
            plan.status.success(),
            "{}",
            String::from_utf8_lossy(&plan.stderr)
        );
        let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
        let column = |k: &str| -> Vec<u64> {
            perf[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        };
        // Ranks are laid out replica-inner: rank = stage * dp * tp + tp_rank * dp + replica.
        let ranks = plan["ranks"].as_array().unwrap();
        let dp = plan["dp"].as_u64().unwrap() as usize;
        let tp = plan["tp"].as_u64().unwrap() as usize;
        let measured = |k: &str, r: &serde_json::Value| -> u64 {
            let (t, s) = (
                r["tp_rank"].as_u64().unwrap() as usize,
                r["stage"].as_u64().unwrap() as usize,
            );
            column(k)[s * dp * tp + t * dp]
        };
        for r in ranks {
            for k in ["parameter_bytes", "gradient_bytes"] {
                assert_eq!(r[k].as_u64().unwrap(), measured(k, r), "{layout:?} {k} {r}");
            }
            let (want, got) = (
                measured("optimizer_state_bytes", r) as f64,
                r["optimizer_state_bytes"].as_u64().unwrap() as f64,
            );
            assert!(
                (got - want).abs() <= 0.02 * want,
                "{layout:?} optimizer state {got} vs {want}"
            );
        }
        let predicted = plan["process_base_bytes"].as_u64().unwrap()
            + dp as u64
                * ranks
                    .iter()
                    .map(|r| r["peak_bytes"].as_u64().unwrap())
                    .sum::<u64>();
        let peak = column("peak_rss_bytes")[0];
        let error = (predicted as f64 - peak as f64) / peak as f64;
        assert!(
            error.abs() <= tolerance,
            "{layout:?}: predicted {} MiB, measured {} MiB ({:+.1}%)",
            predicted >> 20,
            peak >> 20,
            error * 100.0
        );
        eprintln!(
            "{layout:?}: predicted {} MiB, measured {} MiB ({:+.1}%)",
            predicted >> 20,
            peak >> 20,
            error * 100.0
        );
    }
    let fits = onnx_train(&["plan", "--config", cfg, "--memory-per-rank", "64GiB"]);
    let text = String::from_utf8_lossy(&fits.stdout);
    assert!(
        fits.status.success() && text.contains("fits: a rank needs"),
        "{text}"
    );
    assert!(
        text.contains("parameters") && text.contains("working set"),
        "{text}"
    );
    let tight = onnx_train(&["plan", "--config", cfg, "--memory-per-rank", "100MiB"]);
    let err = String::from_utf8_lossy(&tight.stderr);
    assert_eq!(tight.status.code(), Some(3), "{err}");
    assert!(
        err.contains("does not fit")
            && err.contains("--memory-per-rank is 100.0 MiB")
            && err.contains("--auto"),
        "{err}"
    );
    let bad = onnx_train(&["plan", "--config", cfg, "--memory-per-rank", "lots"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("--memory-per-rank") && err.contains("'lots'"),
        "{err}"
    );
}

/// `plan --auto --np 2` tries every layout of two processes on a small GPT-2 (2 x 64, 8
/// samples a micro-batch, one process): dp 2 at ZeRO 0-3 (4 samples a replica: the
/// global batch kept), tp 2 and pp 2, each planned and timed; the ones that fit 1 GiB a
/// rank come first, fastest first. A limit below every layout's need fits none (exit
/// status 3). `train --auto` on two thread ranks runs the layout it chooses: its
/// perf.json has that layout and the same global batch.
#[test]
fn auto_ranks_every_layout_of_the_world_and_train_runs_the_chosen_one() {
    let dir = tempdir("cli-auto");
    let cfg = gpt2_run(&dir, 2, 64, 512, 32);
    let cfg = cfg.to_str().unwrap();
    let plan = onnx_train(&[
        "plan",
        "--config",
        cfg,
        "--auto",
        "--np",
        "2",
        "--memory-per-rank",
        "1GiB",
        "--json",
    ]);
    assert!(
        plan.status.success(),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    let trials: Vec<serde_json::Value> = serde_json::from_slice(&plan.stdout).unwrap();
    let layout = |t: &serde_json::Value| {
        [
            "dp",
            "tp",
            "pp",
            "zero_stage",
            "batch_size",
            "accumulation",
            "micro_batches",
            "chunks",
        ]
        .map(|k| t[k].as_u64().unwrap())
    };
    let mut got: Vec<[u64; 8]> = trials.iter().map(layout).collect();
    got.sort();
    // The pipeline with 2, 4 and 8 micro-batches of its 8 samples, and interleaved (2
    // chunks a rank) at 2.
    assert_eq!(
        got,
        vec![
            [1, 1, 2, 0, 8, 1, 2, 1],
            [1, 1, 2, 0, 8, 1, 2, 2],
            [1, 1, 2, 0, 8, 1, 4, 1],
            [1, 1, 2, 0, 8, 1, 8, 1],
            [1, 2, 1, 0, 8, 1, 0, 1],
            [2, 1, 1, 0, 4, 1, 0, 1],
            [2, 1, 1, 1, 4, 1, 0, 1],
            [2, 1, 1, 2, 4, 1, 0, 1],
            [2, 1, 1, 3, 4, 1, 0, 1],
        ]
    );
    let speeds: Vec<f64> = trials
        .iter()
        .map(|t| {
            assert!(t["refused"].is_null() && t["fits"] == true, "{t}");
            assert!(t["per_rank_bytes"].as_u64().unwrap() < 1 << 30, "{t}");
            t["throughput_per_sec"].as_f64().unwrap()
        })
        .collect();
    assert!(speeds.iter().all(|s| *s > 0.0), "{speeds:?}");
    assert!(
        speeds.windows(2).all(|w| w[0] >= w[1]),
        "fastest first: {speeds:?}"
    );
    let chosen = String::from_utf8_lossy(&plan.stderr).to_string();
    assert!(chosen.contains("chosen: --dp"), "{chosen}");

    let tight = onnx_train(&[
        "plan",
        "--config",
        cfg,
        "--auto",
        "--np",
        "2",
        "--memory-per-rank",
        "1MiB",
    ]);
    assert_eq!(
        tight.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&tight.stderr)
    );

    let out = dir.join("out");
    let run = onnx_train(&[
        "train",
        "--config",
        cfg,
        "--dp",
        "2",
        "--batch-size",
        "4",
        "--auto",
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // The global batch of --dp 2 --batch-size 4.
    auto_choice_ran(&String::from_utf8_lossy(&run.stderr), &out, 2, 8);
}

/// `train` with its model and data named by flags alone (no config file): it checks,
/// says what it will do, trains, and ends with a summary of the run.
#[test]
fn a_users_own_model_trains_from_flags_without_a_config_file() {
    let dir = tempdir("cli-own-model");
    train_setup(&dir);
    let data = dir.join("data");
    let out_dir = dir.join("flags-out");
    let model = refkit("models/gpt2_tiny.onnx");
    let args = [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--train-data",
        data.to_str().unwrap(),
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--accumulation",
        "2",
        "--steps",
        "2",
        "--output-dir",
        out_dir.to_str().unwrap(),
    ];
    // --check: every check of a run, what it would do, nothing written.
    let mut checked = args.to_vec();
    checked.push("--check");
    let out = onnx_train(&checked);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 512 tokens make 32 windows of 16: 4 x 2 samples per update, 128 tokens.
    for line in [
        "data     32 sequences of tokens",
        "batch    8 samples per update, 128 tokens",
        "updates  2 (4 micro-steps, 2 accumulated per update)",
        "layout   cpu, f32, 1 rank",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    assert!(!out_dir.exists(), "--check trains nothing");
    let out = onnx_train(&args);
    let log = String::from_utf8_lossy(&out.stderr);
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("updates  2 (4 micro-steps"),
        "the banner:\n{log}"
    );
    assert!(log.contains("train step 2/2: loss "), "{log}");
    assert!(
        summary.contains("train loss ")
            && summary.contains("2 updates in")
            && summary.contains(&format!(
                "exported {}",
                out_dir.join("gpt2_tiny_trained.onnx").display()
            ))
            && summary.contains(&format!(
                "checkpoint {}",
                out_dir.join("checkpoints/ckpt-000000002").display()
            ))
            && summary.contains("metrics.jsonl"),
        "{summary}"
    );
    // `export --checkpoint` takes the run directory (its newest checkpoint).
    let exported = dir.join("from-run-dir.onnx");
    export_checkpoint(&out_dir, &exported);
    assert_eq!(
        onnx_params(exported),
        onnx_params(out_dir.join("gpt2_tiny_trained.onnx")),
        "the run directory's newest checkpoint is the trained model"
    );
}

/// `onnx-train export --checkpoint checkpoint --output output`, which must succeed.
fn export_checkpoint(checkpoint: &std::path::Path, output: &std::path::Path) {
    let out = onnx_train(&[
        "export",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The exit status, standard error and the count of `needle` in it of `train` with `args`.
fn refused(args: &[&str], needle: &str) -> (Option<i32>, String, usize) {
    let out = onnx_train(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let n = err.matches(needle).count();
    (out.status.code(), err, n)
}

/// Bad input fails before the first update with exit 78, printed once, naming the field,
/// and `--max-restarts` never retries it.
#[test]
fn input_errors_exit_78_once_naming_the_field_and_are_never_restarted() {
    let dir = tempdir("cli-input-errors");
    let cfg = train_setup(&dir);
    let cfg = cfg.to_str().unwrap();
    let (code, err, n) = refused(
        &[
            "train",
            "--config",
            cfg,
            "--batch-size",
            "0",
            "--max-restarts",
            "2",
        ],
        "config.data.batch_size: must be at least 1",
    );
    assert_eq!((code, n), (Some(78), 1), "{err}");
    assert!(!err.contains("restarting"), "{err}");
    // `plan` checks the same config.
    let (code, err, n) = refused(
        &["plan", "--config", cfg, "--batch-size", "0"],
        "config.data.batch_size: must be at least 1",
    );
    assert_eq!((code, n), (Some(78), 1), "{err}");
    let (code, err, _) = refused(&["train", "--config", cfg, "--set", "data.seq_len=0"], "");
    assert_eq!(code, Some(78), "{err}");
    assert!(err.contains("config.data.seq_len"), "{err}");
    // A misspelt directory: the field and the absolute path it resolved to.
    let (code, err, _) = refused(
        &["train", "--config", cfg, "--train-data", "data/trian"],
        "",
    );
    assert_eq!(code, Some(78), "{err}");
    let absolute = std::env::current_dir().unwrap().join("data/trian");
    assert!(
        err.contains(&format!(
            "config.data.train_data_dir: {}: no such directory",
            absolute.display()
        )),
        "{err}"
    );
    // A key the config does not have: what was meant.
    let (code, err, _) = refused(&["train", "--config", cfg, "--set", "lr=1e-3"], "");
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("did you mean lr.initial_lr (flag --lr)?"),
        "{err}"
    );
    let (code, err, _) = refused(
        &["train", "--config", cfg, "--set", "learning_rate=1e-3"],
        "",
    );
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("unknown key learning_rate; did you mean lr.initial_lr"),
        "{err}"
    );
    // An input the graph does not have: the inputs it has and the flag to set.
    let (code, err, _) = refused(&["train", "--config", cfg, "--input-name", "tokens"], "");
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("config.model.input_name: 'tokens' is not an input of")
            && err.contains("(its inputs: input_ids); set it with --input-name input_ids"),
        "{err}"
    );
    // A device this binary was not built for.
    #[cfg(not(feature = "cuda"))]
    {
        let (code, err, _) = refused(
            &[
                "train",
                "--config",
                cfg,
                "--device",
                "cuda",
                "--max-restarts",
                "2",
            ],
            "",
        );
        assert_eq!(code, Some(78), "{err}");
        assert!(!err.contains("restarting"), "{err}");
    }
}

/// A checkpoint of another model in the output directory is said to be one.
#[test]
fn resuming_another_models_checkpoint_names_both_models() {
    let dir = tempdir("cli-other-model");
    let cfg = train_setup(&dir);
    let out = onnx_train(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let other = dir.join("other.onnx");
    let out = onnx_train(&[
        "gpt2",
        "--output",
        other.to_str().unwrap(),
        "--layers",
        "1",
        "--heads",
        "2",
        "--width",
        "32",
        "--vocab",
        "1024",
        "--positions",
        "64",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, err, _) = refused(
        &[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--model",
            other.to_str().unwrap(),
            "--steps",
            "6",
        ],
        "",
    );
    assert_eq!(code, Some(78), "{err}");
    assert!(
        err.contains("config.model.model_path")
            && err.contains(&format!(
                "was trained from {}",
                refkit("models/gpt2_tiny.onnx").display()
            ))
            && err.contains(&format!("this run uses {}", other.display())),
        "{err}"
    );
}

/// `init` writes a commented config from the graph that reads back as the run it says.
#[test]
fn init_writes_a_config_filled_from_the_graph() {
    use burn_onnx_train::train::TrainingConfig;
    let dir = tempdir("cli-init");
    let run = dir.join("run.toml");
    let model = refkit("models/gpt2_tiny.onnx");
    let args = [
        "init",
        model.to_str().unwrap(),
        "--output",
        run.to_str().unwrap(),
    ];
    let out = onnx_train(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&run).unwrap();
    let c = TrainingConfig::from_file(&run).unwrap();
    assert_eq!(
        (
            c.model.input_name.as_str(),
            c.model.output_name.as_str(),
            c.model.loss
        ),
        (
            "input_ids",
            "logits",
            burn_onnx_train::model::loss::LossKind::LmCrossEntropy
        )
    );
    // gpt2_tiny: 128 positions, 1024 tokens (refkit README).
    assert_eq!(c.data.seq_len, 128);
    assert!(
        text.contains("Token ids must be below 1024")
            && text.contains("at most 128 (the rows of")
            && text.contains("# The graph's inputs: input_ids (int64 [batch, seq])"),
        "{text}"
    );
    // An image classifier: its float input, cross-entropy on [batch, classes].
    let mlp = dir.join("mlp.toml");
    let out = onnx_train(&[
        "init",
        refkit("models/mlp.onnx").to_str().unwrap(),
        "--output",
        mlp.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = TrainingConfig::from_file(&mlp).unwrap();
    assert_eq!(
        (c.model.input_name.as_str(), c.model.loss),
        (
            "input",
            burn_onnx_train::model::loss::LossKind::CrossEntropy
        )
    );
    // It never writes over a file.
    let again = onnx_train(&args);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
}
