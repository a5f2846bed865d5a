#!/bin/bash
# Open MPI (4.x; 5.x needs mpi4py installed for JAX to read the job), one process per GPU on
# 2 hosts of 8 GPUs: each takes the GPU of its local rank.
# Run from the repository root: bash docs/clusters/mpirun.sh --model resnet50 --data DIR
mpirun -np 16 --npernode 8 --hostfile hosts.txt -x PATH -x LD_LIBRARY_PATH \
    python experiments/train.py --mesh data=16 --run-name jaxcnn-run --resume auto "$@"
