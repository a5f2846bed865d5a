"""The one test that runs on the accelerator, where this machine has one (every other test
runs on simulated CPU devices: conftest.py). Skipped where JAX would compute on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import PLATFORMS_GIVEN, REPO

from jaxcnn.host_memory import computes_on_cpu


def _accelerator_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if PLATFORMS_GIVEN is not None:
        env["JAX_PLATFORMS"] = PLATFORMS_GIVEN
    return env


@pytest.mark.accelerator
def test_default_training_runs_on_the_accelerator(tmp_path, monkeypatch):
    env = _accelerator_env()
    with monkeypatch.context() as patch:  # computes_on_cpu reads this process's environment
        patch.delitem(os.environ, "JAX_PLATFORMS")
        if PLATFORMS_GIVEN is not None:
            patch.setenv("JAX_PLATFORMS", PLATFORMS_GIVEN)
        if computes_on_cpu():
            pytest.skip("no accelerator plugin here: JAX computes on the CPU")
    flags = ["--epochs", "1", "--max-steps", "20", "--run-name", "gpu", "--results-dir", str(tmp_path), "--quiet"]
    done = subprocess.run(
        [sys.executable, str(REPO / "experiments/train.py"), *flags], capture_output=True, text=True, env=env,
        timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "gpu" / "gpu.json").read_text())
    assert record["platform"] != "cpu" and record["steps"] == 20
