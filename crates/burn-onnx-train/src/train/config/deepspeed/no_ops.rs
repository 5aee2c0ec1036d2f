//! The key table of what changes nothing here: every DeepSpeed key accepted with a warning
//! (at any value or only at DeepSpeed's default), with why, and how a key's path is matched
//! against it.

use serde_json::Value;

use super::key::Key;

/// Keys DeepSpeed documents that change nothing here: `keys` of `section` (`""`: the top
/// level; a segment ending in `*` matches any name it starts), at any value or at `only`
/// (JSON, DeepSpeed's default), with why.
pub(super) struct NoOps {
    pub(super) section: &'static str,
    pub(super) keys: &'static [&'static str],
    pub(super) only: Option<&'static str>,
    pub(super) why: &'static str,
}

/// Why DeepSpeed's offload buffering changes nothing here.
const OFFLOAD_BUFFERS: &str =
    "how DeepSpeed buffers its offload transfers; the same values are offloaded";
/// Why DeepSpeed's choice among optimizer implementations changes nothing here.
const OPTIMIZER_IMPLEMENTATION: &str =
    "which optimizer implementation DeepSpeed accepts or picks; the update is the same";

/// Every key accepted without effect (module docs).
pub(super) const NO_OPS: &[NoOps] = &[
    NoOps {
        section: "",
        keys: &[
            "wall_clock_breakdown",
            "memory_breakdown",
            "flops_profiler",
            "comms_logger",
            "dump_state",
        ],
        only: None,
        why: "DeepSpeed's own reports",
    },
    NoOps {
        section: "zero_optimization",
        keys: &[
            "contiguous_gradients",
            "overlap_comm",
            "reduce_scatter",
            "reduce_bucket_size",
            "allgather_partitions",
            "allgather_bucket_size",
            "round_robin_gradients",
            "use_multi_rank_bucket_allreduce",
            "sub_group_size",
            "memory_efficient_linear",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ],
        only: None,
        why: "how DeepSpeed's ZeRO buckets, overlaps and schedules its communication and memory; the averaged gradients and the update are the same",
    },
    NoOps {
        section: "zero_optimization",
        keys: &[
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ],
        only: None,
        why: "how DeepSpeed saves a ZeRO-3 model; the export here writes the whole f32 weights",
    },
    NoOps {
        section: "zero_optimization.offload_*",
        keys: &[
            "pin_memory",
            "buffer_count",
            "buffer_size",
            "fast_init",
            "pipeline_read",
            "pipeline_write",
            "max_in_cpu",
        ],
        only: None,
        why: OFFLOAD_BUFFERS,
    },
    NoOps {
        section: "zero_optimization",
        keys: &["cpu_offload_use_pin_memory"],
        only: None,
        why: OFFLOAD_BUFFERS,
    },
    NoOps {
        section: "",
        keys: &["aio"],
        only: None,
        why: "libaio settings of DeepSpeed's NVMe transfers; the offload files here are memory-mapped",
    },
    NoOps {
        section: "",
        keys: &[
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
        ],
        only: None,
        why: OPTIMIZER_IMPLEMENTATION,
    },
    NoOps {
        section: "optimizer.params",
        keys: &["torch_adam"],
        only: None,
        why: OPTIMIZER_IMPLEMENTATION,
    },
    NoOps {
        section: "fp16",
        keys: &["hysteresis", "consecutive_hysteresis", "min_loss_scale"],
        only: None,
        why: "when DeepSpeed lowers a dynamic loss scale after overflows; overflowing steps are skipped either way, and the scale here halves at each overflow, with no floor",
    },
    NoOps {
        section: "",
        keys: &["activation_checkpointing"],
        only: None,
        why: "settings of DeepSpeed's checkpointing API, which model code calls; recomputation here is --recompute, with the same gradients",
    },
    NoOps {
        section: "",
        keys: &["prescale_gradients"],
        only: Some("false"),
        why: "DeepSpeed's default: gradients averaged without pre-scaling, as here",
    },
    NoOps {
        section: "",
        keys: &["gradient_predivide_factor"],
        only: Some("1.0"),
        why: "DeepSpeed's default: no division before averaging, as here",
    },
    NoOps {
        section: "fp16",
        keys: &["auto_cast"],
        only: Some("false"),
        why: "DeepSpeed's default: the model's inputs are not cast to fp16, as here",
    },
    NoOps {
        section: "",
        keys: &["communication_data_type"],
        only: Some("null"),
        why: "DeepSpeed's default: gradients reduced as the run says (parallel.allreduce_in_fp16)",
    },
];

impl NoOps {
    /// Whether `key` is one of these keys (at any value).
    pub(super) fn names(&self, key: &Key) -> bool {
        let parent = key.path.strip_suffix(key.name);
        let parent = parent.and_then(|p| p.strip_suffix('.')).unwrap_or("");
        self.keys.contains(&key.name) && segments_match(self.section, parent)
    }

    /// Whether `value` changes nothing here.
    pub(super) fn harmless(&self, value: &Value) -> bool {
        self.only.is_none_or(|only| same(value, only))
    }
}

/// `path` against `pattern`, dotted segment by segment; a pattern segment ending in `*`
/// matches any segment it starts.
fn segments_match(pattern: &str, path: &str) -> bool {
    let (pattern, path): (Vec<&str>, Vec<&str>) =
        (pattern.split('.').collect(), path.split('.').collect());
    pattern.len() == path.len()
        && pattern
            .iter()
            .zip(&path)
            .all(|(p, s)| match p.strip_suffix('*') {
                Some(prefix) => s.starts_with(prefix),
                None => p == s,
            })
}

/// `value` equals the JSON `expected` (numbers by value: 1 is 1.0).
fn same(value: &Value, expected: &str) -> bool {
    let Ok(expected) = serde_json::from_str::<Value>(expected) else {
        return false;
    };
    match (value.as_f64(), expected.as_f64()) {
        (Some(a), Some(b)) => a == b,
        _ => *value == expected,
    }
}
