"""Named layouts: a parallel strategy is a table from logical axes to mesh axes.

A layout is data, not code. Adding a strategy means adding a `Layout` to `LAYOUTS` (or
passing `--layout-rules`), never a new code path in the model or the trainer.

A table has three parts, applied by `jaxcnn.sharding.partition`:
- `params`: parameter logical axes (kh, conv_out, mlp, ...) -> the mesh axes they are
  split over; a name not in it is replicated;
- `activations`: activation logical axes (batch, height, ...) -> mesh axes; `()` pins
  one whole, and a name not in it is left to XLA's propagation (UNCONSTRAINED), so a
  table only has to name what it splits;
- `fsdp`: ZeRO-3 -- every parameter of at least `fsdp_min_bytes` is also split over these
  mesh axes along its largest dimension they divide (and that is not already split);
  optimizer state follows its parameter. For compute the parameters are gathered: that
  placement is `compute_layout()`, the same table without `fsdp`.

Notation (scaling book, "How to Scale Your Model"): `X[B_D,H,W,C]` is an activation
whose batch is split over mesh axis D(ata); M = model, S = spatial.
- single:   X[B,H,W,C], W[Kh,Kw,Cin,Cout] -- the baseline every layout must match
- dp:       X[B_D,H,W,C], W replicated, gradients all-reduced
- fsdp:     X[B_D,H,W,C], W[Kh,Kw,Cin,Cout_D] (largest divisible dim), optimizer state likewise
- tp:       W1[Kh,Kw,Cin,Cout_M] -> X[B,H,W,C_M] -> W2[Kh,Kw,Cin_M,Cout] -> all-reduce; dense likewise
- hybrid:   dp's table and tp's together: X[B_D,...], W1[...,Cout_M], W2[...,Cin_M,...]
- spatial:  X[B_D,H_S,W,C], W replicated; 3x3 convs exchange one halo row each way
- pipeline: stage s holds the layers of group s (jaxcnn.pipeline); X[B_D,...] within a stage
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jaxcnn.errors import UserError
from jaxcnn.sharding import axes as ax

MeshAxes = tuple[str, ...]  # () = not split (replicated / pinned whole)
Table = tuple[tuple[str, MeshAxes], ...]


@dataclass(frozen=True)
class Layout:
    """A typed rules table (module docstring) and what the lint may expect of it."""

    name: str
    params: Table = ()
    activations: Table = ()
    fsdp: MeshAxes = ()
    default_mesh: str = "data=1"  # used when --mesh is not given; -1 fills the devices
    # (collective kind, "param" | "activation") pairs the compiled train step may contain;
    # the lint reports any other (jaxcnn.analysis.lint). None: no expectation (user tables).
    expected_collectives: frozenset[tuple[str, str]] | None = None
    # FSDP threshold: smaller parameters stay replicated -- gathering a few KiB costs a
    # collective's fixed latency (~10 us on GPUs) and saves almost no memory.
    fsdp_min_bytes: int = 4096
    # Pipeline: the mesh axis whose indices are stages (jaxcnn.pipeline), else None.
    stage_axis: str | None = None

    def axes_for(self, logical: str | None) -> MeshAxes | None:
        """The mesh axes a logical axis is split over; () whole; None: not in the table."""
        for name, axes in (*self.params, *self.activations):
            if name == logical:
                return axes
        return None

    def degree(self, logical: str, mesh_shape: dict[str, int]) -> int:
        """Into how many parts `logical` is split on a mesh of this shape."""
        degree = 1
        for axis in self.axes_for(logical) or ():
            degree *= mesh_shape.get(axis, 1)
        return degree

    def compute_layout(self) -> Layout:
        """Where parameters live while computing: FSDP's split undone (gathered)."""
        return replace(self, fsdp=())

    def with_batch_axes(self, axes: MeshAxes) -> Layout:
        """The same table with the batch split over `axes` instead (a table that leaves the
        batch to XLA keeps doing so when there is nothing left to split it over)."""
        if not axes and self.axes_for(ax.BATCH) is None:
            return self
        return replace(self, activations=_set(self.activations, ax.BATCH, axes))

    @property
    def rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """The table as the user writes it (`--layout-rules`): name -> axis, axes or None."""
        flat = (*self.params, *((ax.PARAMS, self.fsdp),) * bool(self.fsdp), *self.activations)
        return tuple((name, axes[0] if len(axes) == 1 else (axes or None)) for name, axes in flat)

    @property
    def mesh_axes(self) -> MeshAxes:
        """Mesh axes the table refers to, in first-use order: the stage axis, then the
        activations' (the batch's first), the parameters', FSDP's."""
        seen = [self.stage_axis] if self.stage_axis else []
        for _, axes in (*self.activations, *self.params, ("", self.fsdp)):
            seen += [a for a in axes if a not in seen]
        return tuple(seen)

    @property
    def optional_axes(self) -> MeshAxes:
        """Axes a mesh may leave out: a pipeline runs with or without a data axis."""
        return tuple(a for a in self.mesh_axes if a != self.stage_axis) if self.stage_axis else ()


