"""The ResNets: torchvision's parameter counts, the stems, the logical names that make
tp a column -> row pair per block, every layout equal to one device on tiny ResNets (the
realistic sizes, resnet18 at 32x32 and 64x64: experiments/check_layouts.py --sizes
resnet), and the collectives each layout compiles to."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bundled_digits, compiled_program, train_losses
from flax import nnx

from jaxcnn.analysis.comm_model import modelled_comm, spatial_plan
from jaxcnn.analysis.hlo import KINDS, collectives, kinds_seen
from jaxcnn.analysis.lint import classify
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.models import ResNet, build_model, count_params, layer_shapes
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding import build_mesh, get_layout, parse_rules
from jaxcnn.sharding.partition import NAMES_KEY

STEPS = 6
BASIC = ModelConfig(name="resnet_tiny")  # 8 and 16 channels: an identity block, then a stride-2 projection block
BOTTLENECK = ModelConfig(name="resnet_tiny_bottleneck")  # widths 8, 16 -> 32, 64 channels out


def abstract(config: ModelConfig, image_shape) -> ResNet:
    return nnx.eval_shape(lambda: build_model(config, image_shape, seed=0))


@pytest.mark.parametrize(
    ("name", "params"), [("resnet18", 11_689_512), ("resnet34", 21_797_672), ("resnet50", 25_557_032)]
)
def test_parameter_counts_equal_torchvisions(name, params):
    model = abstract(ModelConfig(name=name, num_classes=1000), (224, 224, 3))
    assert count_params(model) == params


def test_block_structure_and_projection_shortcuts():
    r18, r50 = abstract(ModelConfig(name="resnet18"), (32, 32, 3)), abstract(ModelConfig(name="resnet50"), (32, 32, 3))
    assert len(r18.blocks) == 8 and [i for i, b in enumerate(r18.blocks) if b.shortcut] == [2, 4, 6]
    assert len(r50.blocks) == 16 and [i for i, b in enumerate(r50.blocks) if b.shortcut] == [0, 3, 7, 13]
    assert r50.blocks[3].conv2.strides == (2, 2) and r50.blocks[3].conv1.strides == (1, 1)  # v1.5: stride on the 3x3


@pytest.mark.parametrize(
    ("image_shape", "stem", "kernel", "pooled"),
    [((32, 32, 3), "auto", 3, False), ((17, 17, 1), "auto", 3, False), ((224, 224, 3), "auto", 7, True),
     ((33, 33, 3), "imagenet", 7, True), ((224, 224, 3), "small", 3, False)],
)  # fmt: skip
def test_the_stem_follows_the_image_size_unless_told(image_shape, stem, kernel, pooled):
    config = ModelConfig(name="resnet18", stem=stem, num_classes=7)
    model = abstract(config, image_shape)
    assert model.stem.conv.kernel_size == (kernel, kernel) and model.stem.pool == pooled
    graphdef, state = nnx.split(model)
    images = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    assert jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, images).shape == (2, 7)
    # the layer shapes the cost models read agree with what the model computes
    layers = layer_shapes(config, image_shape)
    stem_out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s).stem(x, False), state, images).shape
    assert stem_out[1:3] == layers[0].next_size


def test_each_block_names_a_column_then_a_row_conv_and_leaves_the_residual_stream_whole():
    def names(conv):
        return conv.kernel.get_metadata()[NAMES_KEY][2:]

    basic = abstract(ModelConfig(name="resnet18"), (32, 32, 3)).blocks[2]
    assert names(basic.conv1) == (ax.CONV_IN, ax.CONV_OUT) and names(basic.conv2) == (ax.CONV_OUT, ax.CONV_IN)
    assert names(basic.shortcut.conv) == (ax.CONV_IN, ax.CONV_IN)
    bottleneck = abstract(ModelConfig(name="resnet50"), (32, 32, 3)).blocks[0]
    assert [names(c) for c in (bottleneck.conv1, bottleneck.conv2, bottleneck.conv3)] == [
        (ax.CONV_IN, ax.CONV_IN), (ax.CONV_IN, ax.CONV_OUT), (ax.CONV_OUT, ax.CONV_IN)
    ]  # fmt: skip
    variables = jax.tree.leaves(nnx.state(bottleneck), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert all(len(v.get_metadata()[NAMES_KEY]) == v.get_value().ndim for v in variables)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "resnet18", "dense_features": (64,)}, "global average pooling"),
        ({"name": "resnet18", "dropout": 0.5}, "drop --dense-features and --dropout"),
        ({"name": "resnet18", "conv_features": (8, 16)}, "has 4 stages"),
        ({"name": "resnet18", "stem": "huge"}, "unknown --stem"),
        ({"stem": "small"}, "--stem is for the ResNets"),
    ],
)
def test_bad_resnet_configs(kwargs, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**kwargs)


# --- every layout equals one device --------------------------------------------------------

FSDP_TP = "batch=data+fsdp,params=fsdp,conv_out=model,mlp=model"
MESHES = [
    ("dp", {"data": 8}),
    ("fsdp", {"data": 4}),
    ("tp", {"model": 2}),
    ("tp", {"model": 8}),
    ("hybrid", {"data": 2, "model": 4}),
    ("spatial", {"data": 4, "spatial": 2}),
    ("spatial", {"data": 2, "spatial": 4}),  # 8 rows -> 2 a shard; block 1's 4 rows are gathered
    (FSDP_TP, {"data": 2, "fsdp": 2, "model": 2}),
]
MODELS = {"basic": BASIC, "bottleneck": BOTTLENECK}
# the bottleneck differs from the basic block where tp and spatial act: its replicated 1x1
# conv before the column -> row pair, its 1x1 convs without halos
BOTTLENECK_MESHES = [MESHES[2], MESHES[6], MESHES[7]]
CASES = [("basic", *case) for case in MESHES] + [("bottleneck", *case) for case in BOTTLENECK_MESHES]


def layout_named(name):
    return parse_rules(name, "fsdp+tp") if "=" in name else get_layout(name)


@pytest.fixture(scope="module")
def singles():
    return {name: train_losses(get_layout("single"), {"data": 1}, model, steps=STEPS) for name, model in MODELS.items()}


@pytest.mark.parametrize(
    ("model_name", "layout_name", "mesh"),
    CASES,
    ids=[f"{b}-{n.split(',')[0]}-{','.join(f'{k}={v}' for k, v in m.items())}" for b, n, m in CASES],
)
def test_layout_matches_single_device(singles, model_name, layout_name, mesh):
    reference, ref_state, _ = singles[model_name]
    losses, state, _ = train_losses(layout_named(layout_name), mesh, MODELS[model_name], steps=STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(ref_state.model_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("mesh", "microbatches"), [({"stage": 4}, 4), ({"data": 2, "stage": 2}, 2)])
def test_pipeline_cuts_at_block_boundaries_and_matches_single_device(mesh, microbatches):
    """Group norm (per example), so micro-batches change nothing: equal losses for M > 1."""
    model = replace(BASIC, norm="group")
    reference = train_losses(get_layout("single"), {"data": 1}, model, steps=STEPS)[0]
    data = bundled_digits()
    program = build_program(
        model, OptimConfig(learning_rate=1e-2, warmup_steps=2), get_layout("pipeline"), build_mesh(mesh),
        data.image_shape, 32, STEPS, microbatches=microbatches, with_eval=False,
    )  # fmt: skip
    # units: the stem, block 0, block 1 (with its projection), the head
    assert [list(g) for g in program.anatomy.layer_groups][: mesh["stage"]] == (
        [[0], [1], [2], [3]] if mesh["stage"] == 4 else [[0, 1], [2, 3]]
    )
    result = fit(
        program, program.init(), data, None, TrainConfig(batch_size=32, epochs=1, max_steps=STEPS), progress=False
    )
    np.testing.assert_allclose(result.loss_history, reference, rtol=1e-5)


# --- the collectives each layout compiles to ---------------------------------------------


def compiled(layout, mesh, model=BASIC):
    program = compiled_program(get_layout(layout), mesh, model, steps=STEPS)
    return program, collectives(program.train_step.as_text(), program.mesh.size)


@pytest.mark.parametrize("model", [BASIC, BOTTLENECK], ids=["basic", "bottleneck"])
def test_tp_all_reduces_once_per_block_each_way_and_never_gathers_an_activation(model):
    program, found = compiled("tp", {"model": 2}, model)
    roles = classify(found, program.anatomy.placements, program.mesh)
    assert not [c for c, role in zip(found, roles, strict=True) if c.kind == "all-gather" and role != "param"]
    assert kinds_seen(found)["all-to-all"] == kinds_seen(found)["collective-permute"] == 0
    layers = layer_shapes(model, (8, 8, 1))
    blocks = sorted({layer.unit for layer in layers if layer.space_out == ax.CONV_OUT})
    outputs = {
        (32, layer.out_height, layer.out_width, layer.features) for layer in layers if layer.space_in == ax.CONV_OUT
    }
    inputs = {(32, layer.height, layer.width, layer.in_features) for layer in layers if layer.space_out == ax.CONV_OUT}
    activation_reduces = [c for c in found if c.kind == "all-reduce" and any(len(s) == 4 for s in c.shapes)]
    # forward: each block's row conv output (partial sums), before its norm and the add;
    # backward: each block's column conv input gradient -- one each per block, nothing else
    assert len(activation_reduces) == 2 * len(blocks) == 4
    assert {s for c in activation_reduces for s in c.shapes if len(s) == 4} == outputs | inputs
    assert all(c.group_size == 2 for c in activation_reduces)


def test_spatial_exchanges_halos_and_gathers_only_where_the_height_stops_dividing():
    program, found = compiled("spatial", {"data": 2, "spatial": 4})
    kinds = kinds_seen(found)
    assert kinds["collective-permute"] > 0 and kinds["all-to-all"] == 0
    roles = classify(found, program.anatomy.placements, program.mesh)
    gathered = [c for c, role in zip(found, roles, strict=True) if c.kind == "all-gather" and role == "activation"]
    _, expected = spatial_plan(layer_shapes(BASIC, (8, 8, 1)), 4, 16, 4)
    expected_gathers = [t for t in expected if t.kind == "all-gather"]
    assert len(gathered) == len(expected_gathers) == 1  # block 1's 4 output rows: 1 a shard is too few
    assert sum(c.buffer_bytes for c in gathered) == expected_gathers[0].buffer_bytes
    for c in found:
        if c.kind == "collective-permute":
            assert c.group_size == 2 and all(s[0] == 16 and s[1] <= 2 for s in c.shapes)  # a row or two of halo


@pytest.mark.parametrize(
    ("model", "image_shape", "mesh"),
    [
        (BASIC, (8, 8, 1), {"data": 4, "spatial": 2}),  # block 1 keeps 2 rows a shard: the pool all-reduces
        (BASIC, (8, 8, 1), {"data": 2, "spatial": 4}),  # block 1's 4 rows are gathered
        (replace(BASIC, stem="imagenet"), (48, 48, 3), {"data": 4, "spatial": 2}),  # the 7x7/2 stem and its pool
        (replace(BOTTLENECK, stem="imagenet"), (48, 48, 3), {"data": 4, "spatial": 2}),
    ],
    ids=["pool-all-reduce", "gather", "stem", "bottleneck-stem"],
)
def test_spatial_collectives_are_the_ones_the_comm_model_predicts(model, image_shape, mesh):
    """Every halo, gather and reduction, kind by kind, byte for byte: the model knows what
    a 7x7 stride-2 conv, a 3x3 stride-2 pool and global average pooling exchange."""
    program = compiled_program(get_layout("spatial"), mesh, model, steps=STEPS, image_shape=image_shape)
    measured = {}
    for c in collectives(program.train_step.as_text(), program.mesh.size):
        measured[c.kind] = measured.get(c.kind, 0) + c.buffer_bytes * c.repeats
    modelled = modelled_comm(program, model, image_shape)
    assert measured.get("collective-permute", 0) > 0
    # every kind, the ones XLA did not emit included: a kind the model predicts that the
    # program never runs (or the reverse) fails here, and so does the total
    assert {kind: modelled[kind] for kind in KINDS} == {kind: measured.get(kind, 0) for kind in KINDS}
    assert modelled["total"] == sum(measured.values())
