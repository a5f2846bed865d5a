"""ConvNeXt and MobileNetV2 under every layout: per-step losses equal one device's (SGD,
rtol 1e-5) at realistic-ish widths on an odd image (48x13: widths 13 -> 6 -> 3), the
collectives each layout compiles to equal the communication model's -- a depthwise conv
moves nothing under tp -- and the pipeline cuts them into stages.

Widths: ConvNeXt 32 and 64 channels (MLP 128 and 256) with stochastic depth on, so the
seeded per-example drops must agree across layouts too; MobileNetV2 at width multiplier 2
(64 -> 32 -> 48 channels, depthwise convs on 64, 192 and 288) with batch norm and its
classifier's dropout.
"""

import functools
from dataclasses import replace

import jax
import numpy as np
import pytest
from conftest import compiled_program, train_losses

from jaxcnn.analysis.comm_model import modelled_comm
from jaxcnn.analysis.hlo import KINDS, collectives
from jaxcnn.analysis.lint import classify, lint_program
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data.sources import synthetic_dataset
from jaxcnn.fit import fit
from jaxcnn.models import layer_shapes
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding import build_mesh, get_layout, parse_rules

STEPS, BATCH = 6, 24
IMAGE = (48, 13, 3)  # spatial=2 keeps 6 rows a shard for stage 1's 7x7 depthwise convs (module docstring of comm_model)
SGD = OptimConfig(name="sgd", learning_rate=0.05, schedule="constant", warmup_steps=0)
MODELS = {
    "convnext": ModelConfig(name="convnext_test", conv_features=(32, 64), stochastic_depth=0.2),
    "mobilenet": ModelConfig(name="mobilenet_v2_test", width_multiplier=2.0, dropout=0.2),
}
FSDP_TP = "batch=data+fsdp,params=fsdp,conv_out=model,mlp=model"
MESHES = [
    ("dp", {"data": 8}),
    ("fsdp", {"data": 4}),
    ("tp", {"model": 4}),
    ("hybrid", {"data": 2, "model": 4}),
    ("spatial", {"data": 4, "spatial": 2}),
    (FSDP_TP, {"data": 2, "fsdp": 2, "model": 2}),
]
CASES = [(family, *case) for family in MODELS for case in MESHES]


@functools.cache
def data():
    return synthetic_dataset(IMAGE, 10 * BATCH, 10, 0)


def layout_named(name):
    return parse_rules(name, "fsdp+tp") if "=" in name else get_layout(name)


def run(family, layout, mesh):
    return train_losses(layout, mesh, MODELS[family], steps=STEPS, batch_size=BATCH, data=data(), optim=SGD)


@pytest.fixture(scope="module")
def singles():
    return {family: run(family, get_layout("single"), {"data": 1}) for family in MODELS}


def assert_close_to_scale(actual, desired, rtol: float = 1e-3, atol: float = 5e-6) -> None:
    actual, desired = np.asarray(actual), np.asarray(desired)
    error = float(np.abs(actual - desired).max())
    assert error <= rtol * np.abs(desired).max() + atol, (
        f"{error:.2e} against entries up to {np.abs(desired).max():.2e}"
    )


def _case_id(family, name, mesh):
    return f"{family}-{name.split(',')[0]}-{','.join(f'{k}={v}' for k, v in mesh.items())}"


@pytest.mark.parametrize(("family", "layout_name", "mesh"), CASES, ids=[_case_id(*c) for c in CASES])
def test_layout_matches_single_device_and_moves_what_the_model_says(singles, family, layout_name, mesh):
    reference, ref_state, _ = singles[family]
    losses, state, program = run(family, layout_named(layout_name), mesh)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    # Parameters and batch statistics after 6 steps, each leaf within 1e-3 of its largest entry
    # plus 5e-6: float32's floor here, not slack -- nudging single's own images by one ulp moves
    # its MobileNetV2 depthwise kernels by 4.3e-5 (4e-4 of their largest entry) and a batch-norm
    # bias of entries ~3e-4 by 2.1e-6 after 6 steps, as much as any layout does; after one step
    # every leaf of every layout is within 2e-6 of single's.
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        assert_close_to_scale(a, b)
    for a, b in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(ref_state.model_state), strict=True):
        assert_close_to_scale(a, b)
    # the compiled step's collectives, kind by kind, against the communication model, byte for
    # byte. On XLA:CPU FSDP's reduce-scatter is an all-reduce of the whole gradient (the same
    # buffer bytes): those two kinds are compared summed. Under tp the gathers of a column
    # layer's batch-norm vectors are not modelled (comm_model's docstring): all-gathers are
    # then compared only for ConvNeXt, which has none.
    measured = {kind: 0 for kind in KINDS}
    for c in collectives(program.train_step.as_text(), program.mesh.size):
        measured[c.kind] += c.buffer_bytes * c.repeats
    modelled = modelled_comm(program, MODELS[family], IMAGE)
    for figures in (measured, modelled):
        figures["all-reduce"] += figures.pop("reduce-scatter")
    if program.layout.degree(ax.CONV_OUT, mesh) > 1 and MODELS[family].norm == "batch":
        assert measured.pop("all-gather") >= modelled.pop("all-gather")
    assert {kind: measured[kind] for kind in measured} == {kind: modelled[kind] for kind in measured}
    assert sum(measured.values()) > 0  # the layout really split the work
    report = lint_program(program)
    assert not [w for w in report.warnings if "did not expect" in w]  # no collective the layout did not expect


