"""The GPipe schedule: the host issues each stage's compiled programs in order.

Stage s's programs run on its own devices (jaxcnn.pipeline.program compiles them);
activations travel to the next stage's devices (`to_stage`: each process moves its own
shards, so stages inside a host and `data` across hosts run on several processes), and
JAX's asynchronous dispatch lets every stage's devices run at once:

    forward:  tick t = 0 .. M+S-2, stage s runs micro-batch t-s   (M+S-1 ticks)
    backward: the same ticks in reverse, each stage recomputing its forward (remat, as
              in the GPipe paper) and adding its gradient to an accumulator
    update:   one optimizer step per stage (Adam is element-wise: the same as one global step)

Each stage idles (S-1)/(M+S-1) of its time: the bubble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding


class StageState(NamedTuple):
    params: nnx.State
    stats: nnx.State  # batch-norm running statistics of this stage's layers
    opt_state: optax.OptState


class PipelineState(NamedTuple):
    step: jax.Array  # on stage 0's devices
    stages: tuple[StageState, ...]
    rng: jax.Array


def bubble_fraction(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def to_stage(x: jax.Array, target: NamedSharding) -> jax.Array:
    """`x`, on one stage's devices, laid out alike on another's (`target`: the same spec on a
    mesh of the same shape). Within one process a `device_put`; across several (JAX moves no
    array between device sets that span processes) each process copies its own shards to the
    devices at the same mesh positions -- its own too (jaxcnn.pipeline.split checks) -- and
    the next stage's global array is assembled from them."""
    if x.is_fully_addressable and target.is_fully_addressable:
        return jax.device_put(x, target)
    position = {device: index for index, device in np.ndenumerate(x.sharding.mesh.devices)}
    moved = {}
    for shard in x.addressable_shards:
        destination = target.mesh.devices[position[shard.device]]
        moved[destination] = jax.device_put(shard.data, destination)
    pieces = [moved[device] for device in target.addressable_devices_indices_map(x.shape)]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


@dataclass
class GPipe:
    """Runs one optimizer step (or an evaluation) through the stages' compiled programs.

    `programs[s]` holds stage s's compiled "init", "update", "eval" and either "forward"
    and "backward" or, on the last stage, "last" (its forward, loss and backward in one),
    plus the shardings its inputs arrive in ("x_sharding", "y_sharding" for the gradient
    sent back, "eval_x_sharding")."""

    programs: list[dict]
    replicated: list[NamedSharding]  # per stage: its devices, every array whole
    microbatches: int
    batch_size: int
    seed: int
    group_images: Any  # compiled: global batch -> [M, micro, ...], each micro-batch split over data
    group_labels: Any
    eval_tail: Any  # compiled: (logits, labels, mask) -> (loss_sum, correct_sum, predictions)
    # One computation at a time -- every program, transfer and eager op finished before the
    # next starts: XLA:CPU's cross-process collectives (gloo) fail with a "collective
    # mismatch" when two programs on different device sets run theirs at once (seen on 2
    # processes x 2 CPU devices); GPUs' (NCCL: a communicator per device set) do not.
    serial: bool = False

    def _run(self, program, *args):
        return self._done(program(*args))

    def _done(self, out):
        if self.serial:
            jax.block_until_ready(out)
        return out

    def __post_init__(self):
        self.stages = len(self.programs)
        self.indices = [  # micro-batch i's index, on stage s's devices (from the host: every process gives it)
            [jax.device_put(np.int32(i), rep) for i in range(self.microbatches)] for rep in self.replicated
        ]

    def init(self) -> PipelineState:
        rep = self.replicated[0]
        rng = jax.device_put(np.asarray(jax.random.key_data(jax.random.key(self.seed + 1))), rep)
        return PipelineState(
            jax.device_put(np.zeros((), np.int32), rep), tuple(p["init"]() for p in self.programs), rng
        )

    def train_step(self, state: PipelineState, images, labels):
        programs, m, n, rep, mbs = self.programs, self.microbatches, self.stages, self.replicated, self.indices
        images, labels = self._run(self.group_images, images), self._run(self.group_labels, labels)
        step_key = self._done(
            jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
        )
        keys = self._done([to_stage(step_key, r) for r in rep])
        stats = [st.stats for st in state.stages]
        inputs = [[None] * m for _ in range(n)]  # what stage s received for micro-batch i
        for t in range(m + n - 1):  # forward ticks
            for s in range(n):
                i = t - s
                if not 0 <= i < m:
                    continue
                x = images if s == 0 else inputs[s][i]
                inputs[s][i] = x
                if s < n - 1:
                    y, stats[s] = self._run(
                        programs[s]["forward"], state.stages[s].params, stats[s], x, mbs[s][i], keys[s]
                    )
                    inputs[s + 1][i] = self._done(to_stage(y, programs[s + 1]["x_sharding"]))
        grads = self._done([jax.tree.map(jnp.zeros_like, st.params) for st in state.stages])
        totals = self._done((jax.device_put(np.float32(0), rep[-1]), jax.device_put(np.int32(0), rep[-1])))
        douts: list[list] = [[None] * m for _ in range(n)]
        for t in range(m + n - 1):  # backward ticks, last stage first
            for s in reversed(range(n)):
                i = m - 1 - (t - (n - 1 - s))
                if not 0 <= i < m:
                    continue
                p = state.stages[s].params
                if s == n - 1:
                    grads[s], dx, stats[s], totals = self._run(
                        programs[s]["last"], p, stats[s], inputs[s][i], labels, mbs[s][i], keys[s], grads[s], totals
                    )
                else:
                    grads[s], dx = self._run(
                        programs[s]["backward"], p, stats[s], inputs[s][i], mbs[s][i], keys[s], douts[s][i], grads[s]
                    )
                if s > 0:
                    douts[s - 1][i] = self._done(to_stage(dx, programs[s - 1]["y_sharding"]))
        new_stages = []
        for s, st in enumerate(state.stages):
            params, opt_state = self._run(programs[s]["update"], st.params, st.opt_state, grads[s])
            new_stages.append(StageState(params, stats[s], opt_state))
        metrics = self._done({"loss": totals[0], "accuracy": totals[1] / self.batch_size})
        return PipelineState(self._done(state.step + 1), tuple(new_stages), state.rng), metrics

    def eval_step(self, state: PipelineState, images, labels, mask):
        x = images
        for s, st in enumerate(state.stages):
            if s > 0:
                x = self._done(to_stage(x, self.programs[s]["eval_x_sharding"]))
            x = self._run(self.programs[s]["eval"], st.params, st.stats, x)
        return self._run(self.eval_tail, x, labels, mask)
