"""One typed config from the flags down: every field of every part of a RunConfig is set by
the `jaxcnn train` flag of its name, the flags' defaults are the config's, config.json reads
back to the same config, and what the parts must agree on is refused in one line."""

import argparse
import dataclasses
import json

import pytest

from jaxcnn.commands import train as train_command
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig, UpdateConfig
from jaxcnn.errors import UserError
from jaxcnn.run_config import NAME_FLAGS, PARTS, CheckpointConfig, DataConfig, OutputConfig, ParallelConfig, RunConfig


def _train_flags() -> set[str]:
    return {a.dest for a in train_command.parser()._actions if a.dest != "help"}


def test_every_field_has_the_train_flag_of_its_name_and_every_flag_a_field():
    fields = {"compile_cache"}
    for name, part in PARTS.items():
        fields |= {
            NAME_FLAGS[name] if f.name == "name" and name in NAME_FLAGS else f.name for f in dataclasses.fields(part)
        }
    assert fields == _train_flags()


def test_the_flags_defaults_are_the_configs():
    assert train_command.parse_flags([]) == RunConfig()


def test_each_flag_lands_in_its_field():
    config = train_command.parse_flags([
        "--model", "resnet_tiny", "--optimizer", "sgd", "--lr", "0.05", "--grad-accum", "2", "--augment-flip",
        "--layout", "hybrid", "--mesh", "data=2,model=2", "--checkpoint-every", "7", "--run-name", "r", "--quiet",
        "--coordinator", "h:1",
    ])  # fmt: skip
    assert config.model.name == "resnet_tiny" and config.optim.name == "sgd" and config.optim.learning_rate == 0.05
    assert config.update.grad_accum == 2 and config.data.augment_flip
    assert config.parallel == ParallelConfig(layout="hybrid", mesh="data=2,model=2")
    assert config.checkpoint.checkpoint_every == 7 and config.output == OutputConfig(run_name="r", quiet=True)
    assert config.cluster.coordinator == "h:1"


def test_config_json_reads_back_to_the_same_config():
    every_part = RunConfig(
        model=ModelConfig(conv_features=(8, 16, 16), dense_features=(32, 16)),
        optim=OptimConfig(name="sgd", learning_rate=0.1),
        train=TrainConfig(batch_schedule=((0, 32), (2, 64))),
        update=UpdateConfig(grad_accum=2),
        data=DataConfig(synthetic="8x8x1", augment_shift=2),
        parallel=ParallelConfig(layout="hybrid", mesh="data=2,model=2"),
        output=OutputConfig(run_name="r"),
        compile_cache="off",
    )
    pipeline = RunConfig(parallel=ParallelConfig(layout="pipeline", stage_split=(2,), microbatches=4))
    for config in (every_part, pipeline):
        assert RunConfig.from_json(json.loads(json.dumps(config.to_json()))) == config


def test_an_older_runs_flat_config_json_still_reads():
    """Runs written before the config had parts kept their flags, flat, --lr among them."""
    flat = {"model": "resnet_tiny", "conv_features": [8, 16], "lr": 0.01, "layout": "fsdp", "epochs": 3, "quiet": True}
    config = RunConfig.from_json(json.loads(json.dumps(flat)))
    assert config == RunConfig(
        model=ModelConfig(name="resnet_tiny", conv_features=(8, 16)), optim=OptimConfig(learning_rate=0.01),
        train=TrainConfig(epochs=3), parallel=ParallelConfig(layout="fsdp"), output=OutputConfig(quiet=True),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (dict(checkpoint=CheckpointConfig(resume=True)), "--resume needs --run-name"),
        (dict(checkpoint=CheckpointConfig(resume=True), output=OutputConfig(run_name="r", overwrite=True)),
         "give one"),
        (dict(parallel=ParallelConfig(layout="pipeline"), update=UpdateConfig(grad_accum=2)), "do not apply"),
        (dict(parallel=ParallelConfig(layout="dp", microbatches=2)), "apply to --layout pipeline only"),
        (dict(parallel=ParallelConfig(layout="dp", pipeline_schedule="1f1b")), "apply to --layout pipeline only"),
        (dict(parallel=ParallelConfig(layout="pipeline", pipeline_schedule="zb")), "unknown --pipeline-schedule"),
    ],
)  # fmt: skip
def test_what_the_parts_must_agree_on_is_refused(parts, message):
    with pytest.raises(UserError, match=message):
        RunConfig(**parts)


def test_a_part_refuses_its_own_bad_field():
    for build, message in [
        (lambda: DataConfig(prefetch=0), "--prefetch"),
        (lambda: ParallelConfig(layout="nope"), "unknown layout"),
        (lambda: OutputConfig(run_name="a b"), "--run-name"),
        (lambda: CheckpointConfig(keep_checkpoints=0), "--keep-checkpoints"),
        (lambda: TrainConfig(auto_batch="lots"), "as a size"),
    ]:
        with pytest.raises(UserError, match=message):
            build()


def test_from_flags_takes_a_namespace_or_a_mapping():
    flags = {"model": "resnet_tiny", "layout": "fsdp", "epochs": 3}
    assert RunConfig.from_flags(argparse.Namespace(**flags)) == RunConfig.from_flags(flags)


def test_a_config_saved_with_steps_per_call_auto_resumes_with_one_step_a_call():
    """Runs saved before `--steps-per-call auto` went hold "auto" in config.json: `--resume`
    reads it back as 1 (the same numbers as any K), not as a bad flag."""
    saved = RunConfig().to_json()
    saved["train"]["steps_per_call"] = "auto"
    assert RunConfig.from_json(saved).train.steps_per_call == 1
