//! ZeRO stages 1, 2 and 3 on thread ranks against plain data parallelism (stage 0) on the
//! same samples: 10 updates of AdamW (with its no-decay group and global clipping), SGD and
//! LAMB on gpt2_tiny and the MLP, evaluation included; memory per rank in `perf.json`;
//! sharded checkpoints that resume on another world size and stage.

use super::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::Device;
use burn_onnx_train::OnnxModel;
use burn_onnx_train::collective::{CollectiveGroup, Collectives};
use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};
use burn_onnx_train::model::ChunkStore;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::train::TrainingConfig;
use burn_onnx_train::train::checkpoint::params::read_params;
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::data::{Dataset, DistributedSampler, ImageDataset, Target};
use burn_onnx_train::train::process::launch::launch;
use burn_ort_dist::run_threads;
use common::counting::{Counting, logits_and_grads};
use common::*;
use ndarray::{ArrayD, IxDyn};

fn gpt2(out: &Path, ranks: usize, stage: usize) -> TrainingConfig {
    let mut c = gpt2_config(out);
    c.train.num_train_steps = 10;
    c.data.batch_size = 4 / ranks;
    c.parallel.data_parallel_size = ranks;
    c.parallel.zero_stage = stage;
    c.train.max_grad_norm = 0.5;
    c
}

fn mlp_data() -> Arc<dyn Dataset> {
    let mut next = lcg(11);
    let x = ArrayD::from_shape_fn(IxDyn(&[64, 784]), |_| (next() % 1000) as f32 / 1000.0 - 0.5);
    let y = ArrayD::from_shape_fn(IxDyn(&[64]), |_| (next() % 10) as i64);
    Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap())
}

fn mlp(out: &Path, ranks: usize, stage: usize, kind: OptimizerKind) -> TrainingConfig {
    let mut c = gpt2(out, ranks, stage);
    c.model.model_path = refkit("models/mlp.onnx");
    c.model.input_name = "input".into();
    c.model.loss = LossKind::CrossEntropy;
    c.optimizer = OptimizerConfig {
        kind,
        momentum: 0.9,
        epsilon: 1e-6,
        ..Default::default()
    };
    // No clipping: a clipped step would hide a gradient off by a constant factor.
    c.train.max_grad_norm = 0.0;
    c
}

/// Same parameters within `atol`, and moved from the initial model by more than `min_move`.
fn same(initial: PathBuf, a: &Path, b: &Path, file: &str, atol: f32, min_move: f32) {
    for ((name, x), (_, y)) in onnx_params(a.join(file))
        .iter()
        .zip(onnx_params(b.join(file)))
    {
        assert_close(&format!("{}: {name}", b.display()), &y, x, atol, 0.0);
    }
    assert_moved(&initial, &a.join(file), min_move);
}

fn perf(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join("perf.json")).unwrap()).unwrap()
}

