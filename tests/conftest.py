"""Session-wide test settings."""

import os

# With mpi4py installed, Lightning's MPIEnvironment.detect() initialises MPI in the test process itself; an
# isolated singleton keeps Open MPI from starting a helper daemon (orted) that would outlive the test that made it.
os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")
