//! Adam, AdamW and LAMB over every parameter at once: the "multi-tensor apply" of NVIDIA
//! Apex's FusedAdam/FusedLAMB and DeepSpeed. The parameters and gradients of a step are
//! laid end to end in one flat buffer (each padded to whole chunks); the moments live in
//! two flat buffers across steps; one pass updates it all (three for LAMB: direction,
//! per-parameter trust ratio, update), where Burn's optimizer runs ~15 tensor ops per
//! parameter. On CubeCL devices the pass is one kernel launch (`cube_optim.rs`); on the
//! CPU each parameter is updated in place in its own buffer, the moments flat on the host
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

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::cube_optim::ClipMode;
use super::host_optim::{HostRule, HostSlot, InPlace};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::offload_step;
use burn::backend::flex::Flex;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::module::ModuleMapper;
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

use super::FLAT_CHUNK as CHUNK;

/// One parameter in the flat buffers.
#[derive(Debug, Clone)]
struct Slot {
    id: ParamId,
    shape: Vec<usize>,
    len: usize,
    /// First chunk.
    chunk: usize,
    decay: f32,
}

impl Slot {
    fn offset(&self) -> usize {
        self.chunk * CHUNK
    }
    fn padded(&self) -> usize {
        self.len.div_ceil(CHUNK).max(1) * CHUNK
    }
}

/// Where the two flat moment buffers live.
enum Moments {
    /// Tensors on the training device.
    Device(Tensor<1>, Tensor<1>),
    /// A memory-mapped file (the CPU update only).
    Disk(DiskVectors),
}

/// The flat layout and the device state of a run's optimizer.
struct Flat {
    slots: Vec<Slot>,
    len: usize,
    device: Device,
    moments: Moments,
    time: usize,
    /// The f32 master parameters in host memory, laid out as the moments (the offloaded
    /// update of a model on a GPU; read from the device at its first step).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    master: Option<Vec<f32>>,
    /// The flat parameters the last update on a CubeCL device wrote, whose views the
    /// module's parameters became: laid out already for the next update while they still
    /// are (nothing replaced a value in between).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    laid_params: Option<Tensor<1>>,
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
}

fn invalid(message: String) -> DistError {
    DistError::Invalid { rank: 0, message }
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
                .map(Cow::Owned)
                .map_err(|e| invalid(format!("cannot read the optimizer state: {e}")))
        };
        Ok(Some(match &flat.moments {
            Moments::Device(a, b) => (host(a)?, host(b)?),
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
        })
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
        let mut moments = match &self.offload_dir {
            Some(dir) => Moments::Disk(DiskVectors::create(dir, 2, len).map_err(|e| {
                invalid(format!(
                    "optimizer moments on disk under {}: {e}",
                    dir.display()
                ))
            })?),
            None => Moments::Device(Tensor::empty([0], &device), Tensor::empty([0], &device)),
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
            let upload = |v: Vec<f32>| {
                let n = v.len();
                Tensor::<1>::from_data(TensorData::new(v, [n]), &device)
            };
            moments = Moments::Device(upload(host_m1), upload(host_m2));
        }
        Ok(Flat {
            moments,
            slots,
            len,
            device,
            time,
            master: None,
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            laid_params: None,
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

/// The values of the parameters in `ids`, flattened, in visiting order.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
struct Values<'a>(&'a [ParamId], Vec<Tensor<1>>);

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ModuleVisitor for Values<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.0.contains(&param.id) {
            let n: usize = param.val().dims().iter().product();
            self.1.push(param.val().inner().reshape([n]));
        }
    }
}

/// Whether each of `parts` (the parameters, flattened, in slot order) is a contiguous view
/// of `laid` at its slot: the same device allocation at the slot's byte offset.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn views_of(laid: &Tensor<1>, parts: &[Tensor<1>], slots: &[Slot]) -> bool {
    use burn::backend::{Cube, TensorMetadata};
    let cube = |t: &Tensor<1>| t.clone().inner().try_into_primitive::<Cube>().ok();
    let Some(laid) = cube(laid) else {
        return false;
    };
    let memory = |t: &burn_cubecl::tensor::CubeTensor| t.handle.memory.clone().binding().id();
    let start = |t: &burn_cubecl::tensor::CubeTensor| t.handle.offset_start.unwrap_or(0);
    let bytes = laid.dtype.size() as u64;
    parts.len() == slots.len()
        && parts.iter().zip(slots).all(|(part, slot)| {
            cube(part).is_some_and(|p| {
                memory(&p) == memory(&laid)
                    && start(&p) == start(&laid) + slot.offset() as u64 * bytes
                    && p.shape().num_elements() == slot.len
                    && p.is_contiguous()
            })
        })
}

