"""A training step's FLOPs per device from the layer shapes: the work the model asks for,
set beside XLA's `cost_analysis` of the compiled step (jaxcnn.analysis.cost).

Why a second count: XLA:CPU has no grouped kernel for a depthwise convolution's kernel
gradient (a `batch_group_count` convolution). It runs it as the full C -> C convolution
and keeps the diagonal, and its cost analysis counts what it runs: C x the true FLOPs
(656 MFLOP against 10 for a 7x7 depthwise conv on 8 x 16 x 16 x 64). So XLA's figure
overstates ConvNeXt's and MobileNetV2's compute many times, and by more where a device
holds more channels (dp's whole depthwise convs against tp's split ones). The count here
is what the planner ranks by and what `compare` and `scale` print beside XLA's.

Per layer and image: forward `LayerShape.flops` (a multiply-add 2 FLOPs; a depthwise
conv k x k x C x H_out x W_out x 2), backward twice that (the input's gradient and the
kernel's). Not counted: norms, activations, pooling, the optimizer update (a few percent
of a CNN's step), remat's recomputed forward, spatial's halo rows. The work divides as
the layout divides the layer: the batch over the data axes, the rows over `spatial` where
the layer's input is height-split (jaxcnn.analysis.comm_model.spatial_plan), the channels
over `model` where either of the layer's channel spaces is split. A layer the layout
keeps whole is computed whole on each of those devices -- tp's replicated layers,
spatial's gathered ones: the redundant compute the planner names. A pipeline's figure is
its busiest stage's layers.
"""

from __future__ import annotations

from jaxcnn.analysis.comm_model import spatial_plan
from jaxcnn.config import ModelConfig
from jaxcnn.models import LayerShape, layer_shapes
from jaxcnn.program import Program
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout

BACKWARD = 2  # the backward pass: the input's gradient and the kernel's, each the forward's FLOPs


def train_flops(layer: LayerShape) -> float:
    """Forward and backward FLOPs per image of one layer."""
    return (1 + BACKWARD) * layer.flops


def unit_flops(
    config: ModelConfig, image_shape: tuple[int, int, int], batch_size: int, layout: Layout, mesh_shape: dict[str, int]
) -> dict[int, float]:
    """Per pipeline unit (jaxcnn.models.LayerShape.unit), the training FLOPs per device of
    one step of `batch_size` images (module docstring)."""
    layers = layer_shapes(config, image_shape)
    compute = layout.compute_layout()  # FSDP gathers its parameters: it splits no layer's work
    data = compute.degree(ax.BATCH, mesh_shape)
    rows = compute.degree(ax.HEIGHT, mesh_shape)
    rows_split, _ = spatial_plan(layers, rows, batch_size / data, 4)
    per_unit: dict[int, float] = {}
    for layer, on_split_rows in zip(layers, rows_split, strict=True):
        channels = max(compute.degree(layer.space_in, mesh_shape), compute.degree(layer.space_out, mesh_shape))
        ways = data * (rows if on_split_rows else 1) * channels
        per_unit[layer.unit] = per_unit.get(layer.unit, 0.0) + train_flops(layer) * batch_size / ways
    return per_unit


def program_model_flops(program: Program) -> float | None:
    """The model's training FLOPs per device per optimizer step of `program` -- a
    pipeline's busiest stage -- or None for a custom model (no layer shapes)."""
    spec = program.spec
    if not isinstance(spec.model_config, ModelConfig):
        return None
    per_unit = unit_flops(spec.model_config, spec.image_shape, spec.batch_size, spec.layout, dict(spec.mesh.shape))
    groups = program.anatomy.layer_groups
    if not groups:
        return sum(per_unit.values())
    stages = len(program.anatomy.stages)
    per_stage = [0.0] * stages
    for chunk, units in enumerate(groups):  # chunk c runs on stage c mod S
        per_stage[chunk % stages] += sum(per_unit.get(u, 0.0) for u in units)
    return max(per_stage)
