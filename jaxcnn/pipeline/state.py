"""The pipeline's state as every other layout's: one whole-model `TrainState`.

A pipeline holds its state per stage (`PipelineState`: each stage's parameters, statistics
and optimizer state on that stage's devices, named by the stage's own paths,
"units/0/conv/kernel"). Checkpoints hold the whole model's `TrainState`, named by the
model's paths ("blocks/3/conv/kernel"), the same tree the SPMD layouts save -- so a
pipeline run resumes exactly, resumes onto dp or single, and they onto it (Orbax reshards
each array into the sharding it is restored to).

Both directions rename and regroup the leaves; no parameter-shaped array is copied. Each
chunk's optimizer state has the whole model's structure (the same optax chain), its
parameter-shaped parts `nnx.State`s of the chunk's parameters; the scalars beside them (Adam's
step count, the schedule's) are equal on every chunk: the whole model keeps the first
chunk's, and a restore copies them to every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from flax import nnx

from jaxcnn.models import build_model
from jaxcnn.pipeline.schedule import PipelineState, StageState, to_stage
from jaxcnn.pipeline.split import Stage
from jaxcnn.steps.state import TrainState


def _is_state(x) -> bool:
    return isinstance(x, nnx.State)


@dataclass(frozen=True)
class StateForms:
    """The renames between the chunks' paths and the model's, one dict per chunk."""

    to_model: list[dict[tuple, tuple]]  # chunk c's variable path -> the model's path

    @classmethod
    def of(cls, model_config, image_shape, groups: list[range]) -> StateForms:
        """Matched by the Variable objects a Stage shares with the model it is cut from."""
        model = nnx.eval_shape(lambda: build_model(model_config, image_shape, 0))
        model_path = {id(v): p for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
        return cls(
            [
                {p: model_path[id(v)] for p, v in nnx.iter_graph(Stage(model, group)) if isinstance(v, nnx.Variable)}
                for group in groups
            ]
        )

    def _merge(self, *stage_trees: nnx.State) -> nnx.State:
        """Per-chunk States (the chunks' paths) -> one State of the model's paths."""
        return nnx.from_flat_state(
            [(rename[path], leaf) for rename, tree in zip(self.to_model, stage_trees, strict=True)
             for path, leaf in nnx.to_flat_state(tree)]
        )  # fmt: skip

    def _split(self, whole: nnx.State) -> list[nnx.State]:
        flat = dict(nnx.to_flat_state(whole))
        return [nnx.from_flat_state([(path, flat[model]) for path, model in rename.items() if model in flat])
                for rename in self.to_model]  # fmt: skip

    def whole(self, state: PipelineState) -> TrainState:
        """The per-chunk state as the whole model's TrainState (also for abstract states)."""
        stages = state.stages
        opt_state = jax.tree.map(
            lambda *parts: self._merge(*parts) if _is_state(parts[0]) else parts[0],
            *(st.opt_state for st in stages),
            is_leaf=_is_state,
        )
        return TrainState(
            step=state.step,
            params=self._merge(*(st.params for st in stages)),
            model_state=self._merge(*(st.stats for st in stages)),
            opt_state=opt_state,
            rng=state.rng,
        )

    def stages(self, state: TrainState, like: PipelineState) -> PipelineState:
        """The whole model's TrainState cut into the chunks' states. The optimizer's scalars
        are copied to each chunk's devices, as in `like` (the abstract per-chunk state: its
        shardings)."""
        params, stats = self._split(state.params), self._split(state.model_state)
        leaves, treedef = jax.tree.flatten(state.opt_state, is_leaf=_is_state)
        parts = [self._split(leaf) if _is_state(leaf) else None for leaf in leaves]

        def stage_opt(s):
            places = [
                getattr(x, "sharding", None) for x in jax.tree.leaves(like.stages[s].opt_state, is_leaf=_is_state)
            ]
            return treedef.unflatten(
                [part[s] if part is not None else to_stage(leaf, place)
                 for leaf, part, place in zip(leaves, parts, places, strict=True)]
            )  # fmt: skip

        stages = tuple(StageState(params[s], stats[s], stage_opt(s)) for s in range(len(self.to_model)))
        return PipelineState(state.step, stages, state.rng)
