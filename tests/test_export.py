"""`jaxcnn export`: a trained run's model as ONNX (run here by ONNX Runtime) and StableHLO
(read back by jax.export.deserialize), each giving the run's own logits at any batch size;
the sidecar's preprocessing, applied to raw files by code that knows nothing of jaxcnn,
reproduces `jaxcnn predict`; an export is never overwritten without --overwrite; bad input
and an operation the converter lacks are one line."""

import json
import shutil

import cv2
import jax
import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
from conftest import REPO, load_train_module, write_folder
from PIL import Image

from jaxcnn.commands import cli, export, predict
from jaxcnn.data import Dataset
from jaxcnn.errors import UserError
from jaxcnn.export.formats import image_spec, onnx_bytes, run_onnx
from jaxcnn.inference import load_predictor
from jaxcnn.layers import max_pool_2x2, max_pool_window
from jaxcnn.runs import open_run
from jaxcnn.sharding import build_mesh, get_layout

TINY_CSV = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--dropout", "0.25", "--batch-size", "32",
            "--max-steps", "6", "--host-devices", "8", "--quiet"]  # fmt: skip
RTOL = 1e-4


def close(logits, reference) -> bool:
    """rtol 1e-4, with atol 1e-4 x the largest logit (logits near 0 carry summation-order noise)."""
    return np.allclose(logits, reference, rtol=RTOL, atol=RTOL * np.abs(reference).max())


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    """A run on the bundled digits (CSV: float32 pixels; batch norm and dropout), exported."""
    results = tmp_path_factory.mktemp("runs")
    load_train_module().main([*TINY_CSV, "--results-dir", str(results), "--run-name", "r"])
    info = export.main(["--run", str(results / "r"), "--check-examples", "40"])
    return results / "r", info


def _the_runs_logits(run_dir, images: np.ndarray) -> np.ndarray:
    """The run's model under the layout it trained with (dp on the suite's 8 devices)."""
    run = open_run(run_dir)
    predictor = load_predictor(
        run.model_dir, run.config.model, images.shape[1:], get_layout("dp"), build_mesh({"data": 8}), 8,
        image_dtype=images.dtype.name,
    )  # fmt: skip
    return predictor.logits(Dataset(images, None, "test"))


def _onnx_session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_onnx_and_stablehlo_give_the_runs_logits_at_two_batch_sizes(csv_run, capsys):
    run_dir, info = csv_run
    out = run_dir / "export"
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.onnx", "model.stablehlo"]
    assert json.loads((out / "model.json").read_text()) == json.loads(json.dumps(info))
    assert all(check["within_tolerance"] for check in info["check"]["results"])
    assert [(c["format"], c["examples"], c["batch_sizes"]) for c in info["check"]["results"]] == [
        ("onnx", 40, [40, 1]),
        ("stablehlo", 40, [40, 1]),
    ]
    images = np.random.default_rng(0).random((7, 8, 8, 1), dtype=np.float32)
    reference = _the_runs_logits(run_dir, images)
    session = _onnx_session(out / "model.onnx")
    (given,) = session.get_inputs()
    assert given.name == "images" and isinstance(given.shape[0], str) and given.shape[1:] == [8, 8, 1]
    stablehlo = jax.export.deserialize(bytearray((out / "model.stablehlo").read_bytes()))
    for batch in (3, 7):  # one artefact, two batch sizes: the batch is symbolic
        assert close(session.run(["logits"], {"images": images[:batch]})[0], reference[:batch]), batch
        assert close(np.asarray(stablehlo.call(images[:batch])), reference[:batch]), batch
    assert not close(reference[::-1], reference)  # the check can fail


def test_the_sidecar_preprocessing_of_a_csv_reproduces_predict(csv_run, tmp_path):
    """A server reads the raw CSV with pandas, scales it as the sidecar says and runs ONNX
    Runtime: the labels `jaxcnn predict` writes, and the run's logits."""
    run_dir, info = csv_run
    steps = info["preprocessing"]
    assert info["input"]["dtype"] == "float32" and info["input"]["layout"] == "NHWC"
    assert steps["training_file_full_scale"] == 16 and "1, 16, 255, 65535" in steps["steps"][1]
    frame = pd.read_csv(REPO / "data/test.csv")
    pixels = frame[[c for c in frame.columns if c.startswith("pixel")]].to_numpy(np.float64)
    scale = next(s for s in (1, 16, 255, 65535) if pixels.max() <= s)
    height, width, channels = info["input"]["shape"][1:]
    images = (pixels / scale).astype(np.float32).reshape(-1, height, width, channels)
    logits = _onnx_session(run_dir / "export" / "model.onnx").run(["logits"], {"images": images})[0]
    predicted = predict.main(["--run", str(run_dir), "--data", str(REPO / "data/test.csv"), "--out",
                              str(tmp_path / "p.csv")])  # fmt: skip
    assert (logits.argmax(-1) == predicted["Label"].to_numpy()).all()
    assert close(logits, _the_runs_logits(run_dir, images))


def _server_images(sidecar: dict, paths) -> np.ndarray:
    """What a server that reads only the sidecar does to image files fitted by resizing."""
    height, width, channels = sidecar["input"]["shape"][1:]
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
    out = []
    for path in paths:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert(mode), np.uint8).reshape(image.size[1], image.size[0], channels)
        shrink = max(pixels.shape[0] / height, pixels.shape[1] / width)
        interpolation = cv2.INTER_AREA if shrink >= 2 else cv2.INTER_LINEAR
        if pixels.shape[:2] != (height, width):
            pixels = cv2.resize(pixels, (width, height), interpolation=interpolation).reshape(height, width, channels)
        out.append(pixels)
    return np.stack(out)


