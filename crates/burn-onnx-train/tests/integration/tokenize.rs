//! `onnx-train tokenize` against Hugging Face's Python `tokenizers`: the same
//! `tokenizer.json` encodes the same files there, and the shards hold exactly those ids
//! (end-of-document tokens included, across shard boundaries, per file and per line),
//! uint16 for a GPT-2-style byte-level BPE and uint32 for a vocabulary past 65536; the
//! shards load as a token dataset; an unknown `--eos` is an error naming the flag.
#![cfg(feature = "tokenize")]

use super::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_onnx_train::train::data::documents::DocumentDataset;
use burn_onnx_train::train::data::npy::read_npy;
use burn_onnx_train::train::data::{Dataset, TokenDataset};
use burn_onnx_train::value::host_tensor::HostTensor;
use common::*;

/// Writes into `dir`: `bpe.json` (a byte-level BPE trained on the texts, with
/// `<|endoftext|>`), `wide.json` (a word-level vocabulary of 70000 words), the texts
/// `a.txt`, `b.txt`, `w.txt`, and the ids Python's `tokenizers` gives them as `.npy`.
const REFERENCE: &str = r#"
import sys, numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
d = sys.argv[1]
a = "The quick brown fox jumps over the lazy dog.\n\nÜber café naïve résumé 😀 — done.\nlast line without newline"
b = "Second document: numbers 12345 and symbols #@!\n"
open(f"{d}/a.txt", "w", encoding="utf-8").write(a)
open(f"{d}/b.txt", "w", encoding="utf-8").write(b)
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
bpe.train_from_iterator([a, b] * 20, trainer)
bpe.save(f"{d}/bpe.json")
eos = bpe.token_to_id("<|endoftext|>")
enc = lambda t: bpe.encode(t, add_special_tokens=False).ids
per_file = enc(a) + [eos] + enc(b) + [eos]
files_idx = [0, len(enc(a)) + 1, len(per_file)]
per_line, lines_idx = [], [0]
for text in (a, b):
    for line in text.split("\n"):
        if line.strip():
            per_line += enc(line) + [eos]
            lines_idx.append(len(per_line))
np.save(f"{d}/want_files.npy", np.array(per_file, dtype=np.int64))
np.save(f"{d}/want_lines.npy", np.array(per_line, dtype=np.int64))
np.save(f"{d}/want_files_idx.npy", np.array(files_idx, dtype=np.int64))
np.save(f"{d}/want_lines_idx.npy", np.array(lines_idx, dtype=np.int64))
vocab = {f"w{i}": i for i in range(70000)}
vocab["[UNK]"] = 70000
wide = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
wide.pre_tokenizer = pre_tokenizers.Whitespace()
wide.save(f"{d}/wide.json")
open(f"{d}/w.txt", "w").write("w69999 w5 w65536 unknown w0")
np.save(f"{d}/want_wide.npy", np.array(wide.encode("w69999 w5 w65536 unknown w0").ids, dtype=np.int64))
"#;

fn tokenize(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-train"))
        .arg("tokenize")
        .args(args)
        .output()
        .unwrap()
}

/// The shards of `dir` in order (not the document index beside them), widened, and each
/// one's dtype from its `.npy` header.
fn shards(dir: &Path) -> (Vec<i64>, Vec<String>, usize) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.to_string_lossy().ends_with(".idx.npy"))
        .collect();
    files.sort();
    let (mut ids, mut dtypes) = (Vec::new(), Vec::new());
    for f in &files {
        let header = String::from_utf8_lossy(&std::fs::read(f).unwrap()[..128]).to_string();
        let descr = header.split("'descr': '").nth(1).unwrap();
        dtypes.push(descr[..3].to_string());
        let HostTensor::Int(a) = read_npy(f).unwrap() else {
            panic!("{}: integer shard", f.display())
        };
        ids.extend(a.iter().copied());
    }
    (ids, dtypes, files.len())
}

fn want(path: PathBuf) -> Vec<i64> {
    let HostTensor::Int(a) = read_npy(path).unwrap() else {
        panic!("integer reference")
    };
    a.iter().copied().collect()
}

#[test]
fn tokenize_writes_the_ids_of_hugging_face_tokenizers() {
    let Some(python) = python_for("ONNX_TRAIN_PYTHON", "Hugging Face tokenizers") else {
        return;
    };
    let dir = tempdir("tokenize");
    let d = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let status = Command::new(&python)
        .args(["-c", REFERENCE, dir.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(
        status.success(),
        "Python's tokenizers could not write the reference"
    );

    for (mode, out, reference) in [
        (None, "files", "want_files.npy"),
        (Some("--per-line"), "lines", "want_lines.npy"),
    ] {
        let mut args = vec![
            "--tokenizer".to_string(),
            d("bpe.json"),
            "--output".into(),
            d(out),
            "--shard-tokens".into(),
            "7".into(),
            "--eos".into(),
            "<|endoftext|>".into(),
        ];
        args.extend(mode.map(str::to_string));
        args.extend([d("a.txt"), d("b.txt")]);
        let r = tokenize(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let (ids, dtypes, count) = shards(&dir.join(out));
        let want = want(dir.join(reference));
        assert_eq!(ids, want, "{out}: the ids of Python's tokenizers");
        assert_eq!(count, want.len().div_ceil(7), "{out}: shards of 7 tokens");
        assert!(dtypes.iter().all(|t| t == "<u2"), "{out}: {dtypes:?}");
        let data = TokenDataset::load(&dir.join(out), 5).unwrap();
        assert_eq!(data.len(), want.len() / 5);
        // The document starts, as Python counts them, load as documents.
        let idx = reference.replace(".npy", "_idx.npy");
        let starts = self::want(dir.join(out).join("documents.idx.npy"));
        assert_eq!(starts, self::want(dir.join(&idx)), "{out}: document starts");
        let docs = DocumentDataset::load(&dir.join(out), 1024, 0).unwrap();
        assert_eq!(
            docs.len(),
            starts.len() - 1,
            "{out}: one sample per document"
        );
    }

    let r = tokenize(&[
        "--tokenizer",
        &d("wide.json"),
        "--output",
        &d("wide"),
        &d("w.txt"),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (ids, dtypes, _) = shards(&dir.join("wide"));
    assert_eq!(ids, want(dir.join("want_wide.npy")));
    assert!(ids.contains(&69999));
    assert_eq!(dtypes, ["<u4"]);

    let r = tokenize(&[
        "--tokenizer",
        &d("bpe.json"),
        "--output",
        &d("never"),
        "--eos",
        "</s>",
        &d("a.txt"),
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        !r.status.success() && err.contains("--eos") && err.contains("</s>"),
        "{err}"
    );
}
