//! Tensor (horizontal) parallelism on ONNX graphs, as Megatron-LM splits transformer
//! layers and ORT's `horizontal_parallel_size` did by rewriting the training graph:
//! [`plan`] finds the column- and row-parallel projections by following splits through
//! the graph, [`vocab`] the token embedding and LM head to split along the vocabulary,
//! [`rewrite`] inserts Megatron's `f`/`g` operators ([`crate::collective::megatron`],
//! with their own backward) and adapts reshapes and splits to local sizes, and each rank keeps its
//! part of the split weights ([`AxisSplit`]); with sequence parallelism ([`sequence_parallel`]) the parts
//! between the blocks run on each rank's slice of the tokens. [`TensorParallel`] does all
//! of it for a run.

pub mod ops;
pub mod plan;
pub mod rewrite;
pub mod sequence_parallel;
/// The old name of [`sequence_parallel`], kept for one release (docs/changelog.md).
#[doc(hidden)]
pub use sequence_parallel as sequence;
pub mod vocab;

use std::collections::BTreeMap;

use burn_ort_dist::Communicator;
use ndarray::ArrayD;

pub use crate::collective::axis_split::AxisSplit;
pub use crate::model::Probe;
pub use plan::SplitPlan;
/// The old name of [`SplitPlan`], kept for one release (docs/changelog.md).
#[doc(hidden)]
pub use plan::SplitPlan as Plan;
pub use sequence_parallel::SequenceParallel;
pub use vocab::VocabShard;

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::value::Value;
use crate::value::host_tensor::into_row_major_vec;

/// This rank's place in a tensor-parallel group and what is split.
#[derive(Debug, Clone)]
pub struct TensorParallel {
    /// Rank in the group.
    pub rank: usize,
    /// Group size.
    pub size: usize,
    /// The split parameters, by ONNX name.
    pub params: BTreeMap<String, AxisSplit>,
    /// Column-parallel projections found (node names), for the log and `inspect`.
    pub blocks: Vec<String>,
    /// The slice of the vocabulary this rank's logits hold, when the head is split.
    pub vocab: Option<VocabShard>,
    /// What runs on sequence slices, with sequence parallelism.
    pub sequence: Option<SequenceParallel>,
}

/// What a tensor-parallel split may cut besides Megatron's blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SplitOptions {
    /// Run a graph in which nothing splits replicated instead of failing.
    pub allow_replicated: bool,
    /// Split token embeddings along the vocabulary (Megatron's `VocabParallelEmbedding`),
    /// and the head of `vocab_head`.
    pub vocab_parallel: bool,
    /// With `vocab_parallel`, the graph output a cross-entropy reads: the head producing
    /// it is split along the vocabulary too, and the output then holds this rank's slice
    /// of the logits only (the loss must be [`crate::collective::vocab`]'s).
    pub vocab_head: Option<String>,
    /// Megatron's sequence parallelism: between the blocks each rank holds its slice of
    /// the tokens ([`sequence_parallel`]).
    pub sequence_parallel: bool,
}

/// The error of a split over `size` ranks that found no Megatron block in `model`: the
/// rank counts its blocks do split over (a count that divides the heads and widths), so
/// the user can pick one, as Megatron refuses a tensor-parallel size that does not divide
/// the attention heads.
fn no_block(model: &OnnxModel, probe: &Probe, size: usize, source: &str, vocab: bool) -> OnnxError {
    let splits_at: Vec<String> = (2..=8)
        .filter(|&n| n != size && !plan::plan(model, probe, n).starts.is_empty())
        .map(|n| n.to_string())
        .collect();
    let hint = if splits_at.is_empty() {
        "nothing to split".to_string()
    } else {
        format!(
            "its blocks split over {} ranks (sizes that divide its heads and widths)",
            splits_at.join(", ")
        )
    };
    let vocab = if vocab {
        " (the vocabulary split alone would leave every block whole on every rank)"
    } else {
        ""
    };
    OnnxError::field(
        "horizontal_parallel_size",
        format!(
            "no Megatron block (MatMul/Gemm on a 2-D weight -> ... -> MatMul/Gemm contracting its split axis) splits over {size} ranks in {source}{vocab}: {hint}; set tensor_parallel_allow_replicated to run it replicated"
        ),
    )
}

