"""Batch norm whose training statistics cost one collective each way.

Over a batch split across devices (dp, fsdp, spatial's height), flax's two-pass batch norm
needs the mean before the variance: one all-reduce for each, and autodiff adds one in the
backward pass for each again -- small collectives on the critical path, 3-4 per layer.
Here instead:

- forward: each device's piece of the batch gives its own mean and sum of squared
  deviations (two passes over local data, exact). One all-reduce of 2C values sums the
  pieces' moments about a reference every device already holds, the running mean:
  `sum n (mean_i - ref)` and `sum m2_i + n (mean_i - ref)^2`, from which the batch's mean
  and variance follow (Chan et al.'s parallel variance about a shift). The bytes do not
  grow with the device count, as a gather of every piece's pair would. Only the spread
  of the pieces' means about the reference is computed in one pass, so the rounding is
  eps * ((batch mean - ref) / std)^2 of the variance: float32 rounding once the running
  mean follows the batch's, flax's own one-pass `use_fast_variance` at a cold start far
  from zero. One piece (one device) needs no collective and keeps the exact two-pass form;
- backward: the standard batch-norm gradient (a `custom_vjp`) needs the sums of `dy` and
  `dy * x_hat` over the batch: one stacked sum, so one all-reduce, which also gives
  `scale`'s and `bias`'s gradients.

The pieces are those the active layout cuts the activation into (`image_pieces`), so
one device has one piece and the numbers equal one device's two-pass statistics to
float32 rounding. Inside a `shard_map` over the batch's axes (gradient accumulation), the
gather and the sum run over `axis_name` instead.

`local=True` is per-device batch norm (torch DDP without SyncBatchNorm): each piece is
normalised by its own statistics; no collective but the running statistics' mean.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcnn.sharding.partition import image_pieces, replicate_statistics

WITHIN_PIECE = (1, 3, 5)  # of the activation split into pieces: (pb, b, ph, h, pw, w, C)
STATISTICS_SCOPE = "batch_norm_statistics"  # names the collectives in the compiled program (analysis.lint)
RUNNING_SCOPE = "running_averages"  # inside it: per-device statistics' reduction for the running averages only


class BatchNorm(nnx.BatchNorm):
    """`nnx.BatchNorm` (same variables, running statistics and evaluation) whose training
    step on 4-d activations runs as the module docstring says."""

    def __init__(self, *args, local: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.local = local

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        evaluating = self.use_running_average if use_running_average is None else use_running_average
        unusual = self.scale is None or self.bias is None or self.axis_index_groups is not None or self.axis != -1
        if evaluating or x.ndim != 4 or mask is not None or unusual:  # flax's own path
            return super().__call__(x, use_running_average=use_running_average, mask=mask)
        scale, bias = self.scale[...], self.bias[...]
        if self.dtype is not None:  # as flax: input, scale and bias in the compute dtype
            x, scale, bias = x.astype(self.dtype), scale.astype(self.dtype), bias.astype(self.dtype)
        out_dtype = self.dtype or jnp.result_type(x, scale, bias)
        pieces = image_pieces(x.shape)
        reference = jax.lax.stop_gradient(self.mean[...])
        y, mean, var = batch_norm_train(x, scale, bias, reference, pieces, self.axis_name, self.epsilon, self.local)
        self.mean[...] = jax.lax.stop_gradient(self.momentum * self.mean[...] + (1 - self.momentum) * mean)
        self.var[...] = jax.lax.stop_gradient(self.momentum * self.var[...] + (1 - self.momentum) * var)
        return y.astype(out_dtype)


def _stat_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)  # statistics in float32 at least, as flax


def _split(x, pieces):
    (pb, ph, pw), (b, h, w, c) = pieces, x.shape
    return x.reshape(pb, b // pb, ph, h // ph, pw, w // pw, c)


def _piece_moments(x, pieces):
    """Each piece's mean and sum of squared deviations: (pieces, 2, C). The pieces in one
    dimension, split over all the batch's mesh axes together, so that gathering them is one
    collective over every device rather than one per axis."""
    xs = _split(x.astype(_stat_dtype(x)), pieces)
    mean = xs.mean(WITHIN_PIECE, keepdims=True)
    m2 = jnp.square(xs - mean).sum(WITHIN_PIECE)
    moments = jnp.stack([mean.squeeze(WITHIN_PIECE), m2], axis=3)  # (pb, ph, pw, 2, C)
    return moments.reshape(-1, *moments.shape[3:])


def _per_piece_sums(dy, x_hat):
    """Each piece's sums of dy and dy * x_hat: (2, pieces, C), pieces in one dimension."""
    sums = jnp.stack([dy, dy * x_hat]).sum(tuple(a + 1 for a in WITHIN_PIECE))  # (2, pb, ph, pw, C)
    return sums.reshape(2, -1, sums.shape[-1])


