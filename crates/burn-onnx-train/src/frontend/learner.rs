//! An [`OnnxModel`] under burn-train's `Learner` (feature `learner`): a Burn user trains an
//! ONNX file with Burn's own loop, optimizers, schedulers, metrics and renderer.
//!
//! [`OnnxClassifier`] (cross-entropy over `[batch, classes]` logits: Burn's
//! `ClassificationOutput`, for `LossMetric`, `AccuracyMetric`, ...) and
//! [`OnnxLanguageModel`] (next-token cross-entropy over `[batch, seq, vocab]` logits:
//! `SequenceOutput`, for `LossMetric`, `PerplexityMetric`, ...) implement `TrainStep` and
//! `InferenceStep` on [`Batch`]es of this crate's datasets; [`batches`] turns a
//! [`Dataset`] into the data loader the `Learner` reads, in a given batch order. The forward
//! pass and the loss are the runner's (`train::passes::step`), so the same batches give the same
//! losses and gradients as `onnx-train train`; batch-norm running statistics are updated
//! after each optimizer step, as the runner does.

use std::sync::{Arc, Mutex};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::{ClassificationOutput, InferenceStep, SequenceOutput, TrainOutput, TrainStep};

use crate::model::loss::LossKind;
use crate::model::{Mode, OnnxModel};
use crate::train::data::{Batch, Dataset, Target};
use crate::train::passes::step::{PassSettings, StepOutput, forward_loss_and_output};
use crate::train::precision::Precision;
use crate::value::PhysTensor;
use crate::value::host_tensor::HostTensor;

/// Batch-norm state updates of the last training step, applied after the optimizer's.
type Pending = Arc<Mutex<Vec<(usize, PhysTensor)>>>;

/// The pass settings of a model fed `input` whose `output` the loss reads.
fn settings(input: &str, output: &str, loss: LossKind) -> PassSettings {
    PassSettings {
        input_name: input.into(),
        output_name: output.into(),
        loss,
        label_name: "labels".into(),
        attention_mask_name: None,
        precision: Precision::F32,
        accumulation: 1,
        seed: 0,
    }
}

/// A training-mode forward with its loss; the state updates wait for `optimize`.
fn train_forward(
    model: &OnnxModel,
    settings: &PassSettings,
    pending: &Pending,
    batch: &Batch,
) -> (StepOutput, PhysTensor) {
    let (out, logits) =
        forward_loss_and_output(model, batch, settings, &model.device(), Mode::Train, 0)
            .unwrap_or_else(|e| panic!("ONNX forward pass: {e}"));
    let mut state = pending.lock().expect("pending state");
    *state = out.state_updates.clone();
    (out, logits)
}

/// `model` after the optimizer's step, with the last step's batch-norm state applied.
fn step_and_apply_state(
    model: OnnxModel,
    pending: &Pending,
    optim: &mut ModuleOptimizer,
    lr: ModuleLearningRate,
    grads: GradientsParams,
) -> OnnxModel {
    let model = optim.step(lr, model, grads);
    let state = std::mem::take(&mut *pending.lock().expect("pending state"));
    model.apply_state(state)
}

fn classes(batch: &Batch, device: &Device) -> Tensor<1, Int> {
    let Target::Classes(labels) = &batch.target else {
        panic!("a classifier's batches carry class labels")
    };
    let n = labels.len();
    Tensor::from_data(
        TensorData::new(labels.iter().copied().collect::<Vec<i64>>(), [n]),
        device,
    )
}

/// An ONNX classifier for burn-train: cross-entropy of `output` (`[batch, classes]`)
/// against the batch's class labels.
#[derive(Module, Debug)]
pub struct OnnxClassifier {
    /// The ONNX model.
    pub model: OnnxModel,
    #[module(skip)]
    settings: Arc<PassSettings>,
    #[module(skip)]
    pending: Pending,
}

impl OnnxClassifier {
    /// `model` fed its batches as `input`, its logits read from `output`.
    pub fn new(model: OnnxModel, input: &str, output: &str) -> Self {
        OnnxClassifier {
            model,
            settings: Arc::new(settings(input, output, LossKind::CrossEntropy)),
            pending: Pending::default(),
        }
    }

    fn output(&self, out: StepOutput, logits: PhysTensor, batch: &Batch) -> ClassificationOutput {
        let dims = logits.dims();
        let logits: Tensor<2> = logits.reshape([dims[dims.len() - 2], dims[dims.len() - 1]]);
        let targets = classes(batch, &logits.device());
        ClassificationOutput::new(out.loss, logits, targets)
    }
}