fn gpt2_case(ranks: usize) {
    let base = tempdir(&format!("zero-gpt2-{ranks}-0"));
    // Evaluation after update 5 and 10 over 3 batches: replicas get unequal shares.
    let c = |out: &Path, stage| {
        let mut c = gpt2(out, ranks, stage);
        c.eval.evaluation_period = 5;
        c.eval.eval_batches = 3;
        c
    };
    let want = launch(c(&base, 0), gpt2_tokens(), Some(gpt2_tokens())).unwrap();
    let replicated = perf(&base);
    for stage in [1, 2, 3] {
        let out = tempdir(&format!("zero-gpt2-{ranks}-{stage}"));
        let got = launch(c(&out, stage), gpt2_tokens(), Some(gpt2_tokens())).unwrap();
        same(
            refkit("models/gpt2_tiny.onnx"),
            &base,
            &out,
            "gpt2_tiny_trained.onnx",
            1e-6,
            1e-3,
        );
        assert_eq!(got.evals.len(), 2);
        for (g, w) in got.evals.iter().zip(&want.evals) {
            assert!(
                (g.loss - w.loss).abs() < 1e-5,
                "stage {stage}: evaluation loss {} against {}",
                g.loss,
                w.loss
            );
        }
        let p = perf(&out);
        assert_eq!(p["zero_stage"], stage);
        // Adam keeps 2 floats per element; each rank holds 1/N of them (plus padding).
        let elements = replicated["parameter_bytes"][0].as_u64().unwrap() / 4;
        let share = |bytes: f64| bytes * (1.0 / ranks as f64 + 0.02);
        for r in 0..ranks {
            let state = p["optimizer_state_bytes"][r].as_u64().unwrap() as f64;
            assert!(
                state <= share((elements * 2 * 4) as f64),
                "stage {stage} rank {r}: {state} state bytes of {}",
                elements * 8
            );
            let grads = p["gradient_bytes"][r].as_u64().unwrap() as f64;
            let limit = if stage >= 2 {
                share(elements as f64 * 4.0)
            } else {
                elements as f64 * 4.0 * 1.02
            };
            assert!(
                grads <= limit,
                "stage {stage} rank {r}: {grads} gradient bytes"
            );
            let params = p["parameter_bytes"][r].as_u64().unwrap() as f64;
            let limit = if stage == 3 {
                share(elements as f64 * 4.0)
            } else {
                elements as f64 * 4.0
            };
            assert!(
                params <= limit,
                "stage {stage} rank {r}: {params} parameter bytes of {}",
                elements * 4
            );
        }
    }
}

/// ZeRO updating on the device, as NCCL groups do on CUDA (`ThroughHost` carries the
/// device collectives through host memory here): stages 1-3 on 2 ranks, clipped AdamW,
/// the global norm and the clip factor computed on the device, end where plain data
/// parallelism does (within 1e-5: the device sums squares in f32, the host in f64); each
/// rank keeps its shard's two moments and each element's weight decay (3 floats an
/// element of its shard), and its groups carried device tensors.
#[test]
fn stages_1_to_3_updating_on_the_device_match_replicated_adamw_on_gpt2_tiny() {
    use burn_onnx_train::train::process::launch::launch_threads_over;
    let base = tempdir("zero-device-0");
    launch(gpt2(&base, 2, 0), gpt2_tokens(), None).unwrap();
    let elements = perf(&base)["parameter_bytes"][0].as_u64().unwrap() / 4;
    for stage in [1, 2, 3] {
        let out = tempdir(&format!("zero-device-{stage}"));
        let groups = ThroughHostGroups::default();
        launch_threads_over(gpt2(&out, 2, stage), gpt2_tokens(), None, &|comm| {
            groups.wrap(comm)
        })
        .unwrap_or_else(|e| panic!("ZeRO-{stage}: {e}"));
        let calls = groups.calls();
        assert!(
            calls.len() == 2 && calls.iter().all(|&c| c > 0),
            "ZeRO-{stage}: {calls:?} device collectives"
        );
        same(
            refkit("models/gpt2_tiny.onnx"),
            &base,
            &out,
            "gpt2_tiny_trained.onnx",
            1e-5,
            1e-3,
        );
        let p = perf(&out);
        for r in 0..2 {
            let state = p["optimizer_state_bytes"][r].as_u64().unwrap();
            let shard = elements.div_ceil(2);
            assert!(
                (3 * shard * 4..=3 * (shard + 64) * 4).contains(&state),
                "ZeRO-{stage} rank {r}: {state} state bytes for a shard of ~{shard}"
            );
        }
    }
}

#[test]
fn stages_1_to_3_on_two_ranks_match_replicated_adamw_on_gpt2_tiny() {
    gpt2_case(2);
}

#[test]
fn stages_1_to_3_on_four_ranks_match_replicated_adamw_on_gpt2_tiny() {
    gpt2_case(4);
}

#[test]
fn every_optimizer_sharded_matches_replicated_on_the_mlp() {
    for kind in [
        OptimizerKind::Sgd,
        OptimizerKind::Adam,
        OptimizerKind::Adamw,
        OptimizerKind::Lamb,
    ] {
        let base = tempdir(&format!("zero-mlp-{kind:?}-0"));
        launch(mlp(&base, 2, 0, kind), mlp_data(), None).unwrap();
        for stage in [2, 3] {
            let out = tempdir(&format!("zero-mlp-{kind:?}-{stage}"));
            launch(mlp(&out, 2, stage, kind), mlp_data(), None).unwrap();
            same(
                refkit("models/mlp.onnx"),
                &base,
                &out,
                "mlp_trained.onnx",
                1e-6,
                1e-4,
            );
        }
    }
}

