//! [`OnnxModel`]: an ONNX graph as a trainable Burn [`Module`].
//!
//! Float initializers become [`Param`]s, keyed by their ONNX names; an initializer read by
//! several nodes (a tied embedding) is one parameter. Which of them train follows the rule
//! in [`crate::model::trainability`]: weights train, while scalars, graph constants and batch-norm
//! running statistics are parameters that never require gradients (saved and exported like
//! weights). Float initializers read only as settings (Resize scales, Clip bounds, shapes)
//! and integer/bool initializers stay host constants.
//! The graph itself is immutable and shared. `forward` interprets it node by node with Burn
//! tensor ops, so autodiff gives a gradient for every trainable initializer.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use burn::module::{Module, Param, ParamId};
use burn::tensor::Gradients;
use burn::tensor::{Device, FloatDType, TensorData};

use crate::collective::grad_hooks::{GradSink, SinkRef};
use crate::collective::prefetch::{PrefetchTimes, prefetched};
use crate::collective::vocab::{ShardedLogits, VocabShard};
use crate::collective::{Collectives, grad_hooks};
use crate::error::{OnnxError, OpError, Result};
use crate::graph::attributes::Attr;
use crate::graph::initializer::Initializer;
use crate::graph::{Dim, Graph, TensorInfo, ValueKind};
use crate::model::profile::NodeProfiler;
use crate::model::trainability::{DefaultRole, Usage};
use crate::ops::{Inputs, OpContext, PassMemo};
use crate::util::seeds::mix_seed;
use crate::value::host_tensor::{HostTensor, dtype, into_row_major_vec};
use crate::value::uploads::DeviceUploads;
use crate::value::{FloatValue, PhysTensor, Value, padded};

use file_tensor::file_tensor;
pub use fused_head_loss::HeadOperands;
pub use padded_head::PaddedHead;
use shape_folds::{FoldKey, FoldPass, ShapeFolds};
pub use sharded::{ChunkPlace, ChunkStore, Settled, Sharding};
pub use tensor_parallel::Probe;

mod activation_precision;
mod file_tensor;
mod fused_head_loss;
mod head_precision;
pub mod loss;
pub mod named_store;
pub mod padded_head;
mod param_file;
pub mod profile;
mod shape_folds;
mod sharded;
pub mod stage;
mod tensor_parallel;
pub mod trainability;
pub mod vjp;

/// What a parameter is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamRole {
    /// Trained by the optimizer.
    Trainable,
    /// Excluded from training by the user (weights_not_to_train).
    Frozen,
    /// Updated by the forward pass, not by gradients (batch-norm running statistics).
    State,
    /// A graph constant by the default rule (scalars, values no gradient reaches); trained
    /// only when named in weights_to_train.
    Constant,
}

impl ParamRole {
    /// Lower-case name, as `inspect` prints it.
    pub fn name(self) -> &'static str {
        match self {
            ParamRole::Trainable => "trainable",
            ParamRole::Frozen => "frozen",
            ParamRole::State => "state",
            ParamRole::Constant => "constant",
        }
    }
}

/// Description of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// ONNX initializer name.
    pub name: String,
    /// Logical shape.
    pub shape: Vec<usize>,
    /// Role.
    pub role: ParamRole,
    /// Why it has that role (e.g. `scalar or one-element tensor`).
    pub reason: &'static str,
}

/// An initializer the model holds as a host constant (never trained), for `inspect`.
#[derive(Debug, Clone, PartialEq)]
pub struct ConstantInfo {
    /// ONNX initializer name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Why it is a constant.
    pub reason: &'static str,
}

/// Where a graph edge that is not computed by a node comes from.
#[derive(Debug, Clone)]
enum Source {
    Param(usize),
    Constant(HostTensor),
}

