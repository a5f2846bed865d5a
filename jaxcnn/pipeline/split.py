"""Where the pipeline cuts the model: layer groups balanced by FLOPs, the stage modules,
the stages' sub-meshes, and how many micro-batches a step streams through them.

The model is cut between its pipeline units (a CNN's layers; a ResNet's stem, residual
blocks and head, so a block and its shortcut stay together). The split into S groups
balances modelled FLOPs (forward + backward, from the layer shapes), because equal
stage times are what keep the bubble at its formula (jaxcnn.pipeline.schedule); `--stage-split` overrides it.
"""

from __future__ import annotations

import itertools

import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import layer_shapes
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import constrain


def unit_costs(config: ModelConfig, image_shape) -> list[float]:
    """Forward FLOPs per image of each pipeline unit (a CNN layer; a ResNet's stem, residual
    block or head): x3 for forward + backward is the same for every unit."""
    layers = layer_shapes(config, image_shape)
    costs = [0.0] * (layers[-1].unit + 1)
    for layer in layers:
        costs[layer.unit] += layer.flops
    return costs


def balance(costs: list[float], stages: int) -> tuple[int, ...]:
    """Split points (first layer of stages 1..S-1) minimising the most expensive stage:
    the classic linear-partition dynamic programme, exact for these few layers."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = {(0, 0): (0.0, ())}
    for s in range(1, stages + 1):
        for end in range(s, n - (stages - s) + 1):
            options = []
            for start in range(s - 1, end):
                if (s - 1, start) in best:
                    worst, cuts = best[(s - 1, start)]
                    options.append((max(worst, prefix[end] - prefix[start]), (*cuts, start)))
            best[(s, end)] = min(options)
    return best[(stages, n)][1][1:]


def stage_groups(
    config: ModelConfig, image_shape, stages: int, split: tuple[int, ...] | None, virtual: int = 1
) -> list[range]:
    """The model's units cut into stages x virtual chunks (chunk c runs on stage c mod S)."""
    costs = unit_costs(config, image_shape)
    units, chunks = len(costs), stages * virtual
    if chunks > units:
        what = f"{stages} stages" if virtual == 1 else f"{stages} stages x {virtual} virtual stages = {chunks} chunks"
        if virtual == 1:
            fewer = f"--mesh stage={units} or fewer"
        elif units // stages > 1:
            fewer = f"--virtual-stages {units // stages} or fewer"
        else:
            fewer = f"--mesh stage={units // virtual} or fewer, or --virtual-stages 1"
        raise UserError(
            f"a pipeline of {what} needs at least {chunks} layers, but {config.name} has {units} "
            f"(a ResNet's stem, each residual block and its head count one each); use {fewer}"
        )
    if split is None:
        split = balance(costs, chunks)
    elif len(split) != chunks - 1 or list(split) != sorted(set(split)) or not all(0 < c < units for c in split):
        raise UserError(
            f"--stage-split {','.join(map(str, split))} must give {chunks - 1} increasing layer indices "
            f"between 1 and {units - 1} (the first layer -- for a ResNet the first block -- of each later chunk)"
        )
    edges = (0, *split, units)
    return [range(a, b) for a, b in itertools.pairwise(edges)]


# Batch-norm statistics come from one micro-batch: below ~16 images they get noisy enough
# to cost accuracy (seen here: M=8 micro-batches of 8 -> 98.1% test accuracy, M=4 of 16 -> 98.6%).
MIN_MICROBATCH = 16


def default_microbatches(batch_size: int, stages: int) -> int:
    """2 x stages (bubble (S-1)/(3S-1) < 1/3), fewer while micro-batches would be under
    `MIN_MICROBATCH` images, always a divisor of the batch."""
    for m in range(2 * stages, 0, -1):
        if batch_size % m == 0 and (batch_size // m >= MIN_MICROBATCH or m == 1):
            return m
    return 1


class Stage(nnx.Module):
    """Pipeline units `group` of the model (sharing its submodules, so its initial values)."""

    def __init__(self, model, group: range):
        units = model.pipeline_units()
        self.units = nnx.List([units[i] for i in group])

    def __call__(self, x, *, train: bool, rngs: nnx.Rngs | None = None):
        x = constrain(x, ax.IMAGE_BHWC if x.ndim == 4 else ax.FEATURES_BF)
        for unit in self.units:
            x = unit(x, train, rngs)
        return x


def sub_meshes(mesh: Mesh, stage_axis: str) -> list[Mesh]:
    """Stage s's devices as a mesh of the remaining axes (data)."""
    names = list(mesh.axis_names)
    order = [names.index(stage_axis)] + [i for i, n in enumerate(names) if n != stage_axis]
    grid = np.transpose(mesh.devices, order)
    rest = tuple(n for n in names if n != stage_axis)
    sizes = [mesh.shape[n] for n in rest]
    if not rest:  # stage only: each stage is one device, a data axis of 1
        rest, sizes = (ax.DATA,), [1]
    auto = (AxisType.Auto,) * len(rest)
    return [Mesh(np.asarray(grid[s], dtype=object).reshape(sizes), rest, axis_types=auto) for s in range(grid.shape[0])]


def check_stages_within_processes(meshes: list[Mesh], mesh: Mesh, stage_axis: str) -> None:
    """Refuse a pipeline whose stage boundary would cross processes: consecutive stages hand
    activations over device by device (jaxcnn.pipeline.schedule.to_stage), each process its
    own shards, so the devices at one position of every stage's mesh must be one process's."""
    for s in range(len(meshes) - 1):
        here, there = meshes[s].devices.flat, meshes[s + 1].devices.flat
        crossing = next(((a, b) for a, b in zip(here, there, strict=True) if a.process_index != b.process_index), None)
        if crossing is None:
            continue
        hosts = len({d.process_index for d in mesh.devices.flat})
        per_host = mesh.size // hosts
        stages = mesh.shape[stage_axis]
        fits = f"--mesh data={mesh.size // stages},{stage_axis}={stages}" if stages <= per_host else None
        how = (
            f"keep each stage boundary inside a process: e.g. {fits}, the hosts across data (no --dcn-mesh on {stage_axis})"
            if fits
            else f"use at most {per_host} stages, the devices of one process, e.g. --mesh data={hosts},{stage_axis}={per_host}"
        )
        raise UserError(
            f"--layout pipeline: stages {s} and {s + 1} would hand activations from process {crossing[0].process_index} "
            f"to process {crossing[1].process_index} ({crossing[0]} -> {crossing[1]}), which is not supported; {how}"
        )
