"""Frozen run configuration, validated where it is built, and the model presets."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxcnn.errors import UserError

DEFAULT_MODEL = "cnn2d_3layer_fullconnected_3layer"
MODEL_NAME = re.compile(r"cnn2d_(\d)layer_fullconnected_(\d)layer")
MAX_CONV_BLOCKS, MAX_DENSE_LAYERS = 6, 4

# Preset widths: conv block i has CONV_WIDTHS[i] channels; hidden dense layer j DENSE_WIDTHS[j].
CONV_WIDTHS = (32, 64, 128, 128, 256, 256)
DENSE_WIDTHS = (256, 128, 128)
NORMS = ("none", "batch", "group")


@dataclass(frozen=True)
class ModelConfig:
    name: str = DEFAULT_MODEL
    conv_features: tuple[int, ...] = ()  # () = the name's preset widths
    dense_features: tuple[int, ...] = ()  # hidden dense widths; the classifier is added
    norm: str = "batch"
    dropout: float = 0.0
    num_classes: int = 10

    def __post_init__(self):
        match = MODEL_NAME.fullmatch(self.name)
        if not match:
            raise UserError(
                f"unknown model {self.name!r}; use cnn2d_<N>layer_fullconnected_<M>layer, "
                f"e.g. {DEFAULT_MODEL} (N in 1..{MAX_CONV_BLOCKS}, M in 1..{MAX_DENSE_LAYERS})"
            )
        n_conv, n_dense = int(match[1]), int(match[2])
        if not (1 <= n_conv <= MAX_CONV_BLOCKS and 1 <= n_dense <= MAX_DENSE_LAYERS):
            raise UserError(
                f"model {self.name!r}: use 1..{MAX_CONV_BLOCKS} conv and 1..{MAX_DENSE_LAYERS} dense layers"
            )
        conv = self.conv_features or CONV_WIDTHS[:n_conv]
        dense = self.dense_features or DENSE_WIDTHS[: n_dense - 1]
        if len(conv) != n_conv:
            raise UserError(f"model {self.name} has {n_conv} conv blocks but --conv-features gives {len(conv)} widths")
        if len(dense) != n_dense - 1:
            raise UserError(
                f"model {self.name} has {n_dense - 1} hidden dense layers but --dense-features gives {len(dense)} widths"
            )
        if min(conv + dense, default=1) < 1:
            raise UserError("layer widths must be positive integers")
        if self.norm not in NORMS:
            raise UserError(f"unknown --norm {self.norm!r}; use one of {', '.join(NORMS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.num_classes < 2:
            raise UserError(f"--num-classes must be at least 2, got {self.num_classes}")
        object.__setattr__(self, "conv_features", tuple(conv))
        object.__setattr__(self, "dense_features", tuple(dense))


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

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise UserError(f"unknown --optimizer {self.name!r}; use one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"unknown --schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if not self.learning_rate > 0:
            raise UserError(f"--lr must be positive, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise UserError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0 or not 0 <= self.momentum < 1:
            raise UserError("--weight-decay must be >= 0 and --momentum in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 64  # global, per optimizer step
    epochs: int = 30
    max_steps: int | None = None  # stop early after this many optimizer steps
    seed: int = 0
    eval_batch_size: int | None = None  # default: batch_size

    def __post_init__(self):
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.epochs < 1:
            raise UserError(f"--epochs must be a positive integer, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps must be a positive integer, got {self.max_steps}")
