"""A trained model applied to data: its predictions, and how they compare with the labels.

    predictor = load_predictor(run.model_dir, model_config, image_shape, layout, mesh, batch_size)
    logits = predictor.logits(dataset)                   # [N, classes], float32, in order
    report = evaluation(logits, dataset.labels, classes)

The model is read into the shards the given layout puts it in (jaxcnn.saved_model), and
its forward pass is compiled once for that layout, mesh and batch size -- any SPMD layout:
inference has no use for a pipeline's stages. Batches are the evaluation's (in order, the
last padded and its padding dropped), so on the layout and batch a run evaluated with,
the predictions are the ones its test accuracy counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.config import ModelConfig
from jaxcnn.data import Dataset, eval_batches
from jaxcnn.errors import UserError
from jaxcnn.models import call
from jaxcnn.saved_model import model_template, restore_model
from jaxcnn.sharding import ParallelDims
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import activation_layout, data_sharding
from jaxcnn.sharding.placement import to_global


@dataclass
class Predictor:
    """A trained model compiled for one layout, mesh and batch size."""

    step: Any  # compiled (params, stats, images) -> logits, replicated
    params: nnx.State
    stats: nnx.State
    image_sharding: NamedSharding
    batch_size: int

    def logits(self, dataset: Dataset) -> np.ndarray:
        """Every example's logits [N, classes] (float32), in the dataset's order."""
        out = []
        for images, _, mask in eval_batches(dataset, self.batch_size):
            logits = self.step(self.params, self.stats, to_global(images, self.image_sharding))
            out.append(np.asarray(logits)[mask > 0])
        return np.concatenate(out)


def load_predictor(
    model_dir: str | Path,
    model_config: ModelConfig,
    image_shape: tuple[int, int, int],
    layout: Layout,
    mesh: Mesh,
    batch_size: int,
    image_dtype: str = "float32",
) -> Predictor:
    """The model in `model_dir` placed by `layout` on `mesh`, its forward pass compiled for
    batches of `image_dtype` pixels (uint8: an image folder's, scaled in the step)."""
    if layout.stage_axis:
        raise UserError("predict and evaluate run one SPMD program: use --layout dp (the default) or any but pipeline")
    ParallelDims(layout, dict(mesh.shape)).validate(batch_size, image_shape=image_shape)
    template = model_template(model_config, image_shape, layout, mesh)
    params, stats = restore_model(model_dir, template)
    image_sharding = data_sharding(ax.IMAGE_BHWC, layout, mesh)

    def logits_of(params, stats, images):
        model = nnx.merge(template.graphdef, params, stats)
        with activation_layout(layout, mesh):
            return call(model, images, train=False).astype(jnp.float32)

    images = jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.dtype(image_dtype), sharding=image_sharding)
    step = (
        jax.jit(logits_of, out_shardings=NamedSharding(mesh, P()))
        .lower(template.params, template.stats, images)
        .compile()
    )
    return Predictor(step, params, stats, image_sharding, batch_size)


def probabilities(logits: np.ndarray) -> np.ndarray:
    """Softmax over classes, in float64."""
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(-1, keepdims=True)


@dataclass
class Evaluation:
    accuracy: float
    loss: float  # mean cross-entropy (float64 from the float32 logits)
    examples: int
    per_class: list[dict]  # class, label, examples, correct, accuracy (None: no example of it)
    confusion: np.ndarray  # [true, predicted] counts


def evaluation(logits: np.ndarray, labels: np.ndarray, classes: list[str]) -> Evaluation:
    """Accuracy, loss, per-class accuracy and the confusion matrix of `logits` against `labels`."""
    k = len(classes)
    predicted = logits.argmax(-1)
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    loss = float(-log_probs[np.arange(len(labels)), labels].mean())
    confusion = np.bincount(labels * k + predicted, minlength=k * k).reshape(k, k)
    per_class = []
    for label, name in enumerate(classes):
        examples, correct = int(confusion[label].sum()), int(confusion[label, label])
        per_class.append({
            "class": name, "label": label, "examples": examples, "correct": correct,
            "accuracy": correct / examples if examples else None,
        })  # fmt: skip
    accuracy = int(np.trace(confusion)) / len(labels)
    return Evaluation(accuracy, loss, len(labels), per_class, confusion)
