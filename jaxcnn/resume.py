"""Where a restored run continues: its step, what it had recorded, where its loader stood,
and the checks that the flags it resumes under train the same steps it took.

    resume = Resume.from_record(restored.record)      # a checkpoint's record (jaxcnn.checkpoint)
    record = history.snapshot(feed.position()).to_record(fingerprint)   # the loop's, to save
    resume.check_continues(len(train_set), train_config)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxcnn.config import TrainConfig, epoch_steps
from jaxcnn.errors import UserError


@dataclass
class Resume:
    """Where a restored run continues: its step and what it had recorded so far."""

    step: int
    loss_history: list[float]
    accuracy_history: list[float]
    epochs: list[dict]
    skipped_steps: int = 0
    loader: dict | None = None  # the loader's position (Batches.position); None: from the step
    epoch_sizes: list[list[int]] | None = None  # [steps, global batch] per epoch, and the seed, of the run
    seed: int | None = None  # that saved it (None: a checkpoint from before they were recorded)

    def to_record(self, fingerprint: list) -> dict:
        """The checkpoint's record (JSON) of this point of a run, with its state's
        fingerprint (jaxcnn.checkpoint.state_fingerprint); `from_record` reads it back."""
        return {
            "step": self.step, "loss_history": self.loss_history, "accuracy_history": self.accuracy_history,
            "epochs": self.epochs, "skipped_steps": self.skipped_steps, "fingerprint": fingerprint,
            "loader": self.loader, "epoch_sizes": self.epoch_sizes, "seed": self.seed,
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: dict) -> Resume:
        return cls(
            record["step"], record["loss_history"], record["accuracy_history"], record["epochs"],
            record.get("skipped_steps", 0), record.get("loader"),
            record.get("epoch_sizes", record.get("plan")), record.get("seed"),
        )  # fmt: skip

    def check_continues(self, train_size: int, config: TrainConfig) -> None:
        """Refuse to resume under flags that change the steps already taken: the seed, the
        steps and batch of every epoch before the one it stopped in, that epoch's batch, or
        fewer steps in it than were taken (batch size, batch schedule, data, --max-steps).
        Later steps may change (more --epochs or --max-steps). And a checkpoint whose loader
        position is not its state's step is refused (checked here: before anything is written)."""
        self.loader_position()
        if self.epoch_sizes is None:  # saved before they were recorded
            return
        sizes = epoch_sizes(epoch_steps(train_size, config), config)
        ends = np.cumsum([count for count, _ in self.epoch_sizes])
        k = int(np.searchsorted(ends, self.step))  # the epoch the saved step falls in
        taken = self.step - (int(ends[k - 1]) if k else 0)  # steps of it already taken
        same = (
            self.seed == config.seed and k < len(sizes) and sizes[:k] == self.epoch_sizes[:k]
            and sizes[k][1] == self.epoch_sizes[k][1] and sizes[k][0] >= taken
        )  # fmt: skip
        if not same:
            raise UserError(
                f"the saved state (step {self.step}) was trained with other steps per epoch, batch or seed than "
                "these flags give: resume with the flags it was saved with (its run's config.json), "
                "or start a new --run-name"
            )

    def loader_position(self) -> dict:
        """Where the restored run's loader continues: the position its checkpoint saved (from
        the step, for checkpoints made before the loader saved one)."""
        position = self.loader or {"next_step": self.step}
        if position["next_step"] != self.step:
            raise UserError(
                f"the checkpoint's loader stands at step {position['next_step']} but its state at step {self.step}; "
                "the checkpoint is inconsistent: resume from an earlier one"
            )
        return position

    def rows(self, steps_per_epoch: list[int], config: TrainConfig) -> list[dict]:
        """The epoch rows of a restored run, one for every epoch it had finished. Checkpoints
        saved at an epoch's last step by older versions of jaxcnn lack that epoch's
        row: it is rebuilt from the loss and accuracy histories (test figures and timings,
        which cannot be rebuilt, are None)."""
        rows, recorded, first = [], {r["epoch"]: r for r in self.epochs}, 0
        for epoch, count in enumerate(steps_per_epoch):
            if first + count > self.step:
                break
            rows.append(recorded.get(epoch + 1) or {
                "epoch": epoch + 1, "step": first + count, "global_batch_size": config.batch_for_epoch(epoch),
                "train_loss": float(np.mean(self.loss_history[first : first + count])),
                "train_accuracy": float(np.mean(self.accuracy_history[first : first + count])),
                "test_loss": None, "test_accuracy": None, "epoch_seconds": None, "images_per_second": None,
                "input_wait_fraction": None,
            })  # fmt: skip
            first += count
        return rows


def epoch_sizes(steps: list[int], config: TrainConfig) -> list[list[int]]:
    """[optimizer steps, global batch] of each epoch the run trains (`steps`: epoch_steps')."""
    return [[count, config.batch_for_epoch(epoch)] for epoch, count in enumerate(steps)]
