"""The one builder: a layout, a mesh and a batch in, a compiled `jaxcnn.program.Program` out.

    program = build_program(model_config, optim_config, layout, mesh, image_shape, batch_size, total_steps)

It validates the sizes against the layout's degrees first (`ParallelDims.validate`), then
dispatches on the layout: a table with a stage axis compiles per-stage programs
(jaxcnn.pipeline), every other table one SPMD program (jaxcnn.spmd). Nothing is allocated.
"""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig, UpdateConfig, check_layout_options, total_steps
from jaxcnn.data.on_device import OnDevice
from jaxcnn.errors import UserError
from jaxcnn.models import CustomModel, build_model
from jaxcnn.optim import optim_for_batch
from jaxcnn.pipeline import build_pipeline_program
from jaxcnn.pipeline.split import default_microbatches
from jaxcnn.program import Program, ProgramSpec
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.mesh import ParallelDims
from jaxcnn.sharding.partition import ParamPlacement, place_variables
from jaxcnn.spmd import build_spmd_program
from jaxcnn.steps import split_model

IMAGE_DTYPES = ("float32", "uint8")  # what a batch's pixels may be


def build_program(
    model_config: ModelConfig | CustomModel,
    optim_config: OptimConfig,
    layout: Layout,
    mesh: Mesh,
    image_shape: tuple[int, int, int],
    batch_size: int,
    total_steps: int,
    *,
    seed: int = 0,
    eval_batch_size: int | None = None,
    with_eval: bool = True,
    with_init: bool = True,
    update: UpdateConfig | None = None,
    microbatches: int | None = None,
    stage_split: tuple[int, ...] | None = None,
    pipeline_schedule: str = "gpipe",
    virtual_stages: int = 1,
    compiler_options: dict | None = None,
    image_dtype: str = "float32",
    on_device: OnDevice | None = None,
    steps_per_call: int = 1,
) -> Program:
    """Compile the init, train and eval steps of one (model, layout, mesh, batch size);
    the model one of jaxcnn's (a ModelConfig) or your own (jaxcnn.models.CustomModel).

    `with_eval` / `with_init` False skip compiling those (training without a test set;
    cost inspection and planning, which only read the train step). `update` picks the
    step's update rule (jaxcnn.steps: accumulation, local SGD, stale gradients);
    `microbatches`, `stage_split`, `pipeline_schedule` and `virtual_stages` shape a
    pipeline. `compiler_options` replace jaxcnn's XLA options for the steps (None: jaxcnn.compiling's for the platform).
    `image_dtype` is the batches' pixels: "float32" in [0, 1], or "uint8" (an image
    folder's bytes), scaled to [0, 1] inside every compiled step (jaxcnn.models.unit_pixels).
    `on_device` (jaxcnn.data.on_device) compiles steps that gather their batches from the
    training set held on the devices; `steps_per_call` K > 1 a call of K steps
    (jaxcnn.steps.calls); more calls compile when `program.calls` is asked for them."""
    if image_dtype not in IMAGE_DTYPES:
        raise UserError(f"image dtype {image_dtype!r}: one of {', '.join(IMAGE_DTYPES)}")
    if steps_per_call < 1:
        raise UserError(f"--steps-per-call must be a positive integer, got {steps_per_call}")
    if layout.stage_axis and (on_device or steps_per_call > 1):
        raise UserError(
            "--data-on-device and --steps-per-call do not apply to --layout pipeline: the host drives its stages"
        )
    eval_batch_size = eval_batch_size or batch_size
    update = update or UpdateConfig()
    check_layout_options(bool(layout.stage_axis), update, microbatches, stage_split, pipeline_schedule, virtual_stages)
    dims = ParallelDims(layout, dict(mesh.shape))
    if layout.stage_axis:
        microbatches = microbatches or default_microbatches(batch_size, dims.stages)
        if virtual_stages > 1 and pipeline_schedule == "1f1b" and microbatches % dims.stages:
            raise UserError(
                f"interleaved 1F1B (--virtual-stages {virtual_stages}) runs micro-batches in groups of the "
                f"{dims.stages} stages: use --microbatches a multiple of {dims.stages} (it is {microbatches})"
            )
    dims.validate(
        batch_size, eval_batch_size=eval_batch_size, image_shape=image_shape, grad_accum=update.grad_accum,
        microbatches=microbatches,
    )  # fmt: skip
    spec = ProgramSpec(
        model_config=model_config, optim_config=optim_config, layout=layout, mesh=mesh, image_shape=image_shape,
        batch_size=batch_size, total_steps=total_steps, seed=seed, eval_batch_size=eval_batch_size,
        with_eval=with_eval, with_init=with_init, update=update, compiler_options=compiler_options,
        image_dtype=image_dtype, on_device=on_device, steps_per_call=steps_per_call,
    )  # fmt: skip
    if layout.stage_axis:
        if isinstance(model_config, CustomModel):
            raise UserError(
                f"a model of your own ({model_config.name}) runs under every layout but the pipeline, whose stages "
                "are cut from jaxcnn's own layer descriptions"
            )
        return build_pipeline_program(spec, microbatches, stage_split, pipeline_schedule, virtual_stages)
    return build_spmd_program(spec)


def build_programs(
    model_config: ModelConfig,
    optim_config: OptimConfig,
    layout: Layout,
    mesh: Mesh,
    image_shape: tuple[int, int, int],
    train_config: TrainConfig,
    train_size: int,
    **options,
) -> dict[int, Program]:
    """One program per global batch the run uses (a batch schedule has several), each
    with its learning rate scaled for its batch (jaxcnn.optim.optim_for_batch). Only the
    first batch's program compiles `init`: the state passes from program to program."""
    steps = total_steps(train_size, train_config)
    if layout.stage_axis and train_config.batch_schedule:
        raise UserError("--batch-schedule does not apply to --layout pipeline; give it one --batch-size")
    programs = {}
    for batch in train_config.batch_sizes:
        programs[batch] = build_program(
            model_config, optim_for_batch(optim_config, train_config, batch), layout, mesh, image_shape, batch,
            steps, seed=train_config.seed, eval_batch_size=train_config.eval_batch_size,
            with_init=batch == train_config.batch_size, **options,
        )  # fmt: skip
    return programs


def plan_placements(
    model_config: ModelConfig, layout: Layout, mesh: Mesh, image_shape: tuple[int, int, int]
) -> list[ParamPlacement]:
    """Where every parameter and statistic of the model would go, without compiling."""
    _, params, model_state = split_model(nnx.eval_shape(lambda: build_model(model_config, image_shape, 0)))
    return place_variables(params, layout, mesh)[1] + place_variables(model_state, layout, mesh)[1]
