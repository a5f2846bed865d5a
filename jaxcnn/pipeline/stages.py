"""The pipeline's chunks before anything compiles: where the model is cut and the stages'
devices (`PipelineCut`), each chunk's state placed on its stage (`PlacedChunks`), and the
computations each chunk's programs run (`ChunkFunctions`: forward, backward, the last
chunk's loss, the update). jaxcnn.pipeline.program lowers and compiles them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.config import ModelConfig
from jaxcnn.models import build_model, cross_entropy, resolve_kernels, unit_pixels
from jaxcnn.optim import apply_optimizer, make_optimizer, optimizer_shardings
from jaxcnn.pipeline.schedule import Action, StageState, stage_orders, ticks
from jaxcnn.pipeline.split import Stage, check_stages_within_processes, stage_groups, sub_meshes
from jaxcnn.pipeline.state import StateForms
from jaxcnn.program import ProgramSpec
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import DP
from jaxcnn.sharding.partition import (
    ParamPlacement,
    activation_layout,
    bytes_per_device,
    data_sharding,
    place_variables,
)


@dataclass(frozen=True)
class PipelineCut:
    """Where the model is cut (S x V chunks, chunk c on stage c mod S), each chunk's
    devices, the schedule's ticks, and what crosses between chunks."""

    spec: ProgramSpec
    model_config: ModelConfig  # the kernels resolved for the platform
    platform: str
    groups: list[range]  # per chunk: its layers
    num_stages: int
    chunks: int
    microbatches: int
    meshes: list[Mesh]  # chunk c's devices (a `data` sub-mesh)
    timeline: list[list[Action | None]]
    data_ways: int  # devices in a stage
    act_dtype: Any  # activations cross stages in the compute dtype (bfloat16 halves the bytes sent)
    pixels: Any  # stage 0's input dtype; uint8 is scaled in its programs (unit_pixels)
    txs: list  # per chunk, the optimizer (--freeze / --backbone-lr read the chunk's paths as the model's)

    @property
    def micro(self) -> int:
        return self.spec.batch_size // self.microbatches

    def on(self, sub: Mesh, shape: tuple) -> NamedSharding:
        """An activation of `shape` on a stage's devices, its batch split over `data`."""
        logical = ax.IMAGE_BHWC if len(shape) == 4 else ax.FEATURES_BF
        return data_sharding(logical[: len(shape)], DP, sub)

    def stage_module(self, c: int) -> Stage:
        return Stage(build_model(self.model_config, self.spec.image_shape, self.spec.seed), self.groups[c])

    def init_chunk(self, c: int) -> StageState:
        _, params, stats = nnx.split(self.stage_module(c), nnx.Param, ...)
        return StageState(params, stats, self.txs[c].init(params))


def cut_model(
    spec: ProgramSpec, microbatches: int, stage_split: tuple[int, ...] | None, schedule: str, virtual_stages: int
) -> PipelineCut:
    """Cut the model into chunks (`stage_split` None: balanced by FLOPs) and lay them on the
    stage axis's sub-meshes."""
    layout, mesh = spec.layout, spec.mesh
    platform = mesh.devices.flat[0].platform
    model_config = resolve_kernels(spec.model_config, platform)
    num_stages = mesh.shape[layout.stage_axis]
    chunks = num_stages * virtual_stages
    groups = stage_groups(model_config, spec.image_shape, num_stages, stage_split, virtual_stages)
    meshes = [sub_meshes(mesh, layout.stage_axis)[c % num_stages] for c in range(chunks)]
    check_stages_within_processes(meshes, mesh, layout.stage_axis)
    return PipelineCut(
        spec, model_config, platform, groups, num_stages, chunks, microbatches, meshes,
        timeline=ticks(stage_orders(schedule, num_stages, virtual_stages, microbatches), chunks),
        data_ways=math.prod(meshes[0].shape.values()), act_dtype=jnp.dtype(model_config.dtype),
        pixels=jnp.dtype(spec.image_dtype), txs=chunk_optimizers(spec, model_config, groups),
    )  # fmt: skip


