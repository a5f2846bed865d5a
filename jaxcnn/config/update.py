"""How gradients become updates: the optimizer and its schedule (OptimConfig), the update rule
around the step (UpdateConfig), and the options that apply to the pipeline layout only or to
every layout but it. Frozen and validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass

from jaxcnn.errors import UserError

# the named layouts (jaxcnn.sharding.layouts.LAYOUTS, which a test holds to this), for flag
# parsing that must not import the sharding package (it starts JAX)
LAYOUT_NAMES = ("single", "dp", "fsdp", "tp", "hybrid", "spatial", "pipeline")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # jaxcnn.pipeline.schedule

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adam"
    learning_rate: float = 2e-3
    schedule: str = "cosine"
    warmup_steps: int = 20
    weight_decay: float = 1e-4  # adamw only
    momentum: float = 0.9  # sgd only
    warmup_from: float = 0.0  # learning rate the warmup starts at (linear scaling: the base rate)
    # fine-tuning (jaxcnn.models.model_parts names the parts): parts whose parameters do not move,
    # "backbone" for all but the head; and the learning rate of every part but the head (None: --learning-rate)
    freeze: tuple[str, ...] = ()
    backbone_lr: float | None = None

    def __post_init__(self):
        if isinstance(self.freeze, str):  # the flag's "stem,stage1"
            object.__setattr__(self, "freeze", tuple(p.strip() for p in self.freeze.split(",") if p.strip()))
        object.__setattr__(self, "freeze", tuple(self.freeze))
        if self.backbone_lr is not None and not self.backbone_lr > 0:
            raise UserError(f"--backbone-lr must be positive, got {self.backbone_lr} (--freeze backbone stops it)")
        if "backbone" in self.freeze and (len(self.freeze) > 1 or self.backbone_lr is not None):
            raise UserError("--freeze backbone freezes every part but the head: give it alone, without --backbone-lr")
        if self.name not in OPTIMIZERS:
            raise UserError(f"unknown --optimizer {self.name!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"unknown --schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if not self.learning_rate > 0:
            raise UserError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0 or not 0 <= self.momentum < 1:
            raise UserError("--weight-decay must be >= 0 and --momentum in [0, 1)")


SYNC_MODES = ("allreduce", "local-sgd")


@dataclass(frozen=True)
class UpdateConfig:
    """How gradients become updates: what the compiled train step does beyond one
    forward/backward on the global batch (jaxcnn.steps)."""

    grad_accum: int = 1  # micro-batches per optimizer step, gradients summed (lax.scan)
    sync: str = "allreduce"  # "local-sgd": replicas step alone, parameters averaged every `sync_every`
    sync_every: int = 1
    staleness: int = 0  # gradients taken on the parameters of this many steps ago
    skip_nonfinite: bool = False  # a step whose loss or new parameters are not finite changes nothing

    def __post_init__(self):
        if self.grad_accum < 1:
            raise UserError(f"--grad-accum must be a positive integer, got {self.grad_accum}")
        if self.sync not in SYNC_MODES:
            raise UserError(f"unknown --sync {self.sync!r}; use one of {', '.join(SYNC_MODES)}")
        if self.sync_every < 1:
            raise UserError(f"--sync-every must be a positive integer, got {self.sync_every}")
        if self.sync_every > 1 and self.sync != "local-sgd":
            raise UserError("--sync-every applies to --sync local-sgd; add it or drop --sync-every")
        if self.staleness < 0:
            raise UserError(f"--staleness must be >= 0, got {self.staleness}")
        if self.staleness and self.sync != "allreduce":
            raise UserError("--staleness models an asynchronous parameter server; use it with --sync allreduce")

    @property
    def local(self) -> bool:
        return self.sync == "local-sgd"


def check_layout_options(
    pipeline: bool,
    update: UpdateConfig,
    microbatches: int | None,
    stage_split: tuple[int, ...] | None,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
) -> None:
    """The options that apply to the pipeline only, or to every layout but it."""
    if schedule not in PIPELINE_SCHEDULES:
        raise UserError(f"unknown --pipeline-schedule {schedule!r}; use one of {', '.join(PIPELINE_SCHEDULES)}")
    if virtual_stages < 1:
        raise UserError(f"--virtual-stages must be a positive integer, got {virtual_stages}")
    if pipeline and update != UpdateConfig():
        raise UserError(
            "--grad-accum, --sync, --staleness and --skip-nonfinite do not apply to --layout pipeline "
            "(its micro-batches already accumulate: use --microbatches)"
        )
    if not pipeline and (microbatches or stage_split or schedule != "gpipe" or virtual_stages != 1):
        raise UserError(
            "--microbatches, --stage-split, --pipeline-schedule and --virtual-stages apply to --layout pipeline only"
        )
