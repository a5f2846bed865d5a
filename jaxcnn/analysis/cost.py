"""What a compiled program costs each device per optimizer step: memory (XLA's
`memory_analysis`), FLOPs (`cost_analysis`, and the model's own count from the layer
shapes: jaxcnn.analysis.model_flops, which XLA:CPU's depthwise kernel gradients overstate)
and collectives (the HLO), read without running anything.

`step_cost` reads one compiled step. `program_cost` reads any `jaxcnn.program.Program`
through its `stages`: an SPMD program is one stage of one program; a pipeline stage runs
several per-stage programs, some once per micro-batch. Its figures are then those of the
stage that bounds the step -- the most parameter, optimizer and temporary bytes, the
most FLOPs -- plus the activations and gradients sent between stages (point-to-point
`device_put`s, not HLO collectives); per-kind collective bytes are the stages' mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from jaxcnn.analysis.hlo import Collective, collectives, kernel_count
from jaxcnn.analysis.model_flops import program_model_flops
from jaxcnn.autobatch import largest_batch
from jaxcnn.build import build_program
from jaxcnn.errors import UserError
from jaxcnn.platform_choices import probe_compiler_options
from jaxcnn.program import CompiledPart, Program
from jaxcnn.sharding.partition import bytes_per_device, quiet_fallbacks
from jaxcnn.steps import update_rule


@dataclass(frozen=True)
class StepCost:
    """What one compiled train step costs each device (read from XLA, nothing run)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # donated inputs reused as outputs
    temp_bytes: int  # activations and scratch
    param_bytes: int  # parameters (and batch-norm statistics) held per device
    optimizer_bytes: int
    flops: float  # per device
    collectives: list[Collective]

    @property
    def peak_bytes(self) -> int:
        """Live at once: inputs, outputs not aliased to inputs, and temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def comm_bytes(self, kind: str | None = None) -> int:
        """Per step: a collective inside a loop counts once per iteration."""
        return sum(c.step_bytes for c in self.collectives if kind in (None, c.kind))

    def wire_bytes(self, kind: str | None = None) -> float:
        return sum(c.step_wire_bytes for c in self.collectives if kind in (None, c.kind))


def step_cost(compiled, abstract_state, num_devices: int) -> StepCost:
    """Memory (`memory_analysis`), FLOPs (`cost_analysis`) and collectives of a compiled step.

    `abstract_state` is the step's TrainState of ShapeDtypeStructs with shardings.
    """
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per device
    return StepCost(
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        param_bytes=bytes_per_device((abstract_state.params, abstract_state.model_state)),
        optimizer_bytes=bytes_per_device(abstract_state.opt_state),
        flops=float(cost.get("flops", 0.0)),
        collectives=collectives(compiled.as_text(), num_devices),
    )


def live_bytes(memory) -> int:
    """A compiled program's peak per device from its `memory_analysis()`: inputs, outputs not
    aliased to inputs, and temporaries."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def _analyses(compiled):
    cost = compiled.cost_analysis()
    return compiled.memory_analysis(), cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: per device


def part_collectives(part: CompiledPart) -> list[Collective]:
    """A part's collectives, each counted as often as a step runs it (`repeats`)."""
    found = collectives(part.compiled.as_text(), part.devices)
    return [dataclasses.replace(c, repeats=c.repeats * part.calls) for c in found]


def program_collectives(program: Program) -> list[Collective]:
    """Every collective one optimizer step of `program` runs, all stages."""
    return [c for stage in program.anatomy.stages for part in stage for c in part_collectives(part)]


