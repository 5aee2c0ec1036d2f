/* MPI_IN_PLACE collectives for the MPI communicator: rsmpi does not expose MPI_IN_PLACE (its
 * value differs between MPI implementations), so these wrappers are compiled against the
 * MPI headers the build finds. */
#include <mpi.h>

int burn_ort_allreduce_sum_f32_in_place(float *buf, int count, MPI_Comm comm) {
    return MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, comm);
}

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
