//! ZeRO-3 prefetch: the parameter gathers of one forward pass run on a communication
//! thread ahead of the nodes that read them (DeepSpeed's `stage3_prefetch_bucket_size`,
//! FSDP's forward prefetch), so a gather overlaps the computation of the nodes before its
//! parameter's first reader.
//!
//! A pass reads each parameter once, at its first reader, in graph order, and its chunk is
//! known before the pass starts: the thread gathers the chunks in that order, at most
//! `depth` ahead of the pass, into a [`Prefetching`] group that stands in for the sharding
//! group. Its `all_gather` hands out the next gathered parameter (after checking that the
//! op sends the chunk the thread sent); every other collective (the backward's
//! reduce-scatters, after the pass) goes to the group itself. Every rank gathers in the same
//! order, and nothing else uses the group while the thread runs, so the collectives meet
//! as they would inline. The time the thread spent gathering and the time the pass waited
//! for it add up in the model's [`PrefetchTimes`].

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_ort_dist::{Communicator, DistError, DistResult, Forwarding, SyncTimes};

use super::CollectiveGroup;
use crate::value::PhysTensor;

/// The prefetch times of a model's passes since the last [`PrefetchTimes::take`]: the
/// model owns them (`OnnxModel::take_prefetch_times`), its clones add to the same.
#[derive(Debug, Default)]
pub struct PrefetchTimes(Mutex<SyncTimes>);

impl PrefetchTimes {
    /// The times since the last call: `busy`, the thread's time in gathers; `exposed`, the
    /// time the passes waited for them.
    pub fn take(&self) -> SyncTimes {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Add one pass's gathering (`busy`) and waiting (`exposed`).
    fn add(&self, busy: Duration, exposed: Duration) {
        let mut times = self.0.lock().unwrap_or_else(|p| p.into_inner());
        times.busy += busy;
        times.exposed += exposed;
    }
}

/// One gather done ahead: the chunk sent and the whole parameter (or the failure).
struct Gathered {
    sent: Vec<f32>,
    whole: DistResult<Vec<f32>>,
}

/// The sharding group of a pass whose gathers were started ahead.
pub struct Prefetching {
    inner: Arc<dyn Communicator>,
    ahead: Mutex<Option<Receiver<Gathered>>>,
    waited: Mutex<Duration>,
}

impl Prefetching {
    fn invalid(&self, message: String) -> DistError {
        DistError::Invalid {
            rank: self.inner.rank(),
            message,
        }
    }
}

/// Run `pass` with the gathers of `chunks` (this rank's chunk of each parameter, in the
/// order the pass gathers them) started ahead on a thread, at most `depth` ahead, over
/// `group`; `pass` gets the group to use; the thread's and the pass's times go to `times`.
/// A collective of `group`, like the gathers.
pub fn prefetched<R>(
    group: &CollectiveGroup,
    chunks: Vec<PhysTensor>,
    depth: usize,
    times: &PrefetchTimes,
    pass: impl FnOnce(&CollectiveGroup) -> R,
) -> R {
    let (send, receive) = sync_channel::<Gathered>(depth.max(1) - 1);
    let prefetching = Arc::new(Prefetching {
        inner: group.0.clone(),
        ahead: Mutex::new(Some(receive)),
        waited: Mutex::new(Duration::ZERO),
    });
    let stands_in = CollectiveGroup(prefetching.clone());
    let inner = group.0.clone();
    let (out, busy) = std::thread::scope(|s| {
        // The thread gathers every chunk even when the pass stops early (an error): every
        // rank's thread then joins the same collectives, whatever its pass did.
        let thread = s.spawn(move || {
            let mut busy = Duration::ZERO;
            let mut handing_over = true;
            for chunk in chunks {
                let started = Instant::now();
                let sent = host_values(chunk);
                let whole = sent.and_then(|sent| {
                    let mut all = vec![0.0; sent.len() * inner.world_size()];
                    inner.all_gather(&sent, &mut all).map(|()| (sent, all))
                });
                busy += started.elapsed();
                let gathered = match whole {
                    Ok((sent, all)) => Gathered {
                        sent,
                        whole: Ok(all),
                    },
                    Err(e) => Gathered {
                        sent: Vec::new(),
                        whole: Err(e),
                    },
                };
                handing_over = handing_over && send.send(gathered).is_ok();
            }
            busy
        });
        // A pass that panics (a failed gather does) must still let the thread go.
        let out = catch_unwind(AssertUnwindSafe(|| pass(&stands_in)));
        // Whatever the pass did not take is dropped: the thread hands nothing more over.
        prefetching
            .ahead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        (out, thread.join().unwrap_or_default())
    });
    let waited = *prefetching.waited.lock().unwrap_or_else(|p| p.into_inner());
    times.add(busy, waited);
    out.unwrap_or_else(|panic| resume_unwind(panic))
}

/// A chunk's values on the host.
fn host_values(chunk: PhysTensor) -> DistResult<Vec<f32>> {
    burn_ort_dist::collective_host_values(chunk).map_err(|e| DistError::Invalid {
        rank: 0,
        message: format!("ZeRO-3 prefetch: reading a parameter chunk: {e}"),
    })
}

impl Forwarding for Prefetching {
    fn inner(&self) -> &dyn Communicator {
        self.inner.as_ref()
    }

    /// The next parameter gathered ahead.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        let started = Instant::now();
        let next = {
            let ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
            let Some(ahead) = ahead.as_ref() else {
                return Err(self.invalid(
                    "ZeRO-3 prefetch: a gather after the pass it was prefetched for".into(),
                ));
            };
            ahead.recv().map_err(|_| {
                self.invalid("ZeRO-3 prefetch: more gathers than the pass's parameters".into())
            })?
        };
        *self.waited.lock().unwrap_or_else(|p| p.into_inner()) += started.elapsed();
        let whole = next.whole?;
        if next.sent != send || whole.len() != recv.len() {
            return Err(self.invalid(format!(
                "ZeRO-3 prefetch: the pass gathered another parameter ({} values) than the one prefetched next ({} values)",
                send.len(),
                next.sent.len()
            )));
        }
        recv.copy_from_slice(&whole);
        Ok(())
    }
}