#[test]
fn stage_3_with_recomputed_segments_matches_replicated() {
    let base = tempdir("zero3-recompute-0");
    launch(gpt2(&base, 2, 0), gpt2_tokens(), None).unwrap();
    let out = tempdir("zero3-recompute-3");
    launch(
        {
            let mut c = gpt2(&out, 2, 3);
            c.parallel.recompute_segments = 3;
            c
        },
        gpt2_tokens(),
        None,
    )
    .unwrap();
    // The tied embedding's two gradient contributions (its Gather in the first segment,
    // the lm_head's Transpose in the last) add up across segments here and inside one
    // backward pass there: the same sum in another order, a few ulps apart (parameters
    // move by more than 1e-3).
    same(
        refkit("models/gpt2_tiny.onnx"),
        &base,
        &out,
        "gpt2_tiny_trained.onnx",
        5e-6,
        1e-3,
    );
}

/// ZeRO-3's prefetch (`zero3_prefetch`, gathers on a communication thread ahead of their
/// first reader) changes when the gathers run, not what they carry: 1, 2 and 8 ahead end
/// bit-identical to inline gathers on 2 ranks, with the tied embedding, evaluation passes
/// and recomputed segments, and perf.json reports the gathers' time and the part of it
/// hidden behind the computation (absent for inline gathers).
#[test]
fn stage_3_prefetched_gathers_train_bit_identically_to_inline_ones() {
    let run = |tag: &str, depth: usize, recompute: usize| {
        let out = tempdir(&format!("zero3-prefetch-{tag}"));
        let mut c = gpt2(&out, 2, 3);
        c.parallel.zero3_prefetch = depth;
        c.parallel.recompute_segments = recompute;
        c.eval.evaluation_period = 5;
        let s = launch(c, gpt2_tokens(), Some(gpt2_tokens())).unwrap();
        (out, s)
    };
    for recompute in [0, 3] {
        let (inline, a) = run(&format!("inline-{recompute}"), 0, recompute);
        assert!(perf(&inline)["prefetch_hidden_fraction"].is_null());
        for depth in [1, 2, 8] {
            let (ahead, b) = run(&format!("{depth}-{recompute}"), depth, recompute);
            assert_eq!(a.losses, b.losses, "depth {depth}, recompute {recompute}");
            assert_eq!(a.evals.len(), b.evals.len());
            for (x, y) in a.evals.iter().zip(&b.evals) {
                assert_eq!(x.loss, y.loss, "evaluation");
            }
            same(
                refkit("models/gpt2_tiny.onnx"),
                &inline,
                &ahead,
                "gpt2_tiny_trained.onnx",
                0.0,
                1e-3,
            );
            let p = perf(&ahead);
            let hidden = p["prefetch_hidden_fraction"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&hidden), "{p}");
            assert!(p["avg_prefetch_gather_ms"].as_f64().unwrap() > 0.0, "{p}");
        }
    }
}

/// The ZeRO shards of `ckpt` as a reader that is not ours sees them: numpy parses each
/// `zero-<r>.safetensors` by the format's definition (8-byte header length, JSON header,
/// raw data): Adam's two F32 vectors of one shard length, finite and moved from zero, and
/// the rank, world size, ZeRO stage and step in the metadata.
fn shards_read_with_numpy(ckpt: &Path, world: usize, stage: usize) {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "safetensors shard") else {
        return;
    };
    let script = r#"