def chunk_optimizers(spec: ProgramSpec, model_config: ModelConfig, groups: list[range]) -> list:
    """Each chunk's optimizer: one for all, unless --freeze or --backbone-lr must tell the
    model's parts apart by the chunks' own paths."""
    optim = spec.optim_config
    if not optim.freeze and optim.backbone_lr is None:
        return [make_optimizer(optim, spec.total_steps)] * len(groups)
    forms = StateForms.of(model_config, spec.image_shape, groups)
    return [
        make_optimizer(optim, spec.total_steps, model_config, {_key(k): _key(v) for k, v in to_model.items()})
        for to_model in forms.to_model
    ]


def _key(path: tuple) -> str:
    return "/".join(map(str, path))


@dataclass(frozen=True)
class PlacedChunks:
    """Each chunk's state, abstract, and its shardings on its stage; what a device holds."""

    abstract: list[StageState]
    shardings: list[StageState]
    graphdefs: list
    placements: list[ParamPlacement]  # every chunk's parameters and statistics, "stage{c}/..." paths
    param_bytes: list[int]  # per chunk, a device's
    opt_bytes: list[int]
    act_shapes: list[jax.ShapeDtypeStruct]  # per chunk: its output for one micro-batch
    act_bytes: list[int]  # those outputs' bytes, whole


