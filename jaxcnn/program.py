"""One interface for every compiled training program, whatever the layout.

    program = build_program(...)       # jaxcnn.build: dispatches on the layout
    state = program.init()
    state, metrics = program.train_step(state, *program.train_input.place(images, labels))

An SPMD layout (single, dp, fsdp, tp, hybrid, spatial, user tables) compiles to one program
over the whole mesh (jaxcnn.spmd); the pipeline to one program per stage and kind, driven
by the host (jaxcnn.pipeline). Both fill the same fields, so the fit loop, the scripts and
the analysis never ask which one they hold. A `Program` is what a run calls; its `anatomy`
is what the tools that cost and check it read: `anatomy.stages` lists, per stage, the
compiled programs one optimizer step runs and how often, which is all a cost reader needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jax.sharding import Mesh

from jaxcnn import compile_cache
from jaxcnn.compiling import ProgramTiming, compile_with
from jaxcnn.config import ModelConfig, OptimConfig, UpdateConfig
from jaxcnn.data.on_device import OnDevice
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import ParamPlacement
from jaxcnn.sharding.placement import BatchPlacement


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
    image_dtype: str = "float32"  # the batches' pixels: float32 in [0, 1], or uint8 scaled in the step
    on_device: OnDevice | None = None  # the training set held on the devices: steps gather their batches there
    steps_per_call: int = 1  # optimizer steps per compiled call (the calls compiled with the program)


@dataclass(frozen=True)
class StepCall:
    """One compiled call the training loop makes: `steps` optimizer steps, their batches
    stacked from the host or, `on_device`, gathered from the training data on the devices."""

    # (state, *inputs) -> (state, metrics): each metric [steps] when `stacked`, else a scalar; on the
    # devices (state, carry): its metrics written into the epoch's log (jaxcnn.steps.calls.steps_on_device_data)
    run: Any
    steps: int
    on_device: bool
    stacked: bool = True


class StepCalls:
    """The calls a program's loop may make, by (steps, on_device), each compiled the first
    time it is asked for -- or ahead, on a thread (`compile_ahead`), while the loop runs
    others: an epoch's shorter last call on the devices."""

    def __init__(
        self, lower: Callable[[int, bool], Any], options: dict | None, ready: dict[tuple, StepCall], carry=None
    ):
        self._lower, self._options = lower, options  # (steps, on_device) -> jax.stages.Lowered
        self.carry = carry  # on the devices: the calls' carry, abstract (jaxcnn.steps.calls.epoch_carry)
        self._calls = dict(ready)
        self._pending: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self.timings: list[ProgramTiming] = []  # of the calls compiled after the build

    def get(self, steps: int, on_device: bool) -> StepCall:
        """The call, compiled now if it is not yet (or waited for, if on its way)."""
        key = (steps, on_device)
        with self._lock:
            if key in self._calls:
                return self._calls[key]
            pending = self._pending.get(key)
        return pending.result() if pending else self._compile(key)

    def ready(self, steps: int, on_device: bool) -> bool:
        return (steps, on_device) in self._calls

    def compile_ahead(self, steps: int, on_device: bool) -> None:
        """Start compiling the call on a thread (XLA does not hold the interpreter)."""
        key = (steps, on_device)
        with self._lock:
            if key in self._calls or key in self._pending:
                return
            pool = ThreadPoolExecutor(1, thread_name_prefix="jaxcnn-compile")
            self._pending[key] = pool.submit(self._compile, key)
            pool.shutdown(wait=False)

    def _compile(self, key: tuple) -> StepCall:
        start = time.perf_counter()
        lowered = self._lower(*key)
        lowered_at = time.perf_counter()
        with compile_cache.watch() as seen:
            run = compile_with(lowered, self._options)
        done = time.perf_counter()
        call = StepCall(run, key[0], key[1])
        cached = seen["hit"] if compile_cache.in_use() is not None else None
        with self._lock:
            self._calls[key] = call
            self._pending.pop(key, None)
            self.timings.append(ProgramTiming(call_name(*key), lowered_at - start, done - lowered_at, cached))
        return call


