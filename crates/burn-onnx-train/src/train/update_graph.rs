//! The update replayed as one recorded device graph (`train.cuda_graph`; PyTorch's CUDA
//! graphs under `torch.compile(mode="reduce-overhead")`, Megatron's `--enable-cuda-graph`).
//! A GPU update is ~800 kernel launches that the host issues at ~13 us each; once recorded
//! (`kernels::device_graph`), a replay issues them all at once and the update costs the
//! device's time alone.
//!
//! The first update runs as usual (it lays out the optimizer's flat buffers, and the
//! passes upload their constants once: `value::uploads`); the allocator is prepared before
//! the second, which also runs as usual and counts what its passes still upload; the
//! third is recorded and replayed, and every later one is replayed. A replay reads and
//! writes the buffers the recording did, so everything an update takes from the host
//! is written over those buffers before it: the batch's token ids and next-token targets
//! (seeds of the model's uploads, found by the passes by content), and the optimizer's
//! learning rate, bias corrections and decay factors (its tables, written where they
//! are). What an update leaves is where the recording left it: the parameters and
//! moments, written in place by the fused update (checked after the recording: a
//! parameter at another place turns the replays off), and the losses and the gradient
//! norm, copied after each replay for the reports.
//!
//! Where a run cannot be recorded it trains as usual, with one line saying why: more than
//! one rank, not a CubeCL device, a loss other than the next-token cross-entropy on
//! windows of token ids, random ops (a recorded seed would repeat its masks), a loss
//! scale or per-weight norms (both read the device each update), an optimizer not fused
//! on the device, passes that upload per-batch values other than the seeds.

use burn::tensor::{Device, Tensor};

use super::config::TrainingConfig;
use super::data::{Batch, Target};
use crate::kernels::device_graph::DeviceGraph;
use crate::model::OnnxModel;
use crate::model::loss::{LossKind, next_token_targets, target_rows};
use crate::value::host_tensor::HostTensor;
use crate::value::uploads::{DeviceUploads, Made};

/// Ops whose values depend on a seed the recording would keep.
const RANDOM_OPS: [&str; 7] = [
    "Dropout",
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
];

/// Updates run as usual before the recording: the first lays out, the second warms up.
const WARM_UPDATES: usize = 2;

/// The recorded update of a run, and where the run is with it.
pub(super) struct UpdateGraph {
    phase: Phase,
    /// Updates run as usual so far.
    plain: usize,
    /// Whether the allocator was prepared for a recording not made yet.
    prepared: bool,
}

enum Phase {
    /// Updates run as usual until the recording.
    Warming,
    Recorded(Box<Recorded>),
    Off,
}

/// A recorded update, with what its replays read and write.
pub(super) struct Recorded {
    /// The launches.
    pub graph: DeviceGraph,
    /// The shape of the batches' token ids it was recorded for.
    pub shape: Vec<usize>,
    /// Each micro-step's loss as the recording writes it.
    pub losses: Vec<Tensor<1>>,
    /// The gradient norm's buffer as the recording writes it.
    pub norm: Option<Tensor<1>>,
    /// The device copies the recording reads (kept alive while it may be replayed).
    pub _held: Vec<Made>,
}

/// What the next update does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// Runs as usual.
    Plain,
    /// Runs as usual, the allocator prepared for the recording first.
    Warm,
    /// Is recorded, then replayed.
    Record,
    /// Is a replay.
    Replay,
}

