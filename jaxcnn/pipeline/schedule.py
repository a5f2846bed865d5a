"""The pipeline's schedules: the order in which the host issues each stage's compiled programs.

The model is cut into C = S x V chunks (S stages, V virtual stages a stage: chunk c runs on
stage c mod S's devices, so a stage holds V non-neighbouring chunks when V > 1). Each
schedule is a list of actions per stage -- F(c, i), chunk c's forward of micro-batch i, and
B(c, i), its backward (recomputing the forward: remat, as in the GPipe paper; the last
chunk's F and B are one program, its loss between them):

    gpipe: every forward, then every backward (V > 1: looped, chunk by chunk)
    1f1b:  stage s runs S-s-1 warm-up forwards, then one forward and one backward in turn,
           then drains (Narayanan et al. 2021, PipeDream-Flush; Megatron's default); each
           micro-batch's input and output gradient are released after its backward, so a
           stage holds at most S micro-batches in flight, whatever M is
    V > 1 with 1f1b: Megatron's interleaved 1F1B (micro-batches in groups of S, chunk by chunk)

The lists are merged into one issue order in lockstep ticks (each stage issues its next
action once what it needs was issued in an earlier tick); JAX's asynchronous dispatch then
runs every stage's devices at once, each in that order. The ticks are the schedule's
timeline, the bubble read from it: (S-1)/(V*M+S-1) of each stage's time idle when forward
and backward take alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxcnn.sharding.placement import put_whole


class StageState(NamedTuple):
    params: nnx.State
    stats: nnx.State  # batch-norm running statistics of this chunk's layers
    opt_state: optax.OptState


class PipelineState(NamedTuple):
    step: jax.Array  # on stage 0's devices
    stages: tuple[StageState, ...]  # one per chunk
    rng: jax.Array


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    return (stages - 1) / (virtual * microbatches + stages - 1)


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward
    chunk: int
    microbatch: int


def stage_orders(schedule: str, stages: int, virtual: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions in the order it runs them. (The last chunk's F(c, i) stands for
    the first half of its one program, which runs at its B(c, i).)"""
    return [_stage_order(schedule, g, stages, virtual, microbatches) for g in range(stages)]


