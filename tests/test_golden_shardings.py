"""Each layout places each golden model's tensors exactly as its golden table says: the
default CNN, resnet18, convnext_atto and mobilenet_v2 (tests/make_golden.py).

The tables are tests/golden/<model_><layout>.json; regenerate them with `python tests/make_golden.py`
after an intended change and review the diff.
"""

import json

import pytest
from make_golden import GOLDEN, GOLDEN_LAYOUTS, GOLDEN_MODELS, golden_for, golden_path


@pytest.mark.parametrize("prefix", GOLDEN_MODELS, ids=[prefix.rstrip("_") or "cnn" for prefix in GOLDEN_MODELS])
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


def tables(prefix: str) -> dict:
    return {name: json.loads(golden_path(name, prefix).read_text())["parameters"] for name in GOLDEN_LAYOUTS}


def test_depthwise_golden_tables_split_a_depthwise_kernel_only_with_the_channels_it_acts_on():
    """ConvNeXt's depthwise conv acts on the residual stream (`conv_in`): whole under tp, its
    MLP a column -> row pair. MobileNetV2's acts on the expanded channels (`conv_out`): under
    tp its kernel splits along them, between the expand (column) and project (row) convs."""
    convnext = tables("convnext_atto_")
    block = "blocks/3"  # stage 2's first block (blocks/2 is its downsample), 80 channels
    assert convnext["tp"][f"{block}/dwconv/kernel"]["logical"] == ["kh", "kw", "group_in", "conv_in"]
    assert convnext["tp"][f"{block}/dwconv/kernel"]["spec"] == "(-, -, -, -)"
    assert convnext["tp"][f"{block}/pwconv1/kernel"]["spec"] == "(-, model)"
    assert convnext["tp"][f"{block}/pwconv2/kernel"]["spec"] == "(model, -)"
    mobilenet = tables("mobilenet_v2_")
    block = "blocks/2"  # stage 2's second block: 24 -> 144 -> 24 channels
    assert mobilenet["tp"][f"{block}/depthwise/conv/kernel"]["spec"] == "(-, -, -, model)"
    assert mobilenet["tp"][f"{block}/expand/conv/kernel"]["spec"] == "(-, -, -, model)"
    assert mobilenet["tp"][f"{block}/project/conv/kernel"]["spec"] == "(-, -, model, -)"
    for layout in ("dp", "spatial"):
        assert mobilenet[layout][f"{block}/depthwise/conv/kernel"]["spec"] == "(-, -, -, -)"
