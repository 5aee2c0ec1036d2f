//! ZeRO-1/2's whole-model collectives over contiguous shards, a bucket at a time: the
//! reduce-scatter of the flat gradient and the all-gather of the updated parameters run as
//! one collective per window of [`DEFAULT_BUCKET_BYTES`] of each shard, so what a
//! communicator holds for them (a thread group's shared sum and result, MPI's staging) is a
//! bucket per rank, not the whole model, and the gathered parameters are made as their
//! windows arrive. Every rank's shard has the same length, so every rank runs the same
//! windows.

use std::collections::HashMap;

use burn::module::{Module, ParamId};
use burn::tensor::{Device, Tensor, TensorData};

use super::layout::FlatLayout;
use crate::comm::communicator::{Communicator, ReduceOp};
use crate::error::{DistError, DistResult};
use crate::grads::grad_sync::DEFAULT_BUCKET_BYTES;
use crate::storage::param_swap::{Place, Release};

/// Values per rank in one bucket.
pub const BUCKET: usize = DEFAULT_BUCKET_BYTES / std::mem::size_of::<f32>();

/// The windows `[a, b)` of `bucket` values of a shard of `len` values.
pub(super) fn windows(len: usize, bucket: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len)
        .step_by(bucket.max(1))
        .map(move |a| (a, (a + bucket.max(1)).min(len)))
}

/// `recv` (this rank's shard) = the mean over the ranks of their flat gradients' slices
/// at this rank's shard, `bucket` values of each shard at a time; `fp16` sends f16 on the
/// wire ([`crate::comm::fp16_wire`]). The gradients (one flat tensor per slot of the contiguous
/// `layout`) are read to the host as the windows reach them and dropped once passed.
pub fn reduce_scatter(
    comm: &dyn Communicator,
    layout: &FlatLayout,
    grads: Vec<Option<Tensor<1>>>,
    recv: &mut [f32],
    fp16: bool,
    bucket: usize,
) -> DistResult<()> {
    let shard = recv.len();
    let mut reader = FlatReader::new(layout, grads);
    let mut send = Vec::new();
    for (a, b) in windows(shard, bucket) {
        // Window [a, b) of every rank's shard, end to end: rank r receives its own.
        send.clear();
        for r in 0..comm.world_size() {
            reader.append(r * shard + a..r * shard + b, &mut send)?;
        }
        if fp16 {
            crate::comm::fp16_wire::reduce_scatter(comm, &send, &mut recv[a..b], ReduceOp::Mean)?;
        } else {
            comm.reduce_scatter(&send, &mut recv[a..b], ReduceOp::Mean)?;
        }
    }
    Ok(())
}

/// Reads ranges of a layout's flat buffer from per-slot tensors, each read to the host
/// when a range first reaches it and dropped when every value of it has been read.
struct FlatReader<'a> {
    layout: &'a FlatLayout,
    tensors: Vec<Option<Tensor<1>>>,
    /// Slots read to the host, with the values of them not read yet.
    open: HashMap<usize, (Vec<f32>, usize)>,
}

impl<'a> FlatReader<'a> {
    fn new(layout: &'a FlatLayout, tensors: Vec<Option<Tensor<1>>>) -> Self {
        FlatReader {
            layout,
            tensors,
            open: HashMap::new(),
        }
    }

    /// Append flat values `range` to `out` (zeros for a slot without a tensor and for the
    /// padding past the last slot).
    fn append(&mut self, range: std::ops::Range<usize>, out: &mut Vec<f32>) -> DistResult<()> {
        let start = out.len();
        out.resize(start + range.len(), 0.0);
        let end = range.end.min(self.layout.len);
        let first = self
            .layout
            .slots
            .partition_point(|s| s.offset + s.len <= range.start);
        for (i, s) in self.layout.slots.iter().enumerate().skip(first) {
            if s.offset >= end {
                break;
            }
            let (lo, hi) = (s.offset.max(range.start), (s.offset + s.len).min(end));
            if !self.open.contains_key(&i) {
                let Some(t) = self.tensors[i].take() else {
                    continue;
                };
                let values = super::layout::host(t).map_err(|e| DistError::Invalid {
                    rank: 0,
                    message: format!("cannot read a gradient: {e}"),
                })?;
                self.open.insert(i, (values, s.len));
            }
            let (values, left) = self.open.get_mut(&i).expect("opened above");
            out[start + lo - range.start..start + hi - range.start]
                .copy_from_slice(&values[lo - s.offset..hi - s.offset]);
            *left -= hi - lo;
            if *left == 0 {
                self.open.remove(&i);
            }
        }
        Ok(())
    }
}

