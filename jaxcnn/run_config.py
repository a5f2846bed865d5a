"""One typed configuration for a whole run, from the command line down.

    config = RunConfig.from_flags(args)        # jaxcnn.commands: the only place flags exist
    record = jaxcnn.run.train(config)
    config.to_json()                            # the run directory's config.json

A `RunConfig` gathers one frozen dataclass per part of a run: the model, the optimizer, the
training loop, the update rule (jaxcnn.config), the data and its input pipeline, the parallel
layout and mesh, the processes of a multi-host run, checkpoints and output. Each field is
set by the flag of the same name (`--grad-accum` -> `update.grad_accum`); a part's `name`
field by the part's own flag (`--model`, `--optimizer`). Each part checks its own fields
where it is built, and `RunConfig` what they must agree on, so bad input fails here, before
JAX starts. Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from jaxcnn.config import LAYOUT_NAMES, ModelConfig, OptimConfig, TrainConfig, UpdateConfig, check_layout_options
from jaxcnn.errors import UserError

BUNDLED_DATASET = "digits"  # the CSVs in data/: the default --dataset
STOP_SIGNALS = ("USR1", "USR2")  # --stop-signal: besides SIGTERM and Ctrl-C (jaxcnn.stopping)
DEFAULT_SIMULATED_DEVICES = 8  # on a CPU-only machine, when neither the mesh nor --host-devices says
AUGMENTS = ("none", "imagenet")
DATA_ON_DEVICE = ("auto", "on", "off")  # --augment: imagenet is jaxcnn.data.crops' recipe for image folders


def check_input_options(workers: int | None, prefetch: int) -> None:
    """--input-workers and --prefetch (DataConfig's, and a Loader's built without one)."""
    if (workers is not None and workers < 0) or prefetch < 1:
        raise UserError(f"--input-workers must be >= 0 and --prefetch >= 1, got {workers} and {prefetch}")


def check_data_on_device(mode: str) -> None:
    """--data-on-device (DataConfig's, and jaxcnn.data.on_device.choose's)."""
    if mode not in DATA_ON_DEVICE:
        raise UserError(f"--data-on-device {mode!r}: use one of {', '.join(DATA_ON_DEVICE)}")


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how the input pipeline feeds them (jaxcnn.data)."""

    dataset: str = BUNDLED_DATASET  # or one of jaxcnn.data.DATASETS, read by name
    data_dir: str | None = None  # where --dataset's files are
    download: bool = False
    data: str | None = None  # a training CSV or image folder (None: the bundled digits)
    test_data: str | None = None
    val_split: float = 0.1  # held out of --data when it has no --test-data
    image_size: str | None = None  # "HxW": folder images resized to this
    channels: int = 1
    synthetic: str | None = None  # "HxWxC": random images instead of files
    synthetic_size: int = 1024
    augment: str = "none"  # one of AUGMENTS
    augment_shift: int = 0
    augment_flip: bool = False
    input_workers: int | None = None  # None: 0 for data in memory, one per core for files
    prefetch: int = 2
    data_on_device: str = "auto"  # one of DATA_ON_DEVICE: the training set held on the devices (jaxcnn.data.on_device)

    def __post_init__(self):
        check_input_options(self.input_workers, self.prefetch)
        if not 0.0 < self.val_split < 1.0:
            raise UserError(f"--val-split must be in (0, 1), got {self.val_split}")
        if self.channels < 1 or self.synthetic_size < 1:
            raise UserError("--channels and --synthetic-size must be positive integers")
        if self.augment_shift < 0:
            raise UserError(f"--augment-shift must be >= 0, got {self.augment_shift}")
        check_data_on_device(self.data_on_device)
        if self.augment not in AUGMENTS:
            raise UserError(f"unknown --augment {self.augment!r}; use one of {', '.join(AUGMENTS)}")
        if self.augment == "imagenet" and (self.augment_shift or self.augment_flip):
            raise UserError(
                "--augment imagenet crops and flips on its own; drop --augment-shift/--augment-flip (for data in memory)"
            )

    def workers_for(self, in_memory: bool) -> int:
        """--input-workers, or its default: none for data already in memory (gathering rows
        is cheap), one per core this process may use for files decoded every epoch."""
        if self.input_workers is not None:
            return self.input_workers
        return 0 if in_memory else len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class ParallelConfig:
    """How the run is split over devices: a layout (a name or a rules table) on a mesh."""

    layout: str = "dp"  # one of LAYOUT_NAMES
    layout_rules: str | None = None  # your own table, e.g. "batch=data,conv_out=model" (replaces layout)
    mesh: str | None = None  # e.g. "data=4,model=2" (-1 fills the rest); None: the layout's
    dcn_mesh: str | None = None  # each axis's ways across hosts, e.g. "data=2" (None: hosts split `data` first)
    host_devices: int | None = None  # CPU devices to simulate (None: what the mesh needs)
    microbatches: int | None = None  # pipeline only
    stage_split: tuple[int, ...] | None = None  # pipeline only: each stage's first layer after the first
    pipeline_schedule: str = "gpipe"  # pipeline only: jaxcnn.pipeline.schedule.SCHEDULES
    virtual_stages: int = 1  # pipeline only: chunks of layers each stage holds

    def __post_init__(self):
        if not self.layout_rules and self.layout not in LAYOUT_NAMES:
            raise UserError(f"unknown layout {self.layout!r}; use one of {', '.join(LAYOUT_NAMES)}")
        if self.host_devices is not None and self.host_devices < 1:
            raise UserError(f"--host-devices must be at least 1, got {self.host_devices}")
        if self.stage_split is not None:
            object.__setattr__(self, "stage_split", tuple(self.stage_split))

    @property
    def named_pipeline(self) -> bool:
        """The pipeline by name (a rules table with a stage axis is known only once parsed)."""
        return not self.layout_rules and self.layout == "pipeline"


