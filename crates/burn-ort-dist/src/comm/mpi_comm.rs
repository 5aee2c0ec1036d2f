//! MPI communicator through rsmpi: the engine for multi-process CPU runs and multi-node jobs
//! (`mpirun -np N ...`). Ranks and world size come from the MPI environment.
//!
//! All-reduce runs in place (`MPI_IN_PLACE`, through a C wrapper compiled by `build.rs`,
//! since rsmpi does not expose it). Every operation starts non-blocking and is tested until
//! it completes (`mpi_watch.rs`): with a `collective_timeout`, a wait that outlasts it ends
//! the rank with an error naming the operation, its bytes, the group and the ranks that
//! never arrived, instead of hanging the job.
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED` and every call goes through a mutex, so
//! the communicator can be shared across threads. [`MpiCommunicator::init`] installs a panic
//! hook that calls `MPI_Abort`: a panicking rank would otherwise hang the job (measured:
//! `MPI_Finalize` in the universe's destructor blocks), and `abort` ends every rank of the
//! job with a non-zero status.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mpi::environment::{Threading, Universe};
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};

use crate::comm::communicator::{Communicator, ReduceOp, check_reduce_scatter, scale_mean};
use crate::comm::mpi_ffi::*;
use crate::comm::mpi_watch::Watch;
use crate::comm::stall::OpInfo;
use crate::error::{DistError, DistResult};

/// Sends in flight: each request with the buffer it reads, kept alive until it completes.
type Pending = Vec<(mpi::ffi::MPI_Request, Vec<f32>)>;

/// Values an all-reduce takes at a time: its send copy ([`Comms::send_copy`]) stays at most
/// this big (32 MiB).
const ALL_REDUCE_CHUNK: usize = 1 << 23;

/// The group's communicator and its watch channel, used under one lock.
struct Comms {
    comm: SimpleCommunicator,
    watch: Watch,
    /// What an all-reduce sends: a copy of the buffer it reduces into (Open MPI's
    /// non-blocking all-reduce in place runs at about 0.6x its blocking one; from a copy,
    /// at about the blocking one's speed: BENCHMARKS.md Session 30). Kept between calls.
    send_copy: Vec<f32>,
}

/// A group of an MPI job: the world, or a group split from it.
pub struct MpiCommunicator {
    comms: Mutex<Comms>,
    /// Buffered sends not known to be complete (locked inside `comms`' lock).
    pending: Mutex<Pending>,
    rank: usize,
    size: usize,
    /// The members' world ranks, in group-rank order (for error reports).
    world_ranks: Vec<usize>,
    /// How long one operation may wait (`None`: as long as it takes).
    timeout: Option<Duration>,
    // Shared with sub-communicators; the last one dropped finalises MPI.
    universe: Arc<Universe>,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED and every MPI call made through this
// type holds `comms`' mutex, so no two threads ever call MPI at the same time.
unsafe impl Send for MpiCommunicator {}
// SAFETY: see above; shared references only reach MPI through the mutex.
unsafe impl Sync for MpiCommunicator {}

/// `n` as MPI's int count, or the error naming `what`.
fn mpi_count(n: usize, rank: usize, what: &str) -> DistResult<i32> {
    i32::try_from(n).map_err(|_| DistError::Invalid {
        rank,
        message: format!("{what} of {n} values is above MPI's count limit"),
    })
}

impl MpiCommunicator {
    /// Initialise MPI (once per process) and install the aborting panic hook. Operations
    /// wait without limit until [`MpiCommunicator::with_timeout`] sets one.
    pub fn init() -> DistResult<Self> {
        let Some((universe, level)) = mpi::initialize_with_threading(Threading::Serialized) else {
            return Err(DistError::Invalid {
                rank: 0,
                message: "MPI was already initialised in this process".into(),
            });
        };
        if level < Threading::Serialized {
            return Err(DistError::Invalid {
                rank: 0,
                message: format!("the MPI library only provides {level:?} threading"),
            });
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            eprintln!("rank {rank}: panic, aborting the MPI job");
            // SAFETY: MPI_Abort may be called at any time after MPI_Init; it does not return.
            unsafe {
                mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
            }
        }));
        let world_ranks = (0..world.size() as usize).collect();
        Ok(Self::wrap(world, world_ranks, None, Arc::new(universe)))
    }

    /// The same group with a limit on how long one operation waits (`None`: no limit);
    /// groups split from it inherit the limit.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long one operation may wait (`None`: no limit).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The members' world ranks, in group-rank order.
    pub fn world_ranks(&self) -> &[usize] {
        &self.world_ranks
    }

    fn wrap(
        comm: SimpleCommunicator,
        world_ranks: Vec<usize>,
        timeout: Option<Duration>,
        universe: Arc<Universe>,
    ) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        let watch = Watch::new(&comm);
        MpiCommunicator {
            comms: Mutex::new(Comms {
                comm,
                watch,
                send_copy: Vec::new(),
            }),
            pending: Mutex::new(Vec::new()),
            rank,
            size,
            world_ranks,
            timeout,
            universe,
        }
    }

    /// `MPI_Comm_split`: the ranks of each colour form a group, ordered by `key`.
    pub fn split_mpi(&self, color: usize, key: usize) -> DistResult<MpiCommunicator> {
        // Every member's world rank, so the new group can name its members in reports.
        let mut all = vec![0.0f32; 3 * self.size];
        let mine = [color as f32, key as f32, self.world_ranks[self.rank] as f32];
        self.all_gather(&mine, &mut all)?;
        let mut members: Vec<(usize, usize, usize)> = (0..self.size)
            .filter(|&r| all[3 * r] as usize == color)
            .map(|r| (all[3 * r + 1] as usize, r, all[3 * r + 2] as usize))
            .collect();
        members.sort_unstable();
        let sub = self.with_world(|w| {
            w.split_by_color_with_key(Color::with_value(color as i32), key as i32)
        })?;
        let sub = sub.ok_or_else(|| DistError::Invalid {
            rank: self.rank,
            message: format!("MPI_Comm_split with colour {color} gave no communicator"),
        })?;
        let world_ranks = members.iter().map(|m| m.2).collect();
        Ok(Self::wrap(
            sub,
            world_ranks,
            self.timeout,
            self.universe.clone(),
        ))
    }

    /// Run `f` on the raw rsmpi communicator (under the communicator's lock), for
    /// collectives this trait does not offer and for measuring against plain rsmpi.
    pub fn with_world<T>(&self, f: impl FnOnce(&SimpleCommunicator) -> T) -> DistResult<T> {
        let c = self.lock()?;
        Ok(f(&c.comm))
    }

    fn lock(&self) -> DistResult<std::sync::MutexGuard<'_, Comms>> {
        self.comms.lock().map_err(|_| DistError::Peer {
            rank: self.rank,
            message: "MPI lock poisoned".into(),
        })
    }

    /// Operation `op` of `bytes`: start it with `start` (which gets the raw communicator and
    /// the request to fill, and returns MPI's code), then wait for it as the watch does.
    /// Returns the number of floats a receive got.
    fn run(
        &self,
        op: &str,
        bytes: usize,
        start: impl FnOnce(mpi::ffi::MPI_Comm, &mut mpi::ffi::MPI_Request) -> i32,
    ) -> DistResult<usize> {
        let mut guard = self.lock()?;
        self.start_and_wait(&mut guard, op, bytes, start)
    }

    /// [`Self::run`] under the lock the caller holds.
    fn start_and_wait(
        &self,
        c: &mut Comms,
        op: &str,
        bytes: usize,
        start: impl FnOnce(mpi::ffi::MPI_Comm, &mut mpi::ffi::MPI_Request) -> i32,
    ) -> DistResult<usize> {
        c.watch.begin(op, bytes);
        let mut req = null_request();
        let code = start(c.comm.as_raw(), &mut req);
        if code != 0 {
            return Err(DistError::Peer {
                rank: self.rank,
                message: format!("{op} could not start: MPI error code {code}"),
            });
        }
        let info = OpInfo {
            op,
            bytes,
            group: &self.world_ranks,
        };
        c.watch.wait(&mut req, info, self.rank, self.timeout)
    }
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        // Into `buf` from a copy of it ([`Comms::send_copy`]), a chunk at a time.
        for chunk in buf.chunks_mut(ALL_REDUCE_CHUNK) {
            let mut guard = self.lock()?;
            let c = &mut *guard;
            c.send_copy.clear();
            c.send_copy.extend_from_slice(chunk);
            let (src, dst, len) = (c.send_copy.as_ptr(), chunk.as_mut_ptr(), chunk.len());
            self.start_and_wait(c, "all_reduce", 4 * len, |comm, req| {
                // SAFETY: `src` (the copy, untouched until the wait ends) and `dst` (the
                // exclusively borrowed chunk) hold `len` values each and outlive the request
                // (`start_and_wait` waits for it); calls are serialised by the lock.
                unsafe { burn_ort_iallreduce_sum_f32(src, dst, len as i32, comm, req) }
            })?;
        }
        scale_mean(buf, op, self.size);
        Ok(())
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        check_reduce_scatter(self.rank, self.size, send.len(), recv.len())?;
        let count = mpi_count(recv.len(), self.rank, "a reduce_scatter chunk")?;
        let (src, dst) = (send.as_ptr(), recv.as_mut_ptr());
        self.run("reduce_scatter", 4 * send.len(), |comm, req| {
            // SAFETY: `send` holds size x count values and `recv` count, both alive until
            // `run` returns after the request completes.
            unsafe { burn_ort_ireduce_scatter_block_sum_f32(src, dst, count, comm, req) }
        })?;
        scale_mean(recv, op, self.size);
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()> {
        if root >= self.size {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!("broadcast root {root} in a world of {}", self.size),
            });
        }
        let count = mpi_count(buf.len(), self.rank, "a broadcast")?;
        let ptr = buf.as_mut_ptr();
        self.run("broadcast", 4 * buf.len(), |comm, req| {
            // SAFETY: `buf` holds `count` values and outlives the request.
            unsafe { burn_ort_ibcast_f32(ptr, count, root as i32, comm, req) }
        })
        .map(|_| ())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        if recv.len() != send.len() * self.size {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "all_gather receive buffer of {} for {} x {}",
                    recv.len(),
                    self.size,
                    send.len()
                ),
            });
        }
        let count = mpi_count(send.len(), self.rank, "an all_gather contribution")?;
        let (src, dst) = (send.as_ptr(), recv.as_mut_ptr());
        self.run("all_gather", 4 * recv.len(), |comm, req| {
            // SAFETY: `send` holds `count` values and `recv` size x count, both alive until
            // the request completes.
            unsafe { burn_ort_iallgather_f32(src, count, dst, comm, req) }
        })
        .map(|_| ())
    }

    fn barrier(&self) -> DistResult<()> {
        // SAFETY: no buffers; `req` is filled by MPI.
        self.run("barrier", 0, |comm, req| unsafe {
            burn_ort_ibarrier(comm, req)
        })
        .map(|_| ())
    }

    /// Buffered: the values are copied and sent in the background (`MPI_Isend`); messages
    /// between two ranks arrive in order.
    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        if dest >= self.size {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!("send to rank {dest} in a world of {}", self.size),
            });
        }
        let count = mpi_count(buf.len(), self.rank, "a message")?;
        let data = buf.to_vec();
        let code = self.with_world(|w| {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            reap(&mut pending);
            let mut req = null_request();
            // SAFETY: `data` is moved into `pending` below and outlives the request (it is
            // only dropped once MPI_Test or MPI_Wait reports completion); calls are serialised.
            let code = unsafe {
                burn_ort_isend_f32(data.as_ptr(), count, dest as i32, w.as_raw(), &mut req)
            };
            if code == 0 {
                pending.push((req, data));
            }
            code
        })?;
        if code != 0 {
            return Err(DistError::Peer {
                rank: self.rank,
                message: format!("MPI_Isend to rank {dest} failed with code {code}"),
            });
        }
        Ok(())
    }

    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()> {
        if src >= self.size {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!("receive from rank {src} in a world of {}", self.size),
            });
        }
        let count = mpi_count(buf.len(), self.rank, "a message")?;
        let ptr = buf.as_mut_ptr();
        let op = format!("receive from world rank {}", self.world_ranks[src]);
        let got = self.run(&op, 4 * buf.len(), |comm, req| {
            // SAFETY: `buf` holds `count` values and outlives the request.
            unsafe { burn_ort_irecv_f32(ptr, count, src as i32, comm, req) }
        })?;
        if got != buf.len() {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "received {got} values from rank {src}, expected {}",
                    buf.len()
                ),
            });
        }
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        Ok(Box::new(self.split_mpi(color, key)?))
    }

    fn abort(&self, code: i32) {
        if let Ok(c) = self.comms.lock() {
            c.comm.abort(code);
        }
    }
}

/// Drop the sends that have completed.
fn reap(pending: &mut Pending) {
    pending.retain_mut(|(req, _)| {
        let mut done = 0;
        // SAFETY: `req` came from MPI_Isend and has not completed yet.
        let code = unsafe { burn_ort_test(req, &mut done) };
        code == 0 && done == 0
    });
}

impl Drop for MpiCommunicator {
    /// Sends still in flight complete before their buffers go.
    fn drop(&mut self) {
        let pending = self
            .pending
            .get_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        if let Ok(_c) = self.comms.lock() {
            for (mut req, _data) in pending {
                // SAFETY: an incomplete request from MPI_Isend; its buffer is alive here.
                unsafe { burn_ort_wait(&mut req) };
            }
        }
    }
}