/// `module` with its parameters replaced by the values every rank's `mine` (its shard of
/// the contiguous `layout`) holds. The old values are dropped first and each parameter is
/// made as soon as the windows gathered so far complete it, so the host holds the model
/// once (not an old copy, a flat gathered buffer and the new tensors). `bucket` values of
/// each shard at a time.
pub fn gather_params<M: Module>(
    comm: &dyn Communicator,
    layout: &FlatLayout,
    module: M,
    mine: &[f32],
    bucket: usize,
) -> DistResult<M> {
    let mut release = Release::all();
    let module = module.map(&mut release);
    let mut building = Building {
        layout,
        parts: vec![Vec::new(); layout.slots.len()],
        filled: vec![0; layout.slots.len()],
        done: HashMap::new(),
        places: release.devices,
    };
    let shard = mine.len();
    let mut got = Vec::new();
    for (a, b) in windows(shard, bucket) {
        got.resize((b - a) * comm.world_size(), 0.0);
        comm.all_gather(&mine[a..b], &mut got)?;
        for (r, part) in got.chunks(b - a).enumerate() {
            building.add(r * shard + a, part);
        }
    }
    building.finish(comm.rank())?;
    Ok(module.map(&mut Place(building.done)))
}

/// The parameters being filled from gathered windows.
struct Building<'a> {
    layout: &'a FlatLayout,
    /// Each slot's values so far (empty until its first window arrives), and how many
    /// have arrived.
    parts: Vec<Vec<f32>>,
    filled: Vec<usize>,
    /// The finished parameters, flat.
    done: HashMap<ParamId, (Tensor<1>, Vec<usize>)>,
    /// Each parameter's device.
    places: HashMap<ParamId, Device>,
}

impl Building<'_> {
    /// Flat values `values` starting at flat offset `at` (the padding past the last
    /// parameter ignored).
    fn add(&mut self, at: usize, values: &[f32]) {
        let end = (at + values.len()).min(self.layout.len);
        let first = self
            .layout
            .slots
            .partition_point(|s| s.offset + s.len <= at);
        for (i, s) in self.layout.slots.iter().enumerate().skip(first) {
            if s.offset >= end {
                break;
            }
            let (lo, hi) = (s.offset.max(at), (s.offset + s.len).min(end));
            let part = &mut self.parts[i];
            if part.is_empty() {
                part.resize(s.len, 0.0);
            }
            part[lo - s.offset..hi - s.offset].copy_from_slice(&values[lo - at..hi - at]);
            self.filled[i] += hi - lo;
            // A parameter across two shards gets its second part first (the first window
            // of the next shard): it is made when all its values are in.
            if self.filled[i] == s.len
                && let Some(device) = self.places.get(&s.id)
            {
                let values = std::mem::take(part);
                let t = Tensor::<1>::from_data(TensorData::new(values, [s.len]), device);
                self.done.insert(s.id, (t, s.shape.clone()));
            }
        }
    }
}

