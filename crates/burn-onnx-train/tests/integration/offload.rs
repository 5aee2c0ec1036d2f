//! Adam's moments on disk (`offload.offload_optimizer = "disk"`, issue 31): the same update
//! arithmetic on a memory-mapped file, so an offloaded run equals the in-memory run bit
//! for bit (AdamW and LAMB on gpt2_tiny; ZeRO 1, 2 and 3 on two thread ranks, each rank's
//! shard on disk), a checkpoint taken with the state on disk resumes bit-identically (also
//! under ZeRO), no file is left in the offload directory, and the combinations it does not
//! support are config errors naming the field. ZeRO-3's parameter chunks on disk
//! (`offload.offload_params = "disk"`): updated in place in their file by the fused update,
//! copied back after an optimizer that replaces them, and runs equal to ZeRO-3 in memory
//! bit for bit, resumed bit-identically.

use super::common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Device;
use burn_onnx_train::collective::{CollectiveGroup, Collectives};
use burn_onnx_train::model::{ChunkStore, Settled};
use burn_onnx_train::train::config::{OffloadTarget, OptimizerKind, ParamOffload};
use burn_onnx_train::train::process::launch::launch;
use burn_onnx_train::train::{DeviceSpec, RunSummary, TrainingConfig};
use burn_onnx_train::{Mode, OnnxModel, Value};
use burn_ort_dist::LocalCommunicator;
use burn_ort_dist::grads::grad_sync::Reduction;
use burn_ort_dist::update::strategy::UpdateStrategy;
use burn_ort_dist::update::zero::Zero;
use burn_ort_dist::update::zero::flat_optim::Rule;
use common::*;

fn offloaded(c: &TrainingConfig, out: &Path) -> TrainingConfig {
    let mut c = c.clone();
    c.checkpoint.output_dir = out.to_path_buf();
    c.offload.offload_optimizer = OffloadTarget::Disk;
    c.offload.offload_dir = Some(out.join("moments"));
    c
}

/// The run in `out` moved its parameters and left no file in `out`/`files` (each offload
/// file is unlinked once mapped).
fn moved_and_left_no_file(out: &Path, files: &str) {
    assert_moved(
        &refkit("models/gpt2_tiny.onnx"),
        &out.join("gpt2_tiny_trained.onnx"),
        1e-3,
    );
    let left: Vec<_> = std::fs::read_dir(out.join(files)).unwrap().collect();
    assert!(left.is_empty(), "{}: files left: {left:?}", out.display());
}

fn params_equal_exactly(a: &Path, b: &Path) {
    let file = "gpt2_tiny_trained.onnx";
    for ((name, x), (_, y)) in onnx_params(a.join(file))
        .iter()
        .zip(onnx_params(b.join(file)))
    {
        assert_eq!(x, &y, "{name}: offloaded differs from in memory");
    }
}

#[test]
fn moments_on_disk_train_bit_identically_to_moments_in_memory() {
    for kind in [OptimizerKind::Adamw, OptimizerKind::Lamb] {
        let base = tempdir(&format!("offload-mem-{kind:?}"));
        let mut c = gpt2_config(&base);
        c.optimizer.kind = kind;
        let want = run_local(c.clone());
        let disk = tempdir(&format!("offload-disk-{kind:?}"));
        let got = run_local(offloaded(&c, &disk));
        assert_eq!(got.losses, want.losses, "{kind:?}: losses");
        params_equal_exactly(&base, &disk);
        moved_and_left_no_file(&disk, "moments");
    }
}

/// What puts a config's offloaded files under a run directory: [`offloaded`] or
/// [`params_on_disk`].
type OnDisk = fn(&TrainingConfig, &Path) -> TrainingConfig;

/// `c` with what `on_disk` offloads and a checkpoint every 3 updates, run whole and then
/// resumed from update 3 by `run`: the same losses from there, bit-identical parameters.
fn resumes_bit_identically(
    tag: &str,
    c: TrainingConfig,
    on_disk: OnDisk,
    run: fn(TrainingConfig) -> RunSummary,
) {
    let whole = tempdir(&format!("{tag}-whole"));
    let mut c = on_disk(&c, &whole);
    c.checkpoint.checkpoint_period = 3;
    let want = run(c.clone());
    let resumed = tempdir(&format!("{tag}-resumed"));
    let mut r = on_disk(&c, &resumed);
    r.checkpoint.checkpoint_to_load_path = Some(whole.join("checkpoints/ckpt-000000003"));
    let got = run(r);
    assert_eq!(got.start_step, 3);
    assert_eq!(got.losses, want.losses[3..].to_vec());
    params_equal_exactly(&whole, &resumed);
}

