"""Sharding lint: where every parameter went, which rules did nothing, which collectives
the compiled step contains that its layout did not expect.

    print(format_report(lint_program(program)))

The collective check classifies each collective by what it moves: `statistics` when batch
norm's statistics code emitted it (its named scope), `param` when every array it returns
has the shape of a parameter or of one device's shard of one (up to a transposed layout;
scalars are neutral), `activation` otherwise. A layout declares the
(kind, role) pairs it expects; anything else is reported, e.g. an all-gather of
activations under `tp`, which means two consecutive layers split the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jax.sharding import Mesh, NamedSharding

from jaxcnn.analysis.cost import program_collectives
from jaxcnn.analysis.hlo import Collective
from jaxcnn.models.batch_norm import STATISTICS_SCOPE
from jaxcnn.program import Program
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import ParamPlacement

# Activation names the CNN family constrains at block boundaries (jaxcnn.models).
MODEL_ACTIVATION_NAMES = frozenset(ax.IMAGE_BHWC + ax.FEATURES_BF)


@dataclass
class ShardingReport:
    layout: Layout
    mesh_shape: dict[str, int]
    placements: list[ParamPlacement]
    warnings: list[str] = field(default_factory=list)
    collectives: list[Collective] | None = None  # None: not compiled
    roles: list[str] = field(default_factory=list)  # "statistics" | "param" | "activation", per collective

    @property
    def bytes_per_device(self) -> int:
        return sum(p.bytes_per_device for p in self.placements)


def spec_text(spec) -> str:
    parts = []
    for entry in spec:
        if entry is None:
            parts.append("-")
        elif isinstance(entry, tuple):
            parts.append("+".join(entry))
        else:
            parts.append(str(entry))
    return "(" + ", ".join(parts) + ")"


def rule_warnings(layout: Layout, mesh_shape: dict[str, int], placements: list[ParamPlacement]) -> list[str]:
    """Rules that matched no name, rules over a 1-device axis, and every fallback."""
    used_names = {name for p in placements for name in p.logical if name} | MODEL_ACTIVATION_NAMES
    found = []
    for logical, targets in (*layout.params, *layout.activations, *((ax.PARAMS, layout.fsdp),) * bool(layout.fsdp)):
        if logical != ax.PARAMS and logical not in used_names:
            found.append(
                f"rule {logical}={'+'.join(targets) or 'none'} matched nothing: no parameter or activation is named {logical!r}"
            )
            continue
        for axis in targets:
            if mesh_shape.get(axis, 1) == 1:
                found.append(f"rule {logical}={axis} does nothing on this mesh: axis {axis!r} has size 1")
    for placement in placements:
        found += [note for note in placement.notes if not note.startswith("no logical")]
    return found


def _shape_key(shape) -> tuple[int, ...]:
    return tuple(sorted(shape))  # XLA may return a transposed layout of the same buffer


def classify(found: list[Collective], placements: list[ParamPlacement], mesh: Mesh) -> list[str]:
    """ "statistics", "param" or "activation" for every collective (the module docstring)."""
    shapes = set()
    for p in placements:
        shapes.add(_shape_key(p.shape))
        shapes.add(_shape_key(NamedSharding(mesh, p.spec).shard_shape(p.shape)))
    roles = []
    for c in found:
        arrays = [s for s in c.shapes if s]  # scalars (the loss, step counts) say nothing
        # XLA's combiner may fuse batch norm's backward sums into the gradients' reduction,
        # which then carries one op's name: with a kernel's gradient in it, it is that
        kernels = [s for s in arrays if len(s) > 1 and _shape_key(s) in shapes]
        if STATISTICS_SCOPE in c.line and not kernels:
            roles.append("statistics")
            continue
        roles.append("param" if arrays and all(_shape_key(s) in shapes for s in arrays) else "activation")
    return roles


def collective_warnings(layout: Layout, found: list[Collective], roles: list[str]) -> list[str]:
    if layout.expected_collectives is None:
        return []
    unexpected: dict[tuple[str, str], list[Collective]] = {}
    for c, role in zip(found, roles, strict=True):
        if (c.kind, role) not in layout.expected_collectives:
            unexpected.setdefault((c.kind, role), []).append(c)
    return [
        f"layout {layout.name} did not expect {len(cs)} {kind} of {role}s "
        f"({sum(c.buffer_bytes for c in cs):,} bytes per device), e.g. {cs[0].shapes}"
        for (kind, role), cs in unexpected.items()
    ]


def lint(
    layout: Layout, mesh: Mesh, placements: list[ParamPlacement], found: list[Collective] | None = None
) -> ShardingReport:
    """The report for a placement; give the collectives a step runs to check them too."""
    report = ShardingReport(layout, dict(mesh.shape), placements)
    report.warnings = rule_warnings(layout, report.mesh_shape, placements)
    if found is not None:
        report.collectives = found
        report.roles = classify(found, placements, mesh)
        report.warnings += collective_warnings(layout, found, report.roles)
    return report


def lint_program(program: Program) -> ShardingReport:
    """The report for a compiled program: its placements and every collective of one step."""
    return lint(program.layout, program.mesh, program.anatomy.placements, program_collectives(program))


def format_report(report: ShardingReport) -> str:
    rows = [("parameter", "logical names", "shape", "spec", "bytes/device")]
    for p in report.placements:
        names = "(" + ", ".join(n or "-" for n in p.logical) + ")"
        rows.append(
            (p.path, names, "x".join(map(str, p.shape)) or "scalar", spec_text(p.spec), f"{p.bytes_per_device:,}")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"shardings for layout {report.layout.name} on mesh "
        + ",".join(f"{k}={v}" for k, v in report.mesh_shape.items())
    ]
    for i, row in enumerate(rows):
        lines.append(
            "  "
            + "  ".join(
                cell.ljust(w) if j < 4 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    lines.append(f"  total parameter and statistics bytes per device: {report.bytes_per_device:,}")
    if report.collectives is not None:
        lines.append("collectives in the compiled train step (per device):")
        tally: dict[tuple[str, str], list[Collective]] = {}
        for c, role in zip(report.collectives, report.roles, strict=True):
            tally.setdefault((c.kind, role), []).append(c)
        if not tally:
            lines.append("  none")
        for (kind, role), cs in sorted(tally.items()):
            lines.append(f"  {kind:<19} of {role}s: {len(cs):>3} x, {sum(c.buffer_bytes for c in cs):>12,} bytes")
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)


def golden_table(report: ShardingReport) -> dict[str, dict]:
    """The JSON-able form tests compare against: path -> logical names, shape, spec."""
    return {
        p.path: {
            "logical": list(p.logical),
            "shape": list(p.shape),
            "spec": spec_text(p.spec),
            "bytes_per_device": p.bytes_per_device,
        }
        for p in report.placements
    }
