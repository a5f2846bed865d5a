"""Sharding helpers: logical axes, meshes, layouts (rules tables), partitioning, and the
tools that read a compiled program back: inspector, analytic model, lint, planner."""

from jaxcnn.sharding.comm_model import CommTerm, comm_terms, summarise
from jaxcnn.sharding.hardware import PROFILES, HardwareProfile, get_profile
from jaxcnn.sharding.inspect import Collective, StepCost, collective_summary, collectives, step_cost
from jaxcnn.sharding.layouts import LAYOUTS, Layout, get_layout, parse_rules
from jaxcnn.sharding.lint import ShardingReport, format_report, lint
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
from jaxcnn.sharding.planner import Candidate, explain, plan

__all__ = [
    "LAYOUTS",
    "PROFILES",
    "Candidate",
    "Collective",
    "CommTerm",
    "HardwareProfile",
    "Layout",
    "ParamPlacement",
    "ShardingReport",
    "ShardingWarning",
    "StepCost",
    "activation_layout",
    "activation_spec",
    "build_mesh",
    "collective_summary",
    "collectives",
    "comm_terms",
    "constrain",
    "data_sharding",
    "explain",
    "format_mesh",
    "format_report",
    "get_layout",
    "get_profile",
    "lint",
    "param_spec",
    "parse_mesh",
    "parse_rules",
    "place_variables",
    "plan",
    "resolve_mesh",
    "simulate_cpu_devices",
    "step_cost",
    "summarise",
]