/// Puts the updated values back, as views of the flat buffer.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
struct Scatter<'a> {
    flat: &'a Tensor<1>,
    slots: HashMap<ParamId, &'a Slot>,
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ModuleMapper for Scatter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(slot) = self.slots.get(&param.id).copied() else {
            return param;
        };
        let flat = self.flat;
        param.map(|t| {
            let require = t.is_require_grad();
            let shape: [usize; D] = slot.shape.clone().try_into().expect("rank D");
            let part = flat
                .clone()
                .slice(slot.offset()..slot.offset() + slot.len)
                .reshape(shape);
            Tensor::from_inner(part).set_require_grad(require)
        })
    }
}

/// `parts` laid end to end at their slots' offsets, each followed by zeros to its padded
/// end, in a buffer of `len` values: one launch per four parts (a `cat` with the padding
/// as parts of its own fills and copies each part and each padding in a launch of its
/// own).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn laid_end_to_end(
    parts: Vec<Tensor<1>>,
    slots: &[Slot],
    len: usize,
    device: &Device,
) -> Tensor<1> {
    let mut flat = Tensor::<1>::empty([len], device);
    let mut parts = parts.into_iter();
    for group in slots.chunks(4) {
        let (mut starts, mut ends) = ([0; 4], [0; 4]);
        for (k, s) in group.iter().enumerate() {
            (starts[k], ends[k]) = (s.offset(), s.offset() + s.padded());
        }
        let four = parts.by_ref().take(group.len()).collect();
        flat = ops::lay_out_four(flat, four, starts, ends);
    }
    flat
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
        Moments::Device(t1, t2) => {
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

/// The update on a CubeCL device: parameters laid end to end beside the gradients `grads`
/// (laid out already, [`laid_end_to_end`]; with the clip buffer of [`ops::clip_factor`]
/// when clipped), one launch (three for LAMB), the parameters put back as views of the
/// flat result.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn on_device<M: Module>(
    flat: &mut Flat,
    module: M,
    (grads, clip): (Tensor<1>, Option<(Tensor<1>, ClipMode)>),
    step: AdamStep,
    factors: &[f32],
    rule: Rule,
) -> M {
    let device = flat.device.clone();
    let ids: Vec<ParamId> = flat.slots.iter().map(|s| s.id).collect();
    let mut values = Values(&ids, Vec::new());
    module.visit(&mut values);
    let params = match flat.laid_params.take() {
        Some(laid) if views_of(&laid, &values.1, &flat.slots) => laid,
        _ => laid_end_to_end(values.1, &flat.slots, flat.len, &device),
    };
    let hyper = [
        step.lr,
        step.beta[0],
        step.beta[1],
        step.one_minus_beta[0],
        step.one_minus_beta[1],
        step.correction[0],
        step.correction[1],
        step.epsilon,
    ];
    let upload =
        |v: &[f32]| Tensor::<1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device);
    // First chunk of every parameter, then the chunk count.
    let starts: Vec<f32> = flat
        .slots
        .iter()
        .map(|s| s.chunk as f32)
        .chain([(flat.len / CHUNK) as f32])
        .collect();
    // The moments move into the update, which writes them in place.
    let Moments::Device(moment_1, moment_2) = &mut flat.moments else {
        unreachable!("FusedAdam::step keeps moments on disk to the CPU update")
    };
    let buffers = ops::Buffers {
        params,
        grads,
        moment_1: std::mem::replace(moment_1, Tensor::empty([0], &device)),
        moment_2: std::mem::replace(moment_2, Tensor::empty([0], &device)),
        chunk_starts: upload(&starts),
        factors: upload(factors),
        hyper: upload(&hyper),
        clip,
    };
    let (params, m1, m2) = ops::update(buffers, rule);
    flat.moments = Moments::Device(m1, m2);
    flat.laid_params = Some(params.clone());
    let slots = flat.slots.iter().map(|s| (s.id, s)).collect();
    module.map(&mut Scatter {
        flat: &params,
        slots,
    })
}