def _set(table: Table, name: str, axes: MeshAxes) -> Table:
    """`table` with `name` mapped to `axes` (replaced where present, else added)."""
    return tuple({**dict(table), name: axes}.items())


def compose(name: str, *layouts: Layout, default_mesh: str, expected: frozenset | None = None) -> Layout:
    """One table holding every rule of `layouts` (a logical axis given two ways is an error)."""
    params: dict[str, MeshAxes] = {}
    activations: dict[str, MeshAxes] = {}
    for layout in layouts:
        for table, into in ((layout.params, params), (layout.activations, activations)):
            for logical, axes in table:
                if into.setdefault(logical, axes) != axes:
                    raise ValueError(f"{name}: {logical} is split over {into[logical]} and {axes}")
    fsdp = tuple(dict.fromkeys(a for layout in layouts for a in layout.fsdp))
    return Layout(name, tuple(params.items()), tuple(activations.items()), fsdp, default_mesh, expected)


def _expect(*pairs: str) -> frozenset[tuple[str, str]]:
    return frozenset(tuple(pair.split(":")) for pair in pairs)


# Batch norm over a split batch: its statistics' one all-reduce forward and one backward
# per layer (jaxcnn.models.batch_norm).
NORM_STATISTICS = _expect("all-reduce:statistics")

SINGLE = Layout(name="single", default_mesh="data=1", expected_collectives=frozenset())

DP = Layout(
    name="dp",
    activations=((ax.BATCH, (ax.DATA,)),),
    default_mesh="data=-1",
    # gradients (fused all-reduces), batch-norm statistics, the loss
    expected_collectives=_expect("all-reduce:param", "all-reduce:activation") | NORM_STATISTICS,
)

FSDP = Layout(
    name="fsdp",
    # Activations pinned whole but for the batch: left free, XLA's propagation follows the
    # data-split kernels into the activations' channels, clashing with the batch split
    # (all-to-alls and activation all-gathers); pinned, it gathers the kernel instead.
    activations=((ax.BATCH, (ax.DATA,)), *((name, ()) for name in (ax.HEIGHT, ax.WIDTH, ax.CHANNELS, ax.FEATURES))),
    fsdp=(ax.DATA,),
    default_mesh="data=-1",
    # parameters gathered, gradients reduce-scattered (on CPU: all-reduced, then sliced);
    # small replicated tensors' gradients and the loss all-reduced; BN statistics
    expected_collectives=_expect(
        "all-gather:param", "reduce-scatter:param", "all-reduce:param", "all-reduce:activation"
    )
    | NORM_STATISTICS,
)

# Tensor parallelism needs nothing but two rules because the model names its channel
# spaces so that consecutive layers alternate (jaxcnn.models): a column layer splits its
# output channels (conv_out / mlp), the next, a row layer, splits the same space as its
# input and ends in an all-reduce of partial sums. So no activation is ever all-gathered.
# With 3 conv blocks: block 0 replicated (its input is the image's 1-3 channels, too few to
# split), block 1 column, block 2 row; dense 0 column, dense 1 row, classifier replicated.
TP_COLLECTIVES = _expect("all-reduce:activation", "all-reduce:param", "all-gather:param")
TP = Layout(
    name="tp",
    params=((ax.CONV_OUT, (ax.MODEL,)), (ax.MLP, (ax.MODEL,))),
    default_mesh="model=-1",
    # partial sums (activations) all-reduced; batch-norm vectors (`norm`, replicated) of a
    # column layer are gathered from its split channels. Never an all-gather of activations.
    expected_collectives=TP_COLLECTIVES,
)