impl TensorParallel {
    /// Plan `model` (the whole model) for `size` ranks from a probe on `sample` inputs,
    /// and return rank `rank`'s model. A graph with nothing to split is an error unless
    /// `options.allow_replicated`.
    pub fn apply(
        model: OnnxModel,
        sample: Vec<(String, Value)>,
        rank: usize,
        size: usize,
        options: &SplitOptions,
    ) -> Result<(OnnxModel, TensorParallel)> {
        let probe = model.probe(sample)?;
        let mut plan = plan::plan(&model, &probe, size);
        if options.vocab_parallel {
            let in_block = |i: usize| plan.region.contains(&i) || plan.starts.contains(&i);
            let blocks = vocab::Blocks {
                params: &plan.params,
                contains: &in_block,
            };
            plan.vocab = vocab::plan(&model, size, &blocks, options.vocab_head.as_deref());
            if let Some((head, _)) = plan.vocab.head {
                plan.copies
                    .insert(model.graph().nodes[head].inputs[0].clone());
            }
        }
        let source = model
            .graph()
            .source
            .as_ref()
            .map_or_else(|| "the model".to_string(), |p| p.display().to_string());
        if plan.starts.is_empty() && !options.allow_replicated {
            return Err(no_block(
                &model,
                &probe,
                size,
                &source,
                options.vocab_parallel,
            ));
        }
        let blocks: Vec<String> = plan
            .starts
            .iter()
            .map(|&i| model.graph().nodes[i].name.clone())
            .collect();
        let mut graph = rewrite::rewrite(model.graph(), &plan)?;
        let sequence = if options.sequence_parallel {
            let known = plan::Known {
                model: &model,
                probe: &probe,
            };
            let (g, seq) = sequence_parallel::rewrite(&graph, &known, size)?;
            if seq.scatters == 0 {
                return Err(OnnxError::field(
                    "tensor_parallel_sequence",
                    format!(
                        "no block output of {source} splits along a sequence axis over {size} ranks"
                    ),
                ));
            }
            graph = g;
            Some(seq)
        } else {
            None
        };
        let vocab = plan.vocab.shard(model.graph(), rank, size);
        let params = plan.all_params();
        let parts: BTreeMap<_, _> = params
            .iter()
            .map(|(name, split)| (name.clone(), move |full: &_| split.slice(full, rank, size)))
            .collect();
        let model = model
            .into_tensor_parallel(graph, &parts)?
            .with_vocab_shard(vocab.clone());
        Ok((
            model,
            TensorParallel {
                rank,
                size,
                params,
                blocks,
                vocab,
                sequence,
            },
        ))
    }

    /// Parameter `name`'s full values on rank 0 of `group` (`None` on the others), from
    /// each rank's `local` part of it (whole, not ZeRO-3 chunks). A collective of the
    /// group for a split parameter; one that is not split is rank 0's own.
    pub fn gather_param(
        &self,
        name: &str,
        local: ArrayD<f32>,
        group: &dyn Communicator,
    ) -> Result<Option<ArrayD<f32>>> {
        let Some(split) = self.params.get(name) else {
            return Ok((self.rank == 0).then_some(local));
        };
        let shape = local.raw_dim();
        let send = into_row_major_vec(local);
        let mut recv = vec![0f32; send.len() * self.size];
        group.all_gather(&send, &mut recv)?;
        if self.rank != 0 {
            return Ok(None);
        }
        let parts: Vec<_> = recv
            .chunks(send.len())
            .map(|c| {
                ArrayD::from_shape_vec(shape.clone(), c.to_vec())
                    .map_err(|e| OnnxError::field(name, e.to_string()))
            })
            .collect::<Result<_>>()?;
        Ok(Some(split.assemble(&parts)))
    }
}
