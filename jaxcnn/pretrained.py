"""Pretrained weights in, and out: a safetensors file in torchvision's (or timm's) names mapped
onto a model's parameters and batch-norm statistics (`--init-from FILE`), and a model written
back in those names.

    plan = read_plan(model_config, image_shape, "resnet18.safetensors")   # checks names and shapes
    state, said = load_pretrained(program, program.init(), plan)          # each shard where it lives
    save_pretrained("out.safetensors", program.model_variables(state), model_config)
    save_run_weights("runs/my-run", "my-run.safetensors")                 # a finished run's model

Names: torchvision's state_dict keys for the ResNets, ConvNeXt and MobileNetV2, timm's for
ConvNeXt (jaxcnn.models.torchvision_names), and for every family (the CNN family has no
torchvision twin) jaxcnn's own: the state's paths with dots, "blocks.0.conv.kernel", arrays
as jaxcnn holds them (kernels HWIO). The file's scheme is the one sharing most names with it.
`num_batches_tracked` is skipped (jaxcnn's batch-norm momentum is fixed).

A classifier whose class count differs from the model's keeps its fresh initialisation (and
the run says so); any other mismatch -- a name missing or unexpected, a shape -- is one
UserError naming the first offender and what the file holds.

Placement: the file is read one tensor at a time (`safe_open`), and each array of the
state is built by `jax.make_array_from_callback` in the sharding the layout gave it, each
device taking its slice; the freshly initialised array it replaces is freed at once. So no
device holds more than its share of the state plus one parameter's, whatever the layout
(a pipeline's state is handled in its whole-model form, `program.saved_form`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxcnn import runs
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import CustomModel, build_model, layer_shapes
from jaxcnn.models.torchvision_names import SKIPPED, TRANSFORMS, name_schemes, torch_shape
from jaxcnn.saved_model import ModelVariables, flat_variables, model_template, path_key, restore_model
from jaxcnn.sharding import build_mesh
from jaxcnn.sharding.layouts import SINGLE

JAXCNN_SCHEME = "jaxcnn"
FLAG = "--init-from"
# a name in a file -> the model it most likely came from (for a mismatch's message)
LIKELY = (
    ("layer1.0.conv3.weight", "a resnet50 file"),
    ("layer1.0.conv1.weight", "a resnet18/34 file"),
    (".block.0.weight", "a torchvision convnext file"),
    (".conv_dw.weight", "a timm convnext file"),
    ("features.1.conv.0.0.weight", "a mobilenet_v2 file"),
    ("conv_stem.weight", "a timm efficientnet/mobilenet file"),
    (".kernel", "a file in jaxcnn's own names"),
)


@dataclass(frozen=True)
class Plan:
    """What loads where: file key -> (state path, TRANSFORMS entry), the classifier's keys
    left at their initialisation, and the line that says so."""

    file: Path
    scheme: str
    keys: dict[str, tuple[str, str]]
    head_reinit: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


def model_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> dict[str, tuple[int, ...]]:
    """Every parameter's and statistic's path -> its shape, without allocating."""
    _, params, stats = nnx.split(nnx.eval_shape(lambda: build_model(config, image_shape, 0)), nnx.Param, ...)
    flat = [*nnx.to_flat_state(params), *nnx.to_flat_state(stats)]
    return {"/".join(map(str, path)): tuple(v.shape) for path, v in flat}


def schemes(config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, str]:
    """The naming schemes the model's weights may come in ({scheme: {key: (path, how)}},
    jaxcnn's own last), and why torchvision's is not among them, if it is not."""
    try:
        named = name_schemes(config)
    except UserError as err:  # torchvision's ResNets and MobileNetV2 need batch norm
        named, why = {}, str(err)
    else:
        why = ""
    own = {path.replace("/", "."): (path, "vector") for path in shapes}  # "vector": taken as it is
    return {**named, JAXCNN_SCHEME: own}, why


def _holds(names: list[str]) -> str:
    """What the file holds, by a telling name: "62 tensors named like 'layer1.0.conv1.weight': a resnet18/34 file?"."""
    for pattern, guess in LIKELY:
        if example := next((n for n in names if pattern in n), None):
            return f"the file holds {len(names)} tensors named like {example!r}: {guess}?"
    return f"the file holds {len(names)} tensors named like {names[0]!r}"


def _read_shapes(file: Path, where: str) -> dict[str, tuple[int, ...]]:
    """The file's tensor names and shapes, from its header."""
    try:
        with safe_open(file, framework="numpy") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except FileNotFoundError:
        raise UserError(f"{where}: no such file") from None
    except (SafetensorError, OSError) as err:
        raise UserError(f"{where}: not a readable safetensors file ({str(err).splitlines()[0][:120]})") from None


def _only_classes_differ(how: str, want: tuple, have: tuple) -> bool:
    """A classifier's array that differs from the model's in its class count alone."""
    axis = 0 if how == "linear" else len(want) - 1  # torch's Linear is (out, in); jaxcnn's kernel (in, out)
    if len(want) != len(have):
        return False
    return all(a == b for i, (a, b) in enumerate(zip(want, have, strict=True)) if i != axis)