def test_a_depthwise_model_on_image_files_exports_to_onnx_and_its_sidecar_reproduces_predict(tmp_path, capsys):
    """MobileNetV2 (depthwise convs, ReLU6) trained on an image folder: uint8 input; raw
    files of another size, decoded and resized as the sidecar says, give predict's labels
    and probabilities."""
    train = write_folder(tmp_path / "train", per_class=4, size=(16, 16))
    load_train_module().main(
        ["--data", str(train), "--val-split", "0.25", "--channels", "3", "--num-classes", "3",
         "--model", "mobilenet_v2_test", "--width-multiplier", "0.25", "--batch-size", "8", "--max-steps", "2",
         "--host-devices", "8", "--quiet", "--results-dir", str(tmp_path), "--run-name", "m"]
    )  # fmt: skip
    info = export.main(["--run", str(tmp_path / "m"), "--format", "onnx"])
    assert "onnx       max |diff|" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "m" / "export").iterdir()) == ["model.json", "model.onnx"]
    assert info["input"]["dtype"] == "uint8" and info["classes"] == ["cat", "dog", "owl"]
    assert info["preprocessing"]["fit"] == "resize" and all(c["within_tolerance"] for c in info["check"]["results"])
    photos = tmp_path / "photos"  # to label: no class subfolders, two sizes (one shrinks 2x: OpenCV's area)
    write_folder(tmp_path / "a", per_class=3, size=(20, 24), classes=("x",), seed=1)
    write_folder(tmp_path / "b", per_class=3, size=(40, 36), classes=("x",), seed=2)
    photos.mkdir()
    for k, path in enumerate([*sorted((tmp_path / "a" / "x").iterdir()), *sorted((tmp_path / "b" / "x").iterdir())]):
        shutil.copy(path, photos / f"{k}{path.suffix}")
    predicted = predict.main(["--run", str(tmp_path / "m"), "--data", str(photos), "--layout", "single"])
    images = _server_images(info, predicted["path"])
    logits = _onnx_session(tmp_path / "m" / "export" / "model.onnx").run(["logits"], {"images": images})[0]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert [info["classes"][k] for k in probs.argmax(-1)] == list(predicted["label"])
    np.testing.assert_allclose(probs.max(-1), predicted["probability"], atol=2e-6)


def test_an_export_is_never_overwritten_without_overwrite(csv_run, capsys):
    run_dir, _ = csv_run
    out = run_dir / "export"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as stop:
        cli.run_main(export.PROG, lambda: export.main(["--run", str(run_dir), "--format", "stablehlo"]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and "already exists; pass --overwrite" in lines[0], lines
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    export.main(["--run", str(run_dir), "--format", "stablehlo", "--overwrite", "--check-examples", "4"])
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.stablehlo"]
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []  # nothing left aside
    export.main(["--run", str(run_dir), "--overwrite", "--check-examples", "40"])  # as the module's fixture left it


def test_bad_input_is_one_line_and_exit_2(csv_run, tmp_path, capsys):
    run_dir, _ = csv_run
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run_dir, unfinished, ignore=shutil.ignore_patterns("model", "export"))
    cases = {
        "no run": (["--run", str(tmp_path / "nowhere")], "not found; pass --run"),
        "not a run": (["--run", str(tmp_path)], "is not a run directory"),
        "no kept model": (["--run", str(unfinished)], "has no trained model"),
        "unknown format": (["--run", str(run_dir), "--format", "tflite"], "unknown --format tflite; use some of onnx"),
        "no examples": (["--run", str(run_dir), "--check-examples", "0"], "--check-examples must be a positive"),
    }
    for case, (flags, message) in cases.items():
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as stop:
            cli.run_main(export.PROG, lambda flags=flags, out=out: export.main([*flags, "--out", str(out)]))
        lines = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(lines) == 1 and message in lines[0], (case, lines)
        assert not out.exists(), case


@pytest.mark.parametrize("pool", [max_pool_2x2, max_pool_window], ids=["select", "window"])
def test_the_cnns_pools_on_an_odd_map_convert_exactly_at_any_batch(pool):
    """An odd 7x7 map: the select pool pads (jax2onnx's pad fails on a symbolic batch), the
    window pool is a reduce_window (a four-axis MaxPool ONNX Runtime refuses): both replayed
    (jaxcnn.export.inlined), both exact."""
    data = onnx_bytes(pool, image_spec((7, 7, 3), "float32"), "pool")
    x = np.random.default_rng(1).normal(size=(5, 7, 7, 3)).astype(np.float32)
    for batch in (2, 5):
        assert np.array_equal(run_onnx(data, x[:batch]), np.asarray(pool(x[:batch]))), batch


def test_an_operation_jax2onnx_lacks_is_one_line_naming_it():
    """A kernel chosen per platform (lax.platform_dependent: a platform_index operation, which
    jax2onnx does not convert): the error names it and the way out."""
    spec = image_spec((2, 2, 1), "float32")
    per_platform = lambda x: jax.lax.platform_dependent(x, cpu=lambda x: 2 * x, default=lambda x: x + 1)  # noqa: E731
    with pytest.raises(UserError) as err:
        onnx_bytes(lambda x: per_platform(x).sum((1, 2, 3)), spec, "m")
    message = str(err.value)
    assert "'platform_index'" in message and "--format stablehlo" in message and "\n" not in message, message
