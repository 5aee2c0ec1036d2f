//! MPI communicator through rsmpi: the engine for multi-process CPU runs and multi-node jobs
//! (`mpirun -np N ...`). Ranks and world size come from the MPI environment.
//!
//! All-reduce runs in place (`MPI_IN_PLACE`, through a C wrapper compiled by `build.rs`,
//! since rsmpi does not expose it), so it costs what a raw `MPI_Allreduce` does.
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED` and every call goes through a mutex, so
//! the communicator can be shared across threads. [`MpiCommunicator::init`] installs a panic
//! hook that calls `MPI_Abort`: a panicking rank would otherwise hang the job (measured:
//! `MPI_Finalize` in the universe's destructor blocks), and `abort` ends every rank of the
//! job with a non-zero status.

use std::sync::{Arc, Mutex};

use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::environment::{Threading, Universe};
use mpi::point_to_point::Source;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};

use crate::communicator::{Communicator, ReduceOp, check_reduce_scatter, scale_mean};
use crate::error::{DistError, DistResult};

unsafe extern "C" {
    /// `MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, comm)` (`csrc/in_place.c`).
    fn burn_ort_allreduce_sum_f32_in_place(
        buf: *mut f32,
        count: i32,
        comm: mpi::ffi::MPI_Comm,
    ) -> i32;
    /// `MPI_Isend` of `count` floats to `dest` with tag 0.
    fn burn_ort_isend_f32(
        buf: *const f32,
        count: i32,
        dest: i32,
        comm: mpi::ffi::MPI_Comm,
        req: *mut mpi::ffi::MPI_Request,
    ) -> i32;
    /// `MPI_Test(req, done, MPI_STATUS_IGNORE)`.
    fn burn_ort_test(req: *mut mpi::ffi::MPI_Request, done: *mut i32) -> i32;
    /// `MPI_Wait(req, MPI_STATUS_IGNORE)`.
    fn burn_ort_wait(req: *mut mpi::ffi::MPI_Request) -> i32;
}

/// Sends in flight: each request with the buffer it reads, kept alive until it completes.
type Pending = Vec<(mpi::ffi::MPI_Request, Vec<f32>)>;

/// The world of an MPI job.
pub struct MpiCommunicator {
    world: Mutex<SimpleCommunicator>,
    /// Buffered sends not known to be complete (locked inside `world`'s lock).
    pending: Mutex<Pending>,
    rank: usize,
    size: usize,
    // Shared with sub-communicators; the last one dropped finalises MPI.
    universe: Arc<Universe>,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED and every MPI call made through this
// type holds `world`'s mutex, so no two threads ever call MPI at the same time.
unsafe impl Send for MpiCommunicator {}
// SAFETY: see above; shared references only reach MPI through the mutex.
unsafe impl Sync for MpiCommunicator {}

/// Was this process started by an MPI launcher (OpenMPI, MPICH, Slurm's PMI)?
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

impl MpiCommunicator {
    /// Initialise MPI (once per process) and install the aborting panic hook.
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
        Ok(Self::wrap(world, Arc::new(universe)))
    }

    fn wrap(comm: SimpleCommunicator, universe: Arc<Universe>) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiCommunicator {
            world: Mutex::new(comm),
            pending: Mutex::new(Vec::new()),
            rank,
            size,
            universe,
        }
    }

    /// `MPI_Comm_split`: the ranks of each colour form a group, ordered by `key`.
    pub fn split_mpi(&self, color: usize, key: usize) -> DistResult<MpiCommunicator> {
        let sub = self.with_world(|w| {
            w.split_by_color_with_key(Color::with_value(color as i32), key as i32)
        })?;
        let sub = sub.ok_or_else(|| DistError::Invalid {
            rank: self.rank,
            message: format!("MPI_Comm_split with colour {color} gave no communicator"),
        })?;
        Ok(Self::wrap(sub, self.universe.clone()))
    }

    /// Run `f` on the raw rsmpi world (under the communicator's lock), for collectives this
    /// trait does not offer and for measuring against plain rsmpi.
    pub fn with_world<T>(&self, f: impl FnOnce(&SimpleCommunicator) -> T) -> DistResult<T> {
        let w = self.world.lock().map_err(|_| DistError::Peer {
            rank: self.rank,
            message: "MPI lock poisoned".into(),
        })?;
        Ok(f(&w))
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
        // In place (no send-buffer copy), in chunks that fit MPI's int count.
        for chunk in buf.chunks_mut(i32::MAX as usize) {
            let code = self.with_world(|w| {
                // SAFETY: `chunk` is a valid, exclusively borrowed f32 buffer of `len` values
                // and `w` a live communicator; MPI calls are serialised by the world lock.
                unsafe {
                    burn_ort_allreduce_sum_f32_in_place(
                        chunk.as_mut_ptr(),
                        chunk.len() as i32,
                        w.as_raw(),
                    )
                }
            })?;
            if code != 0 {
                return Err(DistError::Peer {
                    rank: self.rank,
                    message: format!("MPI_Allreduce failed with code {code}"),
                });
            }
        }
        scale_mean(buf, op, self.size);
        Ok(())
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        check_reduce_scatter(self.rank, self.size, send.len(), recv.len())?;
        self.with_world(|w| w.reduce_scatter_block_into(send, recv, SystemOperation::sum()))?;
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
        self.with_world(|w| w.process_at_rank(root as i32).broadcast_into(buf))
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
        self.with_world(|w| w.all_gather_into(send, recv))
    }

    fn barrier(&self) -> DistResult<()> {
        self.with_world(|w| w.barrier())
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
        let count = i32::try_from(buf.len()).map_err(|_| DistError::Invalid {
            rank: self.rank,
            message: format!(
                "a message of {} values is above MPI's count limit",
                buf.len()
            ),
        })?;
        let data = buf.to_vec();
        let code = self.with_world(|w| {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            reap(&mut pending);
            // SAFETY: an MPI_Request is plain data (an int or a pointer) that MPI_Isend fills.
            let mut req: mpi::ffi::MPI_Request = unsafe { std::mem::zeroed() };
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
        let status = self.with_world(|w| w.process_at_rank(src as i32).receive_into(buf))?;
        let count = status.count(f32::equivalent_datatype()) as usize;
        if count != buf.len() {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "received {count} values from rank {src}, expected {}",
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
        if let Ok(w) = self.world.lock() {
            w.abort(code);
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
        if let Ok(_w) = self.world.lock() {
            for (mut req, _data) in pending {
                // SAFETY: an incomplete request from MPI_Isend; its buffer is alive here.
                unsafe { burn_ort_wait(&mut req) };
            }
        }
    }
}
