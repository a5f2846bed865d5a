"""Regenerate the golden sharding tables: `python tests/make_golden.py`.

One JSON per layout under tests/golden/: the default model on the bundled 8x8 digits,
under the layout's default mesh for 8 devices, parameter path -> logical names, shape,
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
IMAGE_SHAPE = (8, 8, 1)


def golden_for(name: str) -> dict:
    layout = LAYOUTS[name]
    shape = resolve_mesh(parse_mesh(layout.default_mesh), DEVICES if name != "single" else 1)
    mesh = build_mesh(shape)
    with quiet_fallbacks():  # fallbacks are recorded in the table itself
        placements = plan_placements(ModelConfig(), layout, mesh, IMAGE_SHAPE)
    report = ShardingReport(layout, dict(mesh.shape), placements)
    return {"layout": name, "mesh": dict(mesh.shape), "model": ModelConfig().name, "parameters": golden_table(report)}


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name in GOLDEN_LAYOUTS:
        path = GOLDEN / f"{name}.json"
        path.write_text(json.dumps(golden_for(name), indent=1) + "\n")
        print("wrote", path.relative_to(GOLDEN.parent.parent))


if __name__ == "__main__":
    main()
