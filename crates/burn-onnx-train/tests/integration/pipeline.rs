//! Pipeline parallelism with stage threads (`pipeline_parallel_size` without mpirun): a run
//! cut into stages ends with the parameters of the plain single-process run on the same
//! batches (the micro-batches' mean gradient is the batch's), on gpt2_tiny, a GPT-2 with a
//! tied embedding held by the first and last stage, SqueezeNet and the MLP (manual cut);
//! GPipe and 1F1B are bit-identical; virtual stages (interleaved 1F1B) train alike; dp x pp
//! composes; a pipelined run resumes exactly;
//! every stage's weights reach TensorBoard.

use super::common;

use std::path::Path;
use std::sync::Arc;

use burn::tensor::Device;
use burn_onnx_train::OnnxModel;
use burn_onnx_train::model::loss::LossKind;
use burn_onnx_train::parallel::pipeline::{Partition, PipelineSchedule};
use burn_onnx_train::train::checkpoint::list_checkpoints;
use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::data::{Dataset, ImageDataset, Target, TokenDataset};
use burn_onnx_train::train::process::launch::{launch, launch_threads_over};
use burn_onnx_train::train::report::tensorboard::{EventKind, ValueKind, read_events, scalars};
use burn_onnx_train::train::{RunSummary, TrainingConfig};
use common::*;
use ndarray::{ArrayD, IxDyn};

fn tokens(vocab: u64) -> Arc<dyn Dataset> {
    let mut next = lcg(7);
    Arc::new(
        TokenDataset::from_tokens((0..16 * 96).map(|_| (next() % vocab) as i64).collect(), 16)
            .unwrap(),
    )
}

fn run(c: TrainingConfig, data: &Arc<dyn Dataset>) -> RunSummary {
    launch(c, data.clone(), Some(data.clone())).unwrap_or_else(|e| panic!("{e}"))
}

/// Every parameter of `got` within `atol` of `want`'s, and `want` moved from `initial`.
fn compare(initial: &Path, want: &Path, got: &Path, atol: f32) {
    let (a, b) = (
        onnx_params(want.to_path_buf()),
        onnx_params(got.to_path_buf()),
    );
    assert_eq!(a.len(), b.len(), "{}: parameter count", got.display());
    for ((name, a), (name_b, b)) in a.iter().zip(&b) {
        assert_eq!(name, name_b);
        assert_close(&format!("{}: {name}", got.display()), b, a, atol, 0.0);
    }
    assert_moved(initial, want, 1e-3);
}

/// The training losses and the last evaluation loss of `piped` within 1e-5 of `single`'s.
fn same_losses(what: &str, single: &RunSummary, piped: &RunSummary) {
    for ((s, a), (t, b)) in single.losses.iter().zip(&piped.losses) {
        assert_eq!(s, t);
        assert!(
            (a - b).abs() < 1e-5,
            "{what}: loss at update {s}: {a} vs {b}"
        );
    }
    let (ea, eb) = (single.evals.last().unwrap(), piped.evals.last().unwrap());
    assert!(
        (ea.loss - eb.loss).abs() < 1e-5,
        "{what}: evaluation loss {} vs {}",
        ea.loss,
        eb.loss
    );
}

fn gpt2_tiny(out: &Path) -> TrainingConfig {
    let mut c = sgd_config(
        refkit("models/gpt2_tiny.onnx"),
        LossKind::LmCrossEntropy,
        "input_ids",
    );
    c.checkpoint.output_dir = out.to_path_buf();
    c.data.batch_size = 4;
    c.eval.eval_batch_size = 4;
    c
}

#[test]
fn gpt2_tiny_two_stages_equal_one_process() {
    let data = tokens(1024);
    let (one, two) = (tempdir("pp-gpt2-1"), tempdir("pp-gpt2-2"));
    let single = run(gpt2_tiny(&one), &data);
    let piped = run(
        {
            let mut c = gpt2_tiny(&two);
            c.parallel.pipeline_parallel_size = 2;
            c
        },
        &data,
    );
    assert_eq!(piped.losses.len(), 10);
    same_losses("2 stages", &single, &piped);
    assert_eq!(piped.perf.unwrap().world_size, 2);
    compare(
        &refkit("models/gpt2_tiny.onnx"),
        &one.join("gpt2_tiny_trained.onnx"),
        &two.join("gpt2_tiny_trained.onnx"),
        1e-5,
    );
}

