"""Mesh flags, layouts and user rules tables: parsing and validation."""

import warnings
from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxcnn.errors import UserError
from jaxcnn.run_config import ParallelConfig
from jaxcnn.sharding import LAYOUTS, build_mesh, get_layout, mesh_for, parse_mesh, parse_rules, resolve_mesh
from jaxcnn.sharding.mesh import across_hosts, check_layout_axes, device_grid, host_devices_for


def test_parse_keeps_axis_order_and_sizes():
    assert list(parse_mesh("data=4,model=2").items()) == [("data", 4), ("model", 2)]
    assert parse_mesh(" data = -1 ") == {"data": -1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("data", "has no size"),
        ("batch=4", "unknown mesh axis 'batch'"),
        ("data=4,data=2", "given twice"),
        ("data=two", "has size 'two'"),
        ("data=0", "has size 0"),
        ("data=-2", "has size -2"),
        ("data=-1,model=-1", "more than one -1"),
        ("", "names no axis"),
    ],
)
def test_parse_rejects_bad_meshes(text, message):
    with pytest.raises(UserError, match=message):
        parse_mesh(text)


def test_minus_one_fills_the_devices():
    assert resolve_mesh({"data": -1, "model": 2}, 8) == {"data": 4, "model": 2}
    assert resolve_mesh({"data": 8}, 8) == {"data": 8}


def test_product_must_match_the_devices():
    with pytest.raises(UserError, match="needs 6 devices but 8 are in use"):
        resolve_mesh({"data": 3, "model": 2}, 8)
    with pytest.raises(UserError, match="not a multiple of 3"):
        resolve_mesh({"data": -1, "model": 3}, 8)


def test_mesh_for_builds_what_a_parallel_config_names_over_the_devices_it_is_given():
    """The one mesh builder: -1 fills the devices; a fixed mesh takes the first ones, and says
    how many stay idle; a rules table is the layout; a mesh too big is one line."""
    devices = jax.devices()
    layout, mesh = mesh_for(ParallelConfig(layout="hybrid"), devices[:4])
    assert layout is get_layout("hybrid") and dict(mesh.shape) == {"data": 2, "model": 2}
    assert list(mesh.devices.flat) == devices[:4]
    with pytest.warns(UserWarning, match="uses 2 of the 8 devices"):
        _, mesh = mesh_for(ParallelConfig(layout="tp", mesh="model=2"))
    assert list(mesh.devices.flat) == devices[:2]
    layout, mesh = mesh_for(ParallelConfig(layout_rules="batch=data,conv_out=model", mesh="data=4,model=2"))
    assert layout.axes_for("conv_out") == ("model",) and mesh.size == 8
    with pytest.raises(UserError, match="needs 16 devices but 8 exist"):
        mesh_for(ParallelConfig(mesh="data=16"))
    with pytest.raises(UserError, match="lacks"):
        mesh_for(ParallelConfig(layout="hybrid", mesh="data=8"))


def test_mesh_uses_auto_axes_over_the_first_devices():
    mesh = build_mesh({"data": 2, "model": 2})
    assert dict(mesh.shape) == {"data": 2, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    with pytest.raises(UserError, match="needs 16 devices but only 8 exist"):
        build_mesh({"data": 16})


def test_host_devices_default_follows_the_mesh():
    assert host_devices_for({"data": 4}, None, 8) == 4
    assert host_devices_for({"data": -1}, None, 8) == 8
    assert host_devices_for({"data": 4}, 4, 8) == 4


def test_layout_names_are_the_contract():
    assert {"single", "dp"} <= set(LAYOUTS)
    assert get_layout("dp").mesh_axes == ("data",)
    with pytest.raises(UserError, match="unknown layout 'zero'"):
        get_layout("zero")


def test_user_rules_table():
    layout = parse_rules("batch=data,conv_out=model,mlp=model,embed=none,height=data+spatial")
    assert layout.axes_for("conv_out") == ("model",)
    assert layout.axes_for("embed") == ()
    assert layout.axes_for("height") == ("data", "spatial")
    assert layout.axes_for("classes") is None
    assert set(layout.mesh_axes) == {"data", "model", "spatial"}
    assert layout.default_mesh == "data=-1,model=1,spatial=1"  # the order written, every device on the first
    assert parse_rules("conv_out=model,batch=data").default_mesh == "model=-1,data=1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("batch", "needs the form"),
        ("pixels=data", "unknown logical axis 'pixels'"),
        ("batch=gpu", "unknown mesh axis 'gpu'"),
        ("batch=data,batch=model", "twice"),
        (",", "holds no rule"),
    ],
)
def test_user_rules_rejects_bad_tables(text, message):
    with pytest.raises(UserError, match=message):
        parse_rules(text)


