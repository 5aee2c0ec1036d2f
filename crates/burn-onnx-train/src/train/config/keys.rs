//! The keys a config takes, section by section ([`SECTIONS`]), and the keys it cannot
//! take, named with what was probably meant: a key no section has (`learning_rate`,
//! Hugging Face's name for `lr.initial_lr`), or a section given a value (`lr = 1e-3`).
//! Suggestions come from the names other trainers use for our fields and from the
//! spelling of the fields themselves.

use super::TrainingConfig;

/// The sections of a config file and their fields, by ORT name.
pub(super) const SECTIONS: &[(&str, &[&str])] = &[
    (
        "model",
        &[
            "model_path",
            "input_name",
            "output_name",
            "loss",
            "label_name",
            "attention_mask_name",
            "weights_to_train",
            "weights_not_to_train",
            "tie_duplicate_initializers",
            "untie_shared_constants",
            "pad_vocab_to_multiple_of",
            "fused_head_loss",
        ],
    ),
    (
        "data",
        &[
            "train_data_dir",
            "test_data_dir",
            "batch_size",
            "seq_len",
            "sequences",
            "length_bucket_batches",
            "pad_id",
        ],
    ),
    (
        "train",
        &[
            "num_train_steps",
            "num_train_epochs",
            "gradient_accumulation_steps",
            "max_grad_norm",
            "seed",
            "cuda_graph",
        ],
    ),
    (
        "eval",
        &[
            "eval_batch_size",
            "evaluation_period",
            "eval_batches",
            "eval_partitioned",
        ],
    ),
    (
        "precision",
        &["dtype", "loss_scale", "loss_scale_growth_interval"],
    ),
    (
        "parallel",
        &[
            "device",
            "data_parallel_size",
            "horizontal_parallel_size",
            "tensor_parallel_allow_replicated",
            "tensor_parallel_vocab",
            "tensor_parallel_sequence",
            "pipeline_parallel_size",
            "pipeline_virtual_stages",
            "num_pipeline_micro_batches",
            "pipeline_schedule",
            "pipeline_cut_after",
            "zero_stage",
            "zero3_prefetch",
            "enable_adasum",
            "allreduce_in_fp16",
            "overlap",
            "recompute_segments",
            "collective_timeout",
        ],
    ),
    (
        "checkpoint",
        &[
            "output_dir",
            "checkpoints_dir",
            "checkpoint_period",
            "max_num_checkpoints",
            "checkpoint_to_load_path",
            "resume",
            "overwrite_output_dir",
        ],
    ),
    (
        "logging",
        &[
            "display_loss_steps",
            "log_dir",
            "histogram_weights",
            "norm_weights",
            "progress",
            "profile",
        ],
    ),
    (
        "offload",
        &["offload_optimizer", "offload_params", "offload_dir"],
    ),
    ("optimizer", &[]),
    ("lr", &[]),
];

/// Names other trainers (Hugging Face's `TrainingArguments`, Megatron, DeepSpeed) use for
/// our fields, with the flag that sets the field where there is one.
const SYNONYMS: &[(&str, &str, Option<&str>)] = &[
    ("learning_rate", "lr.initial_lr", Some("--lr")),
    ("lr", "lr.initial_lr", Some("--lr")),
    (
        "per_device_train_batch_size",
        "data.batch_size",
        Some("--batch-size"),
    ),
    ("train_batch_size", "data.batch_size", Some("--batch-size")),
    ("micro_batch_size", "data.batch_size", Some("--batch-size")),
    ("per_device_eval_batch_size", "eval.eval_batch_size", None),
    ("max_steps", "train.num_train_steps", Some("--steps")),
    (
        "make_vocab_size_divisible_by",
        "model.pad_vocab_to_multiple_of",
        None,
    ),
    ("fused_linear_cross_entropy", "model.fused_head_loss", None),
    ("train_iters", "train.num_train_steps", Some("--steps")),
    ("num_epochs", "train.num_train_epochs", Some("--epochs")),
    ("epochs", "train.num_train_epochs", Some("--epochs")),
    ("warmup_ratio", "lr.warmup_ratio", None),
    ("weight_decay", "optimizer.weight_decay", None),
    ("adam_epsilon", "optimizer.epsilon", None),
    ("optim", "optimizer.kind", None),
    ("lr_scheduler_type", "lr.mode", None),
    (
        "logging_steps",
        "logging.display_loss_steps",
        Some("--display-loss-steps"),
    ),
    (
        "save_steps",
        "checkpoint.checkpoint_period",
        Some("--checkpoint-period"),
    ),
    (
        "eval_steps",
        "eval.evaluation_period",
        Some("--eval-period"),
    ),
    ("save_total_limit", "checkpoint.max_num_checkpoints", None),
    ("fp16", "precision.dtype", Some("--precision")),
    ("bf16", "precision.dtype", Some("--precision")),
    ("model_name_or_path", "model.model_path", Some("--model")),
    ("max_seq_length", "data.seq_len", None),
    ("block_size", "data.seq_len", None),
    ("seq_length", "data.seq_len", None),
    (
        "gradient_checkpointing",
        "parallel.recompute_segments",
        Some("--recompute"),
    ),
];

