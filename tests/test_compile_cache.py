"""The persistent compile cache: a second run in a new process reads what the first compiled,
each program's compile is timed and marked cached or not, and --compile-cache off or a bad
directory behave."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO

from jaxcnn import cli, compile_cache
from jaxcnn.compiling import Compilation
from jaxcnn.errors import UserError


def _train(tmp_path, name: str, cache) -> dict:
    flags = ["--epochs", "1", "--max-steps", "3", "--quiet", "--results-dir", str(tmp_path / "runs"),
             "--run-name", name, "--compile-cache", str(cache), "--host-devices", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "experiments/train.py"), *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "runs" / name / f"{name}.json").read_text())


@pytest.mark.slow
def test_a_second_identical_train_reads_every_program_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first, second = _train(tmp_path, "first", cache), _train(tmp_path, "second", cache)
    assert [p["name"] for p in first["programs"]] == ["train", "eval", "init"]
    assert not any(p["cached"] for p in first["programs"])
    assert all(p["cached"] for p in second["programs"])
    assert second["compile_seconds"] <= 0.25 * first["compile_seconds"]
    assert first["compile_cache"] == second["compile_cache"] == str(cache)
    for record in (first, second):  # the time to the first step holds the compile and the first step
        assert record["time_to_first_step_seconds"] > record["compile_seconds"] + record["first_step_seconds"] > 0


def test_each_program_is_timed_and_marked_from_the_cache_or_not(tmp_path):
    compile_cache.enable(str(tmp_path / "cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    try:
        for expected in (False, True):  # the second compilation finds both programs on disk
            compilation = Compilation("cpu")
            compilation.lower("sin", jax.jit(lambda a: jnp.sin(a)), x)  # a new function: no in-memory reuse
            compilation.lower("cos", jax.jit(lambda a: jnp.cos(a) * 3), x)
            compiled = compilation.compile()
            assert [(t.name, t.cached) for t in compilation.timings] == [("sin", expected), ("cos", expected)]
            assert all(t.lower_seconds >= 0 and t.compile_seconds >= 0 for t in compilation.timings)
            assert float(compiled["cos"](jnp.zeros((64, 64)))[0, 0]) == 3.0
    finally:
        compile_cache.enable(None)


def test_off_means_no_cache_and_every_program_says_so():
    try:
        assert compile_cache.enable("off") is None and compile_cache.in_use() is None
        compilation = Compilation("cpu")
        compilation.lower("sin", jax.jit(jnp.sin), jax.ShapeDtypeStruct((3,), jnp.float32))
        compilation.compile()
        assert compilation.timings[0].cached is None
    finally:
        compile_cache.enable(None)


def test_the_default_directory_is_jaxcnn_cache_else_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCNN_CACHE", str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("JAXCNN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "jaxcnn")


def test_every_command_takes_compile_cache_and_a_bad_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    parser = cli.FlagParser(prog="jaxcnn test")
    try:
        with pytest.raises(
            UserError, match=r"--compile-cache .*file/cache: cannot create it.*writable directory or off"
        ):
            parser.parse_args(["--compile-cache", str(blocker / "cache")])
        assert parser.parse_args(["--compile-cache", str(tmp_path / "c")]).compile_cache == str(tmp_path / "c")
        assert compile_cache.in_use() == str(tmp_path / "c")
    finally:
        compile_cache.enable(None)
