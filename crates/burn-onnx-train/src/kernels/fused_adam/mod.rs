//! Adam, AdamW and LAMB over every parameter at once: the "multi-tensor apply" of NVIDIA
//! Apex's FusedAdam/FusedLAMB and DeepSpeed. The parameters and gradients of a step are
//! laid end to end in flat buffers (each padded to whole chunks; cut into groups of at
//! most 128 MiB on CubeCL devices, `layout.rs`); the moments live in flat buffers across
//! steps; one pass updates it all (three for LAMB: direction, per-parameter trust ratio,
//! update), where Burn's optimizer runs ~15 tensor ops per parameter. On CubeCL devices
//! the pass is one kernel launch per group (`on_device.rs`, `cube_optim.rs`); on the CPU
//! each parameter is updated in place in its own buffer, the moments flat on the host
//! (`host_optim.rs`). The state is written and
//! read as Burn's optimizer record, so a checkpoint resumes under either optimizer, on any
//! device.
//!
//! Parameters and moments are f32 (master weights): under `--precision f16/bf16` the
//! interpreter casts at the autocast ops, so there is no separate low-precision copy.
//! With the moments offloaded to disk (`offload.offload_optimizer = "disk"`, CPU update
//! only) they live in a memory-mapped file instead (`burn_ort_dist::storage::disk_vectors`), the arithmetic
//! unchanged.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::PathBuf;

use super::host_optim::{HostRule, HostSlot, InPlace};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::offload_step;
use burn::backend::flex::Flex;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Bytes, Device, Tensor, TensorData};
use burn_ort_dist::storage::disk_vectors::DiskVectors;
use burn_ort_dist::update::grad_norm::GradNorm;
use burn_ort_dist::update::replica_optimizer::clip_then_step;
use burn_ort_dist::update::zero::flat_optim::{AdamStep, Rule};
use burn_ort_dist::{
    DistError, DistResult, MomentSlices, MomentState, ReplicaOptimizer, decode_moments,
    encode_moments, write_moments,
};

mod layout;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod on_device;

use super::FLAT_CHUNK as CHUNK;
use layout::{GROUP_BYTES, Group, Slot};

/// Where the flat moment buffers live.
enum Moments {
    /// Tensors on the training device, a pair per group of the layout.
    Device(Vec<(Tensor<1>, Tensor<1>)>),
    /// A memory-mapped file (the CPU update only).
    Disk(DiskVectors),
}

/// The flat layout and the device state of a run's optimizer.
struct Flat {
    slots: Vec<Slot>,
    /// The slots' groups: one on the CPU and wherever the whole layout fits one buffer.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    groups: Vec<Group>,
    len: usize,
    device: Device,
    moments: Moments,
    time: usize,
    /// The f32 master parameters in host memory, laid out as the moments (the offloaded
    /// update of a model on a GPU; read from the device at its first step).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    master: Option<Vec<f32>>,
    /// Each group's flat parameters the last update on a CubeCL device wrote, whose views
    /// the module's parameters became: laid out already for the next update while they
    /// still are (nothing replaced a value in between).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    laid_params: Vec<Option<Tensor<1>>>,
    /// The update's small tables on the device, uploaded when they change.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    tables: on_device::UpdateTables,
}

/// Adam, AdamW or LAMB over flat device buffers; Burn's optimizer record as its state.
pub struct FusedAdam {
    rule: Rule,
    decay: HashMap<ParamId, f32>,
    flat: Option<Flat>,
    /// A loaded record, placed into the flat buffers at the first step.
    loaded: Option<BTreeMap<u64, MomentState>>,
    /// Keep the moments in a file under this directory instead of in memory.
    offload_dir: Option<PathBuf>,
    /// Keep the moments in host memory and update on the CPU while the model is on a GPU
    /// (without a GPU backend built in, the update is on the CPU already).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    host_update: bool,
    /// The most bytes one group's flat buffers hold on a CubeCL device.
    group_bytes: usize,
}

