"""Layouts and their placement: logical axes, meshes, layouts (typed rules tables),
partitioning. Nothing here knows a model, an optimizer or a training loop; the tools that
read a compiled program back live in `jaxcnn.analysis`."""

from jaxcnn.sharding.layouts import LAYOUTS, Layout, compose, get_layout, parse_rules
from jaxcnn.sharding.mesh import ParallelDims, build_mesh, format_mesh, parse_mesh, resolve_mesh, simulate_cpu_devices
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

__all__ = [
    "LAYOUTS",
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
    "param_spec",
    "parse_mesh",
    "parse_rules",
    "place_variables",
    "quiet_fallbacks",
    "resolve_mesh",
    "simulate_cpu_devices",
]