/// The device of `module`'s first float parameter.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
struct FirstDevice(Option<Device>);

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ModuleVisitor for FirstDevice {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.0.is_none() {
            self.0 = Some(param.val().device());
        }
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
        // AdamW multiplies the parameter by 1 - lr * decay (in f64, as Burn); Adam and
        // LAMB take the decay itself.
        let factors = flat
            .slots
            .iter()
            .map(|s| match rule {
                Rule::AdamW { .. } => (1.0 - lr * f64::from(s.decay)) as f32,
                _ => s.decay,
            })
            .collect();
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
                let grads = laid_end_to_end(grads, &flat.slots, flat.len, &flat.device);
                return Ok(on_device(flat, module, (grads, None), step, &factors, rule));
            }
        }
        on_host(flat, module, grads, step, &factors, rule)
    }

    /// The update on a CubeCL device with the gradients measured first: laid end to end,
    /// their sum of squares and clip factor (divided by a loss scale too: `unscale` = 1 /
    /// scale) on the device (two launches), then the update, which reads the factor as
    /// `mode` says. Returns the module and the clip buffer `[sum of squares, factor,
    /// finite]`; nothing is read back.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn measured_update_on_device<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
        max_norm: f32,
        (unscale, mode): (f32, ClipMode),
    ) -> DistResult<(M, Tensor<1>)> {
        let (grads, step, factors) = self.begin_step(lr, &module, &mut grads, None)?;
        let rule = self.rule;
        let flat = self.flat.as_mut().expect("laid out by begin_step");
        let grads = laid_end_to_end(grads, &flat.slots, flat.len, &flat.device);
        let clip = ops::clip_factor(grads.clone(), max_norm, unscale);
        let grads_and_clip = (grads, Some((clip.clone(), mode)));
        let module = on_device(flat, module, grads_and_clip, step, &factors, rule);
        Ok((module, clip))
    }

    /// [`ReplicaOptimizer::step_clipped`] on a CubeCL device: the norm stays on the device
    /// until a report reads it.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn step_clipped_on_device<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
    ) -> DistResult<(M, GradNorm)> {
        let measured = (1.0, ClipMode::Scale);
        let (module, clip) =
            self.measured_update_on_device(lr, module, grads, max_norm, measured)?;
        Ok((module, GradNorm::OnDevice(clip)))
    }

    /// [`ReplicaOptimizer::step_scaled`] on a CubeCL device: the gradients divided by
    /// `scale` by the factor that clips them, and the update writing nothing when their sum
    /// of squares is not finite. The clip buffer is read once the update is launched (the
    /// next forward's loss scale depends on it); on overflow the step is not counted.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn step_scaled_on_device<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
        scale: f32,
    ) -> DistResult<(M, GradNorm, bool)> {
        let measured = (1.0 / scale, ClipMode::ScaleOrSkip);
        let (module, clip) =
            self.measured_update_on_device(lr, module, grads, max_norm, measured)?;
        let [squares, _, finite] = GradNorm::read(&clip)?[..] else {
            unreachable!("the clip buffer holds three values")
        };
        if finite != 1.0 {
            if let Some(flat) = self.flat.as_mut() {
                flat.time -= 1;
            }
            return Ok((module, GradNorm::Read(f32::INFINITY), true));
        }
        Ok((module, GradNorm::Read(GradNorm::of_squares(squares)), false))
    }

    /// Whether this step runs on the CubeCL device `module` is on (not offloaded to the
    /// CPU).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn updates_on_device<M: Module>(&self, module: &M) -> bool {
        let mut first = FirstDevice(None);
        module.visit(&mut first);
        first.0.as_ref().is_some_and(super::runs_cubecl)
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
}

