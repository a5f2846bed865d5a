"""Hardware profiles for the planner: peak FLOP/s, per-device memory, interconnect.

`link_bytes_per_second` is the one-way bandwidth one device can drive into the ring
collectives (half the vendor's bidirectional figure), the quantity `wire_bytes` (ring
traffic sent per device) is divided by. `flops_fp32` is what an fp32 JAX program gets:
on NVIDIA Ampere and later XLA runs fp32 convolutions and matmuls on TF32 tensor cores at
default precision, so it is the dense TF32 peak there.

Between hosts (`network_*`: a collective whose group spans hosts runs at these): a DGX
A100 has one 200 Gb/s HDR InfiniBand port per GPU (25 GB/s one way), a DGX H100/H200 one
400 Gb/s NDR port per GPU (50 GB/s); TPU v5e hosts reach each other over the data-centre
network, about 50 Gb/s per chip (an order of magnitude). A hop between hosts: ~5 us over
InfiniBand, ~10 us over a data-centre network.

Sources (dense, no sparsity):
- A100 SXM4 80 GB: NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16, 156 TF32, 80 GB,
  NVLink 3 600 GB/s bidirectional.
- H100 SXM5: NVIDIA H100 datasheet (2023): 989 TFLOP/s bf16, 495 TF32, 80 GB,
  NVLink 4 900 GB/s bidirectional.
- H200 SXM: NVIDIA H200 datasheet (2024): compute as H100, 141 GB, NVLink 900 GB/s.
- TPU v5e: cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM, ICI 400 GB/s
  bidirectional per chip. (The MXUs take fp32 as multi-pass bf16: ~1/3 the rate.)
- P100 SXM2 16 GB (p100-ethernet): NVIDIA Tesla P100 datasheet (2016): 10.6 TFLOP/s fp32,
  21.2 fp16, NVLink 1 4 links x 20 GB/s a direction (40 GB/s taken as a ring's share in
  the hybrid cube-mesh); network as Goyal et al. 2017 ("Accurate, Large Minibatch SGD",
  arXiv 1706.02677, sec. 4 and 5): 50 Gbit/s Ethernet a server, 8 GPUs a server.
- cpu-here: measured on the development machine (2 AMD EPYC cores, Dec 2026): a 2048^2
  fp32 matmul under jit at 62 GFLOP/s, a 64 MiB numpy copy at 8.8 GB/s. Simulated
  devices share these two cores, so the planner divides both by the device count.

The fixed costs, orders of magnitude rather than measurements, are what make a tiny model's
answer "one device": `kernel_seconds` per kernel a step launches (a CUDA launch and the gap
after it, 1-3 us; an XLA:TPU program's ops far less; an XLA:CPU thunk's dispatch) and
`hop_seconds` per latency-bound step of a ring collective (NCCL's low-latency protocol over
NVLink about 1 us a hop, so ~15 us for a small all-reduce over 8 GPUs; TPU ICI about 1 us;
gloo between simulated devices tens of us).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxcnn.errors import UserError


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    flops_fp32: float  # per device, FLOP/s
    flops_bf16: float
    memory_bytes: float  # per device
    link_bytes_per_second: float  # one way, per device
    kernel_seconds: float  # fixed cost of each kernel a step launches
    hop_seconds: float  # fixed cost of each latency-bound step of a collective (collective.hops)
    network_bytes_per_second: float  # one way, per device, between hosts
    network_hop_seconds: float  # a hop between hosts
    shared_host: bool = False  # simulated devices split one host's compute and bandwidth
    # how a cluster runs the step's collectives (jaxcnn.analysis.cluster_clock); the
    # defaults cost them as compiled: each its own ring, nothing hidden behind compute
    combine_threshold_bytes: float = 0.0  # XLA's combiners merge the parameters' collectives up to this
    collective_algorithm: str = "ring"  # "nccl": the cheaper of ring and tree latency
    overlap_fraction: float = 0.0  # of compute time the parameters' collectives can hide behind

    def flops(self, dtype: str = "float32") -> float:
        return self.flops_bf16 if dtype == "bfloat16" else self.flops_fp32


GB, GiB, MiB = 1e9, 2**30, 2**20
# XLA:GPU's combine threshold (xla/debug_options_flags.cc); a GPU's backward pass is about
# two thirds of a training step's compute, the window its gradients' reductions hide in
GPU_CLUSTER = {"combine_threshold_bytes": 30 * MiB, "collective_algorithm": "nccl", "overlap_fraction": 2 / 3}
PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("cpu-here", 62e9, 62e9, 24 * GiB, 8.8 * GB, 2e-6, 20e-6, 8.8 * GB, 20e-6, shared_host=True),
        HardwareProfile("a100", 156e12, 312e12, 80 * GB, 300 * GB, 2e-6, 1.5e-6, 25 * GB, 5e-6, **GPU_CLUSTER),
        HardwareProfile("h100", 495e12, 989e12, 80 * GB, 450 * GB, 2e-6, 1e-6, 50 * GB, 5e-6, **GPU_CLUSTER),
        HardwareProfile("h200", 495e12, 989e12, 141 * GB, 450 * GB, 2e-6, 1e-6, 50 * GB, 5e-6, **GPU_CLUSTER),
        HardwareProfile(
            "tpu-v5e",
            197e12 / 3,
            197e12,
            16 * GiB,
            200 * GB,
            0.5e-6,
            1e-6,
            6.25 * GB,
            10e-6,
            combine_threshold_bytes=30 * MiB,
            overlap_fraction=2 / 3,
        ),
        # Goyal et al. 2017's cluster: 8 P100s a server (NVLink), one 50 Gbit/s Ethernet
        # port a server shared by its 8 GPUs, gradients reduced by Gloo's hierarchical
        # all-reduce overlapped with the backward pass
        HardwareProfile(
            "p100-ethernet", 10.6e12, 21.2e12, 16 * GB, 40 * GB, 5e-6, 2e-6, 6.25 * GB / 8, 25e-6, **GPU_CLUSTER
        ),
    )
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UserError(f"unknown hardware profile {name!r}; use one of {', '.join(PROFILES)}") from None
