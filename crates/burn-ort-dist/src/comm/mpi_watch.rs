//! Timed waits of the MPI communicator (`collective_timeout`).
//!
//! Every operation starts non-blocking and is tested until it completes. While it waits,
//! a rank answers its peers' questions on a duplicate of the group's communicator (the
//! watch channel): "what are you waiting in?" gets the rank's operation count, operation
//! and bytes. When the deadline passes, the rank asks every peer, listens for a few
//! seconds, and reports the peers that did not answer (stopped, dead, or computing outside
//! any communication) as never arrived, and those waiting in another operation as such;
//! then the job ends with that error (the trainer calls `MPI_Abort`).

use std::time::{Duration, Instant};

use mpi::ffi::MPI_Request;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator as _, SimpleCommunicator};

use crate::comm::mpi_ffi::*;
use crate::comm::stall::{OpInfo, Stall, trace_done};
use crate::error::{DistError, DistResult};

const QUERY: i32 = 1;
const REPLY: i32 = 2;
/// How long a timed-out rank listens for its peers' answers.
const GRACE: Duration = Duration::from_secs(3);
/// The operations, by the code a reply carries.
const OPS: [&str; 7] = [
    "all_reduce",
    "reduce_scatter",
    "broadcast",
    "all_gather",
    "barrier",
    "receive",
    "send",
];

/// What a rank is waiting in: its operation count, the operation (an index of `OPS`), its
/// bytes; 24 bytes on the watch channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Doing {
    seq: u64,
    op: u64,
    bytes: u64,
}

type Message = Box<[u8; 24]>;

impl Doing {
    fn encode(self) -> Message {
        let mut m = Box::new([0u8; 24]);
        m[..8].copy_from_slice(&self.seq.to_le_bytes());
        m[8..16].copy_from_slice(&self.op.to_le_bytes());
        m[16..].copy_from_slice(&self.bytes.to_le_bytes());
        m
    }

    fn decode(m: &[u8; 24]) -> Doing {
        let word = |i: usize| u64::from_le_bytes(m[i..i + 8].try_into().expect("8 bytes"));
        Doing {
            seq: word(0),
            op: word(8),
            bytes: word(16),
        }
    }

    fn describe(self) -> String {
        let op = OPS
            .get(self.op as usize)
            .copied()
            .unwrap_or("an unknown operation");
        format!(
            "{op} #{} of {}",
            self.seq,
            crate::comm::stall::human_bytes(self.bytes as usize)
        )
    }
}

/// The watch channel of one communicator and the operation its rank is in.
pub(crate) struct Watch {
    comm: SimpleCommunicator,
    /// The posted receive for the next question, and its buffer (boxed: MPI writes there).
    query: (MPI_Request, Message),
    /// Sends in flight (answers, questions) with their buffers.
    sending: Vec<(MPI_Request, Message)>,
    doing: Doing,
}

// SAFETY: used only under the communicator's lock (MPI_THREAD_SERIALIZED); the requests
// and buffers are plain data owned here.
unsafe impl Send for Watch {}

impl Watch {
    /// A watch channel for `comm` (collective over `comm`: every rank creates one).
    pub fn new(comm: &SimpleCommunicator) -> Watch {
        let mut w = Watch {
            comm: comm.duplicate(),
            query: (null_request(), Box::new([0; 24])),
            sending: Vec::new(),
            doing: Doing::default(),
        };
        w.post_query();
        w
    }

    fn post_query(&mut self) {
        post_receive(&self.comm, QUERY, &mut self.query);
    }

    /// Start operation `op` (beginning with an entry of `OPS`) of `bytes`.
    pub fn begin(&mut self, op: &str, bytes: usize) {
        self.doing = Doing {
            seq: self.doing.seq + 1,
            op: OPS
                .iter()
                .position(|o| op.starts_with(o))
                .unwrap_or(OPS.len()) as u64,
            bytes: bytes as u64,
        };
    }

