"""Parameters and batches land where the layout's rules say (read back from .sharding.spec)."""

import jax
import pytest
from conftest import TINY_BN_DROPOUT
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcnn.build import build_program
from jaxcnn.config import OptimConfig
from jaxcnn.errors import UserError
from jaxcnn.sharding import ParallelDims, ShardingWarning, build_mesh, get_layout, param_spec, parse_rules
from jaxcnn.sharding.partition import activation_spec


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def test_dp_replicates_every_parameter_and_splits_the_batch():
    program = build_program(
        TINY_BN_DROPOUT, OptimConfig(), get_layout("dp"), build_mesh({"data": 8}), (8, 8, 1), 32, 5, with_eval=False
    )
    state = program.init()
    for array in jax.tree.leaves((state.params, state.model_state, state.opt_state)):
        assert array.sharding.is_fully_replicated
    assert program.train_input.images.sharding.spec == P("data", None, None, None)
    assert program.train_input.labels.sharding.spec == P("data")


def test_user_rules_shard_the_tensors_they_name():
    layout = parse_rules("batch=data,conv_out=model,mlp=model")
    mesh = build_mesh({"data": 4, "model": 2})
    program = build_program(TINY_BN_DROPOUT, OptimConfig(), layout, mesh, (8, 8, 1), 32, 5, with_eval=False)
    state = program.init()
    kernel0 = state.params["blocks"][0]["conv"]["kernel"]  # (kh, kw, conv_in, conv_out): column
    kernel1 = state.params["blocks"][1]["conv"]["kernel"]  # (kh, kw, conv_out, conv_in): row
    dense0 = state.params["dense"][0]["kernel"]  # (embed, mlp)
    assert kernel0.get_value().sharding.spec == P(None, None, None, "model")
    assert kernel1.get_value().sharding.spec == P(None, None, "model", None)
    assert dense0.get_value().sharding.spec == P(None, "model")
    assert {s.data.shape for s in dense0.get_value().addressable_shards} == {(dense0.shape[0], 16)}
    # Adam's moments sit exactly where their parameters sit.
    mu = state.opt_state[0].mu["blocks"][0]["conv"]["kernel"]
    assert mu.get_value().sharding == kernel0.get_value().sharding
    # the placement table agrees with the arrays
    rows = {row.path: row for row in program.anatomy.placements}
    assert rows["blocks/0/conv/kernel"].spec == P(None, None, None, "model")
    assert rows["blocks/0/conv/kernel"].bytes_per_device == 3 * 3 * 1 * 4 * 4
    assert rows["dense/0/bias"].spec == P("model")
    assert "blocks/0/conv/bias" not in rows  # no conv bias before batch norm


def test_dimension_that_does_not_divide_is_replicated_with_a_note():
    layout = parse_rules("conv_out=model")
    mesh = build_mesh({"data": 2, "model": 4})
    spec, notes = param_spec(("kh", "kw", "conv_in", "conv_out"), (3, 3, 1, 6), layout, mesh, "conv")
    assert spec == P(None, None, None, None)
    assert notes == ("conv dim 3 (conv_out, size 6) does not divide mesh axes model=4; replicated",)
    spec, notes = param_spec(("kh", "kw", "conv_in", "conv_out"), (3, 3, 1, 8), layout, mesh, "conv")
    assert spec == P(None, None, None, "model") and notes == ()


def test_program_warns_about_fallbacks_it_applies():
    layout = parse_rules("batch=data,classes=model")  # 10 classes over model=4: cannot split
    with pytest.warns(ShardingWarning) as caught:
        build_program(
            TINY_BN_DROPOUT, OptimConfig(), layout, build_mesh({"data": 2, "model": 4}), (8, 8, 1), 16, 2,
            with_eval=False, with_init=False,
        )  # fmt: skip
    assert sorted(str(w.message) for w in caught) == [
        "dense/1/bias dim 0 (classes, size 10) does not divide mesh axes model=4; replicated",
        "dense/1/kernel dim 1 (classes, size 10) does not divide mesh axes model=4; replicated",
    ]