/// Each stage recomputing its forward in backward (`recompute_segments` = stages) trains
/// exactly as the stages that keep their activations (1F1B and GPipe) and as one process;
/// another segment count is an error naming the field.
#[test]
fn stages_that_recompute_their_forward_equal_stages_that_keep_it() {
    let data = tokens(1024);
    let one = tempdir("pp-recompute-one");
    run(gpt2_tiny(&one), &data);
    for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::Gpipe] {
        let (kept, again) = (
            tempdir(&format!("pp-kept-{schedule:?}")),
            tempdir(&format!("pp-recompute-{schedule:?}")),
        );
        let piped = |out: &Path, recompute_segments| {
            let mut c = gpt2_tiny(out);
            c.parallel.pipeline_parallel_size = 2;
            c.parallel.num_pipeline_micro_batches = 4;
            c.parallel.pipeline_schedule = schedule;
            c.parallel.recompute_segments = recompute_segments;
            c
        };
        let a = run(piped(&kept, 0), &data);
        let b = run(piped(&again, 2), &data);
        assert_eq!(
            a.losses, b.losses,
            "{schedule:?}: the same losses, bit for bit"
        );
        compare(
            &refkit("models/gpt2_tiny.onnx"),
            &kept.join("gpt2_tiny_trained.onnx"),
            &again.join("gpt2_tiny_trained.onnx"),
            0.0,
        );
        compare(
            &refkit("models/gpt2_tiny.onnx"),
            &one.join("gpt2_tiny_trained.onnx"),
            &again.join("gpt2_tiny_trained.onnx"),
            1e-5,
        );
    }
    let bad = {
        let mut c = gpt2_tiny(&one);
        c.parallel.pipeline_parallel_size = 2;
        c.parallel.recompute_segments = 3;
        c
    };
    let err = bad.validate(2).unwrap_err().to_string();
    assert!(
        err.contains("config.parallel.recompute_segments") && err.contains("set it to 2"),
        "{err}"
    );
}

#[test]
fn gpt2_tiny_four_stages_1f1b_and_gpipe_are_identical_and_equal_one_process() {
    let data = tokens(1024);
    let one = tempdir("pp4-one");
    run(gpt2_tiny(&one), &data);
    let mut outs = Vec::new();
    for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::Gpipe] {
        let out = tempdir(&format!("pp4-{schedule:?}"));
        let c = {
            let mut c = gpt2_tiny(&out);
            c.parallel.pipeline_parallel_size = 4;
            c.parallel.num_pipeline_micro_batches = 4;
            c.parallel.pipeline_schedule = schedule;
            c
        };
        run(c, &data);
        outs.push(out.join("gpt2_tiny_trained.onnx"));
    }
    compare(
        &refkit("models/gpt2_tiny.onnx"),
        &one.join("gpt2_tiny_trained.onnx"),
        &outs[0],
        1e-5,
    );
    for ((name, a), (_, b)) in onnx_params(outs[0].clone())
        .iter()
        .zip(onnx_params(outs[1].clone()))
    {
        assert_eq!(a, &b, "{name}: GPipe and 1F1B differ");
    }
}

