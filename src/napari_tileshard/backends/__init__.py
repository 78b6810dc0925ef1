"""Backends turn batches of whole tile epochs into compressed tiles grouped by shard.

One small interface (:class:`Backend`), two implementations:

* :mod:`.cpu` - NumPy tiling + multi-threaded compression (every codec; GIL released).
* :mod:`.gpu` - CuPy scatter/aggregate kernels + nvCOMP batched zstd, pipelined on streams
  (the codecs whose ``gpu`` is not None).

The GPU module is imported only when asked for, so the package works without CUDA.
"""

from __future__ import annotations

import logging

from ..codecs import gpu_support
from .base import Backend, Ticket

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "gpu")


def gpu_unavailable_reason() -> str | None:
    """Why the GPU backend can't run here, or None when it can."""
    from . import gpu_probe

    return gpu_probe.unavailable_reason()


def select_backend(name: str, layout, codec, level: int, **options) -> Backend:
    """Instantiate backend ``name`` (``auto`` picks the GPU when it is usable and encodes ``codec``,
    and says so)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name in ("auto", "gpu"):
        refusal = gpu_support(codec)  # asked first: the same answer with or without a GPU
        if refusal and name == "gpu":
            raise ValueError(refusal)
        reason = refusal or gpu_unavailable_reason()
        if reason is None:
            from .gpu import GpuBackend

            log.info("backend=%s: using the GPU backend", name)
            return GpuBackend(layout, codec, level, **options)
        if name == "gpu":
            raise RuntimeError(f"backend='gpu' was requested but the GPU backend is not usable: {reason}")
        log.info("backend=auto: using the CPU backend (%s)", reason)
    from .cpu import CpuBackend

    return CpuBackend(layout, codec, level, **options)


__all__ = ["Backend", "Ticket", "BACKENDS", "select_backend", "gpu_unavailable_reason"]