/// The update as a backend extension on CubeCL tensors.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod ops {
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Cube, backend_extension};
    use burn::tensor::Tensor;
    use burn_ort_dist::update::zero::flat_optim::Rule;

    use crate::kernels::cube_optim::{self, ClipMode, FlatBuffers};

    pub struct Buffers {
        pub params: Tensor<1>,
        pub grads: Tensor<1>,
        pub moment_1: Tensor<1>,
        pub moment_2: Tensor<1>,
        pub chunk_starts: Tensor<1>,
        pub factors: Tensor<1>,
        pub hyper: Tensor<1>,
        pub clip: Option<(Tensor<1>, ClipMode)>,
    }

    #[backend_extension(Cube)]
    pub trait MultiTensorOps: Backend {
        /// One Adam/AdamW (`lamb` false; `decoupled` for AdamW) or LAMB step over flat
        /// buffers: `(params, moment_1, moment_2)`.
        #[allow(clippy::too_many_arguments)]
        fn multi_tensor_update(
            params: FloatTensor<Self>,
            grads: FloatTensor<Self>,
            moment_1: FloatTensor<Self>,
            moment_2: FloatTensor<Self>,
            chunk_starts: FloatTensor<Self>,
            factors: FloatTensor<Self>,
            hyper: FloatTensor<Self>,
            clip: FloatTensor<Self>,
            mode: ClipMode,
            lamb: bool,
            decoupled: bool,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
        /// `[sum of squares, factor, finite]` of the flat gradient `grads` divided by a
        /// loss scale (`unscale` = 1 / scale) for the limit `max_norm` (see
        /// `cube_optim::clip_factor`).
        fn clip_factor(grads: FloatTensor<Self>, max_norm: f32, unscale: f32) -> FloatTensor<Self>;
        /// Parts `a`, `b`, `c`, `d` written into `flat` at `starts`, zeros after each up
        /// to its `ends` entry (a part whose entries are equal writes nothing); returns
        /// `flat`.
        #[allow(clippy::too_many_arguments)]
        fn lay_out_four(
            flat: FloatTensor<Self>,
            a: FloatTensor<Self>,
            b: FloatTensor<Self>,
            c: FloatTensor<Self>,
            d: FloatTensor<Self>,
            starts: [usize; 4],
            ends: [usize; 4],
        ) -> FloatTensor<Self>;
    }

    impl MultiTensorOps for Cube {
        fn multi_tensor_update(
            params: FloatTensor<Self>,
            grads: FloatTensor<Self>,
            moment_1: FloatTensor<Self>,
            moment_2: FloatTensor<Self>,
            chunk_starts: FloatTensor<Self>,
            factors: FloatTensor<Self>,
            hyper: FloatTensor<Self>,
            clip: FloatTensor<Self>,
            mode: ClipMode,
            lamb: bool,
            decoupled: bool,
        ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
            let b = FlatBuffers {
                params,
                grads,
                moment_1,
                moment_2,
                chunk_starts,
                factors,
                hyper,
                clip: mode.scales().then_some((clip, mode)),
            };
            if lamb {
                cube_optim::lamb(b)
            } else {
                cube_optim::adam(b, decoupled)
            }
        }

        fn lay_out_four(
            flat: FloatTensor<Self>,
            a: FloatTensor<Self>,
            b: FloatTensor<Self>,
            c: FloatTensor<Self>,
            d: FloatTensor<Self>,
            starts: [usize; 4],
            ends: [usize; 4],
        ) -> FloatTensor<Self> {
            cube_optim::lay_out_four(flat, [a, b, c, d], starts, ends)
        }

        fn clip_factor(grads: FloatTensor<Self>, max_norm: f32, unscale: f32) -> FloatTensor<Self> {
            cube_optim::clip_factor(grads, max_norm, unscale)
        }
    }

    /// See [`MultiTensorOps::clip_factor`].
    pub fn clip_factor(grads: Tensor<1>, max_norm: f32, unscale: f32) -> Tensor<1> {
        Tensor::from_dispatch(<burn::backend::Dispatch as MultiTensorOps>::clip_factor(
            grads.into_dispatch(),
            max_norm,
            unscale,
        ))
    }

    /// See [`MultiTensorOps::lay_out_four`].
    pub fn lay_out_four(
        flat: Tensor<1>,
        parts: Vec<Tensor<1>>,
        starts: [usize; 4],
        ends: [usize; 4],
    ) -> Tensor<1> {
        // A missing part is bound as the first again and writes nothing (start = end).
        let part = |k: usize| parts.get(k).unwrap_or(&parts[0]).clone().into_dispatch();
        Tensor::from_dispatch(<burn::backend::Dispatch as MultiTensorOps>::lay_out_four(
            flat.into_dispatch(),
            part(0),
            part(1),
            part(2),
            part(3),
            starts,
            ends,
        ))
    }

    pub fn update(b: Buffers, rule: Rule) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
        // Without a clip buffer the hyper-parameters are bound in its place, never read.
        let (clip, mode) = b.clip.unwrap_or_else(|| (b.hyper.clone(), ClipMode::None));
        let (p, m1, m2) = <burn::backend::Dispatch as MultiTensorOps>::multi_tensor_update(
            b.params.into_dispatch(),
            b.grads.into_dispatch(),
            b.moment_1.into_dispatch(),
            b.moment_2.into_dispatch(),
            b.chunk_starts.into_dispatch(),
            b.factors.into_dispatch(),
            b.hyper.into_dispatch(),
            clip.into_dispatch(),
            mode,
            matches!(rule, Rule::Lamb { .. }),
            matches!(rule, Rule::AdamW { .. }),
        );
        (
            Tensor::from_dispatch(p),
            Tensor::from_dispatch(m1),
            Tensor::from_dispatch(m2),
        )
    }
}
