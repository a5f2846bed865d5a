"""Named layouts: a parallel strategy is a rules table from logical axes to mesh axes.

A layout is data, not code. Adding a strategy means adding a `Layout` row to `LAYOUTS`
(or passing `--layout-rules`), never a new code path in the model or the trainer.

Rule semantics (applied by `jaxcnn.sharding.partition`):
- a logical name mapped to a mesh axis (or a tuple of axes) is split over it;
- mapped to None, it is replicated;
- absent from the table: parameters are replicated, activations are left to XLA's
  propagation (`PartitionSpec.UNCONSTRAINED`), so a table only has to name what it splits;
- the special key `params` is FSDP (ZeRO-3): every parameter of at least
  `fsdp_min_bytes` is also split over that mesh axis along its largest dimension the
  axis divides (and is not already split); optimizer state follows its parameter.

Notation (scaling book, "How to Scale Your Model"): `X[B_D,H,W,C]` is an activation
whose batch is split over mesh axis D(ata); M = model, S = spatial.
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
    # (collective kind, "param" | "activation") pairs the compiled train step may contain;
    # the lint reports any other (jaxcnn.sharding.lint). None: no expectation (user tables).
    expected_collectives: frozenset[tuple[str, str]] | None = None
    # FSDP threshold: smaller parameters stay replicated -- gathering a few KiB costs a
    # collective's fixed latency (~10 us on GPUs) and saves almost no memory.
    fsdp_min_bytes: int = 4096
    # Pipeline: the mesh axis whose indices are stages (jaxcnn.sharding.pipeline), else None.
    stage_axis: str | None = None

    def lookup(self, logical: str | None) -> tuple[bool, MeshAxes]:
        """(is the name in the table, the mesh axes it maps to)."""
        for name, target in self.rules:
            if name == logical:
                return True, target
        return False, None

    @property
    def optional_axes(self) -> tuple[str, ...]:
        """Axes a mesh may leave out: a pipeline runs with or without a data axis."""
        return tuple(a for a in self.mesh_axes if a != self.stage_axis) if self.stage_axis else ()

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Mesh axes the rules refer to, in first-use order."""
        seen: list[str] = [self.stage_axis] if self.stage_axis else []
        for _, target in self.rules:
            for axis in (target,) if isinstance(target, str) else (target or ()):
                if axis not in seen:
                    seen.append(axis)
        return tuple(seen)


REPLICATED_ACTIVATIONS: Rules = tuple((name, None) for name in (ax.HEIGHT, ax.WIDTH, ax.CHANNELS, ax.FEATURES))


def _expect(*pairs: str) -> frozenset[tuple[str, str]]:
    return frozenset(tuple(pair.split(":")) for pair in pairs)


SINGLE = Layout(
    name="single",
    rules=(),
    default_mesh="data=1",
    notation="X[B,H,W,C], W[Kh,Kw,Cin,Cout]",
    summary="one device, nothing split: the baseline every other layout must match",
    expected_collectives=frozenset(),
)

DP = Layout(
    name="dp",
    rules=((ax.BATCH, ax.DATA),),
    default_mesh="data=-1",
    notation="X[B_D,H,W,C], W[Kh,Kw,Cin,Cout] replicated",
    summary="data parallel: batch split over `data`, parameters replicated, gradients all-reduced",
    # gradients (one fused all-reduce), batch-norm statistics, the loss
    expected_collectives=_expect("all-reduce:param", "all-reduce:activation"),
)

FSDP = Layout(
    name="fsdp",
    # Activations pinned whole but for the batch: left free, XLA's propagation follows the
    # data-split kernels into the activations' channels, clashing with the batch split
    # (all-to-alls and activation all-gathers); pinned, it gathers the kernel instead.
    rules=((ax.BATCH, ax.DATA), (ax.PARAMS, ax.DATA), *REPLICATED_ACTIVATIONS),
    default_mesh="data=-1",
    notation="X[B_D,H,W,C], W[Kh,Kw,Cin,Cout_D] (largest divisible dim), optimizer state likewise",
    summary=(
        "fully sharded data parallel (ZeRO-3, the sharded parameter server): batch and every "
        "parameter >= 4 KiB split over `data`; parameters all-gathered for compute, gradients "
        "reduce-scattered back to their owners"
    ),
    # parameters gathered, gradients reduce-scattered (on CPU: all-reduced, then sliced);
    # small replicated tensors' gradients, BN statistics and the loss all-reduced
    expected_collectives=_expect(
        "all-gather:param", "reduce-scatter:param", "all-reduce:param", "all-reduce:activation"
    ),
)

