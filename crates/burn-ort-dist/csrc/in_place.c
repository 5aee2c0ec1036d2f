/* MPI_IN_PLACE collectives for the MPI communicator: rsmpi does not expose MPI_IN_PLACE (its
 * value differs between MPI implementations), so these wrappers are compiled against the
 * MPI headers the build finds. */
#include <mpi.h>

int burn_ort_allreduce_sum_f32_in_place(float *buf, int count, MPI_Comm comm) {
    return MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, comm);
}
