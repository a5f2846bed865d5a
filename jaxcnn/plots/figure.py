"""What every figure shares: matplotlib without a display (Agg), and an atomic save."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from jaxcnn.results import FILE_MODE


def save(fig, path: Path) -> Path:
    """Write atomically: a failed plot never leaves half a PNG where a good one was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png.tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
