"""Analytic communication model: the bytes each layout *should* move per training step.

Set beside what XLA compiled (jaxcnn.analysis.hlo) it says whether the compiler did
what theory predicts. Same convention as the inspector: **buffer bytes** per device (the
logical array a collective works on: the reduced array, the gathered whole, the
unscattered input, the sent halo); `wire_bytes` turns a buffer into ring traffic.
Sources: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms" (2009) for the ring
costs; "How to Scale Your Model" (Austin et al., 2025), chs. 3 and 5, for the dp / fsdp /
tp patterns; Megatron-LM (Shoeybi et al., 2019) for column -> row pairs; Dryden et al.,
"Improving strong-scaling of CNN training by exploiting finer-grained parallelism"
(2019) for spatial halos.

With B the global batch, f the bytes of an element, D the data-parallel degree (the mesh
axes `batch` maps to), M the tensor-parallel degree (`conv_out` / `mlp`), S the spatial
degree (`height`), G = D x S the devices holding different data for one parameter:

- gradients: an all-reduce over G of every parameter's bytes *as used for compute*
  (a tp shard is P/M); the FSDP-split ones are reduce-scattered instead, same buffer.
  Plus the loss and accuracy scalars. Under spatial, XLA reduces conv gradients over
  `spatial` and then over `data` (two all-reduces); the dense head, fed the gathered
  activation, only over `data`. A depthwise conv's kernel gradient on split rows is the
  exception: XLA reduces it over data x spatial in one all-reduce (its bias goes the usual
  way; seen on MobileNetV2 and ConvNeXt, XLA:CPU, jax 0.12).
- FSDP: one all-gather of each split parameter per step (gathered once, kept for backward).
- batch norm over P > 1 pieces of the batch (P = D, or D x S where the layer's input is
  split by height and S divides its output height; jaxcnn.models.batch_norm), per layer: forward one all-reduce of the
  pieces' shifted sums (2 x C_local x 4 bytes: float32 statistics, whatever P); backward one
  all-reduce of the sums of dy and dy x x_hat (2 x C_local x 4), which are also scale's
  and bias's gradients -- so those leave the gradients' all-reduce. C_local = C / M when
  split. Per-device statistics: only the running averages' all-reduce forward (2 x C_local
  x 4) and scale's and bias's gradients backward (likewise).
- tensor parallelism, M > 1: every row layer all-reduces its output activation forward
  (B/D x H_out x W_out x C_out x f); every column layer whose input needs a gradient
  all-reduces that gradient backward (B/D x H x W x C_in x f).
- spatial, S > 1 (`spatial_plan`): a k x k conv of stride t on a height-split input needs
  k - t rows of its input from the neighbours, forward and again for the weight gradient
  (B/D x W x C_in x f a row), and ceil((k - t) / t) rows of its output's gradient for the
  input gradient (not for the first conv). A ResNet stem's 3x3 stride-2 max-pool: one row
  forward; backward XLA's select-and-scatter takes 3 rows of its padded operand (width
  W + 2) and one row of the output gradient -- on a spatial degree of 2. On more, XLA
  re-pads the operand with further exchanges (resnet_tiny, 64x64x3, 4-way: measured 1.3x
  the model's permutes), and where the pool's output height stops dividing it re-balances
  rows; neither is modelled. Where a height stops dividing (or before a
  CNN's flatten) the activation is all-gathered, an uneven split padded to equal shards;
  a ResNet's global average pool over split rows all-reduces its partial sums.

A depthwise conv (ConvNeXt's 7x7, MobileNetV2's 3x3) maps each channel to itself: under tp
its channels are split exactly where its input's are (jaxcnn.sharding.axes.GROUP_IN), so it
adds no tp term at all. LayerNorm over channels (ConvNeXt) has no batch statistics: no
batch-norm terms; it sits on the residual stream, whole under tp.

Not modelled (small, stated so the ratios can be read): under tp, a column layer's
batch-norm vectors are gathered from their split channels (8 x C x f per such layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxcnn.analysis.hlo import KINDS, ring_wire_bytes
from jaxcnn.config import ModelConfig
from jaxcnn.models import LayerShape, layer_shapes
from jaxcnn.program import Program
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import ParamPlacement, spatial_split_ok


@dataclass(frozen=True)
class CommTerm:
    kind: str  # a collective kind (jaxcnn.analysis.hlo.KINDS)
    what: str  # which term of the model, for the report
    group_size: int
    buffer_bytes: float

    @property
    def wire_bytes(self) -> float:
        return ring_wire_bytes(self.kind, self.group_size, self.buffer_bytes)


def comm_terms(
    config: ModelConfig,
    image_shape: tuple[int, int, int],
    batch_size: int,
    layout: Layout,
    mesh_shape: dict[str, int],
    placements: list[ParamPlacement],
    compute_bytes: dict[str, int],
    itemsize: int = 4,
) -> list[CommTerm]:
    """The model's terms for one step. `compute_bytes`: parameter path -> bytes per device
    as used for compute (FSDP's split undone); `placements` say which are FSDP-split."""
    d = layout.degree(ax.BATCH, mesh_shape)
    s = layout.degree(ax.HEIGHT, mesh_shape)
    g = d * s
    local_batch = batch_size / d
    fsdp_axes = set(layout.fsdp)

    def fsdp_split(p: ParamPlacement) -> bool:
        return any(e in fsdp_axes or (isinstance(e, tuple) and fsdp_axes & set(e)) for e in p.spec if e)

    params = [p for p in placements if p.path in compute_bytes]
    layers = layer_shapes(config, image_shape)
    split_input, terms = spatial_plan(layers, s, local_batch, itemsize)
    split_of = {path: split for layer, split in zip(layers, split_input, strict=True)
                for path in (layer.path, layer.norm_path, *layer.other_paths) if path}  # fmt: skip

    def reduce_over(what: str, buffer: float, spatially_split: bool) -> None:
        """A sum over every device that saw other data: XLA reduces over the spatial
        axis, then over the data axes -- one all-reduce each (hierarchical)."""
        if spatially_split and s > 1:
            terms.append(CommTerm("all-reduce", f"{what} (over spatial)", s, buffer))
        if d > 1:
            terms.append(CommTerm("all-reduce", f"{what} (over data)", d, buffer))

    def spatially_split(p: ParamPlacement) -> bool:
        return split_of.get(p.path.rsplit("/", 1)[0], False)

    norm_paths = {layer.norm_path for layer in layers if layer.norm_path}

    def reduced_with_gradients(p: ParamPlacement) -> bool:  # batch norm's come with its statistics
        return not fsdp_split(p) and not (config.norm == "batch" and p.path.rsplit("/", 1)[0] in norm_paths)

    depthwise = {layer.path for layer in layers if layer.depthwise}

    def flat(p: ParamPlacement) -> bool:  # a depthwise kernel's gradient on split rows: one all-reduce over G
        layer, leaf = p.path.rsplit("/", 1)
        return s > 1 and spatially_split(p) and layer in depthwise and leaf == "kernel"

    for on_split in (True, False):
        group = [p for p in params if spatially_split(p) == on_split and reduced_with_gradients(p) and not flat(p)]
        if group:
            reduce_over("gradients", sum(compute_bytes[p.path] for p in group), on_split)
    flat_bytes = sum(compute_bytes[p.path] for p in params if flat(p) and reduced_with_gradients(p))
    if flat_bytes and g > 1:
        terms.append(CommTerm("all-reduce", "depthwise conv gradients (over data x spatial at once)", g, flat_bytes))
    if g > 1:
        terms.append(CommTerm("all-reduce", "loss and accuracy", g, 2 * 4))
    fsdp_bytes = sum(compute_bytes[p.path] for p in params if fsdp_split(p))
    if fsdp_bytes and g > 1:
        terms.append(CommTerm("reduce-scatter", "FSDP gradients to their owners", g, fsdp_bytes))
    if fsdp_bytes:
        terms.append(CommTerm("all-gather", "FSDP parameters for compute", g, fsdp_bytes))

    convs = [(layer, split) for layer, split in zip(layers, split_input, strict=True) if layer.kind == "conv"]
    if config.norm == "batch":
        for layer, on_split in convs:
            # the pieces a device holds (partition.image_pieces); where the layer's input is
            # whole along `spatial`, every device has every row piece and gathers over data only
            pieces = d * (s if on_split and layer.out_height % s == 0 else 1)
            if pieces == 1:
                continue
            stats = 2 * layer.features / layout.degree(layer.space_out, mesh_shape) * 4
            if config.norm_statistics == "global":
                terms.append(CommTerm("all-reduce", "batch-norm statistics (shifted sums)", pieces, stats))
                terms.append(CommTerm("all-reduce", "batch-norm gradient sums", pieces, stats))
            else:
                terms.append(CommTerm("all-reduce", "batch-norm running statistics", pieces, stats))
                terms.append(CommTerm("all-reduce", "batch-norm scale and bias gradients", pieces, stats))

    for i, layer in enumerate(layers):
        if layer.depthwise:  # each output channel from its own input channel: split alike, nothing moves
            continue
        tp_out = layout.degree(layer.space_out, mesh_shape)
        tp_in = layout.degree(layer.space_in, mesh_shape)
        if tp_in > 1:  # a row layer: partial sums of its output
            out = local_batch * layer.out_height * layer.out_width * layer.features * itemsize
            terms.append(CommTerm("all-reduce", "tp row-layer outputs", tp_in, out))
        if tp_out > 1 and i > 0:  # a column layer: the gradient of its (whole) input
            grad = local_batch * layer.height * layer.width * layer.in_features * itemsize
            terms.append(CommTerm("all-reduce", "tp column-layer input gradients", tp_out, grad))
    return terms


def spatial_plan(
    layers: list[LayerShape], s: int, local_batch: float, itemsize: int
) -> tuple[list[bool], list[CommTerm]]:
    """Which layers see a height-split input under a spatial degree `s`, and the halo
    exchanges, gathers and reductions that costs (module docstring).

    The model constrains the image and every unit's output (a CNN block, a ResNet stem or
    block) to the layout, which splits a height only while each shard keeps 2 rows
    (partition.spatial_split_ok), checked anew at each boundary; inside a unit the convs
    share its input's split. A unit's output is its last layer's (a ResNet block lists its
    projection last, with the block's output shape)."""
    terms: list[CommTerm] = []
    if s == 1:
        return [False] * len(layers), terms
    split = spatial_split_ok(layers[0].height, s)
    unit_input, split_input = {}, []
    for i, layer in enumerate(layers):
        if layer.kind != "conv":
            split_input.append(False)
            continue
        split_input.append(unit_input.setdefault(layer.unit, split))
        if i + 1 < len(layers) and layers[i + 1].unit == layer.unit:
            continue  # not the unit's last layer
        out_h, out_w = layer.next_size
        divides = spatial_split_ok(out_h, s)
        nxt = layers[i + 1].kind
        still = divides and nxt == "conv"
        if split and not still:
            if nxt == "dense" and divides and layer.pool != 2:  # a ResNet's global average pool
                pooled = local_batch * layer.features * itemsize
                terms.append(CommTerm("all-reduce", "global average pool over split rows", s, pooled))
            else:  # an uneven split is padded to equal shards, then gathered
                rows = -(-out_h // s) * s
                whole = local_batch * rows * out_w * layer.features * itemsize
                terms.append(CommTerm("all-gather", "activation gathered where its height stops splitting", s, whole))
        split = still
    for i, (layer, on_split) in enumerate(zip(layers, split_input, strict=True)):
        if not on_split:
            continue
        if layer.kernel > layer.stride:
            rows = layer.kernel - layer.stride
            row_in = local_batch * layer.width * layer.in_features * itemsize
            row_out = local_batch * layer.out_width * layer.features * itemsize
            terms.append(CommTerm("collective-permute", "halo rows, forward", 2, rows * row_in))
            terms.append(CommTerm("collective-permute", "halo rows, weight gradient", 2, rows * row_in))
            if i > 0:
                grad_rows = -(-rows // layer.stride)
                terms.append(CommTerm("collective-permute", "halo rows, input gradient", 2, grad_rows * row_out))
        if layer.pool == 3:  # the stem's 3x3 stride-2 max-pool, on the conv's split output
            row = local_batch * layer.features * itemsize
            pooled_w = layer.next_size[1]
            terms.append(CommTerm("collective-permute", "pool halo, forward", 2, row * layer.out_width))
            terms.append(CommTerm("collective-permute", "pool halo, backward", 2, 3 * row * (layer.out_width + 2)))
            terms.append(CommTerm("collective-permute", "pool halo, output gradient", 2, row * pooled_w))
    return split_input, terms


def summarise(terms: list[CommTerm]) -> dict[str, float]:
    """{kind: buffer bytes} for every kind, plus 'total' and 'wire'."""
    out = {kind: 0.0 for kind in KINDS}
    for t in terms:
        out[t.kind] += t.buffer_bytes
    out["total"] = sum(t.buffer_bytes for t in terms)
    out["wire"] = sum(t.wire_bytes for t in terms)
    return out


def pipeline_summary(program: Program, config: ModelConfig, image_shape: tuple[int, int, int]) -> dict[str, float]:
    """The pipeline's model, for the stage that bounds the step (jaxcnn.analysis.cost):
    with a data axis of D > 1 each stage all-reduces its parameters' gradient once per
    micro-batch (M per step); every boundary carries each micro-batch's activation forward
    and its gradient back, 2 x M x micro x (the last layer's pooled output) x f / D."""
    groups, m = program.anatomy.layer_groups, program.anatomy.microbatches  # groups: per chunk
    stages = len(program.anatomy.stage_param_bytes)
    data_ways = program.mesh.size // stages
    layers, micro = layer_shapes(config, image_shape), program.batch_size // m
    itemsize = jnp.dtype(config.dtype).itemsize  # activations cross in the compute dtype
    sent = [0] * stages  # stage s sends from each of its chunks but the last
    for c, group in enumerate(groups[:-1]):
        last = [layer for layer in layers if layer.unit == group.stop - 1][-1]
        height, width = last.next_size
        size = height * width * last.features if last.kind == "conv" else last.features
        sent[c % stages] += 2 * m * micro * size * itemsize // data_ways
    grads = [m * b for b in program.anatomy.stage_param_bytes] if data_ways > 1 else [0] * stages
    wire = [ring_wire_bytes("all-reduce", data_ways, g) for g in grads]
    return {"total": max(grads) + max(sent, default=0), "wire": max(wire) + max(sent, default=0)}


def modelled_comm(program: Program, config: ModelConfig, image_shape: tuple[int, int, int]) -> dict[str, float]:
    """The model's bytes for `program`: `summarise(comm_terms(...))`, or the pipeline's."""
    if program.layout.stage_axis:
        return pipeline_summary(program, config, image_shape)
    compute_bytes = {p.path: p.bytes_per_device for p in program.anatomy.compute_placements}
    mesh_shape = dict(program.mesh.shape)
    terms = comm_terms(
        config, image_shape, program.batch_size, program.layout, mesh_shape, program.anatomy.placements, compute_bytes
    )
    return summarise(terms)