import json, struct, sys
import numpy as np
ckpt, world, stage = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lengths = set()
for r in range(world):
    raw = open(f"{ckpt}/zero-{r}.safetensors", "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__")
    assert meta["rank"] == str(r) and meta["world_size"] == str(world), meta
    assert meta["zero_stage"] == stage and meta["step"] == "4", meta
    assert sorted(header) == ["state.0", "state.1"], sorted(header)
    for name, t in header.items():
        assert t["dtype"] == "F32" and len(t["shape"]) == 1, t
        a, b = t["data_offsets"]
        v = np.frombuffer(raw[8 + n + a:8 + n + b], dtype="<f4")
        assert v.size == t["shape"][0] and np.isfinite(v).all(), name
        assert np.abs(v).max() > 0, f"rank {r} {name}: all zero"
        lengths.add(v.size)
assert len(lengths) == 1, lengths
print("ok", stage, lengths)
"#;
    let (world, stage) = (world.to_string(), stage.to_string());
    python_says_ok(
        &python,
        script,
        &[ckpt.as_os_str(), world.as_ref(), stage.as_ref()],
    );
}

/// The replicated optimizer state of `ckpt` (`optimizer.safetensors`, written at update
/// 4 by AdamW) as numpy sees it, parsed by the format's definition: per parameter id two
/// finite F32 moments of one shape, the second non-negative, both moved from zero, the
/// parameter's id in the metadata and its step count `u64:4`.
fn record_read_with_numpy(ckpt: &Path) {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "safetensors optimizer record") else {
        return;
    };
    let script = r#"
import json, struct, sys
import numpy as np
raw = open(sys.argv[1] + "/optimizer.safetensors", "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
meta = header.pop("__metadata__")
assert meta["format"] == "burn-optimizer-record", meta
ids = {name.split(".")[0] for name in header}
assert len(ids) >= 4, ids
for i in ids:
    m1, m2 = header[f"{i}.momentum.moment_1"], header[f"{i}.momentum.moment_2"]
    assert m1["dtype"] == m2["dtype"] == "F32" and m1["shape"] == m2["shape"], (m1, m2)
    assert meta[f"param_id.{i}.momentum.moment_1"] == i, i
    assert meta[f"scalar.{i}.momentum.time"] == "u64:4", meta[f"scalar.{i}.momentum.time"]
    v = [np.frombuffer(raw[8 + n + t["data_offsets"][0]:8 + n + t["data_offsets"][1]], dtype="<f4") for t in (m1, m2)]
    assert all(np.isfinite(x).all() and np.abs(x).max() > 0 for x in v), i
    assert (v[1] >= 0).all(), i
print("ok", len(ids))
"#;
    python_says_ok(&python, script, &[ckpt.as_os_str()]);
}

/// A checkpoint written at update 4 of a 4-rank run at `stage` (its directory), resumed by
/// `resumes` (ranks, stage, accumulation steps; the global batch of 4 windows kept): each
/// ends where the uninterrupted run did.
fn resumes_from_a_four_rank_checkpoint(stage: usize, resumes: &[(usize, usize, usize)]) -> PathBuf {
    let full = tempdir(&format!("zero{stage}-ckpt-full"));
    launch(
        {
            let mut c = gpt2(&full, 4, stage);
            c.checkpoint.checkpoint_period = 4;
            c
        },
        gpt2_tokens(),
        None,
    )
    .unwrap();
    let ckpt = full.join("checkpoints/ckpt-000000004");
    assert!(
        stage == 0
            || ckpt.join("zero.json").is_file()
                && (0..4).all(|r| ckpt.join(format!("zero-{r}.safetensors")).is_file()),
        "one shard per rank and a manifest"
    );
    if stage > 0 {
        shards_read_with_numpy(&ckpt, 4, stage);
    } else {
        record_read_with_numpy(&ckpt);
    }
    for &(ranks, to, accumulation) in resumes {
        let out = tempdir(&format!("zero{stage}-ckpt-{ranks}-{to}-{accumulation}"));
        let c = {
            let mut c = gpt2(&out, ranks, to);
            c.checkpoint.checkpoint_to_load_path = Some(ckpt.clone());
            c.data.batch_size = 4 / (ranks * accumulation);
            c.train.gradient_accumulation_steps = accumulation;
            // ORT's num_train_steps counts micro-steps: the same 10 updates.
            c.train.num_train_steps = 10 * accumulation;
            c
        };
        let summary = launch(c, gpt2_tokens(), None).unwrap();
        assert_eq!(summary.start_step, 4);
        // The same samples per update (the global batch is the same 4 windows), so the
        // resumed run ends where the uninterrupted one did.
        same(
            refkit("models/gpt2_tiny.onnx"),
            &full,
            &out,
            "gpt2_tiny_trained.onnx",
            1e-5,
            1e-3,
        );
    }
    ckpt
}

