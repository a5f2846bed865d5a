"""Sharding helpers: logical axes, meshes, layouts (rules tables) and partitioning."""

from jaxcnn.sharding.layouts import LAYOUTS, Layout, get_layout, parse_rules
from jaxcnn.sharding.mesh import build_mesh, format_mesh, parse_mesh, resolve_mesh, simulate_cpu_devices
from jaxcnn.sharding.partition import (
    ParamPlacement,
    ShardingWarning,
    activation_layout,
    activation_spec,
    constrain,
    data_sharding,
    param_spec,
    place_variables,
)

__all__ = [
    "LAYOUTS",
    "Layout",
    "ParamPlacement",
    "ShardingWarning",
    "activation_layout",
    "activation_spec",
    "build_mesh",
    "constrain",
    "data_sharding",
    "format_mesh",
    "get_layout",
    "param_spec",
    "parse_mesh",
    "parse_rules",
    "place_variables",
    "resolve_mesh",
    "simulate_cpu_devices",
]
