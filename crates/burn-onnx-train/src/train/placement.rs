//! [`Placement`]: where this rank sits in the run's topology and what it holds.
//!
//! The world splits into data-parallel replicas and, within a replica, pipeline stages
//! (`burn_ort_dist::Topology`, Megatron's layout). A rank holds its stage's part of the
//! model, trains it with the passes of a stage, averages gradients with the ranks holding
//! the same part, writes that part into checkpoints, and hands it to stage 0 for export.

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::Device;
use burn_ort_dist::{Communicator, Groups, ModelParallel, Topology};

use super::checkpoint::{model_bytes, model_file, stage_state_dir};
use super::config::TrainingConfig;
use super::passes::{Passes, Sequential};
use super::recompute::Recomputed;
use super::summaries::SummaryRole;
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::pipeline::wire::{recv_values, send_values};
use crate::pipeline::{Partition, Pipelined};
use crate::value::{FloatValue, Value};

/// This rank's coordinates, groups and pipeline partition.
pub struct Placement {
    /// The sizes.
    pub topology: Topology,
    /// Coordinates and sub-communicators.
    pub groups: Groups,
    /// The partition of the model, with more than one stage.
    pub partition: Option<Arc<Partition>>,
}

impl Placement {
    /// Carve the groups out of `world` (collective) for `c`'s sizes.
    pub fn new(c: &TrainingConfig, world: &dyn Communicator) -> Result<Self> {
        let topology = Topology::new(c.data_parallel_size, c.horizontal_parallel_size, c.pipeline_parallel_size, world.world_size())?;
        let groups = topology.groups(world)?;
        Ok(Placement { topology, groups, partition: None })
    }

    /// Cut `model` (the whole model) for the pipeline and keep this rank's stage.
    pub fn model_part(&mut self, c: &TrainingConfig, model: OnnxModel) -> Result<OnnxModel> {
        if self.topology.pp == 1 {
            return Ok(model);
        }
        let partition = if c.pipeline_cut_after.is_empty() {
            Partition::auto(&model, self.topology.pp)?
        } else {
            if c.pipeline_cut_after.len() + 1 != self.topology.pp {
                return Err(OnnxError::field(
                    "config.pipeline_cut_after",
                    format!("{} cut(s) make {} stages, but pipeline_parallel_size is {}", c.pipeline_cut_after.len(), c.pipeline_cut_after.len() + 1, self.topology.pp),
                ));
            }
            Partition::after(&model, &c.pipeline_cut_after)?
        };
        let part = model.into_stage(&partition.stages[self.groups.pp_rank])?;
        self.partition = Some(Arc::new(partition));
        Ok(part)
    }

    /// The passes this rank runs on `model` (its part of the model).
    pub fn passes(&self, c: &TrainingConfig, model: &OnnxModel, device: &Device) -> Result<Box<dyn Passes>> {
        Ok(match &self.partition {
            None if c.recompute_segments > 1 => {
                let nodes = model.graph().nodes.len();
                if c.recompute_segments > nodes {
                    return Err(OnnxError::field("config.recompute_segments", format!("{} segments for a graph of {nodes} nodes", c.recompute_segments)));
                }
                Box::new(Recomputed { partition: Arc::new(Partition::auto(model, c.recompute_segments)?), replica: self.groups.dp_rank, device: device.clone() })
            }
            None => Box::new(Sequential { replica: self.groups.dp_rank, device: device.clone() }),
            Some(p) => Box::new(Pipelined {
                partition: p.clone(),
                comm: self.groups.pp.clone(),
                replica: self.groups.dp_rank,
                schedule: c.pipeline_schedule,
                micro_batches: c.micro_batches(),
                device: device.clone(),
            }),
        })
    }

    /// The model-parallel norm group of a stage (`None` without a pipeline): parameters
    /// whose first holder is another stage count there.
    pub fn model_parallel(&self, model: &OnnxModel) -> Option<ModelParallel> {
        let p = self.partition.as_ref()?;
        let me = self.groups.pp_rank;
        let elsewhere: HashSet<ParamId> = p
            .shared
            .iter()
            .filter(|s| s.stages.first() != Some(&me))
            .filter_map(|s| model.param_index(&s.name).map(|i| model.params()[i].id))
            .collect();
        Some(ModelParallel::new(self.groups.pp.clone(), elsewhere))
    }

