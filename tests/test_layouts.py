"""Layouts are typed tables: one lookup, the compute layout derived, hybrid composed, a user
table read back into the same three parts, and one up-front check of degrees."""

import pytest

from jaxcnn.errors import UserError
from jaxcnn.sharding import LAYOUTS, ParallelDims, compose, get_layout, parse_rules


def test_every_named_layout_reads_back_from_its_own_rules():
    """`rules` is the table as a user writes it; parsing it gives the same three parts."""
    for name, layout in LAYOUTS.items():
        if not layout.rules:
            continue
        text = ",".join(f"{k}={'+'.join(v) if isinstance(v, tuple) else (v or 'none')}" for k, v in layout.rules)
        parsed = parse_rules(text, name)
        assert (parsed.params, dict(parsed.activations), parsed.fsdp) == (
            layout.params,
            dict(layout.activations),
            layout.fsdp,
        ), name


def test_axes_for_tells_split_whole_and_absent_apart():
    fsdp, tp = get_layout("fsdp"), get_layout("tp")
    assert fsdp.axes_for("batch") == ("data",)
    assert fsdp.axes_for("channels") == ()  # pinned whole
    assert tp.axes_for("channels") is None  # left to XLA's propagation
    assert tp.axes_for("conv_out") == ("model",) and tp.axes_for("conv_in") is None
    assert get_layout("spatial").degree("height", {"data": 2, "spatial": 4}) == 4


def test_compute_layout_only_undoes_the_fsdp_split():
    fsdp = get_layout("fsdp")
    compute = fsdp.compute_layout()
    assert fsdp.fsdp == ("data",) and compute.fsdp == ()
    assert (compute.params, compute.activations) == (fsdp.params, fsdp.activations)
    assert get_layout("dp").compute_layout() == get_layout("dp")


def test_a_user_table_s_default_mesh_follows_the_order_written():
    assert parse_rules("conv_out=model,batch=data").default_mesh == "model=-1,data=1"
    assert parse_rules("batch=data+fsdp,params=fsdp,conv_out=model").default_mesh == "data=-1,fsdp=1,model=1"
    assert parse_rules("embed=none").default_mesh == "data=1"


def test_hybrid_is_dp_and_tp_composed():
    dp, tp, hybrid = get_layout("dp"), get_layout("tp"), get_layout("hybrid")
    assert hybrid.params == tp.params and hybrid.activations == dp.activations
    assert hybrid.mesh_axes == ("data", "model")
    with pytest.raises(ValueError, match="batch is split over"):
        compose("clash", dp, parse_rules("batch=model"), default_mesh="data=2")


def test_parallel_dims_checks_the_mesh_and_every_size_up_front():
    with pytest.raises(UserError, match="layout hybrid splits over mesh axis 'model'"):
        ParallelDims(get_layout("hybrid"), {"data": 8})
    dims = ParallelDims(get_layout("dp"), {"data": 4, "model": 2})
    assert dims.notes == ["mesh axis model=2 is not used by layout dp: its devices hold replicas"]
    assert dims.data == 4 and dims.validate(8, eval_batch_size=12, grad_accum=2) is dims
    channels = ParallelDims(parse_rules("batch=data,channels=model"), {"data": 2, "model": 2})
    with pytest.raises(UserError, match="image channels 3 is not divisible by mesh axes model=2"):
        channels.validate(8, image_shape=(8, 8, 3))
    pipeline = ParallelDims(get_layout("pipeline"), {"stage": 4})  # the data axis is optional there
    assert (pipeline.data, pipeline.stages) == (1, 4)
