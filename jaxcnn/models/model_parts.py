"""The named parts of a model, in order from the input: what `--freeze stem,stage1` names and
`--backbone-lr` tells from the head (jaxcnn.optim).

- ResNets: `stem`, `stage1`..`stage4` (torchvision's layer1..layer4), `head` (the classifier);
- ConvNeXt: `stem`, `stage1`..`stage4` (each stage's downsample in front of it, as timm
  groups it), `head` (its LayerNorm and the classifier);
- MobileNetV2: `stem`, `stage1`..`stage7` (the inverted-residual settings), `last` (the 1x1
  conv to 1280 channels), `head`;
- the CNN family: `stage1`..`stageN` (the conv blocks), `dense1`.. (the hidden dense layers),
  `head` (the last dense layer).

The backbone is every part but `head`.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxcnn.config import CONVNEXTS, MOBILENETS, RESNETS, ModelConfig

HEAD = "head"
BACKBONE = "backbone"  # --freeze backbone: every part but the head


def _stage_of_block(config: ModelConfig) -> list[str]:
    """The part each entry of the model's `blocks` list belongs to."""
    if config.family == "resnet":
        return [f"stage{s + 1}" for s, n in enumerate(RESNETS[config.name][1]) for _ in range(n)]
    if config.family == "convnext":  # the downsample before stages 2.. is the stage's first unit
        return [f"stage{s + 1}" for s, n in enumerate(CONVNEXTS[config.name][0]) for _ in range(n + (s > 0))]
    if config.family == "mobilenet":
        return [f"stage{s + 1}" for s, (_, _, n, _) in enumerate(MOBILENETS[config.name][1]) for _ in range(n)]
    return [f"stage{i + 1}" for i in range(len(config.conv_features))]


def part_names(config: ModelConfig) -> list[str]:
    """The model's parts, input first."""
    stages = list(dict.fromkeys(_stage_of_block(config)))
    if config.family == "cnn":
        return [*stages, *(f"dense{j + 1}" for j in range(len(config.dense_features))), HEAD]
    return ["stem", *stages, *(["last"] if config.family == "mobilenet" else []), HEAD]


def part_of(config: ModelConfig) -> Callable[[str], str]:
    """A parameter's path in the model's state ("blocks/3/conv1/kernel") -> its part."""
    blocks, dense = _stage_of_block(config), len(config.dense_features)

    def part(path: str) -> str:
        top, _, rest = path.partition("/")
        if top == "blocks":
            return blocks[int(rest.partition("/")[0])]
        if top == "dense":  # the CNN's dense layers: the last is the classifier
            j = int(rest.partition("/")[0])
            return HEAD if j == dense else f"dense{j + 1}"
        return top  # stem, last, head

    return part
