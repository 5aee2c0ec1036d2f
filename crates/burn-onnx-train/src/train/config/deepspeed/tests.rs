//! Unit tests of the DeepSpeed reader: the key table, `"auto"`, the batch rule, every
//! refusal by path, and the fixtures of tests/data/deepspeed.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::*;
use crate::train::config::{OffloadTarget, OptimizerKind, ParamOffload, ScheduleKind};
use crate::train::precision::Precision;

/// `tests/data/deepspeed/<name>` (sources in its SOURCES.md).
fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/deepspeed")
        .join(name)
}

/// The fixture `name` as JSON.
fn fixture(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture_path(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A run config as `--config` would give it, with values a DeepSpeed file's `"auto"`
/// keeps: 4 x 2 micro-steps, 200 micro-steps (100 updates), clipping 0.5, AdamW with
/// betas (0.85, 0.98), eps 1e-6, decay 0.05, lr 3e-5, in `dtype`.
fn run(dtype: Precision) -> TrainingConfig {
    let mut c = TrainingConfig::default();
    (c.data.batch_size, c.eval.eval_batch_size) = (4, 4);
    c.train.gradient_accumulation_steps = 2;
    c.train.num_train_steps = 200;
    c.train.max_grad_norm = 0.5;
    c.lr.initial_lr = 3e-5;
    let o = &mut c.optimizer;
    (o.beta1, o.beta2, o.epsilon, o.weight_decay) = (0.85, 0.98, 1e-6, 0.05);
    c.precision.dtype = dtype;
    c
}

/// `json` read over `c`.
fn apply(c: TrainingConfig, json: &Value) -> Step<Applied> {
    read(c, json.as_object().unwrap())
}

/// `json` read over `c`, expected to succeed.
fn applied(c: TrainingConfig, json: &Value) -> Applied {
    apply(c, json).unwrap_or_else(|e| panic!("refused: {e}"))
}

/// `json` read over `c`, expected to fail: the message.
fn refused(c: TrainingConfig, json: serde_json::Value) -> String {
    match apply(c, &json) {
        Ok(_) => panic!("accepted: {json}"),
        Err(e) => e,
    }
}

/// The keys `a` accepted without effect.
fn no_ops(a: &Applied) -> Vec<&str> {
    a.no_ops.iter().map(|(path, _)| path.as_str()).collect()
}

/// `json` with the key at `path` (dotted) removed.
fn without(mut json: Value, path: &str) -> Value {
    let (parent, name) = path.rsplit_once('.').unwrap_or(("", path));
    let mut at = &mut json;
    for segment in parent.split('.').filter(|s| !s.is_empty()) {
        at = &mut at[segment];
    }
    at.as_object_mut().unwrap().remove(name).unwrap();
    json
}

#[test]
fn hugging_face_zero2_keeps_the_run_where_it_says_auto() {
    let json = fixture("transformers_ds_config_zero2.json");
    let a = applied(run(Precision::F16), &json);
    let c = &a.config;
    assert_eq!((c.data.batch_size, c.eval.eval_batch_size), (4, 4));
    assert_eq!(c.train.gradient_accumulation_steps, 2);
    assert_eq!(c.train.max_grad_norm, 0.5);
    assert_eq!(c.train.num_train_steps, 200);
    assert_eq!(c.parallel.zero_stage, 2);
    assert_eq!(c.offload.offload_optimizer, OffloadTarget::Cpu);
    assert_eq!(c.offload.offload_params, ParamOffload::None);
    assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
    assert_eq!((c.optimizer.beta1, c.optimizer.beta2), (0.85, 0.98));
    assert_eq!(
        (c.optimizer.epsilon, c.optimizer.weight_decay),
        (1e-6, 0.05)
    );
    assert_eq!(c.lr.initial_lr, 3e-5);
    assert_eq!(
        (c.lr.mode, c.lr.warmup_ratio),
        (ScheduleKind::Constant, 0.0)
    );
    // fp16 "auto" under an f16 run: its loss scaling applies.
    assert_eq!(c.precision.dtype, Precision::F16);
    assert_eq!(c.precision.loss_scale, Some(0.0));
    assert_eq!(c.precision.loss_scale_growth_interval, 1000);
    assert_eq!(c.logging.display_loss_steps, 2000);
    let quiet = no_ops(&a);
    for key in [
        "wall_clock_breakdown",
        "fp16.hysteresis",
        "fp16.min_loss_scale",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_optimizer.pin_memory",
    ] {
        assert!(quiet.contains(&key), "{key} not in {quiet:?}");
    }
    assert!(a.mapped.contains(
        &"train_micro_batch_size_per_gpu = \"auto\" → data.batch_size, eval.eval_batch_size kept = 4".to_string()
    ), "{:#?}", a.mapped);
    assert!(
        a.mapped
            .contains(&"zero_optimization.stage = 2 → parallel.zero_stage = 2".to_string())
    );
    let line = a.no_ops_line();
    assert!(
        line.contains("zero_optimization.overlap_comm") && line.contains("ZeRO"),
        "{line}"
    );
}

#[test]
fn hugging_face_fp16_auto_leaves_an_f32_run_and_its_loss_scale_alone() {
    let json = fixture("transformers_ds_config_zero2.json");
    let c = applied(run(Precision::F32), &json).config;
    assert_eq!(c.precision.dtype, Precision::F32);
    assert_eq!(c.precision.loss_scale, None);
    assert_eq!(c.precision.loss_scale_growth_interval, 2000);
}

#[test]
fn hugging_face_zero3_offloads_parameters_and_optimizer_to_the_cpu() {
    let json = fixture("transformers_ds_config_zero3.json");
    let a = applied(run(Precision::F32), &json);
    let c = &a.config;
    assert_eq!(c.parallel.zero_stage, 3);
    assert_eq!(c.offload.offload_optimizer, OffloadTarget::Cpu);
    assert_eq!(c.offload.offload_params, ParamOffload::Cpu);
    assert_eq!(c.precision.dtype, Precision::F32);
    assert_eq!(c.data.batch_size, 4);
    assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
    let quiet = no_ops(&a);
    for key in [
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.sub_group_size",
        "zero_optimization.offload_param.pin_memory",
    ] {
        assert!(quiet.contains(&key), "{key} not in {quiet:?}");
    }
}

#[test]
fn hugging_face_bfloat16_auto_keeps_a_bf16_run() {
    let json = fixture("transformers_ds_config_zero2_bf16.json");
    let a = applied(run(Precision::Bf16), &json);
    assert_eq!(a.config.precision.dtype, Precision::Bf16);
    assert_eq!(a.config.precision.loss_scale, None);
    assert!(
        a.mapped
            .iter()
            .any(|l| l.starts_with("bfloat16.enabled = \"auto\""))
    );
}

#[test]
fn a_hugging_face_warm_up_left_to_auto_must_be_linear_when_the_run_has_one() {
    let json = fixture("transformers_ds_config_zero2.json");
    let mut c = run(Precision::F32);
    (c.lr.mode, c.lr.warmup_ratio) = (ScheduleKind::Linear, 0.1);
    let err = apply(c.clone(), &json).err().unwrap();
    assert!(
        err.contains("scheduler.params.warmup_type") && err.contains("logarithmically"),
        "{err}"
    );
    let mut json = json;
    json["scheduler"]["params"]["warmup_type"] = "linear".into();
    let c = applied(c, &json).config;
    assert_eq!(
        (c.lr.mode, c.lr.warmup_ratio),
        (ScheduleKind::Constant, 0.1)
    );
}

#[test]
fn the_hugging_face_nvme_example_names_its_misplaced_aio_and_nothing_else() {
    let json = fixture("transformers_docs_deepspeed_zero3_nvme.json");
    let err = refused(run(Precision::F16), json.clone());
    assert!(
        err.starts_with("zero_optimization.aio: not supported"),
        "{err}"
    );
    assert!(!err.contains("problems"), "{err}");
    let a = applied(run(Precision::F16), &without(json, "zero_optimization.aio"));
    let c = &a.config;
    assert_eq!(c.parallel.zero_stage, 3);
    assert_eq!(c.offload.offload_optimizer, OffloadTarget::Disk);
    assert_eq!(c.offload.offload_params, ParamOffload::Disk);
    assert_eq!(c.offload.offload_dir, Some(PathBuf::from("/local_nvme")));
    for key in [
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_optimizer.fast_init",
    ] {
        assert!(no_ops(&a).contains(&key), "{key}");
    }
}

#[test]
fn the_cifar_example_lists_everything_it_cannot_have_in_one_error() {
    let json = fixture("deepspeedexamples_cifar_ds_config.json");
    let mut long = run(Precision::F32);
    (
        long.train.gradient_accumulation_steps,
        long.train.num_train_steps,
    ) = (1, 20_000);
    let err = refused(long.clone(), json.clone());
    assert!(err.starts_with("3 problems:"), "{err}");
    for key in [
        "fp16.fp16_master_weights_and_grads: not supported",
        "fp16.initial_scale_power: the dynamic loss scale starts at 2^16",
        "scheduler.params.warmup_type: DeepSpeed's WarmupLR warms up logarithmically",
    ] {
        assert!(err.contains(key), "{key}: {err}");
    }
    // Without what it cannot have, the rest maps.
    let mut json = without(json, "fp16.fp16_master_weights_and_grads");
    json["fp16"]["initial_scale_power"] = 16.into();
    json["scheduler"]["params"]["warmup_type"] = "linear".into();
    let a = applied(long, &json);
    let c = &a.config;
    // train_batch_size 4 on one rank, the run's accumulation 1: micro-batches of 4.
    assert_eq!(
        (c.data.batch_size, c.train.gradient_accumulation_steps),
        (4, 1)
    );
    assert_eq!(c.parallel.zero_stage, 2);
    assert_eq!(c.offload.offload_optimizer, OffloadTarget::Cpu);
    assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
    assert_eq!((c.optimizer.beta1, c.optimizer.beta2), (0.8, 0.999));
    assert_eq!(c.optimizer.weight_decay, 3e-7);
    assert_eq!(c.lr.initial_lr, 0.001);
    assert_eq!(
        (c.lr.mode, c.lr.warmup_ratio),
        (ScheduleKind::Constant, 0.05)
    );
    assert_eq!(c.train.max_grad_norm, 1.0);
    assert_eq!(c.precision.dtype, Precision::F16);
    assert_eq!(c.precision.loss_scale_growth_interval, 500);
    assert!(no_ops(&a).contains(&"prescale_gradients"));
}

#[test]
fn megatron_zero2_infers_the_micro_batch_and_runs_fp16_adamw() {
    let json = fixture("deepspeedexamples_megatron_lm_ds_zero2_config.json");
    let a = applied(run(Precision::F32), &json);
    let c = &a.config;
    assert_eq!((c.data.batch_size, c.eval.eval_batch_size), (16, 16));
    assert_eq!(c.train.gradient_accumulation_steps, 1);
    assert_eq!(c.parallel.zero_stage, 2);
    assert_eq!(c.precision.dtype, Precision::F16);
    assert_eq!(c.precision.loss_scale, Some(0.0));
    assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
    assert_eq!(c.lr.initial_lr, 0.00015);
    assert_eq!(c.train.max_grad_norm, 1.0);
    assert_eq!(c.logging.display_loss_steps, 1);
    assert!(no_ops(&a).contains(&"activation_checkpointing"));
}

#[test]
fn megatron_zero_infinity_names_its_misspelt_key_and_maps_the_rest() {
    let json = fixture("deepspeedexamples_megatron_lm_zero3_ds_zero_stage_infinity_config.json");
    let misspelt = "zero_optimization.stage3_param_persitance_threshold";
    let err = refused(run(Precision::F32), json.clone());
    assert!(
        err.starts_with(&format!("{misspelt}: not supported")),
        "{err}"
    );
    let a = applied(run(Precision::F32), &without(json, misspelt));
    let c = &a.config;
    assert_eq!(
        (c.data.batch_size, c.train.gradient_accumulation_steps),
        (4, 1)
    );
    assert_eq!(c.parallel.zero_stage, 3);
    assert_eq!(c.offload.offload_optimizer, OffloadTarget::Disk);
    assert_eq!(c.offload.offload_params, ParamOffload::Disk);
    assert_eq!(c.offload.offload_dir, Some(PathBuf::from("/nvme_data")));
    assert_eq!(c.precision.dtype, Precision::F16);
    assert_eq!(c.precision.loss_scale, Some(1024.0));
    for key in [
        "aio",
        "zero_allow_untested_optimizer",
        "zero_optimization.offload_optimizer.pipeline_read",
    ] {
        assert!(no_ops(&a).contains(&key), "{key}");
    }
}

#[test]
fn every_unsupported_key_and_bad_value_is_named_by_its_full_path_in_one_error() {
    let err = refused(
        run(Precision::F32),
        serde_json::json!({
            "sparse_gradients": true,
            "zero_optimization": {"stage": 2, "zero_quantized_weights": true},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": true}},
            "fp16": {"enabled": "yes"}
        }),
    );
    assert!(err.starts_with("4 problems:"), "{err}");
    for key in [
        "sparse_gradients: not supported",
        "zero_optimization.zero_quantized_weights: not supported",
        "optimizer.params.amsgrad: not supported",
        "fp16.enabled: expected true, false or \"auto\", got \"yes\"",
    ] {
        assert!(err.contains(key), "{key}: {err}");
    }
}

#[test]
fn fp16_and_bf16_both_on_are_refused_naming_both() {
    let both = serde_json::json!({"fp16": {"enabled": true}, "bf16": {"enabled": true}});
    let err = refused(run(Precision::F32), both);
    assert!(
        err.contains("fp16.enabled and bf16.enabled are both on"),
        "{err}"
    );
    // "auto" counts as on where the run already computes in that precision.
    let auto = serde_json::json!({"fp16": {"enabled": true}, "bf16": {"enabled": "auto"}});
    let err = refused(run(Precision::Bf16), auto.clone());
    assert!(
        err.contains("bf16.enabled is \"auto\" and the run computes in \"bf16\""),
        "{err}"
    );
    assert_eq!(
        applied(run(Precision::F32), &auto).config.precision.dtype,
        Precision::F16
    );
}

#[test]
fn auto_where_the_trainer_fills_nothing_is_refused_by_path() {
    let err = refused(
        run(Precision::F32),
        serde_json::json!({
            "zero_optimization": {"stage": "auto"},
            "optimizer": {"type": "SGD", "params": {"momentum": "auto"}}
        }),
    );
    for key in [
        "zero_optimization.stage: \"auto\" is resolved only",
        "optimizer.params.momentum: \"auto\"",
    ] {
        assert!(err.contains(key), "{key}: {err}");
    }
}

#[test]
fn a_no_op_only_at_deepspeeds_default_is_refused_at_another_value() {
    let err = refused(
        run(Precision::F32),
        serde_json::json!({"prescale_gradients": true}),
    );
    assert!(
        err.starts_with("prescale_gradients = true: not available here; only false"),
        "{err}"
    );
    let err = refused(
        run(Precision::F32),
        serde_json::json!({"gradient_predivide_factor": 8}),
    );
    assert!(err.starts_with("gradient_predivide_factor = 8"), "{err}");
    let a = applied(
        run(Precision::F32),
        &serde_json::json!({"gradient_predivide_factor": 1}),
    );
    assert_eq!(no_ops(&a), ["gradient_predivide_factor"]);
}

#[test]
fn communication_data_type_sets_the_reduction_precision() {
    let fp16 = serde_json::json!({"communication_data_type": "fp16"});
    assert!(
        applied(run(Precision::F16), &fp16)
            .config
            .parallel
            .allreduce_in_fp16
    );
    let err = refused(
        run(Precision::F32),
        serde_json::json!({"communication_data_type": "bf16"}),
    );
    assert!(
        err.starts_with("communication_data_type: expected \"fp16\", \"fp32\" or null"),
        "{err}"
    );
}

#[test]
fn train_batch_size_is_checked_when_all_three_are_given_and_completes_the_rest() {
    let all = serde_json::json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2});
    let err = refused(run(Precision::F32), all);
    assert!(err.starts_with("train_batch_size 64 is not train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 2 x data-parallel ranks 1 = 16"), "{err}");
    let two = serde_json::json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8});
    assert_eq!(
        applied(run(Precision::F32), &two)
            .config
            .train
            .gradient_accumulation_steps,
        8
    );
    let err = refused(
        run(Precision::F32),
        serde_json::json!({"train_batch_size": 7}),
    );
    assert!(
        err.contains("not a multiple of gradient_accumulation_steps 2"),
        "{err}"
    );
}

