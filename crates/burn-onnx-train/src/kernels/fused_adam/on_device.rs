//! The fused update on a CubeCL device: each group of the layout (`layout.rs`) gets its
//! gradients laid end to end in one buffer (one launch per four parameters), a clipped or
//! loss-scaled update measures them all (one launch per group and one for the factor),
//! and one launch per group (three for LAMB) updates the group's flat parameters and
//! moments in place; the module's parameters become views of the flat parameters, so the
//! next update finds them laid out already.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_ort_dist::DistResult;
use burn_ort_dist::update::grad_norm::GradNorm;
use burn_ort_dist::update::zero::flat_optim::{AdamStep, Rule};

use super::layout::{Group, Slot};
use super::{Flat, FusedAdam, Moments};
use crate::kernels::FLAT_CHUNK as CHUNK;
use crate::kernels::cube_optim::ClipMode;

/// A small f32 table the update reads, on the device: uploaded again only when its values
/// change, so a layout's constant tables cross to the device once, not every update, and
/// then written over in place, so the table keeps its device buffer (a captured update
/// reads it there).
#[derive(Default)]
struct DeviceTable(Option<(Vec<f32>, Tensor<1>)>);

impl DeviceTable {
    /// The table holding `values`.
    fn holding(&mut self, values: &[f32], device: &Device) -> Tensor<1> {
        if let Some((held, table)) = &mut self.0 {
            if held.as_slice() == values {
                return table.clone();
            }
            if crate::kernels::write_floats(table, values) {
                held.copy_from_slice(values);
                return table.clone();
            }
        }
        let table = Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device);
        self.0 = Some((values.to_vec(), table.clone()));
        table
    }
}

/// The tables of an update: the step's hyperparameters, and each group's chunk starts and
/// per-parameter factors (constant for a layout, but AdamW's factors follow the learning
/// rate).
#[derive(Default)]
pub(super) struct UpdateTables {
    hyper: DeviceTable,
    groups: Vec<[DeviceTable; 2]>,
}

/// The values of the parameters in `ids`, flattened, in visiting order.
struct Values<'a>(&'a [ParamId], Vec<Tensor<1>>);

impl ModuleVisitor for Values<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.0.contains(&param.id) {
            let n: usize = param.val().dims().iter().product();
            self.1.push(param.val().inner().reshape([n]));
        }
    }
}

/// Whether each of `parts` (the group's parameters, flattened, in slot order) is a
/// contiguous view of `laid` at its slot: the same device allocation at the slot's byte
/// offset in the group.
fn views_of(laid: &Tensor<1>, parts: &[Tensor<1>], slots: &[Slot], group: &Group) -> bool {
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
                    && start(&p) == start(&laid) + group.offset_of(slot) as u64 * bytes
                    && p.shape().num_elements() == slot.len
                    && p.is_contiguous()
            })
        })
}

/// Takes the values of the parameters in `ids` out of the module, leaving each a view
/// of the one-element `spare` (with its `require_grad`), so that the flat buffers they
/// were views of are the update's alone and it writes them in place: the parameters keep
/// their device buffers from update to update (a captured update's replays rely on it).
struct Vacate<'a> {
    ids: &'a [ParamId],
    spare: Tensor<1>,
}

impl ModuleMapper for Vacate<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !self.ids.contains(&param.id) {
            return param;
        }
        let spare = self.spare.clone();
        param.map(|t| {
            let require = t.is_require_grad();
            Tensor::from_inner(spare.reshape([1; D])).set_require_grad(require)
        })
    }
}

/// Puts the updated values back, as views of their group's flat buffer.
struct Scatter<'a> {
    /// Each parameter's slot, its group's flat parameters and its offset in them.
    places: HashMap<ParamId, (&'a Slot, &'a Tensor<1>, usize)>,
}

impl ModuleMapper for Scatter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(&(slot, flat, offset)) = self.places.get(&param.id) else {
            return param;
        };
        param.map(|t| {
            let require = t.is_require_grad();
            let shape: [usize; D] = slot.shape.clone().try_into().expect("rank D");
            let part = flat.clone().slice(offset..offset + slot.len).reshape(shape);
            Tensor::from_inner(part).set_require_grad(require)
        })
    }
}

/// `parts` (the group's slots' values, in order) laid end to end at their offsets in the
/// group, each followed by zeros to its padded end: one launch per four parts (a `cat`
/// with the padding as parts of its own fills and copies each part and each padding in a
/// launch of its own).
fn laid_end_to_end(
    parts: Vec<Tensor<1>>,
    slots: &[Slot],
    group: &Group,
    device: &Device,
) -> Tensor<1> {
    let mut flat = Tensor::<1>::empty([group.len()], device);
    let mut parts = parts.into_iter();
    for four in slots.chunks(4) {
        let (mut starts, mut ends) = ([0; 4], [0; 4]);
        for (k, s) in four.iter().enumerate() {
            let at = group.offset_of(s);
            (starts[k], ends[k]) = (at, at + s.padded());
        }
        let taken = parts.by_ref().take(four.len()).collect();
        flat = ops::lay_out_four(flat, taken, starts, ends);
    }
    flat
}

