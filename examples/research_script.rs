//! A research script against the crates, nanoGPT-style: build (or load) a GPT-2 ONNX file,
//! then a plain loop of forward, loss, backward and Burn's AdamW. Everything the runner
//! adds (data parallelism, ZeRO, checkpoints, schedules) is left out on purpose.
//!
//! ```text
//! cargo run --release --example research_script
//! ```
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};
use burn_onnx_train::model::loss::lm_cross_entropy;
use burn_onnx_train::{Mode, OnnxModel, Value};
use ndarray::{Array2, IxDyn};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("research_gpt2.onnx");
    let gpt2 = Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 64,
        vocab_size: 64,
        n_positions: 32,
        ..Default::default()
    };
    write_gpt2(&gpt2, &path)?;
    let device = Device::flex().autodiff();
    let mut model = OnnxModel::load(&path, &device)?;
    let mut optim = AdamWConfig::new().init();
    // A learnable stream: token t+1 follows token t by a fixed rule.
    let ids = Array2::from_shape_fn((8, 32), |(b, t)| ((b * 5 + t * 7) % 64) as i64)
        .into_shape_with_order(IxDyn(&[8, 32]))?;
    for step in 0..30 {
        let out = model.forward(
            vec![("input_ids".into(), Value::Int(ids.clone()))],
            Mode::Train,
        )?;
        let Some(Value::Float(logits)) = out.first().cloned() else {
            return Err("no logits".into());
        };
        let loss = lm_cross_entropy(logits, &ids)?;
        if step % 10 == 0 || step == 29 {
            println!("step {step}: loss {:.4}", loss.clone().into_scalar::<f32>());
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    Ok(())
}
