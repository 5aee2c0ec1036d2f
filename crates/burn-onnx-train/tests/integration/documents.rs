//! Variable-length sequences (`data.sequences`): documents padded to the longest of their
//! batch and packed windows hold exactly the labels, masks and sizes worked out by hand;
//! the length-balanced sampler deals every sample once an epoch, gives each rank its batch
//! size and about the same tokens, and pads less with length buckets; the first update's
//! loss on documents equals onnxruntime's cross-entropy over each document run alone
//! (averaged over all their labels); and two data-parallel ranks end where one process
//! does on the same documents (the loss divided by the update's labels over all ranks).

use super::common;

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use burn_onnx_train::Value;
use burn_onnx_train::model::loss::{IGNORE_INDEX, LossKind};
use burn_onnx_train::train::config::Sequences;
use burn_onnx_train::train::data::documents::{DocumentDataset, PackedDocuments};
use burn_onnx_train::train::data::npy::write_npy;
use burn_onnx_train::train::data::{
    Dataset, DistributedSampler, LengthBalance, SampleSize, Target,
};
use burn_onnx_train::train::process::launch::launch;
use common::*;
use ndarray::{ArrayD, IxDyn};

fn ints(shape: &[usize], v: Vec<i64>) -> ArrayD<i64> {
    ArrayD::from_shape_vec(IxDyn(shape), v).unwrap()
}

const X: i64 = IGNORE_INDEX;

