//! In-process communicator: one rank per thread, shared memory.
//!
//! Collectives meet at a generation-counted rendezvous: every rank deposits its
//! contribution under a mutex, the last to arrive completes the collective, and all leave
//! with the result. A rank that aborts (its thread returned an error) or panics marks the
//! group broken and wakes everyone, so the others fail at once with an error naming it; a
//! rank that finishes leaves the group, which fails only what needs it (a collective, a
//! message from it or to it: point-to-point patterns finish rank by rank); a rank that
//! stops answering makes the others fail after `timeout`
//! (`Duration::MAX`: never, for launchers where a live rank is a working rank), with an
//! error naming the operation, its bytes, the group and the ranks that never arrived.
//!
//! Tensors on a GPU ([`DeviceCollectives`], [`DeviceSends`]) are exchanged as handles: the
//! last rank to arrive adds (or concatenates) the deposited tensors in rank order on its
//! device, and every other rank copies the result on its own stream (to its own device if
//! it has another); a message is the tensor itself, copied by the receiver. Each rank
//! waits for its stream before it hands a tensor over and after it copies one: cubecl's
//! streams share one memory pool, so a buffer another stream may still read must not go
//! back to it. Nothing passes through host memory. CPU tensors keep the host collectives.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};

use crate::comm::communicator::{
    Communicator, DeviceCollectives, DeviceSends, ReduceOp, check_reduce_scatter, scale_mean,
};
use crate::comm::stall::{OpInfo, Stall, trace_done};
use crate::error::{DistError, DistResult};

struct State {
    generation: u64,
    arrived: usize,
    /// Sum (or concatenation) being built for the current generation.
    acc: Vec<f32>,
    /// The finished result of the previous generation.
    result: Arc<Vec<f32>>,
    /// Set when a rank failed; the group is unusable afterwards.
    broken: Option<String>,
    /// Ranks that finished and dropped their communicator.
    left: Vec<bool>,
    /// Ranks inside a collective of the current generation (arrived, not yet gone).
    inside: Vec<bool>,
    /// Point-to-point messages in flight, by (source, destination).
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
    /// Device tensors deposited for the current device collective, in rank order.
    tensors: Vec<Tensor<1>>,
    /// The finished result of the previous device collective.
    tensor_result: Option<Tensor<1>>,
    /// Device tensors sent and not yet received, by (source, destination).
    tensor_mail: HashMap<(usize, usize), VecDeque<Tensor<1>>>,
    /// Sub-groups made by `split`, by (split number, colour), created by their first member.
    splits: HashMap<(usize, usize), Arc<Shared>>,
}

struct Shared {
    world: usize,
    /// The members' ranks in the first group (the world), in this group's rank order.
    world_ranks: Vec<usize>,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group.
pub struct ThreadCommunicator {
    rank: usize,
    shared: Arc<Shared>,
    /// How many splits this rank has made (every rank splits in the same order).
    splits_done: AtomicUsize,
}

impl ThreadCommunicator {
    /// Create a group of `world` ranks; hand one to each thread.
    pub fn group(world: usize, timeout: Duration) -> Vec<ThreadCommunicator> {
        let shared = Shared::new((0..world).collect(), timeout);
        (0..world)
            .map(|rank| ThreadCommunicator::member(rank, shared.clone()))
            .collect()
    }

    fn member(rank: usize, shared: Arc<Shared>) -> Self {
        ThreadCommunicator {
            rank,
            shared,
            splits_done: AtomicUsize::new(0),
        }
    }

    /// Operation `op` of `bytes` in this group, for reports and traces.
    fn info<'s>(&'s self, op: &'s str, bytes: usize) -> OpInfo<'s> {
        OpInfo {
            op,
            bytes,
            group: &self.shared.world_ranks,
        }
    }

