"""Each layout places the default model's tensors exactly as its golden table says.

The tables are tests/golden/<layout>.json; regenerate them with `python tests/make_golden.py`
after an intended change and review the diff.
"""

import json

import pytest
from make_golden import GOLDEN, GOLDEN_LAYOUTS, golden_for


@pytest.mark.parametrize("name", GOLDEN_LAYOUTS)
def test_placements_match_the_golden_table(name):
    path = GOLDEN / f"{name}.json"
    assert path.exists(), f"no golden table for {name}: run python tests/make_golden.py"
    assert golden_for(name) == json.loads(path.read_text())


def test_golden_tables_differ_where_the_layouts_differ():
    specs = {name: json.loads((GOLDEN / f"{name}.json").read_text())["parameters"] for name in GOLDEN_LAYOUTS}
    kernel = "blocks/2/conv/kernel"  # 3x3x64x128, a row layer under tp
    assert specs["single"][kernel]["spec"] == specs["dp"][kernel]["spec"] == "(-, -, -, -)"
    assert specs["fsdp"][kernel]["spec"] == "(-, -, -, data)"
    assert specs["tp"][kernel]["spec"] == specs["hybrid"][kernel]["spec"] == "(-, -, model, -)"
    assert specs["fsdp"]["blocks/0/conv/kernel"]["spec"] == "(-, -, -, -)"  # 1,152 bytes: under the threshold
