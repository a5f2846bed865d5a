"""A trained run's model leaves jaxcnn: as ONNX (jax2onnx; ONNX Runtime runs it) or StableHLO
(`jax.export`), with a batch of any size, and a sidecar JSON saying how to feed it.

    summary = export_run(run, ("onnx", "stablehlo"), run.directory / "export", check_examples=512)

    <run>/export/model.onnx        input "images" [batch, H, W, C], output "logits"
                 model.stablehlo   jax.export's Exported.serialize(): jax.export.deserialize reads it
                 model.json        the sidecar (jaxcnn.export.sidecar), with the checks below

Nothing is written unless every artefact, run back (ONNX Runtime; `jax.export.deserialize`)
on the first `check_examples` of the run's test set as one batch and on its first example
alone, gives the run's own logits (`jaxcnn predict`'s, jaxcnn.inference) within rtol 1e-4
(atol 1e-4 x the largest logit). The files appear together, by one rename.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np

from jaxcnn.data import load_datasets
from jaxcnn.errors import UserError
from jaxcnn.export.formats import (
    image_spec,
    inference_function,
    onnx_bytes,
    run_onnx,
    run_stablehlo,
    stablehlo_bytes,
)
from jaxcnn.export.sidecar import sidecar
from jaxcnn.inference import load_predictor
from jaxcnn.results import write_json
from jaxcnn.run_config import ParallelConfig
from jaxcnn.runs import Run
from jaxcnn.sharding import mesh_for

FORMATS = ("onnx", "stablehlo")
FILES = {"onnx": "model.onnx", "stablehlo": "model.stablehlo"}
SIDECAR = "model.json"
RTOL = 1e-4  # and atol RTOL x the largest |logit|: logits near 0 carry float32's summation-order noise

__all__ = ["FILES", "FORMATS", "SIDECAR", "compare", "export_run", "reference_sample"]


def export_run(run: Run, formats: tuple[str, ...], out: Path, check_examples: int, classes: list[str]) -> dict:
    """Write `formats` of the run's model and its sidecar to `out` (which must not exist),
    each checked against the run's own logits first; the sidecar, with the checks."""
    config = run.config
    image_shape = tuple(run.record["image_shape"])
    images, reference, source = reference_sample(run, check_examples)
    dtype = images.dtype.name
    function = inference_function(run.model_dir, config.model, image_shape)
    spec = image_spec(image_shape, dtype)
    artefacts, checks = {}, []
    for name in formats:
        if name == "onnx":
            data = onnx_bytes(function, spec, run.record["model"])
            runner = run_onnx
        else:
            data = stablehlo_bytes(function, spec)
            runner = run_stablehlo
        whole, first = runner(data, images), runner(data, images[:1])  # two batch sizes, one artefact
        both = compare(name, np.concatenate([whole, first]), np.concatenate([reference, reference[:1]]))
        checks.append({**both, "examples": len(images), "batch_sizes": [len(images), 1]})
        artefacts[FILES[name]] = data
    failed = [c for c in checks if not c["within_tolerance"]]
    if failed:
        c = failed[0]
        raise UserError(
            f"the {c['format']} export's logits differ from the run's by up to {c['max_abs_diff']:.3g} "
            f"({c['max_rel_diff']:.3g} of the largest logit), beyond rtol {RTOL:g}; nothing written"
        )
    info = sidecar(run, classes, image_shape, dtype, {n: FILES[n] for n in formats})
    info["check"] = {"data": f"the first {len(images)} examples of the run's test set ({source})", "results": checks}
    _write_together(out, artefacts, info)
    return info


def reference_sample(run: Run, examples: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(the first `examples` images of the run's test set, as its model takes them; the
    run's own logits for them, from `jaxcnn predict`'s path; the test set's source)."""
    config = run.config
    test = load_datasets(config.data, config.model.num_classes, config.train.seed, decode_test=False)[1]
    sample = test.subset(np.arange(min(examples, len(test)))).loaded()
    layout, mesh = mesh_for(ParallelConfig(layout="single"), jax.devices()[:1])
    batch = min(len(sample), config.train.eval_batch_size or config.train.batch_size)
    predictor = load_predictor(
        run.model_dir, config.model, sample.image_shape, layout, mesh, batch, image_dtype=sample.images.dtype.name
    )
    return np.asarray(sample.images), predictor.logits(sample), test.source


def compare(name: str, logits: np.ndarray, reference: np.ndarray) -> dict:
    """How far `logits` are from `reference`: the figures the command prints and the sidecar keeps."""
    largest = float(np.abs(reference).max())
    diff = np.abs(logits.astype(np.float64) - reference)
    return {
        "format": name,
        "examples": len(reference),
        "max_abs_diff": float(diff.max()),
        "max_rel_diff": float(diff.max() / largest) if largest else 0.0,
        "largest_logit": largest,
        "same_predictions": float(np.mean(logits.argmax(-1) == reference.argmax(-1))),
        "within_tolerance": bool(np.allclose(logits, reference, rtol=RTOL, atol=RTOL * largest)),
    }


def _write_together(out: Path, artefacts: dict[str, bytes], info: dict) -> None:
    """Every file in a fresh directory beside `out`, then renamed to `out` at once; an
    `out` already there (the caller allowed it: --overwrite) is replaced only then."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging, aside = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("partial", "replaced"))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for file, data in artefacts.items():
            (staging / file).write_bytes(data)
        write_json(staging / SIDECAR, info)
        if out.exists():
            out.rename(aside)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if aside.exists() and not out.exists():  # the old export comes back
            aside.rename(out)
        raise
    shutil.rmtree(aside, ignore_errors=True)