fn invalid(message: String) -> DistError {
    DistError::Invalid { rank: 0, message }
}

/// The most values one group's buffers hold on `device`: `group_bytes` or the largest
/// allocation a CubeCL device makes, whichever is less; no limit on the CPU (one group).
fn group_values(device: &Device, group_bytes: usize) -> usize {
    if !super::runs_cubecl(device) {
        return usize::MAX;
    }
    let largest = super::largest_allocation(device).map_or(usize::MAX, |b| b as usize);
    group_bytes.min(largest) / 4
}

/// The scalars of step `flat.time` at learning rate `lr` under `rule`: Adam's, and each
/// parameter's decay factor (AdamW multiplies the parameter by 1 - lr * decay, in f64 as
/// Burn; Adam and LAMB take the decay itself).
fn step_scalars(rule: Rule, flat: &Flat, lr: f64) -> (AdamStep, Vec<f32>) {
    let (beta_1, beta_2, epsilon) = match rule {
        Rule::Adam {
            beta1,
            beta2,
            epsilon,
        }
        | Rule::AdamW {
            beta1,
            beta2,
            epsilon,
        }
        | Rule::Lamb {
            beta1,
            beta2,
            epsilon,
        } => (beta1, beta2, epsilon),
        Rule::Sgd { .. } => unreachable!("FusedAdam::new refuses SGD"),
    };
    let step = AdamStep::new(beta_1, beta_2, epsilon, lr, flat.time as i32);
    let factors = flat
        .slots
        .iter()
        .map(|s| match rule {
            Rule::AdamW { .. } => (1.0 - lr * f64::from(s.decay)) as f32,
            _ => s.decay,
        })
        .collect();
    (step, factors)
}

impl FusedAdam {
    /// The state loaded from a checkpoint and not laid out yet, as a record.
    fn loaded_record(&self) -> DistResult<Bytes> {
        let loaded: Vec<_> = self
            .loaded
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        encode_moments(&loaded, self.nested())
    }

    /// Both moments on the host (borrowed from the mapped file, read from a GPU), or
    /// `None` before the first update laid them out.
    fn host_moments(&self) -> DistResult<Option<(Cow<'_, [f32]>, Cow<'_, [f32]>)>> {
        let Some(flat) = &self.flat else {
            return Ok(None);
        };
        let host = |t: &Tensor<1>| {
            burn_ort_dist::host_values(t.clone())
                .map_err(|e| invalid(format!("cannot read the optimizer state: {e}")))
        };
        Ok(Some(match &flat.moments {
            Moments::Device(pairs) => {
                let (mut m1, mut m2) = (Vec::with_capacity(flat.len), Vec::with_capacity(flat.len));
                for (a, b) in pairs {
                    m1.extend_from_slice(&host(a)?);
                    m2.extend_from_slice(&host(b)?);
                }
                (Cow::Owned(m1), Cow::Owned(m2))
            }
            Moments::Disk(d) => {
                let v = d.vectors();
                (Cow::Borrowed(v[0]), Cow::Borrowed(v[1]))
            }
        }))
    }