@dataclass(frozen=True)
class ClusterConfig:
    """The processes of a multi-host run (jaxcnn.distributed; None: the environment's)."""

    coordinator: str | None = None  # process 0's HOST:PORT
    num_processes: int | None = None
    process_id: int | None = None
    local_devices: tuple[int, ...] | None = None  # this process's accelerators (None: all, or SLURM's task GPU)
    heartbeat_timeout: int = 100  # seconds a process may miss heartbeats before the others fail
    join_timeout: int = 300  # seconds process 0 waits for the others to join

    def __post_init__(self):
        if self.local_devices is not None:
            object.__setattr__(self, "local_devices", tuple(self.local_devices))
            if (
                not self.local_devices
                or min(self.local_devices) < 0
                or len(set(self.local_devices)) < len(self.local_devices)
            ):
                raise UserError(
                    f"--local-devices must list distinct device numbers >= 0, e.g. 0 or 0,1; got {self.local_devices}"
                )
        for flag, seconds in (("heartbeat-timeout", self.heartbeat_timeout), ("join-timeout", self.join_timeout)):
            if seconds < 1:
                raise UserError(f"--{flag} must be a positive number of seconds, got {seconds}")


RESUME_AUTO = "auto"  # --resume auto: continue a run directory that holds a saved state, else start it


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_dir: str | None = None  # Orbax checkpoints, saved asynchronously
    checkpoint_every: int = 100  # steps between checkpoints
    keep_checkpoints: int = 3
    # continue the run (its directory's saved state, or --checkpoint-dir's newest); RESUME_AUTO: when there is one
    resume: bool | str = False
    stop_signal: str | None = None  # a signal that stops and saves like SIGTERM (e.g. USR1, for SLURM's --signal)
    init_from: str | None = None  # a safetensors file the fresh state starts from (jaxcnn.pretrained); resume wins

    def __post_init__(self):
        if self.resume not in (False, True, RESUME_AUTO):
            raise UserError(f"--resume takes no value or {RESUME_AUTO!r}, got {self.resume!r}")
        if self.stop_signal is not None and self.stop_signal.upper().removeprefix("SIG") not in STOP_SIGNALS:
            raise UserError(f"--stop-signal {self.stop_signal!r}: use one of {', '.join(STOP_SIGNALS)}")
        if self.checkpoint_every < 1:
            raise UserError(f"--checkpoint-every must be a positive integer, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be a positive integer, got {self.keep_checkpoints}")


