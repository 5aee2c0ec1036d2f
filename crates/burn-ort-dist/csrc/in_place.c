/* MPI calls for the MPI communicator that rsmpi does not expose: MPI_IN_PLACE (its value
 * differs between MPI implementations), the non-blocking collectives and tests that report a
 * status. Compiled against the MPI headers the build finds; declared in src/mpi_ffi.rs. */
#include <mpi.h>

/* Buffered point-to-point for pipeline stages: a send starts and returns (the caller keeps the
 * buffer alive until the request completes), so two stages sending to each other never block
 * each other the way two blocking MPI_Send calls can. */
int burn_ort_isend_f32(const float *buf, int count, int dest, MPI_Comm comm, MPI_Request *req) {
    return MPI_Isend(buf, count, MPI_FLOAT, dest, 0, comm, req);
}

int burn_ort_test(MPI_Request *req, int *done) {
    return MPI_Test(req, done, MPI_STATUS_IGNORE);
}

int burn_ort_wait(MPI_Request *req) {
    return MPI_Wait(req, MPI_STATUS_IGNORE);
}

/* Non-blocking collectives and receives for the timed waits (`collective_timeout`): the
 * communicator starts each operation, then tests it until it completes, the deadline passes,
 * or a peer asks what it is waiting for. */
/* From a separate send buffer: Open MPI's non-blocking all-reduce runs MPI_IN_PLACE at about
 * 0.6x the speed of its blocking one, and from a copy at about the blocking one's. */
int burn_ort_iallreduce_sum_f32(const float *send, float *recv, int count, MPI_Comm comm,
                                MPI_Request *req) {
    return MPI_Iallreduce(send, recv, count, MPI_FLOAT, MPI_SUM, comm, req);
}

int burn_ort_ireduce_scatter_block_sum_f32(const float *send, float *recv, int count, MPI_Comm comm,
                                           MPI_Request *req) {
    return MPI_Ireduce_scatter_block(send, recv, count, MPI_FLOAT, MPI_SUM, comm, req);
}

int burn_ort_ibcast_f32(float *buf, int count, int root, MPI_Comm comm, MPI_Request *req) {
    return MPI_Ibcast(buf, count, MPI_FLOAT, root, comm, req);
}

int burn_ort_iallgather_f32(const float *send, int count, float *recv, MPI_Comm comm, MPI_Request *req) {
    return MPI_Iallgather(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, comm, req);
}

int burn_ort_ibarrier(MPI_Comm comm, MPI_Request *req) {
    return MPI_Ibarrier(comm, req);
}

int burn_ort_irecv_f32(float *buf, int count, int src, MPI_Comm comm, MPI_Request *req) {
    return MPI_Irecv(buf, count, MPI_FLOAT, src, 0, comm, req);
}

/* MPI_Test that also reports the sender and the element count of a completed receive of
 * `type_bytes`-byte elements (1: bytes, 4: floats). */
int burn_ort_test_status(MPI_Request *req, int *done, int *source, int *count, int type_bytes) {
    MPI_Status status;
    int code = MPI_Test(req, done, &status);
    if (code == MPI_SUCCESS && *done) {
        *source = status.MPI_SOURCE;
        code = MPI_Get_count(&status, type_bytes == 4 ? MPI_FLOAT : MPI_BYTE, count);
    }
    return code;
}

/* The watch channel: small byte messages (a query, a reply) with a tag. */
int burn_ort_isend_bytes(const void *buf, int count, int dest, int tag, MPI_Comm comm, MPI_Request *req) {
    return MPI_Isend(buf, count, MPI_BYTE, dest, tag, comm, req);
}

int burn_ort_irecv_bytes_any(void *buf, int count, int tag, MPI_Comm comm, MPI_Request *req) {
    return MPI_Irecv(buf, count, MPI_BYTE, MPI_ANY_SOURCE, tag, comm, req);
}

/* Withdraw a posted receive that will never complete (at the communicator's end). */
int burn_ort_cancel(MPI_Request *req) {
    MPI_Cancel(req);
    return MPI_Wait(req, MPI_STATUS_IGNORE);
}