class LazyCompiled:
    """A program compiled the first time it is called (`compile()` gives the compiled one)."""

    def __init__(self, compile: Callable[[], Any]):
        self._compile, self._compiled = compile, None

    def __call__(self, *args):
        if self._compiled is None:
            self._compiled = self._compile()
        return self._compiled(*args)


def call_name(steps: int, on_device: bool) -> str:
    """A call's name in compile timings: "train/device/32"."""
    return "train/" + ("device/" if on_device else "") + str(steps)


class CompiledPart(NamedTuple):
    """A compiled program one optimizer step runs `calls` times, on `devices` devices."""

    name: str
    compiled: Any  # jax.stages.Compiled
    calls: int
    devices: int
    takes_optimizer_state: bool = True  # False: the state stays resident beside it (a pipeline's forward)


@dataclass(frozen=True)
class Anatomy:
    """What a compiled program is made of, for the tools that cost and check it
    (jaxcnn.analysis) and the pipeline's stage table; no step reads it."""

    stages: list[list[CompiledPart]]  # per stage (SPMD: one), what a train step runs
    placements: list[ParamPlacement]  # parameters, then model state (BN statistics); pipeline: "stage<s>/" paths
    compute_placements: list[ParamPlacement]  # parameters as used for compute (FSDP: gathered)
    stage_param_bytes: list[int]  # parameters + statistics per device, per stage
    stage_optimizer_bytes: list[int]
    # pipeline: per stage, bytes per device per step across the boundaries after its chunks
    # (activations forward, gradients back), and how many sends a stage's boundaries make
    boundary_bytes: list[int] = field(default_factory=list)
    boundary_transfers: int = 0  # per step: M activations forward, M gradients back, per chunk
    bubble_fraction: float = 0.0  # pipeline: share of each stage's time it idles
    microbatches: int = 1  # pipeline: micro-batches a step streams through the stages
    layer_groups: list[range] = field(default_factory=list)  # pipeline: the model's layers each chunk holds
    # pipeline: per stage, the micro-batch inputs and output gradients its schedule holds at once
    stage_held_bytes: list[int] = field(default_factory=list)


def _same(state):
    return state


@dataclass
class Program:
    """Everything compiled for one (model, layout, mesh, batch size): what a run calls,
    then what its reports read."""

    spec: ProgramSpec  # what was compiled: model, optimizer, layout, mesh, batch sizes
    init: Any  # () -> state, each device creating its own shards; None when not compiled
    train_step: Any  # (state, images, labels) -> (state, {"loss", "accuracy"[, "skipped"]})
    eval_step: Any  # (state, images, labels, mask) -> (loss_sum, correct_sum, predictions); None without eval
    train_input: BatchPlacement  # how train_step takes its batch: shapes, shardings, the examples' order
    eval_input: BatchPlacement  # how eval_step takes its batch (images, labels, mask)
    anatomy: Anatomy
    num_params: int
    compile_seconds: float  # XLA compiling every program (or reading the compile cache), wall clock
    lower_seconds: float  # tracing and lowering every program before that, wall clock
    abstract_state: Any = None  # ShapeDtypeStructs with shardings: what a checkpoint restores into
    # the state as checkpoints hold it (a whole-model TrainState), and back: a pipeline's is per stage
    saved_form: Callable[[Any], Any] = _same
    from_saved: Callable[[Any], Any] = _same
    state_shardings: Any = None
    averaging: Any = None  # local SGD: a jaxcnn.steps.ReplicaAveraging, run after each step; else None
    calls: StepCalls | None = None  # several steps per call, data on the devices (SPMD); None: train_step alone
    # (state) -> jaxcnn.saved_model.ModelVariables: the whole model's arrays by path, whatever the layout
    model_variables: Any = None
    record: dict = field(default_factory=dict)  # layout-specific result fields (the pipeline's stages)
    description: str = ""  # printed before training (the pipeline's stage table)
    pipeline: Any = None  # the pipeline's jaxcnn.pipeline.schedule.ScheduleRunner: its timeline, what it held
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
