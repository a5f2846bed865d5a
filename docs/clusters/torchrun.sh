#!/bin/bash
# torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
# one process per GPU on 2 hosts of 8 GPUs: each takes the GPU of its local rank. Static
# rendezvous, so that rank 0 runs on MASTER_ADDR, where JAX's coordinator listens: on
# MASTER_PORT + 1 when torchrun's own store holds MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE).
# On each host, from the repository root: NODE_RANK=0 (1 on the other) HEAD_NODE=host0 bash docs/clusters/torchrun.sh --data DIR
torchrun --nnodes=2 --nproc-per-node=8 --node-rank="$NODE_RANK" --master-addr="$HEAD_NODE" --master-port=29500 \
    experiments/train.py --mesh data=16 --run-name jaxcnn-run --resume auto "$@"