/// Interleaved 1F1B (virtual stages, Megatron's `virtual_pipeline_model_parallel_size`):
/// 2 ranks holding 2 model chunks each, with 1F1B and with GPipe, and 2 ranks of 3 chunks
/// recomputing their forwards, end where one process does; the interleaved 1F1B and GPipe
/// runs are bit-identical. Virtual stages without a pipeline, or with a micro-batch count
/// the interleaving cannot group, are errors naming the field.
#[test]
fn virtual_stages_interleave_and_equal_one_process() {
    let data = tokens(1024);
    let one = tempdir("pp-virtual-one");
    let single = run(gpt2_tiny(&one), &data);
    let mut outs = Vec::new();
    for (chunks, schedule, recompute) in [
        (2, PipelineSchedule::OneFOneB, 0),
        (2, PipelineSchedule::Gpipe, 0),
        (3, PipelineSchedule::OneFOneB, 2),
    ] {
        let out = tempdir(&format!("pp-virtual-{chunks}-{schedule:?}-{recompute}"));
        let mut c = gpt2_tiny(&out);
        c.parallel.pipeline_parallel_size = 2;
        c.parallel.pipeline_virtual_stages = chunks;
        c.parallel.num_pipeline_micro_batches = 4;
        c.parallel.pipeline_schedule = schedule;
        c.parallel.recompute_segments = recompute;
        c.checkpoint.checkpoint_period = 10;
        let piped = run(c, &data);
        // Each rank holds its chunks' weights, a layer apart: rank 0 the embeddings and a
        // later block, rank 1 an earlier block and the head.
        let (_, ckpt) = list_checkpoints(&out.join("checkpoints")).pop().unwrap();
        let held =
            |rank: usize| tensor_names(&ckpt.join(format!("model-stage-{rank}.safetensors")));
        let (first, second) = (held(0), held(1));
        assert!(first.iter().any(|n| n.ends_with("wte.weight")), "{first:?}");
        assert!(
            second.iter().any(|n| n.ends_with("ln_f.weight")),
            "{second:?}"
        );
        let block = |names: &[String]| -> Vec<usize> {
            let mut b: Vec<usize> = names
                .iter()
                .filter_map(|n| n.split(".h.").nth(1)?.split('.').next()?.parse().ok())
                .collect();
            b.dedup();
            b
        };
        assert!(
            block(&first)
                .iter()
                .any(|b| block(&second).iter().any(|e| e < b)),
            "rank 0 holds blocks {:?}, rank 1 {:?}: no interleaving",
            block(&first),
            block(&second)
        );
        assert_eq!(piped.perf.as_ref().unwrap().world_size, 2);
        same_losses(&format!("{chunks} chunks"), &single, &piped);
        let trained = out.join("gpt2_tiny_trained.onnx");
        compare(
            &refkit("models/gpt2_tiny.onnx"),
            &one.join("gpt2_tiny_trained.onnx"),
            &trained,
            1e-5,
        );
        outs.push(trained);
    }
    for ((name, a), (_, b)) in onnx_params(outs[0].clone())
        .iter()
        .zip(onnx_params(outs[1].clone()))
    {
        assert_eq!(a, &b, "{name}: interleaved 1F1B and GPipe differ");
    }
    let refused = |edit: &dyn Fn(&mut TrainingConfig), field: &str| {
        let out = tempdir("pp-virtual-refused");
        let mut c = gpt2_tiny(&out);
        edit(&mut c);
        let e = match launch(c, data.clone(), None) {
            Ok(_) => panic!("{field}: the run started"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(field), "{e}");
    };
    refused(
        &|c| c.parallel.pipeline_virtual_stages = 2,
        "pipeline_virtual_stages",
    );
    refused(
        &|c| {
            c.parallel.pipeline_parallel_size = 2;
            c.parallel.pipeline_virtual_stages = 2;
            c.parallel.num_pipeline_micro_batches = 1;
        },
        "num_pipeline_micro_batches",
    );
}

#[test]
fn tied_embedding_split_across_stages_trains_as_one_parameter() {
    // Our GPT-2 builder ties the LM head to the token embedding: the first stage (Gather)
    // and the last (MatMul) each hold a copy, their gradients are summed, and the global
    // norm (AdamW with clipping at 0.5, which binds) counts the parameter once.
    let model = small_gpt2("pp-tied", "gpt2_tied.onnx", 2, 2, 256);
    let dir = model.parent().unwrap().to_path_buf();
    let loaded = OnnxModel::load(&model, &Device::flex()).unwrap();
    let part = Partition::auto(&loaded, 2).unwrap();
    let wte = part
        .shared
        .iter()
        .find(|s| s.name == "transformer.wte.weight")
        .expect("the tied embedding is shared");
    assert_eq!(wte.stages, vec![0, 1]);
    let data = tokens(256);
    let base = |out: &Path| {
        let mut c = sgd_config(model.clone(), LossKind::LmCrossEntropy, "input_ids");
        c.optimizer = OptimizerConfig {
            kind: OptimizerKind::Adamw,
            ..Default::default()
        };
        c.lr = LrConfig {
            initial_lr: 3e-3,
            ..Default::default()
        };
        c.train.max_grad_norm = 0.5;
        c.checkpoint.output_dir = out.to_path_buf();
        c.data.batch_size = 4;
        c.eval.eval_batch_size = 4;
        c
    };
    let (one, two) = (dir.join("one"), dir.join("two"));
    run(base(&one), &data);
    run(
        {
            let mut c = base(&two);
            c.parallel.pipeline_parallel_size = 2;
            c
        },
        &data,
    );
    let file = "gpt2_tied_trained.onnx";
    compare(&model, &one.join(file), &two.join(file), 1e-5);
    // The clipping binds: without it the run ends elsewhere.
    let free = dir.join("unclipped");
    run(
        {
            let mut c = base(&free);
            c.train.max_grad_norm = 0.0;
            c
        },
        &data,
    );
    let moved = onnx_params(one.join(file))
        .iter()
        .zip(onnx_params(free.join(file)))
        .map(|((_, a), (_, b))| max_abs_diff(a, &b))
        .fold(0.0f32, f32::max);
    assert!(
        moved > 1e-4,
        "clipping at 0.5 changed nothing (max difference {moved})"
    );
}

#[test]
fn data_and_pipeline_parallel_compose() {
    // 2 replicas x 2 stages with 2 samples per replica = one process with 4.
    let data = tokens(1024);
    let (one, grid) = (tempdir("dppp-one"), tempdir("dppp-grid"));
    run(gpt2_tiny(&one), &data);
    let summary = run(
        {
            let mut c = gpt2_tiny(&grid);
            c.data.batch_size = 2;
            c.eval.eval_batch_size = 2;
            c.parallel.data_parallel_size = 2;
            c.parallel.pipeline_parallel_size = 2;
            c
        },
        &data,
    );
    assert_eq!(summary.perf.unwrap().world_size, 4);
    compare(
        &refkit("models/gpt2_tiny.onnx"),
        &one.join("gpt2_tiny_trained.onnx"),
        &grid.join("gpt2_tiny_trained.onnx"),
        1e-5,
    );
}

#[test]
fn squeezenet_two_stages_equal_one_process() {
    let mut next = lcg(3);
    let x = ArrayD::from_shape_fn(IxDyn(&[8, 3, 224, 224]), |_| {
        (next() % 1000) as f32 / 1000.0 - 0.5
    });
    let y = ArrayD::from_shape_fn(IxDyn(&[8]), |_| (next() % 1000) as i64);
    let data: Arc<dyn Dataset> = Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap());
    let model = refkit("models/squeezenet1_1_dynbatch.onnx");
    let base = |out: &Path| {
        let mut c = sgd_config(model.clone(), LossKind::CrossEntropy, "input");
        c.checkpoint.output_dir = out.to_path_buf();
        c.data.batch_size = 2;
        c.eval.eval_batch_size = 2;
        c.train.num_train_steps = 3;
        c.lr = LrConfig {
            initial_lr: 0.01,
            ..Default::default()
        };
        c
    };
    let (one, two) = (tempdir("pp-sq-1"), tempdir("pp-sq-2"));
    run(base(&one), &data);
    run(
        {
            let mut c = base(&two);
            c.parallel.pipeline_parallel_size = 2;
            c
        },
        &data,
    );
    let file = "squeezenet1_1_dynbatch_trained.onnx";
    compare(&model, &one.join(file), &two.join(file), 1e-5);
}

