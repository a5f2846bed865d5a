"""The collectives XLA put in a compiled program, read from its optimized HLO text.

Collectives appear only after `.compile()` (GSPMD partitions late), so everything here
reads the optimized HLO text of a compiled executable. Both HLO dialects are handled:
CPU's synchronous ops (`all-reduce(...)`) and GPU's async pairs (`all-reduce-start` ...
`-done`, whose results are tuples); each collective is counted once, at its start.

Byte convention: `buffer_bytes` is the size, on one device, of the logical buffer the
collective works on -- the reduced array for all-reduce, the *gathered* (full) array for
all-gather, the *unscattered* (full) input for reduce-scatter, the sent array for
collective-permute and all-to-all. `wire_bytes` is what one device sends on a ring
(Patarasuk & Yuan 2009; "How to Scale Your Model", ch. 3): all-reduce 2(N-1)/N x buffer,
all-gather and reduce-scatter (N-1)/N x buffer, all-to-all (N-1)/N x buffer, permute the
buffer itself.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
# `%name = <result type> kind(<operands>), attributes` -- kind optionally with -start.
_OP = re.compile(
    r"=\s*(?P<result>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<operands>[^)]*)\)(?P<attrs>,.*)?$"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
# newer XLA: replica_groups=mesh['data'=4,'model'=2] {'model'} (a sub-axis prints as 'spatial':(1)2)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{([0-9,{}]*)\}")


@dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    group_size: int  # devices taking part together (N)
    buffer_bytes: int  # per device, see the module docstring
    dtype: str
    shapes: tuple[tuple[int, ...], ...]  # per-device result arrays
    line: str  # the HLO instruction, for the lint's messages
    repeats: int = 1  # times it runs per call of the program: inside a while loop, its trip count

    @property
    def wire_bytes(self) -> float:
        return ring_wire_bytes(self.kind, self.group_size, self.buffer_bytes)

    @property
    def step_bytes(self) -> int:
        """buffer_bytes x repeats: what it moves per call of the program."""
        return self.buffer_bytes * self.repeats

    @property
    def step_wire_bytes(self) -> float:
        return self.wire_bytes * self.repeats

    @property
    def hops(self) -> int:
        """Latency-bound steps of the ring algorithm: each pays a link's latency once."""
        if self.kind == "collective-permute":
            return 1
        return 2 * (self.group_size - 1) if self.kind == "all-reduce" else self.group_size - 1


def ring_wire_bytes(kind: str, group_size: int, buffer_bytes: float) -> float:
    """Bytes one device sends for a collective on a ring of `group_size` (module docstring)."""
    n = group_size
    if kind == "all-reduce":
        return 2 * (n - 1) / n * buffer_bytes
    if kind == "collective-permute":
        return float(buffer_bytes)
    return (n - 1) / n * buffer_bytes


def _arrays_bytes(text: str) -> tuple[int, str]:
    """Total bytes of the array types in an HLO type string, and the first dtype."""
    total, first = 0, ""
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _DTYPE_BYTES[dtype]
        first = first or dtype
    return total, first