impl Building<'_> {
    /// Makes the parameters without values (no window touches them) and checks that
    /// every other one was made.
    fn finish(&mut self, rank: usize) -> DistResult<()> {
        for (i, s) in self.layout.slots.iter().enumerate() {
            if self.done.contains_key(&s.id) {
                continue;
            }
            match self.places.get(&s.id) {
                Some(device) if s.len == 0 => {
                    let t = Tensor::<1>::from_data(TensorData::new(Vec::<f32>::new(), [0]), device);
                    self.done.insert(s.id, (t, s.shape.clone()));
                }
                _ => {
                    return Err(DistError::Invalid {
                        rank,
                        message: format!(
                            "ZeRO parameter gather: {} of the {} values of parameter {} arrived",
                            self.filled[i], s.len, s.id
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::module::{Module, Param};
    use burn::tensor::{Device, Tensor, TensorData};

    use super::*;
    use crate::comm::launch::run_threads;

    #[derive(Module, Debug)]
    struct Net {
        a: Param<Tensor<2>>,
        b: Param<Tensor<1>>,
        c: Param<Tensor<1>>,
    }

    /// Parameter `i`'s element `j` is `100 i + j` on rank 0 and `-1` elsewhere.
    fn net(rank: usize) -> Net {
        let device = Device::flex();
        let values = |i: usize, n: usize| -> Vec<f32> {
            (0..n)
                .map(|j| {
                    if rank == 0 {
                        (100 * i + j) as f32
                    } else {
                        -1.0
                    }
                })
                .collect()
        };
        let param = |i: usize, shape: [usize; 1]| {
            let n = shape[0];
            Param::from_tensor(Tensor::from_data(
                TensorData::new(values(i, n), shape),
                &device,
            ))
        };
        Net {
            a: Param::from_tensor(Tensor::from_data(
                TensorData::new(values(0, 6), [2, 3]),
                &device,
            )),
            b: param(1, [1]),
            c: param(2, [4]),
        }
    }

    fn values<const D: usize>(p: &Param<Tensor<D>>) -> (Vec<usize>, Vec<f32>) {
        let t = p.val();
        (
            t.dims().to_vec(),
            t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
        )
    }

    /// Rank 0's whole model, cut into shards that every rank gathers back a bucket at a
    /// time: with buckets of 1, 2, 3 and 100 values (parameters across windows and across
    /// shards: shards of 4 values for 11 with 3 ranks) every rank ends with rank 0's
    /// values and shapes.
    #[test]
    fn gathered_windows_rebuild_every_parameter_on_every_rank() {
        let want = net(0);
        for bucket in [1, 2, 3, 100] {
            let results = run_threads(3, Duration::from_secs(30), |comm| -> Result<_, String> {
                let module = net(comm.rank());
                let layout = FlatLayout::of(&module, 3);
                let mine = layout
                    .shard_params(&want, comm.rank())
                    .map_err(|e| e.to_string())?;
                let got = gather_params(comm.as_ref(), &layout, module, &mine, bucket)
                    .map_err(|e| e.to_string())?;
                Ok((values(&got.a), values(&got.b), values(&got.c)))
            });
            for r in results {
                assert_eq!(
                    r.unwrap(),
                    (values(&want.a), values(&want.b), values(&want.c)),
                    "bucket {bucket}"
                );
            }
        }
    }

    /// Each rank's shard of the mean of the ranks' flat gradients, a bucket at a time and
    /// read from per-parameter tensors (lengths 4, 7, 1 and 3 for 15 values, shards of 5
    /// with 3 ranks: tensors across windows and shards), equals the shard of the mean
    /// computed here.
    #[test]
    fn bucketed_reduce_scatter_is_the_mean_of_each_shard() {
        let (world, shard, lens) = (3, 5, [4usize, 7, 1, 3]);
        let slots = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| super::super::layout::Slot {
                id: burn::module::ParamId::from(i as u64),
                shape: vec![len],
                offset: 0,
                len,
                trainable: true,
            })
            .collect();
        let layout =
            FlatLayout::from_slots(slots, world, super::super::layout::Partitioning::Contiguous);
        // Element i of rank r's flat gradient is i * (r + 1).
        let grads = |rank: usize| -> Vec<Option<Tensor<1>>> {
            layout
                .slots
                .iter()
                .map(|s| {
                    let v: Vec<f32> = (s.offset..s.offset + s.len)
                        .map(|i| (i * (rank + 1)) as f32)
                        .collect();
                    Some(Tensor::from_data(
                        TensorData::new(v, [s.len]),
                        &Device::flex(),
                    ))
                })
                .collect()
        };
        for bucket in [1, 2, 4, 5, 9] {
            let results = run_threads(
                world,
                Duration::from_secs(30),
                |comm| -> Result<_, String> {
                    let mut mine = vec![0.0; shard];
                    reduce_scatter(
                        comm.as_ref(),
                        &layout,
                        grads(comm.rank()),
                        &mut mine,
                        false,
                        bucket,
                    )
                    .map_err(|e| e.to_string())?;
                    Ok(mine)
                },
            );
            for (rank, r) in results.into_iter().enumerate() {
                // The sum over ranks is i * (1 + 2 + 3); the mean is 2 i.
                let want: Vec<f32> = (rank * shard..(rank + 1) * shard)
                    .map(|i| 2.0 * i as f32)
                    .collect();
                assert_eq!(r.unwrap(), want, "bucket {bucket}, rank {rank}");
            }
        }
    }
}
