//! `onnx-train tokenize`: text files into token shards with a Hugging Face tokenizer.

use std::path::PathBuf;

use crate::error::OnnxError;
use crate::frontend::tokenize::{TokenizeOptions, tokenize};

/// `onnx-train tokenize`'s arguments.
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// The tokenizer (Hugging Face's `tokenizer.json`).
    #[arg(long)]
    tokenizer: PathBuf,
    /// Where the shards go (the directory `train_data_dir` then names).
    #[arg(long, value_name = "DIR")]
    output: PathBuf,
    /// Tokens per shard (the last one may hold fewer).
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: usize,
    /// Each non-empty line is a document (default: each file is one).
    #[arg(long)]
    per_line: bool,
    /// A token appended after every document, e.g. "<|endoftext|>" for GPT-2.
    #[arg(long, value_name = "TOKEN")]
    eos: Option<String>,
    /// The text files, in stream order.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

/// `onnx-train tokenize`: the shards written, a line saying how many of what.
pub fn run(args: TokenizeArgs) -> Result<(), OnnxError> {
    let TokenizeArgs {
        tokenizer,
        output,
        shard_tokens,
        per_line,
        eos,
        files,
    } = args;
    let s = tokenize(&TokenizeOptions {
        tokenizer,
        files,
        output,
        shard_tokens,
        per_line,
        eos,
    })?;
    println!(
        "{} documents, {} tokens ({}) in {} shard(s) under {}",
        s.documents,
        s.tokens,
        s.dtype,
        s.shards.len(),
        s.shards
            .first()
            .and_then(|p| p.parent())
            .map(|d| d.display().to_string())
            .unwrap_or_default()
    );
    Ok(())
}