#[test]
fn manual_cut_of_the_mlp_equals_one_process() {
    let mut next = lcg(5);
    let x = ArrayD::from_shape_fn(IxDyn(&[64, 784]), |_| (next() % 1000) as f32 / 1000.0 - 0.5);
    let y = ArrayD::from_shape_fn(IxDyn(&[64]), |_| (next() % 10) as i64);
    let data: Arc<dyn Dataset> = Arc::new(ImageDataset::new(x, Target::Classes(y)).unwrap());
    let base = |out: &Path| {
        let mut c = sgd_config(refkit("models/mlp.onnx"), LossKind::CrossEntropy, "input");
        c.checkpoint.output_dir = out.to_path_buf();
        c.data.batch_size = 8;
        c.eval.eval_batch_size = 8;
        c
    };
    let (one, two) = (tempdir("pp-mlp-1"), tempdir("pp-mlp-2"));
    run(base(&one), &data);
    let c = {
        let mut c = base(&two);
        c.parallel.pipeline_parallel_size = 2;
        c.parallel.pipeline_cut_after = vec!["/Relu_output_0".into()];
        c
    };
    run(c.clone(), &data);
    compare(
        &refkit("models/mlp.onnx"),
        &one.join("mlp_trained.onnx"),
        &two.join("mlp_trained.onnx"),
        1e-5,
    );
    // A cut naming no value of the graph is an error naming the field and the value.
    let bad = {
        let mut cfg = c;
        cfg.parallel.pipeline_cut_after = vec!["nope".into()];
        cfg.checkpoint.output_dir = tempdir("pp-mlp-bad");
        cfg
    };
    let err = launch(bad, data.clone(), None).err().unwrap().to_string();
    assert!(
        err.contains("pipeline_cut_after") && err.contains("nope"),
        "{err}"
    );
}

