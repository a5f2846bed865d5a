"""ImageNet-style crops (torchvision's reference recipe), as boxes in an image's own pixels.

    training (--augment imagenet):  RandomResizedCrop -- a random box of 8%-100% of the
                                    image's area, aspect ratio 3/4-4/3, resized to the
                                    model's input -- then a horizontal flip half the time
    evaluation and predict:         the shorter side resized to size/0.875 (256 for 224),
                                    the centre kept

A crop's random numbers are drawn for the whole global batch from (seed, epoch, batch)
before any image is opened (`RandomResizedCrop.draws`); the worker that decodes an image
turns its example's numbers into a box once the file's header has told it the image's size
(`random_box`, torchvision's `get_params`: 10 attempts, then a centre crop). So a crop is
the same whatever process, worker or resumed run decodes it. The box is cut from the image
as it is resized (jaxcnn.data.folders): the pixels outside it are never resampled, and a
JPEG much larger than the box is decoded at 1/2, 1/4 or 1/8 scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ATTEMPTS = 10  # torchvision's tries at a box that fits, before its centre-crop fallback
SCALE = (0.08, 1.0)  # a box's area, as a share of the image's
RATIO = (3 / 4, 4 / 3)  # a box's width / height
CENTRE_SHARE = 0.875  # evaluation: the crop's side / the resized shorter side (224 / 256)
DRAWS_PER_EXAMPLE = 4 * ATTEMPTS + 1  # per attempt (area, ratio, top, left), then the flip

Box = tuple[float, float, float, float]  # (left, top, right, bottom) in pixels: Pillow's order


def random_box(uniforms_A4: np.ndarray, height: int, width: int) -> Box:
    """torchvision's RandomResizedCrop box in an image of (height, width), from one
    example's uniform [0, 1) numbers: (area, log-ratio, top, left) per attempt."""
    area_A = height * width * (SCALE[0] + uniforms_A4[:, 0] * (SCALE[1] - SCALE[0]))
    low, high = math.log(RATIO[0]), math.log(RATIO[1])
    ratio_A = np.exp(low + uniforms_A4[:, 1] * (high - low))
    w_A = np.round(np.sqrt(area_A * ratio_A)).astype(np.int64)  # half to even, as Python's round
    h_A = np.round(np.sqrt(area_A / ratio_A)).astype(np.int64)
    fits_A = (w_A > 0) & (w_A <= width) & (h_A > 0) & (h_A <= height)
    if fits_A.any():
        k = int(np.argmax(fits_A))
        w, h = int(w_A[k]), int(h_A[k])
        top = int(uniforms_A4[k, 2] * (height - h + 1))  # torch.randint(0, height - h + 1)
        left = int(uniforms_A4[k, 3] * (width - w + 1))
        return left, top, left + w, top + h
    if width / height < RATIO[0]:  # no attempt fitted: the centre, at the nearest allowed ratio
        w, h = width, round(width / RATIO[0])
    elif width / height > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def centre_box(height: int, width: int, size: tuple[int, int]) -> Box:
    """The evaluation crop: the part of an image of (height, width) that, once its shorter
    side is resized to max(size) / 0.875, is the centred `size` (H, W)."""
    scale = max(size) / CENTRE_SHARE / min(height, width)  # resized pixels per source pixel
    crop_h, crop_w = size[0] / scale, size[1] / scale
    top, left = (height - crop_h) / 2, (width - crop_w) / 2
    return left, top, left + crop_w, top + crop_h


def draft_reduction(box: Box, size: tuple[int, int]) -> int:
    """The largest JPEG DCT-domain reduction (8, 4, 2; 1: none) that leaves the box at
    least `size` (H, W) pixels: decoding at 1/r scale costs about 1/r^2 of a full decode."""
    box_w, box_h = box[2] - box[0], box[3] - box[1]
    for reduction in (8, 4, 2):
        if box_w / reduction >= size[1] and box_h / reduction >= size[0]:
            return reduction
    return 1


@dataclass(frozen=True)
class RandomResizedCrop:
    """--augment imagenet: each training image cropped by `random_box` and resized to the
    model's input as it is decoded, then flipped half the time. Reads an image folder's
    `ImageFiles` (jaxcnn.data.folders) through `crops`."""

    active = True

    def draws(self, seed: int, epoch: int, index: int, size: int) -> np.ndarray:
        """[size, DRAWS_PER_EXAMPLE] uniform numbers for batch `index` of `epoch`: each
        example's attempts (area, log-ratio, top, left), then its flip (< 0.5: flipped)."""
        return np.random.default_rng([seed, epoch, index, 11]).random((size, DRAWS_PER_EXAMPLE))

    def read(self, images, rows: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """The images at `rows`, each cropped, resized and flipped by its row of `draws`."""
        if not hasattr(images, "crops"):
            raise TypeError("RandomResizedCrop reads image files (jaxcnn.data.folders.ImageFiles)")
        return images.crops(rows, draws)


def example_crop(draws_D: np.ndarray) -> tuple[np.ndarray, bool]:
    """One example's draws -> (its attempts' uniforms [ATTEMPTS, 4], whether it is flipped)."""
    return draws_D[: 4 * ATTEMPTS].reshape(ATTEMPTS, 4), bool(draws_D[4 * ATTEMPTS] < 0.5)
