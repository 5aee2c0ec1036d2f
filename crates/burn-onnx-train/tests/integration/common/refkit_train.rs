//! The kit's training cases (`train/mlp`, `train/gpt2_tiny`): one forward+backward and ten
//! optimizer steps on a given device, against PyTorch's loss, gradients (`grads.npz`) and
//! parameters after 10 updates (`sgd_step10.npz`, `adamw_step10.npz`).

use std::collections::HashMap;

use burn::optim::{
    AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig, momentum::MomentumConfig,
};
use burn::tensor::{Device, Tensor};
use burn_onnx_train::graph::Graph;
use burn_onnx_train::graph::initializer_ties::TieOptions;
use burn_onnx_train::model::ForwardOutput;
use burn_onnx_train::model::loss::{LogitValues, Logits, cross_entropy, lm_cross_entropy};
use burn_onnx_train::value::host_tensor::HostTensor;
use burn_onnx_train::{Mode, OnnxModel, Value};
use ndarray::ArrayD;

use super::*;

/// One of the kit's training cases: its model and batch.
pub struct Case {
    name: &'static str,
    model: &'static str,
    batch: HashMap<String, HostTensor>,
    /// Pad the head to a multiple of this many columns ([`OnnxModel::with_padded_head`]).
    pad_head: Option<usize>,
    /// Leave the head's product to the loss ([`OnnxModel::with_fused_head_loss`]).
    fused_head: bool,
}

impl Case {
    pub fn new(name: &'static str, model: &'static str) -> Self {
        Case {
            name,
            model,
            batch: npz(refkit(&format!("train/{name}/batch.npz"))),
            pad_head: None,
            fused_head: false,
        }
    }

    /// The case with its head's product left to the loss, a block of rows at a time.
    pub fn with_fused_head_loss(self) -> Self {
        Case {
            fused_head: true,
            ..self
        }
    }

    /// The case with its head padded to a multiple of `multiple` columns.
    pub fn with_padded_head(self, multiple: usize) -> Self {
        Case {
            pad_head: Some(multiple),
            ..self
        }
    }

    /// The kit's model with every initializer a parameter of its own: its references train
    /// GPT-2's folded `lm_head` copy apart from the embedding (refkit README, as
    /// onnxruntime-training does), so duplicates are reported, not tied.
    pub fn load(&self, device: &Device) -> OnnxModel {
        let path = refkit(&format!("models/{}.onnx", self.model));
        let ties = TieOptions {
            tie_duplicates: false,
            ..TieOptions::default()
        };
        let model = OnnxModel::from_graph(Graph::load_with(path, ties).unwrap(), device).unwrap();
        let output = model.graph().outputs[0].name.clone();
        let model = match self.pad_head {
            Some(multiple) => {
                let model = model.with_padded_head(&output, multiple);
                let head = model.padded_head().expect("the head is padded");
                assert_eq!(head.padded, head.classes.next_multiple_of(multiple));
                assert!(head.padded > head.classes, "{}: nothing to pad", self.name);
                model
            }
            None => model,
        };
        if !self.fused_head {
            return model;
        }
        let (model, fused) = model.with_fused_head_loss(&output);
        assert!(
            fused,
            "{}: the head is a MatMul only the loss reads",
            self.name
        );
        model
    }

    /// The forward's first output as the logits a loss reads: the classes of a padded
    /// head, whose logits are checked to be that wide.
    /// A head left to the loss gives its operands instead, its output left out.
    fn logits(out: ForwardOutput) -> Logits {
        let classes = out.padded_logits.as_ref().map(|h| h.classes);
        let value = match out.fused_head {
            Some(head) => {
                assert!(out.outputs.iter().all(|(name, _)| *name != head.output));
                LogitValues::Fused(head)
            }
            None => {
                let Some(Value::Float(value)) = out.outputs.first().map(|(_, v)| v.clone()) else {
                    panic!("the first output is not float logits")
                };
                LogitValues::Written(value)
            }
        };
        if let Some(head) = &out.padded_logits {
            assert_eq!(value.shape().last(), Some(&head.padded));
        }
        Logits {
            value,
            sharded: None,
            classes,
            uploads: out.uploads,
        }
    }

    /// Forward and the kit's loss (mean cross-entropy; next-token for GPT-2).
    fn loss(&self, model: &OnnxModel, device: &Device) -> Tensor<1> {
        if self.name == "mlp" {
            let x = Value::from_host(&self.batch["input"], device).unwrap();
            let out = model
                .forward(vec![("input".into(), x)], Mode::Train)
                .unwrap();
            cross_entropy(Self::logits(out), int(&self.batch["target"])).unwrap()
        } else {
            let ids = int(&self.batch["input_ids"]).clone();
            let out = model
                .forward(
                    vec![("input_ids".into(), Value::Int(ids.clone()))],
                    Mode::Train,
                )
                .unwrap();
            lm_cross_entropy(Self::logits(out), &ids).unwrap()
        }
    }

