"""The model a run trains: the families' presets (the VGG-like CNN, the ResNets, ConvNeXt,
MobileNetV2) and ModelConfig, frozen and validated where it is built."""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxcnn.errors import UserError

DEFAULT_MODEL = "cnn2d_3layer_fullconnected_3layer"
MODEL_NAME = re.compile(r"cnn2d_(\d)layer_fullconnected_(\d)layer")
MAX_CONV_BLOCKS, MAX_DENSE_LAYERS = 6, 4

# The ResNets (He et al. 2016, torchvision's v1.5: a bottleneck's stride on its 3x3 conv):
# name -> (residual block, blocks per stage). `conv_features` are the stages' widths (a
# bottleneck's output is 4x its width). The tiny ones keep every mechanism -- an identity
# and a projection shortcut, a stride-2 stage -- at test sizes.
RESNETS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet_tiny": ("basic", (1, 1)),
    "resnet_tiny_bottleneck": ("bottleneck", (1, 1)),
}
RESNET_WIDTHS = (64, 128, 256, 512)
TINY_RESNET_WIDTHS = (8, 16)

# ConvNeXt (Liu et al. 2022) as torchvision builds it: name -> (blocks per stage, stage widths);
# `conv_features` overrides the widths. tiny..large are torchvision's; atto..nano timm's smaller
# widths of the same block (ConvNeXt V2's names), small enough to train on a CPU; convnext_test
# keeps every mechanism (a downsample between two stages, layer scale, stochastic depth) at
# test sizes.
CONVNEXTS = {
    "convnext_tiny": ((3, 3, 9, 3), (96, 192, 384, 768)),
    "convnext_small": ((3, 3, 27, 3), (96, 192, 384, 768)),
    "convnext_base": ((3, 3, 27, 3), (128, 256, 512, 1024)),
    "convnext_large": ((3, 3, 27, 3), (192, 384, 768, 1536)),
    "convnext_atto": ((2, 2, 6, 2), (40, 80, 160, 320)),
    "convnext_femto": ((2, 2, 6, 2), (48, 96, 192, 384)),
    "convnext_pico": ((2, 2, 6, 2), (64, 128, 256, 512)),
    "convnext_nano": ((2, 2, 8, 2), (80, 160, 320, 640)),
    "convnext_test": ((1, 2), (16, 32)),
}
# MobileNetV2 (Sandler et al. 2018) as torchvision builds it: name -> (stem width, inverted
# residual stages as (expansion t, width c, blocks n, first stride s), last conv's width),
# all at width multiplier 1 (`width_multiplier` scales them as torchvision's width_mult).
# mobilenet_v2_test keeps every mechanism: an expansion-1 block, a stride-2 stage, a residual.
MOBILENETS = {
    "mobilenet_v2": (
        32,
        ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)),
        1280,
    ),
    "mobilenet_v2_test": (32, ((1, 16, 1, 1), (6, 24, 2, 2)), 64),
}
# The stem: "small" a 3x3 stride-1 conv (CIFAR-sized images), "imagenet" a 7x7 stride-2 conv
# and a 3x3 stride-2 max-pool; "auto" picks imagenet from IMAGENET_STEM_FROM pixels a side.
# ConvNeXt: imagenet a 4x4 stride-4 patchify conv, small 2x2 stride 2 (28 px -> 14 -> 7 -> 3 -> 1).
# MobileNetV2: imagenet a 3x3 stride-2 conv, small the same at stride 1.
STEMS = ("auto", "small", "imagenet")
IMAGENET_STEM_FROM = 128

# Preset widths: conv block i has CONV_WIDTHS[i] channels; hidden dense layer j DENSE_WIDTHS[j].
CONV_WIDTHS = (32, 64, 128, 128, 256, 256)
DENSE_WIDTHS = (256, 128, 128)
NORMS = ("none", "batch", "group")  # the choices; ConvNeXt's is always "layer" (LayerNorm over channels)
# Batch norm's training statistics: the whole global batch's (synchronised, one collective
# each way) or each device's own piece's (no collective; a per-device batch of a few images
# gives noisy statistics -- docs/layouts.md has the measured accuracy cost).
NORM_STATISTICS = ("global", "per-device")
# jax.checkpoint per conv block: keep nothing but its input (full), the conv outputs
# (dots: jax.checkpoint_policies.dots_saveable) or the activations named in
# `remat_names` (names: save_only_these_names), recomputing the rest in the backward pass.
REMAT_POLICIES = ("none", "full", "dots", "names")
REMAT_NAMES = ("conv", "norm", "relu")  # the activations a conv block tags (checkpoint_name)
DTYPES = ("float32", "bfloat16")
# Kernels computed two ways with the same numbers, one faster on each platform
# (jaxcnn.platform_choices; "auto": the platform's choice, made when the program is built).
CONV1X1_KERNELS = ("auto", "dot", "conv")
MAX_POOL_KERNELS = ("auto", "select", "window")