/// The first key of the sectioned table `file` that no field takes, said with what was
/// probably meant; `None` when every top-level key is a section holding a table.
pub(super) fn unknown_key(file: &toml::Table) -> Option<String> {
    let sections = known_fields();
    for (key, value) in file {
        let fields = sections.iter().find(|(s, _)| s == key).map(|(_, f)| f);
        match (fields, value) {
            (Some(_), toml::Value::Table(_)) => {}
            (Some(fields), _) => {
                let meant = suggestion(key, &sections)
                    .map_or_else(String::new, |s| format!("; did you mean {s}?"));
                return Some(format!(
                    "{key} is a section, not a value: set one of its fields ({}){meant}",
                    fields.join(", ")
                ));
            }
            (None, _) => {
                let meant = suggestion(key, &sections).map_or_else(
                    || format!(" (sections: {})", section_names(&sections)),
                    |s| format!("; did you mean {s}?"),
                );
                return Some(format!("unknown key {key}{meant}"));
            }
        }
    }
    None
}

/// Each section with its fields: the flat-name table's, and for the sections it leaves
/// empty (`optimizer`, `lr`) the fields a default config writes.
fn known_fields() -> Vec<(String, Vec<String>)> {
    let written = toml::Table::try_from(TrainingConfig::default()).unwrap_or_default();
    SECTIONS
        .iter()
        .map(|&(section, fields)| {
            let fields: Vec<String> = if fields.is_empty() {
                match written.get(section) {
                    Some(toml::Value::Table(t)) => t.keys().cloned().collect(),
                    _ => Vec::new(),
                }
            } else {
                fields.iter().map(|f| f.to_string()).collect()
            };
            (section.to_string(), fields)
        })
        .collect()
}

fn section_names(sections: &[(String, Vec<String>)]) -> String {
    let names: Vec<&str> = sections.iter().map(|(s, _)| s.as_str()).collect();
    names.join(", ")
}

/// `section.field` (and its flag) that `key` most likely means: a synonym, else the field
/// whose name is nearest in spelling (at most a third of its letters off).
fn suggestion(key: &str, sections: &[(String, Vec<String>)]) -> Option<String> {
    if let Some((_, field, flag)) = SYNONYMS.iter().find(|(k, ..)| *k == key) {
        return Some(match flag {
            Some(flag) => format!("{field} (flag {flag})"),
            None => field.to_string(),
        });
    }
    let (distance, field) = sections
        .iter()
        .flat_map(|(s, fields)| fields.iter().map(move |f| (s, f)))
        .map(|(s, f)| (edit_distance(key, f), format!("{s}.{f}")))
        .min()?;
    (distance <= key.len().max(3) / 3).then_some(field)
}

/// Levenshtein distance of two names.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn hugging_face_names_point_at_our_fields() {
        let m = unknown_key(&table("learning_rate = 0.001")).unwrap();
        assert_eq!(
            m,
            "unknown key learning_rate; did you mean lr.initial_lr (flag --lr)?"
        );
        let m = unknown_key(&table("lr = 0.001")).unwrap();
        assert!(
            m.starts_with("lr is a section, not a value: set one of its fields ("),
            "{m}"
        );
        assert!(
            m.contains("initial_lr") && m.ends_with("did you mean lr.initial_lr (flag --lr)?"),
            "{m}"
        );
    }

    #[test]
    fn a_misspelt_key_names_the_nearest_field() {
        let m = unknown_key(&table("batchsize = 4")).unwrap();
        assert_eq!(m, "unknown key batchsize; did you mean data.batch_size?");
        let m = unknown_key(&table("zzz = 1")).unwrap();
        assert!(
            m.starts_with("unknown key zzz (sections: model, data, "),
            "{m}"
        );
    }

    #[test]
    fn sections_holding_tables_pass() {
        assert_eq!(
            unknown_key(&table("[data]\nbatch_size = 4\n[lr]\ninitial_lr = 0.1")),
            None
        );
    }

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("seq_len", "seq_len"), 0);
        assert_eq!(edit_distance("seqlen", "seq_len"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
