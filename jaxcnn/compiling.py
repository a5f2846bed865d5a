"""Compile several lowered programs at once, with the XLA:CPU options that make them fast.

Tracing and lowering need the Python interpreter; XLA's compilation does not hold it, so
the programs of one run (train step, eval step, init; a pipeline's per-stage programs)
compile side by side on the host's cores.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax

YNN_FUSION_TYPES = "xla_cpu_experimental_ynn_fusion_type"
# XLA:CPU's default hands four kinds of work to YNNPACK: dots, dots with fused epilogues,
# reductions and convolutions. Its convolutions are the slow ones for this model family on
# x86 (profiled in experiments/profile_step.py; ablation in results/speedups.csv):
# leaving convolutions to XLA's Eigen kernels makes the default model's train step 1.2x
# faster at 28x28 (batch 128) and 1.8x at 224x224 (batch 8). The other three stay.
CPU_STEP_OPTIONS = {
    YNN_FUSION_TYPES: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"
}


def _on_cpu(mesh) -> bool:
    return mesh.devices.flat[0].platform == "cpu"


def cpu_step_options(mesh) -> dict | None:
    """Compiler options for train/eval steps; a choice the user made in XLA_FLAGS wins."""
    if not _on_cpu(mesh) or YNN_FUSION_TYPES in os.environ.get("XLA_FLAGS", ""):
        return None
    return dict(CPU_STEP_OPTIONS)


def cpu_init_options(mesh) -> dict | None:
    """Init runs once; on CPU, LLVM spends seconds optimising each unrolled threefry
    initializer, so compile it unoptimised (same values to ~1e-7, 2-3x faster compile)."""
    return {"xla_backend_optimization_level": 0} if _on_cpu(mesh) else None


def compile_with(lowered: jax.stages.Lowered, options: dict | None):
    """`lowered.compile(options)`; an option this jaxlib does not know is dropped with a
    warning (XLA's debug options change between releases), not a failed run."""
    try:
        return lowered.compile(options)
    except Exception as error:  # XLA raises its own error type: INVALID_ARGUMENT for an unknown option
        unknown = [key for key in options or {} if key in str(error)]
        if not unknown:
            raise
        warnings.warn(
            f"this jaxlib rejects compiler option(s) {', '.join(unknown)}; compiling without them", stacklevel=2
        )
        return lowered.compile({k: v for k, v in options.items() if k not in unknown} or None)


def compile_all(
    lowered: dict[str, jax.stages.Lowered],
    options: dict[str, dict | None] | None = None,
    default: dict | None = None,
) -> dict:
    """{name: compiled} for {name: lowered}; `options` gives per-program compiler options,
    `default` those of every program `options` does not name."""
    options = options or {}
    workers = max(1, min(len(lowered), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(compile_with, low, options.get(name, default)) for name, low in lowered.items()}
        return {name: future.result() for name, future in futures.items()}
