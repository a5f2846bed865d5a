"""Layers jaxcnn computes its own way, each checked against a float64 reference
(tests/test_gradients.py): the 2x2 max-pool, whose gradient it writes itself, and the
1x1 convolution as a matrix product.

Why a max-pool of our own: the gradient JAX derives for `jnp.max` (and so for a pool
written as reshape + max) marks the window's winner by comparing the operand with the
result bit for bit. Under `jit`, XLA may recompute a fused operand (batch norm -> ReLU)
in the backward pass with different rounding than the forward used; the comparison then
fails and the window gets no gradient at all (seen on XLA:CPU at 128 channels: a third of
the windows). `lax.reduce_window`'s select-and-scatter is immune but materialises index
arrays the size of the activation on XLA:CPU. This pool decides the winner once, in the
forward pass, from comparisons among the window's own four values, and keeps that choice
(one int8 per output) for the backward pass: every window routes its gradient to exactly
one input, whatever XLA fuses or recomputes. (A custom VJP has no forward-mode rule:
`jax.jvp` / `jacfwd` through the pool are not supported; training needs only `grad`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _windows(x_BHWC: jax.Array) -> tuple[jax.Array, ...]:
    """The four corners of each 2x2 window, in row-major order, after SAME padding
    (the high side padded with -inf, which never wins)."""
    b, h, w, c = x_BHWC.shape
    if h % 2 or w % 2:
        x_BHWC = jnp.pad(x_BHWC, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=-jnp.inf)
    x_BhiwjC = x_BHWC.reshape(b, -(-h // 2), 2, -(-w // 2), 2, c)
    return tuple(x_BhiwjC[:, :, i, :, j, :] for i in (0, 1) for j in (0, 1))


def _pool_with_choice(x_BHWC: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(pooled, index 0-3 of the first maximum in row-major order), as torch picks."""
    top_left, top_right, bottom_left, bottom_right = _windows(x_BHWC)

    def beats(challenger, holder):  # a NaN wins, as in torch and reduce_window: it must not vanish
        return (challenger > holder) | jnp.isnan(challenger)

    right_wins = beats(top_right, top_left)
    top = jnp.where(right_wins, top_right, top_left)
    bottom_right_wins = beats(bottom_right, bottom_left)
    bottom = jnp.where(bottom_right_wins, bottom_right, bottom_left)
    bottom_wins = beats(bottom, top)
    pooled = jnp.where(bottom_wins, bottom, top)
    choice = jnp.where(bottom_wins, 2 + bottom_right_wins, right_wins).astype(jnp.int8)
    return pooled, choice


@jax.custom_vjp
def max_pool_2x2(x_BHWC: jax.Array) -> jax.Array:
    """2x2 max-pool, stride 2, SAME padding: the values of
    `nnx.max_pool(x, (2, 2), (2, 2), "SAME")`; the gradient goes to the first maximum of
    each window, as chosen in the forward pass (see the module docstring)."""
    return _pool_with_choice(x_BHWC)[0]


def _max_pool_forward(x_BHWC):
    pooled, choice = _pool_with_choice(x_BHWC)
    return pooled, (choice, x_BHWC.shape)


def _max_pool_backward(residuals, g_BhwC):
    choice_Bhwc, (b, h, w, c) = residuals
    hh, ww = choice_Bhwc.shape[1:3]
    corner = (2 * jnp.arange(2)[:, None] + jnp.arange(2)[None, :]).reshape(1, 1, 2, 1, 2, 1)
    chosen = choice_Bhwc[:, :, None, :, None, :] == corner
    g_BhiwjC = jnp.where(chosen, g_BhwC[:, :, None, :, None, :], jnp.zeros((), g_BhwC.dtype))
    return (g_BhiwjC.reshape(b, 2 * hh, 2 * ww, c)[:, :h, :w, :],)


max_pool_2x2.defvjp(_max_pool_forward, _max_pool_backward)


def max_pool_window(x_BHWC: jax.Array) -> jax.Array:
    """The same pool as `lax.reduce_window` (via flax): XLA's own gradient, select-and-scatter."""
    return nnx.max_pool(x_BHWC, (2, 2), strides=(2, 2), padding="SAME")


def pointwise_conv(inputs, kernel, window_strides, padding, **options):
    """`lax.conv_general_dilated` for a 1x1 kernel (NHWC, HWIO), as a matrix product over
    the channels of every (strided) pixel -- flax's `conv_general_dilated=` hook.

    Why: on XLA:CPU a convolution runs in Eigen, and its weight gradient first transposes
    activation and gradient so the batch is the minor dimension -- at batch 8 a slow,
    cache-unfriendly copy (a ResNet-50 step at 224x224 spent more time in these copies than
    in its pooling and normalisation together). As a dot, forward and both gradients are
    plain matrix products (YNNPACK's on CPU) with no such copies. Anything but an
    undilated, ungrouped, unpadded 1x1 goes to `lax.conv_general_dilated` unchanged."""
    pointwise = (
        kernel.shape[:2] == (1, 1)
        and all(low == high == 0 for low, high in padding)
        and all(d in (None, 1, (1, 1)) for d in (options.get("lhs_dilation"), options.get("rhs_dilation")))
        and options.get("feature_group_count", 1) == 1
        and options.get("out_sharding") is None
    )
    if not pointwise:
        return jax.lax.conv_general_dilated(inputs, kernel, window_strides, padding, **options)
    sh, sw = window_strides
    x_BHWC = inputs[:, ::sh, ::sw, :] if (sh, sw) != (1, 1) else inputs
    return jnp.einsum(
        "bhwc,cd->bhwd", x_BHWC, kernel[0, 0], precision=options.get("precision"),
        preferred_element_type=options.get("preferred_element_type"),
    )  # fmt: skip
