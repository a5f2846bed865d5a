"""A model of your own, written here as a Flax user writes one (logical names through
`nnx.with_partitioning`, no `train` argument), trains under jaxcnn's layouts to the same
numbers as on one device."""

import numpy as np
import pytest
from conftest import bundled_digits, train_losses
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxcnn.errors import UserError
from jaxcnn.models import CustomModel
from jaxcnn.sharding import get_layout

STEPS = 10


def named(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Net(nnx.Module):
    """conv -> batch norm -> ReLU -> dense -> ReLU -> dense, on the bundled 8x8 digits."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 16, (3, 3), kernel_init=named("kh", "kw", "conv_in", "conv_out"), use_bias=False,
                             rngs=rngs)  # fmt: skip
        norm = {"out_sharding": ("norm",)}
        self.norm = nnx.BatchNorm(16, use_fast_variance=False, scale_metadata=norm, bias_metadata=norm, rngs=rngs)
        self.hidden = nnx.Linear(8 * 8 * 16, 32, kernel_init=named("embed", "mlp"), rngs=rngs)
        self.out = nnx.Linear(32, 10, kernel_init=named("mlp", "classes"), rngs=rngs)

    def __call__(self, x):
        y = nnx.relu(self.norm(self.conv(x)))
        return self.out(nnx.relu(self.hidden(y.reshape(y.shape[0], -1))))


MODEL = CustomModel(Net, name="net")


def test_your_model_builds_without_a_mesh_and_keeps_its_names():
    model = MODEL.build(0)  # flax alone would ask for a mesh: "An auto mesh context or metadata is required"
    assert model.conv.kernel.get_metadata()["out_sharding"] == ("kh", "kw", "conv_in", "conv_out")


@pytest.mark.parametrize(("layout", "mesh"), [("dp", {"data": 4}), ("fsdp", {"data": 4}), ("tp", {"model": 2})])
def test_your_model_trains_under_a_layout_as_on_one_device(layout, mesh):
    reference, _, _ = train_losses(get_layout("single"), {"data": 1}, MODEL, steps=STEPS)
    losses, _, program = train_losses(get_layout(layout), mesh, MODEL, steps=STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert reference[-1] < reference[0]  # it trains
    split = {p.path: p.spec for p in program.anatomy.placements if any(p.spec)}
    if layout == "dp":
        assert not split  # replicated parameters
        # and a split batch: the compiled step takes it split over data, each device a quarter of the rows
        taken = program.train_step.input_shardings[0][1:]  # (state, images, labels)
        for given, compiled in zip(program.train_input.arrays, taken, strict=True):
            assert given.sharding.spec == compiled.spec == P("data", *[None] * (given.ndim - 1)), compiled
        data, quarter = bundled_digits(), program.batch_size // 4
        images, _ = program.train_input.place(data.images[: program.batch_size], data.labels[: program.batch_size])
        rows = {(s.index[0].start, s.index[0].stop) for s in images.addressable_shards}
        assert rows == {(i * quarter, (i + 1) * quarter) for i in range(4)}, rows
    else:  # the kernels' logical names reached the mesh
        axis = "data" if layout == "fsdp" else "model"
        assert any(axis in str(spec) for path, spec in split.items() if "kernel" in path), split


def test_the_pipeline_refuses_your_model():
    with pytest.raises(UserError, match="every layout but the pipeline"):
        train_losses(get_layout("pipeline"), {"data": 1, "stage": 2}, MODEL, steps=2)
