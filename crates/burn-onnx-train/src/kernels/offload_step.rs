//! ZeRO-Offload's step for a model on a GPU whose optimizer state is on the host
//! (`offload_optimizer = "cpu"`, or `"disk"` for the moments): the f32 master parameters live
//! in host memory, laid out as the flat moments are, so that a step reads only the
//! gradients off the device and writes only the new parameters back (the master copy is
//! read from the device once, at the first step). In between the CPU updates the master
//! copy and the moments (`host_optim`'s arithmetic, the one the CPU device runs).
//!
//! The three phases run one after the other, every device operation on the calling
//! thread. Streamed versions measured slower on an H100 (BENCHMARKS.md, session 20): reads
//! from a second thread go through another CubeCL stream and memory pool, and reads
//! interleaved with a CPU update on every core waited on the busy cores. Transfers go by
//! buckets of consecutive parameters ([`buckets`], up to [`BUCKET_VALUES`] values): the
//! gradients of a bucket concatenated on the device and read at once, the new values of a
//! bucket uploaded at once and its parameters made views of it. One blocking transfer per
//! parameter (436 of them at 774M) cost about 1 s a step on an H200 (session 23).
//!
//! Between steps the master copy is the truth: each step must get the module the last one
//! returned (as the runner does; loading optimizer state lays everything out again).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ort_dist::storage::param_swap::{Place, Release};
use burn_ort_dist::update::zero::flat_optim::AdamStep;
use burn_ort_dist::{DistError, DistResult};

use super::host_optim::{HostRule, update};

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
    pub after_each: Option<&'a dyn Fn(Range<usize>)>,
}

fn invalid(message: String) -> DistError {
    DistError::Invalid { rank: 0, message }
}

fn not_in_model(id: ParamId) -> DistError {
    invalid(format!(
        "offloaded update: parameter {id} is not in the model"
    ))
}

/// A device tensor's values as f32 on the host.
fn read(t: Tensor<1>, what: &str) -> DistResult<Vec<f32>> {
    burn_ort_dist::host_values(t)
        .map_err(|e| invalid(format!("offloaded update: reading {what}: {e}")))
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
        let t = values
            .found
            .remove(&s.id)
            .ok_or_else(|| not_in_model(s.id))?;
        master[s.range.clone()].copy_from_slice(&read(t, "a parameter")?);
    }
    Ok(master)
}

/// Values per transfer: 64 Mi (256 MB of f32), a few transfers for a model of billions of
/// parameters, and little device memory for the concatenated gradients.
pub const BUCKET_VALUES: usize = 1 << 26;

/// `slots` cut into runs of consecutive parameters on one device, each at most
/// [`BUCKET_VALUES`] values of the flat layout (a larger parameter alone), as index ranges.
pub fn buckets(slots: &[Placed], devices: &HashMap<ParamId, Device>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for (i, s) in slots.iter().enumerate() {
        match out.last_mut() {
            Some(b)
                if s.range.end - slots[b.start].range.start <= BUCKET_VALUES
                    && devices.get(&s.id) == devices.get(&slots[b.start].id) =>
            {
                b.end = i + 1
            }
            _ => out.push(i..i + 1),
        }
    }
    out
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
    // The old values go first, so that the device holds one copy of the parameters.
    let mut release = Release::only(slots.iter().map(|s| s.id));
    let module = module.map(&mut release);
    let HostState {
        master,
        moment_1,
        moment_2,
        after_each,
    } = host;
    let buckets = buckets(slots, &release.devices);
    let start = Instant::now();
    let mut grads = grads.into_iter();
    let (mut read_ms, mut update_ms) = (0.0, 0.0);
    for b in &buckets {
        let t0 = Instant::now();
        let parts: Vec<Tensor<1>> = grads.by_ref().take(b.len()).collect();
        let values = read(Tensor::cat(parts, 0), "the gradients")?;
        read_ms += t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let mut at = 0;
        for s in &slots[b.clone()] {
            let r = s.range.clone();
            update(
                &mut master[r.clone()],
                &values[at..at + r.len()],
                &mut moment_1[r.clone()],
                &mut moment_2[r.clone()],
                s.factor,
                step,
                rule,
            );
            at += r.len();
            if let Some(after) = after_each {
                after(r);
            }
        }
        update_ms += t1.elapsed().as_secs_f64() * 1e3;
    }
    let t2 = Instant::now();
    let mut uploaded = HashMap::new();
    for b in &buckets {
        let in_bucket = &slots[b.clone()];
        let base = in_bucket[0].range.start;
        let end = in_bucket[in_bucket.len() - 1].range.end;
        let device = release
            .devices
            .get(&in_bucket[0].id)
            .ok_or_else(|| not_in_model(in_bucket[0].id))?;
        let flat = Tensor::<1>::from_data(
            TensorData::new(master[base..end].to_vec(), [end - base]),
            device,
        );
        for s in in_bucket {
            let part = flat.clone().slice(s.range.start - base..s.range.end - base);
            uploaded.insert(s.id, (part, s.shape.to_vec()));
        }
    }
    tracing::debug!(
        read_ms,
        update_ms,
        write_ms = t2.elapsed().as_secs_f64() * 1e3,
        transfers = buckets.len(),
        total_ms = start.elapsed().as_secs_f64() * 1e3,
        "offloaded update"
    );
    Ok(module.map(&mut Place(uploaded)))
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