#[test]
fn a_stage_3_checkpoint_of_four_ranks_resumes_on_two_ranks_at_stage_3_and_on_one_process_at_stage_1()
 {
    let ckpt = resumes_from_a_four_rank_checkpoint(3, &[(2, 3, 1), (1, 1, 1)]);
    let manifest = std::fs::read_to_string(ckpt.join("zero.json")).unwrap();
    assert!(manifest.contains("per_tensor"), "{manifest}");
    // No rank gathered the whole model: each wrote its chunks (and the resumes above
    // joined them).
    assert!(!ckpt.join("model.safetensors").exists());
    model_shards_read_with_numpy(&ckpt, 4);
    // `export` joins them too, into the model the runner reads back.
    let exported = ckpt.join("exported.onnx");
    burn_onnx_train::onnx::export::export_onnx(
        &read_params(
            &ckpt,
            OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &Device::flex()).unwrap(),
            None,
        )
        .unwrap(),
        &exported,
    )
    .unwrap();
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &exported, 1e-4);
}

/// The ZeRO-3 model shards of `ckpt` as numpy sees them: every `model-zero-<r>.safetensors`
/// holds one 1-D F32 chunk per parameter, of `ceil(n / world)` values on every rank, with
/// the parameter's shape in the metadata; joined in rank order, the padding past `n` is
/// zero and the whole has the shape of the ONNX initializer of that name.
fn model_shards_read_with_numpy(ckpt: &Path, world: usize) {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "ZeRO-3 model shards") else {
        return;
    };
    let script = r#"
import json, math, struct, sys
import numpy as np, onnx
from onnx import numpy_helper
ckpt, world, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(model).graph.initializer}
chunks = {}
for r in range(world):
    raw = open(f"{ckpt}/model-zero-{r}.safetensors", "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__")
    assert meta["format"] == "zero3-shard" and meta["zero_rank"] == str(r), meta
    assert meta["zero_world"] == str(world), meta
    for name, t in header.items():
        a, b = t["data_offsets"]
        chunks.setdefault(name, []).append((np.frombuffer(raw[8 + n + a:8 + n + b], dtype="<f4"), json.loads(meta["shape." + name])))
assert len(chunks) == 28, len(chunks)
for name, parts in chunks.items():
    shape = parts[0][1]
    size = int(np.prod(shape))
    assert all(len(c) == math.ceil(size / world) for c, _ in parts), name
    joined = np.concatenate([c for c, _ in parts])
    assert not joined[size:].any(), f"{name}: padding is not zero"
    assert list(inits[name].shape) == shape, (name, inits[name].shape, shape)
    assert np.isfinite(joined).all(), name
print("ok", len(chunks))
"#;
    let world = world.to_string();
    python_says_ok(
        &python,
        script,
        &[
            ckpt.as_os_str(),
            world.as_ref(),
            refkit("models/gpt2_tiny.onnx").as_os_str(),
        ],
    );
}

#[test]
fn a_stage_2_checkpoint_of_four_ranks_resumes_on_two_ranks_at_stage_1_and_on_one_process() {
    let ckpt = resumes_from_a_four_rank_checkpoint(2, &[(2, 1, 1), (1, 1, 1), (1, 2, 4)]);
    // A replicated run cannot take ZeRO shards.
    let out = tempdir("zero-ckpt-replicated");
    let err = launch(
        {
            let mut c = gpt2(&out, 4, 0);
            c.checkpoint.checkpoint_to_load_path = Some(ckpt);
            c
        },
        gpt2_tokens(),
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("config.parallel.zero_stage"), "{err}");
}

