"""The persistent compile cache: a second run in a new process reads what the first compiled,
each program's compile is timed and marked cached or not, every command takes
--compile-cache, and off or a bad directory behave."""

import importlib
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO

from jaxcnn import compile_cache
from jaxcnn.commands import COMMANDS, cli, module_name
from jaxcnn.compiling import Compilation
from jaxcnn.errors import UserError


def _train(tmp_path, name: str, cache) -> dict:
    flags = ["--epochs", "1", "--max-steps", "3", "--quiet", "--results-dir", str(tmp_path / "runs"),
             "--run-name", name, "--compile-cache", str(cache), "--host-devices", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "experiments/train.py"), *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "runs" / name / f"{name}.json").read_text())


@pytest.mark.slow
def test_a_second_identical_train_reads_its_programs_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first, second = _train(tmp_path, "first", cache), _train(tmp_path, "second", cache)
    # the digits go on the devices (--data-on-device auto): the step compiled is the one that gathers them
    assert [p["name"] for p in first["programs"]] == ["train/device/1", "eval", "init"]
    assert not any(p["cached"] for p in first["programs"])
    # every program JAX stored is read back (it stores those that took MIN_COMPILE_SECONDS or more)
    stored = [p["name"] for p in first["programs"] if p["compile_seconds"] >= compile_cache.MIN_COMPILE_SECONDS]
    assert {"train/device/1", "eval"} <= set(stored)
    assert all(p["cached"] for p in second["programs"] if p["name"] in stored)
    assert second["compile_seconds"] <= 0.25 * first["compile_seconds"]
    assert first["compile_cache"] == second["compile_cache"] == str(cache)
    for record in (first, second):  # the time to the first step holds the compile and the first step
        assert record["time_to_first_step_seconds"] > record["compile_seconds"] + record["first_step_seconds"] > 0


def test_each_program_is_timed_and_marked_from_the_cache_or_not(tmp_path):
    compile_cache.enable(str(tmp_path / "cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    cold = {}  # the first compilation's seconds per program
    try:
        for second in (False, True):  # the second compilation finds sin and cos on disk, not tan
            compilation = Compilation("cpu")
            compilation.lower("sin", jax.jit(lambda a: jnp.sin(a)), x)  # a new function: no in-memory reuse
            compilation.lower("cos", jax.jit(lambda a: jnp.cos(a) * 3), x)
            if second:
                compilation.lower("tan", jax.jit(lambda a: jnp.tan(a)), x)
            compiled = compilation.compile()
            expected = [("sin", second), ("cos", second)] + [("tan", False)] * second
            assert [(t.name, t.cached) for t in compilation.timings] == expected
            assert all(t.lower_seconds > 0 and t.compile_seconds > 0 for t in compilation.timings), compilation.timings
            seconds = {t.name: t.compile_seconds for t in compilation.timings}
            if not second:
                cold = seconds
            else:  # reading a program from disk is quicker than compiling it (here ~2 ms against ~40)
                assert all(seconds[name] < cold[name] for name in cold), (cold, seconds)
            assert float(compiled["cos"](jnp.zeros((64, 64)))[0, 0]) == 3.0
    finally:
        compile_cache.enable(None)


def test_off_writes_nothing_and_marks_no_program_and_on_again_reads(tmp_path):
    x = jax.ShapeDtypeStruct((3,), jnp.float32)

    def compile_one(body):
        compilation = Compilation("cpu")
        compilation.lower("f", jax.jit(body), x)
        compilation.compile()
        return compilation.timings[0].cached

    try:
        compile_cache.enable(str(tmp_path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        assert compile_one(lambda a: a + 1) is False
        entries = sorted(p.name for p in tmp_path.iterdir())
        assert entries
        assert compile_cache.enable("off") is None and compile_cache.in_use() is None
        assert compile_one(lambda a: a + 2) is None
        assert sorted(p.name for p in tmp_path.iterdir()) == entries  # off: nothing written
        compile_cache.enable(str(tmp_path))
        assert compile_one(lambda a: a + 1) is True  # on again: read
    finally:
        compile_cache.enable(None)


def test_the_default_directory_is_jaxcnn_cache_else_under_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXCNN_CACHE", str(tmp_path / "mine"))
    assert compile_cache.default_dir() == str(tmp_path / "mine")
    monkeypatch.delenv("JAXCNN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "jaxcnn")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_offers_compile_cache(command, capsys):
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"jaxcnn.commands.{module_name(command)}").parse_flags(["--help"])
    assert done.value.code == 0 and "--compile-cache DIR|off" in capsys.readouterr().out


def test_a_bad_directory_is_one_clear_error_by_name_and_a_warning_by_default(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    parser = cli.FlagParser(prog="jaxcnn test")
    try:
        with pytest.raises(UserError, match=r"--compile-cache .*file/cache'?: cannot be created.*directory or off"):
            parser.parse_args(["--compile-cache", str(blocker / "cache")])
        with pytest.raises(UserError, match="is empty"):
            parser.parse_args(["--compile-cache", ""])
        monkeypatch.delenv("JAXCNN_CACHE")
        monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the default directory cannot be made
        with pytest.warns(UserWarning, match="no compile cache"):
            assert parser.parse_args([]).compile_cache is None
        assert compile_cache.in_use() is None
        assert parser.parse_args(["--compile-cache", str(tmp_path / "c")]).compile_cache == str(tmp_path / "c")
        assert compile_cache.in_use() == str(tmp_path / "c")
    finally:
        monkeypatch.undo()
        compile_cache.enable(None)