# Tensor parallelism needs nothing but two rules because the model names its channel
# spaces so that consecutive layers alternate (jaxcnn.models): a column layer splits its
# output channels (conv_out / mlp), the next, a row layer, splits the same space as its
# input and ends in an all-reduce of partial sums. So no activation is ever all-gathered.
# With 3 conv blocks: block 0 replicated (its input is the image's 1-3 channels, too few to
# split), block 1 column, block 2 row; dense 0 column, dense 1 row, classifier replicated.
TP = Layout(
    name="tp",
    rules=((ax.CONV_OUT, ax.MODEL), (ax.MLP, ax.MODEL)),
    default_mesh="model=-1",
    notation="W1[Kh,Kw,Cin,Cout_M] -> X[B,H,W,C_M] -> W2[Kh,Kw,Cin_M,Cout] -> all-reduce; dense likewise",
    summary="tensor parallel: conv and dense kernels split column -> row over `model`, partial sums all-reduced",
    # partial sums (activations) all-reduced; batch-norm vectors (`norm`, replicated) of a
    # column layer are gathered from its split channels. Never an all-gather of activations.
    expected_collectives=_expect("all-reduce:activation", "all-reduce:param", "all-gather:param"),
)

HYBRID = Layout(
    name="hybrid",
    rules=((ax.BATCH, ax.DATA), (ax.CONV_OUT, ax.MODEL), (ax.MLP, ax.MODEL)),
    default_mesh="data=-1,model=2",
    notation="X[B_D,H,W,C], W1[...,Cout_M], W2[...,Cin_M,...]",
    summary="dp across `data`, tp inside `model`: gradients all-reduced over data, partial sums over model",
    expected_collectives=_expect("all-reduce:activation", "all-reduce:param", "all-gather:param"),
)

SPATIAL = Layout(
    name="spatial",
    # features=None: the flatten gathers the (small) last activation whole, so the dense
    # head runs data-parallel. Left free, XLA carries the height split into the flattened
    # features and splits the *dense kernel's gradient* instead -- gathering 100 MB per
    # step at 224x224 where the activation is 1.6 MB.
    rules=((ax.BATCH, ax.DATA), (ax.HEIGHT, ax.SPATIAL), (ax.FEATURES, None)),
    default_mesh="data=-1,spatial=2",
    notation="X[B_D,H_S,W,C], W replicated; 3x3 convs exchange one halo row each way",
    summary=(
        "spatial: image height split over `spatial` (batch over `data`); XLA exchanges halo rows "
        "between neighbours (collective-permute) before every 3x3 conv"
    ),
    # halos (permutes); gradients and BN statistics all-reduced over data x spatial;
    # heights that stop dividing after pooling, and the flatten, gathered whole again
    expected_collectives=_expect(
        "collective-permute:activation",
        "all-reduce:param",
        "all-reduce:activation",
        "all-gather:activation",
        "all-gather:param",
    ),
)

PIPELINE = Layout(
    name="pipeline",
    rules=((ax.BATCH, ax.DATA),),
    default_mesh="data=-1,stage=4",
    notation="stage s holds layers of group s; X[B_D,...] within a stage",
    summary=(
        "GPipe: consecutive layer groups on the `stage` axis, micro-batches streamed through them, "
        "dp inside each stage over `data` (jaxcnn.sharding.pipeline)"
    ),
    stage_axis=ax.STAGE,
)

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (SINGLE, DP, FSDP, TP, HYBRID, SPATIAL, PIPELINE)}


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
        if logical not in ax.RULE_KEYS:
            raise UserError(f"layout rule names unknown logical axis {logical!r}; use one of {', '.join(ax.RULE_KEYS)}")
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