    /// Test `req` until it completes (returning the number of floats a receive got), or
    /// until `timeout` passes: then the error naming `info`'s operation and the ranks that
    /// never arrived. `rank` is this rank's index in `info.group`.
    pub fn wait(
        &mut self,
        req: &mut MPI_Request,
        info: OpInfo<'_>,
        rank: usize,
        timeout: Option<Duration>,
    ) -> DistResult<usize> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let (mut done, mut source, mut count) = (0, 0, 0);
            // SAFETY: `req` is a live request of an operation whose buffers the caller holds.
            let code = unsafe { burn_ort_test_status(req, &mut done, &mut source, &mut count, 4) };
            if code != 0 {
                return Err(DistError::Peer {
                    rank: info.group[rank],
                    message: format!("{} failed with MPI error code {code}", info.op),
                });
            }
            if done != 0 {
                trace_done(info, start.elapsed());
                return Ok(count.max(0) as usize);
            }
            self.answer();
            let waited = start.elapsed();
            if timeout.is_some_and(|t| waited >= t) {
                return Err(self.stalled(info, rank, waited));
            }
            back_off(&mut spins);
        }
    }

    /// Answer every question that has arrived with what this rank is doing.
    fn answer(&mut self) {
        loop {
            let (mut done, mut source, mut count) = (0, 0, 0);
            // SAFETY: the posted query receive and its buffer, owned by `self`.
            let code = unsafe {
                burn_ort_test_status(&mut self.query.0, &mut done, &mut source, &mut count, 1)
            };
            if code != 0 || done == 0 {
                break;
            }
            self.send(self.doing.encode(), source, REPLY);
            self.post_query();
        }
        self.sending.retain_mut(|(req, _)| {
            let mut done = 0;
            // SAFETY: a send request from `send`, not yet known complete.
            let code = unsafe { burn_ort_test(req, &mut done) };
            code == 0 && done == 0
        });
    }

    fn send(&mut self, message: Message, dest: i32, tag: i32) {
        let mut req = null_request();
        // SAFETY: the buffer moves into `self.sending` with its request and lives until the
        // send completes (or, for a peer that never receives, until the job ends).
        let code = unsafe {
            burn_ort_isend_bytes(
                message.as_ptr(),
                24,
                dest,
                tag,
                self.comm.as_raw(),
                &mut req,
            )
        };
        if code == 0 {
            self.sending.push((req, message));
        }
    }

    /// Ask every peer what it waits in, listen for `GRACE`, and build the timeout error.
    fn stalled(&mut self, info: OpInfo<'_>, rank: usize, waited: Duration) -> DistError {
        let peers: Vec<usize> = (0..info.group.len()).filter(|&r| r != rank).collect();
        for &p in &peers {
            self.send(self.doing.encode(), p as i32, QUERY);
        }
        let mut replies: Vec<Option<Doing>> = vec![None; info.group.len()];
        let mut reply: (MPI_Request, Message) = (null_request(), Box::new([0; 24]));
        post_receive(&self.comm, REPLY, &mut reply);
        let listen = Instant::now();
        let mut spins = 0u32;
        while listen.elapsed() < GRACE && peers.iter().any(|&p| replies[p].is_none()) {
            let (mut done, mut source, mut count) = (0, 0, 0);
            // SAFETY: the reply receive posted above.
            let code = unsafe {
                burn_ort_test_status(&mut reply.0, &mut done, &mut source, &mut count, 1)
            };
            if code != 0 {
                break;
            }
            if done != 0 {
                if let Some(slot) = replies.get_mut(source as usize) {
                    *slot = Some(Doing::decode(&reply.1));
                }
                post_receive(&self.comm, REPLY, &mut reply);
            }
            self.answer();
            back_off(&mut spins);
        }
        // SAFETY: the pending reply receive; cancelled before its buffer goes.
        unsafe { burn_ort_cancel(&mut reply.0) };
        let mine = self.doing;
        let same = |d: &Doing| d.seq == mine.seq && d.op == mine.op;
        Stall {
            info,
            waited,
            absent: peers
                .iter()
                .filter(|&&p| replies[p].is_none())
                .map(|&p| info.group[p])
                .collect(),
            elsewhere: peers
                .iter()
                .filter_map(|&p| {
                    replies[p]
                        .filter(|d| !same(d))
                        .map(|d| (info.group[p], d.describe()))
                })
                .collect(),
        }
        .into_error(info.group[rank])
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // SAFETY: the posted query receive, withdrawn before its buffer and the duplicate
        // communicator go.
        unsafe { burn_ort_cancel(&mut self.query.0) };
        // Sends to a peer that never receives them cannot complete: their buffers stay
        // allocated (forgotten) rather than freed under MPI.
        for (_, buf) in self.sending.drain(..) {
            std::mem::forget(buf);
        }
    }
}

/// Post a receive of one 24-byte message with `tag` from any rank into `slot`'s buffer.
/// The caller keeps `slot` (its boxed buffer) alive until the receive completes or is
/// cancelled.
fn post_receive(comm: &SimpleCommunicator, tag: i32, slot: &mut (MPI_Request, Message)) {
    let (req, buf) = slot;
    // SAFETY: `buf` is a live 24-byte heap buffer that the caller keeps until the request
    // completes or is cancelled; MPI calls are serialised by the communicator's lock.
    unsafe { burn_ort_irecv_bytes_any(buf.as_mut_ptr(), 24, tag, comm.as_raw(), req) };
}

/// Between two tests: spin briefly, then yield the core, then sleep, so a rank that waits
/// long leaves the processor to ranks that compute.
fn back_off(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    match *spins {
        0..=64 => std::hint::spin_loop(),
        65..=4096 => std::thread::yield_now(),
        _ => std::thread::sleep(Duration::from_micros(50)),
    }
}