/// The immutable part of a model: graph plus parameter table.
#[derive(Debug, Clone)]
struct Spec {
    graph: Arc<Graph>,
    params: Vec<ParamInfo>,
    constants: Vec<ConstantInfo>,
    sources: HashMap<String, Source>,
    /// The device the model was loaded onto: where a model without parameters computes.
    device: Device,
    /// ZeRO-3: the parameters hold only this rank's chunk (see [`sharded`]).
    sharding: Option<Sharding>,
    /// ZeRO-3 with the chunks on disk: the file they live in.
    param_file: Option<Arc<param_file::ParamFile>>,
    /// The groups its collective ops run on ([`OnnxModel::with_collectives`]).
    collectives: Collectives,
    /// A tensor-parallel rank's slice of the logits, when the head is split along the
    /// vocabulary ([`OnnxModel::with_vocab_shard`]).
    vocab_shard: Option<VocabShard>,
    /// The head widened to aligned columns ([`OnnxModel::with_padded_head`]).
    padded_head: Option<PaddedHead>,
    /// ZeRO-3: parameters gathered ahead of their first reader ([`OnnxModel::with_prefetch`]).
    prefetch: usize,
    /// The time its passes' prefetching took ([`OnnxModel::take_prefetch_times`]).
    prefetch_times: Arc<PrefetchTimes>,
    /// Where its training-mode passes record their node times ([`OnnxModel::with_profiler`]).
    profiler: Option<Arc<NodeProfiler>>,
    /// Where its training-mode passes hand each parameter's final gradient
    /// ([`OnnxModel::with_grad_sink`]).
    grad_sink: Option<SinkRef>,
    /// Values that depend only on the inputs' shapes, made once per shape
    /// ([`shape_folds`]).
    folds: ShapeFolds,
    /// Device copies of the host values its passes upload, by content
    /// ([`DeviceUploads`]).
    uploads: Arc<DeviceUploads>,
}

/// Forward mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Dropout active, batch norm on batch statistics (running statistics updated).
    Train,
    /// Deterministic inference.
    Eval,
}

/// Result of a forward pass.
pub struct ForwardOutput {
    /// Graph outputs, in the graph's order.
    pub outputs: Vec<(String, Value)>,
    /// New values for state parameters (by parameter index), to apply with
    /// [`OnnxModel::apply_state`] after the optimizer step.
    pub state_updates: Vec<(usize, PhysTensor)>,
    /// The output holding this rank's slice of the logits, when the head is split along
    /// the vocabulary: a loss reads it with [`ShardedLogits`].
    pub sharded_logits: Option<ShardedLogits>,
    /// The output holding logits wider than their classes (a padded head): a loss reads
    /// only the first [`PaddedHead::classes`] columns of each row.
    pub padded_logits: Option<PaddedHead>,
    /// The operands of a head left to the loss (its output is not among
    /// [`Self::outputs`]; `model::fused_head_loss`).
    pub fused_head: Option<HeadOperands>,
    /// The model's device copies of host values, for the loss's targets and weights.
    pub uploads: Arc<DeviceUploads>,
}

impl ForwardOutput {
    /// The output with this name.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.outputs.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The first graph output.
    pub fn first(&self) -> Option<&Value> {
        self.outputs.first().map(|(_, v)| v)
    }
}

/// An ONNX model whose float initializers are trainable Burn parameters.
#[derive(Module, Debug)]
pub struct OnnxModel {
    /// Parameter tensors, stored at the interpreter's physical rank.
    params: Vec<Param<PhysTensor>>,
    #[module(skip)]
    spec: Arc<Spec>,
}

impl OnnxModel {
    /// This model with `nodes` marked with the flag attribute `attr` (an `Int` 1: how the
    /// plan tells an op to take a fused path), and how many.
    pub(crate) fn with_mark(mut self, nodes: &[usize], attr: &str) -> (OnnxModel, usize) {
        if nodes.is_empty() {
            return (self, 0);
        }
        let mut graph = self.graph().clone();
        for &node in nodes {
            graph.nodes[node].attrs.set(attr, Attr::Int(1));
        }
        self.spec = Arc::new(Spec {
            graph: Arc::new(graph),
            ..(*self.spec).clone()
        });
        (self, nodes.len())
    }

    /// This model with the MatMul head producing graph output `output` ([`Self::matmul_head`])
    /// marked with the flag attribute `attr`, and whether it has one.
    pub(crate) fn with_head_mark(self, output: &str, attr: &str) -> (OnnxModel, bool) {
        let Some(head) = self.matmul_head(output) else {
            return (self, false);
        };
        let (model, marked) = self.with_mark(&[head.node], attr);
        (model, marked == 1)
    }

    /// The device copies of host values its passes upload ([`DeviceUploads`]).
    pub fn uploads(&self) -> &Arc<DeviceUploads> {
        &self.spec.uploads
    }

