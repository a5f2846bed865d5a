"""Regenerate the golden sharding tables: `python tests/make_golden.py`.

One JSON per layout and model under tests/golden/: the default model on the bundled 8x8
digits (<layout>.json), and resnet18, convnext_atto and mobilenet_v2 on 32x32x3 images
(resnet18_<layout>.json, convnext_atto_<layout>.json, mobilenet_v2_<layout>.json), under the
layout's default mesh for 8 devices, parameter path -> logical names, shape,
PartitionSpec and bytes per device. tests/test_golden_shardings.py checks the code still
places every tensor that way; after an intended change, rerun this and review the diff.
"""

import contextlib

import jax

with contextlib.suppress(RuntimeError):  # under pytest, conftest has already set 8
    jax.config.update("jax_num_cpu_devices", 8)

import json
from pathlib import Path

from jaxcnn.analysis.lint import ShardingReport, golden_table
from jaxcnn.build import plan_placements
from jaxcnn.config import ModelConfig
from jaxcnn.sharding import LAYOUTS, build_mesh, parse_mesh, quiet_fallbacks, resolve_mesh

GOLDEN = Path(__file__).resolve().parent / "golden"
DEVICES = 8
# the pipeline places whole layers on stages, not tensors by rules: tests/test_pipeline.py
GOLDEN_LAYOUTS = [name for name, layout in LAYOUTS.items() if layout.stage_axis is None]
# file prefix -> (model, image shape)
GOLDEN_MODELS = {
    "": (ModelConfig(), (8, 8, 1)),
    **{f"{name}_": (ModelConfig(name=name), (32, 32, 3)) for name in ("resnet18", "convnext_atto", "mobilenet_v2")},
}


def golden_path(name: str, prefix: str = "") -> Path:
    return GOLDEN / f"{prefix}{name}.json"


def golden_for(name: str, prefix: str = "") -> dict:
    layout = LAYOUTS[name]
    model, image_shape = GOLDEN_MODELS[prefix]
    shape = resolve_mesh(parse_mesh(layout.default_mesh), DEVICES if name != "single" else 1)
    mesh = build_mesh(shape)
    with quiet_fallbacks():  # fallbacks are recorded in the table itself
        placements = plan_placements(model, layout, mesh, image_shape)
    report = ShardingReport(layout, dict(mesh.shape), placements)
    return {"layout": name, "mesh": dict(mesh.shape), "model": model.name, "parameters": golden_table(report)}


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for prefix in GOLDEN_MODELS:
        for name in GOLDEN_LAYOUTS:
            path = golden_path(name, prefix)
            path.write_text(json.dumps(golden_for(name, prefix), indent=1) + "\n")
            print("wrote", path.relative_to(GOLDEN.parent.parent))


if __name__ == "__main__":
    main()
