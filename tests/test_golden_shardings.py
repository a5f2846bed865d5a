"""Each layout places the default model's tensors exactly as its golden table says.

The tables are tests/golden/<layout>.json; regenerate them with `python tests/make_golden.py`
after an intended change and review the diff.
"""

import json

import pytest
from make_golden import GOLDEN, GOLDEN_LAYOUTS, GOLDEN_MODELS, golden_for, golden_path


@pytest.mark.parametrize("prefix", GOLDEN_MODELS, ids=["cnn", "resnet18"])
@pytest.mark.parametrize("name", GOLDEN_LAYOUTS)
def test_placements_match_the_golden_table(name, prefix):
    path = golden_path(name, prefix)
    assert path.exists(), f"no golden table {path.name}: run python tests/make_golden.py"
    assert golden_for(name, prefix) == json.loads(path.read_text())


def test_golden_tables_differ_where_the_layouts_differ():
    specs = {name: json.loads((GOLDEN / f"{name}.json").read_text())["parameters"] for name in GOLDEN_LAYOUTS}
    kernel = "blocks/2/conv/kernel"  # 3x3x64x128, a row layer under tp
    assert specs["single"][kernel]["spec"] == specs["dp"][kernel]["spec"] == "(-, -, -, -)"
    assert specs["fsdp"][kernel]["spec"] == "(-, -, -, data)"
    assert specs["tp"][kernel]["spec"] == specs["hybrid"][kernel]["spec"] == "(-, -, model, -)"
    assert specs["fsdp"]["blocks/0/conv/kernel"]["spec"] == "(-, -, -, -)"  # 1,152 bytes: under the threshold


def test_resnet_golden_tables_split_each_block_as_a_column_row_pair():
    specs = {name: json.loads(golden_path(name, "resnet18_").read_text())["parameters"] for name in GOLDEN_LAYOUTS}
    block = "blocks/2"  # the first block of stage 2: 64 -> 128 channels, stride 2, a projection
    assert specs["tp"][f"{block}/conv1/kernel"]["spec"] == "(-, -, -, model)"  # column: output channels
    assert specs["tp"][f"{block}/conv2/kernel"]["spec"] == "(-, -, model, -)"  # row: input channels
    assert specs["tp"][f"{block}/shortcut/conv/kernel"]["spec"] == "(-, -, -, -)"  # the residual stream: whole
    assert "model" not in specs["tp"]["stem/conv/kernel"]["spec"] + specs["tp"]["head/fc/kernel"]["spec"]
    assert specs["fsdp"][f"{block}/conv2/kernel"]["spec"] == "(-, -, -, data)"
    assert specs["spatial"][f"{block}/conv2/kernel"]["spec"] == specs["dp"][f"{block}/conv2/kernel"]["spec"]
