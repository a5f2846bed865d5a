"""Logical axis names: the only axis names model code may use.

A layout maps these to mesh axes; the model never names `data` or `model` itself.
Parameter and activation names are kept apart so that a rule for one cannot
silently move the other (the MaxText convention).
"""

# Parameters. Conv kernels are HWIO: (kh, kw, conv_in, conv_out).
KH = "kh"
KW = "kw"
CONV_IN = "conv_in"
CONV_OUT = "conv_out"
EMBED = "embed"  # dense kernel input dim
MLP = "mlp"  # dense kernel output dim (hidden layers)
CLASSES = "classes"  # output layer's output dim
NORM = "norm"  # normalisation scale / bias / running statistics
# A depthwise conv's kernel is (kh, kw, group_in, C): group_in is its input channels per
# group (1), never split; C is named by the channel space the conv acts on (conv_in on a
# residual stream, conv_out inside an inverted bottleneck), so that tp splits a depthwise
# conv's channels exactly where it splits its input's -- and then it moves nothing.
GROUP_IN = "group_in"

PARAM_AXES = (KH, KW, CONV_IN, CONV_OUT, EMBED, MLP, CLASSES, NORM, GROUP_IN)

# Activations.
BATCH = "batch"
HEIGHT = "height"
WIDTH = "width"
CHANNELS = "channels"
FEATURES = "features"

ACTIVATION_AXES = (BATCH, HEIGHT, WIDTH, CHANNELS, FEATURES)

LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

# Not an axis: the rule key for FSDP ("split every large parameter over this mesh axis").
PARAMS = "params"
RULE_KEYS = (*LOGICAL_AXES, PARAMS)

# Mesh axes a layout may use.
DATA = "data"
MODEL = "model"
SPATIAL = "spatial"
STAGE = "stage"
FSDP = "fsdp"  # a second data-like axis, for FSDP beside plain dp on a 3-axis mesh

MESH_AXES = (DATA, FSDP, MODEL, SPATIAL, STAGE)

# Shorthands for the annotations the model attaches.
CONV_KERNEL = (KH, KW, CONV_IN, CONV_OUT)


def depthwise_kernel(space: str) -> tuple[str, str, str, str]:
    """The names of a depthwise conv's kernel acting on channel space `space`."""
    return (KH, KW, GROUP_IN, space)


IMAGE_BHWC = (BATCH, HEIGHT, WIDTH, CHANNELS)
FEATURES_BF = (BATCH, FEATURES)
