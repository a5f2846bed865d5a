"""Result files: `<run>.json` (one object) and `<run>.csv` (one row per epoch, EPOCH_COLUMNS).

Files are written to a temporary name and renamed into place, so a failed or interrupted
run never leaves a half-written result over a good one; they get the mode a plain `open`
would (0644 under the usual umask 022), not mkstemp's private 0600.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from jaxcnn.config import DIVERGENCE_FACTOR
from jaxcnn.errors import UserError

EPOCH_COLUMNS = [
    "epoch",
    "step",
    "global_batch_size",
    "train_loss",
    "train_accuracy",
    "test_loss",
    "test_accuracy",
    "epoch_seconds",
    "images_per_second",
    "input_wait_fraction",
]


def ensure_writable_dir(path: str | Path, flag: str = "--results-dir") -> Path:
    """Create the directory `flag` names if needed and prove it is writable, before any work."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise UserError(f"directory {path} cannot be written ({err.strerror}); pass a writable {flag}") from None
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would create


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain(value):
    """numpy scalars/arrays -> JSON-ready Python values."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def write_json(path: str | Path, record: dict) -> Path:
    path = Path(path)
    _atomic_write(path, json.dumps(_plain(record), indent=2) + "\n")
    return path


def write_csv(path: str | Path, rows: Iterable[dict], columns: list[str] | None = None) -> Path:
    path = Path(path)
    frame = pd.DataFrame(list(rows), columns=columns)
    _atomic_write(path, frame.to_csv(index=False))
    return path


def write_run(results_dir: Path, run_name: str, record: dict, epoch_rows: list[dict]) -> tuple[Path, Path]:
    json_path = write_json(results_dir / f"{run_name}.json", record)
    csv_path = write_csv(results_dir / f"{run_name}.csv", epoch_rows, EPOCH_COLUMNS)
    return json_path, csv_path


def write_submission(path: str | Path, predictions: np.ndarray) -> Path:
    """Kaggle's submission format: ImageId (from 1), Label."""
    frame = pd.DataFrame({"ImageId": np.arange(1, len(predictions) + 1), "Label": predictions.astype(int)})
    path = Path(path)
    _atomic_write(path, frame.to_csv(index=False))
    return path


def summary_text(record: dict) -> str:
    """The one-screen summary printed at the end of a run."""
    schedule = record.get("batch_schedule")
    batch = " -> ".join(str(b) for _, b in schedule) if schedule else record["global_batch_size"]

    def pct(x):
        if x is None:
            return "n/a (interrupted)" if record.get("interrupted_at_step") else "n/a (no labels)"
        return f"{100 * x:.2f}%"

    mesh = ",".join(f"{k}={v}" for k, v in record["mesh"].items())
    diverged = record.get("diverged_at_step")
    lines = [
        f"model           {record['model']} ({record['num_params']:,} parameters)",
        f"layout          {record['layout']}  mesh {mesh}  ({record['num_devices']} x {record['device_kind']}"
        f"{', simulated' if record.get('simulated_devices') else ''}; {record['num_processes']} process(es))",
        f"training        {record['steps']} steps x batch {batch}, final loss "
        + (f"{record['loss_history'][-1]:.4f}" if record["loss_history"] else "n/a"),
        f"test accuracy   {pct(record['test_accuracy'])}"
        + (f"  (loss {record['test_loss']:.4f})" if record["test_loss"] is not None else ""),
        throughput_line(record),
        f"time            {record['wall_seconds']:.1f} s wall, {record['compile_seconds']:.1f} s compile"
        + (f" ({record['lower_seconds']:.1f} s tracing before it)" if record.get("lower_seconds") is not None else "")
        + (
            f", first step done {record['time_to_first_step_seconds']:.1f} s after the start"
            if record.get("time_to_first_step_seconds") is not None
            else ""
        ),
    ]
    if record.get("programs"):
        lines.append(compile_line(record["programs"], record.get("compile_cache")))
    if diverged is not None:
        lines.insert(3, f"diverged        at step {diverged}: loss above {DIVERGENCE_FACTOR:g}x step 1's; lower --lr")
    return "\n".join(lines)


def compile_line(programs: list[dict], cache: str | None) -> str:
    """Each program's compile seconds and whether the persistent cache answered it."""

    def one(p):
        cached = " (cached)" if p["cached"] else ""
        return f"{p['name']} {p['compile_seconds']:.1f} s{cached}"

    where = f"cache {cache}" if cache else "no compile cache"
    return f"compiled        {', '.join(one(p) for p in programs)}; {where}"


def throughput_line(record: dict) -> str:
    if record["images_per_second"] is None:  # resumed at the end: this run trained no step
        return f"throughput      none: nothing left to train (resumed at step {record['steps']} of {record['steps']})"
    return (
        f"throughput      {record['images_per_second']:,.0f} images/s (steady state), "
        f"input wait {100 * record['input_wait_fraction']:.1f}%"
    )