    /// Wait on the group's condition variable until `ready` holds, the group breaks, a rank
    /// the wait needs (`peer`; `None`: every rank) leaves, or the timeout passes.
    fn wait_until<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        info: OpInfo<'_>,
        peer: Option<usize>,
        mut ready: impl FnMut(&mut State) -> bool,
    ) -> DistResult<MutexGuard<'a, State>> {
        // `Duration::MAX` (no deadline): wait as long as the peers live; a departed peer
        // fails the wait, so only a live but stuck rank could make this wait forever.
        let start = Instant::now();
        let deadline = start.checked_add(self.shared.timeout);
        while !ready(&mut st) {
            if let Some(b) = &st.broken {
                return Err(self.peer(b.clone()));
            }
            self.check_present(&st, peer)?;
            let now = Instant::now();
            let Some(deadline) = deadline else {
                st = self
                    .shared
                    .cv
                    .wait(st)
                    .map_err(|_| self.peer("lock poisoned".into()))?;
                continue;
            };
            if now >= deadline {
                let err = self.stalled(&st, info, peer, now - start);
                st.broken = Some(err.to_string());
                self.shared.cv.notify_all();
                return Err(err);
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .map_err(|_| self.peer("lock poisoned".into()))?
                .0;
        }
        Ok(st)
    }

    /// The timeout error of a wait for `peer` (`None`: every rank of the collective).
    fn stalled(
        &self,
        st: &State,
        info: OpInfo<'_>,
        peer: Option<usize>,
        waited: Duration,
    ) -> DistError {
        let absent = match peer {
            Some(p) => vec![p],
            None => (0..self.shared.world)
                .filter(|&r| r != self.rank && !st.inside[r])
                .collect(),
        };
        Stall {
            info,
            waited,
            absent: absent.iter().map(|&r| self.shared.world_ranks[r]).collect(),
            elsewhere: Vec::new(),
        }
        .into_error(self.shared.world_ranks[self.rank])
    }

    /// An error when rank `peer` (`None`: any rank) has left the group.
    fn check_present(&self, st: &State, peer: Option<usize>) -> DistResult<()> {
        let gone = match peer {
            Some(p) => st.left[p].then_some(p),
            None => st.left.iter().position(|l| *l),
        };
        match gone {
            Some(r) => Err(self.peer(format!("rank {r} left the group"))),
            None => Ok(()),
        }
    }