#[test]
fn a_checkpoint_of_moments_on_disk_resumes_bit_identically() {
    let c = gpt2_config(&tempdir("offload-ckpt"));
    resumes_bit_identically("offload-ckpt", c, offloaded, run_local);
}

/// `c` on 2 thread ranks at ZeRO stage `zero`, one sample per rank.
fn zero_dp2(c: &TrainingConfig, zero: usize) -> TrainingConfig {
    let mut c = c.clone();
    c.parallel.data_parallel_size = 2;
    c.parallel.zero_stage = zero;
    c.data.batch_size = 2;
    c
}

fn run_threads(c: TrainingConfig) -> RunSummary {
    launch(c, gpt2_tokens(), Some(gpt2_tokens())).unwrap_or_else(|e| panic!("{e}"))
}

/// Each rank's shard of the optimizer state in its own file: the same arithmetic as in
/// memory, so the runs end bit for bit alike; the state's memory reads 0 in perf.json.
#[test]
fn zero_shards_on_disk_train_bit_identically_to_shards_in_memory() {
    for zero in 1..=3 {
        let base = tempdir(&format!("offload-zero{zero}-mem"));
        let c = zero_dp2(&gpt2_config(&base), zero);
        let want = run_threads(c.clone());
        let disk = tempdir(&format!("offload-zero{zero}-disk"));
        let got = run_threads(offloaded(&c, &disk));
        assert_eq!(got.losses, want.losses, "ZeRO-{zero}: losses");
        params_equal_exactly(&base, &disk);
        let (mem, off) = (want.perf.unwrap(), got.perf.unwrap());
        assert!(
            mem.memory.optimizer_state_bytes.iter().all(|&b| b > 0),
            "{:?}",
            mem.memory.optimizer_state_bytes
        );
        assert_eq!(off.memory.optimizer_state_bytes, vec![0, 0], "ZeRO-{zero}");
        moved_and_left_no_file(&disk, "moments");
    }
}

#[test]
fn a_zero_checkpoint_of_shards_on_disk_resumes_bit_identically() {
    let c = zero_dp2(&gpt2_config(&tempdir("offload-zero-ckpt")), 2);
    resumes_bit_identically("offload-zero-ckpt", c, offloaded, run_threads);
}

