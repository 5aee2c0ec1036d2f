//! The streamed export's wire protocol: with tensor or pipeline parallelism no rank holds
//! the trained model whole, so world rank 0 writes the file and asks for each parameter as
//! the writer reaches it; the stage owning it assembles it (its ZeRO-3 chunks gathered over
//! the data-parallel group, then its tensor-parallel parts on tp rank 0) and sends it to
//! world rank 0, one parameter at a time ([`export_streamed`]). The run's layout comes in
//! as an [`ExportLayout`] that [`super::parallel_plan::ParallelPlan::export`] fills.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use burn_ort_dist::{Communicator, Groups};
use ndarray::{ArrayD, IxDyn};

use crate::error::{OnnxError, Result};
use crate::graph::Graph;
use crate::model::OnnxModel;
use crate::onnx::export::{ExportOptions, ParamSource, export_onnx_from, param_reads};
use crate::parallel::pipeline::Partition;
use crate::parallel::tensor_parallel::TensorParallel;
use crate::value::host_tensor::into_row_major_vec;

/// Where this rank sits in the run's layout, as far as the protocol asks.
pub struct ExportLayout<'a> {
    /// Coordinates and sub-communicators.
    pub groups: &'a Groups,
    /// The pipeline partition, with pipeline parallelism.
    pub partition: Option<&'a Partition>,
    /// The tensor-parallel split, with tensor parallelism.
    pub tensor_parallel: Option<&'a TensorParallel>,
    /// ZeRO-3: each parameter is chunked over the data-parallel group.
    pub zero3: bool,
}

impl ExportLayout<'_> {
    /// The pipeline rank whose stages write parameter `name` (0 without a pipeline).
    fn owner_stage(&self, name: &str) -> usize {
        self.partition.and_then(|p| p.owner(name)).unwrap_or(0)
    }
}

/// Export the model cut as `layout` says, of which this rank holds `model`, to `path` on
/// world rank 0 (a collective over `world`): rank 0 writes the model file and tells every
/// rank the parameters it reads, in order; every rank walks them with it
/// (`stream_param`).
pub fn export_streamed(
    layout: &ExportLayout,
    model: &OnnxModel,
    world: &dyn Communicator,
    path: &Path,
) -> Result<()> {
    let names = whole_param_names(layout, model);
    if world.rank() != 0 {
        for i in broadcast_indices(world, Vec::new())? {
            stream_param(layout, model, &names[i])?;
        }
        return Ok(());
    }
    // Every rank's graph keeps the whole model's protobuf and ties for export.
    let graph = model.graph();
    let params = Streamed {
        layout,
        model,
        names: &names,
        shapes: initializer_shapes(graph),
    };
    let reads: Vec<usize> = param_reads(graph, &params)
        .iter()
        .filter_map(|n| names.binary_search(n).ok())
        .collect();
    broadcast_indices(world, reads)?;
    export_onnx_from(graph, &params, path, ExportOptions::default())
}

/// The names of the whole model's parameters, sorted: the same list on every rank
/// (each pipeline rank knows every stage's parameters from the partition).
fn whole_param_names(layout: &ExportLayout, model: &OnnxModel) -> Vec<String> {
    let names: BTreeSet<String> = match layout.partition {
        Some(p) => (0..p.ranks).flat_map(|k| p.params_of(k)).collect(),
        None => model.param_infos().iter().map(|i| i.name.clone()).collect(),
    };
    names.into_iter().collect()
}

/// One step of the streamed export, on every rank for the same parameter `name` in the
/// same order: the ranks of the stage owning it gather it whole (ZeRO-3 over the
/// data-parallel group, then the tensor-parallel parts on tp rank 0), and the first
/// replica's tp rank 0 of that stage sends it to stage 0. World rank 0 gets `Some` when it
/// owns the parameter itself; every other rank gets `None`.
fn stream_param(
    layout: &ExportLayout,
    model: &OnnxModel,
    name: &str,
) -> Result<Option<ArrayD<f32>>> {
    let g = layout.groups;
    let owner = layout.owner_stage(name);
    if g.pp_rank != owner || (!layout.zero3 && g.dp_rank != 0) {
        return Ok(None);
    }
    let local = model.whole_param(model.require_param(name)?, g.dp.as_ref())?;
    if g.dp_rank != 0 {
        return Ok(None);
    }
    let full = match layout.tensor_parallel {
        Some(t) => t.gather_param(name, local, g.tp.as_ref())?,
        None => Some(local),
    };
    match full {
        Some(full) if owner != 0 => {
            g.pp.recv(&mut [0.0], 0)?;
            g.pp.send(&into_row_major_vec(full), 0)?;
            Ok(None)
        }
        full => Ok(full),
    }
}

/// World rank 0's side of [`stream_param`]: parameter `name` (of `shape`), its own or
/// received from the stage owning it. The owner sends once asked, so one parameter at a
/// time is in flight.
fn received_param(
    layout: &ExportLayout,
    model: &OnnxModel,
    name: &str,
    shape: &[usize],
) -> Result<ArrayD<f32>> {
    if let Some(values) = stream_param(layout, model, name)? {
        return Ok(values);
    }
    let owner = layout.owner_stage(name);
    let pp = layout.groups.pp.as_ref();
    pp.send(&[0.0], owner)?;
    let mut values = vec![0f32; shape.iter().product()];
    pp.recv(&mut values, owner)?;
    ArrayD::from_shape_vec(IxDyn(shape), values)
        .map_err(|e| OnnxError::field(format!("parameter '{name}'"), e.to_string()))
}

/// World rank 0's parameters in a streamed export ([`export_streamed`]).
struct Streamed<'a> {
    layout: &'a ExportLayout<'a>,
    /// Rank 0's part of the trained model.
    model: &'a OnnxModel,
    /// The whole model's parameters, sorted.
    names: &'a [String],
    /// Each initializer's shape, from the whole model's protobuf.
    shapes: HashMap<String, Vec<usize>>,
}

impl ParamSource for Streamed<'_> {
    fn holds(&self, name: &str) -> bool {
        self.names
            .binary_search_by(|n| n.as_str().cmp(name))
            .is_ok()
    }

    fn values(&self, name: &str) -> Result<ArrayD<f32>> {
        let shape = self.shapes.get(name).ok_or_else(|| {
            OnnxError::field(
                format!("parameter '{name}'"),
                "not an initializer of the model",
            )
        })?;
        received_param(self.layout, self.model, name, shape)
    }
}

/// The shape of each initializer of `graph`'s protobuf, by name.
fn initializer_shapes(graph: &Graph) -> HashMap<String, Vec<usize>> {
    graph
        .model
        .graph
        .iter()
        .flat_map(|g| &g.initializer)
        .map(|t| {
            (
                t.name.clone(),
                t.dims.iter().map(|&d| d.max(0) as usize).collect(),
            )
        })
        .collect()
}

/// `indices` from world rank 0 to every rank (the others pass an empty list): a length,
/// then the indices, as f32 (exact below 2^24).
fn broadcast_indices(world: &dyn Communicator, indices: Vec<usize>) -> Result<Vec<usize>> {
    let mut len = [indices.len() as f32];
    world.broadcast(&mut len, 0)?;
    let mut buf: Vec<f32> = indices.iter().map(|&i| i as f32).collect();
    buf.resize(len[0] as usize, 0.0);
    world.broadcast(&mut buf, 0)?;
    Ok(buf.into_iter().map(|x| x as usize).collect())
}