    /// Each parameter's slices of the flat moments `m1`, `m2` (none before an update).
    fn moment_slices<'a>(&'a self, m1: &'a [f32], m2: &'a [f32]) -> Vec<MomentSlices<'a>> {
        let Some(flat) = self.flat.as_ref().filter(|f| f.time > 0) else {
            return Vec::new();
        };
        flat.slots
            .iter()
            .map(|s| {
                let r = s.offset()..s.offset() + s.len;
                MomentSlices {
                    id: s.id.val(),
                    time: flat.time,
                    shape: &s.shape,
                    moment_1: &m1[r.clone()],
                    moment_2: &m2[r],
                }
            })
            .collect()
    }

    /// The fused form of `rule` (Adam, AdamW or LAMB; `None` for SGD); `decay` holds each
    /// parameter's weight decay (absent: none).
    pub fn new(rule: Rule, decay: HashMap<ParamId, f32>) -> Option<Self> {
        (!matches!(rule, Rule::Sgd { .. })).then_some(FusedAdam {
            rule,
            decay,
            flat: None,
            loaded: None,
            offload_dir: None,
            host_update: false,
            group_bytes: GROUP_BYTES,
        })
    }

    /// The same optimizer with its flat buffers cut into groups of at most `bytes` on
    /// CubeCL devices (default 128 MiB, and never more than the device allocates at
    /// once): an update holds one group's copy of the gradients beside them, and runs one
    /// launch per group. A parameter larger than `bytes` is a group of its own.
    pub fn with_group_bytes(self, bytes: usize) -> Self {
        FusedAdam {
            group_bytes: bytes.max(1),
            ..self
        }
    }

    /// The same optimizer with its moments in host memory: on a GPU device the update runs
    /// on the CPU against master parameters kept on the host, each gradient read and each
    /// new parameter written while others are updated (ZeRO-Offload, `offload_step.rs`).
    pub fn on_host(self) -> Self {
        FusedAdam {
            host_update: true,
            ..self
        }
    }

    /// The same optimizer with its moments in a memory-mapped file under `dir` (updated
    /// on the CPU, as [`Self::on_host`], when the model is on a GPU).
    pub fn with_moments_on_disk(self, dir: PathBuf) -> Self {
        FusedAdam {
            offload_dir: Some(dir),
            host_update: true,
            ..self
        }
    }

    /// Adam and AdamW nest their moments in a `momentum` field of Burn's record.
    fn nested(&self) -> bool {
        !matches!(self.rule, Rule::Lamb { .. })
    }

    /// The flat layout of the parameters with a gradient, in visiting order, with the
    /// state of a loaded record (or zeros) in place on `device`.
    fn lay_out(
        &mut self,
        grads: &[(ParamId, Tensor<1>, Vec<usize>)],
        device: Device,
    ) -> DistResult<Flat> {
        if grads.is_empty() {
            return Err(invalid(
                "fused optimizer: no parameter has a gradient".into(),
            ));
        }
        let mut slots = Vec::with_capacity(grads.len());
        let mut chunk = 0;
        for (id, g, shape) in grads {
            let slot = Slot {
                id: *id,
                shape: shape.clone(),
                len: g.dims()[0],
                chunk,
                decay: self.decay.get(id).copied().unwrap_or(0.0),
            };
            chunk += slot.padded() / CHUNK;
            slots.push(slot);
        }
        let len = chunk * CHUNK;
        let groups = layout::groups(&slots, group_values(&device, self.group_bytes));
        let mut moments = match &self.offload_dir {
            Some(dir) => Moments::Disk(DiskVectors::create(dir, 2, len).map_err(|e| {
                invalid(format!(
                    "optimizer moments on disk under {}: {e}",
                    dir.display()
                ))
            })?),
            None => Moments::Device(Vec::new()),
        };
        let (mut host_m1, mut host_m2) = (Vec::new(), Vec::new());
        let (m1, m2): (&mut [f32], &mut [f32]) = match &mut moments {
            Moments::Disk(d) => {
                let (v, _) = d.vectors_mut();
                let [m1, m2]: [&mut [f32]; 2] = v.try_into().expect("two moments");
                (m1, m2)
            }
            Moments::Device(..) => {
                (host_m1, host_m2) = (vec![0.0f32; len], vec![0.0f32; len]);
                (&mut host_m1, &mut host_m2)
            }
        };
        let mut time = 0;
        if let Some(mut loaded) = self.loaded.take() {
            let mut times = Vec::new();
            for s in &slots {
                let Some(state) = loaded.remove(&s.id.val()) else {
                    continue;
                };
                if state.moment_1.len() != s.len || state.moment_2.len() != s.len {
                    return Err(invalid(format!(
                        "optimizer record: the state of parameter {} has {} values, the parameter {}",
                        s.id,
                        state.moment_1.len(),
                        s.len
                    )));
                }
                m1[s.offset()..s.offset() + s.len].copy_from_slice(&state.moment_1);
                m2[s.offset()..s.offset() + s.len].copy_from_slice(&state.moment_2);
                times.push(state.time);
            }
            time = times.first().copied().unwrap_or(0);
            if times.iter().any(|t| *t != time) || (time > 0 && times.len() != slots.len()) {
                return Err(invalid(format!(
                    "optimizer record: its parameters were updated different numbers of times ({} of {} have state); the fused optimizer steps all of them together",
                    times.len(),
                    slots.len()
                )));
            }
        }
        if let Moments::Device(..) = moments {
            let upload =
                |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device);
            let pairs = groups
                .iter()
                .map(|g| (upload(&host_m1[g.range()]), upload(&host_m2[g.range()])))
                .collect();
            moments = Moments::Device(pairs);
        }
        Ok(Flat {
            moments,
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            laid_params: vec![None; groups.len()],
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            tables: Default::default(),
            groups,
            slots,
            len,
            device,
            time,
            master: None,
        })
    }
}