#[test]
fn pipelined_checkpoints_hold_each_stage_and_resume_exactly() {
    let data = tokens(1024);
    let full = tempdir("pp-ckpt-full");
    let c = {
        let mut c = gpt2_tiny(&full);
        c.parallel.pipeline_parallel_size = 2;
        c.train.num_train_steps = 4;
        c.checkpoint.checkpoint_period = 2;
        c
    };
    let summary = run(c.clone(), &data);
    let kept = list_checkpoints(&full.join("checkpoints"));
    let (_, dir) = kept
        .iter()
        .find(|(s, _)| *s == 2)
        .expect("a checkpoint at update 2");
    for f in [
        "model-stage-0.safetensors",
        "model-stage-1.safetensors",
        "state.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing in {}", dir.display());
    }
    for s in ["stage-0", "stage-1"] {
        assert!(
            std::fs::read_dir(dir.join(s)).unwrap().count() > 0,
            "no optimizer state in {s}"
        );
    }
    // Resume from update 2 in a fresh directory: the same last loss and parameters, bit for bit.
    let resumed = tempdir("pp-ckpt-resumed");
    copy_tree(
        dir,
        &resumed.join("checkpoints").join(dir.file_name().unwrap()),
    );
    let summary2 = run(
        {
            let mut cfg = c.clone();
            cfg.checkpoint.output_dir = resumed.clone();
            cfg
        },
        &data,
    );
    assert_eq!(summary2.start_step, 2);
    assert_eq!(summary2.losses.last(), summary.losses.last());
    for ((name, a), (_, b)) in onnx_params(full.join("gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(resumed.join("gpt2_tiny_trained.onnx")))
    {
        assert_eq!(a, &b, "{name} differs after resume");
    }
    // Another stage count, or the same ranks holding two chunks each, continues it: each
    // rank takes its parameters' optimizer state (SGD momentum, which moves the weights by
    // ~1e-3 per update) from the stage that held them, and ends where the uninterrupted
    // run does.
    for (stages, chunks) in [(1, 1), (4, 1), (2, 2)] {
        let other = tempdir(&format!("pp-ckpt-to-{stages}x{chunks}"));
        copy_tree(
            dir,
            &other.join("checkpoints").join(dir.file_name().unwrap()),
        );
        let c = {
            let mut cfg = c.clone();
            cfg.checkpoint.output_dir = other.clone();
            cfg.parallel.pipeline_parallel_size = stages;
            cfg.parallel.pipeline_virtual_stages = chunks;
            cfg.parallel.num_pipeline_micro_batches = 0;
            cfg
        };
        assert_eq!(run(c, &data).start_step, 2);
        compare(
            &refkit("models/gpt2_tiny.onnx"),
            &full.join("gpt2_tiny_trained.onnx"),
            &other.join("gpt2_tiny_trained.onnx"),
            1e-5,
        );
    }
}

/// The stage parts' `model.safetensors.index.json`, checked by reading the part files'
/// headers in Python (Hugging Face's sharded-weights layout): every tensor of every part
/// listed once, under its own file, and `total_size` their data bytes.
fn index_read_with_python(dir: &Path) {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "checkpoint index") else {
        return;
    };
    let script = r#"
import glob, json, os, struct, sys
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
want, total = {}, 0
for path in sorted(glob.glob(os.path.join(d, "model-stage-*.safetensors"))):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    for name, t in json.loads(raw[8:8 + n]).items():
        if name != "__metadata__":
            assert name not in want, name
            want[name] = os.path.basename(path)
            total += t["data_offsets"][1] - t["data_offsets"][0]
assert len(set(want.values())) == 2, want
assert index["weight_map"] == want, (index["weight_map"], want)
assert index["metadata"]["total_size"] == total
print("ok", len(want), total)
"#;
    python_says_ok(&python, script, &[dir.as_os_str()]);
}