@dataclass(frozen=True)
class ModelConfig:
    name: str = DEFAULT_MODEL
    conv_features: tuple[int, ...] = ()  # () = the name's preset widths
    dense_features: tuple[int, ...] = ()  # hidden dense widths; the classifier is added
    norm: str = "batch"
    norm_statistics: str = "global"  # NORM_STATISTICS
    dropout: float = 0.0
    num_classes: int = 10
    remat: str = "none"
    remat_names: tuple[str, ...] = ("norm",)  # saved by remat="names"
    dtype: str = "float32"  # compute dtype; parameters and optimizer state stay float32
    stem: str = "auto"  # ResNets only (STEMS)
    conv1x1: str = "auto"  # ResNets' 1x1 convs as a matrix product or a convolution (CONV1X1_KERNELS)
    max_pool: str = "auto"  # the CNN's 2x2 pool: select (jaxcnn.layers) or window (reduce_window)
    stochastic_depth: float = 0.0  # ConvNeXt: the last block's drop rate, linear from 0 (torchvision's tiny: 0.1)
    width_multiplier: float = 1.0  # MobileNetV2: every width x this, rounded to 8 (torchvision's width_mult)

    def __post_init__(self):
        if self.name in RESNETS:
            self._check_resnet()
        elif self.name in CONVNEXTS:
            self._check_convnext()
        elif self.name in MOBILENETS:
            self._check_mobilenet()
        else:
            self._check_cnn()
        self._check_common()

    @property
    def is_resnet(self) -> bool:
        return self.name in RESNETS

    @property
    def family(self) -> str:
        """ "resnet", "convnext", "mobilenet" or "cnn" (the VGG-like cnn2d_* family)."""
        for family, names in (("resnet", RESNETS), ("convnext", CONVNEXTS), ("mobilenet", MOBILENETS)):
            if self.name in names:
                return family
        return "cnn"

    @property
    def kernel_choice(self) -> str | None:
        """The field of the platform-dependent kernel this family uses (jaxcnn.platform_choices):
        1x1 convolutions (ResNets, MobileNetV2), the 2x2 max-pool (the CNN), none (ConvNeXt:
        its 1x1 layers are dense layers already)."""
        return {"resnet": "conv1x1", "mobilenet": "conv1x1", "cnn": "max_pool"}.get(self.family)

    def resnet_stem(self, image_shape: tuple[int, int, int]) -> str:
        """The stem a ResNet (or ConvNeXt, MobileNetV2) uses on images of `image_shape` (H, W, C)."""
        if self.stem != "auto":
            return self.stem
        return "imagenet" if min(image_shape[:2]) >= IMAGENET_STEM_FROM else "small"

    def _check_no_cnn_options(self, allow_dropout: bool = False):
        if self.dense_features or (self.dropout and not allow_dropout):
            what = "--dense-features" + ("" if allow_dropout else " and --dropout")
            raise UserError(f"{self.name} ends in global average pooling and one classifier: drop {what}")
        if self.stem not in STEMS:
            raise UserError(f"unknown --stem {self.stem!r}; use one of {', '.join(STEMS)}")
        if self.max_pool != "auto":
            raise UserError(f"--max-pool is for the CNN family's 2x2 pools; drop it for {self.name}")

    def _check_convnext(self):
        depths, preset = CONVNEXTS[self.name]
        widths = self.conv_features or preset
        if len(widths) != len(depths):
            raise UserError(
                f"model {self.name} has {len(depths)} stages but --conv-features gives {len(widths)} widths"
            )
        if min(widths) < 1:
            raise UserError("layer widths must be positive integers")
        self._check_no_cnn_options()
        if self.conv1x1 != "auto":
            raise UserError(f"--conv1x1: {self.name}'s 1x1 layers are dense layers already; drop it")
        if self.norm not in ("batch", "layer"):  # "batch" is the flag's default, not a choice made
            raise UserError(f"{self.name} normalises with LayerNorm over channels (torchvision's); drop --norm")
        object.__setattr__(self, "norm", "layer")
        if not 0.0 <= self.stochastic_depth < 1.0:
            raise UserError(f"--stochastic-depth must be in [0, 1), got {self.stochastic_depth}")
        object.__setattr__(self, "conv_features", tuple(widths))

    def _check_mobilenet(self):
        if self.conv_features:
            raise UserError(f"{self.name}'s widths come from its preset; scale them with --width-multiplier instead")
        if not self.width_multiplier > 0:
            raise UserError(f"--width-multiplier must be positive, got {self.width_multiplier}")
        self._check_no_cnn_options(allow_dropout=True)  # its classifier's dropout (torchvision's: 0.2)

    def _check_resnet(self):
        _, stages = RESNETS[self.name]
        widths = self.conv_features or (TINY_RESNET_WIDTHS if "tiny" in self.name else RESNET_WIDTHS)
        if len(widths) != len(stages):
            raise UserError(
                f"model {self.name} has {len(stages)} stages but --conv-features gives {len(widths)} widths"
            )
        self._check_no_cnn_options()
        if min(widths) < 1:
            raise UserError("layer widths must be positive integers")
        object.__setattr__(self, "conv_features", tuple(widths))

    def _check_cnn(self):
        match = MODEL_NAME.fullmatch(self.name)
        if not match:
            raise UserError(
                f"unknown model {self.name!r}; use cnn2d_<N>layer_fullconnected_<M>layer, "
                f"e.g. {DEFAULT_MODEL} (N in 1..{MAX_CONV_BLOCKS}, M in 1..{MAX_DENSE_LAYERS}), "
                f"or one of {', '.join((*RESNETS, *CONVNEXTS, *MOBILENETS))}"
            )
        n_conv, n_dense = int(match[1]), int(match[2])
        if not (1 <= n_conv <= MAX_CONV_BLOCKS and 1 <= n_dense <= MAX_DENSE_LAYERS):
            raise UserError(
                f"model {self.name!r}: use 1..{MAX_CONV_BLOCKS} conv and 1..{MAX_DENSE_LAYERS} dense layers"
            )
        conv = self.conv_features or CONV_WIDTHS[:n_conv]
        dense = self.dense_features or DENSE_WIDTHS[: n_dense - 1]
        if len(conv) != n_conv:
            raise UserError(f"model {self.name} has {n_conv} conv blocks but --conv-features gives {len(conv)} widths")
        if len(dense) != n_dense - 1:
            raise UserError(
                f"model {self.name} has {n_dense - 1} hidden dense layers but --dense-features gives {len(dense)} widths"
            )
        if min(conv + dense, default=1) < 1:
            raise UserError("layer widths must be positive integers")
        if self.stem != "auto":
            raise UserError(f"--stem is for the ResNets ({', '.join(RESNETS)}); drop it for {self.name}")
        if self.conv1x1 != "auto":
            raise UserError(f"--conv1x1 is for the ResNets' 1x1 convolutions; drop it for {self.name}")
        object.__setattr__(self, "conv_features", tuple(conv))
        object.__setattr__(self, "dense_features", tuple(dense))

    def _check_common(self):
        if self.norm not in NORMS and not (self.norm == "layer" and self.family == "convnext"):
            raise UserError(f"unknown --norm {self.norm!r}; use one of {', '.join(NORMS)}")
        if self.stochastic_depth and self.family != "convnext":
            raise UserError(f"--stochastic-depth is ConvNeXt's (its residual blocks); drop it for {self.name}")
        if self.width_multiplier != 1.0 and self.family != "mobilenet":
            raise UserError(f"--width-multiplier is MobileNetV2's; drop it for {self.name}")
        if self.norm_statistics not in NORM_STATISTICS:
            raise UserError(
                f"unknown --norm-statistics {self.norm_statistics!r}; use one of {', '.join(NORM_STATISTICS)}"
            )
        if self.norm_statistics != "global" and self.norm != "batch":
            raise UserError("--norm-statistics is batch norm's; drop it or use --norm batch")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.remat not in REMAT_POLICIES:
            raise UserError(f"unknown --remat {self.remat!r}; use one of {', '.join(REMAT_POLICIES)}")
        unknown = sorted(set(self.remat_names) - set(REMAT_NAMES))
        if unknown:
            raise UserError(f"unknown --remat-names {', '.join(unknown)}; use some of {', '.join(REMAT_NAMES)}")
        if self.dtype not in DTYPES:
            raise UserError(f"unknown --dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        for flag, value, known in (
            ("conv1x1", self.conv1x1, CONV1X1_KERNELS),
            ("max-pool", self.max_pool, MAX_POOL_KERNELS),
        ):
            if value not in known:
                raise UserError(f"unknown --{flag} {value!r}; use one of {', '.join(known)}")
        if self.num_classes < 2:
            raise UserError(f"--num-classes must be at least 2, got {self.num_classes}")