    /// `output`'s head ([`head_of`](crate::graph::head::head_of)) when it is a MatMul (a
    /// Gemm adds its bias after the product).
    pub(crate) fn matmul_head(&self, output: &str) -> Option<crate::graph::head::Head> {
        crate::graph::head::head_of(self.graph(), output, |_| true)
            .filter(|h| self.graph().nodes[h.node].op_type == "MatMul")
    }

    /// Build from a checked graph.
    ///
    /// The initializer data moves into the parameters and constants: the graph the model
    /// keeps has an empty `initializers` list and no data in its protobuf's parameter
    /// initializers (export writes the parameters' current values there), so a model holds
    /// its weights once, not three times. Parameters of initializers left in the file
    /// ([`crate::graph::initializer::Initializer::Mapped`]) read it in place until written
    /// (`model/file_tensor.rs`).
    pub fn from_graph(mut graph: Graph, device: &Device) -> Result<Self> {
        let usage = Usage::of(&graph);
        let mut params = Vec::new();
        let mut infos = Vec::new();
        let mut constants = Vec::new();
        let mut sources = HashMap::new();
        for (name, t) in std::mem::take(&mut graph.initializers) {
            let shape = t.shape().to_vec();
            let (role, reason) = match usage.default_role(&name, &t) {
                DefaultRole::HostConstant(reason) => {
                    constants.push(ConstantInfo {
                        name: name.clone(),
                        shape,
                        reason,
                    });
                    sources.insert(name, Source::Constant(t.into_host()));
                    continue;
                }
                DefaultRole::Trainable => (ParamRole::Trainable, "weight"),
                DefaultRole::State => (ParamRole::State, "batch-norm running statistic"),
                DefaultRole::Constant(reason) => (ParamRole::Constant, reason),
            };
            let phys = padded(&shape)
                .map_err(|e| OnnxError::field(format!("initializer '{name}'"), e.0))?;
            let tensor = match t {
                Initializer::Mapped { data, .. } => file_tensor(&data, phys.to_vec(), device),
                Initializer::Host(HostTensor::Float(a)) => PhysTensor::from_data(
                    TensorData::new(into_row_major_vec(a), phys.to_vec()),
                    device,
                ),
                Initializer::Host(_) => {
                    unreachable!("default_role keeps non-float tensors on the host")
                }
            };
            let mut param =
                Param::from_tensor(tensor).set_require_grad(role == ParamRole::Trainable);
            param.id = stable_param_id(&name);
            sources.insert(name.clone(), Source::Param(params.len()));
            params.push(param);
            infos.push(ParamInfo {
                name,
                shape,
                role,
                reason,
            });
        }
        if let Some(g) = graph.model.graph.as_mut() {
            for init in g
                .initializer
                .iter_mut()
                .filter(|i| matches!(sources.get(&i.name), Some(Source::Param(_))))
            {
                init.raw_data = Default::default();
                init.float_data.clear();
                init.double_data.clear();
                init.int32_data.clear();
            }
        }
        for (name, t) in &graph.constants {
            sources.insert(name.clone(), Source::Constant(t.clone()));
        }
        Ok(OnnxModel {
            params,
            spec: Arc::new(Spec {
                graph: Arc::new(graph),
                params: infos,
                constants,
                sources,
                device: device.clone(),
                sharding: None,
                param_file: None,
                collectives: Collectives::default(),
                vocab_shard: None,
                padded_head: None,
                prefetch: 0,
                prefetch_times: Arc::default(),
                profiler: None,
                grad_sink: None,
                folds: ShapeFolds::default(),
                uploads: Arc::default(),
            }),
        })
    }

    /// The checked graph.
    pub fn graph(&self) -> &Graph {
        &self.spec.graph
    }

    /// Parameter descriptions, in initializer order.
    pub fn param_infos(&self) -> &[ParamInfo] {
        &self.spec.params
    }

