"""A run's figures: its curves, an evaluation's confusion matrix."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxcnn.plots.figure import plt, save


def curves_plot(loss_history: list[float], rows: list[dict], path: Path, title: str) -> Path:
    """A run's training loss per step (and per epoch), and its accuracies per epoch."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.arange(1, len(loss_history) + 1)
    left.plot(steps, loss_history, color="0.7", lw=0.8, label="train loss (step)")
    epochs_at = [r["step"] for r in rows]
    left.plot(epochs_at, [r["train_loss"] for r in rows], "o-", label="train loss (epoch mean)")
    if any(r.get("test_loss") is not None for r in rows):
        left.plot(epochs_at, [r.get("test_loss") for r in rows], "s-", label="test loss")
    left.set(xlabel="optimizer step", ylabel="cross-entropy", yscale="log")
    left.legend()
    right.plot([r["epoch"] for r in rows], [r["train_accuracy"] for r in rows], "o-", label="train")
    if any(r.get("test_accuracy") is not None for r in rows):
        right.plot([r["epoch"] for r in rows], [r.get("test_accuracy") for r in rows], "s-", label="test")
    right.set(xlabel="epoch", ylabel="accuracy")
    right.legend()
    fig.suptitle(title)
    return save(fig, path)


def confusion_plot(confusion: np.ndarray, classes: list[str], path: Path, title: str) -> Path:
    """Rows: the true class, columns: the predicted one; each cell's count printed."""
    size = max(4.0, 0.5 * len(classes) + 2)
    fig, axes = plt.subplots(figsize=(size + 1, size))
    image = axes.imshow(confusion, cmap="Blues")
    axes.set(xticks=range(len(classes)), yticks=range(len(classes)), xlabel="predicted", ylabel="true", title=title)
    axes.set_xticklabels(classes, rotation=45, ha="right")
    axes.set_yticklabels(classes)
    if len(classes) <= 30:
        dark = confusion.max() / 2
        for (i, j), count in np.ndenumerate(confusion):
            axes.text(
                j, i, str(count), ha="center", va="center", fontsize=7, color="white" if count > dark else "black"
            )
    fig.colorbar(image, ax=axes, shrink=0.8)
    return save(fig, path)
