"""The IDX format of MNIST and Fashion-MNIST (Y. LeCun's), gzipped or not.

    0x00 0x00 <type> <ndim>   magic: type 0x08 = unsigned byte; ndim dimensions follow
    ndim x big-endian int32   the sizes
    the values                row-major, big-endian

Every way a file can be broken is a UserError naming the file: not IDX (wrong magic), a
type jaxcnn does not read, a truncated body, a damaged gzip stream.
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from pathlib import Path

import numpy as np

from jaxcnn.errors import UserError

_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def idx_bytes(path: Path) -> bytes:
    """The file's IDX content, decompressed if it is gzipped."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(f"{path} is a damaged gzip file ({err}); download it again") from None


def parse_idx(content: bytes, source: str) -> np.ndarray:
    """The array an IDX file holds."""
    if len(content) < 4 or content[:2] != b"\x00\x00" or content[2] not in _TYPES:
        raise UserError(f"{source} is not an IDX file (its first bytes are {content[:4].hex() or 'missing'}); "
                        "give the MNIST-format files (e.g. train-images-idx3-ubyte.gz)")  # fmt: skip
    ndim = content[3]
    header = 4 + 4 * ndim
    if len(content) < header:
        raise UserError(f"{source} is truncated: its header needs {header} bytes, the file has {len(content)}")
    shape = tuple(int.from_bytes(content[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_TYPES[content[2]])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(content) != expected:
        raise UserError(
            f"{source} is truncated or padded: shape {shape} needs {expected:,} bytes, the file has {len(content):,}; "
            "download it again"
        )
    return np.frombuffer(content, dtype, offset=header).reshape(shape)


def read_idx(path: Path, sha256: str | None = None) -> np.ndarray:
    """The array in an IDX file; with `sha256`, its (decompressed) content must match it."""
    content = idx_bytes(path)
    if sha256 is not None and hashlib.sha256(content).hexdigest() != sha256:
        raise UserError(
            f"{path} does not match its published checksum (sha256 of its content {hashlib.sha256(content).hexdigest()[:16]}..., "
            f"expected {sha256[:16]}...); the file is damaged or another dataset's: download it again"
        )
    return parse_idx(content, str(path))