/// A replicated (stage 0) checkpoint of 4 ranks resumes on 2 ranks accumulating 2
/// micro-steps and on one process accumulating 4 (elastic shrink keeps the global batch);
/// one that would change the global batch is an error naming it.
#[test]
fn a_replicated_checkpoint_of_four_ranks_resumes_on_two_ranks_and_one_process_with_accumulation() {
    let ckpt = resumes_from_a_four_rank_checkpoint(0, &[(2, 0, 2), (1, 0, 4)]);
    let out = tempdir("zero0-ckpt-bigger-batch");
    let err = launch(
        {
            let mut c = gpt2(&out, 1, 0);
            c.checkpoint.checkpoint_to_load_path = Some(ckpt);
            c.data.batch_size = 2;
            c.train.gradient_accumulation_steps = 4;
            c.train.num_train_steps = 40;
            c
        },
        gpt2_tokens(),
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("config.data.batch_size") && err.contains("global batch of 8"),
        "{err}"
    );
}

#[test]
fn unsupported_combinations_are_config_errors() {
    let dir = tempdir("zero-invalid");
    let adasum = |stage| {
        let mut c = gpt2(&dir, 2, stage);
        c.parallel.enable_adasum = true;
        c
    };
    for (c, field) in [
        (adasum(2), "config.parallel.enable_adasum"),
        (adasum(3), "config.parallel.enable_adasum"),
        (gpt2(&dir, 2, 4), "config.parallel.zero_stage"),
    ] {
        let err = c.validate(2).unwrap_err().to_string();
        assert!(err.contains(field), "{err}");
    }
    // Adasum with stage 1 is fine: the whole gradient is combined before sharding.
    assert!(
        {
            let mut c = gpt2(&dir, 2, 1);
            c.parallel.enable_adasum = true;
            c
        }
        .validate(2)
        .is_ok()
    );
}

/// gpt2 tokens whose batch `fail_at` fails once (a transient read error), then works.
struct Flaky {
    inner: Arc<dyn Dataset>,
    fail_at_window: usize,
    failed: std::sync::atomic::AtomicBool,
}

impl Dataset for Flaky {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn batch(
        &self,
        indices: &[usize],
    ) -> burn_onnx_train::Result<burn_onnx_train::train::data::Batch> {
        if indices.contains(&self.fail_at_window)
            && !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(burn_onnx_train::OnnxError::field(
                "data",
                "transient read error (test)",
            ));
        }
        self.inner.batch(indices)
    }
    fn unit(&self) -> &'static str {
        self.inner.unit()
    }
    fn target_kind(&self) -> burn_onnx_train::train::data::TargetKind {
        self.inner.target_kind()
    }
}

/// gpt2_tiny's tokens, failing once at rank 0's first window of micro-step `k` (2 ranks,
/// batch 2, seed 42).
fn flaky_at_micro_step(k: usize) -> Arc<dyn Dataset> {
    let sampler = DistributedSampler {
        len: gpt2_tokens().len(),
        batch_size: 2,
        rank: 0,
        world: 2,
        seed: 42,
        shuffle: true,
        balance: None,
        last_order: Default::default(),
    };
    Arc::new(Flaky {
        inner: gpt2_tokens(),
        fail_at_window: sampler.batch_indices(k).unwrap()[0],
        failed: false.into(),
    })
}

#[test]
fn a_failed_thread_run_restarts_from_its_newest_checkpoint_and_ends_as_an_uninterrupted_one() {
    use burn_onnx_train::train::process::launch::launch_elastic;
    let clean = tempdir("elastic-clean");
    let c = |out: &Path| {
        let mut c = gpt2(out, 2, 2);
        c.checkpoint.checkpoint_period = 2;
        c
    };
    launch(c(&clean), gpt2_tokens(), None).unwrap();
    // Rank 0's first window of micro-step 6 (after the checkpoints of updates 2, 4, 6) fails
    // once: the first attempt dies there, the second resumes from update 6 and finishes.
    let flaky = || flaky_at_micro_step(6);
    let out = tempdir("elastic-restarted");
    let err = launch_elastic(c(&tempdir("elastic-no-restart")), flaky(), None, 0)
        .err()
        .expect("without restarts the failure ends the run");
    assert!(err.to_string().contains("transient read error"), "{err}");
    let summary = launch_elastic(c(&out), flaky(), None, 1).unwrap();
    assert_eq!(
        summary.start_step, 6,
        "the second attempt resumed from the newest checkpoint"
    );
    same(
        refkit("models/gpt2_tiny.onnx"),
        &clean,
        &out,
        "gpt2_tiny_trained.onnx",
        0.0,
        1e-3,
    );
}

