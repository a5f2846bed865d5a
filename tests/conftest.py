"""8 simulated CPU devices for every test, wherever it runs (on a GPU machine JAX would pick
the GPU, where the 8-device tests cannot run): set before anything touches a JAX device, and
inherited by the tests' subprocesses. `test_accelerator.py` alone runs on the accelerator.
The commands' compile cache goes to a directory of the session's own, never
~/.cache/jaxcnn, and is on from the start: tests (and their subprocesses) that compile the
same program share it."""

import atexit
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile

PLATFORMS_GIVEN = os.environ.get("JAX_PLATFORMS")  # what the user's environment said, for test_accelerator
os.environ["JAX_PLATFORMS"] = "cpu"

if "JAXCNN_TEST_CACHE" not in os.environ:  # pytest-xdist's workers share their controller's
    os.environ["JAXCNN_TEST_CACHE"] = tempfile.mkdtemp(prefix="jaxcnn-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXCNN_TEST_CACHE"], ignore_errors=True)
os.environ["JAXCNN_CACHE"] = os.environ["JAXCNN_TEST_CACHE"]

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jaxcnn import compile_cache  # noqa: E402

compile_cache.enable(None)  # from the start, as the commands would: whatever runs, a program compiles once

import functools  # noqa: E402
import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from jaxcnn.config import ModelConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Tiny family members for fast tests: same code paths, small widths.
TINY_PLAIN = ModelConfig(
    name="cnn2d_2layer_fullconnected_2layer", conv_features=(8, 16), dense_features=(32,), norm="none"
)
TINY_BN_DROPOUT = ModelConfig(
    name="cnn2d_2layer_fullconnected_2layer", conv_features=(8, 16), dense_features=(32,), norm="batch", dropout=0.25
)


def write_digits_csv(path: Path, rows: int = 40, side: int = 8, channels: int = 1, labels: bool = True, seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 17, size=(rows, side * side * channels))
    frame = pd.DataFrame(pixels, columns=[f"pixel{i}" for i in range(pixels.shape[1])])
    if labels:
        frame.insert(0, "label", np.arange(rows) % 10)
    frame.to_csv(path, index=False)
    return path


def write_folder(root: Path, per_class: int = 6, size=(10, 12), classes=("cat", "dog", "owl"), seed=0) -> Path:
    """PNG and JPEG images of every mode, `size` = (H, W); each class a brightness band."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((*size, 4)) * 60 + 80 * c).astype(np.uint8)
            mode, ext = [("RGB", "png"), ("L", "jpg"), ("RGBA", "png"), ("RGB", "jpeg")][i % 4]
            channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
            image = Image.fromarray(pixels[..., :channels].squeeze(), mode)
            image.save(root / name / f"{i:03d}.{ext}")
    return root


@pytest.fixture
def digits_csv(tmp_path):
    return write_digits_csv(tmp_path / "train.csv")


def _optim():
    from jaxcnn.config import OptimConfig

    return OptimConfig(learning_rate=1e-2, warmup_steps=2)


def load_script(name: str):
    """experiments/<name>.py as a module, to call its main() in-process."""
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", REPO / f"experiments/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_train_module():
    return load_script("train")


def jit_initialised(make):
    """The module `make()` returns, its variables made by one jitted init compiled as the
    programs' own init is (unoptimised on a CPU) instead of eagerly, where each initializer
    of a new shape compiles, optimised, on its own: seconds apiece."""
    from flax import nnx

    from jaxcnn.platform_choices import init_compiler_options

    graphdef = nnx.graphdef(nnx.eval_shape(make))
    init = jax.jit(lambda: nnx.state(make())).lower()
    return nnx.merge(graphdef, init.compile(compiler_options=init_compiler_options(jax.default_backend()))())


@functools.cache
def _initialised(model_config, image_shape, seed):
    from flax import nnx

    from jaxcnn.models import build_model

    return nnx.split(jit_initialised(lambda: build_model(model_config, image_shape, seed)))


def initialised(model_config, image_shape, seed=0):
    """build_model(model_config, image_shape, seed), initialised as jit_initialised does
    (once per configuration; each call a module of its own)."""
    from flax import nnx

    return nnx.merge(*_initialised(model_config, tuple(image_shape), seed))


@functools.cache
def bundled_digits():
    from jaxcnn.data import load_csv

    return load_csv(REPO / "data/train.csv")


_PROGRAMS: dict = {}


def compiled_program(
    layout, mesh_shape, model_config=TINY_PLAIN, steps=20, batch_size=32, seed=0, image_shape=None, update=None,
    optim=None,
):  # fmt: skip
    """One compiled program per configuration for the whole session (tests share them)."""
    from jaxcnn.build import build_program
    from jaxcnn.config import UpdateConfig
    from jaxcnn.sharding import build_mesh

    image_shape = image_shape or bundled_digits().image_shape
    update = None if update == UpdateConfig() else update  # the default shares the plain programs
    key = (layout, tuple(mesh_shape.items()), model_config, steps, batch_size, seed, image_shape, update, optim)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build_program(
            model_config, optim or _optim(), layout, build_mesh(mesh_shape), image_shape, batch_size, steps,
            seed=seed, with_eval=False, update=update,  # the harness trains without a test set
        )  # fmt: skip
    return _PROGRAMS[key]


def train_losses(
    layout, mesh_shape, model_config=TINY_PLAIN, steps=20, batch_size=32, seed=0, data=None, update=None, optim=None
):
    """Train `steps` steps on the bundled digits; return (per-step losses, final state, program)."""
    from jaxcnn.config import TrainConfig
    from jaxcnn.fit import fit

    data = data or bundled_digits()
    config = TrainConfig(batch_size=batch_size, epochs=1, max_steps=steps, seed=seed)
    program = compiled_program(
        layout, mesh_shape, model_config, steps, batch_size, seed, data.image_shape, update, optim
    )
    result = fit(program, program.init(), data, None, config, progress=False)
    return np.asarray(result.loss_history), result.state, program


# The stop and cluster tests' run: a tiny CNN on the bundled digits, 2 epochs of 89 steps on 4
# devices; not --quiet: those tests time their signals by its epoch lines
TWO_EPOCHS_ON_4 = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "16", "--epochs", "2",
                   "--mesh", "data=4"]  # fmt: skip


@pytest.fixture(scope="session")
def uninterrupted() -> dict:
    """The run record of TWO_EPOCHS_ON_4 in one process, never stopped: what every stopped,
    requeued or restarted run of it must end with. Run once per session: the first of
    pytest-xdist's workers to ask runs it (the others wait on the lock) and leaves it in the
    session's directory."""
    shared = Path(os.environ["JAXCNN_TEST_CACHE"]) / "uninterrupted"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "ref" / "ref.json"
        if not record.exists():
            proc = subprocess.run([sys.executable, str(REPO / "experiments/train.py"), *TWO_EPOCHS_ON_4,
                                   "--host-devices", "4", "--results-dir", str(shared), "--run-name", "ref", "--quiet"],
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(record.read_text())