#[test]
fn unsupported_offload_combinations_are_config_errors() {
    let out = tempdir("offload-invalid");
    let c = offloaded(&gpt2_config(&out), &out);
    c.validate(1).unwrap();
    let refused = |f: &dyn Fn(&mut TrainingConfig), why: &str| {
        let mut bad = c.clone();
        f(&mut bad);
        let world = bad.parallel.world_size();
        let err = bad.validate(world).unwrap_err().to_string();
        assert!(
            err.contains("config.offload.offload_optimizer") && err.contains(why),
            "{err}"
        );
    };
    refused(&|b| b.optimizer.kind = OptimizerKind::Sgd, "SGD");
    // ZeRO's shards go to disk too.
    let mut zero = c.clone();
    zero.parallel.zero_stage = 1;
    zero.parallel.data_parallel_size = 2;
    zero.data.batch_size = 2;
    zero.validate(2).unwrap();
    // "cpu" moves the state off a GPU: on the CPU device there is nothing to move.
    refused(
        &|b| b.offload.offload_optimizer = OffloadTarget::Cpu,
        "host memory already",
    );
    // ZeRO on a GPU takes "cpu" as well: its shards then stay in host memory where the
    // group could keep them on the device.
    let mut zero_gpu = zero.clone();
    zero_gpu.parallel.device = DeviceSpec::Wgpu(None);
    zero_gpu.parallel.zero_stage = 2;
    zero_gpu.offload.offload_optimizer = OffloadTarget::Cpu;
    zero_gpu.validate(2).unwrap();
    // On a GPU device both are accepted (the update then runs on the CPU: tests/gpu.rs).
    for target in [OffloadTarget::Cpu, OffloadTarget::Disk] {
        let mut gpu = c.clone();
        gpu.parallel.device = DeviceSpec::Wgpu(None);
        gpu.offload.offload_optimizer = target;
        gpu.validate(1).unwrap();
    }
    // Parameter chunks on disk: ZeRO-3, on any device.
    let mut on_disk = gpt2_config(&out);
    on_disk.parallel.zero_stage = 3;
    on_disk.offload.offload_params = ParamOffload::Disk;
    on_disk.validate(1).unwrap();
    on_disk.parallel.zero_stage = 2;
    let err = on_disk.validate(1).unwrap_err().to_string();
    assert!(
        err.contains("config.offload.offload_params") && err.contains("zero_stage = 3"),
        "{err}"
    );
    // Parameter chunks in host memory: ZeRO-3 on a GPU only.
    let mut params = gpt2_config(&out);
    params.parallel.device = DeviceSpec::Wgpu(None);
    params.parallel.zero_stage = 3;
    params.parallel.data_parallel_size = 2;
    params.data.batch_size = 2;
    params.offload.offload_params = ParamOffload::Cpu;
    params.validate(2).unwrap();
    for (edit, why) in [
        (
            &(|b: &mut TrainingConfig| b.parallel.zero_stage = 2) as &dyn Fn(&mut TrainingConfig),
            "zero_stage = 3",
        ),
        (
            &|b: &mut TrainingConfig| b.parallel.device = DeviceSpec::Cpu,
            "host memory already",
        ),
    ] {
        let mut bad = params.clone();
        edit(&mut bad);
        let err = bad.validate(2).unwrap_err().to_string();
        assert!(
            err.contains("config.offload.offload_params") && err.contains(why),
            "{err}"
        );
    }
}

/// `c` with ZeRO-3's parameter chunks in files under `out`/offload.
fn params_on_disk(c: &TrainingConfig, out: &Path) -> TrainingConfig {
    let mut c = c.clone();
    c.checkpoint.output_dir = out.to_path_buf();
    c.offload.offload_params = ParamOffload::Disk;
    c.offload.offload_dir = Some(out.join("offload"));
    c
}

/// `whole` as the ZeRO-3 model of one rank (its chunk is the whole parameter), its chunks
/// in memory or in a file under `dir`.
fn zero3(whole: &OnnxModel, dir: Option<&Path>) -> OnnxModel {
    let model = match dir {
        Some(d) => whole.clone().into_sharded(0, 1, ChunkStore::Disk(d)),
        None => whole.clone().into_sharded(0, 1, ChunkStore::Device),
    };
    model.unwrap().with_collectives(Collectives {
        tensor_parallel: None,
        sharding: Some(CollectiveGroup(Arc::new(LocalCommunicator))),
    })
}

/// The gradients of `mean(logits^2)` over a fixed batch.
fn mean_square_grads(model: &OnnxModel) -> GradientsParams {
    let ids = ndarray::ArrayD::from_shape_fn(ndarray::IxDyn(&[2, 16]), |ix| {
        ((ix[0] * 131 + ix[1] * 17) % 256) as i64
    });
    let out = model
        .forward(vec![("input_ids".into(), Value::Int(ids))], Mode::Train)
        .unwrap();
    let Some(Value::Float(logits)) = out.first().cloned() else {
        panic!("float logits")
    };
    let grads = (logits.tensor.clone() * logits.tensor).mean().backward();
    GradientsParams::from_grads(grads, model)
}

fn values(model: &OnnxModel) -> Vec<Vec<f32>> {
    model
        .params()
        .iter()
        .map(|p| p.val().into_data().try_to_vec::<f32>().unwrap())
        .collect()
}