/// A run that fails in its first update would fail the same way again: not restarted,
/// although the flaky read would succeed the second time.
#[test]
fn a_thread_run_that_fails_before_its_first_update_is_not_restarted() {
    use burn_onnx_train::train::process::launch::launch_elastic;
    let out = tempdir("elastic-first-update");
    let err = launch_elastic(gpt2(&out, 2, 2), flaky_at_micro_step(0), None, 3)
        .err()
        .expect("a failure before the first update ends the run");
    assert!(
        err.is_before_first_update() && err.to_string().contains("transient read error"),
        "{err}"
    );
    assert_eq!(err.training_exit_code(), 78);
}

#[test]
fn a_sharded_model_gathers_each_parameter_once_per_pass_and_gets_the_whole_models_gradient_chunks()
{
    // Our builder's GPT-2 ties the embedding: one initializer read by Gather and MatMul.
    let path = tempdir("zero3-gather-model").join("gpt2.onnx");
    let config = Gpt2Config {
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        vocab_size: 97,
        n_positions: 32,
        ..Default::default()
    };
    write_gpt2(&config, &path).unwrap();
    let mut next = lcg(5);
    let x = ArrayD::from_shape_vec(
        IxDyn(&[2, 16]),
        (0..32).map(|_| (next() % 97) as i64).collect(),
    )
    .unwrap();
    let whole = OnnxModel::load(&path, &train_device()).unwrap();
    let (want_logits, want_grads) = logits_and_grads(&whole, &x);
    let read = whole.params().len();
    let reads: usize = whole
        .graph()
        .nodes
        .iter()
        .map(|n| {
            n.inputs
                .iter()
                .filter(|i| whole.param_index(i).is_some())
                .count()
        })
        .sum();
    assert!(
        reads > read,
        "a parameter with two readers ({reads} reads of {read} parameters)"
    );
    let results = run_threads(
        2,
        std::time::Duration::from_secs(120),
        |comm| -> Result<(), String> {
            let rank = comm.rank();
            let model = OnnxModel::load(&path, &train_device())
                .and_then(|m| m.into_sharded(rank, 2, ChunkStore::Device))
                .map_err(|e| e.to_string())?;
            let counting = Arc::new(Counting::new(comm.clone()));
            let model = model.with_collectives(Collectives {
                tensor_parallel: None,
                sharding: Some(CollectiveGroup(counting.clone())),
            });
            // Both ranks see the same tokens: the averaged gradient is the whole model's.
            let (logits, grads) = logits_and_grads(&model, &x);
            let (gathers, scatters) = (
                counting.all_gathers.lock().unwrap().len(),
                counting.reduce_scatters.lock().unwrap().len(),
            );
            assert_eq!(
                gathers, read,
                "one gather per parameter, not per read ({reads} reads)"
            );
            assert_eq!(
                scatters,
                grads.len(),
                "one reduce-scatter per trained parameter"
            );
            assert_close(
                &format!("rank {rank} logits"),
                &logits,
                &want_logits,
                1e-5,
                1e-5,
            );
            assert_eq!(grads.len(), want_grads.len());
            for ((name, got), (_, want)) in grads.iter().zip(&want_grads) {
                let flat: Vec<f32> = want.iter().copied().collect();
                let c = flat.len().div_ceil(2);
                let mut chunk =
                    flat[(rank * c).min(flat.len())..((rank + 1) * c).min(flat.len())].to_vec();
                chunk.resize(c, 0.0);
                let chunk = ArrayD::from_shape_vec(IxDyn(&[c]), chunk).unwrap();
                assert_close(
                    &format!("rank {rank} gradient chunk of {name}"),
                    got,
                    &chunk,
                    1e-5,
                    1e-4,
                );
            }
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
}
