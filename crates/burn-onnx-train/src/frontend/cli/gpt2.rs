//! `onnx-train gpt2`: a GPT-2 with random weights written as an ONNX file.

use std::path::PathBuf;

use crate::error::OnnxError;
use crate::frontend::builders::gpt2::{Gpt2Config, write_gpt2};

/// `onnx-train gpt2`'s arguments.
#[derive(clap::Args)]
pub struct Gpt2Args {
    /// The ONNX file to write.
    #[arg(long)]
    output: PathBuf,
    /// Layers.
    #[arg(long, default_value_t = 12)]
    layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// Width.
    #[arg(long, default_value_t = 768)]
    width: usize,
    /// Vocabulary.
    #[arg(long, default_value_t = 50257)]
    vocab: usize,
    /// Positions.
    #[arg(long, default_value_t = 1024)]
    positions: usize,
    /// Seed of the weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Separate q_proj/k_proj/v_proj projections instead of the fused c_attn (the
    /// layout of LLaMA- and BERT-style exports).
    #[arg(long)]
    separate_qkv: bool,
}

/// `onnx-train gpt2`: the model written to `--output`.
pub fn run(args: Gpt2Args) -> Result<(), OnnxError> {
    let Gpt2Args {
        output,
        layers,
        heads,
        width,
        vocab,
        positions,
        seed,
        separate_qkv,
    } = args;
    gpt2(
        output,
        Gpt2Config {
            n_layer: layers,
            n_head: heads,
            n_embd: width,
            vocab_size: vocab,
            n_positions: positions,
            seed,
            separate_qkv,
            ..Default::default()
        },
    )
}

fn gpt2(output: PathBuf, config: Gpt2Config) -> Result<(), OnnxError> {
    write_gpt2(&config, &output)?;
    println!(
        "wrote {} ({} layers, width {}, vocab {})",
        output.display(),
        config.n_layer,
        config.n_embd,
        config.vocab_size
    );
    Ok(())
}