def place_chunks(cut: PipelineCut) -> PlacedChunks:
    """Each chunk's parameters, statistics and optimizer state placed dp on its stage, and
    the activations between chunks (each chunk traced on one micro-batch)."""
    abstract, shardings, graphdefs, placements, param_bytes, opt_bytes = [], [], [], [], [], []
    for c, sub in enumerate(cut.meshes):
        state = jax.eval_shape(lambda c=c: cut.init_chunk(c))
        graphdefs.append(nnx.graphdef(nnx.eval_shape(lambda c=c: cut.stage_module(c))))
        p_sh, rows = place_variables(state.params, DP, sub)
        st_sh, st_rows = place_variables(state.stats, DP, sub)
        o_sh = optimizer_shardings(cut.txs[c], state.opt_state, p_sh, sub)
        shardings.append(StageState(p_sh, st_sh, o_sh))
        placements += [
            ParamPlacement(f"stage{c}/{r.path}", r.logical, r.shape, r.dtype, r.spec, r.bytes_per_device, r.notes)
            for r in rows + st_rows
        ]
        param_bytes.append(sum(r.bytes_per_device for r in rows + st_rows))
        opt_bytes.append(bytes_per_device(with_shardings(state.opt_state, o_sh)))
        abstract.append(state)
    shape = jax.ShapeDtypeStruct((cut.micro, *cut.spec.image_shape), jnp.float32)
    act_shapes, act_bytes = [], []
    for c in range(cut.chunks):
        gd = graphdefs[c]
        shape = jax.eval_shape(
            lambda p, st, x, gd=gd: nnx.merge(gd, p, st)(x, train=False), abstract[c].params, abstract[c].stats, shape
        )
        act_shapes.append(shape)
        act_bytes.append(math.prod(shape.shape) * cut.act_dtype.itemsize)
    return PlacedChunks(abstract, shardings, graphdefs, placements, param_bytes, opt_bytes, act_shapes, act_bytes)


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of an abstract tree, carrying their shardings."""
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)


class ChunkFunctions:
    """What each chunk's programs compute, on one micro-batch `mb` of the step (dropout keys
    fold_in(step key, mb)). The global batch arrives split over `data` in contiguous rows,
    so micro-batch i would sit on one device; once per step it is regrouped as [M, micro,
    ...] with each micro-batch split over `data` (one all-to-all), so that chunk 0 takes
    micro-batch i locally."""

    def __init__(self, cut: PipelineCut, placed: PlacedChunks):
        self.cut, self.placed = cut, placed
        self.last_chunk = cut.chunks - 1

    def apply(self, c, params, stats, x, train, key):
        model = nnx.merge(self.placed.graphdefs[c], params, stats, copy=True)
        x = unit_pixels(x) if c == 0 else x
        with activation_layout(DP, self.cut.meshes[c]):
            y = model(x, train=train, rngs=nnx.Rngs(dropout=key) if train else None)
        return y.astype(self.cut.act_dtype), nnx.state(model, nnx.Not(nnx.Param))

    @staticmethod
    def micro_input(c, x, mb):
        """Chunk 0 receives the grouped global batch and takes micro-batch `mb` itself."""
        return jax.lax.dynamic_index_in_dim(x, mb, keepdims=False) if c == 0 else x

    def forward(self, c, params, stats, x, mb, key):
        return self.apply(c, params, stats, self.micro_input(c, x, mb), True, jax.random.fold_in(key, mb))

    def backward(self, c, params, stats, x, mb, key, dy, acc):
        xin = self.micro_input(c, x, mb)

        def f(p, xi):
            return self.apply(c, p, stats, xi, True, jax.random.fold_in(key, mb))[0]

        if c == 0:  # no gradient for the images
            _, vjp = jax.vjp(lambda p: f(p, xin), params)
            (dp,) = vjp(dy)
            return jax.tree.map(jnp.add, acc, dp), None
        _, vjp = jax.vjp(f, params, xin)
        dp, dx = vjp(dy)
        return jax.tree.map(jnp.add, acc, dp), dx

    def last_backward(self, params, stats, x, labels, mb, key, acc, totals):
        """The last chunk: forward, loss and backward in one; the step's loss and correct totals."""
        c, m = self.last_chunk, self.cut.microbatches
        xin, y = self.micro_input(c, x, mb), jax.lax.dynamic_index_in_dim(labels, mb, keepdims=False)

        def loss_fn(p, xi):
            logits, new_stats = self.apply(c, p, stats, xi, True, jax.random.fold_in(key, mb))
            return cross_entropy(logits, y).mean() / m, (logits, new_stats)

        wrt = (0, 1) if c > 0 else (0,)  # a single stage's input is the images: no gradient for them
        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, argnums=wrt, has_aux=True)(params, xin)
        correct = jnp.sum(jnp.argmax(logits, -1) == y)
        dp, dx = grads if c > 0 else (grads[0], None)
        totals = (totals[0] + loss, totals[1] + correct)
        return jax.tree.map(jnp.add, acc, dp), (dx if c > 0 else None), new_stats, totals

    def update(self, c, params, opt_state, grads):
        return apply_optimizer(self.cut.txs[c], grads, opt_state, params)

    def update_last(self, params, opt_state, grads, totals):
        params, opt_state = apply_optimizer(self.cut.txs[self.last_chunk], grads, opt_state, params)
        return params, opt_state, {"loss": totals[0], "accuracy": totals[1] / self.cut.spec.batch_size}

    def zeros(self, c):
        """The gradient accumulator (on the last chunk with the loss and correct totals)."""
        acc = jax.tree.map(jnp.zeros_like, self.placed.abstract[c].params)
        if c == self.last_chunk:
            return acc, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        return acc

    @staticmethod
    def step_key(rng, step):
        """This step's dropout key (every layout's: fold_in(rng, step)) and the next step."""
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), step)), step + 1

    @staticmethod
    def eval_loss(logits, labels, mask):
        predictions = jnp.argmax(logits, -1)
        return jnp.sum(cross_entropy(logits, labels) * mask), jnp.sum((predictions == labels) * mask), predictions


def replicated(cut: PipelineCut) -> list[NamedSharding]:
    """Per chunk: its stage's devices, every array whole."""
    return [NamedSharding(sub, P()) for sub in cut.meshes]
