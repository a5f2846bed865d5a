"""Hardware profiles for the planner: peak FLOP/s, per-device memory, interconnect.

`link_bytes_per_second` is the one-way bandwidth one device can drive into the ring
collectives (half the vendor's bidirectional figure), the quantity `wire_bytes` (ring
traffic sent per device) is divided by. `flops_fp32` is what an fp32 JAX program gets:
on NVIDIA Ampere and later XLA runs fp32 convolutions and matmuls on TF32 tensor cores at
default precision, so it is the dense TF32 peak there.

A convolutional net's training step does not run at peak: batch norm, ReLU, pooling and the
optimizer are bound by memory bandwidth, and the convolutions themselves reach part of it.
`conv_fraction_fp32` and `conv_fraction_bf16` are the fraction of the peak a ResNet-50 v1.5
training step reaches on that GPU in published measurements, and the planner divides a
program's FLOPs by `achieved_flops` = peak x fraction. Each is derived the same way:

    fraction = FLOPs per image (jaxcnn's compiled step) x published images/s per GPU / peak

with jaxcnn's ResNet-50 at 224x224 costing 24.08 GFLOP an image to train (`cost_analysis` of
its compiled train step: 3.082e12 FLOPs for 128 images, results/simulate_resnet50.csv, the
single-device step the same to 0.01%). The published figures (images/s per GPU, training,
ResNet-50 v1.5 at 224; `RESNET50_IMAGES_PER_SECOND` holds the lowest, the one used, the highest):

- A100, TF32: 938 (used; NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/
  resnet50v1.5/README.md, "Training performance: NVIDIA DGX A100 (8x A100 80GB)", 1 GPU,
  pytorch-21.03 NGC container, batch 256 per GPU in configs.yml); 909 (the same repository's
  TensorFlow/Classification/ConvNets/resnet50v1.5/README.md, TF32 + XLA, DGX A100 40GB,
  batch 256, 20.06-tf1 container); 1,066 (lambdal/deeplearning-benchmark,
  pytorch/pytorch-train-throughput-fp32.csv, "A100 80GB SXM4", the DeepLearningExamples
  script at batch 640). Fraction 14.5%.
- A100, mixed precision (fp16 AMP; bf16 has the same tensor-core peak): 2,470 (used; the
  PyTorch README above, batch 256, NHWC); 2,375 (the TensorFlow README, + XLA); 3,411
  (MxNet/Classification/RN50v1.5/README.md, DGX A100 80GB, mxnet-22.10, 1 GPU). Fraction 19.1%.
- H100 SXM5, TF32: 1,894 (used; lambdal/deeplearning-benchmark,
  pytorch/pytorch-train-throughput-v2-fp32.csv, the most common figure of its 28 runs on one
  H100 80GB SXM5: the DeepLearningExamples PyTorch script without --amp (TF32 convolutions,
  PyTorch's cuDNN default), NGC pytorch:24.10, synthetic data, batch 640; 1,753-1,898 over
  that file and pytorch-train-throughput-fp32.csv). No NVIDIA H100 TF32 ResNet-50 figure was
  found. Fraction 9.2%.
- H100 SXM5, mixed precision: 7,009 (used; MLPerf Training v3.0, NVIDIA's closed-division
  single-node DGX H100 submission, mlcommons/training_results_v3.0
  NVIDIA/results/dgxh100_ngc23.04_mxnet/resnet/result_*.txt: median epoch throughput
  56,071 images/s over 8 GPUs, fp16, batch 400 a GPU, MXNet 23.04, DALI); 2,616-2,800
  (lambdal's pytorch-train-throughput[-v2]-fp16.csv, AMP at batch 1280, NCHW). Fraction 17.1%.
- H200: H100's fractions (the same compute die; no H200 ResNet-50 figure found -- its faster
  memory makes this a lower bound).
- P100 (p100-ethernet), fp32: Goyal et al. 2017, Figure 7 and sec. 5.5: an epoch of 1.28 M
  images at minibatch 256 on 8 P100s (32 images a GPU) takes "over 16 minutes", 0.192 s an
  iteration, 167 images/s a GPU (used); their 29 hours for the 90-epoch baseline on 8 GPUs
  (sec. 1, evaluation included) gives 138. Fraction 37.9%.
- No figure, so the peak (fraction 1): cpu-here (its FLOP/s are measured), TPU v5e, P100 in
  fp16.

The modelled step adds each kernel's launch to FLOPs / achieved FLOP/s, which the published
throughput already contains: at 128 images a GPU that puts the planner's ResNet-50 about 5%
below the figure it was calibrated on (H100 TF32: ~1,800 images/s against 1,894).

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

from dataclasses import dataclass, replace

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
    # of the peak, what a convolutional net's training step reaches (module docstring); 1: the peak
    conv_fraction_fp32: float = 1.0
    conv_fraction_bf16: float = 1.0

    def flops(self, dtype: str = "float32") -> float:
        """Peak FLOP/s (the datasheet's, or cpu-here's measured matmul)."""
        return self.flops_bf16 if dtype == "bfloat16" else self.flops_fp32

    def achieved_flops(self, dtype: str = "float32") -> float:
        """The FLOP/s a convolutional net's training step reaches: the peak x its fraction."""
        return self.flops(dtype) * (self.conv_fraction_bf16 if dtype == "bfloat16" else self.conv_fraction_fp32)


GB, GiB, MiB = 1e9, 2**30, 2**20
# XLA:GPU's combine threshold (xla/debug_options_flags.cc); a GPU's backward pass is about
# two thirds of a training step's compute, the window its gradients' reductions hide in
GPU_CLUSTER = {"combine_threshold_bytes": 30 * MiB, "collective_algorithm": "nccl", "overlap_fraction": 2 / 3}

# ResNet-50 at 224x224: FLOPs to train one image, as jaxcnn compiles it (module docstring)
RESNET50_TRAIN_FLOPS_PER_IMAGE = 24.08e9
# Goyal et al. 2017, Figure 7: an epoch of 1,281,167 images at minibatch 256 "over 16 minutes"
GOYAL_ITERATION_SECONDS = 16 * 60 / (1_281_167 / 256)
# published ResNet-50 v1.5 training images/s per GPU: (lowest, used, highest) of the figures
# the module docstring cites, per profile and dtype
RESNET50_IMAGES_PER_SECOND: dict[tuple[str, str], tuple[float, float, float]] = {
    ("a100", "float32"): (909, 938, 1_066),
    ("a100", "bfloat16"): (2_375, 2_470, 3_411),
    ("h100", "float32"): (1_753, 1_894, 1_898),
    ("h100", "bfloat16"): (2_616, 7_009, 7_009),
    ("p100-ethernet", "float32"): (138, 32 / GOYAL_ITERATION_SECONDS, 32 / GOYAL_ITERATION_SECONDS),
}
CALIBRATED_AS = {"h200": "h100"}  # no figure of its own: the same die's


def calibrated(profile: HardwareProfile) -> HardwareProfile:
    """`profile` with the fractions its published ResNet-50 throughput gives (1 where none)."""
    fractions = {}
    for dtype, field in (("float32", "conv_fraction_fp32"), ("bfloat16", "conv_fraction_bf16")):
        figures = RESNET50_IMAGES_PER_SECOND.get((CALIBRATED_AS.get(profile.name, profile.name), dtype))
        if figures:
            fractions[field] = RESNET50_TRAIN_FLOPS_PER_IMAGE * figures[1] / profile.flops(dtype)
    return replace(profile, **fractions)


PROFILES: dict[str, HardwareProfile] = {
    p.name: calibrated(p)
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