#[test]
fn a_padded_batch_holds_each_document_its_labels_and_mask() {
    // Three documents; the third (6 tokens) is cut into pieces of seq_len 4 and 2.
    let docs = vec![
        vec![1, 2, 3],
        vec![4, 5],
        vec![6, 7, 8, 9, 10, 11],
        vec![12],
    ];
    let data = DocumentDataset::from_documents(&docs, 4, 0).unwrap();
    assert_eq!(
        data.len(),
        4,
        "3 + 1 pieces; the one-token document predicts nothing"
    );
    let b = data.batch(&[0, 1, 2]).unwrap();
    assert_eq!(
        b.input,
        burn_onnx_train::value::host_tensor::HostTensor::Int(ints(
            &[3, 4],
            vec![1, 2, 3, 0, 4, 5, 0, 0, 6, 7, 8, 9]
        ))
    );
    let Target::Tokens {
        labels,
        mask,
        divisor,
    } = b.target
    else {
        panic!("documents carry token labels")
    };
    assert_eq!(
        labels,
        ints(&[3, 4], vec![2, 3, X, X, 5, X, X, X, 7, 8, 9, X])
    );
    assert_eq!(
        mask,
        ints(&[3, 4], vec![1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    );
    assert_eq!(
        (b.items, divisor),
        (9, 6.0),
        "real tokens; labels of this batch alone"
    );
    let piece = data.batch(&[3]).unwrap();
    assert_eq!(
        piece.input,
        burn_onnx_train::value::host_tensor::HostTensor::Int(ints(&[1, 2], vec![10, 11]))
    );
    assert_eq!(
        data.sample_size(2),
        Some(SampleSize {
            tokens: 4,
            labels: 3
        })
    );
}

/// Token shards `1..=10` with documents starting at 0, 3 and 7, and their index, in `dir`.
fn packed_shards(dir: &Path) {
    write_npy(
        dir.join("tokens.npy"),
        &Value::Int(ints(&[10], (1..=10).collect())),
    )
    .unwrap();
    write_npy(
        dir.join("documents.idx.npy"),
        &Value::Int(ints(&[4], vec![0, 3, 7, 10])),
    )
    .unwrap();
}

#[test]
fn packed_windows_never_predict_across_a_document_boundary() {
    let dir = tempdir("packed");
    packed_shards(&dir);
    let data = PackedDocuments::load(&dir, 5).unwrap();
    assert_eq!(data.len(), 2, "the index is not read as a shard");
    let b = data.batch(&[0, 1]).unwrap();
    let Target::Tokens { labels, mask, .. } = b.target else {
        panic!("packed windows carry token labels")
    };
    // Window 0 = 1 2 3 | 4 5: position 2 would predict 4, the next document's first token.
    // Window 1 = 6 7 | 8 9 10: position 1 would predict 8.
    assert_eq!(labels, ints(&[2, 5], vec![2, 3, X, 5, X, 7, X, 9, 10, X]));
    assert_eq!(mask, ints(&[2, 5], vec![1; 10]));
    assert_eq!(data.sample_size(0).map(|s| s.labels), Some(3));
    assert_eq!(data.sample_size(1).map(|s| s.labels), Some(3));
    // A broken index is an error naming it.
    write_npy(
        dir.join("documents.idx.npy"),
        &Value::Int(ints(&[3], vec![0, 5, 9])),
    )
    .unwrap();
    let e = PackedDocuments::load(&dir, 5).err().unwrap().to_string();
    assert!(
        e.contains("documents.idx.npy") && e.contains("10 tokens"),
        "{e}"
    );
}

fn balanced(lengths: &[u32], rank: usize, world: usize, bucket: usize) -> DistributedSampler {
    DistributedSampler {
        len: lengths.len(),
        batch_size: 4,
        rank,
        world,
        seed: 5,
        shuffle: true,
        balance: Some(LengthBalance {
            lengths: Arc::new(lengths.to_vec()),
            bucket,
        }),
        last_order: Default::default(),
    }
}

#[test]
fn the_balanced_sampler_deals_every_document_once_with_even_tokens_and_buckets_lengths() {
    let mut next = lcg(3);
    let lengths: Vec<u32> = (0..203).map(|_| 2 + (next() % 120) as u32).collect();
    let (world, batch) = (3, 4);
    let per = lengths.len() / (world * batch);
    let padding = |bucket: usize| -> u64 {
        let s = balanced(&lengths, 0, world, bucket);
        (0..per)
            .flat_map(|k| s.global_batch(k).unwrap())
            .map(|b| {
                let longest = b.iter().map(|&i| lengths[i]).max().unwrap();
                b.iter()
                    .map(|&i| u64::from(longest - lengths[i]))
                    .sum::<u64>()
            })
            .sum()
    };
    let s = balanced(&lengths, 0, world, 8);
    assert_eq!(s.batches_per_epoch(), per);
    let mut seen = HashSet::new();
    for k in 0..per {
        let global = s.global_batch(k).unwrap();
        let longest = global.iter().flatten().map(|&i| lengths[i]).max().unwrap();
        let tokens: Vec<u32> = global
            .iter()
            .map(|b| b.iter().map(|&i| lengths[i]).sum())
            .collect();
        for (r, b) in global.iter().enumerate() {
            assert_eq!(b.len(), batch);
            assert_eq!(
                *b,
                balanced(&lengths, r, world, 8).batch_indices(k).unwrap()
            );
            seen.extend(b.iter().copied());
        }
        let (lo, hi) = (tokens.iter().min().unwrap(), tokens.iter().max().unwrap());
        assert!(hi - lo <= longest, "update {k}: rank tokens {tokens:?}");
    }
    assert_eq!(
        seen.len(),
        per * world * batch,
        "each sample at most once an epoch"
    );
    // The next epoch starts over with another order.
    assert_ne!(s.global_batch(0).unwrap(), s.global_batch(per).unwrap());
    let (bucketed, plain) = (padding(8), padding(1));
    assert!(
        bucketed * 3 < plain,
        "length buckets pad {bucketed} tokens, unbucketed {plain}"
    );
}

/// 24 documents of 3 to 31 tokens below gpt2_tiny's vocabulary.
fn documents() -> Vec<Vec<i64>> {
    let mut next = lcg(17);
    (0..24)
        .map(|_| {
            let len = 3 + (next() % 29) as usize;
            (0..len).map(|_| (next() % 1024) as i64).collect()
        })
        .collect()
}

fn gpt2_documents(out: &Path) -> burn_onnx_train::train::TrainingConfig {
    let mut c = sgd_config(
        refkit("models/gpt2_tiny.onnx"),
        LossKind::LmCrossEntropy,
        "input_ids",
    );
    c.checkpoint.output_dir = out.to_path_buf();
    c.data.sequences = Sequences::Documents;
    c.data.seq_len = 32;
    c.data.length_bucket_batches = 2;
    c
}

/// The loss of the first update of `model` (initial weights) on `docs` with `c`'s
/// settings is the cross-entropy onnxruntime computes over every label of the update's
/// documents, each run alone without padding (with an all-ones `attention_mask` when the
/// graph takes one).
fn first_loss_is_onnxruntimes(
    python: &std::ffi::OsStr,
    model: &Path,
    docs: &[Vec<i64>],
    c: burn_onnx_train::train::TrainingConfig,
) {
    let data: Arc<dyn Dataset> = Arc::new(DocumentDataset::from_documents(docs, 32, 0).unwrap());
    let sampler = DistributedSampler {
        len: data.len(),
        batch_size: c.data.batch_size,
        rank: 0,
        world: 1,
        seed: c.train.seed,
        shuffle: true,
        balance: burn_onnx_train::train::data::documents::length_balance(&c.data, data.as_ref()),
        last_order: Default::default(),
    };
    let dir = c.checkpoint.output_dir.join("docs");
    std::fs::create_dir_all(&dir).unwrap();
    for (k, &i) in sampler.batch_indices(0).unwrap().iter().enumerate() {
        write_npy(
            dir.join(format!("{k}.npy")),
            &Value::Int(ints(&[docs[i].len()], docs[i].clone())),
        )
        .unwrap();
    }
    let got = launch(c, data, None).unwrap().losses[0].1;
    let script = r#"
import glob, sys
import numpy as np, onnxruntime as ort
model, d, got = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
names = [i.name for i in s.get_inputs()]
total, labels = 0.0, 0
for f in sorted(glob.glob(d + "/*.npy")):
    ids = np.load(f)[None, :]
    feed = {"input_ids": ids}
    if "attention_mask" in names:
        feed["attention_mask"] = np.ones_like(ids)
    logits = s.run(["logits"], feed)[0][0].astype(np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    total -= logp[np.arange(ids.shape[1] - 1), ids[0, 1:]].sum()
    labels += ids.shape[1] - 1
want = total / labels
assert abs(got - want) < 1e-4 * want, (got, want)
print("ok", got, want, labels)
"#;
    python_says_ok(
        python,
        script,
        &[model.as_os_str(), dir.as_os_str(), got.to_string().as_ref()],
    );
}

#[test]
fn the_first_loss_on_documents_is_onnxruntimes_over_each_document_alone() {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "documents' loss") else {
        return;
    };
    let c = {
        let mut c = gpt2_documents(&tempdir("documents-loss"));
        c.data.batch_size = 6;
        c.train.num_train_steps = 1;
        c
    };
    first_loss_is_onnxruntimes(&python, &refkit("models/gpt2_tiny.onnx"), &documents(), c);
}

/// A graph whose every position also reads the mean of the sequence's embeddings over
/// the attention mask: padding changes its logits unless the mask hides it.
const MASKED_MEAN_LM: &str = r#"
import sys, numpy as np, onnx
from onnx import helper as h, TensorProto as T, numpy_helper as nh
rng = np.random.default_rng(0)
V, D = 64, 8
g = h.make_graph(
    [h.make_node("Gather", ["emb", "input_ids"], ["e"]),
     h.make_node("Cast", ["attention_mask"], ["m"], to=T.FLOAT),
     h.make_node("Unsqueeze", ["m", "two"], ["m3"]),
     h.make_node("Mul", ["e", "m3"], ["em"]),
     h.make_node("ReduceSum", ["em", "one"], ["s"], keepdims=1),
     h.make_node("ReduceSum", ["m3", "one"], ["n"], keepdims=1),
     h.make_node("Div", ["s", "n"], ["avg"]),
     h.make_node("Add", ["e", "avg"], ["hid"]),
     h.make_node("MatMul", ["hid", "w"], ["logits"])],
    "masked_mean_lm",
    [h.make_tensor_value_info("input_ids", T.INT64, ["b", "l"]),
     h.make_tensor_value_info("attention_mask", T.INT64, ["b", "l"])],
    [h.make_tensor_value_info("logits", T.FLOAT, ["b", "l", V])],
    [nh.from_array(rng.normal(0, 1, (V, D)).astype(np.float32), "emb"),
     nh.from_array(rng.normal(0, 0.5, (D, V)).astype(np.float32), "w"),
     nh.from_array(np.array([1], np.int64), "one"),
     nh.from_array(np.array([2], np.int64), "two")])
onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), sys.argv[1])
print("ok")
"#;