/// ZeRO-3's update (the runner's `Zero` strategy) writes chunks on disk in place (the settle
/// after it finds each in its range of the file), Burn's SGD replaces them (each copied back
/// into the file), and every value equals the same steps on chunks in memory.
#[test]
fn chunks_on_disk_take_the_zero_update_in_place_and_others_are_copied_back() {
    let dir = tempdir("chunks-on-disk").join("offload");
    let whole =
        OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &Device::flex().autodiff()).unwrap();
    let (mut mem, mut disk) = (zero3(&whole, None), zero3(&whole, Some(&dir)));
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(
        left.is_empty(),
        "the file is unlinked once mapped: {left:?}"
    );
    let n = disk.params().len();
    let zero = || {
        let rule = Rule::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
        };
        let comm: Arc<dyn burn_ort_dist::Communicator> = Arc::new(LocalCommunicator);
        Zero::new(3, comm, rule, Reduction::Mean, |_| 0.01, &whole).unwrap()
    };
    let (mut a, mut b) = (zero(), zero());
    let start = values(&mem);
    for _ in 0..2 {
        // Each model moves into the update: a clone alive beside it would share its buffers
        // (and the update would copy them on write).
        let g = mean_square_grads(&mem);
        (mem, _) = a.update(1e-2, mem, g, 0.0, false).unwrap();
        let g = mean_square_grads(&disk);
        (disk, _) = b.update(1e-2, disk, g, 0.0, false).unwrap();
        let settled;
        (disk, settled) = disk.settle_offloaded().unwrap();
        assert_eq!(
            settled,
            Settled {
                in_place: n,
                copied_back: 0,
                in_memory: 0
            },
            "ZeRO-3 AdamW"
        );
        assert_eq!(values(&disk), values(&mem), "ZeRO-3 AdamW");
    }
    let mut sgd = SgdConfig::new().init();
    let g = mean_square_grads(&mem);
    mem = sgd.step(1e-2, mem, g);
    let g = mean_square_grads(&disk);
    disk = sgd.step(1e-2, disk, g);
    let (disk, settled) = disk.settle_offloaded().unwrap();
    assert_eq!(settled.in_memory, 0, "SGD");
    assert_eq!(values(&disk), values(&mem), "SGD");
    let moved = values(&mem)
        .iter()
        .zip(&start)
        .filter(|(a, b)| a != b)
        .count();
    assert!(moved > n / 2, "{moved} of {n} parameters moved");
    // A value set from outside (as a resume does) is a new tensor, copied into the file at
    // once: the settle after finds every chunk reading its range, the new value there.
    let name = disk.param_infos()[0].name.clone();
    let first = HashMap::from([(name.clone(), whole.param_by_name(&name).unwrap())]);
    let disk = disk.set_params(&first).unwrap();
    let (disk, settled) = disk.settle_offloaded().unwrap();
    assert_eq!(
        settled,
        Settled {
            in_place: n,
            copied_back: 0,
            in_memory: 0
        },
        "set_params"
    );
    assert_eq!(values(&disk)[0], start[0], "{name} read back from the file");
}

/// Runs with the chunks on disk equal ZeRO-3 in memory bit for bit: AdamW, SGD, AdamW
/// with its moments on disk too, and with recomputation (segments cut from the sharded
/// model read their chunks from the file); no file is left behind.
#[test]
fn parameters_on_disk_train_bit_identically_to_zero3_in_memory() {
    for (tag, kind, moments, recompute) in [
        ("adamw", OptimizerKind::Adamw, OffloadTarget::None, 0),
        ("sgd", OptimizerKind::Sgd, OffloadTarget::None, 0),
        (
            "adamw-moments",
            OptimizerKind::Adamw,
            OffloadTarget::Disk,
            0,
        ),
        (
            "adamw-recompute",
            OptimizerKind::Adamw,
            OffloadTarget::None,
            2,
        ),
    ] {
        let base = tempdir(&format!("params-disk-{tag}-mem"));
        let mut c = zero_dp2(&gpt2_config(&base), 3);
        c.optimizer.kind = kind;
        c.parallel.recompute_segments = recompute;
        if kind == OptimizerKind::Sgd {
            c.lr.initial_lr = 0.1;
        }
        let want = run_threads(c.clone());
        let disk = tempdir(&format!("params-disk-{tag}-disk"));
        let mut d = params_on_disk(&c, &disk);
        d.offload.offload_optimizer = moments;
        let got = run_threads(d);
        assert_eq!(got.losses, want.losses, "{tag}: losses");
        params_equal_exactly(&base, &disk);
        moved_and_left_no_file(&disk, "offload");
    }
}

#[test]
fn a_checkpoint_of_parameters_on_disk_resumes_bit_identically() {
    let c = zero_dp2(&gpt2_config(&tempdir("params-disk-ckpt")), 3);
    resumes_bit_identically("params-disk-ckpt", c, params_on_disk, run_threads);
}
