"""experiments/launch_local.py as a scheduler stops it: a real SIGTERM sent to the launcher
itself is passed on to every training process, which stop at one step and save (exit 75,
the launcher's too); processes the signal ends before they can handle it end the launcher
as a process killed by it would: 128 + 15."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

LAUNCH = REPO / "experiments/launch_local.py"
RUN_LIMIT_S = 300  # a launch, start to end (they take well under a minute)
STEPS_PER_EPOCH = 89  # the bundled digits' 1,437 training images in batches of 16
# not --quiet: the signal is timed by process 0's first epoch line
FLAGS = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "16", "--epochs", "2",
         "--mesh", "data=4"]  # fmt: skip


def start(tmp_path: Path) -> subprocess.Popen:
    """The launcher of 2 processes of 2 devices, in a session of its own (so a hung run's
    whole tree can be killed)."""
    command = [LAUNCH, "--num-processes", "2", "--", *FLAGS, "--results-dir", tmp_path, "--run-name", "r"]
    return subprocess.Popen([sys.executable, *map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, start_new_session=True)  # fmt: skip


def finish(launcher: subprocess.Popen) -> str:
    """The launcher's whole output once it has ended (killed, with what it started, if it
    has not within RUN_LIMIT_S)."""
    try:
        return launcher.communicate(timeout=RUN_LIMIT_S)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # a no-op once everything has ended


def test_sigterm_to_the_launcher_reaches_every_process_and_stops_them_at_one_step(tmp_path):
    launcher = start(tmp_path)
    seen = []
    for line in launcher.stdout:  # (finish() kills whatever is left should this fail)
        seen.append(line)
        if line.startswith("[p0] epoch 1/2"):
            os.kill(launcher.pid, signal.SIGTERM)  # the launcher's own pid, not its children's
            break
    out = "".join(seen) + finish(launcher)
    assert launcher.returncode == 75, out[-3000:]  # the processes' stopped-and-saved code, passed on
    stopped = dict(re.findall(r"^\[p(\d)\] .*stopped \(SIGTERM\) at step (\d+)", out, re.MULTILINE))
    assert sorted(stopped) == ["0", "1"], out[-3000:]  # each process got the signal
    assert len(set(stopped.values())) == 1 and int(stopped["0"]) < 2 * STEPS_PER_EPOCH, stopped


def test_sigterm_before_the_processes_can_handle_it_ends_the_launcher_with_128_plus_the_signal(tmp_path):
    """SIGTERM to the launcher as soon as it has started its processes (still importing, with
    no handler of their own yet): passed on, it ends them at once; the launcher then ends as
    a process killed by SIGTERM would, 128 + 15, and does not wait for a run of 2 epochs."""
    launcher = start(tmp_path)
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    while launcher.poll() is None and not children.read_text().split():
        time.sleep(0.001)
    os.kill(launcher.pid, signal.SIGTERM)
    out = finish(launcher)
    assert launcher.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "epoch 1/2" not in out and not (tmp_path / "r").exists(), out[-3000:]