    fn lock(&self) -> DistResult<MutexGuard<'_, State>> {
        self.shared
            .state
            .lock()
            .map_err(|_| self.peer("the group's lock was poisoned by a panicking rank".into()))
    }

    fn peer(&self, message: String) -> DistError {
        DistError::Peer {
            rank: self.rank,
            message,
        }
    }

    /// Contribute with `deposit`, wait for everyone, return the finished result. Ranks
    /// deposit in rank order, so sums are added in the same order every time: results are
    /// deterministic, whatever order the threads arrive in.
    fn rendezvous(
        &self,
        op: &str,
        len: usize,
        deposit: impl FnOnce(&mut Vec<f32>),
    ) -> DistResult<Arc<Vec<f32>>> {
        let met = self.meet(
            self.info(op, len * std::mem::size_of::<f32>()),
            |st| {
                if st.arrived == 0 {
                    st.acc.clear();
                    st.acc.resize(len, 0.0);
                } else if st.acc.len() != len {
                    return Err(format!(
                        "buffer of {len} elements, but another rank passed {}",
                        st.acc.len()
                    ));
                }
                deposit(&mut st.acc);
                Ok(())
            },
            |st| {
                st.result = Arc::new(std::mem::take(&mut st.acc));
                Ok(())
            },
            |st| st.result.clone(),
        )?;
        Ok(met.0)
    }

    /// One collective's meeting: in rank order each rank `deposit`s its share (a refusal
    /// breaks the group), the last to arrive `complete`s the collective, and every rank
    /// leaves with what `result` reads, and whether it completed it.
    fn meet<T>(
        &self,
        info: OpInfo<'_>,
        deposit: impl FnOnce(&mut State) -> Result<(), String>,
        complete: impl FnOnce(&mut State) -> DistResult<()>,
        result: impl FnOnce(&State) -> T,
    ) -> DistResult<(T, bool)> {
        let start = Instant::now();
        let mut st = self.lock()?;
        if let Some(b) = &st.broken {
            return Err(self.peer(b.clone()));
        }
        let rank = self.rank;
        st.inside[rank] = true;
        let mut st = self.wait_until(st, info, None, |st| st.arrived == rank)?;
        if let Err(msg) = deposit(&mut st) {
            st.broken = Some(format!("rank {}: {msg}", self.rank));
            self.shared.cv.notify_all();
            return Err(DistError::Invalid {
                rank: self.rank,
                message: msg,
            });
        }
        st.arrived += 1;
        // Wake the next rank in deposit order.
        self.shared.cv.notify_all();
        let generation = st.generation;
        if st.arrived == self.shared.world {
            if let Err(e) = complete(&mut st) {
                st.broken = Some(e.to_string());
                self.shared.cv.notify_all();
                return Err(e);
            }
            st.arrived = 0;
            st.generation += 1;
            st.inside.fill(false);
            self.shared.cv.notify_all();
            trace_done(info, start.elapsed());
            return Ok((result(&st), true));
        }
        let st = self.wait_until(st, info, None, |st| st.generation != generation)?;
        trace_done(info, start.elapsed());
        Ok((result(&st), false))
    }

    /// [`Self::rendezvous`] of device tensors: every rank deposits `t` (all of one length),
    /// the last to arrive makes the result from the deposits in rank order with `finish`,
    /// and every rank leaves with it on its own device.
    fn device_rendezvous(
        &self,
        op: &str,
        t: Tensor<1>,
        finish: impl FnOnce(Vec<Tensor<1>>) -> Tensor<1>,
    ) -> DistResult<Tensor<1>> {
        let (len, device) = (t.dims()[0], t.device());
        // Another rank's thread reads `t` on its own stream: the kernels that wrote it
        // finish first.
        self.finished(&device)?;
        let (result, made_here) = self.meet(
            self.info(op, len * std::mem::size_of::<f32>()),
            |st| {
                match st.tensors.first().map(|d| d.dims()[0]) {
                    Some(other) if other != len => {
                        return Err(format!(
                            "tensor of {len} elements, but another rank passed {other}"
                        ));
                    }
                    _ => st.tensors.push(t),
                }
                Ok(())
            },
            |st| {
                let result = finish(std::mem::take(&mut st.tensors));
                // The other ranks read it on their streams.
                self.finished(&device)?;
                st.tensor_result = Some(result);
                Ok(())
            },
            |st| st.tensor_result.clone().expect("set by the last rank"),
        )?;
        match made_here {
            true => Ok(result),
            false => self.taken(result, &device),
        }
    }

    /// `t`, which another rank's stream wrote, as a copy this rank's stream made on
    /// `device` and finished: the original may go back to a memory pool another stream
    /// allocates from once this rank drops it, so no kernel of this rank may still read
    /// it then.
    fn taken(&self, t: Tensor<1>, device: &Device) -> DistResult<Tensor<1>> {
        let mine = match &t.device() == device {
            true => t.clone().add_scalar(0.0),
            false => t.clone().to_device(device),
        };
        self.finished(device)?;
        drop(t);
        Ok(mine)
    }

    /// Wait for the kernels this rank queued on `device` (its thread's stream), so that a
    /// tensor they wrote can be read from another rank's.
    fn finished(&self, device: &Device) -> DistResult<()> {
        device.sync().map_err(|e| DistError::Invalid {
            rank: self.rank,
            message: format!("the device failed before a collective: {e:?}"),
        })
    }

    /// Leave a message for rank `dest` with `deliver` (into the host or the device mailbox)
    /// and wake the receivers.
    fn post(&self, dest: usize, deliver: impl FnOnce(&mut State)) -> DistResult<()> {
        self.check_peer(dest, "send to")?;
        let mut st = self.lock()?;
        if let Some(b) = &st.broken {
            return Err(self.peer(b.clone()));
        }
        self.check_present(&st, Some(dest))?;
        deliver(&mut st);
        self.shared.cv.notify_all();
        Ok(())
    }

    /// The next message from rank `src` in the mailbox `of` picks, waited for (`op` and
    /// `bytes` name the wait in a timeout's report).
    fn take_message<T>(
        &self,
        src: usize,
        op: &str,
        bytes: usize,
        of: impl Fn(&mut State) -> &mut HashMap<(usize, usize), VecDeque<T>>,
    ) -> DistResult<T> {
        self.check_peer(src, "receive from")?;
        let key = (src, self.rank);
        let st = self.lock()?;
        let mut st = self.wait_until(st, self.info(op, bytes), Some(src), |st| {
            of(st).get(&key).is_some_and(|q| !q.is_empty())
        })?;
        Ok(of(&mut st)
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .expect("waited for"))
    }

    /// An error unless `peer` is another rank of this group.
    fn check_peer(&self, peer: usize, what: &str) -> DistResult<()> {
        if peer >= self.shared.world || peer == self.rank {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!("{what} rank {peer} in a group of {}", self.shared.world),
            });
        }
        Ok(())
    }
}

