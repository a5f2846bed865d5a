"""The sidecar JSON beside an export: everything a server needs to feed the model, and
nothing of jaxcnn's -- the input (name, shape, dtype, NHWC), how a raw image or row
becomes that input (the run's own pixel path, jaxcnn.data), the output and the classes.

jaxcnn's models take pixels in [0, 1] with no mean or standard deviation subtracted (a
model started from torchvision's weights too): a CSV's pixels are divided by the file's
full scale, an IDX file's by 255, and an image folder's travel as uint8 0-255 into the
model, which divides them by 255 itself -- so its export takes uint8 and the server only
decodes, converts and resizes (or centre-crops) as the run's evaluation did.
"""

from __future__ import annotations

from pathlib import Path

from jaxcnn.config import BUNDLED_TRAIN
from jaxcnn.data.crops import CENTRE_SHARE
from jaxcnn.data.folders import MODES
from jaxcnn.data.resize import AREA_FROM
from jaxcnn.data.sources import FULL_SCALES, csv_full_scale
from jaxcnn.export.formats import INPUT, OUTPUT
from jaxcnn.run_config import BUNDLED_DATASET, RunConfig
from jaxcnn.runs import Run

SIDECAR_VERSION = 1
NO_NORMALISATION = "none: the model takes pixels as given here (no mean or standard deviation subtracted)"


def sidecar(run: Run, classes: list[str], image_shape: tuple[int, int, int], dtype: str, files: dict[str, str]) -> dict:
    """The sidecar of a run's export: `files` maps each format to its file's name."""
    height, width, channels = image_shape
    return {
        "sidecar_version": SIDECAR_VERSION,
        "run": run.name,
        "model": run.record["model"],
        "model_config": run.config.to_json()["model"],
        "files": files,
        "input": {
            "name": INPUT,
            "shape": ["batch", height, width, channels],
            "dtype": dtype,
            "layout": "NHWC",
            "values": "0-255 (the model divides by 255)" if dtype == "uint8" else "0.0-1.0",
        },
        "output": {
            "name": OUTPUT,
            "shape": ["batch", len(classes)],
            "dtype": "float32",
            "values": "logits: softmax over the last axis gives each class's probability; class k is classes[k]",
        },
        "classes": list(classes),
        "preprocessing": preprocessing(run.config, image_shape, dtype),
    }


def preprocessing(config: RunConfig, image_shape: tuple[int, int, int], dtype: str) -> dict:
    """How the run's data path turns a raw image (or CSV row) into the model's input."""
    data = config.data
    if data.synthetic:
        return {"source": "synthetic float32 images in [0, 1)", "steps": [], "normalisation": NO_NORMALISATION}
    if data.dataset != BUNDLED_DATASET:
        return {
            "source": f"{data.dataset}: IDX files of uint8 pixels",
            "steps": ["as float32, divided by 255"], "normalisation": NO_NORMALISATION,
        }  # fmt: skip
    if dtype == "uint8":  # an image folder, or `jaxcnn prepare`'s shards of one
        return _image_files(image_shape, "centre" if data.augment == "imagenet" else "resize")
    path = Path(data.data) if data.data else BUNDLED_TRAIN
    return {
        "source": "CSV rows in Kaggle's layout: an optional label column, then pixel0 .. pixelN-1 in HWC order",
        "steps": [
            "reshape each row's pixels to [H, W, C]",
            "divide by the file's full scale (in float64, then as float32): the smallest of "
            f"{', '.join(f'{s:g}' for s in FULL_SCALES)} that holds the file's brightest pixel (each file its own)",
        ],
        "training_file_full_scale": csv_full_scale(path),
        "normalisation": NO_NORMALISATION,
    }


def _image_files(image_shape: tuple[int, int, int], fit: str) -> dict:
    """jaxcnn.data.folders' decoding and jaxcnn.data.resize's resizing, as `predict` reads files."""
    height, width, channels = image_shape
    resize = (
        f"bilinear (OpenCV INTER_LINEAR, pixel centres); OpenCV INTER_AREA when the image shrinks by "
        f"{AREA_FROM:g} or more (max(h / H, w / W) >= {AREA_FROM:g}); an image of the size already is kept"
    )
    steps = [
        f"decode the PNG or JPEG and convert it to {MODES[channels]} ({channels} channel{'s' * (channels > 1)}; "
        "Pillow's convert, RGB JPEGs by OpenCV's decoder: the same libjpeg pixels)",
    ]
    if fit == "resize":
        steps.append(f"resize the whole image to {height}x{width} (H x W): {resize}")
    else:
        shorter = max(height, width) / CENTRE_SHARE
        steps += [
            f"centre crop: with s = {shorter:g} / min(h, w), the box of {height} / s x {width} / s source pixels "
            f"centred in the image (fractional edges) -- the centred {height}x{width} once the shorter side is "
            f"resized to {shorter:g}",
            f"a JPEG whose box is at least {2 * height}x{2 * width} is decoded at 1/r scale in the DCT domain (r the "
            f"largest of 8, 4, 2 that leaves the box at least {height}x{width}: libjpeg's scaled decoding, OpenCV's "
            "IMREAD_REDUCED_*), the box and s scaled with it",
            f"resample the box to {height}x{width}: shrinking by less than {AREA_FROM:g}, bilinear at the output "
            "pixel centres (OpenCV warpAffine, border replicated); otherwise resize the whole image to "
            f"(max({height}, round(h * s)), max({width}, round(w * s))) ({resize}) and cut the {height}x{width} "
            "window at (round(top * s), round(left * s)), kept inside the image",
        ]
    steps.append("keep the pixels uint8 0-255, stacked NHWC")
    return {
        "source": "image files (PNG or JPEG, any size and mode)", "fit": fit, "steps": steps,
        "normalisation": NO_NORMALISATION,
    }  # fmt: skip
