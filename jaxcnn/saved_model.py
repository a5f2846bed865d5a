"""The trained model, kept: its parameters and batch-norm statistics as one Orbax checkpoint,
keyed by the model's own paths ("blocks/0/conv1/kernel"), not by a layout's training state.

    save_model(run_dir / "model", program.model_variables(state))
    variables = restore_model(run_dir / "model", model_config, image_shape, layout, mesh)

Nothing of the layout it was trained under is stored (no optimizer state, no replicas, no
pipeline stages), so the model restores under any layout and mesh: each array is read
straight into the shards the new layout's table gives it (orbax reshards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from jaxcnn.checkpoint import save_replicas_whole_on_cpu
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import place_variables


class ModelVariables(NamedTuple):
    """A model's arrays by path: {"blocks/0/conv1/kernel": array, ...}."""

    params: dict[str, Any]
    stats: dict[str, Any]  # batch-norm running statistics (empty without batch norm)


def path_key(path) -> str:
    """("blocks", 0, "conv1", "kernel") or a jax key path -> "blocks/0/conv1/kernel"."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat_variables(state: nnx.State) -> dict[str, Any]:
    """An nnx.State (or its pure dict) as {path: leaf}."""
    pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    return {path_key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]}


def save_model(directory: str | Path, variables: ModelVariables) -> Path:
    """Write the model (a collective: every process calls it). `directory` must not exist."""
    directory = Path(directory).absolute()
    save_replicas_whole_on_cpu()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory, {"params": variables.params, "stats": variables.stats})
    checkpointer.wait_until_finished()
    checkpointer.close()
    return directory


class ModelTemplate(NamedTuple):
    """What a saved model must match, and how to rebuild the model from its arrays."""

    graphdef: Any
    params: nnx.State  # abstract, with this layout's shardings
    stats: nnx.State


def model_template(model_config: ModelConfig, image_shape: tuple[int, int, int], layout: Layout, mesh: Mesh):
    """The model's abstract variables, each carrying the sharding `layout` gives it on `mesh`."""
    graphdef, params, stats = nnx.split(
        nnx.eval_shape(lambda: build_model(model_config, image_shape, 0)), nnx.Param, ...
    )

    def placed(state):
        shardings, _ = place_variables(state, layout, mesh)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)

    return ModelTemplate(graphdef, placed(params), placed(stats))


def restore_model(directory: str | Path, template: ModelTemplate) -> tuple[nnx.State, nnx.State]:
    """(parameters, statistics) read into the template's shardings. A saved model whose
    arrays differ from the template's (another model or size) is a UserError."""
    directory = Path(directory).absolute()
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = checkpointer.metadata(directory).item_metadata.tree
    except (FileNotFoundError, ValueError, OSError) as err:
        raise UserError(f"no readable model in {directory} ({str(err).splitlines()[0][:120]})") from None
    wanted = {"params": flat_variables(template.params), "stats": flat_variables(template.stats)}
    problem = _mismatch(saved, wanted)
    if problem:
        raise UserError(f"the model in {directory} is not this model: {problem}; check the run's --model and sizes")
    restored = checkpointer.restore(directory, wanted)
    checkpointer.close()
    return _rebuild(template.params, restored["params"]), _rebuild(template.stats, restored["stats"])


def _rebuild(state: nnx.State, flat: dict[str, Any]) -> nnx.State:
    """The nnx.State `state` with its leaves replaced by `flat`'s arrays, by path."""
    pure = nnx.to_pure_dict(state)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    values = jax.tree_util.tree_unflatten(treedef, [flat[path_key(path)] for path, _ in leaves])
    rebuilt = jax.tree.map(lambda x: x, state)  # a copy to fill
    nnx.replace_by_pure_dict(rebuilt, values)
    return rebuilt


def _mismatch(saved: dict, wanted: dict) -> str | None:
    for group in ("params", "stats"):
        have, want = saved.get(group) or {}, wanted[group]
        for key, spec in want.items():
            if key not in have:
                return f"it has no {group} {key}"
            if tuple(have[key].shape) != tuple(spec.shape):
                return f"{key} is {tuple(have[key].shape)} there, {tuple(spec.shape)} here"
        extra = sorted(set(have) - set(want))
        if extra:
            return f"it also has {extra[0]}"
    return None
