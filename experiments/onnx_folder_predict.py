"""ONNX Runtime on an image folder, fed as an export's sidecar says -- Pillow, NumPy and
onnxruntime only, nothing of jaxcnn's -- against `jaxcnn predict`'s CSV for the same folder
(the fine-tuning walkthrough in docs/pretrained-and-export.md).

    python experiments/onnx_folder_predict.py --export runs/NAME/export --folder test/ \
        --predictions runs/NAME/predictions-test.csv

Images of the model's own size only (the walkthrough's): a server resizing others follows the
sidecar's resize step, which this check leaves out.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # the sidecar's "convert it to ..." step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, type=Path, help="the directory `jaxcnn export` wrote")
    parser.add_argument("--predictions", required=True, type=Path, help="`jaxcnn predict --out` for the folder")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    sidecar = json.loads((args.export / "model.json").read_text())
    _, height, width, channels = sidecar["input"]["shape"]
    session = ort.InferenceSession(str(args.export / sidecar["files"]["onnx"]), providers=["CPUExecutionProvider"])
    rows = list(csv.DictReader(args.predictions.open()))
    labels, probabilities = [], []
    for start in range(0, len(rows), args.batch):
        images = []
        for row in rows[start : start + args.batch]:
            image = Image.open(row["path"]).convert(MODES[channels])
            if image.size != (width, height):
                raise SystemExit(f"{row['path']} is {image.size[1]}x{image.size[0]}, the model takes {height}x{width}")
            images.append(np.asarray(image, np.uint8).reshape(height, width, channels))
        (logits,) = session.run([sidecar["output"]["name"]], {sidecar["input"]["name"]: np.stack(images)})
        exp = np.exp(logits - logits.max(-1, keepdims=True))
        probs = exp / exp.sum(-1, keepdims=True)
        labels += [sidecar["classes"][k] for k in probs.argmax(-1)]
        probabilities += list(probs.max(-1))
    same = sum(label == row["label"] for label, row in zip(labels, rows, strict=True))
    gap = max(abs(p - float(row["probability"])) for p, row in zip(probabilities, rows, strict=True))
    print(f"ONNX Runtime {ort.__version__}: {same} of {len(rows)} images given jaxcnn predict's class; "
          f"largest difference in the top class's probability {gap:.2g}")  # fmt: skip
    return {"images": len(rows), "same_class": same, "max_probability_difference": gap}


if __name__ == "__main__":
    main()
