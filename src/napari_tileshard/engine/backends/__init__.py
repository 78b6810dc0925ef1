"""Backends turn batches of whole tile epochs into compressed tiles grouped by shard.

One small interface (:class:`Backend`), the stages it runs (``stages/``: tile, reduce,
compress, aggregate, each with a CPU and a GPU implementation), and two backends that compose
them and only schedule the work:

* ``cpu`` (:mod:`.cpu`) - tasks per (epoch, shard) on a thread pool (every codec).
* ``gpu`` (:mod:`.gpu`) - CUDA streams, a ring of device slots, nvCOMP (the codecs whose ``gpu``
  is not None).

:data:`REGISTRY` lists them in the order ``backend="auto"`` tries them.  A backend's module is
imported only when one is made, and its availability probe answers without importing CuPy
where the reason is cheap to find, so the package works without CUDA.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ...format import codecs
from ...gpu import probe as gpu_probe
from ...gpu.pinned import release_read_staging
from .base import Backend, Ticket
from .multi_gpu import MultiGpuBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendEntry:
    """A backend by name: where its class lives, and how to ask whether it runs here."""

    name: str
    #: ``module:Class``, imported by :meth:`load` only
    target: str
    #: None when the backend can run on this machine, else why not (cached by the probe)
    probe: Callable[[], str | None]
    #: None when the backend encodes the codec, else why not (no machine needed to answer)
    refuses: Callable[[codecs.Codec], str | None]
    description: str = ""

    def is_available(self) -> str | None:
        """None when the backend can run here, else the reason it can't."""
        return self.probe()

    def load(self) -> type[Backend]:
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


def _always() -> str | None:
    return None


def _any_codec(codec) -> str | None:
    return None


def _gpu_probe() -> str | None:
    return gpu_probe.unavailable_reason()


REGISTRY: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry(
            "gpu", f"{__name__}.gpu:GpuBackend", _gpu_probe, codecs.gpu_support, "CuPy kernels + nvCOMP on CUDA streams"
        ),
        BackendEntry(
            "cpu", f"{__name__}.cpu:CpuBackend", _always, _any_codec, "NumPy + the codecs' encoders on a thread pool"
        ),
    )
}
BACKENDS = ("auto", *sorted(REGISTRY))  # what select_backend accepts


def is_available(name: str, codec=None) -> str | None:
    """None when backend ``name`` can run here (and encode ``codec``, if given), else why not."""
    entry = _entry(name)
    return (entry.refuses(codecs.get(codec)) if codec is not None else None) or entry.is_available()


def available_backends(codec=None) -> dict[str, str | None]:
    """Every registered backend, in ``auto``'s order, with None or the reason it can't be used here
    (for ``codec``, if given): what a UI lists."""
    return {name: is_available(name, codec) for name in REGISTRY}


def gpu_unavailable_reason() -> str | None:
    """Why the GPU backend can't run here, or None when it can."""
    return REGISTRY["gpu"].is_available()


def select_backend(name: str, layout, codec, level: int, **options) -> Backend:
    """Instantiate backend ``name``; ``auto`` takes the first in :data:`REGISTRY` that runs here
    and encodes ``codec``, and says so.  ``options`` go to the backend's constructor, which names
    an option it does not take (``TypeError``)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    codec = codecs.get(codec)  # a name resolved once, here
    devices = options.pop("devices", None)
    if devices is not None:  # GPUs named: the GPU backend on them, or an error (never the CPU)
        if name not in ("gpu", "auto"):
            raise ValueError(f"devices={devices!r} selects GPUs: it needs backend='gpu' (got {name!r})")
        name = "gpu"
        devices = resolve_devices(devices)
        if len(devices) > 1:
            entry = REGISTRY["gpu"]
            refusal = entry.refuses(codec) or entry.is_available()
            if refusal:
                raise RuntimeError(f"devices={devices!r} was requested but the GPU backend is not usable: {refusal}")

            return MultiGpuBackend(layout, codec, level, devices=devices, **options)
        options["device"] = devices[0]
    if name != "auto":
        entry = REGISTRY[name]
        refusal = entry.refuses(codec)  # asked first: the same answer on any machine
        if refusal:
            raise ValueError(refusal)
        reason = entry.is_available()
        if reason:
            raise RuntimeError(f"backend={name!r} was requested but the {name.upper()} backend is not usable: {reason}")
        log.info("backend=%s: using the %s backend", name, name.upper())
        return _make(entry, layout, codec, level, options)
    reasons: list[str] = []
    for entry in REGISTRY.values():
        reason = entry.refuses(codec) or entry.is_available()
        if reason is None:
            if reasons:
                log.info("backend=auto: using the %s backend (%s)", entry.name.upper(), "; ".join(reasons))
            else:
                log.info("backend=auto: using the %s backend", entry.name.upper())
            return _make(entry, layout, codec, level, options)
        reasons.append(reason)
    raise RuntimeError(f"no backend is usable here: {'; '.join(reasons)}")


def _make(entry: BackendEntry, layout, codec, level, options) -> Backend:
    cls = entry.load()
    parameters = inspect.signature(cls.__init__).parameters
    unknown = [key for key in options if key not in parameters or key in ("self", "layout", "codec", "level")]
    if unknown:
        taken = [p for p in parameters if p not in ("self", "layout", "codec", "level")]
        raise TypeError(f"the {entry.name} backend takes no option {unknown[0]!r} (its options: {', '.join(taken)})")
    return cls(layout, codec, level, **options)


def resolve_devices(devices) -> list[int]:
    """``"all"`` or a list of CUDA device numbers (repeats allowed: several pipelines on one GPU)."""
    reason = gpu_unavailable_reason()
    if reason:
        raise RuntimeError(f"devices={devices!r} was requested but the GPU backend is not usable: {reason}")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if devices == "all":
        return list(range(count))
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise ValueError(f"devices must be 'all' or a list of GPU numbers, got {devices!r}")
    devices = list(devices)
    bad = [d for d in devices if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < count]
    if not devices or bad:
        raise ValueError(
            f"devices={devices!r}: GPU numbers must be integers in 0..{count - 1} (this machine has {count})"
        )
    return devices


def release_gpu_memory() -> dict[str, int]:
    """Give back the GPU buffers kept for the next recording, CuPy's cached blocks and the GPU
    readers' idle pinned staging; returns the bytes released (``host``: pinned, ``device``).
    Never loads CuPy: without a GPU recording or read in this process there is nothing to
    release."""
    gpu = sys.modules.get(f"{__name__}.gpu")
    if gpu is not None:
        return gpu.release_gpu_memory()
    return {"host": release_read_staging(), "device": 0}


def _entry(name: str) -> BackendEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend {name!r} is not one of {', '.join(REGISTRY)}") from None


__all__ = [
    "Backend",
    "Ticket",
    "BACKENDS",
    "REGISTRY",
    "BackendEntry",
    "select_backend",
    "is_available",
    "available_backends",
    "gpu_unavailable_reason",
    "release_gpu_memory",
]
