"""torchvision's state_dict keys for the ResNets, ConvNeXt and MobileNetV2 (and timm's for
ConvNeXt, whose names differ; timm's ResNets use torchvision's), mapped onto jaxcnn's modules,
so that their weights load as they are (jaxcnn.pretrained reads them from safetensors files):

    state = {k: v.numpy() for k, v in torchvision.models.convnext_tiny(weights=...).state_dict().items()}
    load_torchvision(model, ModelConfig(name="convnext_tiny", num_classes=1000), (224, 224, 3), state)

Each key maps to a parameter's path in the NNX state and how its array turns around:
torch's conv weight is (O, I/groups, kh, kw), Flax's kernel (kh, kw, I/groups, O); a Linear's
weight is (O, I), Flax's (I, O); ConvNeXt's layer scale is (C, 1, 1), here (C,). Batch norm's
`num_batches_tracked` has no counterpart (its momentum is fixed) and is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np
from flax import nnx

from jaxcnn.config import CONVNEXTS, RESNETS, ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models.mobilenet import mobilenet_widths

TRANSFORMS = {
    "conv": lambda w: np.transpose(w, (2, 3, 1, 0)),
    # a Linear's (O, I), or timm's 1x1-conv MLP's (O, I, 1, 1) (conv_mlp: convnext_atto..nano)
    "linear": lambda w: np.transpose(w.reshape(w.shape[0], -1)),
    "vector": lambda w: w,
    "layer_scale": lambda w: w.reshape(w.shape[0]),
}
SKIPPED = ("num_batches_tracked",)


def _conv(torch_prefix: str, path: str, bias: bool) -> Iterator[tuple[str, str, str]]:
    yield f"{torch_prefix}.weight", f"{path}/kernel", "conv"
    if bias:
        yield f"{torch_prefix}.bias", f"{path}/bias", "vector"


def _linear(torch_prefix: str, path: str) -> Iterator[tuple[str, str, str]]:
    yield f"{torch_prefix}.weight", f"{path}/kernel", "linear"
    yield f"{torch_prefix}.bias", f"{path}/bias", "vector"


def _layer_norm(torch_prefix: str, path: str) -> Iterator[tuple[str, str, str]]:
    yield f"{torch_prefix}.weight", f"{path}/scale", "vector"
    yield f"{torch_prefix}.bias", f"{path}/bias", "vector"


def _batch_norm(torch_prefix: str, path: str) -> Iterator[tuple[str, str, str]]:
    yield from _layer_norm(torch_prefix, path)
    yield f"{torch_prefix}.running_mean", f"{path}/mean", "vector"
    yield f"{torch_prefix}.running_var", f"{path}/var", "vector"


def _batch_norm_only(config: ModelConfig) -> None:
    if config.norm != "batch":
        raise UserError(f"torchvision's {config.name} uses batch norm; its weights need --norm batch")


def _resnet_keys(config: ModelConfig) -> Iterator[tuple[str, str, str]]:
    _batch_norm_only(config)
    yield from _conv("conv1", "stem/conv", bias=False)
    yield from _batch_norm("bn1", "stem/norm")
    block, stages = RESNETS[config.name]
    unit = 0
    for stage, blocks in enumerate(stages):
        for b in range(blocks):
            torch_block, at = f"layer{stage + 1}.{b}", f"blocks/{unit}"
            for i in range(1, (2 if block == "basic" else 3) + 1):
                yield from _conv(f"{torch_block}.conv{i}", f"{at}/conv{i}", bias=False)
                yield from _batch_norm(f"{torch_block}.bn{i}", f"{at}/norm{i}")
            if b == 0 and (stage > 0 or block != "basic"):  # where jaxcnn and torchvision project the shortcut
                yield from _conv(f"{torch_block}.downsample.0", f"{at}/shortcut/conv", bias=False)
                yield from _batch_norm(f"{torch_block}.downsample.1", f"{at}/shortcut/norm")
            unit += 1
    yield from _linear("fc", "head/fc")


class ConvNeXtNames(NamedTuple):
    """Where a ConvNeXt's parts sit in one library's state_dict."""

    stem: tuple[str, str]  # conv, norm
    downsample: Callable[[int], tuple[str, str]]  # stage -> norm, conv
    block: Callable[[int, int], str]  # (stage, block) -> its prefix
    parts: tuple[str, str, str, str, str]  # in a block: dwconv, norm, pwconv1, pwconv2, layer scale
    layer_scale: str  # TRANSFORMS entry: torchvision's is (C, 1, 1), timm's `gamma` (C,)
    head: tuple[str, str]  # norm, classifier


TORCHVISION_CONVNEXT = ConvNeXtNames(
    ("features.0.0", "features.0.1"), lambda s: (f"features.{2 * s}.0", f"features.{2 * s}.1"),
    lambda s, i: f"features.{2 * s + 1}.{i}", ("block.0", "block.2", "block.3", "block.5", "layer_scale"),
    "layer_scale", ("classifier.0", "classifier.2"),
)  # fmt: skip
TIMM_CONVNEXT = ConvNeXtNames(
    ("stem.0", "stem.1"), lambda s: (f"stages.{s}.downsample.0", f"stages.{s}.downsample.1"),
    lambda s, i: f"stages.{s}.blocks.{i}", ("conv_dw", "norm", "mlp.fc1", "mlp.fc2", "gamma"), "vector",
    ("head.norm", "head.fc"),
)  # fmt: skip


def _convnext_keys(config: ModelConfig, names: ConvNeXtNames = TORCHVISION_CONVNEXT) -> Iterator[tuple[str, str, str]]:
    yield from _conv(names.stem[0], "stem/conv", bias=True)
    yield from _layer_norm(names.stem[1], "stem/norm")
    unit = 0  # index into the model's blocks: downsamples and blocks in order
    for stage, depth in enumerate(CONVNEXTS[config.name][0]):
        if stage > 0:
            norm, conv = names.downsample(stage)
            yield from _layer_norm(norm, f"blocks/{unit}/norm")
            yield from _conv(conv, f"blocks/{unit}/conv", bias=True)
            unit += 1
        for i in range(depth):
            theirs, at = names.block(stage, i), f"blocks/{unit}"
            dwconv, norm, pwconv1, pwconv2, layer_scale = (f"{theirs}.{part}" for part in names.parts)
            yield from _conv(dwconv, f"{at}/dwconv", bias=True)
            yield from _layer_norm(norm, f"{at}/norm")
            yield from _linear(pwconv1, f"{at}/pwconv1")
            yield from _linear(pwconv2, f"{at}/pwconv2")
            yield layer_scale, f"{at}/layer_scale", names.layer_scale
            unit += 1
    yield from _layer_norm(names.head[0], "head/norm")
    yield from _linear(names.head[1], "head/fc")


def _mobilenet_keys(config: ModelConfig) -> Iterator[tuple[str, str, str]]:
    _batch_norm_only(config)
    yield from _conv("features.0.0", "stem/conv", bias=False)
    yield from _batch_norm("features.0.1", "stem/norm")
    _, blocks, _ = mobilenet_widths(config)
    for j, (t, _, _) in enumerate(blocks):
        torch_block, at = f"features.{j + 1}.conv", f"blocks/{j}"
        parts = [("expand", True)] * (t != 1) + [("depthwise", True), ("project", False)]
        index = 0
        for name, sequential in parts:  # Conv2dNormActivation is conv.i.{0,1}; the project conv and BN are flat
            if sequential:
                yield from _conv(f"{torch_block}.{index}.0", f"{at}/{name}/conv", bias=False)
                yield from _batch_norm(f"{torch_block}.{index}.1", f"{at}/{name}/norm")
                index += 1
            else:
                yield from _conv(f"{torch_block}.{index}", f"{at}/{name}/conv", bias=False)
                yield from _batch_norm(f"{torch_block}.{index + 1}", f"{at}/{name}/norm")
    yield from _conv(f"features.{len(blocks) + 1}.0", "last/conv", bias=False)
    yield from _batch_norm(f"features.{len(blocks) + 1}.1", "last/norm")
    yield from _linear("classifier.1", "head/fc")


# family -> {naming scheme: its keys}; timm names ResNets as torchvision does
SCHEMES = {
    "resnet": {"torchvision": _resnet_keys},
    "convnext": {"torchvision": _convnext_keys, "timm": lambda config: _convnext_keys(config, TIMM_CONVNEXT)},
    "mobilenet": {"torchvision": _mobilenet_keys},
}


def name_schemes(config: ModelConfig) -> dict[str, dict[str, tuple[str, str]]]:
    """{scheme: {key: (the parameter's path in the NNX state, its TRANSFORMS entry)}} for
    the model's family ({} for the CNN family, which has no torchvision twin)."""
    return {
        scheme: {key: (path, how) for key, path, how in keys(config)}
        for scheme, keys in SCHEMES.get(config.family, {}).items()
    }


def torchvision_keys(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """torchvision key -> (the parameter's path in the NNX state, its TRANSFORMS entry)."""
    if config.family not in SCHEMES:
        raise UserError(f"torchvision names are mapped for the ResNets, ConvNeXt and MobileNetV2, not {config.name}")
    return name_schemes(config)["torchvision"]


def torch_shape(how: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape torchvision gives a parameter of Flax shape `shape` (the TRANSFORMS' inverse)."""
    if how == "conv":
        kh, kw, cin, cout = shape
        return cout, cin, kh, kw
    if how == "linear":
        return shape[::-1]
    return (shape[0], 1, 1) if how == "layer_scale" else shape


def load_torchvision(model: nnx.Module, config: ModelConfig, state_dict: Mapping[str, np.ndarray]) -> None:
    """Set `model`'s parameters and batch statistics from torchvision's `state_dict`
    (arrays, e.g. `{k: v.numpy()}`), checking every key and shape."""
    keys = torchvision_keys(config)
    unknown = sorted(k for k in state_dict if k not in keys and not k.endswith(SKIPPED))
    missing = sorted(k for k in keys if k not in state_dict)
    if unknown or missing:
        raise UserError(
            f"torchvision state_dict does not fit {config.name}: unknown {unknown[:3]}, missing {missing[:3]}"
        )
    flat = list(nnx.to_flat_state(nnx.state(model)))
    where = {"/".join(map(str, path)): path for path, _ in flat}
    values = dict(flat)
    for key, (path, how) in keys.items():
        value = TRANSFORMS[how](np.asarray(state_dict[key], np.float32))
        old = values[where[path]]
        if value.shape != old.shape:
            raise UserError(f"{key}: torchvision's {value.shape} against {path}'s {old.shape}")
        values[where[path]] = old.replace(value) if isinstance(old, nnx.Variable) else value
    nnx.update(model, nnx.from_flat_state(list(values.items())))
