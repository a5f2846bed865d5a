"""FLOPs of the depthwise families: XLA:CPU's cost analysis counts a depthwise conv's kernel
gradient as the full C -> C convolution; `compare`, `plan` and `scale` report and price the
model's own count (jaxcnn.analysis.model_flops), which these tests derive by hand from
the architecture; and the three commands run for ConvNeXt and MobileNetV2."""

import jax
import jax.numpy as jnp
import pandas as pd
import pytest
from conftest import load_script

from jaxcnn.analysis.hardware import get_profile
from jaxcnn.analysis.measure import measure_layout
from jaxcnn.analysis.model_flops import train_flops
from jaxcnn.analysis.planner import plan
from jaxcnn.config import ModelConfig
from jaxcnn.models import LayerShape
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding import get_layout

CONVNEXT = ModelConfig(name="convnext_test")  # stages of 1 and 2 blocks, 16 and 32 channels
IMAGE, BATCH = (8, 8, 3), 4


def conv(pixels: int, kernel: int, c_in: int, c_out: int, groups: int = 1) -> int:
    """Forward FLOPs per image of a conv with `pixels` output positions (a multiply-add: 2)."""
    return 2 * pixels * kernel * kernel * (c_in // groups) * c_out


def block(pixels: int, c: int) -> tuple[int, int]:
    """A ConvNeXt block: (its 7x7 depthwise conv, its two 1x1 layers C -> 4C -> C)."""
    return conv(pixels, 7, c, c, groups=c), 2 * conv(pixels, 1, c, 4 * c)


# convnext_test on 8x8x3 by hand: the small stem patchifies 2x2 -> 4x4x16; one block at 16
# channels; a 2x2 stride-2 downsample -> 2x2x32; two blocks at 32; the classifier 32 -> 10
DEPTHWISE = block(16, 16)[0] + 2 * block(4, 32)[0]
MLP = block(16, 16)[1] + 2 * block(4, 32)[1]
FORWARD = conv(16, 2, 3, 16) + DEPTHWISE + MLP + conv(4, 2, 16, 32) + 2 * 32 * 10


def test_xla_counts_a_depthwise_kernel_gradient_as_a_full_convolution():
    """Why the model's count exists: one 7x7 depthwise conv on 64 channels (16x16), forward and both
    gradients compiled -- XLA's count is many times the 3 x forward the layer needs, the
    model's count is exactly that."""
    c, hw, k, batch = 64, 16, 7, 4
    layer = LayerShape("conv", c, c, ax.CONV_IN, ax.CONV_IN, hw, hw, kernel=k, groups=c)
    assert train_flops(layer) * batch == 3 * 2 * k * k * c * hw * hw * batch

    def loss(x, kernel):
        dims = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=dims, feature_group_count=c)
        return jnp.sum(y**2)

    x, kernel = jnp.ones((batch, hw, hw, c)), jnp.ones((k, k, 1, c))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, kernel).compile()
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    assert xla > 8 * train_flops(layer) * batch  # the kernel gradient alone counted ~C x its work


def test_compare_and_plan_report_the_models_count_not_xlas():
    """One device: the count is the hand count above, x3 for the backward pass, x the batch;
    XLA's is far above it. tp on 2: the 1x1 MLP layers halve, the depthwise convs, stem,
    downsample and head stay whole on each device (the residual stream is `conv_in`)."""
    row = measure_layout(CONVNEXT, get_layout("single"), {"data": 1}, IMAGE, BATCH)
    one_device = 3 * BATCH * FORWARD
    assert row["model_flops_per_device"] == pytest.approx(one_device)
    assert row["flops_per_device"] > 1.5 * one_device  # XLA's, shown beside: what the columns showed before
    found = plan(CONVNEXT, IMAGE, BATCH, 2, 1e12, get_profile("h100"), layouts=["single", "tp"])
    by_layout = {c.layout.name: c for c in found if c.error is None}
    assert by_layout["single"].compute_flops == pytest.approx(one_device)
    assert by_layout["tp"].compute_flops == pytest.approx(3 * BATCH * (FORWARD - MLP / 2))
    assert by_layout["tp"].redundancy == pytest.approx(2 * (FORWARD - MLP / 2) / FORWARD)


@pytest.mark.parametrize(
    "flags",
    [
        ["--model", "convnext_test", "--stochastic-depth", "0.1"],
        ["--model", "mobilenet_v2_test", "--dropout", "0.2"],
    ],
    ids=["convnext", "mobilenet"],
)
def test_compare_plan_and_simulate_run_for_the_depthwise_families(flags, tmp_path, capsys):
    shape = ["--synthetic", "16x16x3", "--batch-size", "8"]
    compare = tmp_path / "compare.csv"
    load_script("compare_layouts").main(
        [*flags, *shape, "--layouts", "tp", "--steps", "1", "--out", str(compare), "--plot", str(tmp_path / "c.png")]
    )
    frame = pd.read_csv(compare)
    assert list(frame["layout"]) == ["single", "tp"]
    assert (frame["model_flops_per_device"] < frame["flops_per_device"]).all()  # XLA's overcount, shown beside
    planned = tmp_path / "plan.csv"
    load_script("plan").main([*flags, *shape, "--devices", "2", "--layouts", "dp", "--out", str(planned)])
    ranked = pd.read_csv(planned)
    assert set(ranked["layout"]) == {"dp"} and ranked["fits"].all()  # the layouts asked for
    simulated = tmp_path / "simulate.csv"
    load_script("scaling").main(
        [
            *flags,
            *shape,
            "--simulate",
            "2,4",
            "--layouts",
            "dp",
            "--out",
            str(simulated),
            "--plot",
            str(tmp_path / "s.png"),
        ]
    )
    rows = pd.read_csv(simulated)
    assert list(rows["num_devices"]) == [2, 4] and (rows["model_flops_per_device"] > 0).all()
    assert "GFLOP" in capsys.readouterr().out