#[test]
fn a_scheduler_gets_deepspeeds_defaults_for_what_it_leaves_out() {
    let decay = serde_json::json!({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear", "total_num_steps": 2000}}});
    let c = applied(run(Precision::F32), &decay).config;
    // 2000 updates of 2 micro-steps; DeepSpeed's 1000 warm-up updates and peak 0.001.
    assert_eq!(c.train.num_train_steps, 4000);
    assert_eq!(
        (c.lr.mode, c.lr.warmup_ratio, c.lr.initial_lr),
        (ScheduleKind::Linear, 0.5, 0.001)
    );
    let cosine = serde_json::json!({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 0}}});
    let err = refused(run(Precision::F32), cosine);
    assert!(
        err.starts_with(
            "scheduler.params.cos_min_ratio: DeepSpeed's WarmupCosineLR decays to 0.0001"
        ),
        "{err}"
    );
}

#[test]
fn the_file_and_the_path_are_in_the_error() {
    let path = fixture_path("deepspeedexamples_cifar_ds_config.json");
    match apply_deepspeed(run(Precision::F32), &path) {
        Err(OnnxError::Decode {
            path: p,
            what,
            message,
        }) => {
            assert_eq!((p, what), (path, "DeepSpeed config"));
            assert!(
                message.contains("fp16.fp16_master_weights_and_grads"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
}
