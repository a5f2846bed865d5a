"""What the run has recorded: every step's loss and accuracy, the steps a guard skipped,
and one row per finished epoch (the per-epoch CSV's columns, results.EPOCH_COLUMNS) --
those whose training metrics are still on their way held back until they arrive, then
handed out in order, once, to be published. `snapshot` is what a checkpoint's record
holds (jaxcnn.resume.Resume: `to_record` writes it, `from_record` reads it back)."""

from __future__ import annotations

import numpy as np

from jaxcnn.config import TrainConfig
from jaxcnn.resume import Resume, epoch_sizes


class History:
    def __init__(self, resume: Resume, steps_per_epoch: list[int], config: TrainConfig):
        self.steps_per_epoch, self.config = steps_per_epoch, config
        self.resumed_from = resume.step
        self.step = resume.step  # optimizer steps taken (dispatched)
        self.call_from = resume.step  # the step the last call started at
        self.losses, self.accuracies = list(resume.loss_history), list(resume.accuracy_history)
        self.skipped = resume.skipped_steps
        self.rows = resume.rows(steps_per_epoch, config)
        self._waiting: list[dict] = []  # finished epochs' rows whose training metrics are on their way
        self._ready: list[dict] = []  # rows complete, not yet handed out (`take_ready`)

    def add(self, metrics: dict[str, np.ndarray], good: int | None = None) -> int:
        """Steps' metrics, on the host, in order; `good`: how many of them lead the rest
        finite (None: all). Rows waiting for these steps are completed (up to the first bad
        one). Returns the run's 0-based step of the first of them."""
        first = len(self.losses)
        self.losses.extend(metrics["loss"].tolist())
        self.accuracies.extend(metrics["accuracy"].tolist())
        self.skipped += int(np.sum(metrics["skipped"])) if "skipped" in metrics else 0
        known = len(self.losses) if good is None else first + good
        while self._waiting and self._waiting[0]["step"] <= known:
            row = self._waiting.pop(0)
            self._fill(row)
            self.add_row(row)
        return first

    def epoch_row(self, epoch: int, batch: int, steps: int, seconds: float, stall: float, settled: bool) -> dict:
        """Epoch `epoch`'s row (0-based), ending at the current step; its training metrics
        filled in where its metrics are all on the host (`settled`), else None for now."""
        row = {
            "epoch": epoch + 1, "step": self.step, "global_batch_size": batch, "train_loss": None,
            "train_accuracy": None, "test_loss": None, "test_accuracy": None, "epoch_seconds": seconds,
            "images_per_second": steps * batch / seconds, "input_wait_fraction": stall / seconds,
        }  # fmt: skip
        if settled:
            self._fill(row)
        return row

    def wait_for_metrics(self, row: dict) -> None:
        """A row whose training metrics have not reached the host: completed once they do."""
        self._waiting.append(row)

    def add_row(self, row: dict) -> None:
        """A complete row: recorded, and handed out by the next `take_ready`."""
        self.rows.append(row)
        self._ready.append(row)

    def take_ready(self) -> list[dict]:
        ready, self._ready = self._ready, []
        return ready

    def epoch_losses(self, row: dict) -> list[float]:
        return self.losses[self._first_step(row) : row["step"]]

    def _first_step(self, row: dict) -> int:
        return row["step"] - self.steps_per_epoch[row["epoch"] - 1]

    def _fill(self, row: dict) -> None:
        first = self._first_step(row)
        row["train_loss"] = float(np.mean(self.losses[first : row["step"]]))
        row["train_accuracy"] = float(np.mean(self.accuracies[first : row["step"]]))

    def snapshot(self, loader_position: dict) -> Resume:
        """Where the run stands, as a checkpoint records it (every call's metrics read first)."""
        return Resume(
            self.step, self.losses, self.accuracies, self.rows, self.skipped, loader_position,
            epoch_sizes(self.steps_per_epoch, self.config), self.config.seed,
        )  # fmt: skip