#[test]
fn a_zero_checkpoint_of_a_grid_resumes_in_one_process() {
    // 2 replicas x 2 stages at ZeRO-1 write four shards in two stage directories; one
    // process at ZeRO-1 (the same 4 samples per update) reassembles its state from them.
    let data = tokens(1024);
    let full = tempdir("pp-zero-ckpt-full");
    let grid = {
        let mut c = gpt2_tiny(&full);
        c.data.batch_size = 2;
        c.parallel.data_parallel_size = 2;
        c.parallel.pipeline_parallel_size = 2;
        c.parallel.zero_stage = 1;
        c.train.num_train_steps = 4;
        c.checkpoint.checkpoint_period = 2;
        c
    };
    run(grid.clone(), &data);
    let kept = list_checkpoints(&full.join("checkpoints"));
    let (_, dir) = kept
        .iter()
        .find(|(s, _)| *s == 2)
        .expect("a checkpoint at update 2");
    assert!(dir.join("stage-1/zero-1.safetensors").is_file());
    index_read_with_python(dir);
    let one = tempdir("pp-zero-ckpt-one");
    copy_tree(dir, &one.join("checkpoints").join(dir.file_name().unwrap()));
    let c = {
        let mut c = grid;
        c.checkpoint.output_dir = one.clone();
        c.data.batch_size = 4;
        c.parallel.data_parallel_size = 1;
        c.parallel.pipeline_parallel_size = 1;
        c
    };
    assert_eq!(run(c, &data).start_step, 2);
    compare(
        &refkit("models/gpt2_tiny.onnx"),
        &full.join("gpt2_tiny_trained.onnx"),
        &one.join("gpt2_tiny_trained.onnx"),
        1e-5,
    );
}

/// The tensor names in a safetensors file's header.
fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    header
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn every_stage_writes_the_summaries_of_its_own_weights() {
    // The first stage holds the embeddings (the LM head reads them tied), the last the
    // final LayerNorm: their norms and histograms reach the run's TensorBoard directory
    // (one event file per stage), the loss once.
    let out = tempdir("pp-tb");
    let (first, last) = ("m.transformer.wte.weight", "m.transformer.ln_f.weight");
    let c = {
        let mut c = gpt2_tiny(&out);
        c.parallel.pipeline_parallel_size = 2;
        c.logging.log_dir = None;
        c.logging.display_loss_steps = 5;
        c.eval.evaluation_period = 5;
        c.logging.histogram_weights = vec![first.into(), last.into()];
        c.logging.norm_weights = vec!["*".into()];
        c
    };
    run(c, &tokens(1024));
    let mut events = Vec::new();
    for f in std::fs::read_dir(out.join("tensorboard")).unwrap() {
        events.extend(read_events(&f.unwrap().path()).unwrap());
    }
    let s = scalars(&events);
    for name in [first, last] {
        let tag = format!("norms/gradient/{name}");
        assert!(
            s.iter()
                .any(|(t, step, v)| *t == tag && *step == 5 && *v > 0.0),
            "{tag} missing"
        );
        let histo = format!("weights/{name}");
        let found = events.iter().any(|e| matches!(&e.what, Some(EventKind::Summary(sm)) if sm.value.iter().any(|v| v.tag == histo && matches!(v.value, Some(ValueKind::Histo(_))))));
        assert!(found, "{histo} missing");
    }
    assert_eq!(
        s.iter().filter(|(t, _, _)| *t == "train/loss").count(),
        10,
        "the loss once per update"
    );
}