    /// Index of the parameter with this ONNX name.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        match self.spec.sources.get(name) {
            Some(Source::Param(i)) => Some(*i),
            _ => None,
        }
    }

    /// The value of a parameter in its logical ONNX shape (of a ZeRO-3 model, this rank's
    /// chunk as a vector: see [`Self::unsharded`]).
    pub fn param_value(&self, index: usize) -> Option<FloatValue> {
        let p = self.params.get(index)?;
        Some(FloatValue::new(p.val(), self.stored_rank(index)))
    }

    /// The index of parameter `name`, or an error naming it.
    pub fn require_param(&self, name: &str) -> Result<usize> {
        self.param_index(name).ok_or_else(|| {
            OnnxError::field(format!("parameter '{name}'"), "no such float initializer")
        })
    }

    /// The value of a parameter by ONNX name.
    pub fn param_by_name(&self, name: &str) -> Option<FloatValue> {
        self.param_value(self.param_index(name)?)
    }

    /// The parameter objects (for optimizers, gradients and records).
    pub fn params(&self) -> &[Param<PhysTensor>] {
        &self.params
    }

    /// Initializers held as host constants (integer/bool tensors, settings), in file order.
    pub fn constant_infos(&self) -> &[ConstantInfo] {
        &self.spec.constants
    }

    /// ORT's weights_to_train / weights_not_to_train. When `to_train` is not empty, exactly
    /// the parameters it names train (graph constants included: this overrides the default
    /// rule); otherwise the default rule's trainable set. Parameters named in
    /// `not_to_train` are frozen. State parameters never train. A name that is not a float
    /// parameter is an error naming it and the field (`to_train_field` / `not_to_train_field`).
    pub fn select_trainable(
        mut self,
        to_train: &[String],
        not_to_train: &[String],
        fields: (&str, &str),
    ) -> Result<Self> {
        for (list, field) in [(to_train, fields.0), (not_to_train, fields.1)] {
            for name in list {
                match self.spec.sources.get(name) {
                    Some(Source::Param(i)) if self.spec.params[*i].role == ParamRole::State => {
                        return Err(OnnxError::field(
                            field,
                            format!(
                                "'{name}' is a batch-norm running statistic, updated by the forward pass, not trained"
                            ),
                        ));
                    }
                    Some(Source::Param(_)) => {}
                    Some(Source::Constant(_)) => {
                        let reason = self
                            .spec
                            .constants
                            .iter()
                            .find(|c| &c.name == name)
                            .map_or("constant", |c| c.reason);
                        return Err(OnnxError::field(
                            field,
                            format!("'{name}' cannot be trained: {reason}"),
                        ));
                    }
                    None => {
                        return Err(OnnxError::field(
                            field,
                            format!("'{name}' is not an initializer of the model"),
                        ));
                    }
                }
            }
        }
        let mut spec_params = self.spec.params.clone();
        let params = std::mem::take(&mut self.params);
        self.params = params
            .into_iter()
            .zip(spec_params.iter_mut())
            .map(|(p, info)| {
                if info.role == ParamRole::State {
                    return p;
                }
                (info.role, info.reason) = if not_to_train.contains(&info.name) {
                    (ParamRole::Frozen, "weights_not_to_train")
                } else if to_train.contains(&info.name) {
                    (ParamRole::Trainable, "weights_to_train")
                } else if !to_train.is_empty() {
                    (ParamRole::Frozen, "not in weights_to_train")
                } else {
                    (info.role, info.reason)
                };
                p.set_require_grad(info.role == ParamRole::Trainable)
            })
            .collect();
        let spec = Spec {
            params: spec_params,
            ..(*self.spec).clone()
        };
        self.spec = Arc::new(spec);
        Ok(self)
    }

    /// Replace parameter values by name (shapes must match); unknown names and wrong
    /// shapes are errors naming the parameter.
    pub fn set_params(mut self, values: &HashMap<String, FloatValue>) -> Result<Self> {
        for (name, v) in values {
            let i = self.require_param(name)?;
            let want = &self.spec.params[i].shape;
            if &v.shape() != want {
                return Err(OnnxError::field(
                    format!("parameter '{name}'"),
                    format!("shape {:?}, model has {want:?}", v.shape()),
                ));
            }
            // A fresh untracked tensor: `v` may be a tracked parameter or a non-leaf of
            // another graph (a parameter reshaped to its logical shape).
            let t = self.stored(PhysTensor::from_inner(v.tensor.clone().inner()));
            let p = std::mem::replace(&mut self.params[i], Param::from_tensor(t.clone()));
            let (id, old, _) = p.consume();
            let (require, device) = (old.is_require_grad(), old.device());
            // The old value goes first: a chunk on disk is then written back in place.
            drop(old);
            self.params[i] = Param::initialized(id, t.to_device(&device).set_require_grad(require));
            self.settle_replaced(i)?;
        }
        Ok(self)
    }

    /// Gradients of the trainable parameters, by ONNX name, in their logical shapes (of a
    /// ZeRO-3 model, this rank's chunks).
    pub fn param_grads(&self, grads: &Gradients) -> Vec<(String, FloatValue)> {
        (0..self.params.len())
            .filter(|&i| self.spec.params[i].role == ParamRole::Trainable)
            .filter_map(|i| {
                let g = self.params[i].val().grad(grads)?;
                Some((
                    self.spec.params[i].name.clone(),
                    FloatValue::new(g, self.stored_rank(i)),
                ))
            })
            .collect()
    }

    /// Apply state updates returned by a training-mode forward pass.
    pub fn apply_state(mut self, updates: Vec<(usize, PhysTensor)>) -> Self {
        for (i, t) in updates {
            let t = self.stored(t);
            let p = std::mem::replace(&mut self.params[i], Param::from_tensor(t.clone()));
            let (id, _, _) = p.consume();
            self.params[i] = Param::initialized(id, t.detach().set_require_grad(false));
        }
        self
    }

    /// State updates given by parameter name (from a part of this model, see
    /// [`Self::into_stage`]).
    pub fn apply_named_state(self, updates: Vec<(String, PhysTensor)>) -> Result<Self> {
        let indexed = updates
            .into_iter()
            .map(|(name, t)| {
                self.param_index(&name).map(|i| (i, t)).ok_or_else(|| {
                    OnnxError::field(
                        format!("parameter '{name}'"),
                        "a state update for a parameter the model lacks",
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.apply_state(indexed))
    }

    /// The same model with untracked parameters: its forward passes record no autodiff
    /// tape (no gradients, no saved activations).
    pub fn untracked(&self) -> OnnxModel {
        let params = self
            .params
            .iter()
            .map(|p| Param::initialized(p.id, PhysTensor::from_inner(p.val().inner())))
            .collect();
        OnnxModel {
            params,
            spec: self.spec.clone(),
        }
    }

    /// The same model with its training-mode passes (and its clones', stages' and
    /// segments') recording their node times into `profiler`.
    pub fn with_profiler(mut self, profiler: Arc<NodeProfiler>) -> OnnxModel {
        self.spec = Arc::new(Spec {
            profiler: Some(profiler),
            ..(*self.spec).clone()
        });
        self
    }

    /// The same model with its training-mode passes reading each parameter through a
    /// gradient hook ([`grad_hooks`]) that hands the final gradient to `sink`.
    pub fn with_grad_sink(mut self, sink: Arc<dyn GradSink>) -> OnnxModel {
        self.spec = Arc::new(Spec {
            grad_sink: Some(SinkRef(sink)),
            ..(*self.spec).clone()
        });
        self
    }

    /// The device the model computes on: its parameters' (for a model with none, or with
    /// ZeRO-3's chunks in host memory, the device it was loaded onto, tracked as the
    /// parameters are).
    pub fn device(&self) -> Device {
        let Some(first) = self.params.first().map(|p| p.val().device()) else {
            return self.spec.device.clone();
        };
        match self.spec.sharding {
            Some(s) if s.off_device() && first.is_autodiff() => self.spec.device.clone(),
            Some(s) if s.off_device() => self.spec.device.clone().inner(),
            _ => first,
        }
    }

    /// The mode Burn's module state implies, for code that gives none (burn-train's
    /// `Learner` trains the autodiff module and validates its `valid()` copy): `Train` when
    /// the parameters live on an autodiff device, `Eval` otherwise.
    pub fn default_mode(&self) -> Mode {
        if self.device().is_autodiff() {
            Mode::Train
        } else {
            Mode::Eval
        }
    }

    /// [`OnnxModel::forward`] in [`OnnxModel::default_mode`].
    pub fn forward_default(&self, inputs: Vec<(String, Value)>) -> Result<ForwardOutput> {
        self.forward(inputs, self.default_mode())
    }

    /// Run the graph. `inputs` maps graph input names to values. Randomness (training-mode
    /// dropout) uses seed 0: see [`OnnxModel::forward_seeded`].
    pub fn forward(&self, inputs: Vec<(String, Value)>, mode: Mode) -> Result<ForwardOutput> {
        self.forward_seeded(inputs, mode, 0)
    }

    /// Run the graph with the random streams of this pass derived from `seed` (each node's
    /// dropout mask is a pure function of `seed` and the node's index).
    pub fn forward_seeded(
        &self,
        inputs: Vec<(String, Value)>,
        mode: Mode,
        seed: u64,
    ) -> Result<ForwardOutput> {
        self.forward_with(inputs, mode, seed, None)
    }

    /// [`Self::forward_seeded`] with MatMul, Gemm, Conv and ConvTranspose computed in
    /// `autocast` (f16 or bf16; their results come back as f32), as PyTorch's autocast.
    pub fn forward_with(
        &self,
        inputs: Vec<(String, Value)>,
        mode: Mode,
        seed: u64,
        autocast: Option<FloatDType>,
    ) -> Result<ForwardOutput> {
        let graph = &self.spec.graph;
        let device = self.device();
        let mut env: HashMap<String, Value> = HashMap::new();
        for (name, v) in inputs {
            let info = graph
                .inputs
                .iter()
                .find(|i| i.name == name)
                .ok_or_else(|| {
                    OnnxError::field(
                        format!("input '{name}'"),
                        format!(
                            "the graph has no such input (inputs: {})",
                            input_names(&graph.inputs)
                        ),
                    )
                })?;
            check_input(info, &v)?;
            env.insert(name, v);
        }
        // An optional input not given is the empty optional: its readers see it absent.
        let mut absent = std::collections::HashSet::new();
        for info in &graph.inputs {
            if !env.contains_key(&info.name) {
                if !info.optional {
                    return Err(OnnxError::field(
                        format!("input '{}'", info.name),
                        "not provided",
                    ));
                }
                absent.insert(info.name.as_str());
            }
        }
        let mut run = |collectives: &Collectives| {
            self.run_nodes(&mut env, &absent, mode, seed, autocast, collectives)
        };
        let state_updates = match self.prefetch_plan() {
            Some((group, chunks)) => prefetched(
                &group,
                chunks,
                self.spec.prefetch,
                &self.spec.prefetch_times,
                |g| {
                    run(&Collectives {
                        sharding: Some(g.clone()),
                        ..self.spec.collectives.clone()
                    })
                },
            ),
            None => run(&self.spec.collectives),
        }?;
        let fused_head = self.head_operands(&env, &device, autocast, mode == Mode::Train)?;
        let mut outputs = Vec::with_capacity(graph.outputs.len());
        for o in &graph.outputs {
            if fused_head.as_ref().is_some_and(|h| h.output == o.name) {
                continue;
            }
            let v = self
                .fetch(&env, &o.name, &device)
                .map_err(|e| OnnxError::field(format!("graph output '{}'", o.name), e.0))?;
            outputs.push((o.name.clone(), v));
        }
        let sharded_logits = match (
            &self.spec.vocab_shard,
            &self.spec.collectives.tensor_parallel,
        ) {
            (None, _) => None,
            (Some(shard), Some(group)) => Some(ShardedLogits {
                shard: shard.clone(),
                group: group.clone(),
            }),
            (Some(shard), None) => {
                return Err(OnnxError::field(
                    format!("graph output '{}'", shard.output),
                    "it holds one tensor-parallel rank's slice of the vocabulary, but the model has no tensor-parallel group (OnnxModel::with_collectives)",
                ));
            }
        };
        Ok(ForwardOutput {
            outputs,
            state_updates,
            sharded_logits,
            padded_logits: self.spec.padded_head.clone(),
            fused_head,
            uploads: self.spec.uploads.clone(),
        })
    }

    /// Run the graph's nodes on `env` (the inputs; the computed values are left in it),
    /// collective ops on `collectives`: the state updates of a training pass.
    fn run_nodes(
        &self,
        env: &mut HashMap<String, Value>,
        absent: &std::collections::HashSet<&str>,
        mode: Mode,
        seed: u64,
        autocast: Option<FloatDType>,
        collectives: &Collectives,
    ) -> Result<Vec<(usize, PhysTensor)>> {
        let graph = &self.spec.graph;
        let device = self.device();
        let mut state_updates = Vec::new();
        let train = mode == Mode::Train;
        let profiler = self.spec.profiler.as_deref().filter(|_| train);
        let grad_sink = self.spec.grad_sink.as_ref().filter(|_| train);
        let memo = PassMemo::new(self.spec.uploads.clone());
        let mut folds = self.fold_pass(env, absent, autocast);
        for (i, node) in graph.nodes.iter().enumerate() {
            if self.leaves_to_loss(i) {
                // The loss computes this product itself; its inputs stay in `env`.
                continue;
            }
            if folds.skips(i, &node.outputs, env) {
                // Made by an earlier pass of these shapes: it costs this pass nothing.
                if let Some(profiler) = profiler {
                    let (at, zero) = (graph.node_offset + i, std::time::Duration::ZERO);
                    profiler.record(at, &node.name, &node.op_type, zero);
                }
                self.forget_last_reads(env, i, &node.inputs);
                continue;
            }
            let err = |m: String| OnnxError::Node {
                node: node.name.clone(),
                op_type: node.op_type.clone(),
                message: m,
            };
            // ZeRO-3 and gradient hooks: a parameter is read once per pass, at its first
            // reader, and kept with the computed values until its last reader (a tied
            // embedding's two readers share one gather and one hook, so their gradients
            // meet in one reduce-scatter, or one final gradient).
            if self.spec.sharding.is_some() || grad_sink.is_some() {
                for name in &node.inputs {
                    if let (false, Some(Source::Param(p))) =
                        (env.contains_key(name), self.spec.sources.get(name))
                    {
                        let mut whole =
                            self.read_param_on(*p, collectives).map_err(|e| err(e.0))?;
                        if let Some(sink) = grad_sink {
                            whole = FloatValue::new(
                                grad_hooks::hook(whole.tensor, *p, sink),
                                whole.rank,
                            );
                        }
                        env.insert(name.clone(), Value::Float(whole));
                    }
                }
            }
            let mut args = Vec::with_capacity(node.inputs.len());
            for name in &node.inputs {
                args.push(if name.is_empty() || absent.contains(name.as_str()) {
                    None
                } else {
                    Some(self.fetch(env, name, &device).map_err(|e| err(e.0))?)
                });
            }
            crate::ops::refuse_unsupported_kinds(&node.op_type, &args).map_err(|e| err(e.0))?;
            let ctx = OpContext {
                device: &device,
                train: mode == Mode::Train,
                opset: graph.opset,
                attrs: &node.attrs,
                num_outputs: node.outputs.len(),
                seed: mix_seed(seed, (graph.node_offset + i) as u64),
                autocast,
                collectives,
                memo: &memo,
            };
            let started = profiler.map(|p| (p, std::time::Instant::now()));
            let result = catch_unwind(AssertUnwindSafe(|| (node.op)(&ctx, Inputs(args))))
                .unwrap_or_else(|panic| {
                    Err(OpError(format!(
                        "internal error: {}",
                        panic_message(&panic)
                    )))
                });
            if let Some((profiler, started)) = started {
                profiler.record(
                    graph.node_offset + i,
                    &node.name,
                    &node.op_type,
                    started.elapsed(),
                );
            }
            let out = result.map_err(|e| err(e.0))?;
            self.forget_last_reads(env, i, &node.inputs);
            if mode == Mode::Train {
                for (slot, v) in out.state_updates {
                    if let Some(Source::Param(p)) =
                        node.inputs.get(slot).and_then(|n| self.spec.sources.get(n))
                    {
                        state_updates.push((*p, v.tensor));
                    }
                }
            }
            for (name, v) in node.outputs.iter().zip(out.values) {
                if !name.is_empty() {
                    env.insert(name.clone(), v);
                }
            }
            folds.note(i, &node.outputs, env);
        }
        self.spec.folds.keep(folds);
        Ok(state_updates)
    }

    /// How many nodes compute values that depend only on the inputs' shapes, made once per
    /// shape and reused by later passes ([`shape_folds`]).
    pub fn shape_folded_nodes(&self) -> usize {
        let graph = &self.spec.graph;
        let constants = |name: &str| self.is_constant(name);
        self.spec.folds.plan(graph, &constants).count()
    }

    /// The values a pass with these inputs folds ([`shape_folds`]).
    fn fold_pass(
        &self,
        env: &HashMap<String, Value>,
        absent: &std::collections::HashSet<&str>,
        autocast: Option<FloatDType>,
    ) -> FoldPass<'_> {
        let graph = &self.spec.graph;
        let shapes = graph
            .inputs
            .iter()
            .map(|i| match absent.contains(i.name.as_str()) {
                true => None,
                false => env.get(&i.name).map(Value::shape),
            })
            .collect();
        let constants = |name: &str| self.is_constant(name);
        self.spec.folds.pass(
            graph,
            &constants,
            FoldKey {
                shapes,
                autocast,
                device: self.device(),
            },
        )
    }

    /// Whether the value named `name` is a constant of the graph (a `Constant` node's
    /// output, an initializer that is not a parameter).
    fn is_constant(&self, name: &str) -> bool {
        self.spec.graph.constants.contains_key(name)
            || matches!(self.spec.sources.get(name), Some(Source::Constant(_)))
    }

    /// Drop from `env` the inputs node `i` reads last (graph outputs stay).
    fn forget_last_reads(&self, env: &mut HashMap<String, Value>, i: usize, inputs: &[String]) {
        let graph = &self.spec.graph;
        for name in inputs {
            if graph.last_use.get(name) == Some(&i)
                && !graph.outputs.iter().any(|o| &o.name == name)
            {
                env.remove(name);
            }
        }
    }

    fn fetch(
        &self,
        env: &HashMap<String, Value>,
        name: &str,
        device: &Device,
    ) -> std::result::Result<Value, OpError> {
        if let Some(v) = env.get(name) {
            return Ok(v.clone());
        }
        match self.spec.sources.get(name) {
            Some(Source::Param(i)) => Ok(Value::Float(self.read_param(*i)?)),
            Some(Source::Constant(t)) => Value::from_host(t, device),
            None => Err(OpError(format!(
                "value '{name}' was not computed (an optional output this importer does not produce?)"
            ))),
        }
    }
}

/// A parameter id derived from the ONNX initializer name (FNV-1a), so optimizer state saved
/// by one process matches the same parameters when another process loads the model.
pub fn stable_param_id(name: &str) -> ParamId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    ParamId::from(h)
}

fn input_names(infos: &[TensorInfo]) -> String {
    infos
        .iter()
        .map(|i| i.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A fed value against its declared input: a sequence for a sequence (each of its tensors
/// checked), a tensor of the declared type and shape for a tensor.
fn check_input(info: &TensorInfo, v: &Value) -> Result<()> {
    let field = || format!("input '{}'", info.name);
    match (info.kind, v) {
        (ValueKind::Sequence, Value::Sequence(items)) => {
            items.iter().try_for_each(|item| check_tensor(info, item))
        }
        (ValueKind::Sequence, v) => Err(OnnxError::field(
            field(),
            format!("expects a sequence, got a {} tensor", v.kind()),
        )),
        (ValueKind::Tensor, v) => check_tensor(info, v),
    }
}

fn check_tensor(info: &TensorInfo, v: &Value) -> Result<()> {
    let field = || format!("input '{}'", info.name);
    let kind_ok = match v {
        Value::Float(_) => dtype::is_float(info.elem_type),
        Value::Int(_) => dtype::is_int(info.elem_type),
        Value::Bool(_) => info.elem_type == dtype::BOOL,
        Value::Str(_) => info.elem_type == dtype::STRING,
        Value::Sequence(_) => {
            return Err(OnnxError::field(
                field(),
                "expects a tensor, got a sequence",
            ));
        }
    };
    if !kind_ok && info.elem_type != 0 {
        return Err(OnnxError::field(
            field(),
            format!(
                "expects {}, got a {} tensor",
                dtype::name(info.elem_type),
                v.kind()
            ),
        ));
    }
    let shape = v.shape();
    if !info.dims.is_empty() {
        if info.dims.len() != shape.len() {
            return Err(OnnxError::field(
                field(),
                format!("expects rank {}, got shape {shape:?}", info.dims.len()),
            ));
        }
        for (i, (d, &s)) in info.dims.iter().zip(&shape).enumerate() {
            if let Dim::Fixed(f) = d
                && *f != s
            {
                return Err(OnnxError::field(
                    field(),
                    format!("dim {i} must be {f}, got {s} (shape {shape:?})"),
                ));
            }
        }
    }
    Ok(())
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Make a float input value from host data.
pub fn float_input(values: Vec<f32>, shape: &[usize], device: &Device) -> Result<Value> {
    let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), values)
        .map_err(|e| OnnxError::field("input", e.to_string()))?;
    Ok(Value::Float(
        FloatValue::from_array(&a, device).map_err(|e| OnnxError::field("input", e.0))?,
    ))
}

/// Make an integer input value from host data.
pub fn int_input(values: Vec<i64>, shape: &[usize]) -> Result<Value> {
    let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), values)
        .map_err(|e| OnnxError::field("input", e.to_string()))?;
    Ok(Value::Int(a))
}