/// Every parameter's gradient (flattened) taken from `grads`, in visiting order.
fn collect<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
) -> Vec<(ParamId, Tensor<1>, Vec<usize>)> {
    let mut c = Collect {
        grads,
        taken: Vec::new(),
    };
    module.visit(&mut c);
    c.taken
}

/// Takes every parameter's gradient (flattened), in visiting order.
struct Collect<'a> {
    grads: &'a mut GradientsParams,
    taken: Vec<(ParamId, Tensor<1>, Vec<usize>)>,
}

impl ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            let shape = g.dims().to_vec();
            let n: usize = shape.iter().product();
            self.taken.push((param.id, g.reshape([n]), shape));
        }
    }
}

/// The update on the CPU: every parameter in place, the moments in the flat host buffers.
fn on_host<M: Module>(
    flat: &mut Flat,
    module: M,
    grads: Vec<Tensor<1>>,
    step: AdamStep,
    factors: &[f32],
    rule: Rule,
) -> DistResult<M> {
    let slots = flat
        .slots
        .iter()
        .zip(grads)
        .zip(factors)
        .map(|((s, grad), &factor)| {
            let range = s.offset()..s.offset() + s.len;
            (
                s.id,
                HostSlot {
                    grad,
                    range,
                    factor,
                },
            )
        })
        .collect();
    with_host_moments(
        &mut flat.moments,
        &flat.device,
        |moment_1, moment_2, after_each| {
            update_in_place(
                module,
                InPlace {
                    slots,
                    moment_1,
                    moment_2,
                    step,
                    rule: host_rule(rule),
                    after_each,
                    error: None,
                },
            )
        },
    )?
}

/// The CPU update's form of `rule`.
fn host_rule(rule: Rule) -> HostRule {
    match rule {
        Rule::AdamW { .. } => HostRule::AdamW,
        Rule::Lamb { .. } => HostRule::Lamb,
        _ => HostRule::Adam,
    }
}

/// `f` run on both moments as host slices, with what releases a parameter's range of them
/// once it is written (the pages of moments on disk), the moments put back afterwards.
fn with_host_moments<R>(
    moments: &mut Moments,
    device: &Device,
    f: impl FnOnce(&mut [f32], &mut [f32], Option<&dyn Fn(Range<usize>)>) -> R,
) -> DistResult<R> {
    match moments {
        Moments::Disk(disk) => {
            let (v, releaser) = disk.vectors_mut();
            let [moment_1, moment_2]: [&mut [f32]; 2] = v.try_into().expect("two moments");
            let release = move |r| releaser.release(r);
            Ok(f(moment_1, moment_2, Some(&release)))
        }
        Moments::Device(pairs) => {
            let [(t1, t2)] = &mut pairs[..] else {
                return Err(invalid(format!(
                    "fused optimizer: the moments lie in {} device buffers; the CPU update takes one",
                    pairs.len()
                )));
            };
            let host = |t: Tensor<1>| {
                t.inner()
                    .try_into_primitive::<Flex>()
                    .map_err(|e| invalid(format!("fused optimizer: moments not on the CPU: {e:?}")))
            };
            let empty = || Tensor::<1>::empty([0], device);
            let mut m1 = host(std::mem::replace(t1, empty()))?;
            let mut m2 = host(std::mem::replace(t2, empty()))?;
            let out = f(m1.storage_mut(), m2.storage_mut(), None);
            *t1 = Tensor::from_primitive::<Flex>(m1);
            *t2 = Tensor::from_primitive::<Flex>(m2);
            Ok(out)
        }
    }
}