impl UpdateGraph {
    /// The recorded update `c` asks for (`train.cuda_graph`), unless the run cannot take
    /// one, which is said once; `None` when not asked for.
    pub fn for_run(
        c: &TrainingConfig,
        world_size: usize,
        device: &Device,
        model: &OnnxModel,
        loss_scaled: bool,
    ) -> Option<Self> {
        if !c.train.cuda_graph {
            return None;
        }
        let random = model
            .graph()
            .nodes
            .iter()
            .find(|n| RANDOM_OPS.contains(&n.op_type.as_str()));
        let refused = if world_size != 1 {
            Some(format!("{world_size} ranks (one only)"))
        } else if !crate::kernels::runs_cubecl(device) {
            Some(format!("{device:?} is not a CubeCL device"))
        } else if c.model.loss != LossKind::LmCrossEntropy {
            Some(format!(
                "the loss is {:?}, not the next-token cross-entropy",
                c.model.loss
            ))
        } else if let Some(node) = random {
            Some(format!(
                "node '{}' ({}) draws random numbers",
                node.name, node.op_type
            ))
        } else if loss_scaled {
            Some("a loss scale reads the device each update".into())
        } else if !c.logging.norm_weights.is_empty() {
            Some("logging.norm_weights reads per-weight norms".into())
        } else {
            None
        };
        if let Some(why) = &refused {
            tracing::warn!(reason = %why, "train.cuda_graph: the updates run as usual");
        }
        refused.is_none().then_some(UpdateGraph {
            phase: Phase::Warming,
            plain: 0,
            prepared: false,
        })
    }

    /// What the next update does.
    pub fn next(&self) -> Next {
        match (&self.phase, self.plain) {
            (Phase::Warming, n) if n + 1 < WARM_UPDATES => Next::Plain,
            (Phase::Warming, n) if n + 1 == WARM_UPDATES => Next::Warm,
            (Phase::Warming, _) => Next::Record,
            (Phase::Recorded(_), _) => Next::Replay,
            (Phase::Off, _) => Next::Plain,
        }
    }

    /// An update ran as usual.
    pub fn ran_plain(&mut self) {
        self.plain += 1;
    }

    /// The allocator was prepared for the recording (`true`), or the recording closed.
    pub fn set_prepared(&mut self, prepared: bool) {
        self.prepared = prepared;
    }

    /// Keep `recorded` for the next updates.
    pub fn keep(&mut self, recorded: Recorded) {
        tracing::info!(
            micro_steps = recorded.losses.len(),
            "train.cuda_graph: the update is recorded; the next ones are replays"
        );
        self.phase = Phase::Recorded(Box::new(recorded));
    }

    /// The recording, once kept.
    pub fn recorded(&self) -> Option<&Recorded> {
        match &self.phase {
            Phase::Recorded(r) => Some(r),
            _ => None,
        }
    }

    /// Stop recording or replaying, saying why; later updates run as usual. Whether the
    /// allocator was prepared for a recording that now will not come (to be closed).
    pub fn turn_off(&mut self, why: &str) -> bool {
        tracing::warn!(reason = %why, "train.cuda_graph: the updates run as usual from here");
        self.phase = Phase::Off;
        std::mem::take(&mut self.prepared)
    }
}

/// Write each micro-step's batch values over its seeds in `uploads` (token ids, and the
/// rows the next-token loss reads): the shape of the token ids, or why the batches cannot
/// be seeded (not token windows, or shapes that differ).
pub(super) fn seed_batches(
    uploads: &DeviceUploads,
    batches: &[Batch],
    device: &Device,
) -> Result<Vec<usize>, String> {
    let mut shape = None;
    for (m, batch) in batches.iter().enumerate() {
        let (HostTensor::Int(ids), Target::NextToken) = (&batch.input, &batch.target) else {
            return Err("a batch is not a window of token ids with next-token targets".into());
        };
        if *shape.get_or_insert_with(|| ids.shape().to_vec()) != ids.shape() {
            return Err(format!(
                "a batch of shape {:?} among {:?}",
                ids.shape(),
                shape
            ));
        }
        let flat: Vec<i64> = ids.iter().copied().collect();
        uploads.seed_ints(("token ids", m), &flat, device);
        let rows = target_rows(&next_token_targets(ids));
        uploads.seed_ints(("target rows", m), &rows, device);
    }
    shape.ok_or_else(|| "no batch".into())
}

/// A copy of `t` in a buffer of its own (a recording's output, which the next replay
/// writes over).
pub(super) fn snapshot(t: &Tensor<1>) -> Tensor<1> {
    // `t` is held by the recording too, so the addition writes a new buffer.
    t.clone().add_scalar(0.0)
}
