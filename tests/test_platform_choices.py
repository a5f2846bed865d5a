"""Each platform choice is what its measurements in results/platform_choices.csv pick, the
safe default (XLA's way) where a platform has none, and both variants of a kernel choice
compute the same numbers."""

import dataclasses

import jax
import numpy as np
import pandas as pd
import pytest
from conftest import REPO, initialised
from flax import nnx
from test_gradients import float64_twin

from jaxcnn import platform_choices
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model, layer_shapes, resolve_kernels

EVIDENCE = REPO / "results/platform_choices.csv"
KEY = ["model", "image_shape", "global_batch_size", "dtype"]


def _measurements(rows: pd.DataFrame) -> list[dict]:
    """Per configuration: {variant: (seconds per step, cold compile seconds)} of the variants timed."""
    timed = rows[~rows["timed_out"].astype(bool)]
    return [
        {r.variant: (r.median_step_seconds, r.cold_compile_seconds) for r in group.itertuples()}
        for _, group in timed.groupby(KEY)
    ]


@pytest.mark.parametrize("choice", list(platform_choices.CHOICES))
def test_each_platforms_choice_is_what_its_measurements_pick(choice):
    evidence = pd.read_csv(EVIDENCE)
    spec = platform_choices.CHOICES[choice]
    measured = evidence[evidence["choice"] == choice]
    for platform, rows in measured.groupby("platform"):
        picks = _measurements(rows)
        assert picks, f"{choice} on {platform}: every variant timed out"
        assert set().union(*picks) == set(spec.variants), f"{choice} on {platform}: not every variant measured"
        assert platform_choices.variant(choice, platform) == platform_choices.pick_across(picks), (choice, platform)
    unmeasured = set(spec.chosen) - set(measured["platform"])
    assert not unmeasured, f"{choice}: chosen on {unmeasured} without measurements: keep XLA's default there"


def test_pick_takes_the_fastest_step_unless_a_close_one_compiles_much_faster():
    assert platform_choices.pick({"a": (1.00, 100.0), "b": (1.10, 10.0)}) == "a"  # 10% slower: speed wins
    assert platform_choices.pick({"a": (1.00, 100.0), "b": (1.01, 10.0)}) == "b"  # 1% slower, 10x quicker
    assert platform_choices.pick({"a": (1.00, 100.0), "b": (1.01, 90.0)}) == "a"  # quicker, but not by enough
    # across configurations each counts alike, whatever its seconds
    small, large = {"a": (1.0, 1.0), "b": (2.0, 1.0)}, {"a": (300.0, 1.0), "b": (200.0, 1.0)}
    assert platform_choices.pick_across([small, large]) == "a"  # 2x faster on one, 1.5x slower on the other


def test_a_platform_without_measurements_keeps_xlas_way():
    assert (platform_choices.variant("conv1x1", "tpu"), platform_choices.variant("max_pool", "tpu")) == (
        "conv",
        "window",
    )
    assert platform_choices.step_compiler_options("tpu") is None
    assert platform_choices.probe_compiler_options("gpu") == {platform_choices.AUTOTUNE_LEVEL: 0}


@pytest.mark.parametrize(("model", "field"), [("resnet_tiny_bottleneck", "conv1x1"), (ModelConfig().name, "max_pool")])
def test_both_variants_of_a_kernel_choice_give_the_same_values_and_gradients(model, field):
    """Same weights, same batch, float64: the two kernels agree to rounding (each kernel's
    own float64 checks against lax's: tests/test_gradients.py), and each program computes
    with its own kernel (else they would agree trivially)."""
    config = ModelConfig(name=model, conv_features=(8, 16) if "resnet" in model else ())
    images = np.random.default_rng(0).random((4, 32, 32, 3))

    def loss(module, x):
        return (module(x, train=True) ** 2).sum()

    found, programs = [], {}
    for variant in platform_choices.CHOICES[field].variants:
        weights = initialised(dataclasses.replace(config, **{field: variant}), (32, 32, 3))
        with jax.enable_x64(True):
            graphdef, params, rest = nnx.split(float64_twin(weights), nnx.Param, ...)
            pure = lambda params, x: loss(nnx.merge(graphdef, params, rest, copy=True), x)  # noqa: B023, E731
            lowered = jax.jit(jax.value_and_grad(pure, argnums=(0, 1))).lower(params, images)
            found.append(lowered.compile()(params, images))
        programs[variant] = lowered.as_text()
    if field == "max_pool":  # select: max_pool_2x2, keeping each window's winner as an int8; window: a
        # reduce_window, its gradient a select_and_scatter; one pool per conv block
        ops = ("stablehlo.reduce_window", "stablehlo.select_and_scatter", "xi8>")
        ran = {variant: tuple(text.count(op) > 0 for op in ops) for variant, text in programs.items()}
        assert ran == {"select": (False, False, True), "window": (True, True, False)}, (ops, ran)
        pools = len(config.conv_features)
        assert programs["window"].count(ops[0]) == programs["window"].count(ops[1]) == pools
    else:  # a 1x1 conv done as a dot is a convolution less, forward and backward
        convolutions = {variant: text.count("stablehlo.convolution") for variant, text in programs.items()}
        assert convolutions["dot"] < convolutions["conv"], convolutions
    (value_a, grads_a), (value_b, grads_b) = found
    np.testing.assert_allclose(value_a, value_b, rtol=1e-10)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10 * np.abs(b).max())


@pytest.mark.parametrize("conv1x1", ["auto", "dot", "conv"])
def test_the_resnets_1x1_convolutions_compile_as_their_choice_says(conv1x1):
    """The lowered forward has a convolution per conv layer, less one per 1x1 conv done as a
    dot; "auto" is the platform's choice (here a CPU's)."""
    config = ModelConfig(name="resnet_tiny_bottleneck", conv_features=(8, 16), conv1x1=conv1x1)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(resolve_kernels(config, "cpu"), (16, 16, 3), 0)))
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, train=False))
    convs = forward.lower(state, np.zeros((2, 16, 16, 3), np.float32)).as_text().count("stablehlo.convolution")
    layers = [layer for layer in layer_shapes(config, (16, 16, 3)) if layer.kind == "conv"]
    ones = sum(layer.kernel == 1 for layer in layers)
    used = platform_choices.variant("conv1x1", "cpu") if conv1x1 == "auto" else conv1x1
    assert ones > 0 and convs == (len(layers) - ones if used == "dot" else len(layers))


def test_a_kernel_choice_for_the_other_family_is_refused():
    with pytest.raises(UserError, match="--conv1x1 is for the ResNets"):
        ModelConfig(conv1x1="dot")
    with pytest.raises(UserError, match="--max-pool is for the CNN family"):
        ModelConfig(name="resnet18", max_pool="select")