/// `update` applied to `module`'s parameters, in place.
fn update_in_place<M: Module>(module: M, mut update: InPlace) -> DistResult<M> {
    let module = module.map(&mut update);
    match update.error.take() {
        Some(e) => Err(invalid(format!("fused optimizer: {e}"))),
        None => Ok(module),
    }
}

impl FusedAdam {
    /// With the state offloaded on a GPU run: the update on the CPU against the master
    /// parameters in host memory ([`offload_step`]).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn step_offloaded<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> DistResult<M> {
        let (grads, step, factors) =
            self.begin_step(lr, &module, &mut grads, Some(Device::flex()))?;
        let rule = host_rule(self.rule);
        let Flat {
            slots,
            len,
            device,
            moments,
            master,
            ..
        } = self.flat.as_mut().expect("laid out above");
        let placed: Vec<offload_step::Placed> = slots
            .iter()
            .zip(factors)
            .map(|(s, factor)| offload_step::Placed {
                id: s.id,
                shape: &s.shape,
                range: s.offset()..s.offset() + s.len,
                factor,
            })
            .collect();
        if master.is_none() {
            *master = Some(offload_step::read_master(&module, &placed, *len)?);
        }
        let master = master.as_mut().expect("read above");
        with_host_moments(moments, device, |moment_1, moment_2, after_each| {
            let host = offload_step::HostState {
                master,
                moment_1,
                moment_2,
                after_each,
            };
            offload_step::step(module, &placed, grads, host, step, rule)
        })?
    }

    /// The step's gradients taken from `grads` (flat, in layout order; the layout made at
    /// the first step, its moments on `moments_on` or else where the gradients are), after
    /// checking that they are the laid-out parameters; counts the step and returns its
    /// scalars and each parameter's decay factor too.
    fn begin_step<M: Module>(
        &mut self,
        lr: f64,
        module: &M,
        grads: &mut GradientsParams,
        moments_on: Option<Device>,
    ) -> DistResult<(Vec<Tensor<1>>, AdamStep, Vec<f32>)> {
        let taken = collect(module, grads);
        if self.flat.is_none() {
            let device = match moments_on {
                Some(d) => d,
                None => taken.first().map(|(_, g, _)| g.device()).ok_or_else(|| {
                    invalid("fused optimizer: no parameter has a gradient".into())
                })?,
            };
            self.flat = Some(self.lay_out(&taken, device)?);
        }
        let rule = self.rule;
        let flat = self.flat.as_mut().expect("laid out above");
        if taken.len() != flat.slots.len()
            || taken
                .iter()
                .zip(&flat.slots)
                .any(|((id, ..), s)| *id != s.id)
        {
            return Err(invalid(format!(
                "fused optimizer: {} parameters have a gradient at this step, {} at the first; it updates the same parameters at every step",
                taken.len(),
                flat.slots.len()
            )));
        }
        flat.time += 1;
        let (step, factors) = step_scalars(rule, flat, lr);
        let grads = taken.into_iter().map(|(_, g, _)| g).collect();
        Ok((grads, step, factors))
    }

    /// One update on the device the module is on.
    fn step_here<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> DistResult<M> {
        let (grads, step, factors) = self.begin_step(lr, &module, &mut grads, None)?;
        let rule = self.rule;
        let flat = self.flat.as_mut().expect("laid out by begin_step");
        if super::runs_cubecl(&flat.device) {
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            {
                let grads = on_device::laid_in_groups(grads, flat);
                return Ok(on_device::update(
                    flat,
                    module,
                    (grads, None),
                    step,
                    &factors,
                    rule,
                ));
            }
        }
        on_host(flat, module, grads, step, &factors, rule)
    }
}

