//! Adam's moments on disk (`offload.offload_optimizer = "disk"`, issue 31): the same update
//! arithmetic on a memory-mapped file, so an offloaded run equals the in-memory run bit
//! for bit (AdamW and LAMB on gpt2_tiny; ZeRO 1, 2 and 3 on two thread ranks, each rank's
//! shard on disk), a checkpoint taken with the state on disk resumes bit-identically (also
//! under ZeRO), no file is left in the offload directory, and the combinations it does not
//! support are config errors naming the field.

mod common;

use std::path::Path;

use burn_onnx_train::train::config::{OffloadTarget, OptimizerKind, ParamOffload};
use burn_onnx_train::train::launch::launch;
use burn_onnx_train::train::{DeviceSpec, RunSummary, TrainingConfig};
use common::*;

fn offloaded(c: &TrainingConfig, out: &Path) -> TrainingConfig {
    let mut c = c.clone();
    c.checkpoint.output_dir = out.to_path_buf();
    c.offload.offload_optimizer = OffloadTarget::Disk;
    c.offload.offload_dir = Some(out.join("moments"));
    c
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
        assert_moved(
            &refkit("models/gpt2_tiny.onnx"),
            &disk.join("gpt2_tiny_trained.onnx"),
            1e-3,
        );
        let left: Vec<_> = std::fs::read_dir(disk.join("moments")).unwrap().collect();
        assert!(
            left.is_empty(),
            "the moments file is unlinked once mapped: {left:?}"
        );
    }
}

/// `c` with its state on disk and a checkpoint every 3 updates, run whole and then resumed
/// from update 3 by `run`: the same losses from there, bit-identical parameters.
fn resumes_bit_identically(tag: &str, c: TrainingConfig, run: fn(TrainingConfig) -> RunSummary) {
    let whole = tempdir(&format!("{tag}-whole"));
    let mut c = offloaded(&c, &whole);
    c.checkpoint.checkpoint_period = 3;
    let want = run(c.clone());
    let resumed = tempdir(&format!("{tag}-resumed"));
    let mut r = offloaded(&c, &resumed);
    r.checkpoint.checkpoint_to_load_path = Some(whole.join("checkpoints/ckpt-000000003"));
    let got = run(r);
    assert_eq!(got.start_step, 3);
    assert_eq!(got.losses, want.losses[3..].to_vec());
    params_equal_exactly(&whole, &resumed);
}

#[test]
fn a_checkpoint_of_moments_on_disk_resumes_bit_identically() {
    let c = gpt2_config(&tempdir("offload-ckpt"));
    resumes_bit_identically("offload-ckpt", c, run_local);
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
        assert_moved(
            &refkit("models/gpt2_tiny.onnx"),
            &disk.join("gpt2_tiny_trained.onnx"),
            1e-3,
        );
        let (mem, off) = (want.perf.unwrap(), got.perf.unwrap());
        assert!(
            mem.memory.optimizer_state_bytes.iter().all(|&b| b > 0),
            "{:?}",
            mem.memory.optimizer_state_bytes
        );
        assert_eq!(off.memory.optimizer_state_bytes, vec![0, 0], "ZeRO-{zero}");
        let left: Vec<_> = std::fs::read_dir(disk.join("moments")).unwrap().collect();
        assert!(left.is_empty(), "files unlinked once mapped: {left:?}");
    }
}

#[test]
fn a_zero_checkpoint_of_shards_on_disk_resumes_bit_identically() {
    let c = zero_dp2(&gpt2_config(&tempdir("offload-zero-ckpt")), 2);
    resumes_bit_identically("offload-zero-ckpt", c, run_threads);
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
    // ZeRO on a GPU holds and updates its shards on the host already.
    refused(
        &|b| {
            b.parallel.device = DeviceSpec::Wgpu(None);
            b.offload.offload_optimizer = OffloadTarget::Cpu;
            b.parallel.zero_stage = 2;
            b.parallel.data_parallel_size = 2;
            b.data.batch_size = 2;
        },
        "what ZeRO does already",
    );
    // On a GPU device both are accepted (the update then runs on the CPU: tests/gpu.rs).
    for target in [OffloadTarget::Cpu, OffloadTarget::Disk] {
        let mut gpu = c.clone();
        gpu.parallel.device = DeviceSpec::Wgpu(None);
        gpu.offload.offload_optimizer = target;
        gpu.validate(1).unwrap();
    }
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
