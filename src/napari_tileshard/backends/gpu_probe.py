"""Checks whether CuPy, nvCOMP and a CUDA device are usable, without importing them eagerly."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
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
        from . import _nvcomp

        _nvcomp.load()
    except Exception as exc:
        return f"nvCOMP is not usable ({exc}); install nvidia-nvcomp-cu12 or -cu13"
    return None
