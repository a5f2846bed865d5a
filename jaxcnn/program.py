"""One interface for every compiled training program, whatever the layout.

    program = build_program(...)       # jaxcnn.build: dispatches on the layout
    state = program.init()
    state, metrics = program.train_step(state, *program.place_batch(images, labels))

An SPMD layout (single, dp, fsdp, tp, hybrid, spatial, user tables) compiles to one program
over the whole mesh (jaxcnn.spmd); the pipeline to one program per stage and kind, driven
by the host (jaxcnn.pipeline). Both fill the same fields, so the fit loop, the scripts and
the analysis never ask which one they hold: `stages` lists, per stage, the compiled
programs one optimizer step runs and how often, which is all a cost reader needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxcnn.config import ModelConfig, OptimConfig, UpdateConfig
from jaxcnn.data import Feed, process_rows, to_global
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import ParamPlacement


@dataclass(frozen=True)
class ProgramSpec:
    """What to compile: the arguments of `jaxcnn.build.build_program`, checked there."""

    model_config: ModelConfig  # or a jaxcnn.models.CustomModel
    optim_config: OptimConfig
    layout: Layout
    mesh: Mesh
    image_shape: tuple[int, int, int]
    batch_size: int
    total_steps: int  # the learning-rate schedule's length
    seed: int
    eval_batch_size: int
    with_eval: bool  # compile the eval step
    with_init: bool  # compile init (SPMD; a pipeline always does)
    update: UpdateConfig
    compiler_options: dict | None  # None: jaxcnn.compiling's for the platform


class CompiledPart(NamedTuple):
    """A compiled program one optimizer step runs `calls` times, on `devices` devices."""

    name: str
    compiled: Any  # jax.stages.Compiled
    calls: int
    devices: int
    takes_optimizer_state: bool = True  # False: the state stays resident beside it (a pipeline's forward)


@dataclass
class Program:
    """Everything compiled for one (model, layout, mesh, batch size)."""

    spec: ProgramSpec  # what was compiled: model, optimizer, layout, mesh, batch sizes
    batch_shardings: tuple[NamedSharding, NamedSharding]  # train (images, labels)
    eval_shardings: tuple[NamedSharding, NamedSharding, NamedSharding]  # (images, labels, mask)
    placements: list[ParamPlacement]  # parameters, then model state (BN statistics); pipeline: "stage<s>/" paths
    compute_placements: list[ParamPlacement]  # parameters as used for compute (FSDP: gathered)
    num_params: int
    init: Any  # () -> state, each device creating its own shards; None when not compiled
    train_step: Any  # (state, images, labels) -> (state, {"loss", "accuracy"[, "skipped"]})
    eval_step: Any  # (state, images, labels, mask) -> (loss_sum, correct_sum, predictions); None without eval
    compile_seconds: float  # XLA compiling every program (or reading the compile cache), wall clock
    lower_seconds: float  # tracing and lowering every program before that, wall clock
    stages: list[list[CompiledPart]]  # per stage (SPMD: one), what a train step runs
    stage_param_bytes: list[int]  # parameters + statistics per device, per stage
    stage_optimizer_bytes: list[int]
    abstract_state: Any = None  # ShapeDtypeStructs with shardings: what a checkpoint restores into
    state_shardings: Any = None
    average_step: Any = None  # local SGD: compiled (state) -> state, replicas averaged
    sync_every: int = 0  # local SGD: run average_step every this many steps (0: never)
    batch_order: np.ndarray | None = None  # gradient accumulation: jaxcnn.steps.UpdatePlan.batch_order
    # pipeline: bytes per device per step sent across each stage boundary, and how many sends
    boundary_bytes: list[int] = field(default_factory=list)
    boundary_transfers: int = 0  # per boundary per step: M activations forward, M gradients back
    bubble_fraction: float = 0.0  # pipeline: share of each stage's time it idles
    microbatches: int = 1  # pipeline: micro-batches a step streams through the stages
    layer_groups: list[range] = field(default_factory=list)  # pipeline: the model's layers each stage holds
    record: dict = field(default_factory=dict)  # layout-specific result fields (the pipeline's stages)
    # (state) -> jaxcnn.saved_model.ModelVariables: the whole model's arrays by path, whatever the layout
    model_variables: Any = None
    description: str = ""  # printed before training (the pipeline's stage table)
    compile_timings: list = field(default_factory=list)  # jaxcnn.compiling.ProgramTiming per program

    @property
    def layout(self) -> Layout:
        return self.spec.layout

    @property
    def mesh(self) -> Mesh:
        return self.spec.mesh

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.spec.eval_batch_size

    def place_batch(self, images: np.ndarray, labels: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """A host batch as the train step's global arrays (each process gives its rows)."""
        if self.batch_order is not None:
            images, labels = images[self.batch_order], labels[self.batch_order]
        return to_global(images, self.batch_shardings[0]), to_global(labels, self.batch_shardings[1])

    @functools.cached_property  # read every step by place_rows: worked out once
    def feed(self) -> Feed:
        """What the loader builds for this program: its batch size, order, and this process's rows."""
        shapes = ((self.batch_size, *self.spec.image_shape), (self.batch_size,))
        rows = process_rows(list(zip(self.batch_shardings, shapes, strict=True)))
        return Feed(self.batch_size, self.batch_order, rows)

    def place_rows(self, images: np.ndarray, labels: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """This process's rows of a batch (`feed.rows`, already in `batch_order`) as the global arrays."""
        first = self.feed.rows.start
        return tuple(
            to_global(a, s, self.batch_size, first) for a, s in zip((images, labels), self.batch_shardings, strict=True)
        )