/// `t` on `device` (no copy when it is there already).
fn on(t: Tensor<1>, device: &Device) -> Tensor<1> {
    if &t.device() == device {
        t
    } else {
        t.to_device(device)
    }
}

/// `parts` added in order, on the first one's device.
fn summed(parts: Vec<Tensor<1>>) -> Tensor<1> {
    let mut parts = parts.into_iter();
    let first = parts.next().expect("a group has a rank");
    let device = first.device();
    parts.fold(first, |acc, t| acc.add(on(t, &device)))
}

/// `t` divided by the group's size for a mean.
fn scaled(t: Tensor<1>, op: ReduceOp, world: usize) -> Tensor<1> {
    match op {
        ReduceOp::Mean => t.div_scalar(world as f32),
        ReduceOp::Sum => t,
    }
}

impl DeviceCollectives for ThreadCommunicator {
    /// Tensors of a GPU backend (the CPU's keep the host collectives).
    fn works_on(&self, device: &Device) -> bool {
        !matches!(
            device.clone().inner().as_dispatch(),
            burn::backend::DispatchDevice::Flex(_)
        )
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let world = self.shared.world;
        self.device_rendezvous("all_reduce on the device", t, |parts| {
            scaled(summed(parts), op, world)
        })
    }

    fn all_gather(&self, t: Tensor<1>) -> DistResult<Tensor<1>> {
        self.device_rendezvous("all_gather on the device", t, |parts| {
            let device = parts[0].device();
            Tensor::cat(parts.into_iter().map(|p| on(p, &device)).collect(), 0)
        })
    }

    fn reduce_scatter(&self, t: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let (rank, world, n) = (self.rank, self.shared.world, t.dims()[0]);
        check_reduce_scatter(rank, world, n, n / world)?;
        let sum = self.device_rendezvous("reduce_scatter on the device", t, |parts| {
            scaled(summed(parts), op, world)
        })?;
        let chunk = n / world;
        Ok(sum.slice(rank * chunk..(rank + 1) * chunk))
    }
}

impl DeviceSends for ThreadCommunicator {
    fn works_on(&self, device: &Device) -> bool {
        DeviceCollectives::works_on(self, device)
    }

    fn send(&self, t: Tensor<1>, dest: usize) -> DistResult<()> {
        self.check_peer(dest, "send to")?;
        self.finished(&t.device())?;
        let key = (self.rank, dest);
        self.post(dest, |st| {
            st.tensor_mail.entry(key).or_default().push_back(t)
        })
    }

    fn recv(&self, len: usize, src: usize, device: &Device) -> DistResult<Tensor<1>> {
        let op = format!(
            "receive on the device from world rank {}",
            self.shared.world_ranks.get(src).copied().unwrap_or(src)
        );
        let t = self.take_message(src, &op, len * std::mem::size_of::<f32>(), |st| {
            &mut st.tensor_mail
        })?;
        if t.dims()[0] != len {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "received a tensor of {} values from rank {src}, expected {len}",
                    t.dims()[0]
                ),
            });
        }
        self.taken(t, device)
    }
}

impl Shared {
    fn new(world_ranks: Vec<usize>, timeout: Duration) -> Arc<Shared> {
        let world = world_ranks.len();
        Arc::new(Shared {
            world,
            world_ranks,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                acc: Vec::new(),
                result: Arc::new(Vec::new()),
                broken: None,
                left: vec![false; world],
                inside: vec![false; world],
                mail: HashMap::new(),
                tensors: Vec::new(),
                tensor_result: None,
                tensor_mail: HashMap::new(),
                splits: HashMap::new(),
            }),
            cv: Condvar::new(),
        })
    }
}