def _group_size(attrs: str, num_devices: int) -> int:
    if match := _GROUPS_MESH.search(attrs):
        sizes = {k.strip("'"): int(v) for k, v in re.findall(r"('[^']+')=(\d+)", match.group(1))}
        size = 1
        for axis in filter(None, (a.strip() for a in match.group(2).split(","))):
            name, _, sub = axis.partition(":")
            size *= int(sub.split(")")[1]) if sub else sizes[name.strip("'")]
        return size
    if match := _GROUPS_IOTA.search(attrs):
        return int(match.group(2))
    return len(_first_group(attrs, num_devices)) or num_devices  # lists, permutes' pairs, {} (every device)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations|called_computations)=(\{[^}]*\}|[^,\s]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _repeats(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry: a while body runs its
    known trip count (1 if XLA does not know it) times per run of its caller."""
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if (header := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
            current = header.group(1)
            calls.setdefault(current, [])
            entry = current if line.startswith("ENTRY") else entry
            continue
        if current is None or "=" not in line:
            continue
        trip = int(m.group(1)) if " while(" in line and (m := _TRIP_COUNT.search(line)) else 1
        for group in _CALLEE.findall(line):
            for name in re.findall(r"%?([\w.\-]+)", group):
                body = f"body=%{name}" in line or f"body={name}" in line
                calls[current].append((name, trip if body else 1))
    repeats: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        repeats[name] = repeats.get(name, 0) + times
        for callee, factor in calls.get(name, ()):
            visit(callee, times * factor)

    if entry is not None:
        visit(entry, 1)
    return repeats


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective in optimized HLO text (`compiled.as_text()`), in program order,
    each with how many times it runs per call (`repeats`: loops run their bodies)."""
    found = []
    repeats, current = _repeats(hlo_text), None
    for line in hlo_text.splitlines():
        if (header := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
            current = header.group(1)
            continue
        match = _OP.search(line)
        if match is None:
            continue
        kind, attrs = match.group("kind"), match.group("attrs") or ""
        group = _group_size(attrs, num_devices)
        arrays = _ARRAY.findall(match.group("result"))
        if match.group("start"):
            # async starts return (inputs..., outputs..., [u32 contexts]): keep the outputs
            arrays = [a for a in arrays if a[1]] if kind == "collective-permute" else arrays
            arrays = arrays[len(arrays) // 2 :] if kind in ("all-gather", "collective-permute") else arrays
        result_bytes, dtype = _arrays_bytes(" ".join(f"{t}[{d}]" for t, d in arrays))
        # the result is the buffer, except for reduce-scatter, whose result is one shard
        buffer = result_bytes * group if kind == "reduce-scatter" else result_bytes
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
        found.append(Collective(kind, group, buffer, dtype, shapes, line.strip(), max(repeats.get(current, 1), 1)))
    return found


def collective_summary(found: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {count, buffer_bytes, wire_bytes}} for every kind (zeros where absent)."""
    summary = {kind: {"count": 0, "buffer_bytes": 0, "wire_bytes": 0.0} for kind in KINDS}
    for c in found:
        entry = summary[c.kind]
        entry["count"] += c.repeats
        entry["buffer_bytes"] += c.step_bytes
        entry["wire_bytes"] += c.step_wire_bytes
    return summary


def kinds_seen(found: list[Collective]) -> Counter:
    return Counter(c.kind for c in found)


# Instructions that launch no kernel of their own: bookkeeping, control flow (their bodies
# are counted), and the second half of an asynchronous pair.
NOT_KERNELS = frozenset(
    [
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "call",
        "conditional",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "all-reduce-done",
        "all-gather-done",
        "collective-permute-done",
        "copy-done",
        "send-done",
        "recv-done",
        "async-done",
    ]
)
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")


def kernel_count(hlo_text: str) -> int:
    """Kernels one call of a compiled program launches: the instructions of its entry
    computation and of the computations it calls, loops' bodies and conditionals' branches
    (each counted once, as collectives are), fusions as one -- the fixed per-kernel cost a
    step pays however little each kernel computes."""
    text = re.sub(r"/\*.*?\*/", "", hlo_text)  # XLA's /*index=5*/ markers in long tuples
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))  # loops; calls and branches below
    bodies |= set(re.findall(r"\bcall\(.*?to_apply=%?([\w.\-]+)", text))
    for branches in re.findall(r"branch_computations=\{([^}]*)\}", text):
        bodies |= set(re.findall(r"%?([\w.\-]+)", branches))
    count, counting = 0, False
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            counting = line.startswith("ENTRY") or name.lstrip("%") in bodies
            continue
        match = _OPCODE.match(line) if counting else None
        if match and match.group(1) not in NOT_KERNELS:
            count += 1
    return count


_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH_AXIS = re.compile(r"'([^']+)'(?::\(\d+\)\d+)?")


def _first_group(attrs: str, num_devices: int) -> list[int]:
    """The device positions (in the mesh's order) of a collective's first group."""
    if match := _IOTA.search(attrs):
        groups, size = int(match.group(1)), int(match.group(2))
        dims = [int(d) for d in match.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(4):
            ids = ids.transpose([int(p) for p in match.group(4).split(",")])
        return ids.reshape(groups, size)[0].tolist()
    if match := _GROUPS_LIST.search(attrs):
        return [int(d) for d in match.group(1).split("}")[0].strip("{").split(",") if d]
    if match := _PAIRS.search(attrs):
        return [int(d) for d in match.group(1).split("}")[0].strip("{").split(",") if d]
    return list(range(num_devices))  # replica_groups={}: every device


def spanned_axes(collective: Collective, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective's groups run along: named by XLA's mesh form of
    `replica_groups`, else those along which its first group's devices differ."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if match := _GROUPS_MESH.search(collective.line):
        printed = re.findall(r"'([^']+)'=\d+", match.group(1))
        spanned = _MESH_AXIS.findall(match.group(2))
        if len(printed) == len(names):  # XLA may print its own names ('axis_0'): the same axes, in order
            return tuple(names[printed.index(a)] for a in spanned)
    members = _first_group(collective.line, math.prod(sizes))
    coords = np.array(np.unravel_index(members, sizes))
    return tuple(name for name, row in zip(names, coords, strict=True) if len(set(row.tolist())) > 1)
