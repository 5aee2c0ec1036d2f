//! Gradient averaging hidden behind backward (PyTorch DDP's bucketed overlap). A training
//! loop opens an [`OverlappedSync`] for the update from [`DataParallel::overlapped`] and
//! hands it gradients as they become final, which are packed into buckets and averaged on a
//! communication thread while backward goes on: either one at a time from per-parameter
//! hooks inside backward ([`OverlappedSync::reduce_ready`], DDP's way), or a piece at a time
//! from a backward run in pieces, segment by segment from the last layer
//! ([`OverlappedSync::reduce`]). [`OverlappedSync::finish`] waits, puts the averages back
//! and marks them, so the update's `DataParallel::sync` averages only what is left.
//!
//! Buckets are reduced in the order they are submitted, and every rank submits the same
//! buckets in the same order (the same graph finishes its gradients in the same order), so
//! the collectives line up. Only the communication thread calls the communicator while an
//! [`OverlappedSync`] is open (MPI is initialised `Serialized`).

use std::sync::Arc;
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;

use crate::comm::communicator::Communicator;
use crate::error::{DistError, DistResult};
use crate::grads::buckets::bucket_ranges;
use crate::grads::data_parallel::DataParallel;
use crate::grads::grad_sync::{
    FlatGrad, Reduction, flatten, put_flat, reduce_bucket, scatter_back, take_flat,
};

/// Where an update's gradient averaging went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncTimes {
    /// Time the communication thread spent in collectives.
    pub busy: Duration,
    /// Time `finish` waited for them after backward: the communication backward did not
    /// hide.
    pub exposed: Duration,
}

/// The first bucket of gradients handed over one at a time is at most this big, and each
/// next one at most twice the one before, up to the data-parallel bucket size: the last
/// layers' gradients start on the wire early (DDP's small first bucket), and a model whose
/// gradients fit in one ordinary bucket still averages most of them during backward.
const FIRST_BUCKET_BYTES: usize = 1 << 18;

impl DataParallel {
    /// Start averaging one update's gradients during backward (a communication thread; mean
    /// reductions only).
    pub fn overlapped(&self) -> DistResult<OverlappedSync> {
        OverlappedSync::start(self.clone())
    }
}

/// One update's averaging of gradients during backward.
pub struct OverlappedSync {
    ddp: DataParallel,
    reducer: BackgroundReduce,
    in_flight: Vec<Vec<FlatGrad>>,
    /// Gradients handed over one at a time, not yet in a submitted bucket.
    pending: Vec<FlatGrad>,
    pending_bytes: usize,
}

impl OverlappedSync {
    fn start(ddp: DataParallel) -> DistResult<Self> {
        Ok(OverlappedSync {
            reducer: BackgroundReduce::start(ddp.comm().clone(), ddp.reduction())?,
            ddp,
            in_flight: Vec::new(),
            pending: Vec::new(),
            pending_bytes: 0,
        })
    }

    /// Start averaging `grad`, final for this update, once its bucket is full: gradients
    /// handed over one at a time fill buckets in the order they come (256 KiB, then twice
    /// as big each time up to the data-parallel bucket size), and every rank must hand them
    /// over in the same order.
    pub fn reduce_ready(&mut self, grad: FlatGrad) {
        self.pending_bytes += grad.values.len() * std::mem::size_of::<f32>();
        self.pending.push(grad);
        let doublings = self.in_flight.len().min(usize::BITS as usize - 19) as u32;
        let cap = self.ddp.bucket_bytes().min(FIRST_BUCKET_BYTES << doublings);
        if self.pending_bytes >= cap {
            self.submit_pending();
        }
    }