    /// Does this stage write parameter `name` (the first stage holding it does)?
    fn owns(&self, name: &str) -> bool {
        match &self.partition {
            None => true,
            Some(p) => p.shared.iter().find(|s| s.name == name).is_none_or(|s| s.stages.first() == Some(&self.groups.pp_rank)),
        }
    }

    /// This rank's files in a checkpoint: its part of the model (first replica only) and
    /// the optimizer state `state` (under `stage-<k>/` in a pipeline).
    pub fn checkpoint_files(&self, model: &OnnxModel, state: Vec<(String, Vec<u8>)>) -> Result<Vec<(String, Vec<u8>)>> {
        let stage = self.partition.as_ref().map(|_| self.groups.pp_rank);
        let mut files: Vec<(String, Vec<u8>)> = match stage {
            None => state,
            Some(k) => state.into_iter().map(|(n, b)| (format!("{}/{n}", stage_state_dir(k)), b)).collect(),
        };
        if self.groups.dp_rank == 0 {
            files.push((model_file(stage), model_bytes(model, |n| self.owns(n))?));
        }
        Ok(files)
    }

    /// What this rank writes to TensorBoard: world rank 0 the run, the first replica of
    /// every later pipeline stage the summaries of its own weights.
    pub fn summary_role(&self, world_rank: usize) -> SummaryRole {
        match (world_rank, &self.partition) {
            (0, _) => SummaryRole::Run,
            (_, Some(_)) if self.groups.dp_rank == 0 => SummaryRole::StageWeights,
            _ => SummaryRole::Silent,
        }
    }


    /// The whole trained model on world rank 0 (`None` elsewhere): in a pipeline, the
    /// first replica's stages send their parameters to stage 0, which sets them into the
    /// model loaded from `c.model_path`. Collective over `world`: no rank leaves before
    /// the parameters have arrived.
    pub fn whole_model(&self, c: &TrainingConfig, model: &OnnxModel, world: &dyn Communicator) -> Result<Option<OnnxModel>> {
        let Some(p) = &self.partition else {
            return Ok((world.rank() == 0).then(|| model.clone()));
        };
        let whole = if self.groups.dp_rank == 0 { self.gather_stages(c, p, model)? } else { None };
        world.barrier()?;
        Ok(whole)
    }

    /// The first replica's part of [`Self::whole_model`].
    fn gather_stages(&self, c: &TrainingConfig, p: &Partition, model: &OnnxModel) -> Result<Option<OnnxModel>> {
        let me = self.groups.pp_rank;
        let comm = self.groups.pp.as_ref();
        let owned = |k: usize| -> Vec<&String> { p.stages[k].params.iter().filter(|n| (0..k).all(|e| !p.stages[e].params.contains(n))).collect() };
        if me != 0 {
            let values: Vec<Value> = owned(me)
                .into_iter()
                .map(|n| model.param_by_name(n).map(Value::Float).ok_or_else(|| OnnxError::field("pipeline", format!("stage {me} lacks '{n}'"))))
                .collect::<Result<_>>()?;
            send_values(comm, 0, &values.iter().collect::<Vec<_>>())?;
            return Ok(None);
        }
        let device = model.device();
        let mut values: std::collections::HashMap<String, FloatValue> = p.stages[0].params.iter().filter_map(|n| model.param_by_name(n).map(|v| (n.clone(), v))).collect();
        for k in 1..p.stages.len() {
            let names = owned(k);
            for (n, v) in names.iter().zip(recv_values(comm, k, names.len(), &device)?) {
                let Value::Float(f) = v else { return Err(OnnxError::field("pipeline", format!("parameter '{n}' arrived as a non-float value"))) };
                values.insert((*n).clone(), f);
            }
        }
        let whole = OnnxModel::load(&c.model_path, &device)?;
        Ok(Some(whole.set_params(&values)?))
    }
}