@dataclass(frozen=True)
class ProgramCost:
    """Per device per optimizer step, for the stage that bounds it (module docstring)."""

    param_bytes: int
    optimizer_bytes: int
    temp_bytes: int
    peak_bytes: int  # the most live at once: a program's arguments, outputs, temporaries (+ resident state)
    flops: float  # XLA's cost_analysis
    stage_collectives: list[list[Collective]]
    transfer_bytes: int  # pipeline: the most one stage boundary carries, forward + backward
    num_collectives: int  # collectives (loops counted once) and sends between stages per step
    num_kernels: int = 0  # kernels the busiest stage launches per step (loop bodies counted once)
    # the model's training FLOPs from its layer shapes (jaxcnn.analysis.model_flops); None: a custom model
    model_flops: float | None = None

    @property
    def compute_flops(self) -> float:
        """The FLOPs a step's compute is priced by: the model's count where there is one
        (XLA:CPU's counts a depthwise kernel gradient as a full convolution), else XLA's."""
        return self.flops if self.model_flops is None else self.model_flops

    def kind_bytes(self, kind: str) -> int:
        return sum(c.step_bytes for stage in self.stage_collectives for c in stage if c.kind == kind) // len(
            self.stage_collectives
        )

    @property
    def comm_bytes(self) -> int:
        return max(sum(c.step_bytes for c in stage) for stage in self.stage_collectives) + self.transfer_bytes

    @property
    def wire_bytes(self) -> float:
        return max(sum(c.step_wire_bytes for c in stage) for stage in self.stage_collectives) + self.transfer_bytes


def program_cost(program: Program) -> ProgramCost:
    anatomy = program.anatomy
    flops, temp, peak, found, kernels, count = [], [], [], [], [], 0
    held = anatomy.stage_held_bytes or [0] * len(anatomy.stages)  # a pipeline's micro-batches in flight
    for stage, optimizer_bytes, in_flight in zip(anatomy.stages, anatomy.stage_optimizer_bytes, held, strict=True):
        analyses = [_analyses(part.compiled) for part in stage]
        flops.append(sum(part.calls * float(c.get("flops", 0.0)) for part, (_, c) in zip(stage, analyses, strict=True)))
        temp.append(max(m.temp_size_in_bytes for m, _ in analyses))
        # live bytes of each program, plus the optimizer state where it stays resident beside it
        peak.append(in_flight + max(
            live_bytes(m) + (0 if part.takes_optimizer_state else optimizer_bytes)
            for part, (m, _) in zip(stage, analyses, strict=True)
        ))  # fmt: skip
        kernels.append(sum(part.calls * kernel_count(part.compiled.as_text()) for part in stage))
        per_part = [part_collectives(part) for part in stage]
        found.append([c for cs in per_part for c in cs])
        count += sum(len(cs) * part.calls for part, cs in zip(stage, per_part, strict=True))
    return ProgramCost(
        param_bytes=max(anatomy.stage_param_bytes),
        optimizer_bytes=max(anatomy.stage_optimizer_bytes),
        temp_bytes=max(temp),
        peak_bytes=max(peak),
        flops=max(flops),
        stage_collectives=found,
        transfer_bytes=max(anatomy.boundary_bytes, default=0),
        num_collectives=count + anatomy.boundary_transfers,
        num_kernels=max(kernels),
        model_flops=program_model_flops(program),
    )


def step_peak_bytes(model_config, optim_config, layout, mesh, image_shape, **build_options) -> Callable[[int], int]:
    """batch -> per-device peak bytes of the train step at that global batch, compiled and
    never run: what the batch searches (jaxcnn.autobatch) probe. Compiled without autotuning
    on a GPU (it picks among kernels for speed; a search compiles ten or more programs that
    never run), unless `compiler_options` says otherwise."""
    build_options.setdefault("compiler_options", probe_compiler_options(mesh.devices.flat[0].platform))

    def peak(batch: int) -> int:
        with quiet_fallbacks():  # placements are the same for every probe
            program = build_program(
                model_config, optim_config, layout, mesh, image_shape, batch, 1000,
                with_eval=False, with_init=False, **build_options,
            )  # fmt: skip
        return program_cost(program).peak_bytes

    return peak


def auto_batch(model_config, optim_config, layout, mesh, image_shape, update_config, budget: float, train_size: int):
    """`--auto-batch`: search compiled train steps for the largest global batch whose peak
    memory per device fits `budget` (jaxcnn.autobatch.BatchSearch)."""
    if layout.stage_axis:
        raise UserError("--auto-batch needs a single-program layout; give the pipeline a --batch-size")
    # a batch must split over the data shards and then into the micro-batches
    multiple = update_rule(update_config, layout, mesh).groups * update_config.grad_accum

    peak = step_peak_bytes(model_config, optim_config, layout, mesh, image_shape, update=update_config)
    return largest_batch(peak, budget, multiple, train_size)