# dp across `data`, tp inside `model`: gradients all-reduced over data, partial sums over model
HYBRID = compose("hybrid", DP, TP, default_mesh="data=-1,model=2", expected=TP_COLLECTIVES | NORM_STATISTICS)

SPATIAL = Layout(
    name="spatial",
    # features=(): the flatten gathers the (small) last activation whole, so the dense
    # head runs data-parallel. Left free, XLA carries the height split into the flattened
    # features and splits the *dense kernel's gradient* instead -- gathering 100 MB per
    # step at 224x224 where the activation is 1.6 MB.
    activations=((ax.BATCH, (ax.DATA,)), (ax.HEIGHT, (ax.SPATIAL,)), (ax.FEATURES, ())),
    default_mesh="data=-1,spatial=2",
    # halos (permutes); gradients all-reduced over data x spatial, BN statistics likewise;
    # heights that stop dividing after pooling, and the flatten, gathered whole again
    expected_collectives=_expect(
        "collective-permute:activation",
        "all-reduce:param",
        "all-reduce:activation",
        "all-gather:activation",
        "all-gather:param",
    )
    | NORM_STATISTICS,
)

# GPipe: consecutive layer groups on the `stage` axis, micro-batches streamed through them,
# dp inside each stage over `data` (jaxcnn.pipeline)
PIPELINE = Layout(name="pipeline", activations=DP.activations, default_mesh="data=-1,stage=4", stage_axis=ax.STAGE)

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (SINGLE, DP, FSDP, TP, HYBRID, SPATIAL, PIPELINE)}


def get_layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise UserError(f"unknown layout {name!r}; use one of {', '.join(LAYOUTS)}") from None


def parse_rules(text: str, name: str = "custom") -> Layout:
    """A user's table: "batch=data,conv_out=model" (`a+b` splits over two axes, `none`
    replicates, `params=data` is FSDP over data)."""
    params: list[tuple[str, MeshAxes]] = []
    activations: list[tuple[str, MeshAxes]] = []
    fsdp: MeshAxes = ()
    seen: set[str] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        logical, sep, target_text = (s.strip() for s in item.partition("="))
        if not sep or not target_text:
            raise UserError(f"layout rule {item!r} needs the form LOGICAL=MESH_AXIS, e.g. batch=data")
        if logical not in ax.RULE_KEYS:
            raise UserError(f"layout rule names unknown logical axis {logical!r}; use one of {', '.join(ax.RULE_KEYS)}")
        if logical in seen:
            raise UserError(f"layout rules give logical axis {logical!r} twice")
        seen.add(logical)
        targets = () if target_text.lower() == "none" else tuple(t.strip() for t in target_text.split("+"))
        for axis in targets:
            if axis not in ax.MESH_AXES:
                raise UserError(
                    f"layout rule {item!r} names unknown mesh axis {axis!r}; use one of {', '.join(ax.MESH_AXES)}"
                )
        if logical == ax.PARAMS:
            fsdp = targets
        else:
            (params if logical in ax.PARAM_AXES else activations).append((logical, targets))
    if not seen:
        raise UserError(f"--layout-rules {text!r} holds no rule; write e.g. batch=data,conv_out=model")
    # the default mesh: the axes in the order written, every device on the first
    written = {axis for _, axes in (*params, *activations, ("", fsdp)) for axis in axes}
    named = (axis.strip() for item in text.split(",") for axis in item.partition("=")[2].split("+"))
    order = [axis for axis in dict.fromkeys(named) if axis in written]
    default = ",".join(f"{axis}={-1 if i == 0 else 1}" for i, axis in enumerate(order))
    return Layout(name, tuple(params), tuple(activations), fsdp, default_mesh=default or "data=1")