/// An ONNX language model for burn-train: next-token cross-entropy of `output`
/// (`[batch, seq, vocab]`) over token windows.
#[derive(Module, Debug)]
pub struct OnnxLanguageModel {
    /// The ONNX model.
    pub model: OnnxModel,
    #[module(skip)]
    settings: Arc<PassSettings>,
    #[module(skip)]
    pending: Pending,
}

impl OnnxLanguageModel {
    /// `model` fed token windows as `input`, its logits read from `output`.
    pub fn new(model: OnnxModel, input: &str, output: &str) -> Self {
        OnnxLanguageModel {
            model,
            settings: Arc::new(settings(input, output, LossKind::LmCrossEntropy)),
            pending: Pending::default(),
        }
    }

    /// Positions `0..seq-1` of the logits against tokens `1..seq`.
    fn output(&self, out: StepOutput, logits: PhysTensor, batch: &Batch) -> SequenceOutput {
        let dims = logits.dims();
        let (b, t, v) = (
            dims[dims.len() - 3],
            dims[dims.len() - 2],
            dims[dims.len() - 1],
        );
        let logits: Tensor<3> = logits.reshape([b, t, v]).narrow(1, 0, t - 1);
        let HostTensor::Int(ids) = &batch.input else {
            panic!("a language model's batches carry token ids")
        };
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().copied().collect::<Vec<i64>>(), [b, t]),
            &logits.device(),
        );
        SequenceOutput::new(out.loss, logits, None, ids.narrow(1, 1, t - 1))
    }
}

/// `TrainStep` (a training-mode forward, the loss's gradients, Burn's output item; the
/// optimizer's step followed by the batch-norm state) and `InferenceStep` (an
/// evaluation-mode forward) of an adapter with fields `model`, `settings` and `pending`
/// and an `output` method making `$output` from the step, the logits and the batch.
macro_rules! learner_steps {
    ($adapter:ident, $output:ty) => {
        impl TrainStep for $adapter {
            type Input = Batch;
            type Output = $output;

            fn step(&self, batch: Batch) -> TrainOutput<$output> {
                let (out, logits) =
                    train_forward(&self.model, &self.settings, &self.pending, &batch);
                let grads = out.loss.backward();
                let item = self.output(out, logits.detach(), &batch);
                TrainOutput::new(self, grads, item)
            }

            fn optimize(
                self,
                optim: &mut ModuleOptimizer,
                lr: ModuleLearningRate,
                grads: GradientsParams,
            ) -> Self {
                let $adapter {
                    model,
                    settings,
                    pending,
                } = self;
                let model = step_and_apply_state(model, &pending, optim, lr, grads);
                $adapter {
                    model,
                    settings,
                    pending,
                }
            }
        }

        impl InferenceStep for $adapter {
            type Input = Batch;
            type Output = $output;

            fn step(&self, batch: Batch) -> $output {
                let (out, logits) = forward_loss_and_output(
                    &self.model,
                    &batch,
                    &self.settings,
                    &self.model.device(),
                    Mode::Eval,
                    0,
                )
                .unwrap_or_else(|e| panic!("ONNX forward pass: {e}"));
                self.output(out, logits, &batch)
            }
        }
    };
}

learner_steps!(OnnxClassifier, ClassificationOutput);
learner_steps!(OnnxLanguageModel, SequenceOutput);

/// Reads one [`Batch`] of the dataset per item: the item is the batch's sample indices.
struct IndexBatcher(Arc<dyn Dataset>);

impl Batcher<Vec<usize>, Batch> for IndexBatcher {
    fn batch(&self, items: Vec<Vec<usize>>, _device: &Device) -> Batch {
        let indices: Vec<usize> = items.concat();
        self.0
            .batch(&indices)
            .unwrap_or_else(|e| panic!("reading a batch of {} samples: {e}", indices.len()))
    }
}

/// A data loader for the `Learner` yielding `dataset`'s batches of the sample indices in
/// `order`, one batch per entry, in that order (the order `onnx-train train` draws, or any).
pub fn batches(dataset: Arc<dyn Dataset>, order: Vec<Vec<usize>>) -> Arc<dyn DataLoader<Batch>> {
    DataLoaderBuilder::new(IndexBatcher(dataset))
        .batch_size(1)
        .build(InMemDataset::new(order))
}