def read_plan(config: ModelConfig, image_shape: tuple[int, int, int], file: str | Path) -> Plan:
    """Check `file`'s names and shapes against the model (its header only) and say what
    loads where; a mismatch is one UserError."""
    file = Path(file)
    where = f"{FLAG} {file}"
    if isinstance(config, CustomModel):
        raise UserError(f"{where}: loads jaxcnn's model families, not a model of your own")
    found = _read_shapes(file, where)
    names = [key for key in found if not key.endswith(SKIPPED)]
    if not names:
        raise UserError(f"{where}: the file holds no tensors")
    shapes = model_shapes(config, image_shape)
    options, why_not = schemes(config, shapes)
    scheme = max(options, key=lambda s: len(found.keys() & options[s].keys()))  # ties: the first listed
    keys = options[scheme]
    missing = next((k for k in keys if k not in found), None)
    if missing is not None:
        raise UserError(f"{where}: missing {missing!r} ({_holds(names)})" + (f"; {why_not}" if why_not else ""))
    unexpected = next((k for k in names if k not in keys), None)
    if unexpected is not None:
        raise UserError(f"{where}: unexpected {unexpected!r} ({_holds(names)}; {config.name} has {len(keys)} "
                        f"tensors in {scheme} names)")  # fmt: skip
    head = layer_shapes(config, image_shape)[-1].path + "/"  # the classifier
    reinit = []
    for key, (path, how) in keys.items():
        want = torch_shape(how, shapes[path])
        if found[key] == want or (how == "linear" and found[key] == (*want, 1, 1)):  # timm's 1x1-conv MLPs
            continue
        if not (path.startswith(head) and _only_classes_differ(how, want, found[key])):
            raise UserError(f"{where}: {key!r} is {found[key]} in the file, {config.name} here needs {want} "
                            f"({_holds(names)})")  # fmt: skip
        reinit.append(key)
    notes = []
    if reinit:
        notes.append(f"{where}: the file's classifier is not for {config.num_classes} classes "
                     f"({reinit[0]} is {found[reinit[0]]}): {', '.join(reinit)} re-initialised")  # fmt: skip
    return Plan(file, scheme, keys, tuple(reinit), notes)


def load_pretrained(program, state, plan: Plan):
    """`state` (a fresh one, `program.init()`) with the file's parameters and statistics,
    one tensor at a time, each in its place under the program's layout."""
    wanted = {path: (key, how) for key, (path, how) in plan.keys.items() if key not in plan.head_reinit}
    whole = program.saved_form(state)  # a pipeline's per-stage state as the whole model's (no copies)
    with safe_open(plan.file, framework="numpy") as f:

        def one(path, leaf):
            if (found := wanted.get(path_key(path))) is None:
                return leaf
            key, how = found
            old = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            tensor = TRANSFORMS[how](f.get_tensor(key)).astype(old.dtype)  # one parameter in flight
            # a leading replica dim (local SGD) broadcasts: every replica starts from the file
            new = jax.make_array_from_callback(
                old.shape, old.sharding, lambda index: np.broadcast_to(tensor, old.shape)[index]
            )
            old.delete()  # the fresh initialisation's shard goes before the next is read
            return leaf.replace(new) if isinstance(leaf, nnx.Variable) else new

        def fill(tree):
            return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

        whole = whole._replace(
            params=fill(whole.params),
            model_state=fill(whole.model_state),
            history=tuple(fill(h) for h in whole.history),  # stale gradients' shift register starts alike
        )
    return program.from_saved(whole)


def save_pretrained(
    file: str | Path, variables: ModelVariables, config: ModelConfig, scheme: str = "torchvision"
) -> Path:
    """Write the model's parameters and statistics to a safetensors file in `scheme`'s names
    ("torchvision", "timm" for ConvNeXt, or "jaxcnn"), as torch lays them out."""
    arrays = {**variables.params, **variables.stats}
    options, _ = schemes(config, {path: np.shape(a) for path, a in arrays.items()})
    if scheme not in options:
        raise UserError(f"{config.name} is written in {', '.join(options)} names, not {scheme}")
    inverse = {"conv": (3, 2, 0, 1), "linear": (1, 0)}
    out = {}
    for key, (path, how) in options[scheme].items():
        value = np.asarray(arrays[path], np.float32)
        out[key] = np.ascontiguousarray(
            value.transpose(inverse[how]) if how in inverse else value.reshape(torch_shape(how, value.shape))
        )
    save_file(out, str(file))
    return Path(file)


def save_run_weights(run_dir: str | Path, file: str | Path, scheme: str = "torchvision") -> Path:
    """A finished run's model (its directory's `model/`) written by `save_pretrained`: the
    weights a later run's --init-from reads (e.g. frozen-backbone training, then all layers)."""
    run = runs.open_run(run_dir)
    image_shape = tuple(run.record["image_shape"])
    mesh = build_mesh({"data": 1})
    params, stats = restore_model(run.model_dir, model_template(run.config.model, image_shape, SINGLE, mesh))
    return save_pretrained(
        file, ModelVariables(flat_variables(params), flat_variables(stats)), run.config.model, scheme
    )
