//! ZeRO-Offload's step for a model on a GPU whose optimizer state is on the host
//! (`offload_optimizer = "cpu"`, or `"disk"` for the moments): the f32 master parameters live
//! in host memory, laid out as the flat moments are, and a step streams through three stages
//! at once, a parameter at a time: this thread reads each gradient off the device, a thread
//! updates that parameter's master copy and moments on the CPU (`host_optim`'s arithmetic,
//! the one the CPU device runs), and this thread writes the new values to the device
//! between its reads. Only
//! gradients come down and parameters go up (the master copy is read from the device once,
//! at the first step), and the host holds a few parameters' gradients in flight, not a copy
//! of the model.
//!
//! Between steps the master copy is the truth: each step must get the module the last one
//! returned (as the runner does; loading optimizer state lays everything out again).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::mpsc::{channel, sync_channel};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use burn_ort_dist::zero::flat_optim::AdamStep;
use burn_ort_dist::{DistError, DistResult};

use super::host_optim::{HostRule, update};

/// Parameters and gradients in flight between two stages.
const IN_FLIGHT: usize = 2;

/// One parameter of the flat layout: its id, shape and place.
pub struct Placed<'a> {
    pub id: ParamId,
    pub shape: &'a [usize],
    pub range: Range<usize>,
    /// Its decay factor this step (see [`HostRule`]).
    pub factor: f32,
}

/// The host side of the step: master parameters and both moments, flat, and what to call
/// once a parameter's moments are written (moments on disk release their pages).
pub struct HostState<'a> {
    pub master: &'a mut [f32],
    pub moment_1: &'a mut [f32],
    pub moment_2: &'a mut [f32],
    pub after_each: Option<&'a (dyn Fn(Range<usize>) + Sync)>,
}

fn invalid(message: String) -> DistError {
    DistError::Invalid { rank: 0, message }
}

/// A device tensor's values as f32 on the host.
fn read(t: Tensor<1>, what: &str) -> DistResult<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| invalid(format!("offloaded update: reading {what}: {e:?}")))
}

/// The master copy of `module`'s parameters at `slots`, read from the device (zeros in
/// the padding between them).
pub fn read_master<M: Module>(module: &M, slots: &[Placed], len: usize) -> DistResult<Vec<f32>> {
    let mut values = Values {
        wanted: slots.iter().map(|s| s.id).collect(),
        found: HashMap::new(),
    };
    module.visit(&mut values);
    let mut master = vec![0.0f32; len];
    for s in slots {
        let t = values.found.remove(&s.id).ok_or_else(|| {
            invalid(format!(
                "offloaded update: parameter {} is not in the model",
                s.id
            ))
        })?;
        master[s.range.clone()].copy_from_slice(&read(t, "a parameter")?);
    }
    Ok(master)
}

/// One step: `grads` (device tensors, flat, one per slot in order) applied to the master
/// copy, the moments updated, and `module`'s parameters replaced by the new values on the
/// device.
pub fn step<M: Module>(
    module: M,
    slots: &[Placed],
    grads: Vec<Tensor<1>>,
    host: HostState,
    step: AdamStep,
    rule: HostRule,
) -> DistResult<M> {
    let Some(device) = grads.first().map(|g| g.device()) else {
        return Ok(module);
    };
    // The old values go first, so that the device holds one copy of the parameters.
    let module = module.map(&mut Release(slots.iter().map(|s| s.id).collect()));
    let HostState {
        master,
        moment_1,
        moment_2,
        after_each,
    } = host;
    // Every device operation stays on this thread (a CubeCL stream per thread: a read or
    // a write from another would wait on this one's work and allocate from its own pool).
    let uploaded = std::thread::scope(|scope| -> DistResult<Vec<Tensor<1>>> {
        let (grad_tx, grad_rx) = sync_channel::<Vec<f32>>(IN_FLIGHT);
        let (value_tx, value_rx) = channel::<Vec<f32>>();
        let updater = scope.spawn(move || {
            let mut updating = Duration::ZERO;
            for (s, g) in slots.iter().zip(grad_rx) {
                let t = Instant::now();
                let r = s.range.clone();
                let p = &mut master[r.clone()];
                update(
                    p,
                    &g,
                    &mut moment_1[r.clone()],
                    &mut moment_2[r.clone()],
                    s.factor,
                    step,
                    rule,
                );
                if let Some(after) = after_each {
                    after(r);
                }
                updating += t.elapsed();
                if value_tx.send(p.to_vec()).is_err() {
                    break;
                }
            }
            updating
        });
        let start = Instant::now();
        let mut uploaded = Vec::with_capacity(slots.len());
        let mut write = |v: Vec<f32>| {
            let n = v.len();
            uploaded.push(Tensor::<1>::from_data(TensorData::new(v, [n]), &device));
        };
        for g in grads {
            let values = read(g, "a gradient")?;
            grad_tx
                .send(values)
                .map_err(|_| invalid("offloaded update: the CPU update stopped".into()))?;
            while let Ok(v) = value_rx.try_recv() {
                write(v);
            }
        }
        drop(grad_tx);
        let read_all = start.elapsed();
        value_rx.into_iter().for_each(write);
        let updating = updater
            .join()
            .map_err(|_| invalid("offloaded update: the CPU update panicked".into()))?;
        tracing::debug!(
            total_ms = start.elapsed().as_secs_f64() * 1e3,
            reading_and_writing_ms = read_all.as_secs_f64() * 1e3,
            updating_ms = updating.as_secs_f64() * 1e3,
            "offloaded update"
        );
        Ok(uploaded)
    })?;
    if uploaded.len() != slots.len() {
        return Err(invalid(format!(
            "offloaded update: {} of {} parameters reached the device",
            uploaded.len(),
            slots.len()
        )));
    }
    let values = slots
        .iter()
        .zip(uploaded)
        .map(|(s, t)| (s.id, (t, s.shape)))
        .collect();
    Ok(module.map(&mut Place(values)))
}

/// The values of the parameters in `wanted`, flattened.
struct Values {
    wanted: HashSet<ParamId>,
    found: HashMap<ParamId, Tensor<1>>,
}

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.wanted.contains(&param.id) {
            let n: usize = param.val().dims().iter().product();
            self.found
                .insert(param.id, param.val().inner().reshape([n]));
        }
    }
}

/// Replaces the parameters in its list with empty tensors, dropping their device buffers.
struct Release(HashSet<ParamId>);

impl ModuleMapper for Release {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.0.contains(&param.id) {
            return param;
        }
        param.map(|t| {
            let require = t.is_require_grad();
            let device = t.device();
            drop(t);
            Tensor::<D>::empty([0; D], &device).set_require_grad(require)
        })
    }
}

/// Puts the new values (flat, with their shapes) in place.
struct Place<'a>(HashMap<ParamId, (Tensor<1>, &'a [usize])>);

impl ModuleMapper for Place<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some((value, shape)) = self.0.remove(&param.id) else {
            return param;
        };
        param.map(|t| {
            let require = t.is_require_grad();
            let shape: [usize; D] = shape.try_into().expect("rank D");
            Tensor::from_inner(value.reshape(shape)).set_require_grad(require)
        })
    }
}
