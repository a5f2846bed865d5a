"""Speed choices that differ by platform, each made from measurements kept in results/.

Every choice here computes the same numbers either way (checked against float64 in
tests/test_gradients.py); only speed and compile time differ, and those differ by platform.
A platform uses a choice's `chosen` variant only where `results/platform_choices.csv` holds
that platform's measurements of every variant (experiments/platform_choices.py writes it;
tests/test_platform_choices.py holds this table to it through `pick`); elsewhere it keeps the
safe default, what XLA does with the program as written.

    variant("conv1x1", "gpu")          # "conv" until a GPU's measurements say otherwise
    step_compiler_options("cpu")       # the XLA options a train/eval step compiles with

Not a platform choice: batch norm's two-pass variance (jaxcnn.models.parts.norm_layer). It
changes the numbers -- E[x^2] - E[x]^2 cancels where a channel's mean is large beside its
spread -- so it is held to the float64 gradient bar on every platform, whatever it costs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    variants: tuple[str, ...]
    default: str  # the safe default: XLA's own way
    chosen: dict[str, str] = field(default_factory=dict)  # platform -> variant, from the evidence
    what: str = ""


CHOICES = {
    "conv1x1": Choice(
        ("dot", "conv"),
        default="conv",
        chosen={"cpu": "dot"},
        what="a 1x1 convolution as a matrix product over channels (jaxcnn.layers.pointwise_conv) or as a "
        "convolution (XLA:GPU hands convolutions to cuDNN, matrix products to its GEMM autotuner)",
    ),
    "max_pool": Choice(
        ("select", "window"),
        default="window",
        chosen={"cpu": "select"},
        what="the CNN's 2x2 max-pool: jaxcnn.layers.max_pool_2x2 (winner chosen in the forward pass) or "
        "lax.reduce_window, whose gradient is XLA's select-and-scatter",
    ),
    "cpu_convs": Choice(
        ("eigen", "ynnpack"),
        default="ynnpack",
        chosen={"cpu": "eigen"},
        what="XLA:CPU: convolutions in Eigen or in YNNPACK (dots and reductions stay in YNNPACK)",
    ),
    "autotune": Choice(
        ("4", "2", "1", "0"),
        default="4",
        what="XLA:GPU's autotuning level (xla_gpu_autotune_level): 0 takes cuDNN's and the GEMM emitter's "
        "first choice, 1 times the candidates, 2-4 add buffer initialisation and correctness checks",
    ),
}
# Which platform each choice applies to at all (the others have nothing to choose).
PLATFORMS = {"conv1x1": None, "max_pool": None, "cpu_convs": "cpu", "autotune": "gpu"}

# A variant that steps this much slower than the fastest may still win if it compiles this
# much faster: time to the first step counts too.
STEP_TOLERANCE, COMPILE_ADVANTAGE = 0.02, 0.25


def variant(name: str, platform: str) -> str:
    choice = CHOICES[name]
    return choice.chosen.get(platform, choice.default)


def pick(measured: dict[str, tuple[float, float]]) -> str:
    """The variant to choose from {variant: (seconds per step, compile seconds)}: the fastest
    step, unless another within STEP_TOLERANCE of it compiles COMPILE_ADVANTAGE faster."""
    fastest = min(measured, key=lambda v: measured[v][0])
    step, compile_seconds = measured[fastest]
    close = [v for v, (s, c) in measured.items() if s <= step * (1 + STEP_TOLERANCE)]
    quickest = min(close, key=lambda v: measured[v][1])
    return quickest if measured[quickest][1] <= compile_seconds * (1 - COMPILE_ADVANTAGE) else fastest


def pick_across(measurements: list[dict[str, tuple[float, float]]]) -> str:
    """`pick` over several configurations' measurements ({variant: (step s, compile s)} each):
    each variant's geometric mean, over the configurations, of its times relative to that
    configuration's fastest -- so a large model's seconds do not outvote a small one's."""
    common = set.intersection(*(set(m) for m in measurements))

    def relative(index: int, variant: str) -> float:
        return math.exp(
            sum(math.log(m[variant][index] / min(m[v][index] for v in common)) for m in measurements)
            / len(measurements)
        )

    return pick({v: (relative(0, v), relative(1, v)) for v in common})


YNN_FUSION_TYPES = "xla_cpu_experimental_ynn_fusion_type"
# XLA:CPU's default hands four kinds of work to YNNPACK; "eigen" leaves convolutions out.
CPU_WITHOUT_YNN_CONVS = {
    YNN_FUSION_TYPES: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
}
AUTOTUNE_LEVEL = "xla_gpu_autotune_level"


def step_compiler_options(platform: str) -> dict | None:
    """XLA options for train and eval steps on `platform` (None: XLA's defaults). An option
    the user set in XLA_FLAGS wins over the table."""
    user = os.environ.get("XLA_FLAGS", "")
    options = {}
    if platform == "cpu" and variant("cpu_convs", "cpu") == "eigen" and YNN_FUSION_TYPES not in user:
        options.update(CPU_WITHOUT_YNN_CONVS)
    level = variant("autotune", platform)
    if platform == "gpu" and level != CHOICES["autotune"].default and AUTOTUNE_LEVEL not in user:
        options[AUTOTUNE_LEVEL] = int(level)
    return options or None


def probe_compiler_options(platform: str) -> dict | None:
    """For programs compiled only to read their memory use, never run (the batch searches):
    no autotuning, which only picks among kernels for speed."""
    return {AUTOTUNE_LEVEL: 0} if platform == "gpu" else step_compiler_options(platform)


def init_compiler_options(platform: str) -> dict | None:
    """Init runs once; on CPU, LLVM spends seconds optimising each unrolled threefry
    initializer, so compile it unoptimised (same values to ~1e-7, 2-3x faster compile)."""
    return {"xla_backend_optimization_level": 0} if platform == "cpu" else None
