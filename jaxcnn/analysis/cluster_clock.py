"""How long a step's collectives take on a GPU cluster, read from a program compiled here.

The program the planner reads is XLA:CPU's, on simulated devices. A cluster runs the same
collectives differently, and costing them as the CPU program lists them (each one a ring
of 2(N-1) latency-bound hops, one after another) makes 256 GPUs look slower than 8. Three
things change on a GPU, each a profile field (jaxcnn.analysis.hardware):

- **Combining.** XLA:GPU's collective combiners merge independent all-reduces, all-gathers
  and reduce-scatters into ones of up to `combine_threshold_bytes` (30 MiB by default:
  `kDefaultAllReduceCombineThreshold`, xla/debug_options_flags.cc). Only the parameters'
  collectives (gradients, FSDP gathers) are independent of each other; batch norm's
  statistics and tensor parallelism's partial sums each feed the next layer and stay one
  collective each.
- **NCCL's algorithms.** Bandwidth: a ring moves `wire_bytes` (2(N-1)/N of the buffer for
  an all-reduce) at the link's speed inside a host; across hosts NCCL runs one ring per
  NIC (or a hierarchical all-reduce), so the bytes move at the host's whole network
  bandwidth, G devices x each device's NIC, never above the link inside. Latency: the
  cheaper of the ring and the tree, with NCCL's own latency model for its low-latency
  protocol (`baseLat` and `hwLat` in nccl/src/graph/tuning.cc): a ring pays a base
  3.6 us plus 0.4 us for each of its 2(N-1) steps inside a host and 0.9 us for each that
  crosses hosts; a tree 4.4 us plus 2 x ((G-1) x 0.5 us along the chain inside a host +
  ceil(log2 H) x 5 us up and down the tree between hosts) -- log H, not N. (NCCL 2.23's
  PAT gives all-gather and reduce-scatter the same log-depth path across hosts.)
- **Overlap.** XLA:GPU's latency-hiding scheduler runs the parameters' collectives
  asynchronously beside compute: gradients' reductions beside the rest of the backward
  pass, FSDP's gathers ahead of the layers that need them. All but the last combined
  collective hide behind `overlap_fraction` of the compute time; the last one, issued when
  the backward pass ends, and whatever does not fit are exposed.

Per-device batch norm's running averages (`running_averages` in the op's name) feed
nothing in the step and are combined and hidden like the parameters' collectives.
Batch norm's forward statistics and tensor parallelism's partial sums are on the critical
path and always exposed. Batch norm's backward sums (`transpose(...)` in the op's name)
feed only the data gradient: the scheduler runs the weight gradient of the layer after it,
which does not wait for them, meanwhile -- each hides behind an equal share of half the
backward pass (a conv's backward is its data gradient and its weight gradient). Profiles without `combine_threshold_bytes` (the simulated CPU devices) are costed as
compiled: every collective its own ring, nothing hidden.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from jaxcnn.analysis.hardware import HardwareProfile
from jaxcnn.analysis.hlo import Collective, ring_wire_bytes, spanned_axes
from jaxcnn.models.batch_norm import RUNNING_SCOPE

# NCCL's latency model, low-latency protocol (nccl/src/graph/tuning.cc, baseLat and hwLat)
RING_BASE, RING_NVLINK_HOP, RING_NET_HOP = 3.6e-6, 0.4e-6, 0.9e-6
TREE_BASE, TREE_NVLINK_HOP, TREE_NET_HOP = 4.4e-6, 0.5e-6, 5.0e-6
OVERLAPPABLE = "param"  # jaxcnn.analysis.lint.classify's role for the parameters' collectives


@dataclass(frozen=True)
class CommTime:
    """A step's modelled communication: what stays on the critical path and what hides."""

    exposed_seconds: float  # added to the step
    hidden_seconds: float  # ran beside compute
    collectives: int  # as the cluster would run them (after combining)


def collective_seconds(kind: str, group: int, buffer_bytes: float, hosts: int, profile: HardwareProfile) -> float:
    """One collective of `buffer_bytes` over `group` devices on `hosts` hosts (1: inside one)."""
    if group <= 1:
        return 0.0
    per_host = max(1, group // hosts)
    if hosts > 1:
        bandwidth = min(profile.link_bytes_per_second, per_host * profile.network_bytes_per_second)
        slowest_hop = profile.network_hop_seconds
    else:
        bandwidth, slowest_hop = profile.link_bytes_per_second, profile.hop_seconds
    transfer = ring_wire_bytes(kind, group, buffer_bytes) / bandwidth
    if kind == "collective-permute":
        return slowest_hop + transfer
    rounds = 2 if kind == "all-reduce" else 1
    if profile.collective_algorithm != "nccl":
        return rounds * (group - 1) * slowest_hop + transfer
    crossing = rounds * (hosts - 1)
    ring = RING_BASE + (rounds * (group - 1) - crossing) * RING_NVLINK_HOP + crossing * RING_NET_HOP
    tree = TREE_BASE + rounds * ((per_host - 1) * TREE_NVLINK_HOP + math.ceil(math.log2(hosts)) * TREE_NET_HOP)
    return min(ring, tree) + transfer


def _hosts(c: Collective, mesh_shape: dict[str, int], across: dict[str, int]) -> int:
    return math.prod(across.get(a, 1) for a in spanned_axes(c, mesh_shape)) if across else 1


def step_comm(
    found: list[Collective],
    roles: list[str],
    profile: HardwareProfile,
    mesh_shape: dict[str, int],
    across: dict[str, int] | None,
    compute_seconds: float,
) -> CommTime:
    """The collectives of one step (`found`, with `classify`'s roles) on `profile`'s
    cluster, `across` giving each mesh axis's ways across hosts (module docstring)."""
    across = across or {}
    combining = profile.combine_threshold_bytes > 0
    critical, buckets = 0.0, defaultdict(float)  # (kind, group, hosts) -> bytes per call
    count, hidden = 0, 0.0
    backward_sums = [c for c, role in zip(found, roles, strict=True) if role == "statistics" and _backward(c)]
    # each backward sum's share of the weight gradients' half of the backward pass
    window = profile.overlap_fraction / 2 * compute_seconds / max(1, sum(c.repeats for c in backward_sums))
    for c, role in zip(found, roles, strict=True):
        hosts = _hosts(c, mesh_shape, across)
        if combining and (role == OVERLAPPABLE or RUNNING_SCOPE in c.line) and c.kind != "collective-permute":
            buckets[(c.kind, c.group_size, hosts)] += c.buffer_bytes * c.repeats
            continue
        seconds = collective_seconds(c.kind, c.group_size, c.buffer_bytes, hosts, profile)
        if role == "statistics" and _backward(c):
            hidden += c.repeats * min(seconds, window)
            seconds = max(0.0, seconds - window)
        critical += c.repeats * seconds
        count += c.repeats
    times = []
    for (kind, group, hosts), total in buckets.items():
        pieces = max(1, math.ceil(total / profile.combine_threshold_bytes))
        times += [collective_seconds(kind, group, total / pieces, hosts, profile)] * pieces
        count += pieces
    if not times:
        return CommTime(critical, hidden, count)
    background, last = sum(times) - max(times), max(times)
    behind = min(background, profile.overlap_fraction * compute_seconds)
    return CommTime(critical + last + background - behind, hidden + behind, count)


def _backward(c: Collective) -> bool:
    return "transpose(" in c.line
