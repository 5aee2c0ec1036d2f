//! The C wrappers of `csrc/in_place.c`: MPI calls rsmpi does not expose (`MPI_IN_PLACE`,
//! the non-blocking collectives, tests that report a status), compiled against the MPI
//! headers the build finds. Every function returns MPI's error code (0: success).

use mpi::ffi::{MPI_Comm, MPI_Request};

unsafe extern "C" {
    /// `MPI_Iallreduce(send, recv, count, MPI_FLOAT, MPI_SUM, comm, req)`.
    pub fn burn_ort_iallreduce_sum_f32(
        send: *const f32,
        recv: *mut f32,
        count: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Ireduce_scatter_block` of `count` floats per rank, summed.
    pub fn burn_ort_ireduce_scatter_block_sum_f32(
        send: *const f32,
        recv: *mut f32,
        count: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Ibcast` of `count` floats from `root`.
    pub fn burn_ort_ibcast_f32(
        buf: *mut f32,
        count: i32,
        root: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Iallgather` of `count` floats per rank.
    pub fn burn_ort_iallgather_f32(
        send: *const f32,
        count: i32,
        recv: *mut f32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Ibarrier`.
    pub fn burn_ort_ibarrier(comm: MPI_Comm, req: *mut MPI_Request) -> i32;
    /// `MPI_Isend` of `count` floats to `dest` with tag 0.
    pub fn burn_ort_isend_f32(
        buf: *const f32,
        count: i32,
        dest: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Irecv` of up to `count` floats from `src` with tag 0.
    pub fn burn_ort_irecv_f32(
        buf: *mut f32,
        count: i32,
        src: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Isend` of `count` bytes to `dest` with `tag`.
    pub fn burn_ort_isend_bytes(
        buf: *const u8,
        count: i32,
        dest: i32,
        tag: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Irecv` of up to `count` bytes from any source with `tag`.
    pub fn burn_ort_irecv_bytes_any(
        buf: *mut u8,
        count: i32,
        tag: i32,
        comm: MPI_Comm,
        req: *mut MPI_Request,
    ) -> i32;
    /// `MPI_Test(req, done, MPI_STATUS_IGNORE)`.
    pub fn burn_ort_test(req: *mut MPI_Request, done: *mut i32) -> i32;
    /// `MPI_Test` that, once done, reports the sender and the count of `type_bytes`-byte
    /// elements received (1: bytes, 4: floats).
    pub fn burn_ort_test_status(
        req: *mut MPI_Request,
        done: *mut i32,
        source: *mut i32,
        count: *mut i32,
        type_bytes: i32,
    ) -> i32;
    /// `MPI_Wait(req, MPI_STATUS_IGNORE)`.
    pub fn burn_ort_wait(req: *mut MPI_Request) -> i32;
    /// `MPI_Cancel` then `MPI_Wait`: withdraw a posted receive.
    pub fn burn_ort_cancel(req: *mut MPI_Request) -> i32;
}

/// A request for MPI to fill in.
pub fn null_request() -> MPI_Request {
    // SAFETY: an MPI_Request is plain data (an int or a pointer) that the MPI call fills.
    unsafe { std::mem::zeroed() }
}