impl Communicator for ThreadCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        let result = self.rendezvous("all_reduce", buf.len(), |acc| {
            acc.iter_mut().zip(buf.iter()).for_each(|(a, b)| *a += *b)
        })?;
        buf.copy_from_slice(&result);
        scale_mean(buf, op, self.shared.world);
        Ok(())
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        check_reduce_scatter(self.rank, self.shared.world, send.len(), recv.len())?;
        // The ranks sum into one shared buffer; each copies out only its own chunk.
        let result = self.rendezvous("reduce_scatter", send.len(), |acc| {
            acc.iter_mut().zip(send.iter()).for_each(|(a, b)| *a += *b)
        })?;
        let n = recv.len();
        recv.copy_from_slice(&result[self.rank * n..(self.rank + 1) * n]);
        scale_mean(recv, op, self.shared.world);
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()> {
        if root >= self.shared.world {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!("broadcast root {root} in a group of {}", self.shared.world),
            });
        }
        let is_root = self.rank == root;
        let result = self.rendezvous("broadcast", buf.len(), |acc| {
            if is_root {
                acc.copy_from_slice(buf);
            }
        })?;
        buf.copy_from_slice(&result);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        let n = send.len();
        if recv.len() != n * self.shared.world {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "all_gather receive buffer of {} for {} x {n}",
                    recv.len(),
                    self.shared.world
                ),
            });
        }
        let rank = self.rank;
        let result = self.rendezvous("all_gather", recv.len(), |acc| {
            acc[rank * n..(rank + 1) * n].copy_from_slice(send)
        })?;
        recv.copy_from_slice(&result);
        Ok(())
    }

    fn barrier(&self) -> DistResult<()> {
        self.rendezvous("barrier", 0, |_| {}).map(|_| ())
    }

    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        let key = (self.rank, dest);
        self.post(dest, |st| {
            st.mail.entry(key).or_default().push_back(buf.to_vec())
        })
    }

    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()> {
        let op = format!(
            "receive from world rank {}",
            self.shared.world_ranks.get(src).copied().unwrap_or(src)
        );
        let msg = self.take_message(src, &op, std::mem::size_of_val(buf), |st| &mut st.mail)?;
        if msg.len() != buf.len() {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "received {} values from rank {src}, expected {}",
                    msg.len(),
                    buf.len()
                ),
            });
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        let world = self.shared.world;
        let mut all = vec![0.0f32; 2 * world];
        Communicator::all_gather(self, &[color as f32, key as f32], &mut all)?;
        let mut members: Vec<(usize, usize)> = (0..world)
            .filter(|&r| all[2 * r] as usize == color)
            .map(|r| (all[2 * r + 1] as usize, r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .unwrap_or(0);
        let index = self.splits_done.fetch_add(1, Ordering::SeqCst);
        let shared = {
            let mut st = self.lock()?;
            st.splits
                .entry((index, color))
                .or_insert_with(|| {
                    let world_ranks = members
                        .iter()
                        .map(|&(_, r)| self.shared.world_ranks[r])
                        .collect();
                    Shared::new(world_ranks, self.shared.timeout)
                })
                .clone()
        };
        Ok(Box::new(ThreadCommunicator::member(new_rank, shared)))
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }

    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        Some(self)
    }

    fn abort(&self, code: i32) {
        if let Ok(mut st) = self.shared.state.lock() {
            // Keep the first cause: peers should learn who failed first.
            st.broken
                .get_or_insert_with(|| format!("rank {} aborted with code {code}", self.rank));
            self.shared.cv.notify_all();
        }
    }
}

impl Drop for ThreadCommunicator {
    fn drop(&mut self) {
        // A panicking rank breaks the group; a finished one leaves it, which fails only the
        // waits that need it (after a clean run nobody waits any more).
        if let Ok(mut st) = self.shared.state.lock() {
            if std::thread::panicking() {
                if st.broken.is_none() {
                    st.broken = Some(format!("rank {} left the group (panicked)", self.rank));
                }
            } else {
                st.left[self.rank] = true;
            }
            self.shared.cv.notify_all();
        }
    }
}