@dataclass(frozen=True)
class OutputConfig:
    results_dir: str = "runs"  # where run directories go
    run_name: str | None = None  # None: <model>-<layout>-<mesh>
    overwrite: bool = False  # replace an existing run directory of the same name
    submission: str | None = None  # predictions for a label-free test file (None: in the run directory)
    quiet: bool = False  # no progress bar or epoch lines
    print_shardings: bool = False  # every parameter's placement, the collectives, the lint's warnings

    def __post_init__(self):
        if self.run_name is not None:
            check_run_name(self.run_name)


def check_run_name(name: str) -> str:
    """A run directory's name: one path component, no spaces."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=-]*", name):
        raise UserError(f"--run-name {name!r} must be letters, digits, '.', '_', '-', '=' (no spaces or slashes)")
    return name


# the parts, by the attribute RunConfig holds them under
PARTS = {
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "update": UpdateConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "cluster": ClusterConfig,
    "checkpoint": CheckpointConfig,
    "output": OutputConfig,
}
# a part's `name` is set by the part's own flag
NAME_FLAGS = {"model": "model", "optim": "optimizer"}


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    compile_cache: str | None = None  # a directory, "off", or None: $JAXCNN_CACHE, else ~/.cache/jaxcnn

    def __post_init__(self):
        checkpoint, output = self.checkpoint, self.output
        parallel = self.parallel
        if not parallel.layout_rules:  # a rules table's stage axis is known once parsed: jaxcnn.build checks it
            check_layout_options(
                parallel.named_pipeline, self.update, parallel.microbatches, parallel.stage_split,
                parallel.pipeline_schedule, parallel.virtual_stages,
            )  # fmt: skip
        if checkpoint.resume and not (output.run_name or checkpoint.checkpoint_dir):
            raise UserError("--resume needs --run-name NAME, the run to continue (or --checkpoint-dir)")
        if checkpoint.resume and output.overwrite:
            raise UserError("--resume continues a run and --overwrite replaces it: give one")

    @classmethod
    def from_flags(cls, flags: argparse.Namespace | Mapping) -> RunConfig:
        """Every part from the flags of its fields' names; a field without a flag keeps its default."""
        values = dict(vars(flags) if isinstance(flags, argparse.Namespace) else flags)
        parts = {name: part_from_flags(part, values, NAME_FLAGS.get(name)) for name, part in PARTS.items()}
        return cls(**parts, compile_cache=values.get("compile_cache"))

    def to_flags(self) -> dict:
        """{flag's name: value}: what the flags that build this config would have parsed to."""
        flags = {"compile_cache": self.compile_cache}
        for name in PARTS:
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                flags[NAME_FLAGS[name] if key == "name" and name in NAME_FLAGS else key] = value
        return flags

    def to_json(self) -> dict:
        """The nested form config.json holds: {part: {field: value}}."""
        return {
            **{name: dataclasses.asdict(getattr(self, name)) for name in PARTS},
            "compile_cache": self.compile_cache,
        }

    @classmethod
    def from_json(cls, saved: Mapping) -> RunConfig:
        """A config.json back (the nested form; also the flat {flag: value} of older runs)."""
        if isinstance(saved.get("model"), Mapping):
            flat = {"compile_cache": saved.get("compile_cache")}
            for name in PARTS:
                for key, value in saved.get(name, {}).items():
                    flat[NAME_FLAGS[name] if key == "name" and name in NAME_FLAGS else key] = value
        else:  # an older run's flags, as parsed then
            flat = {("learning_rate" if key == "lr" else key): value for key, value in saved.items()}
        if flat.get("steps_per_call") == "auto":  # saved before `auto` went (K steps a call give one step's numbers)
            flat["steps_per_call"] = 1
        return cls.from_flags({key: _tuples(value) for key, value in flat.items()})


def part_from_flags(part: type, values: Mapping, name_flag: str | None = None):
    """One part of the config from {flag's name: value}: each field from its flag (`name`
    from `name_flag`); a field whose flag is absent keeps its default."""
    chosen = {}
    for f in dataclasses.fields(part):
        flag = name_flag if f.name == "name" and name_flag else f.name
        if flag in values:
            chosen[f.name] = values[flag]
    return part(**chosen)


def _tuples(value):
    """JSON's lists back to the tuples the flags parse into (conv widths, batch schedules)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
