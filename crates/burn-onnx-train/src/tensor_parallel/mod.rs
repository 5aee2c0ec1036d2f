//! Tensor (horizontal) parallelism on ONNX graphs, as Megatron-LM splits transformer
//! layers and ORT's `horizontal_parallel_size` did by rewriting the training graph:
//! [`plan`] finds the column- and row-parallel projections by following splits through
//! the graph, [`rewrite`] inserts Megatron's `f`/`g` operators ([`crate::collective::megatron`],
//! with their own backward) and adapts reshapes and splits to local sizes, and each rank keeps its
//! part of the split weights ([`AxisSplit`]). [`TensorParallel`] does all of it for a run.

pub mod ops;
pub mod plan;
pub mod rewrite;
pub mod split;

use std::collections::{BTreeMap, HashMap};

use burn_ort_dist::Communicator;

pub use crate::model::Probe;
pub use plan::Plan;
pub use split::AxisSplit;

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::value::{FloatValue, Value};

/// This rank's place in a tensor-parallel group and what is split.
#[derive(Debug, Clone)]
pub struct TensorParallel {
    /// Rank in the group.
    pub rank: usize,
    /// Group size.
    pub size: usize,
    /// The split parameters, by ONNX name.
    pub params: BTreeMap<String, AxisSplit>,
    /// Column-parallel projections found (node names), for the log and `inspect`.
    pub blocks: Vec<String>,
}

impl TensorParallel {
    /// Plan `model` (the whole model) for `size` ranks from a probe on `sample` inputs,
    /// and return rank `rank`'s model. A graph with nothing to split is an error unless
    /// `allow_replicated`.
    pub fn apply(
        model: OnnxModel,
        sample: Vec<(String, Value)>,
        rank: usize,
        size: usize,
        allow_replicated: bool,
    ) -> Result<(OnnxModel, TensorParallel)> {
        let probe = model.probe(sample)?;
        let plan = plan::plan(&model, &probe, size);
        let source = model
            .graph()
            .source
            .as_ref()
            .map_or_else(|| "the model".to_string(), |p| p.display().to_string());
        if plan.starts.is_empty() && !allow_replicated {
            return Err(OnnxError::field(
                "horizontal_parallel_size",
                format!(
                    "no Megatron block (MatMul/Gemm on a 2-D weight -> ... -> MatMul/Gemm contracting its split axis) splits over {size} ranks in {source}: nothing to split (set tensor_parallel_allow_replicated to run it replicated)"
                ),
            ));
        }
        let blocks: Vec<String> = plan
            .starts
            .iter()
            .map(|&i| model.graph().nodes[i].name.clone())
            .collect();
        let graph = rewrite::rewrite(model.graph(), &plan)?;
        let parts: BTreeMap<_, _> = plan
            .params
            .iter()
            .map(|(name, split)| (name.clone(), move |full: &_| split.slice(full, rank, size)))
            .collect();
        let model = model.into_tensor_parallel(graph, &parts)?;
        Ok((
            model,
            TensorParallel {
                rank,
                size,
                params: plan.params,
                blocks,
            },
        ))
    }

    /// The full values of the split parameters `model` holds (a pipeline stage holds some),
    /// assembled on rank 0 of `group` (`None` on the others). A collective of the group.
    pub fn gather(
        &self,
        model: &OnnxModel,
        group: &dyn Communicator,
    ) -> Result<Option<HashMap<String, FloatValue>>> {
        let mut full = HashMap::new();
        let device = model.device();
        for (name, split) in &self.params {
            let Some(local) = model.param_by_name(name) else {
                continue;
            };
            let a = local.to_array().map_err(|e| OnnxError::field(name, e.0))?;
            let send: Vec<f32> = a.iter().copied().collect();
            let mut recv = vec![0f32; send.len() * self.size];
            group.all_gather(&send, &mut recv)?;
            if self.rank != 0 {
                continue;
            }
            let parts: Vec<_> = recv
                .chunks(send.len())
                .map(|c| {
                    ndarray::ArrayD::from_shape_vec(a.raw_dim(), c.to_vec())
                        .expect("a part of the same shape")
                })
                .collect();
            let v = FloatValue::from_array(&split.assemble(&parts), &device)
                .map_err(|e| OnnxError::field(name, e.0))?;
            full.insert(name.clone(), v);
        }
        Ok((self.rank == 0).then_some(full))
    }
}