#[test]
fn padded_documents_feed_the_attention_mask_and_lose_what_each_document_alone_does() {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "documents' attention mask") else {
        return;
    };
    let out = tempdir("documents-mask");
    let model = out.join("masked_mean_lm.onnx");
    python_says_ok(&python, MASKED_MEAN_LM, &[model.as_os_str()]);
    let docs: Vec<Vec<i64>> = documents()
        .into_iter()
        .map(|d| d.into_iter().map(|t| t % 64).collect())
        .collect();
    let c = {
        let mut c = gpt2_documents(&out);
        c.model.model_path = model.clone();
        c.model.attention_mask_name = Some("attention_mask".into());
        c.data.batch_size = 6;
        c.data.length_bucket_batches = 1;
        c.train.num_train_steps = 1;
        c
    };
    first_loss_is_onnxruntimes(&python, &model, &docs, c);
}

/// Two data-parallel ranks (threads) of 3 documents each, and two pipeline stages of 3
/// micro-batches, end where one process with 6 documents does: the same documents per
/// update, the loss summed over each rank's (micro-batch's) labels and divided by the
/// update's labels over both ranks.
#[test]
fn two_ranks_or_two_stages_on_documents_end_where_one_process_does() {
    let data: Arc<dyn Dataset> =
        Arc::new(DocumentDataset::from_documents(&documents(), 32, 0).unwrap());
    let (one, two, stages) = (
        tempdir("documents-dp1"),
        tempdir("documents-dp2"),
        tempdir("documents-pp2"),
    );
    launch(
        {
            let mut c = gpt2_documents(&one);
            c.data.batch_size = 6;
            c
        },
        data.clone(),
        None,
    )
    .unwrap();
    launch(
        {
            let mut c = gpt2_documents(&two);
            c.data.batch_size = 3;
            c.parallel.data_parallel_size = 2;
            c
        },
        data.clone(),
        None,
    )
    .unwrap();
    launch(
        {
            let mut c = gpt2_documents(&stages);
            c.data.batch_size = 6;
            c.parallel.pipeline_parallel_size = 2;
            c
        },
        data,
        None,
    )
    .unwrap();
    let file = "gpt2_tiny_trained.onnx";
    for other in [&two, &stages] {
        for ((name, a), (_, b)) in onnx_params(one.join(file))
            .iter()
            .zip(onnx_params(other.join(file)))
        {
            assert_close(&format!("{}: {name}", other.display()), &b, a, 1e-5, 0.0);
        }
    }
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &one.join(file), 1e-3);
}