/// `grads` (every slot's, in order) laid out a group at a time: each group's originals
/// are dropped once copied, so the copies never sit beside a second whole set.
pub(super) fn laid_in_groups(grads: Vec<Tensor<1>>, flat: &Flat) -> Vec<Tensor<1>> {
    let mut grads = grads.into_iter();
    flat.groups
        .iter()
        .map(|g| {
            let parts = grads.by_ref().take(g.slots.len()).collect();
            laid_end_to_end(parts, &flat.slots[g.slots.clone()], g, &flat.device)
        })
        .collect()
}

/// `[sum of squares, factor, finite]` of the laid-out gradients `laid` (one per group)
/// divided by a loss scale (`unscale` = 1 / scale), for the limit `max_norm`: one launch
/// per group for the partial sums, one for the factor.
fn clip_factor(laid: &[Tensor<1>], flat: &Flat, max_norm: f32, unscale: f32) -> Tensor<1> {
    let mut partials = Tensor::<1>::empty([flat.len / CHUNK], &flat.device);
    for (grads, group) in laid.iter().zip(&flat.groups) {
        partials = ops::chunk_squares(grads.clone(), partials, group.chunk);
    }
    ops::clip_factor(partials, max_norm, unscale)
}

/// The device tables of a step (`step`'s scalars, AdamW's `factors`): the
/// hyper-parameters, and each group's chunk starts and factors. Each is written where it
/// was unless its values are unchanged (a captured update reads them there).
fn tables(
    flat: &mut Flat,
    step: &AdamStep,
    factors: &[f32],
) -> (Tensor<1>, Vec<(Tensor<1>, Tensor<1>)>) {
    let device = flat.device.clone();
    let tables = &mut flat.tables;
    tables
        .groups
        .resize_with(flat.groups.len(), Default::default);
    let hyper = tables.hyper.holding(
        &[
            step.lr,
            step.beta[0],
            step.beta[1],
            step.one_minus_beta[0],
            step.one_minus_beta[1],
            step.correction[0],
            step.correction[1],
            step.epsilon,
        ],
        &device,
    );
    let groups = flat
        .groups
        .iter()
        .zip(&mut tables.groups)
        .map(|(group, [starts_table, factors_table])| {
            // First chunk of every parameter in the group, then the group's chunk count.
            let starts: Vec<f32> = flat.slots[group.slots.clone()]
                .iter()
                .map(|s| (s.chunk - group.chunk) as f32)
                .chain([group.chunks as f32])
                .collect();
            (
                starts_table.holding(&starts, &device),
                factors_table.holding(&factors[group.slots.clone()], &device),
            )
        })
        .collect();
    (hyper, groups)
}

/// Write the tables of `flat`'s next step at `lr` ([`tables`]) without taking it: the
/// launches of a captured update, replayed, read them (see `crate::train::update_graph`).
pub(super) fn write_next_tables(flat: &mut Flat, rule: Rule, lr: f64) {
    flat.time += 1;
    let (step, factors) = super::step_scalars(rule, flat, lr);
    flat.time -= 1;
    tables(flat, &step, &factors);
}

/// The update of every group, its gradients `grads` laid out already
/// ([`laid_in_groups`]; with the clip buffer of [`clip_factor`] when clipped): per group
/// one launch (three for LAMB) over its parameters (laid end to end unless they are the
/// views of the last update's) and its moments; the module's parameters put back as views
/// of the flat results.
pub(super) fn update<M: Module>(
    flat: &mut Flat,
    module: M,
    (grads, clip): (Vec<Tensor<1>>, Option<(Tensor<1>, ClipMode)>),
    step: AdamStep,
    factors: &[f32],
    rule: Rule,
) -> M {
    let device = flat.device.clone();
    let ids: Vec<ParamId> = flat.slots.iter().map(|s| s.id).collect();
    let mut values = Values(&ids, Vec::new());
    module.visit(&mut values);
    let mut values = values.1.into_iter();
    let spare = Tensor::<1>::empty([1], &device);
    let module = module.map(&mut Vacate { ids: &ids, spare });
    let (hyper, group_tables) = tables(flat, &step, factors);
    let Moments::Device(moments) = &mut flat.moments else {
        unreachable!("FusedAdam::step keeps moments on disk to the CPU update")
    };
    for (k, ((group, grads), (chunk_starts, factors))) in
        flat.groups.iter().zip(grads).zip(group_tables).enumerate()
    {
        let slots = &flat.slots[group.slots.clone()];
        let parts: Vec<Tensor<1>> = values.by_ref().take(slots.len()).collect();
        let laid = flat.laid_params[k]
            .take()
            .filter(|laid| views_of(laid, &parts, slots, group));
        let params = match laid {
            Some(laid) => {
                // Views of it no longer: the update finds it unshared and writes in place.
                drop(parts);
                laid
            }
            None => laid_end_to_end(parts, slots, group, &device),
        };
        // The moments move into the update, which writes them in place.
        let (moment_1, moment_2) = std::mem::replace(
            &mut moments[k],
            (Tensor::empty([0], &device), Tensor::empty([0], &device)),
        );
        let buffers = ops::Buffers {
            params,
            grads,
            moment_1,
            moment_2,
            chunk_starts,
            factors,
            hyper: hyper.clone(),
            clip: clip.clone(),
        };
        let (params, m1, m2) = ops::update(buffers, rule);
        moments[k] = (m1, m2);
        flat.laid_params[k] = Some(params);
    }
    let mut places = HashMap::with_capacity(flat.slots.len());
    for (group, laid) in flat.groups.iter().zip(&flat.laid_params) {
        let laid = laid.as_ref().expect("written above");
        for slot in &flat.slots[group.slots.clone()] {
            places.insert(slot.id, (slot, laid, group.offset_of(slot)));
        }
    }
    module.map(&mut Scatter { places })
}