def test_layout_axes_must_be_in_the_mesh():
    with pytest.raises(UserError, match="splits over mesh axis 'data'"):
        check_layout_axes(("data",), {"model": 8}, "dp")
    notes = check_layout_axes(("data",), {"data": 4, "model": 2}, "dp")
    assert notes == ["mesh axis model=2 is not used by layout dp: its devices hold replicas"]


@dataclass(frozen=True)
class FakeGPU:
    """What JAX's mesh utilities read of a device."""

    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


def hosts_of_grid(grid) -> list:
    return np.vectorize(lambda d: d.process_index)(grid).tolist()


TWO_HOSTS = [FakeGPU(i, i // 8) for i in range(16)]  # 2 hosts x 8 GPUs, one process each


@pytest.mark.parametrize("mesh", [{"data": 2, "model": 8}, {"model": 8, "data": 2}], ids=["data-first", "model-first"])
def test_on_two_hosts_model_groups_stay_inside_a_host_and_data_spans_them(mesh):
    grid = device_grid(mesh, TWO_HOSTS)
    assert grid.shape == tuple(mesh.values())
    hosts = hosts_of_grid(grid if next(iter(mesh)) == "data" else grid.T)  # rows: one data index each
    assert hosts == [[0] * 8, [1] * 8]  # every model group (a row) on one host; data across hosts


def test_tp_on_eight_of_sixteen_takes_one_host_and_a_fast_axis_across_hosts_is_warned_about():
    assert hosts_of_grid(device_grid({"model": 8}, TWO_HOSTS[:8])) == [0] * 8
    with pytest.warns(UserWarning, match="model=16 spans hosts"):
        device_grid({"model": 16}, TWO_HOSTS)


def test_one_process_per_gpu_keeps_model_groups_on_consecutive_processes():
    per_gpu = [FakeGPU(i, i) for i in range(16)]  # 16 processes: ranks host-major, as SLURM and torchrun give
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the hosts are not known, only the order
        grid = device_grid({"data": 2, "model": 8}, per_gpu)
    assert hosts_of_grid(grid) == [list(range(8)), list(range(8, 16))]


def test_dcn_mesh_says_which_axis_crosses_hosts():
    assert across_hosts({"data": 2, "model": 8}, 2) == {"data": 2, "model": 1}
    assert across_hosts({"data": 4, "fsdp": 4}, 8) == {"data": 4, "fsdp": 2}  # slowest axes first
    grid = device_grid({"data": 4, "fsdp": 4}, TWO_HOSTS, dcn_mesh={"fsdp": 2})
    assert hosts_of_grid(grid) == [[0, 0, 1, 1]] * 4  # fsdp's halves on different hosts, data inside each
    with pytest.raises(UserError, match="does not divide"):
        across_hosts({"data": 2, "model": 8}, 2, {"model": 3})
    with pytest.raises(UserError, match="spans 4 processes but the run has 2"):
        across_hosts({"data": 4, "model": 4}, 2, {"data": 4})
    with pytest.raises(UserError, match="cannot be spread over 3 hosts"):
        across_hosts({"data": 2, "model": 8}, 3)


def test_one_host_lays_devices_out_slowest_axis_first():
    devices = jax.devices()[:8]
    grid = build_mesh({"model": 2, "data": 4}, devices).devices
    assert [d.id for d in grid[:, 0]] == [devices[i].id for i in (0, 1)] and grid[0, 1] == devices[2]


def test_dcn_mesh_on_one_process_is_refused():
    with pytest.raises(UserError, match="is for a run of several processes"):
        device_grid({"data": 8}, jax.devices()[:8], dcn_mesh={"data": 2})
