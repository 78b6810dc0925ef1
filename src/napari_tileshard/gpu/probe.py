"""Whether CuPy, nvCOMP and a CUDA device are usable, importing CuPy only when it must.

The cheap answers come first: a CuPy that is not installed, or a ``CUDA_VISIBLE_DEVICES`` that
hides every device, are found without importing anything (importing CuPy loads the CUDA
libraries, which takes seconds and memory on a machine that may have no GPU at all).
"""

from __future__ import annotations

import functools
import importlib.util
import os

from . import nvcomp

__all__ = ["unavailable_reason"]


def _cheap_reason() -> str | None:
    try:
        if importlib.util.find_spec("cupy") is None:
            return "CuPy is not installed; install the 'gpu' extra"
    except (ImportError, ValueError) as exc:  # a broken cupy package on the path
        return f"CuPy is not importable ({exc.__class__.__name__}: {exc}); install the 'gpu' extra"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible!r})"
    return None


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the GPU backend can run here, else why not (cached for the process)."""
    reason = _cheap_reason()
    if reason:
        return reason
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"CuPy is not importable ({exc.__class__.__name__}: {exc}); install the 'gpu' extra"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({exc})"
    if count < 1:
        return "no CUDA device found"
    try:
        nvcomp.load()
    except Exception as exc:
        return f"nvCOMP is not usable ({exc}); install nvidia-nvcomp-cu12 or -cu13"
    return None