def _shifted_sums(moments, count, reference):
    """The pieces' moments as sums about `reference`: (2, pieces, C), to be summed over
    the pieces -- `n (mean_i - ref)` and `m2_i + n (mean_i - ref)^2`, `count` values each."""
    shift = moments[:, 0] - reference
    return jnp.stack([count * shift, moments[:, 1] + count * jnp.square(shift)])


def _from_shifted_sums(sums, n, reference):
    """The batch's mean and (biased) variance from the pieces' summed shifted sums, n values
    in all."""
    shift = sums[0] / n
    return reference + shift, jnp.maximum(sums[1] / n - jnp.square(shift), 0.0)


def _per_piece(x, pieces) -> int:
    """Values per piece and channel."""
    return x.size // x.shape[-1] // (pieces[0] * pieces[1] * pieces[2])


def _by_piece(per_piece, pieces):
    """(..., pieces, C) -> (..., pb, 1, ph, 1, pw, 1, C): against the split activation."""
    pb, ph, pw = pieces
    return per_piece.reshape(*per_piece.shape[:-2], pb, 1, ph, 1, pw, 1, per_piece.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def batch_norm_train(x, scale, bias, reference, pieces, axis_name, epsilon, local):
    """`(y, mean, var)`: x normalised by its batch statistics, then scaled and shifted;
    the statistics for the running averages. `reference`: per channel, the shift the
    pieces' moments are summed about (the running mean; no gradient flows to it)."""
    return _forward(x, scale, bias, reference, pieces, axis_name, epsilon, local)[0]


def _forward(x, scale, bias, reference, pieces, axis_name, epsilon, local):
    with jax.named_scope(STATISTICS_SCOPE):
        mean, var, mean_x, inv_x = _statistics(x, reference, pieces, axis_name, epsilon, local)
    xs = _split(x.astype(_stat_dtype(x)), pieces)
    y = ((xs - mean_x) * (inv_x * scale) + bias).reshape(x.shape)
    return (y, mean, var), (x, mean_x, inv_x, scale, reference)


def _statistics(x, reference, pieces, axis_name, epsilon, local):
    """The batch's mean and variance (for the running averages), and the mean and inverse
    deviation x is normalised by: the batch's, or (local) each piece's."""
    count = _per_piece(x, pieces)
    moments = _piece_moments(x, pieces)
    if local:
        means, variances = moments[:, 0], moments[:, 1] / count
        with jax.named_scope(RUNNING_SCOPE):  # nothing in the step waits for these
            mean, var = means.mean(0), variances.mean(0)  # for the running averages only
            if axis_name:
                mean, var = jax.lax.pmean((mean, var), axis_name)
        return mean, var, _by_piece(means, pieces), _by_piece(jax.lax.rsqrt(variances + epsilon), pieces)
    if len(moments) == 1 and not axis_name:  # the whole batch on one device: exact two-pass
        mean, var = moments[0, 0], moments[0, 1] / count
    else:
        reference = reference.astype(moments.dtype)
        sums = replicate_statistics(_shifted_sums(moments, count, reference).sum(1))  # the forward's one all-reduce
        n = count * len(moments)
        if axis_name:  # inside a shard_map: the other devices' pieces too
            sums, n = jax.lax.psum(sums, axis_name), n * jax.lax.psum(1, axis_name)
        mean, var = _from_shifted_sums(sums, n, reference)
    return mean, var, mean, jax.lax.rsqrt(var + epsilon)


def _backward(pieces, axis_name, epsilon, local, residuals, cotangents):
    x, mean_x, inv_x, scale, reference = residuals
    dy = _split(cotangents[0].astype(mean_x.dtype), pieces)
    x_hat = (_split(x.astype(mean_x.dtype), pieces) - mean_x) * inv_x
    with jax.named_scope(STATISTICS_SCOPE):
        per_piece = _per_piece_sums(dy, x_hat)
        own = per_piece.sum(1)  # the batch's, where the layout splits it: the backward's one all-reduce
        n = _per_piece(x, pieces)
        if local:
            sums = _by_piece(per_piece, pieces)
        else:
            sums, n = own, n * per_piece.shape[1]
            if axis_name:  # inside a shard_map: the other devices' sums too
                sums, n = jax.lax.psum(own, axis_name), n * jax.lax.psum(1, axis_name)
    dx = (inv_x * scale) * (dy - (sums[0] + x_hat * sums[1]) / n)
    # scale's and bias's gradients from this device's own sums: inside a shard_map, as
    # autodiff would give (the caller's pmean averages them); under jit, the batch's
    d_bias, d_scale = own
    d_x, d_scale, d_bias = dx.reshape(x.shape).astype(x.dtype), d_scale.astype(scale.dtype), d_bias.astype(scale.dtype)
    return d_x, d_scale, d_bias, jnp.zeros_like(reference)


batch_norm_train.defvjp(_forward, _backward)
