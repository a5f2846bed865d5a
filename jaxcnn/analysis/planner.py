"""Layout planner: which layout and mesh to use for a model on N devices of some kind.

    candidates = plan(model_config, (224, 224, 3), batch_size=256, num_devices=8,
                      budget_bytes=16 * 2**30, profile=get_profile("tpu-v5e"))
    print(explain(candidates, budget_bytes))

Every mesh factorisation of N x every layout is compiled ahead of time (nothing runs;
on a CPU-only machine on N simulated devices), and beside them one device and dp on every
smaller divisor of N -- the same global batch on fewer devices -- and read back: per-device
peak memory (`memory_analysis`), FLOPs (`cost_analysis`, and the model's count from its
layer shapes), kernels launched and every collective (the HLO). Candidates over the memory
budget are dropped; the rest are ranked by modelled step time, an alpha-beta (Hockney)
model with the fixed costs a GPU pays:

    step = FLOPs per device / achieved FLOP/s  +  kernels x kernel_seconds
         + the collectives' exposed time (latency x hops + wire bytes / bandwidth)

with the model's FLOPs (jaxcnn.analysis.model_flops), not XLA's: XLA:CPU counts a depthwise
conv's kernel gradient as the full convolution, C x its work (a custom model, which has no
layer shapes, is priced by XLA's), where achieved FLOP/s is the peak x the fraction of it a convolutional net's training step
reaches on that hardware, calibrated on published ResNet-50 throughput (the peak itself
for cpu-here, whose FLOP/s are measured), and a GPU cluster's collectives are those XLA:GPU
and NCCL would run -- the parameters' combined and hidden behind compute, log-depth trees
across hosts (jaxcnn.analysis.cluster_clock); jaxcnn.analysis.hardware gives each profile's
figures and their sources. A candidate whose devices each do
well over their share of the work (FLOPs per device above 1.5x the one-device program's /
devices: spatial on images too small to split, tp's replicated layers) is named as
redundant compute.

A pipeline candidate is costed by its busiest stage (jaxcnn.analysis.cost): its compute
stretched by the bubble, (M+S-1)/M, and the activations it sends to the next stage added
to its wire bytes; its peak is that stage's largest program plus its optimizer state.

Candidates within 3% of each other count as tied and the one on fewer devices, then the
one that splits less (dp before hybrid before the rest), wins: same speed, cheaper and
simpler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from jaxcnn.analysis.cluster_clock import step_comm
from jaxcnn.analysis.cost import ProgramCost, part_collectives, program_cost
from jaxcnn.analysis.hardware import HardwareProfile
from jaxcnn.analysis.lint import classify
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.errors import UserError
from jaxcnn.models import layer_shapes
from jaxcnn.pipeline.schedule import held_in_flight, stage_orders, ticks, timeline_bubble
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import LAYOUTS, Layout, parse_rules
from jaxcnn.sharding.mesh import across_hosts, build_mesh, format_mesh
from jaxcnn.sharding.partition import quiet_fallbacks

TIE = 0.03
REDUNDANT = 1.5  # FLOPs per device above this x the fair share: flagged
# fsdp and tp together: only a rules table (docs/layouts.md)
FSDP_TP = parse_rules("batch=data,params=data,conv_out=model,mlp=model", name="fsdp+tp")
SIMPLICITY = {"single": 0, "dp": 1, "hybrid": 2, "fsdp": 3, "tp": 4, "fsdp+tp": 5, "spatial": 6, "pipeline": 7}
# a pipeline mesh is priced under each schedule: (--pipeline-schedule, --virtual-stages)
PIPELINE_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("1f1b", 2))


@dataclass
class Candidate:
    layout: Layout
    mesh_shape: dict[str, int]
    peak_bytes: int = 0
    param_bytes: int = 0
    optimizer_bytes: int = 0
    flops: float = 0.0  # per device: XLA's cost_analysis
    model_flops: float | None = None  # per device: the model's count (jaxcnn.analysis.model_flops)
    wire_bytes: float = 0.0
    num_collectives: int = 0
    num_kernels: int = 0
    redundancy: float = 1.0  # FLOPs per device / (the one-device program's / devices)
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    error: str | None = None  # why it could not be compiled (e.g. a size that does not divide)
    cost: ProgramCost | None = None  # what the compiled program does, before any hardware prices it
    roles: list[list[str]] | None = None  # per stage, each collective's role (lint.classify): which can hide
    bubble_fraction: float = 0.0
    schedule: tuple[str, int] | None = None  # a pipeline's (schedule, virtual stages)

    @property
    def name(self) -> str:
        """The layout's name; a pipeline's with its schedule ("pipeline/1f1b", "pipeline/1f1b x2")."""
        if self.schedule is None:
            return self.layout.name
        schedule, virtual = self.schedule
        return f"{self.layout.name}/{schedule}" + (f" x{virtual}" if virtual > 1 else "")

    @property
    def compute_flops(self) -> float:
        """What the compute is priced by: the model's count, XLA's for a custom model."""
        return self.flops if self.model_flops is None else self.model_flops

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds

    @property
    def mesh(self) -> str:
        return format_mesh(self.mesh_shape)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    @property
    def redundant(self) -> bool:
        return self.redundancy > REDUNDANT


def comm_seconds(
    cost: ProgramCost,
    profile: HardwareProfile,
    mesh_shape: dict[str, int],
    across: dict[str, int] | None = None,
    compute_seconds: float = 0.0,
    roles: list[list[str]] | None = None,
) -> float:
    """Modelled time a step's collectives add to it (jaxcnn.analysis.cluster_clock): each
    hop pays a link's latency, each wire byte its bandwidth -- the network's where the
    collective's group spans hosts (`across`: each mesh axis's ways across hosts), else the
    link inside a host (simulated devices share one host's bandwidth N ways). On a GPU
    cluster profile the parameters' collectives are combined and hide behind
    `compute_seconds`; `roles` (per stage, `lint.classify`'s) says which they are."""
    index = max(
        range(len(cost.stage_collectives)), key=lambda i: sum(c.step_wire_bytes for c in cost.stage_collectives[i])
    )
    busiest = cost.stage_collectives[index]
    stage_roles = roles[index] if roles else ["activation"] * len(busiest)
    share = math.prod(mesh_shape.values()) if profile.shared_host else 1
    if share > 1:
        profile = replace(
            profile,
            link_bytes_per_second=profile.link_bytes_per_second / share,
            network_bytes_per_second=profile.network_bytes_per_second / share,
        )
    across = across or {}
    sends = cost.wire_bytes - sum(c.step_wire_bytes for c in busiest)  # a pipeline's, between its stages
    seconds = sends / (
        profile.network_bytes_per_second if across.get(ax.STAGE, 1) > 1 else profile.link_bytes_per_second
    )
    stage_mesh = {a: n for a, n in mesh_shape.items() if a != ax.STAGE}  # a stage's programs: its own sub-mesh
    return seconds + step_comm(busiest, stage_roles, profile, stage_mesh, across, compute_seconds).exposed_seconds


def across_hosts_of(mesh_shape: dict[str, int], num_devices: int, hosts: int) -> dict[str, int] | None:
    """Each axis's ways across hosts for a candidate on `hosts` hosts of num_devices / hosts
    devices each (jaxcnn.sharding.mesh lays them out); None: it fits inside one host."""
    devices, per_host = math.prod(mesh_shape.values()), num_devices // hosts
    if hosts == 1 or devices <= per_host:
        return None
    if devices % per_host:
        raise UserError(f"{devices} devices do not fill whole hosts of {per_host}")
    return across_hosts(mesh_shape, devices // per_host)


def _pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def candidates_for(num_devices: int, max_stages: int = 0) -> list[tuple[Layout, dict[str, int]]]:
    """Every layout x mesh factorisation worth compiling on `num_devices` (pipelines of up
    to `max_stages` stages: one pipeline unit each at most)."""
    n = num_devices
    found = [(LAYOUTS["single"], {ax.DATA: 1})]  # fewer devices: the same batch on one, and dp on each divisor
    found += [(LAYOUTS["dp"], {ax.DATA: d}) for d, _ in _pairs(n) if 1 < d < n]
    if n == 1:
        return found
    found += [(LAYOUTS["dp"], {ax.DATA: n}), (LAYOUTS["fsdp"], {ax.DATA: n}), (LAYOUTS["tp"], {ax.MODEL: n})]
    for data, model in _pairs(n):
        if data > 1 and model > 1:
            found.append((LAYOUTS["hybrid"], {ax.DATA: data, ax.MODEL: model}))
            found.append((FSDP_TP, {ax.DATA: data, ax.MODEL: model}))
    for data, spatial in _pairs(n):
        if spatial > 1:
            found.append((LAYOUTS["spatial"], {ax.DATA: data, ax.SPATIAL: spatial}))
    for data, stages in _pairs(n):
        if 1 < stages <= max_stages:
            found.append((LAYOUTS["pipeline"], {ax.DATA: data, ax.STAGE: stages}))
    return found


def plan(
    model_config: ModelConfig,
    image_shape: tuple[int, int, int],
    batch_size: int,
    num_devices: int,
    budget_bytes: float,
    profile: HardwareProfile,
    *,
    dtype: str = "float32",
    layouts: list[str] | None = None,
    hosts: int = 1,
    progress=None,
) -> list[Candidate]:
    """All candidates, best first: those that fit by modelled step time, then the rest by memory."""
    compiled = compile_candidates(
        model_config, image_shape, batch_size, num_devices, layouts=layouts, progress=progress
    )
    return rank(price(compiled, profile, num_devices, dtype, hosts), budget_bytes)


def compile_candidates(
    model_config: ModelConfig,
    image_shape: tuple[int, int, int],
    batch_size: int,
    num_devices: int,
    *,
    layouts: list[str] | None = None,
    progress=None,
) -> list[Candidate]:
    """Every layout x mesh for `num_devices`, compiled (not run): memory, FLOPs and
    collectives, which no hardware profile changes; `price` turns them into seconds."""
    out = []
    max_stages = layer_shapes(model_config, image_shape)[-1].unit + 1
    todo = [
        (lay, m, schedule)
        for lay, m in candidates_for(num_devices, max_stages)
        if layouts is None or lay.name in layouts
        for schedule in (PIPELINE_SCHEDULES if lay.stage_axis else (None,))
    ]
    one_chunk = {}  # a pipeline mesh's programs with one chunk a stage: every such schedule runs them
    for i, (layout, mesh_shape, schedule) in enumerate(todo):
        if progress:
            progress(i, len(todo), layout, mesh_shape, schedule)
        key = (layout.name, tuple(mesh_shape.items()))
        if schedule is not None and schedule[1] == 1 and key in one_chunk:
            candidate, program = one_chunk[key]
            if program is None:  # the same sizes refused the same way
                out.append(replace(candidate, schedule=schedule))
                continue
            out.append(measure(Candidate(layout, mesh_shape, schedule=schedule), rescheduled(program, schedule[0])))
            continue
        candidate, program = compile_candidate(model_config, image_shape, batch_size, layout, mesh_shape, schedule)
        if schedule is not None and schedule[1] == 1:
            one_chunk[key] = (candidate, program)
        out.append(candidate)
    total = min((c.compute_flops * c.devices for c in out if c.cost is not None), default=0.0)  # one device's work
    for c in out:
        if c.cost is not None and total:
            c.redundancy = c.compute_flops * c.devices / total
    return out


def compile_candidate(
    model_config: ModelConfig,
    image_shape: tuple[int, int, int],
    batch_size: int,
    layout: Layout,
    mesh_shape: dict,
    schedule: tuple[str, int] | None = None,
):
    """`(candidate, program)`: one layout on one mesh (a pipeline under `schedule`: its
    schedule and virtual stages) compiled for `batch_size` (not run); on a size that does not
    divide, the candidate carries the error and the program is None."""
    candidate = Candidate(layout, mesh_shape, schedule=schedule)
    pipeline = {"pipeline_schedule": schedule[0], "virtual_stages": schedule[1]} if schedule else {}
    try:
        with quiet_fallbacks():
            program = build_program(
                model_config, OptimConfig(), layout, build_mesh(mesh_shape), image_shape, batch_size, 1000,
                with_eval=False, with_init=False, **pipeline,
            )  # fmt: skip
    except UserError as err:
        candidate.error = str(err)
        return candidate, None
    return measure(candidate, program), program


def rescheduled(program, schedule: str):
    """A pipeline `program` with one chunk a stage as `schedule` runs it: the same compiled
    programs in another order, so only what a stage holds in flight and the bubble change."""
    runner = program.pipeline
    stages = len(runner.timeline[0])
    timeline = ticks(stage_orders(schedule, stages, 1, runner.microbatches), stages)
    held = held_in_flight(timeline, [p.x_bytes for p in runner.programs], [p.y_bytes for p in runner.programs])
    anatomy = replace(program.anatomy, stage_held_bytes=held, bubble_fraction=timeline_bubble(timeline))
    return replace(program, anatomy=anatomy)


def measure(candidate: Candidate, program) -> Candidate:
    """`candidate` with what its compiled `program` does: memory, FLOPs, collectives."""
    cost = program_cost(program)
    candidate.cost, candidate.bubble_fraction = cost, program.anatomy.bubble_fraction
    candidate.roles = collective_roles(program)
    candidate.peak_bytes = cost.peak_bytes
    candidate.param_bytes, candidate.optimizer_bytes = cost.param_bytes, cost.optimizer_bytes
    candidate.flops, candidate.model_flops, candidate.wire_bytes = cost.flops, cost.model_flops, cost.wire_bytes
    candidate.num_collectives, candidate.num_kernels = cost.num_collectives, cost.num_kernels
    return candidate


def collective_roles(program) -> list[list[str]]:
    """Per stage, the role of each collective of `program_cost`'s `stage_collectives`."""
    return [
        classify([c for part in stage for c in part_collectives(part)], program.anatomy.placements, program.mesh)
        for stage in program.anatomy.stages
    ]


def price(
    candidates: list[Candidate], profile: HardwareProfile, num_devices: int, dtype: str, hosts: int = 1
) -> list[Candidate]:
    """The candidates with modelled compute and communication seconds on `profile` (copies),
    the `num_devices` spread over `hosts` hosts."""
    priced = []
    for candidate in candidates:
        candidate = replace(candidate)
        if candidate.cost is not None:
            share = candidate.devices if profile.shared_host else 1  # simulated devices share one host's FLOP/s
            stretch = 1 / (1 - candidate.bubble_fraction)  # (M+S-1)/M: a pipeline stage idles in the bubble
            candidate.compute_seconds = (
                candidate.compute_flops / (profile.achieved_flops(dtype) / share)
                + candidate.num_kernels * profile.kernel_seconds
            ) * stretch
            try:
                across = across_hosts_of(candidate.mesh_shape, num_devices, hosts)
            except UserError as err:  # its axes cannot spread evenly over the hosts
                candidate.error = str(err)
                priced.append(candidate)
                continue
            candidate.comm_seconds = comm_seconds(
                candidate.cost, profile, candidate.mesh_shape, across, candidate.compute_seconds, candidate.roles
            )
        priced.append(candidate)
    return priced


def rank(candidates: list[Candidate], budget_bytes: float) -> list[Candidate]:
    ok = [c for c in candidates if c.error is None]
    fits = sorted((c for c in ok if c.peak_bytes <= budget_bytes), key=lambda c: c.step_seconds)
    if fits:  # near-ties go to the simpler layout
        best = fits[0].step_seconds
        tied = sorted(
            (c for c in fits if c.step_seconds <= best * (1 + TIE)),
            key=lambda c: (c.devices, SIMPLICITY.get(c.layout.name, 9), c.schedule or ()),
        )
        fits = tied + [c for c in fits if c not in tied]
    over = sorted((c for c in ok if c.peak_bytes > budget_bytes), key=lambda c: c.peak_bytes)
    return fits + over + [c for c in candidates if c.error is not None]


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


def explain(candidates: list[Candidate], budget_bytes: float, top: int = 3) -> str:
    fits = [c for c in candidates if c.error is None and c.peak_bytes <= budget_bytes]
    lines = []
    if not fits:
        over = [c for c in candidates if c.error is None]
        if not over:
            return "no layout could be compiled: " + "; ".join(f"{c.name} {c.mesh}: {c.error}" for c in candidates)
        c = min(over, key=lambda c: c.peak_bytes)
        return (
            f"no layout fits {_mib(budget_bytes)} per device. The smallest, {c.name} on {c.mesh}, needs "
            f"{_mib(c.peak_bytes)}: {_mib(c.peak_bytes - budget_bytes)} ({c.peak_bytes / budget_bytes:.2f}x) over. "
            "Try more devices, a smaller batch, remat or bf16."
        )
    for i, c in enumerate(fits[:top], 1):
        comm_share = c.comm_seconds / c.step_seconds if c.step_seconds else 0.0
        lines.append(
            f"{i}. {c.name:<8} {c.mesh:<20} step {c.step_seconds * 1e3:8.3f} ms modelled "
            f"(compute {c.compute_seconds * 1e3:.3f} ms, communication {c.comm_seconds * 1e3:.3f} ms = {comm_share:.0%}; "
            f"{c.num_collectives} collectives, {c.num_kernels} kernels; {c.devices} device{'s' * (c.devices > 1)})"
        )
        lines.append(
            f"   fits: {_mib(c.peak_bytes)} of {_mib(budget_bytes)} per device "
            f"(parameters {_mib(c.param_bytes)}, optimizer {_mib(c.optimizer_bytes)})"
        )
    redundant = [c for c in candidates if c.error is None and c.redundant]
    if redundant:
        lines.append(
            "redundant compute (FLOPs per device over their share): "
            + ", ".join(f"{c.name} {c.mesh} {c.redundancy:.1f}x" for c in redundant)
        )
    dropped = [c for c in candidates if c.error is None and c.peak_bytes > budget_bytes]
    if dropped:
        lines.append(
            f"over budget ({len(dropped)}): " + ", ".join(f"{c.name} {c.mesh} {_mib(c.peak_bytes)}" for c in dropped)
        )
    failed = [c for c in candidates if c.error is not None]
    if failed:
        lines.append("not possible: " + "; ".join(f"{c.name} {c.mesh} ({c.error})" for c in failed))
    return "\n".join(lines)