impl ReplicaOptimizer for FusedAdam {
    fn step<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> DistResult<M> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.host_update && self.updates_on_device(&module) {
            return self.step_offloaded(lr, module, grads);
        }
        self.step_here(lr, module, grads)
    }

    fn step_clipped<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
    ) -> DistResult<(M, GradNorm)> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if !self.host_update && self.updates_on_device(&module) {
            return self.step_clipped_on_device(lr, module, grads, max_norm);
        }
        clip_then_step(self, lr, module, grads, max_norm)
    }

    fn steps_scaled<M: Module>(&self, module: &M) -> bool {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        return !self.host_update && self.updates_on_device(module);
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            let _ = module;
            false
        }
    }

    fn step_scaled<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
        scale: f32,
    ) -> DistResult<(M, GradNorm, bool)> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if self.steps_scaled(&module) {
            return self.step_scaled_on_device(lr, module, grads, max_norm, scale);
        }
        let _ = (lr, module, grads, max_norm, scale);
        Err(invalid(
            "fused optimizer: loss-scaled gradients are divided in the update on CubeCL devices only".into(),
        ))
    }

    fn record_bytes(&self) -> DistResult<Bytes> {
        let Some((m1, m2)) = self.host_moments()? else {
            return self.loaded_record();
        };
        let states: Vec<(u64, MomentState)> = self
            .moment_slices(&m1, &m2)
            .into_iter()
            .map(|s| {
                (
                    s.id,
                    MomentState {
                        time: s.time,
                        shape: s.shape.to_vec(),
                        moment_1: s.moment_1.to_vec(),
                        moment_2: s.moment_2.to_vec(),
                    },
                )
            })
            .collect();
        encode_moments(&states, self.nested())
    }

    /// Streams the moments from where they lie (host memory, the mapped file): a
    /// checkpoint never holds a copy of them (a GPU's are read to the host once).
    fn write_state(&self, w: &mut dyn std::io::Write) -> DistResult<()> {
        let Some((m1, m2)) = self.host_moments()? else {
            return burn_ort_dist::storage::record_safetensors::write_record(
                self.loaded_record()?,
                w,
            );
        };
        let slices = self.moment_slices(&m1, &m2);
        // Moments on disk: each parameter's pages are dropped again once written.
        let release = self.flat.as_ref().and_then(|f| match &f.moments {
            Moments::Disk(d) => Some((d.releaser(), f)),
            Moments::Device(..) => None,
        });
        write_moments(&slices, self.nested(), w, |k| {
            if let Some((r, flat)) = &release {
                let s = &flat.slots[k];
                r.release(s.offset()..s.offset() + s.len);
            }
        })
    }

    fn load_record_bytes(&mut self, bytes: Bytes) -> DistResult<()> {
        self.loaded = Some(decode_moments(bytes, self.nested())?);
        self.flat = None;
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        self.flat.as_ref().map_or(0, |f| 2 * f.len * 4)
    }

    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn write_next_step(&mut self, lr: f64) -> bool {
        let rule = self.rule;
        match self.flat.as_mut() {
            // Laid out, its moments on a CubeCL device, updated there.
            Some(flat)
                if !self.host_update
                    && matches!(flat.moments, Moments::Device(_))
                    && super::runs_cubecl(&flat.device) =>
            {
                on_device::write_next_tables(flat, rule, lr);
                true
            }
            _ => false,
        }
    }

    fn count_replayed_step(&mut self) {
        if let Some(flat) = self.flat.as_mut() {
            flat.time += 1;
        }
    }
}
