"""Named layouts: a parallel strategy is a rules table from logical axes to mesh axes.

A layout is data, not code. Adding a strategy means adding a `Layout` row to `LAYOUTS`
(or passing `--layout-rules`), never a new code path in the model or the trainer.

Rule semantics (applied by `jaxcnn.sharding.partition`):
- a logical name mapped to a mesh axis (or a tuple of axes) is split over it;
- mapped to None, it is replicated;
- absent from the table: parameters are replicated, activations are left to XLA's
  propagation (`PartitionSpec.UNCONSTRAINED`), so a table only has to name what it splits.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxcnn.errors import UserError
from jaxcnn.sharding import axes as ax

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]


@dataclass(frozen=True)
class Layout:
    """Mesh axes + a logical-axis rules table, and how to read it."""

    name: str
    rules: Rules
    default_mesh: str  # used when --mesh is not given; -1 fills the devices
    notation: str  # scaling-book notation of what is split
    summary: str

    def lookup(self, logical: str | None) -> tuple[bool, MeshAxes]:
        """(is the name in the table, the mesh axes it maps to)."""
        for name, target in self.rules:
            if name == logical:
                return True, target
        return False, None

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Mesh axes the rules refer to, in first-use order."""
        seen: list[str] = []
        for _, target in self.rules:
            for axis in (target,) if isinstance(target, str) else (target or ()):
                if axis not in seen:
                    seen.append(axis)
        return tuple(seen)


SINGLE = Layout(
    name="single",
    rules=(),
    default_mesh="data=1",
    notation="X[B,H,W,C], W[Kh,Kw,Cin,Cout]",
    summary="one device, nothing split: the baseline every other layout must match",
)

DP = Layout(
    name="dp",
    rules=((ax.BATCH, ax.DATA),),
    default_mesh="data=-1",
    notation="X[B_D,H,W,C], W[Kh,Kw,Cin,Cout] replicated",
    summary="data parallel: batch split over `data`, parameters replicated, gradients all-reduced",
)

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (SINGLE, DP)}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise UserError(f"unknown layout {name!r}; use one of {', '.join(LAYOUTS)}") from None


def parse_rules(text: str, name: str = "custom") -> Layout:
    """A user's table: "batch=data,conv_out=model" (`a+b` splits over two axes, `none` replicates)."""
    rules: list[tuple[str, MeshAxes]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        logical, sep, target_text = (s.strip() for s in item.partition("="))
        if not sep or not target_text:
            raise UserError(f"layout rule {item!r} needs the form LOGICAL=MESH_AXIS, e.g. batch=data")
        if logical not in ax.LOGICAL_AXES:
            raise UserError(
                f"layout rule names unknown logical axis {logical!r}; use one of {', '.join(ax.LOGICAL_AXES)}"
            )
        if any(logical == seen for seen, _ in rules):
            raise UserError(f"layout rules give logical axis {logical!r} twice")
        if target_text.lower() == "none":
            rules.append((logical, None))
            continue
        targets = tuple(t.strip() for t in target_text.split("+"))
        for axis in targets:
            if axis not in ax.MESH_AXES:
                raise UserError(
                    f"layout rule {item!r} names unknown mesh axis {axis!r}; use one of {', '.join(ax.MESH_AXES)}"
                )
        rules.append((logical, targets[0] if len(targets) == 1 else targets))
    if not rules:
        raise UserError(f"--layout-rules {text!r} holds no rule; write e.g. batch=data,conv_out=model")
    layout = Layout(name=name, rules=tuple(rules), default_mesh="", notation="user rules", summary=text)
    default = ",".join(f"{axis}={-1 if i == 0 else 1}" for i, axis in enumerate(layout.mesh_axes)) or "data=1"
    return Layout(**{**layout.__dict__, "default_mesh": default})
