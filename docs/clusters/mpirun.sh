#!/bin/bash
# Open MPI (4.x; 5.x needs mpi4py installed for JAX to read the job), one process per GPU on
# 2 hosts of 8 GPUs: each takes the GPU of its local rank. JAX's coordinator is process 0's:
# the first TCP address of the mpirun host (JAX reads it from Open MPI's variables).
# Run from the repository root: bash docs/clusters/mpirun.sh --model resnet50 --data DIR
# Other sizes: NP=2 NPERNODE=2 HOSTFILE=myhosts bash docs/clusters/mpirun.sh --mesh data=4 ...
# (the suite runs it so, two ranks on one machine; as root Open MPI also wants
# OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1).
mpirun -np "${NP:-16}" --npernode "${NPERNODE:-8}" --hostfile "${HOSTFILE:-hosts.txt}" -x PATH -x LD_LIBRARY_PATH \
    python experiments/train.py --mesh data=16 --run-name jaxcnn-run --resume auto "$@"
