"""What a correct max-pool gradient costs: the default model's conv trunk (conv -> batch
norm -> ReLU -> 2x2 pool, three blocks) forward + backward, with three pools.

python experiments/pool_cost.py                      # 28x28x1 batch 128 and 224x224x3 batch 8
python experiments/pool_cost.py --rounds 3 --out results/pool_cost.csv

- `jaxcnn`: jaxcnn.layers.max_pool_2x2, a custom VJP keeping the forward's first-max choice;
- `reshape_max`: the reshape + max pool jaxcnn used before (its jitted gradient is wrong
  at 128 channels after batch norm: kept here only as the speed it gave);
- `reduce_window`: `nnx.max_pool`, whose gradient is XLA's select-and-scatter.

Per variant: temp bytes and FLOPs of the compiled gradient (jaxcnn's XLA:CPU options), the
median time of a call over interleaved rounds (variants alternate, so the host's drift
hits each alike), and the gradient's error against an eager float64 reference,
relative to its largest entry. A correct pool's error is ~1e-6 unless some window's two
largest inputs are equal to within float32 rounding, so that float32 and float64 rightly
pick different winners: `windows_decided_differently` counts those (the same for every
pool), and where it is not 0 the error of a correct pool is that of those windows.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcnn import results
from jaxcnn.analysis.measure import SIZES as TIMING_SIZES
from jaxcnn.commands import cli
from jaxcnn.compiling import compile_with
from jaxcnn.config import ModelConfig
from jaxcnn.layers import _pool_with_choice, max_pool_2x2
from jaxcnn.models import layer_shapes
from jaxcnn.platform_choices import step_compiler_options

PROG = "pool_cost.py"
SIZES = {"x".join(map(str, TIMING_SIZES[size][0])): TIMING_SIZES[size] for size in ("28", "224")}


def reshape_max_pool(x_BHWC: jax.Array) -> jax.Array:
    b, h, w, c = x_BHWC.shape
    if h % 2 or w % 2:
        x_BHWC = jnp.pad(x_BHWC, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=-jnp.inf)
    return x_BHWC.reshape(b, -(-h // 2), 2, -(-w // 2), 2, c).max(axis=(2, 4))


POOLS = {
    "jaxcnn": max_pool_2x2,
    "reshape_max": reshape_max_pool,
    "reduce_window": lambda x: nnx.max_pool(x, (2, 2), (2, 2), "SAME"),
}


def trunk_params(image_shape, seed: int = 0) -> list[dict]:
    convs = [layer for layer in layer_shapes(ModelConfig(), image_shape) if layer.kind == "conv"]
    keys = jax.random.split(jax.random.key(seed), len(convs))
    return [
        {
            "kernel": jax.random.normal(k, (3, 3, c.in_features, c.features)) / np.sqrt(9 * c.in_features),
            "scale": jnp.ones(c.features),
            "bias": jnp.zeros(c.features),
        }
        for k, c in zip(keys, convs, strict=True)
    ]


def block(p: dict, x_BHWC: jax.Array) -> jax.Array:
    """conv -> batch norm (batch statistics) -> ReLU, before the pool."""
    dims = ("NHWC", "HWIO", "NHWC")
    y = jax.lax.conv_general_dilated(x_BHWC, p["kernel"], (1, 1), "SAME", dimension_numbers=dims)
    mean, var = y.mean((0, 1, 2)), y.var((0, 1, 2))
    return nnx.relu((y - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"])


def trunk_loss(pool, params, x_BHWC, cotangent):
    for p in params:
        x_BHWC = pool(block(p, x_BHWC))
    return jnp.sum(x_BHWC * cotangent)


def window_choices(params, x_BHWC) -> list[jax.Array]:
    """Each block's pool winners (jaxcnn's first-max choice)."""
    choices = []
    for p in params:
        x_BHWC, choice = _pool_with_choice(block(p, x_BHWC))
        choices.append(choice)
    return choices


def measure(size: str, rounds: int, calls: int) -> list[dict]:
    image_shape, batch = SIZES[size]
    params = trunk_params(image_shape)
    x = jax.random.uniform(jax.random.key(1), (batch, *image_shape))
    h, w, _ = image_shape  # three SAME pools: ceil(side / 8)
    cotangent = jax.random.normal(jax.random.key(2), (batch, -(-h // 8), -(-w // 8), params[-1]["kernel"].shape[-1]))
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x, cotangent))
        reference = jax.grad(lambda p, x, g: trunk_loss(POOLS["reduce_window"], p, x, g), argnums=(0, 1))(*wide)
        reference = [np.asarray(r) for r in jax.tree.leaves(reference)]
        wide_choices = window_choices(*wide[:2])
    narrow_choices = jax.jit(window_choices)(params, x)
    flips = sum(int((np.asarray(a) != np.asarray(b)).sum()) for a, b in zip(narrow_choices, wide_choices, strict=True))
    options = step_compiler_options("cpu")
    compiled, rows = {}, {}
    for name, pool in POOLS.items():
        grad = jax.grad(lambda p, x, g, pool=pool: trunk_loss(pool, p, x, g), argnums=(0, 1))
        compiled[name] = compile_with(jax.jit(grad).lower(params, x, cotangent), options)
        got = jax.tree.leaves(compiled[name](params, x, cotangent))
        error = max(
            np.abs(np.asarray(g, np.float64) - r).max() / np.abs(r).max() for g, r in zip(got, reference, strict=True)
        )
        rows[name] = {
            "image": size,
            "batch_size": batch,
            "pool": name,
            "temp_bytes": compiled[name].memory_analysis().temp_size_in_bytes,
            "flops": compiled[name].cost_analysis()["flops"],
            "grad_rel_error": float(error),
            "windows_decided_differently": flips,
            "times": [],
        }
    for _ in range(rounds):
        for name, fn in compiled.items():
            jax.block_until_ready(fn(params, x, cotangent))  # warm
            start = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn(params, x, cotangent))
            rows[name]["times"].append((time.perf_counter() - start) / calls)
    base = statistics.median(rows["reshape_max"]["times"])
    for row in rows.values():
        row["step_ms"] = 1e3 * statistics.median(row.pop("times"))
        row["time_vs_reshape_max"] = row["step_ms"] / (1e3 * base)
    return list(rows.values())


def main(argv=None) -> list[dict]:
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, of " + ", ".join(SIZES))
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default %(default)s)")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per variant per round (default %(default)s)")
    cli.add_output_flags(parser, out_help="CSV to write (default: print only)")
    args = parser.parse_args(argv)
    sizes = cli.some_of(args.sizes, SIZES, "--sizes")
    cli.writable_outputs(args.out)
    rows = []
    for size in sizes:
        print(f"{size}: compiling and timing {len(POOLS)} pools ...", flush=True)
        for row in measure(size, args.rounds, args.calls):
            rows.append(row)
            print(
                f"  {row['pool']:<14} temp {row['temp_bytes'] / 2**20:8.1f} MiB  {row['flops'] / 1e9:7.2f} GFLOP  "
                f"{row['step_ms']:8.1f} ms ({row['time_vs_reshape_max']:.2f}x)  grad error {row['grad_rel_error']:.1e} "
                f"({row['windows_decided_differently']} near-tie windows)",
                flush=True,
            )
    if args.out:
        print("wrote", results.write_csv(args.out, rows))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