def test_a_mesh_axis_is_used_once_per_tensor():
    layout = parse_rules("embed=model,mlp=model")
    spec, notes = param_spec(("embed", "mlp"), (8, 8), layout, build_mesh({"model": 8}), "dense")
    assert spec == P("model", None) and "already used" in notes[0]


def test_activation_names_outside_the_table_stay_unconstrained():
    layout, mesh = get_layout("dp"), build_mesh({"data": 8})
    assert activation_spec(("batch", "height", "width", "channels"), layout, mesh) == P(
        "data", P.UNCONSTRAINED, P.UNCONSTRAINED, P.UNCONSTRAINED
    )


def test_batch_that_does_not_divide_the_data_axis_is_rejected():
    dims = ParallelDims(get_layout("dp"), {"data": 8})
    with pytest.raises(
        UserError, match="global batch of 100 is not divisible by mesh axes data=8; use a multiple of 8"
    ):
        dims.validate(100)
    with pytest.raises(UserError, match="eval batch of 20 is not divisible"):
        dims.validate(96, eval_batch_size=20)
    with pytest.raises(UserError, match="global batch 96 does not split into 8 data shards x 5 micro-batches"):
        dims.validate(96, grad_accum=5)


def test_image_height_that_does_not_divide_the_spatial_axis_is_rejected_before_compiling():
    dims = ParallelDims(get_layout("spatial"), {"data": 2, "spatial": 4})
    with pytest.raises(UserError, match="image height 6 is not divisible by mesh axes spatial=4"):
        dims.validate(8, image_shape=(6, 6, 1))


def test_pipeline_micro_batches_must_divide_the_batch_and_split_over_data():
    dims = ParallelDims(get_layout("pipeline"), {"data": 2, "stage": 4})
    with pytest.raises(UserError, match="--microbatches 5 must divide the global batch 64"):
        dims.validate(64, microbatches=5)
    with pytest.raises(UserError, match=r"a micro-batch of 1 \(64/64\) does not split over data=2"):
        dims.validate(64, microbatches=64)


def test_fsdp_shards_the_largest_divisible_dim_of_tensors_over_the_threshold():
    layout, mesh = get_layout("fsdp"), build_mesh({"data": 8})
    kernel = ("kh", "kw", "conv_in", "conv_out")
    assert param_spec(kernel, (3, 3, 64, 128), layout, mesh)[0] == P(None, None, None, "data")
    assert param_spec(kernel, (3, 3, 128, 64), layout, mesh)[0] == P(None, None, "data", None)
    assert param_spec(kernel, (3, 3, 1, 32), layout, mesh)[0] == P(None, None, None, None)  # 1,152 B < 4 KiB
    spec, notes = param_spec(("embed", "classes"), (1029, 10), layout, mesh, "dense")  # nothing divides 8
    assert spec == P(None, None) and "no free dim" in notes[0]
    # with tensor parallelism on another axis, FSDP takes the largest dim still free
    both = parse_rules("batch=data,params=data,conv_out=model")
    assert param_spec(kernel, (3, 3, 64, 128), both, build_mesh({"data": 4, "model": 2}))[0] == P(
        None, None, "data", "model"
    )


def test_state_is_born_sharded_not_gathered_on_one_device():
    layout = parse_rules("batch=data,mlp=model")
    mesh = build_mesh({"data": 2, "model": 4})
    program = build_program(TINY_BN_DROPOUT, OptimConfig(), layout, mesh, (8, 8, 1), 16, 2, with_eval=False)
    # The compiled init program itself outputs the layout's shardings: each device creates
    # only its own slice; nothing is built whole on one device and scattered.
    dense0 = program.init.output_shardings.params["dense"][0]["kernel"].get_value()
    assert dense0.spec == P(None, "model")
    assert dense0.shard_shape((64, 32)) == (64, 8)
