"""The model's jaxpr as jax2onnx should see it: lax operations only.

jax2onnx converts a function by tracing it with its own rewrites of Flax modules and JAX
wrappers switched on. Two of those fail on jaxcnn's models (checked with jax2onnx 0.13.0 and
0.17.1, jax 0.12.0.1, flax 0.12.12): its `nnx.Dropout` rewrite rejects the `rngs=` the
models pass, and its handlers for nested `jit`, `custom_jvp_call` and `custom_vjp_call`
name `jax._src.core.ClosedJaxpr`, which jax 0.12 no longer has. So the model is traced by
JAX first, and jax2onnx traces `inlined(closed)`: the same operations, replayed one by one
with those wrappers opened -- in eval mode nothing is differentiated, so a custom
derivative's primal body is the whole computation -- and `checkpoint_name` markers dropped.
Its rewrites are never reached; what it converts is the jaxpr XLA compiles.

Two lax operations are replayed differently, with the same numbers: jax2onnx turns
`reduce_window_max` over an NHWC array into a MaxPool over four spatial axes, which ONNX
Runtime refuses ("Unsupported pooling size"), so the batch and channels are folded into one
axis first and the pool has the three ONNX Runtime runs; and its `pad` fails on a symbolic
batch (it gives onnx_ir the output shape unconverted), so a pad (the CNN's 2x2 pool on an
odd-sized map) becomes the concatenation of the array with blocks of the pad value.
"""

from __future__ import annotations

from collections.abc import Callable

from jax import lax
from jax.extend import core as jcore

# primitive -> the parameter holding its body, replayed in its place
OPENED = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}
DROPPED = ("name",)  # checkpoint_name: a marker for remat, the identity otherwise


def inlined(closed: jcore.ClosedJaxpr) -> Callable:
    """A function computing `closed` with lax operations alone (module docstring)."""

    def function(*args):
        outs = replay(closed.jaxpr, closed.consts, args)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return function


def replay(jaxpr: jcore.Jaxpr, consts, args) -> list:
    """Bind `jaxpr`'s operations to `args`, opening the wrappers in OPENED."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(var):
        return var.val if isinstance(var, jcore.Literal) else env[var]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in OPENED:
            body = eqn.params[OPENED[name]]
            outs = replay(body.jaxpr, body.consts, ins)
        elif name in DROPPED:
            outs = ins
        elif name == "reduce_window_max" and _nhwc_pool(eqn.params):
            outs = [nhwc_window_max(*ins, **eqn.params)]
        elif name == "pad" and all(lo >= 0 and hi >= 0 and not inner for lo, hi, inner in eqn.params["padding_config"]):
            outs = [concatenated_pad(*ins, **eqn.params)]
        else:
            out = eqn.primitive.bind(*ins, **eqn.params)
            outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _nhwc_pool(params: dict) -> bool:
    """A pool over height and width only, the one kind the models use."""
    window, strides, padding = params["window_dimensions"], params["window_strides"], params["padding"]
    plain = all(d == 1 for d in (*params["base_dilation"], *params["window_dilation"]))
    return (
        len(window) == 4
        and plain
        and window[0] == window[3] == strides[0] == strides[3] == 1
        and (tuple(padding[0]) == tuple(padding[3]) == (0, 0))
    )


def nhwc_window_max(x_BHWC, *, window_dimensions, window_strides, padding, **_):
    """`reduce_window_max` over height and width, with batch and channels folded into one
    axis (a three-axis pool: what ONNX Runtime's MaxPool runs)."""
    b, h, w, c = x_BHWC.shape
    x_NHW = x_BHWC.transpose(0, 3, 1, 2).reshape(b * c, h, w)
    y_NHW = lax.reduce_window(
        x_NHW, -float("inf"), lax.max, (1, *window_dimensions[1:3]), (1, *window_strides[1:3]),
        ((0, 0), *padding[1:3]),
    )  # fmt: skip
    return y_NHW.reshape(b, c, *y_NHW.shape[1:]).transpose(0, 2, 3, 1)


def concatenated_pad(x, value, *, padding_config):
    """`lax.pad` (edges only, none negative) as concatenations with blocks of `value`."""
    for axis, (lo, hi, _) in enumerate(padding_config):
        blocks = []
        for size in (int(lo), int(hi)):
            shape = list(x.shape)
            shape[axis] = size
            blocks.append(lax.broadcast_in_dim(value, tuple(shape), ()) if size else None)
        if lo or hi:
            x = lax.concatenate([part for part in (blocks[0], x, blocks[1]) if part is not None], axis)
    return x