    fn submit_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let part = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        self.reducer.submit(flatten(&part));
        self.in_flight.push(part);
    }

    /// Take out of `grads` the gradients of `module`'s parameters that `ready` selects
    /// (final for this update) and start averaging them, in buckets of the data-parallel
    /// bucket size.
    pub fn reduce<M: Module>(
        &mut self,
        module: &M,
        grads: &mut GradientsParams,
        ready: impl Fn(ParamId) -> bool,
    ) -> DistResult<()> {
        let flat = take_flat(module, grads, ready, self.ddp.comm().rank())?;
        let lens: Vec<usize> = flat.iter().map(|f| f.values.len()).collect();
        let mut flat = flat.into_iter();
        for range in bucket_ranges(&lens, self.ddp.bucket_bytes()) {
            let part: Vec<FlatGrad> = flat.by_ref().take(range.len()).collect();
            self.reducer.submit(flatten(&part));
            self.in_flight.push(part);
        }
        Ok(())
    }

    /// Wait for every bucket, put the averaged gradients into `grads` (on `module`'s
    /// device) and mark them averaged for the coming `DataParallel::sync`.
    pub fn finish<M: Module>(
        mut self,
        module: &M,
        grads: &mut GradientsParams,
    ) -> DistResult<SyncTimes> {
        self.submit_pending();
        let (buckets, times) = self.reducer.finish()?;
        let mut ids = Vec::new();
        for (bucket, mut part) in buckets.into_iter().zip(self.in_flight) {
            scatter_back(&bucket, &mut part);
            ids.extend(part.iter().map(|f| f.id));
            put_flat(module, grads, part);
        }
        self.ddp.mark_reduced(ids);
        Ok(times)
    }
}

/// A communication thread averaging buckets while the caller computes.
struct BackgroundReduce {
    jobs: Option<Sender<Vec<f32>>>,
    worker: Option<JoinHandle<DistResult<(Vec<Vec<f32>>, Duration)>>>,
    rank: usize,
}

impl BackgroundReduce {
    /// Start the thread for one update's buckets over `comm`. Mean reductions only
    /// (f32 or f16 on the wire): Adasum needs every rank's whole tensors at once.
    fn start(comm: Arc<dyn Communicator>, reduction: Reduction) -> DistResult<Self> {
        let rank = comm.rank();
        if reduction == Reduction::Adasum {
            return Err(DistError::Invalid {
                rank,
                message: "Adasum cannot overlap with backward: it combines whole tensors of every rank after backward".into(),
            });
        }
        let (jobs, queue) = channel::<Vec<f32>>();
        let worker = std::thread::Builder::new()
            .name(format!("grad-sync-{rank}"))
            .spawn(move || {
                let (mut done, mut busy) = (Vec::new(), Duration::ZERO);
                for mut bucket in queue {
                    let t = Instant::now();
                    reduce_bucket(comm.as_ref(), &mut bucket, reduction)?;
                    busy += t.elapsed();
                    done.push(bucket);
                }
                Ok((done, busy))
            })
            .map_err(|e| DistError::Invalid {
                rank,
                message: format!("cannot start the gradient communication thread: {e}"),
            })?;
        Ok(BackgroundReduce {
            jobs: Some(jobs),
            worker: Some(worker),
            rank,
        })
    }

    /// Queue `bucket` for averaging. A failure of the thread is reported by
    /// [`Self::finish`].
    fn submit(&self, bucket: Vec<f32>) {
        if let Some(jobs) = &self.jobs {
            // The thread only stops early on a failed collective, which finish() returns.
            let _ = jobs.send(bucket);
        }
    }

    /// Wait for every submitted bucket: the averaged buckets in submission order.
    fn finish(mut self) -> DistResult<(Vec<Vec<f32>>, SyncTimes)> {
        let waited = Instant::now();
        drop(self.jobs.take());
        let worker = self.worker.take().expect("finish runs once");
        let (buckets, busy) = worker.join().map_err(|_| DistError::Invalid {
            rank: self.rank,
            message: "the gradient communication thread panicked".into(),
        })??;
        Ok((
            buckets,
            SyncTimes {
                busy,
                exposed: waited.elapsed(),
            },
        ))
    }
}

impl Drop for BackgroundReduce {
    /// Dropped without [`Self::finish`] (the update failed): close the queue and leave the
    /// thread to end on its own; the failing rank aborts the group, so it cannot wait for
    /// a peer forever.
    fn drop(&mut self) {
        drop(self.jobs.take());
    }
}