/// With accumulation the divisor counts the labels of both micro-steps of an update: two
/// ranks of 3 documents accumulating 2 micro-steps end where one process taking the
/// update's 12 documents at once does (without length buckets both draw the same 12
/// documents an update; a divisor of one micro-step's labels would weigh the micro-steps
/// differently and fail).
#[test]
fn accumulated_micro_steps_on_documents_divide_by_the_whole_updates_labels() {
    let data: Arc<dyn Dataset> =
        Arc::new(DocumentDataset::from_documents(&documents(), 32, 0).unwrap());
    let (one, two) = (tempdir("documents-acc-dp1"), tempdir("documents-acc-dp2"));
    for (out, ranks, batch, accumulation) in [(&one, 1, 12, 1), (&two, 2, 3, 2)] {
        let mut c = gpt2_documents(out);
        c.data.length_bucket_batches = 1;
        c.data.batch_size = batch;
        c.parallel.data_parallel_size = ranks;
        c.train.gradient_accumulation_steps = accumulation;
        c.train.num_train_steps = 6 * accumulation;
        launch(c, data.clone(), None).unwrap();
    }
    let file = "gpt2_tiny_trained.onnx";
    for ((name, a), (_, b)) in onnx_params(one.join(file))
        .iter()
        .zip(onnx_params(two.join(file)))
    {
        assert_close(&format!("accumulated: {name}"), &b, a, 1e-5, 0.0);
    }
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &one.join(file), 1e-3);
}
