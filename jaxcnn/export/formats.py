"""A run's kept model as one inference function, written as StableHLO or ONNX, and each
artefact run back the way a server would run it.

    predict = inference_function(run.model_dir, config.model, image_shape)  # images -> logits
    spec = image_spec(image_shape, "uint8")       # [batch, H, W, C], batch symbolic
    data = stablehlo_bytes(predict, spec)         # jax.export's Exported.serialize()
    logits = run_stablehlo(data, images)          # jax.export.deserialize(data).call(images)
    data = onnx_bytes(predict, spec, "name")      # jax2onnx, from the model's lax operations
    logits = run_onnx(data, images)               # ONNX Runtime, CPU

The function is the model in eval mode (batch norm's running statistics, no dropout, no
stochastic depth) with its weights as constants, on the images as the run's model takes
them: float32 in [0, 1], or an image folder's uint8 0-255, which the model divides by 255
itself (jaxcnn.models.unit_pixels). The batch is symbolic, so one artefact takes any batch.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.export.inlined import inlined
from jaxcnn.models import call
from jaxcnn.run_config import ParallelConfig
from jaxcnn.saved_model import model_template, restore_model
from jaxcnn.sharding import mesh_for

INPUT, OUTPUT = "images", "logits"
STABLEHLO_INSTEAD = "export --format stablehlo instead (jax.export runs every operation XLA does)"


def inference_function(model_dir: str | Path, model_config: ModelConfig, image_shape: tuple[int, int, int]) -> Callable:
    """images [B, H, W, C] -> logits [B, classes] (float32): the kept model in `model_dir`,
    read onto one device, in eval mode."""
    layout, mesh = mesh_for(ParallelConfig(layout="single"), jax.devices()[:1])
    template = model_template(model_config, image_shape, layout, mesh)
    params, stats = restore_model(model_dir, template)
    model = nnx.merge(template.graphdef, params, stats)

    def logits_of(images_BHWC):
        return call(model, images_BHWC, train=False).astype(jnp.float32)

    return logits_of


def image_spec(image_shape: tuple[int, int, int], dtype: str) -> jax.ShapeDtypeStruct:
    """[batch, H, W, C] images of `dtype`, the batch a symbolic dimension."""
    height, width, channels = image_shape
    shape = jax.export.symbolic_shape(f"batch, {height}, {width}, {channels}")
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def stablehlo_bytes(function: Callable, spec: jax.ShapeDtypeStruct) -> bytes:
    """`function` exported by jax.export for any batch, serialized (weights included)."""
    return bytes(jax.export.export(jax.jit(function))(spec).serialize())


def run_stablehlo(data: bytes, images: np.ndarray) -> np.ndarray:
    return np.asarray(jax.export.deserialize(bytearray(data)).call(images))


def onnx_bytes(function: Callable, spec: jax.ShapeDtypeStruct, name: str) -> bytes:
    """`function` converted by jax2onnx from its lax operations (jaxcnn.export.inlined),
    input "images" with a symbolic batch, output "logits". An operation jax2onnx cannot
    convert is a UserError naming it."""
    to_onnx = _jax2onnx()
    closed = jax.make_jaxpr(function)(spec)
    try:  # quiet: its plugins for libraries we do not use warn as they load, onnx_ir of values it leaves untyped
        with _quiet("jax2onnx"), _quiet("onnx_ir"):
            model = to_onnx(inlined(closed), [spec], model_name=name, input_names=[INPUT], output_names=[OUTPUT])
            return model.SerializeToString()
    except NotImplementedError as err:
        found = re.search(r"primitive '([^']+)'", str(err))
        what = f"the JAX operation {found.group(1)!r}" if found else _first_line(err)
        raise UserError(f"jax2onnx cannot convert {what}, which the model uses, to ONNX; {STABLEHLO_INSTEAD}") from None
    except Exception as err:  # a converter's failure on one operation: said in one line, not a traceback
        raise UserError(
            f"jax2onnx failed to convert the model to ONNX ({type(err).__name__}: {_first_line(err)}); "
            f"{STABLEHLO_INSTEAD}"
        ) from None


def run_onnx(data: bytes, images: np.ndarray) -> np.ndarray:
    """The ONNX model run by ONNX Runtime on the CPU. An operator it cannot run is a
    UserError naming it."""
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: its shape-merge notes about jax2onnx's graphs are not ours
    try:
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        return session.run([OUTPUT], {INPUT: images})[0]
    except Exception as err:  # onnxruntime's errors share no public base class
        raise UserError(
            f"ONNX Runtime cannot run the exported model ({_first_line(err)}); {STABLEHLO_INSTEAD}"
        ) from None


def _jax2onnx():
    try:
        from jax2onnx import to_onnx
    except ImportError:
        raise UserError("export --format onnx needs jax2onnx: pip install 'jaxcnn[export]'") from None
    return to_onnx


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise UserError("checking an ONNX export needs onnxruntime: pip install 'jaxcnn[export]'") from None
    return onnxruntime


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]