    fn params(&self, model: &OnnxModel) -> HashMap<String, ArrayD<f32>> {
        model
            .param_infos()
            .iter()
            .enumerate()
            .map(|(i, info)| {
                (
                    info.name.clone(),
                    model.param_value(i).unwrap().to_array().unwrap(),
                )
            })
            .collect()
    }
}

/// An evaluation pass on `device` (no autodiff): the kit's loss within `loss_tol` of
/// PyTorch's (the kit's models have no dropout), through the head left to the loss when
/// the case asks for it.
pub fn check_eval_loss(case: Case, device: &Device, loss_tol: f32) {
    let model = case.load(device);
    let ids = int(&case.batch["input_ids"]).clone();
    let out = model
        .forward(
            vec![("input_ids".into(), Value::Int(ids.clone()))],
            Mode::Eval,
        )
        .unwrap();
    assert_eq!(
        out.fused_head.is_some(),
        case.fused_head,
        "{}: the head",
        case.name
    );
    assert!(
        out.fused_head.iter().all(|h| !h.gradients),
        "evaluation wants no gradient"
    );
    let got = scalar(lm_cross_entropy(Case::logits(out), &ids).unwrap());
    let want = losses(case.name)["loss0"].as_f64().unwrap() as f32;
    assert!(
        (got - want).abs() < loss_tol,
        "{}: eval loss {got} vs {want}",
        case.name
    );
}

fn scalar(t: Tensor<1>) -> f32 {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()[0]
}

/// One forward+backward on `device` (with autodiff): the loss within `loss_tol` of
/// PyTorch's, every gradient within `grad_tol`.
pub fn check_gradients(case: Case, device: &Device, loss_tol: f32, grad_tol: f32) {
    let device = device.clone().autodiff();
    let model = case.load(&device);
    let loss = case.loss(&model, &device);
    let want_loss = losses(case.name)["loss0"].as_f64().unwrap() as f32;
    let got_loss = scalar(loss.clone());
    assert!(
        (got_loss - want_loss).abs() < loss_tol,
        "{}: loss {got_loss} vs {want_loss}",
        case.name
    );
    let grads = loss.backward();
    let got = model.param_grads(&grads);
    let want = npz(refkit(&format!("train/{}/grads.npz", case.name)));
    assert_eq!(got.len(), want.len(), "every initializer gets a gradient");
    for (name, g) in got {
        let w = float(
            want.get(&name)
                .unwrap_or_else(|| panic!("no reference gradient for {name}")),
        );
        assert_close(
            &format!("{}: grad {name}", case.name),
            &g.to_array().unwrap(),
            w,
            grad_tol,
            0.0,
        );
    }
}

/// Train 10 steps on `device`; each step's loss within `loss_tol` of PyTorch's, the final
/// parameters within `atol`.
pub fn check_trajectory(
    case: Case,
    device: &Device,
    optim: ModuleOptimizer,
    lr: f64,
    key: &str,
    loss_tol: f64,
    atol: f32,
) {
    check_trajectory_within(
        case,
        device,
        optim,
        lr,
        key,
        loss_tol,
        atol,
        (1e-6, atol.max(1e-4)),
    );
}

/// [`check_trajectory`] with the elements of small step-0 gradient held to their own
/// tolerance (see [`assert_close_where_grad_within`]).
#[allow(clippy::too_many_arguments)]
pub fn check_trajectory_within(
    case: Case,
    device: &Device,
    mut optim: ModuleOptimizer,
    lr: f64,
    key: &str,
    loss_tol: f64,
    atol: f32,
    tiny: (f32, f32),
) {
    let device = device.clone().autodiff();
    let mut model = case.load(&device);
    let want_losses: Vec<f64> = losses(case.name)[format!("{key}_losses")]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    for (step, want) in want_losses.iter().enumerate() {
        let loss = case.loss(&model, &device);
        let got = scalar(loss.clone());
        assert!(
            (got as f64 - want).abs() < loss_tol,
            "{} {key} step {step}: loss {got} vs {want}",
            case.name
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    let want = npz(refkit(&format!("train/{}/{key}_step10.npz", case.name)));
    let grads0 = npz(refkit(&format!("train/{}/grads.npz", case.name)));
    let got = case.params(&model);
    for (name, w) in &want {
        assert_close_where_grad_within(
            &format!("{} {key} step 10: {name}", case.name),
            &got[name],
            float(w),
            float(&grads0[name]),
            atol,
            tiny,
        );
    }
}

pub fn sgd() -> ModuleOptimizer {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig {
            momentum: 0.9,
            dampening: 0.0,
            nesterov: false,
        }))
        .init()
}

pub fn adamw() -> ModuleOptimizer {
    AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(0.01)
        .init()
}