def test_a_depthwise_conv_under_tp_moves_nothing():
    """MobileNetV2's depthwise convs split with their input's channels: the only activation
    all-reduces are the row layers' partial sums forward and the column layers' input
    gradients backward -- none carries a depthwise conv's input or output -- and no activation
    is all-gathered. Taking the depthwise convs out of the model changes nothing it predicts."""
    model = MODELS["mobilenet"]
    program = compiled_program(get_layout("tp"), {"model": 4}, model, steps=STEPS, batch_size=BATCH,
                               image_shape=IMAGE, optim=SGD)  # fmt: skip
    found = collectives(program.train_step.as_text(), program.mesh.size)
    roles = classify(found, program.anatomy.placements, program.mesh)
    assert not [c for c, role in zip(found, roles, strict=True) if c.kind == "all-gather" and role == "activation"]
    layers = layer_shapes(model, IMAGE)
    dw = [layer for layer in layers if layer.depthwise]
    assert dw and all(layer.space_in == layer.space_out == ax.CONV_OUT for layer in dw)  # split under tp
    rows = {(BATCH, layer.out_height, layer.out_width, layer.features) for layer in layers
            if layer.kind == "conv" and layer.space_in == ax.CONV_OUT and not layer.depthwise}  # fmt: skip
    columns = {(BATCH, layer.height, layer.width, layer.in_features) for i, layer in enumerate(layers)
               if layer.kind == "conv" and layer.space_out == ax.CONV_OUT and not layer.depthwise and i > 0}  # fmt: skip
    activations = {s for c in found if c.kind == "all-reduce" for s in c.shapes if len(s) == 4}
    assert activations == rows | columns
    depthwise_sides = {(BATCH, layer.height, layer.width, layer.features) for layer in dw}
    depthwise_sides |= {(BATCH, layer.out_height, layer.out_width, layer.features) for layer in dw}
    assert not activations & depthwise_sides
    depthwise_kernels = [p for p in program.anatomy.placements if p.path.endswith("depthwise/conv/kernel")]
    assert all(tuple(p.spec) == (None, None, None, "model") for p in depthwise_kernels)  # really split


def test_convnext_tp_reduces_once_per_block_each_way():
    """The residual stream, the depthwise conv and LayerNorm stay whole; each block's MLP all-reduces
    its output forward and its input gradient backward: 2 per block, nothing else moves."""
    model = MODELS["convnext"]
    program = compiled_program(get_layout("tp"), {"model": 4}, model, steps=STEPS, batch_size=BATCH,
                               image_shape=IMAGE, optim=SGD)  # fmt: skip
    found = collectives(program.train_step.as_text(), program.mesh.size)
    assert {c.kind for c in found} == {"all-reduce"}
    blocks = len([layer for layer in layer_shapes(model, IMAGE) if layer.depthwise])
    activation_reduces = [c for c in found if any(len(s) == 4 for s in c.shapes)]
    assert len(activation_reduces) == 2 * blocks == 6


@pytest.mark.parametrize(
    ("family", "mesh", "microbatches"), [("convnext", {"stage": 4}, 4), ("mobilenet", {"data": 2, "stage": 2}, 2)]
)
def test_pipeline_cuts_between_units_and_matches_single_device(family, mesh, microbatches):
    """Per-example norms (LayerNorm; group norm for MobileNetV2) and no random drops, so the
    micro-batches change nothing: equal losses with M > 1."""
    model = MODELS[family]
    model = replace(model, stochastic_depth=0.0) if family == "convnext" else replace(model, norm="group", dropout=0.0)
    reference = train_losses(get_layout("single"), {"data": 1}, model, steps=STEPS, batch_size=BATCH, data=data(),
                             optim=SGD)[0]  # fmt: skip
    program = build_program(
        model, SGD, get_layout("pipeline"), build_mesh(mesh), IMAGE, BATCH, STEPS, microbatches=microbatches,
        with_eval=False,
    )  # fmt: skip
    groups = [list(g) for g in program.anatomy.layer_groups]
    units = layer_shapes(model, IMAGE)[-1].unit + 1
    assert len(groups) == mesh["stage"] and [u for g in groups for u in g] == list(range(units))
    result = fit(program, program.init(), data(), None, TrainConfig(batch_size=BATCH, epochs=1, max_steps=STEPS),
                 progress=False)  # fmt: skip
    np.testing.assert_allclose(result.loss_history, reference, rtol=1e-5)