/// 2 replicas x 2 stages of gpt2_tiny, AdamW with clipping that binds, ZeRO stage `zero`.
fn adamw_grid(out: &Path, zero: usize) -> TrainingConfig {
    let mut c = gpt2_tiny(out);
    c.optimizer = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        ..Default::default()
    };
    c.lr = LrConfig {
        initial_lr: 1e-3,
        ..Default::default()
    };
    c.train.max_grad_norm = 1.0;
    c.data.batch_size = 2;
    c.eval.eval_batch_size = 2;
    c.parallel.data_parallel_size = 2;
    c.parallel.pipeline_parallel_size = 2;
    c.parallel.zero_stage = zero;
    c
}

/// The tolerance of a grid at ZeRO stage `zero` against the replicated one. Stage 3
/// averages each read's gradient of the tied embedding over the replicas before the stages
/// add theirs, the others after: last-bit differences, which AdamW turns into up to 3e-6
/// on rare embedding rows (a wrong chunk or scale moves weights by whole steps, lr 1e-3).
fn grid_atol(zero: usize) -> f32 {
    if zero == 3 { 1e-5 } else { 1e-6 }
}

#[test]
fn zero_runs_inside_each_stage_data_parallel_group() {
    // ZeRO-1, 2 and 3 shard each stage's optimizer state (3: and parameters) over its two
    // replicas and end where the replicated update does.
    let data = tokens(1024);
    let replicated = tempdir("pp-zero0");
    run(adamw_grid(&replicated, 0), &data);
    for zero in [1, 2, 3] {
        let out = tempdir(&format!("pp-zero{zero}"));
        let summary = run(adamw_grid(&out, zero), &data);
        assert_eq!(summary.perf.unwrap().memory.optimizer_state_bytes.len(), 4);
        compare(
            &refkit("models/gpt2_tiny.onnx"),
            &replicated.join("gpt2_tiny_trained.onnx"),
            &out.join("gpt2_tiny_trained.onnx"),
            grid_atol(zero),
        );
    }
}

/// The same grid with every group moving device tensors itself (`ThroughHost`: through host
/// memory here, as NCCL moves them between GPUs), so the run takes NCCL's code paths: the
/// activations and their gradients cross the stages on the device path, stage 0 averages
/// the gradients in device buckets, ZeRO 1-3 update their shards on the device (the norm
/// summed over the stages). Each ends where the plain replicated grid does (within 1e-5:
/// the device sums squares in f32 where the host sums in f64, last-bit changes of the clip
/// factor that AdamW turns into a few 1e-6 on weights with near-zero gradients; a wrong
/// shard or scale moves weights by whole steps of lr 1e-3), and every rank's groups
/// carried device tensors.
#[test]
fn a_grid_whose_groups_move_device_tensors_ends_where_the_plain_grid_does() {
    let data = tokens(1024);
    let replicated = tempdir("pp-device-plain");
    run(adamw_grid(&replicated, 0), &data);
    for zero in [0, 1, 2, 3] {
        let out = tempdir(&format!("pp-device-zero{zero}"));
        let groups = ThroughHostGroups::default();
        launch_threads_over(
            adamw_grid(&out, zero),
            data.clone(),
            Some(data.clone()),
            &|comm| groups.wrap(comm),
        )
        .unwrap_or_else(|e| panic!("ZeRO-{zero}: {e}"));
        let calls = groups.calls();
        assert!(
            calls.len() == 4 && calls.iter().all(|&c| c > 0),
            "ZeRO-{zero}: every rank's groups carried device tensors ({calls:?})"
        );
        compare(
            &refkit("models/gpt2_tiny.onnx"),
            &replicated.join("gpt2_tiny_trained.onnx"),
            &out.join("gpt2_tiny_trained.onnx"),
            1e-5,
        );
    }
}

/// The wire between stages: values cross in their shapes, out of order by tag, through
/// host memory and device to device (`common::wire_checks`; on the GPU in `tests/gpu.rs`).
#[test]
fn values_cross_the_pipeline_wire_through_the_host_and_device_to_device() {
    common::wire_checks::values_cross_the_pipeline_wire_on_both_paths(&Device::flex());
}