def _stage_order(schedule: str, g: int, stages: int, virtual: int, m: int) -> list[Action]:
    if schedule == "gpipe":  # looped over the stage's chunks when V > 1 (breadth first)
        chunks = [v * stages + g for v in range(virtual)]
        return [Action("F", c, i) for c in chunks for i in range(m)] + [
            Action("B", c, i) for c in reversed(chunks) for i in range(m)
        ]
    # 1F1B: the k-th forward and k-th backward of this stage. Interleaved (Megatron): micro-batches
    # in groups of S, each group through the stage's chunks in turn (backwards: the last chunk first).
    total = m * virtual

    def chunk(k: int, backward: bool) -> int:
        v = (k // stages) % virtual
        return (virtual - 1 - v if backward else v) * stages + g

    def micro(k: int) -> int:
        return (k // (stages * virtual)) * stages + k % stages

    warm = min((stages - g - 1) * (2 if virtual > 1 else 1) + (virtual - 1) * stages, total)
    forwards = [Action("F", chunk(k, False), micro(k)) for k in range(total)]
    backwards = [Action("B", chunk(k, True), micro(k)) for k in range(total)]
    order = forwards[:warm]
    for k in range(total - warm):
        order += [forwards[warm + k], backwards[k]]
    return order + backwards[total - warm :]


def ticks(orders: list[list[Action]], chunks: int) -> list[list[Action | None]]:
    """The stages' orders merged into lockstep ticks: tick t holds each stage's action (or
    None: idle), issued once what it needs came from actions of earlier ticks."""
    last, done, position, out = chunks - 1, set(), [0] * len(orders), []

    def ready(a: Action) -> bool:
        if a.kind == "F":
            return a.chunk == 0 or ("F", a.chunk - 1, a.microbatch) in done
        after = a.chunk == last or ("B", a.chunk + 1, a.microbatch) in done
        return after and ("F", a.chunk, a.microbatch) in done

    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        tick = []
        for g, order in enumerate(orders):
            a = order[position[g]] if position[g] < len(order) else None
            tick.append(a if a is not None and ready(a) else None)
        if not any(tick):
            raise RuntimeError(f"the pipeline schedule deadlocks at tick {len(out)}")
        for g, a in enumerate(tick):
            if a is not None:
                position[g] += 1
                done.add(tuple(a))
        out.append(tick)
    return out


def timeline_bubble(timeline: list[list[Action | None]]) -> float:
    """The stages' idle share of the timeline (a forward and a backward a tick each)."""
    busy = sum(a is not None for tick in timeline for a in tick)
    return 1 - busy / (len(timeline) * len(timeline[0]))


def held_in_flight(timeline: list[list[Action | None]], x_bytes: list[int], y_bytes: list[int]) -> list[int]:
    """Per stage, the most bytes of micro-batch inputs (`x_bytes[c]`, from the previous
    chunk's forward to chunk c's backward) and output gradients (`y_bytes[c]`, from the next
    chunk's backward to chunk c's) a device holds at once, were the timeline run tick by
    tick: what the planner prices before anything runs (ScheduleRunner measures it as it runs)."""
    stages, last = len(timeline[0]), len(x_bytes) - 1
    held, peak = [0] * stages, [0] * stages
    for tick in timeline:
        for a in (a for a in tick if a is not None):
            c = a.chunk
            if a.kind == "F" and c < last:
                held[(c + 1) % stages] += x_bytes[c + 1]
            elif a.kind == "B":
                held[c % stages] -= x_bytes[c] + (y_bytes[c] if c < last else 0)
                if c > 0:
                    held[(c - 1) % stages] += y_bytes[c - 1]
            peak = [max(p, h) for p, h in zip(peak, held, strict=True)]
    return peak


def to_stage(x: jax.Array, target: NamedSharding) -> jax.Array:
    """`x`, on one stage's devices, laid out alike on another's (`target`: the same spec on a
    mesh of the same shape). Within one process a `device_put`; across several (JAX moves no
    array between device sets that span processes) each process copies its own shards to the
    devices at the same mesh positions -- its own too (jaxcnn.pipeline.split checks) -- and
    the next stage's global array is assembled from them."""
    # (a copy even where `target` is where `x` already is: each chunk's arrays are donated
    # to its own update, so two chunks of one stage must not share a buffer)
    if x.is_fully_addressable and target.is_fully_addressable:
        return jax.device_put(x, target, may_alias=False)
    position = {device: index for index, device in np.ndenumerate(x.sharding.mesh.devices)}
    moved = {}
    for shard in x.addressable_shards:
        destination = target.mesh.devices[position[shard.device]]
        moved[destination] = jax.device_put(shard.data, destination, may_alias=False)
    pieces = [moved[device] for device in target.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


@dataclass
class ChunkPrograms:
    """Chunk c's compiled programs, and how its activations arrive (jaxcnn.pipeline.program
    builds them). By name too (`programs["forward"]`), for tables of programs."""

    init: Any  # () -> its StageState
    zeros: Any  # () -> its gradient accumulator (on the last chunk with the loss totals)
    update: Any  # (params, opt_state, grads[, totals]) -> new ones (on the last chunk also the step's metrics)
    x_sharding: NamedSharding  # its input's (for chunk 0: the grouped images)
    y_sharding: NamedSharding  # its output's, as the gradient sent back arrives
    x_bytes: int  # a device's bytes of one micro-batch's input (0 for chunk 0: the batch is there)
    y_bytes: int  # of one micro-batch's output gradient
    forward: Any = None  # every chunk but the last
    backward: Any = None
    last: Any = None  # the last chunk: its forward, loss and backward in one
    step_key: Any = None  # chunk 0: (rng, step) -> (this step's key data, step + 1)
    eval: Any = None  # with evaluation
    eval_x_sharding: NamedSharding | None = None

    def __getitem__(self, name: str):
        return getattr(self, name)


@dataclass
class ScheduleRunner:
    """Runs one optimizer step (or an evaluation) through the chunks' compiled programs in
    the schedule's order (`timeline`, from `ticks`).

    `programs[c]`: chunk c's compiled programs (`ChunkPrograms`)."""

    programs: list[ChunkPrograms]
    replicated: list[NamedSharding]  # per chunk: its stage's devices, every array whole
    microbatches: int
    seed: int
    group_images: Any  # compiled: global batch -> [M, micro, ...], each micro-batch split over data
    group_labels: Any
    eval_tail: Any  # compiled: (logits, labels, mask) -> (loss_sum, correct_sum, predictions)
    timeline: list[list[Action | None]]
    # One computation at a time -- every program and transfer finished before the next
    # starts (several CPU processes: jaxcnn.pipeline.program sets it, a caution beside
    # put_whole, which removed the cause of the gloo mismatches seen there)
    serial: bool = False
    # per stage: the most bytes of micro-batch inputs and output gradients a device held at
    # once in the last step (what the schedule keeps in flight, beside the programs' own)
    peak_held_bytes: list[int] = field(default_factory=list)

    def _run(self, program, *args):
        return self._done(program(*args))

    def _done(self, out):
        if self.serial:
            jax.block_until_ready(out)
        return out

    def __post_init__(self):
        self.chunks, self.stages = len(self.programs), len(self.timeline[0])
        self.order = [a for tick in self.timeline for a in tick if a is not None]
        self.indices = [  # micro-batch i's index, on chunk c's devices (from the host: every process gives it)
            [put_whole(np.int32(i), rep) for i in range(self.microbatches)] for rep in self.replicated
        ]

    def init(self) -> PipelineState:
        rep = self.replicated[0]
        rng = put_whole(jax.random.key_data(jax.random.key(self.seed + 1)), rep)
        return PipelineState(put_whole(np.zeros((), np.int32), rep), tuple(p.init() for p in self.programs), rng)

    def train_step(self, state: PipelineState, images, labels):
        programs, mbs, n, last = self.programs, self.indices, self.stages, self.chunks - 1
        images, labels = self._run(self.group_images, images), self._run(self.group_labels, labels)
        step_key, step = self._run(programs[0].step_key, state.rng, state.step)
        on_stage = [step_key] + [self._done(to_stage(step_key, self.replicated[g])) for g in range(1, n)]
        keys = [on_stage[c % n] for c in range(self.chunks)]
        stats = [st.stats for st in state.stages]
        params = [st.params for st in state.stages]
        grads = [self._run(p.zeros) for p in programs]
        grads[last], totals = grads[last]
        inputs = [{} for _ in range(self.chunks)]  # chunk c's input of micro-batch i, kept for its backward
        douts = [{} for _ in range(self.chunks)]  # the gradient chunk c's output of micro-batch i received
        held, peak = [0] * n, [0] * n

        def hold(c, amount):
            held[c % n] += amount
            peak[c % n] = max(peak[c % n], held[c % n])

        for a in self.order:
            c, i = a.chunk, a.microbatch
            if a.kind == "F":
                if c == last:  # its forward runs inside its backward program
                    continue
                x = images if c == 0 else inputs[c][i]
                y, stats[c] = self._run(programs[c].forward, params[c], stats[c], x, mbs[c][i], keys[c])
                inputs[c + 1][i] = self._done(to_stage(y, programs[c + 1].x_sharding))
                hold(c + 1, programs[c + 1].x_bytes)
                continue
            x = images if c == 0 else inputs[c].pop(i)
            if c == last:
                grads[c], dx, stats[c], totals = self._run(
                    programs[c].last, params[c], stats[c], x, labels, mbs[c][i], keys[c], grads[c], totals
                )
            else:
                grads[c], dx = self._run(
                    programs[c].backward, params[c], stats[c], x, mbs[c][i], keys[c], douts[c].pop(i), grads[c]
                )
                hold(c, -programs[c].y_bytes)
            if c > 0:
                hold(c, -programs[c].x_bytes)
                douts[c - 1][i] = self._done(to_stage(dx, programs[c - 1].y_sharding))
                hold(c - 1, programs[c - 1].y_bytes)
        self.peak_held_bytes = peak
        new_stages, metrics = [], None
        for c, st in enumerate(state.stages):
            if c == last:
                new_params, opt_state, metrics = self._run(
                    programs[c].update, st.params, st.opt_state, grads[c], totals
                )
            else:
                new_params, opt_state = self._run(programs[c].update, st.params, st.opt_state, grads[c])
            new_stages.append(StageState(new_params, stats[c], opt_state))
        return PipelineState(step, tuple(new_stages), state.rng), metrics

    def eval_step(self, state: PipelineState, images, labels, mask):
        x = images
        for c, st in enumerate(state.stages):
            if c > 0:
                x = self._done(to_stage(x, self.programs[c].eval_x_sharding))
            x = self._run(self.programs[c].eval, st.params, st.stats, x)
        return self._run(self.eval_tail, x, labels, mask)
