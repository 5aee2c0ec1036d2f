//! An [`OnnxModel`] as one tensor-parallel rank: a rewritten graph (see
//! [`crate::parallel::tensor_parallel`]) with some parameters replaced by this rank's part. Also the
//! probe pass the planner reads shapes from.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::TensorData;

use super::{Mode, OnnxModel, Spec};
use crate::error::{OnnxError, Result};
use crate::graph::{Graph, TensorInfo};
use crate::value::{PhysTensor, Value, padded};

/// Full shapes (and whether the value is a float tensor) of the graph's values, from a
/// probe pass.
#[derive(Debug, Default, Clone)]
pub struct Probe {
    /// Shape of every graph input and node output.
    pub shapes: HashMap<String, Vec<usize>>,
    /// The float ones.
    pub floats: HashSet<String>,
}

impl OnnxModel {
    /// Run the graph once in evaluation mode without autodiff and note the shape and kind
    /// of every graph input and every value a node reads.
    pub fn probe(&self, inputs: Vec<(String, Value)>) -> Result<Probe> {
        let mut graph = (*self.spec.graph).clone();
        let mut outputs = graph.inputs.clone();
        outputs.extend(
            graph
                .nodes
                .iter()
                .flat_map(|n| n.outputs.iter())
                .filter(|o| graph.last_use.contains_key(*o))
                .map(|o| TensorInfo {
                    name: o.clone(),
                    ..TensorInfo::default()
                }),
        );
        outputs.extend(graph.outputs.iter().cloned());
        graph.outputs = outputs;
        let spec = Spec {
            graph: Arc::new(graph),
            ..(*self.spec).clone()
        };
        let probe = OnnxModel {
            params: self.untracked().params,
            spec: Arc::new(spec),
        };
        let out = probe.forward(inputs, Mode::Eval)?;
        let mut p = Probe::default();
        for (name, v) in out.outputs {
            if matches!(v, Value::Float(_)) {
                p.floats.insert(name.clone());
            }
            p.shapes.insert(name, v.shape());
        }
        Ok(p)
    }

    /// The model whose logits output holds `shard` of the vocabulary (a tensor-parallel
    /// rank with its head split; `None`: whole logits).
    pub fn with_vocab_shard(
        mut self,
        shard: Option<crate::collective::vocab::VocabShard>,
    ) -> OnnxModel {
        self.spec = Arc::new(Spec {
            vocab_shard: shard,
            ..(*self.spec).clone()
        });
        self
    }

    /// `graph` (a rewrite of this model's) with each parameter named in `parts` replaced
    /// by the part `parts` cuts from its full value (a tensor-parallel rank's slice).
    pub fn into_tensor_parallel<F>(
        mut self,
        graph: Graph,
        parts: &BTreeMap<String, F>,
    ) -> Result<OnnxModel>
    where
        F: Fn(&ndarray::ArrayD<f32>) -> ndarray::ArrayD<f32>,
    {
        let mut infos = self.spec.params.clone();
        for (name, cut) in parts {
            let i = self.param_index(name).ok_or_else(|| {
                OnnxError::field(
                    format!("parameter '{name}'"),
                    "a tensor-parallel split of a parameter the model lacks",
                )
            })?;
            let full = self
                .param_value(i)
                .expect("an indexed parameter")
                .to_array()
                .map_err(|e| OnnxError::field(name, e.0))?;
            let part = cut(&full);
            let shape = part.shape().to_vec();
            let phys = padded(&shape).map_err(|e| OnnxError::field(name, e.0))?;
            let device = self.device();
            let old = std::mem::replace(
                &mut self.params[i],
                Param::from_tensor(PhysTensor::empty([1; crate::value::MAX_RANK], &device)),
            );
            let (id, tensor, _) = old.consume();
            let t = PhysTensor::from_data(
                TensorData::new(part.iter().copied().collect::<Vec<f32>>(), phys.to_vec()),
                &tensor.device(),
            );
            self.params[i] = Param::initialized(id, t.set_require_grad(tensor.is_require_grad()));
            infos[i].shape = shape;
        }
        let spec = Spec {
            graph: Arc::new(graph),
            params: infos,
            ..(*self.spec).clone()
        };
        Ok(OnnxModel {
            params: self.params,
            spec: Arc::new(spec),
        })
    }
}
