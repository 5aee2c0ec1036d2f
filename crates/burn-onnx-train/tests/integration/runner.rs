//! The training runner end to end on `gpt2_tiny` with token data: gradient accumulation
//! equivalence, checkpoint rotation, bit-exact resume, a checkpoint write killed half-way,
//! TensorBoard output, config validation.

use super::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::Device;
use burn_onnx_train::train::checkpoint::list_checkpoints;
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind, ScheduleKind};
use burn_onnx_train::train::data::Dataset;
use burn_onnx_train::train::report::tensorboard::{read_events, scalars};
use burn_onnx_train::train::{TrainingConfig, TrainingRunner};
use burn_onnx_train::{OnnxError, OnnxModel};
use burn_ort_dist::LocalCommunicator;
use common::*;

fn tokens() -> Arc<dyn Dataset> {
    gpt2_tokens()
}

fn config(out: &Path) -> TrainingConfig {
    gpt2_config(out)
}

fn run(c: TrainingConfig) -> burn_onnx_train::train::RunSummary {
    run_local(c)
}

#[test]
fn accumulating_k_micro_batches_equals_one_big_batch() {
    let (a, b) = (tempdir("runner-acc-a"), tempdir("runner-acc-b"));
    let base = |out: &Path| {
        let mut c = config(out);
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Sgd,
            weight_decay: 0.0,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.0;
        c.lr = burn_onnx_train::train::config::LrConfig {
            initial_lr: 0.1,
            ..Default::default()
        };
        c
    };
    // 2 updates of 4 micro-batches of 2 sequences vs 2 updates of one batch of 8.
    run({
        let mut c = base(&a);
        c.data.batch_size = 2;
        c.train.gradient_accumulation_steps = 4;
        c.train.num_train_steps = 8;
        c
    });
    run({
        let mut c = base(&b);
        c.data.batch_size = 8;
        c.train.gradient_accumulation_steps = 1;
        c.train.num_train_steps = 2;
        c
    });
    let init = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &Device::flex()).unwrap();
    for ((name, pa), (_, pb)) in onnx_params(a.join("gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(b.join("gpt2_tiny_trained.onnx")))
    {
        assert_close(
            &format!("accumulated vs big batch: {name}"),
            pa,
            &pb,
            1e-6,
            0.0,
        );
        let p0 = init.param_by_name(name).unwrap().to_array().unwrap();
        assert!(max_abs_diff(pa, &p0) > 1e-5, "{name} did not move");
    }
}

#[test]
fn checkpoints_rotate_and_resume_is_bit_exact() {
    let full = tempdir("runner-full");
    let c = {
        let mut c = config(&full);
        c.checkpoint.checkpoint_period = 2;
        c.checkpoint.max_num_checkpoints = 2;
        c.lr = burn_onnx_train::train::config::LrConfig {
            mode: ScheduleKind::Cosine,
            warmup_ratio: 0.3,
            ..Default::default()
        };
        c
    };
    let summary = run(c.clone());
    assert_eq!(summary.losses.len(), 6);
    let kept: Vec<usize> = list_checkpoints(&full.join("checkpoints"))
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(kept, vec![4, 6], "only the newest two checkpoints are kept");
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(full.join("checkpoints/ckpt-000000004/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["written_by_rank"], 0);
    assert_eq!(state["micro_step"], 4);

    // A second run starts from the step-4 checkpoint, as if the first had died after it.
    let resumed = tempdir("runner-resumed");
    std::fs::create_dir_all(resumed.join("checkpoints")).unwrap();
    copy_dir(
        &full.join("checkpoints/ckpt-000000004"),
        &resumed.join("checkpoints/ckpt-000000004"),
    );
    let summary2 = run({
        let mut cfg = c;
        cfg.checkpoint.output_dir = resumed.clone();
        cfg
    });
    assert_eq!(summary2.start_step, 4);
    assert_eq!(summary2.losses.len(), 2);
    assert_eq!(
        summary2.losses[1].1, summary.losses[5].1,
        "same loss at the last update"
    );
    for ((name, a), (_, b)) in onnx_params(full.join("gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(resumed.join("gpt2_tiny_trained.onnx")))
    {
        assert_eq!(a, &b, "{name} differs after resume");
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_checkpoint_write_killed_half_way_leaves_the_previous_one_loadable() {
    let out = tempdir("runner-killed");
    let c = {
        let mut c = config(&out);
        c.train.num_train_steps = 2;
        c.checkpoint.checkpoint_period = 2;
        c
    };
    run(c.clone());
    let dir = out.join("checkpoints");
    // What a kill during the next write leaves: a temporary directory with a torn file.
    let torn = dir.join(".ckpt-000000004.tmp-4242");
    std::fs::create_dir_all(&torn).unwrap();
    let model = std::fs::read(dir.join("ckpt-000000002/model.safetensors")).unwrap();
    std::fs::write(torn.join("model.safetensors"), &model[..model.len() / 2]).unwrap();
    assert_eq!(
        list_checkpoints(&dir)
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>(),
        vec![2]
    );
    // Continue to 4 updates: resumes from step 2, removes the torn directory.
    let summary = run({
        let mut cfg = c;
        cfg.train.num_train_steps = 4;
        cfg
    });
    assert_eq!(summary.start_step, 2);
    assert!(!torn.exists(), "stale temporary removed");
    assert_eq!(
        list_checkpoints(&dir)
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>(),
        vec![2, 4]
    );
}

/// Flip a few bytes in the middle of `path` (what a bad disk or a torn copy leaves).
fn damage(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 4] {
        *b ^= 0x5a;
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn every_checkpoint_file_is_in_the_manifest_with_its_sha256() {
    let out = tempdir("runner-manifest");
    run({
        let mut c = config(&out);
        c.train.num_train_steps = 2;
        c.checkpoint.checkpoint_period = 2;
        c
    });
    let ckpt = out.join("checkpoints/ckpt-000000002");
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("manifest.json")).unwrap()).unwrap();
    let files = manifest["files"].as_object().unwrap();
    let mut on_disk: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "manifest.json")
        .collect();
    on_disk.sort();
    assert_eq!(files.keys().cloned().collect::<Vec<_>>(), on_disk);
    // coreutils' sha256sum is the independent reference.
    for (name, sum) in files {
        let out = std::process::Command::new("sha256sum")
            .arg(ckpt.join(name))
            .output()
            .expect("sha256sum (coreutils)");
        let reference = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            sum["sha256"].as_str().unwrap(),
            reference.split_whitespace().next().unwrap(),
            "{name}"
        );
        assert_eq!(
            sum["bytes"].as_u64().unwrap(),
            std::fs::metadata(ckpt.join(name)).unwrap().len()
        );
    }
}

#[test]
fn a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_bit_identical_from_the_one_before() {
    let full = tempdir("runner-damage-full");
    let c = {
        let mut c = config(&full);
        c.checkpoint.checkpoint_period = 2;
        c.checkpoint.max_num_checkpoints = 3;
        c
    };
    run(c.clone());
    // A copy of the run as if it had died after update 4, with update 4's model damaged.
    let resumed = tempdir("runner-damage-resumed");
    for step in ["ckpt-000000002", "ckpt-000000004"] {
        copy_dir(
            &full.join("checkpoints").join(step),
            &resumed.join("checkpoints").join(step),
        );
    }
    damage(&resumed.join("checkpoints/ckpt-000000004/model.safetensors"));
    let summary = run({
        let mut cfg = c.clone();
        cfg.checkpoint.output_dir = resumed.clone();
        cfg
    });
    assert_eq!(summary.start_step, 2, "resumed from the intact checkpoint");
    for ((name, a), (_, b)) in onnx_params(full.join("gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(resumed.join("gpt2_tiny_trained.onnx")))
    {
        assert_eq!(
            a, &b,
            "{name} differs after resuming from the older checkpoint"
        );
    }
    // Named explicitly, a damaged checkpoint is an error naming the file.
    let named = tempdir("runner-damage-named");
    let damaged = full.join("checkpoints/ckpt-000000006");
    damage(&damaged.join("model.safetensors"));
    let err = TrainingRunner::new(
        {
            let mut cfg = c;
            cfg.checkpoint.output_dir = named.clone();
            cfg.checkpoint.checkpoint_to_load_path = Some(damaged.clone());
            cfg
        },
        Arc::new(LocalCommunicator),
        Device::flex().autodiff(),
    )
    .and_then(|r| r.run(tokens(), None))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("ckpt-000000006/model.safetensors") && err.contains("damaged"),
        "{err}"
    );
}

#[test]
fn tensorboard_events_and_perf_report_are_written() {
    let out = tempdir("runner-tb");
    let summary = run({
        let mut c = config(&out);
        c.logging.log_dir = None;
        c.eval.evaluation_period = 3;
        c
    });
    let tb = out.join("tensorboard");
    let file = std::fs::read_dir(&tb)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let s = scalars(&read_events(&file).unwrap());
    let losses: Vec<_> = s.iter().filter(|(t, _, _)| t == "train/loss").collect();
    assert_eq!(losses.len(), 6);
    assert!((losses[5].2 as f64 - summary.losses[5].1).abs() < 1e-6);
    assert!(s.iter().any(|(t, step, _)| t == "eval/loss" && *step == 3));
    assert!(s.iter().any(|(t, _, _)| t == "train/learning_rate"));
    assert!(s.iter().any(|(t, _, v)| t == "train/grad_norm" && *v > 0.0));
    assert_eq!(summary.evals.len(), 2, "evaluated at 3 and at the end");
    assert!(summary.evals[0].perplexity.unwrap() > 1.0);
    let perf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("perf.json")).unwrap()).unwrap();
    assert_eq!(perf["unit"], "tokens");
    assert!(perf["throughput_per_sec"].as_f64().unwrap() > 0.0);
}

/// Losses and gradient norms stay on the device until a report shows them (every
/// `display_loss_steps` updates): every update is still reported, in order and with the
/// values of a run that reads each one, and a loss that stops being finite still ends the
/// run with an error naming the update it came from.
#[test]
fn losses_read_at_displayed_updates_are_all_reported_and_a_diverged_one_names_its_update() {
    let with_display = |tag: &str, every: usize, lr: Option<f64>| {
        let out = tempdir(tag);
        let mut c = config(&out);
        c.logging.display_loss_steps = every;
        if let Some(lr) = lr {
            c.lr.initial_lr = lr;
        }
        let runner =
            TrainingRunner::new(c, Arc::new(LocalCommunicator), Device::flex().autodiff()).unwrap();
        runner.run(tokens(), None)
    };
    let each = with_display("runner-read-each", 1, None).unwrap();
    let batched = with_display("runner-read-batched", 4, None).unwrap();
    let steps: Vec<usize> = batched.losses.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (1..=6).collect::<Vec<_>>(), "every update, in order");
    assert_eq!(each.losses, batched.losses);
    // AdamW moves every weight by about lr at its first update: 1e30 overflows the next
    // forward pass.
    let diverged = |tag, every| match with_display(tag, every, Some(1e30)) {
        Err(OnnxError::Field { field, message }) if field == "training" => message,
        other => panic!(
            "expected the training loss error, got {:?}",
            other.map(|s| s.losses)
        ),
    };
    let (read_each, read_at_end) = (
        diverged("runner-nan-each", 1),
        diverged("runner-nan-end", 10),
    );
    assert!(read_each.contains("at update 2"), "{read_each}");
    assert_eq!(read_each, read_at_end);
}

fn field_of(err: OnnxError) -> String {
    match err {
        OnnxError::Field { field, .. } => field,
        other => panic!("expected a field error, got {other}"),
    }
}

#[test]
fn invalid_configs_name_the_field() {
    let ok = config(Path::new("/tmp/unused"));
    let cases: Vec<(TrainingConfig, usize, &str)> = vec![
        (
            {
                let mut c = ok.clone();
                c.train.num_train_steps = 7;
                c.train.gradient_accumulation_steps = 2;
                c
            },
            1,
            "config.train.num_train_steps",
        ),
        (
            {
                let mut c = ok.clone();
                c.parallel.data_parallel_size = 2;
                c
            },
            1,
            "config.parallel.data_parallel_size",
        ),
        (ok.clone(), 4, "config.parallel.data_parallel_size"),
        (
            {
                let mut c = ok.clone();
                c.data.batch_size = 0;
                c
            },
            1,
            "config.data.batch_size",
        ),
        (
            {
                let mut c = ok.clone();
                c.model.model_path = PathBuf::new();
                c
            },
            1,
            "config.model.model_path",
        ),
        (
            {
                let mut c = ok.clone();
                c.train.max_grad_norm = -1.0;
                c
            },
            1,
            "config.train.max_grad_norm",
        ),
        (
            {
                let mut c = ok.clone();
                c.data.seq_len = 1;
                c
            },
            1,
            "config.data.seq_len",
        ),
    ];
    for (c, world, field) in cases {
        assert_eq!(field_of(c.validate(world).unwrap_err()), field);
    }
    let mut c = ok.clone();
    c.lr.warmup_ratio = 1.5;
    assert_eq!(
        field_of(c.validate(1).unwrap_err()),
        "config.lr.warmup_ratio"
    );
    let mut c = ok.clone();
    c.optimizer.beta2 = 1.0;
    assert_eq!(
        field_of(c.validate(1).unwrap_err()),
        "config.optimizer.beta2"
    );
    assert!(ok.validate(1).is_ok());

    // Files: unknown fields and bad values are decode errors naming the file.
    let dir = tempdir("runner-cfg");
    let p = dir.join("run.toml");
    std::fs::write(&p, "model_path = \"m.onnx\"\nbatch_sise = 4\n").unwrap();
    let err = TrainingConfig::from_file(&p).unwrap_err().to_string();
    assert!(
        err.contains("run.toml") && err.contains("batch_sise"),
        "{err}"
    );
    // A wrong type or a negative count names its field, in a section too, and the file.
    for (text, field) in [
        (
            "batch_size = \"eight\"\n",
            "batch_size: invalid type: string \"eight\"",
        ),
        ("seq_len = -3\n", "seq_len: invalid value: integer `-3`"),
        (
            "[optimizer]\nweight_decay = \"x\"\n",
            "optimizer.weight_decay: invalid type",
        ),
    ] {
        std::fs::write(&p, format!("model_path = \"m.onnx\"\n{text}")).unwrap();
        let err = TrainingConfig::from_file(&p).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains(field), "{err}");
    }
    std::fs::write(&p, ok.to_toml().unwrap()).unwrap();
    assert_eq!(TrainingConfig::from_file(&p).unwrap(), ok);
    // A weight name that is not in the model.
    let c = {
        let mut c = config(&dir);
        c.model.weights_not_to_train = vec!["nope".into()];
        c
    };
    let runner =
        TrainingRunner::new(c, Arc::new(LocalCommunicator), Device::flex().autodiff()).unwrap();
    let err = runner.run(tokens(), None).err().unwrap();
    assert!(err.to_string().contains("'nope'"), "{err}");
}

#[test]
fn config_files_load_in_sections_or_flat_with_ort_names() {
    use burn_onnx_train::train::config::{Overlap, Resume};
    use burn_onnx_train::train::precision::Precision;
    let dir = tempdir("runner-cfg-sections");
    let read = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        TrainingConfig::from_file(&p)
    };
    // ORT's flat names, its aliases included, and the same run written in sections.
    let flat = read(
        "flat.toml",
        "model_path = \"m.onnx\"\nbatch_size = 4\nseq_len = 32\nnum_train_steps = 20\n\
         gradient_accumulation_steps = 2\ndeepspeed_zero_stage = 1\ndata_parallel_size = 2\n\
         use_mixed_precision = true\nuse_bfloat16 = true\noverlap_segments = 1\n\
         checkpoint_period = 5\nresume = \"never\"\ndisplay_loss_steps = 3\n\
         eval_batches = 2\n[optimizer]\nkind = \"sgd\"\n",
    )
    .unwrap();
    let sectioned = read(
        "sections.toml",
        "[model]\nmodel_path = \"m.onnx\"\n[data]\nbatch_size = 4\nseq_len = 32\n\
         [train]\nnum_train_steps = 20\ngradient_accumulation_steps = 2\n\
         [parallel]\nzero_stage = 1\ndata_parallel_size = 2\noverlap = \"hooks\"\n\
         [precision]\ndtype = \"bf16\"\n[checkpoint]\ncheckpoint_period = 5\nresume = \"never\"\n\
         [logging]\ndisplay_loss_steps = 3\n[eval]\neval_batches = 2\n[optimizer]\nkind = \"sgd\"\n",
    )
    .unwrap();
    assert_eq!(flat, sectioned);
    assert_eq!(flat.model.model_path, PathBuf::from("m.onnx"));
    assert_eq!((flat.data.batch_size, flat.data.seq_len), (4, 32));
    assert_eq!(flat.train.num_updates(), 10);
    assert_eq!(flat.parallel.zero_stage, 1);
    assert_eq!(flat.parallel.overlap, Overlap::Hooks);
    assert_eq!(flat.precision.dtype, Precision::Bf16);
    assert_eq!(flat.checkpoint.resume, Resume::Never);
    assert_eq!(flat.logging.display_loss_steps, 3);
    assert_eq!(flat.optimizer.kind, OptimizerKind::Sgd);
    // Unset fields keep their defaults in both.
    assert_eq!(flat.eval.eval_batch_size, 8);

    // Overlap modes: ORT's counts, names and a segment table; fewer than 2 segments refused.
    for (text, want) in [
        ("overlap_segments = 0", Overlap::Off),
        ("overlap_segments = 3", Overlap::Segments(3)),
        (
            "[parallel]\noverlap = { segments = 4 }",
            Overlap::Segments(4),
        ),
        ("[parallel]\noverlap = \"off\"", Overlap::Off),
    ] {
        let c = read("o.toml", &format!("model_path = \"m.onnx\"\n{text}\n")).unwrap();
        assert_eq!(c.parallel.overlap, want, "{text}");
    }
    for (text, says) in [
        ("[parallel]\noverlap = { segments = 1 }", "needs at least 2"),
        ("[parallel]\noverlap = \"sometimes\"", "not an overlap mode"),
        // One field set twice, flat and in its section.
        (
            "batch_size = 2\n[data]\nbatch_size = 4",
            "batch_size is set twice",
        ),
        ("[data]\nnum_train_steps = 4", "num_train_steps"),
    ] {
        let err = read("bad.toml", &format!("model_path = \"m.onnx\"\n{text}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad.toml") && err.contains(says),
            "{text}: {err}"
        );
    }

    // `--set`: flat and dotted keys reach the same field.
    let a = flat
        .clone()
        .with_overrides(&["batch_size=6".into(), "overlap_segments=0".into()])
        .unwrap();
    let b = flat
        .clone()
        .with_overrides(&[
            "data.batch_size=6".into(),
            "parallel.overlap=\"off\"".into(),
        ])
        .unwrap();
    assert_eq!(a, b);
    assert_eq!((a.data.batch_size, a.parallel.overlap), (6, Overlap::Off));
    let err = flat
        .clone()
        .with_overrides(&["batch_sise=6".into()])
        .unwrap_err();
    assert!(err.to_string().contains("batch_sise"), "{err}");

    // Written in sections; a config written flat by an older run (a checkpoint's copy)
    // still reads.
    let written = flat.to_toml().unwrap();
    assert!(
        written.contains("[data]") && written.contains("[parallel]"),
        "{written}"
    );
    assert_eq!(
        TrainingConfig::from_toml(&written, Path::new("config.toml")).unwrap(),
        flat
    );
    let old = TrainingConfig::from_toml(
        "model_path = \"m.onnx\"\nbatch_size = 4\noverlap_segments = 2\nprecision = \"f16\"\n",
        Path::new("old/config.toml"),
    )
    .unwrap();
    assert_eq!(old.data.batch_size, 4);
    assert_eq!(old.parallel.overlap, Overlap::Segments(2));
    assert_eq!(old.precision.dtype, Precision::F16);
}
