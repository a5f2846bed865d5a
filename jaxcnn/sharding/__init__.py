"""Layouts and their placement: logical axes, meshes, layouts (typed rules tables),
partitioning, and batches placed on the devices (placement). Nothing here knows a model, an optimizer or a training loop; the tools that
read a compiled program back live in `jaxcnn.analysis`."""

from jaxcnn.sharding.layouts import LAYOUTS, Layout, compose, get_layout, parse_rules
from jaxcnn.sharding.mesh import (
    ParallelDims,
    build_mesh,
    format_mesh,
    layout_for,
    mesh_for,
    parse_mesh,
    resolve_mesh,
    simulate_cpu_devices,
    simulate_devices_for,
)
from jaxcnn.sharding.partition import (
    ParamPlacement,
    ShardingWarning,
    activation_layout,
    activation_spec,
    constrain,
    data_sharding,
    param_spec,
    place_variables,
    quiet_fallbacks,
)
from jaxcnn.sharding.placement import BatchPlacement, BatchShare, to_global

__all__ = [
    "LAYOUTS",
    "BatchPlacement",
    "BatchShare",
    "Layout",
    "ParallelDims",
    "ParamPlacement",
    "ShardingWarning",
    "activation_layout",
    "activation_spec",
    "build_mesh",
    "compose",
    "constrain",
    "data_sharding",
    "format_mesh",
    "get_layout",
    "layout_for",
    "mesh_for",
    "param_spec",
    "parse_mesh",
    "parse_rules",
    "place_variables",
    "quiet_fallbacks",
    "resolve_mesh",
    "simulate_cpu_devices",
    "simulate_devices_for",
    "to_global",
]
