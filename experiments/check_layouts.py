"""Prove every layout computes what one device computes, on your model: train K steps
under `single` and under each layout, and print the largest relative loss difference and
the collectives each layout compiled to.

python experiments/check_layouts.py                              # default model, 8 devices
python experiments/check_layouts.py --steps 20 --layouts dp,tp --out results/check.csv
python experiments/check_layouts.py --sizes realistic --out results/layout_equivalence_realistic.csv
python experiments/check_layouts.py --sizes resnet --steps 4 --out results/layout_equivalence_resnet.csv

Two comparisons per layout:
- free-running (`max_rel_loss_diff`): K steps each on its own, as a user's runs. Beside it
  `noise_floor`: how far `single` itself moves when its input images change by one ulp.
  A 2x2 max-pool window whose two largest inputs are equal to within float32 rounding may
  pick either winner, and another summation order (any layout that splits a reduction)
  may pick the other; Adam then amplifies that one-window difference over the following
  steps. Where the floor is above 1e-5, so may be the layout's difference, and that is the
  trajectory's conditioning, not a layout computing something else.
- step by step (`step_rel_loss_diff`, `step_rel_grad_diff`): at every step the layout
  starts from single's exact state, so its loss and gradient (read back from Adam's first
  moment, zeroed before the step; relative to the largest entry) are compared with single's on the same inputs,
  without amplification. A pool window decided the other way shows here as a gradient
  difference of ~1e-3 in the step where it happens. Beside it `grad_floor`: the same
  comparison of `single` with itself on images one ulp larger -- how far float32 rounding
  alone moves a gradient through the model's ReLU and pool kinks (resnet18: 3e-3 to 1e-2). A program without one state to
  start from (the pipeline's: per-stage states) is compared free-running only.

`--sizes realistic` runs the fixed set in REALISTIC instead of the flags' model and data:
the default model (32/64/128 channels) at 24x24x3 and 32x32x3 and a 5-block model (up to
256 channels) at 40x40x3, on odd device counts (data=3, 6 devices, data=3,model=2) and
batches that are not powers of two. Pipeline rows use one micro-batch, so batch norm
sees the whole batch as on one device; with M micro-batches its statistics are per
micro-batch by design (tests/test_pipeline.py checks that design). `--sizes resnet` runs
RESNET: resnet18 at 32x32x3 and 64x64x3 under every layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import jax
import numpy as np
import optax

from jaxcnn import results
from jaxcnn.analysis.hlo import KINDS
from jaxcnn.analysis.lint import lint_program
from jaxcnn.analysis.measure import stage_options
from jaxcnn.build import build_program
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import Dataset, batch_indices, parse_image_shape, synthetic_dataset
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.sharding import Layout, ParallelDims, build_mesh, format_mesh, get_layout, parse_mesh, resolve_mesh
from jaxcnn.sharding.mesh import simulate_cpu_devices
from jaxcnn.sharding.partition import quiet_fallbacks

PROG = "check_layouts.py"
DEFAULT = "cnn2d_3layer_fullconnected_3layer"
FIVE_BLOCKS = "cnn2d_5layer_fullconnected_3layer"  # 32/64/128/128/256 channels

# (model, image, global batch, layout, mesh): the --sizes realistic set
REALISTIC = [
    *[(DEFAULT, "24x24x3", 48, layout, mesh) for layout, mesh in [
        ("dp", "data=3"), ("dp", "data=6"), ("fsdp", "data=3"), ("tp", "model=2"), ("hybrid", "data=3,model=2"),
        ("spatial", "data=3,spatial=2"), ("pipeline", "data=3,stage=2"),
    ]],
    *[(DEFAULT, "32x32x3", 60, layout, mesh) for layout, mesh in [
        ("dp", "data=6"), ("fsdp", "data=6"), ("tp", "model=4"), ("hybrid", "data=3,model=2"),
        ("spatial", "data=3,spatial=2"), ("spatial", "data=2,spatial=4"), ("pipeline", "stage=3"),
    ]],
    *[(DEFAULT, "32x32x3", 64, layout, mesh) for layout, mesh in [
        ("tp", "model=8"), ("hybrid", "data=4,model=2"), ("spatial", "data=4,spatial=2"),
    ]],
    *[(FIVE_BLOCKS, "40x40x3", 24, layout, mesh) for layout, mesh in [
        ("dp", "data=3"), ("fsdp", "data=6"), ("tp", "model=4"), ("hybrid", "data=3,model=2"),
        ("spatial", "data=2,spatial=2"), ("pipeline", "stage=3"),
    ]],
]  # fmt: skip

# --sizes resnet: resnet18 (64..512 channels, stride-2 blocks, projections) at 32x32x3 and
# 64x64x3 on 2-8 devices, odd counts among them
RESNET = [
    *[("resnet18", "32x32x3", 48, layout, mesh) for layout, mesh in [
        ("dp", "data=3"), ("fsdp", "data=8"), ("tp", "model=2"), ("hybrid", "data=3,model=2"),
        ("spatial", "data=3,spatial=2"), ("pipeline", "stage=3"),
    ]],
    *[("resnet18", "64x64x3", 32, layout, mesh) for layout, mesh in [
        ("dp", "data=8"), ("fsdp", "data=4"), ("tp", "model=4"), ("hybrid", "data=4,model=2"),
        ("spatial", "data=2,spatial=4"), ("pipeline", "data=2,stage=2"),
    ]],
]  # fmt: skip
SIZE_SETS = {"realistic": REALISTIC, "resnet": RESNET}


class Case(NamedTuple):
    model: ModelConfig
    dataset: Dataset
    batch_size: int
    layout: Layout
    mesh_shape: dict[str, int]


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    run_flags.add_data_flags(parser)
    g = parser.add_argument_group("check")
    g.add_argument(
        "--sizes",
        choices=("flags", *SIZE_SETS),
        default="flags",
        help="the flags' model and data, or the fixed set REALISTIC or RESNET",
    )
    cli.add_layouts_flag(g)
    cli.add_devices_flag(g, help="devices per layout mesh")
    g.add_argument("--steps", type=int, default=10, help="training steps compared")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument("--seed", type=int, default=0)
    cli.add_output_flags(g, out="runs/layout_equivalence.csv")
    return parser.parse_args(argv)


def cases_from_flags(args, layouts: list[Layout]) -> list[Case]:
    model = cli.model_from_flags(args)
    image_shape, dataset = cli.data_from_flags(args, model.num_classes)
    if dataset is None:
        dataset = synthetic_dataset(image_shape, args.synthetic_size, model.num_classes, 0)
    return [
        Case(model, dataset, args.batch_size, layout, resolve_mesh(parse_mesh(layout.default_mesh), args.devices))
        for layout in layouts
    ]


def realistic_cases(layouts: list[Layout], table=REALISTIC) -> list[Case]:
    """The rows of `table` whose layout is among `layouts`; 10 batches of random images each."""
    wanted = {layout.name for layout in layouts}
    datasets = {}
    cases = []
    for model_name, image, batch, layout_name, mesh in table:
        if layout_name not in wanted:
            continue
        key = (image, batch)
        if key not in datasets:
            datasets[key] = synthetic_dataset(parse_image_shape(image), 10 * batch, 10, 0)
        cases.append(
            Case(ModelConfig(name=model_name), datasets[key], batch, get_layout(layout_name), parse_mesh(mesh))
        )
    return cases


def compile_case(case: Case, steps: int, lr: float, seed: int, layout=None, mesh_shape=None, with_init=True):
    """The program of `case` (or of it under another layout and mesh); `with_init=False`: no
    init program (a layout compared step by step starts from single's state)."""
    layout, mesh_shape = layout or case.layout, mesh_shape or case.mesh_shape
    # batch norm over the whole batch, as on one device (without it: the GPipe schedule as configured)
    options = stage_options(layout, 1 if case.model.norm == "batch" else None)
    with quiet_fallbacks():  # fallbacks show in the lint's count below
        return build_program(
            case.model, OptimConfig(learning_rate=lr, warmup_steps=2), layout, build_mesh(mesh_shape),
            case.dataset.image_shape, case.batch_size, steps, seed=seed, with_eval=False, with_init=with_init,
            **options,
        )  # fmt: skip


def free_running_losses(program, dataset: Dataset, steps: int, seed: int) -> np.ndarray:
    train = TrainConfig(batch_size=program.batch_size, epochs=-(-steps * program.batch_size // len(dataset)),
                        max_steps=steps, seed=seed)  # fmt: skip
    return np.asarray(fit(program, program.init(), dataset, None, train, progress=False).loss_history)


def _host_copy(tree):
    # a copy, not a view: on CPU device_get may alias the device buffer, which the donating step reuses
    return jax.tree.map(lambda a: np.array(a, copy=True), jax.device_get(tree))


KINK = 1e-5  # a step whose gradient differs more: a pool window (or ReLU) decided the other way


def without_momentum(state):
    """The state with Adam's first moment zeroed: the step then leaves (1 - b1) x its
    gradient there, unmixed with earlier gradients (whose rounding would blur it); the
    constant factor cancels in every relative comparison."""
    mu = optax.tree_utils.tree_get(state.opt_state, "mu")
    return state._replace(opt_state=optax.tree_utils.tree_set(state.opt_state, mu=jax.tree.map(np.zeros_like, mu)))


def probe(program, state, images: np.ndarray, labels: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """(loss, (1 - b1) x gradient) of one step of `program` from host `state`, read back from Adam's first moment."""
    placed = program.train_input.place(images, labels)
    after, metrics = program.train_step(
        jax.device_put(_host_copy(without_momentum(state)), program.state_shardings), *placed
    )
    mu = jax.tree.leaves(optax.tree_utils.tree_get(_host_copy(after).opt_state, "mu"))
    return float(metrics["loss"]), mu


def step_by_step(
    single, program, dataset: Dataset, steps: int, seed: int, program_images: np.ndarray | None = None
) -> tuple[list[float], list[float]]:
    """Each step run by `single` and by `program` from single's state on the same batch:
    per step, (relative loss difference, max |gradient difference| / max |single's gradient|).
    Single's own step (momentum kept) carries the trajectory on. `program_images`: what
    `program` sees instead of the dataset's images (the gradient floor: single on nudged images)."""
    state, loss_diffs, grad_diffs = single.init(), [], []
    per_epoch = len(dataset) // single.batch_size
    program_images = dataset.images if program_images is None else program_images
    for step in range(steps):
        idx = batch_indices(len(dataset), single.batch_size, step // per_epoch, seed)[step % per_epoch]
        batch = dataset.images[idx], dataset.labels[idx]
        before = _host_copy(state)
        loss, expected = probe(single, before, *batch)
        layout_loss, got = probe(program, before, program_images[idx], dataset.labels[idx])
        loss_diffs.append(abs(layout_loss - loss) / abs(loss))
        largest = max(float(np.abs(g).max()) for g in expected)
        grad_diffs.append(max(float(np.abs(a - b).max()) for a, b in zip(got, expected, strict=True)) / largest)
        state, _ = single.train_step(jax.device_put(before, single.state_shardings), *single.train_input.place(*batch))
    return loss_diffs, grad_diffs


def nudged(dataset: Dataset) -> Dataset:
    """The same images, each pixel one float32 ulp larger."""
    return replace(dataset, images=np.nextafter(dataset.images, np.float32(np.inf)))


def check(cases: list[Case], steps: int, lr: float, seed: int, free_running: bool = True) -> list[dict]:
    """One row per case; `free_running=False` skips the free-running runs and the noise
    floor (their columns are then None), keeping only the step-by-step comparison."""
    rows, references = [], {}
    for case in cases:
        ParallelDims(case.layout, case.mesh_shape)  # a mesh without the layout's axes fails here
        key = (case.model, case.dataset.image_shape, case.batch_size)
        if key not in references:
            single = compile_case(case, steps, lr, seed, get_layout("single"), {"data": 1})
            reference = floor = grad_floor = None
            if free_running:
                reference = free_running_losses(single, case.dataset, steps, seed)
                nudged_data = nudged(case.dataset)
                nudged_losses = free_running_losses(single, nudged_data, steps, seed)
                floor = float(np.max(np.abs(nudged_losses - reference) / reference))
                # how far single's own gradient moves when its images move by one ulp: the
                # ReLU and pool kinks that float32 rounding may flip, whatever the layout
                grad_floor = max(step_by_step(single, single, case.dataset, steps, seed, nudged_data.images)[1])
            references[key] = single, reference, floor, grad_floor
        single, reference, floor, grad_floor = references[key]
        program = compile_case(case, steps, lr, seed, with_init=free_running)  # only free running starts its own
        free = None
        if free_running:
            free = float(
                np.max(np.abs(free_running_losses(program, case.dataset, steps, seed) - reference) / reference)
            )
        step_loss = step_grad = kink_steps = None
        if program.abstract_state is not None:  # one state to start from single's: compare step by step
            loss_diffs, grad_diffs = step_by_step(single, program, case.dataset, steps, seed)
            step_loss, step_grad = max(loss_diffs), max(grad_diffs)
            kink_steps = sum(d > KINK for d in grad_diffs)
        report = lint_program(program)
        row = {
            "model": case.model.name,
            "image": "x".join(map(str, case.dataset.image_shape)),
            "batch_size": case.batch_size,
            "layout": case.layout.name,
            "mesh": format_mesh(case.mesh_shape),
            "steps": steps,
            "max_rel_loss_diff": free,
            "noise_floor": floor,
            "step_rel_loss_diff": step_loss,
            "step_rel_grad_diff": step_grad,
            "grad_floor": grad_floor,
            "kink_steps": kink_steps,
            "param_bytes_per_device": report.bytes_per_device,
            "lint_warnings": len(report.warnings),
        }
        seen = []
        for kind in KINDS:
            of_kind = [c for c in report.collectives if c.kind == kind]
            column = kind.replace("-", "_")
            # per step: what a program runs once per micro-batch counts once per micro-batch
            count, moved = sum(c.repeats for c in of_kind), sum(c.step_bytes for c in of_kind)
            row[f"count_{column}"], row[f"bytes_{column}"] = count, moved
            if of_kind:
                seen.append(f"{kind} {count}x {moved:,} B")
        rows.append(row)
        stepwise = "step n/a"
        if step_loss is not None:
            stepwise = f"step {step_loss:.1e} grad {step_grad:.1e}"
            stepwise += f" (floor {grad_floor:.1e})" if free_running else ""
        freewise = f"free {free:.1e} (floor {floor:.1e})" if free_running else ""
        print(
            f"{row['model'][:7]:<8}{row['image']:<9}b{case.batch_size:<4}{row['layout']:<9}{row['mesh']:<18}"
            f"{freewise}  {stepwise:<28} {', '.join(seen)}",
            flush=True,
        )
    return rows


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    layouts = cli.layouts_from_flag(args.layouts)
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    (out,) = cli.writable_outputs(args.out)
    cases = (
        cases_from_flags(args, layouts) if args.sizes == "flags" else realistic_cases(layouts, SIZE_SETS[args.sizes])
    )
    devices = max(int(np.prod(list(case.mesh_shape.values()))) for case in cases)
    simulate_cpu_devices(max(devices, args.devices), at_least=True)
    if len(jax.devices()) < devices:
        raise UserError(f"the meshes need {devices} devices but only {len(jax.devices())} exist")
    rows = check(cases, args.steps, args.lr, args.seed)
    results.write_csv(out, rows)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