/// The device of `module`'s first float parameter.
struct FirstDevice(Option<Device>);

impl ModuleVisitor for FirstDevice {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.0.is_none() {
            self.0 = Some(param.val().device());
        }
    }
}

impl FusedAdam {
    /// The update on a CubeCL device with the gradients measured first: laid out, their
    /// sum of squares and clip factor (divided by a loss scale too: `unscale` = 1 /
    /// scale) on the device, then the update, which reads the factor as `mode` says.
    /// Returns the module and the clip buffer `[sum of squares, factor, finite]`; nothing
    /// is read back.
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
        let laid = laid_in_groups(grads, flat);
        let clip = clip_factor(&laid, flat, max_norm, unscale);
        let grads_and_clip = (laid, Some((clip.clone(), mode)));
        let module = update(flat, module, grads_and_clip, step, &factors, rule);
        Ok((module, clip))
    }

    /// [`burn_ort_dist::ReplicaOptimizer::step_clipped`] on a CubeCL device: the norm
    /// stays on the device until a report reads it.
    pub(super) fn step_clipped_on_device<M: Module>(
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

    /// [`burn_ort_dist::ReplicaOptimizer::step_scaled`] on a CubeCL device: the gradients
    /// divided by `scale` by the factor that clips them, and the update writing nothing
    /// when their sum of squares is not finite. The clip buffer is read once the update is
    /// launched (the next forward's loss scale depends on it); on overflow the step is not
    /// counted.
    pub(super) fn step_scaled_on_device<M: Module>(
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
    pub(super) fn updates_on_device<M: Module>(&self, module: &M) -> bool {
        let mut first = FirstDevice(None);
        module.visit(&mut first);
        first.0.as_ref().is_some_and(crate::kernels::runs_cubecl)
    }
}

/// The update as a backend extension on CubeCL tensors.
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
        /// The sums of squares of the flat gradient `grads` chunk by chunk, written into
        /// `partials` from entry `first` on; returns `partials` (see
        /// `cube_optim::chunk_squares`).
        fn chunk_squares(
            grads: FloatTensor<Self>,
            partials: FloatTensor<Self>,
            first: usize,
        ) -> FloatTensor<Self>;
        /// `[sum of squares, factor, finite]` of the gradient whose sums of squares per
        /// chunk are `partials`, divided by a loss scale (`unscale` = 1 / scale), for the
        /// limit `max_norm` (see `cube_optim::clip_factor`).
        fn clip_factor(
            partials: FloatTensor<Self>,
            max_norm: f32,
            unscale: f32,
        ) -> FloatTensor<Self>;
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

        fn chunk_squares(
            grads: FloatTensor<Self>,
            partials: FloatTensor<Self>,
            first: usize,
        ) -> FloatTensor<Self> {
            cube_optim::chunk_squares(grads, partials, first)
        }

        fn clip_factor(
            partials: FloatTensor<Self>,
            max_norm: f32,
            unscale: f32,
        ) -> FloatTensor<Self> {
            cube_optim::clip_factor(partials, max_norm, unscale)
        }
    }

    /// See [`MultiTensorOps::chunk_squares`].
    pub fn chunk_squares(grads: Tensor<1>, partials: Tensor<1>, first: usize) -> Tensor<1> {
        Tensor::from_dispatch(<burn::backend::Dispatch as MultiTensorOps>::chunk_squares(
            grads.into_dispatch(),
            partials.into_dispatch(),
            first,
        ))
    }

    /// See [`MultiTensorOps::clip_factor`].
    pub fn clip_factor(partials: Tensor<1>, max_norm: f32, unscale: f32) -> Tensor<1> {
        Tensor::from_dispatch(<burn::backend::Dispatch as MultiTensorOps>::clip_factor(
            partials.into_dispatch(),
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
