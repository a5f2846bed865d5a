"""What makes the step fast on CPU: host memory kept between steps, convolutions left to
Eigen, unknown compiler options survived; and the profiler that found them."""

import itertools
import json
import os
import re
import resource
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, TINY_BN_DROPOUT, load_script

from jaxcnn.analysis.profiling import hlo_ops
from jaxcnn.build import build_program
from jaxcnn.commands import cli
from jaxcnn.compiling import compile_with
from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.platform_choices import YNN_FUSION_TYPES, step_compiler_options
from jaxcnn.sharding import build_mesh, get_layout

# A program with a 64 MiB temporary (the first matmul's result) and a small output: the
# shape of a train step's buffers. Prints the median page faults of 20 warm calls: the
# median, because the heap still grows now and then for a while after warm-up (a whole
# temporary of fresh pages, a few times in the first dozens of calls), and this measures
# the steady state.
FAULTS_PER_CALL = """
import resource, json, statistics
import jaxcnn, jax, jax.numpy as jnp
f = jax.jit(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2)
x, w1, w2 = jnp.ones((2048, 64)), jnp.ones((64, 8192)) / 64, jnp.ones((8192, 16))
for _ in range(10):
    f(x, w1, w2).block_until_ready()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w1, w2).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(statistics.median(faults)))
"""


def _faults_per_call(*keeps: str) -> list[float]:
    """Each setting in a process of its own (the malloc settings apply at its start), all started at once."""
    envs = [{**os.environ, "JAXCNN_KEEP_HOST_MEMORY": keep, "PYTHONPATH": str(REPO)} for keep in keeps]
    run = [sys.executable, "-c", FAULTS_PER_CALL]
    procs = [subprocess.Popen(run, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keeping_freed_host_memory_stops_most_of_each_steps_page_faults():
    untuned, tuned = _faults_per_call("0", "1")
    assert untuned > 8_000  # glibc's default: the 64 MiB temporary (16,384 pages) comes back by page faults
    assert tuned < untuned / 5  # measured here: 16,400 -> 0 (a train step of the default model: 21,328 -> 0)


def test_train_step_convolutions_run_outside_ynnpack_on_cpu():
    program = build_program(
        TINY_BN_DROPOUT, OptimConfig(), get_layout("single"), build_mesh({"data": 1}), (8, 8, 1), 16, 10,
        with_eval=False, with_init=False,
    )  # fmt: skip
    text = program.train_step.as_text()
    ops = hlo_ops(text)
    ynn_bodies = {line.split("calls=")[1].split(",")[0] for line in text.splitlines() if "__ynn_fusion" in line}
    bodies = text.split("\n\n")
    convolutions_in_ynn = [b for b in bodies if b.split(" ")[0] in ynn_bodies and " convolution(" in b]
    assert any(op["kind"] == "convolution" for op in ops.values())  # forward, input and kernel gradients
    assert not convolutions_in_ynn
    assert any(op["kind"] == "ynn" for op in ops.values())  # dots and reductions still go to YNNPACK


def test_the_optimizer_updates_donated_parameters_in_place_without_copying_them():
    # without the barrier in jaxcnn.optim.apply_optimizer XLA copies the dense kernels
    # (nothing orders their last readers before the update): 103 MB a step at 224x224
    program = build_program(
        ModelConfig(), OptimConfig(), get_layout("single"), build_mesh({"data": 1}), (28, 28, 1), 16, 10,
        with_eval=False, with_init=False,
    )  # fmt: skip
    copied = [line for line in program.train_step.as_text().splitlines() if re.search(r" copy\(%state_params", line)]
    kernels = [line for line in copied if "kernel" in line]
    assert not kernels, kernels


def test_a_ynn_choice_in_xla_flags_wins_over_jaxcnns(monkeypatch):
    assert step_compiler_options("cpu")[YNN_FUSION_TYPES]
    monkeypatch.setenv("XLA_FLAGS", f"--{YNN_FUSION_TYPES}=")
    assert step_compiler_options("cpu") is None


def test_a_compiler_option_this_jaxlib_does_not_know_is_dropped_with_a_warning():
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    with pytest.warns(UserWarning, match="xla_cpu_no_such_option"):
        compiled = compile_with(lowered, {"xla_cpu_no_such_option": True})
    assert jnp.array_equal(compiled(jnp.ones(3)), jnp.full(3, 2.0))


def test_profile_attributes_the_step_to_ops_of_its_compiled_program(tmp_path):
    rows, summary = load_script("profile_step").main(
        ["--size", "8", "--steps", "2", "--out-dir", str(tmp_path), "--trace-dir", str(tmp_path / "trace")]
    )
    assert rows and abs(sum(r["share_of_traced"] for r in rows) - 1) < 1e-6
    assert all(a["thread_ms_per_step"] >= b["thread_ms_per_step"] for a, b in itertools.pairwise(rows))
    # the ops the trace names are the compiled step's instructions: nearly all time is joined to one
    joined = sum(r["share_of_traced"] for r in rows if r["kind"])
    assert joined > 0.9
    assert summary["step_seconds_traced"] > 0
    # under jaxcnn's malloc settings the heap settles, and then a typical step does not fault its temp buffer in
    assert summary["warmup_steps"] < 60
    assert summary["minor_page_faults_per_step"] < max(64, summary["temp_bytes"] // resource.getpagesize() // 100)
    assert (tmp_path / "profile_8.csv").exists() and list((tmp_path / "trace").rglob("*.xplane.pb"))


def test_profile_rejects_an_unknown_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main("profile_step.py", lambda: load_script("profile_step").main(["--size", "99"]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "profile_step.py: error: --size must be one of 8, 28, 224, got '99'"
