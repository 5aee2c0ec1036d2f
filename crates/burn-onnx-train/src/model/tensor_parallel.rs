//! An [`OnnxModel`] as one tensor-parallel rank: the rewritten graph (see
//! [`crate::tensor_parallel`]) with this rank's part of every split parameter. Also the
//! probe pass the planner reads shapes from.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::TensorData;

use super::{Mode, OnnxModel, Spec};
use crate::error::{OnnxError, Result};
use crate::graph::{Graph, TensorInfo};
use crate::tensor_parallel::{AxisSplit, Probe};
use crate::value::{PhysTensor, Value, padded};

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
                    elem_type: 0,
                    dims: Vec::new(),
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

    /// Rank `rank` of `tp`: `graph` (the rewrite of this model's) with the parameters in
    /// `splits` cut to this rank's part.
    pub fn into_tensor_parallel(
        mut self,
        graph: Graph,
        splits: &BTreeMap<String, AxisSplit>,
        rank: usize,
        tp: usize,
    ) -> Result<OnnxModel> {
        let mut infos = self.spec.params.clone();
        for (name, split) in splits {
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
            let part = split.slice(&full, rank, tp);
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
