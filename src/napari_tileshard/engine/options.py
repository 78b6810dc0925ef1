"""How a recording is written, validated once: backend and devices, memory, I/O.

:class:`EngineOptions` is the engine half of a writer's settings (the format half, what is
written, is :class:`~napari_tileshard.format.array_spec.ArraySpec`).  :func:`writer_settings` is
the one place where the Writer's keyword shorthand (``codec=``, ``backend=``, ``io_threads=``, ...)
becomes the two objects; every entry point calls it or passes the objects on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ..format.array_spec import ARRAY_KEYWORDS, ArraySpec
from ..format.layout import Layout
from .backends import BACKENDS
from .backends.base import MemoryBudget
from .dispatch import MODES as DISPATCH_MODES

__all__ = ["ENGINE_KEYWORDS", "EngineOptions", "engine_options", "normalize_devices", "writer_settings"]


def _positive_int(name: str, value, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _seconds(name: str, value, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a positive number of seconds{none}, got {value!r}")
    return float(value)


def normalize_devices(devices) -> str | tuple[int, ...] | None:
    """GPUs by one name everywhere (``devices``): None (the current one), ``"all"``, a count
    (``2``: GPUs 0 and 1) or GPU numbers (a number twice: two pipelines on that GPU); ValueError
    naming the value otherwise.  Whether they
    exist is the GPU backend's check (``engine.backends.resolve_devices``)."""
    if devices is None or devices == "all":
        return devices
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices must be 'all', a positive count or GPU numbers, got {devices!r}")
        return tuple(range(devices))
    if isinstance(devices, Sequence) and not isinstance(devices, str) and devices:
        numbers = tuple(devices)  # repeats allowed: several pipelines on one GPU
        if all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in numbers):
            return numbers
    raise ValueError(f"devices must be 'all', a positive count or GPU numbers, got {devices!r}")


@dataclass(frozen=True)
class EngineOptions:
    """How to write: ``backend`` (auto, cpu, gpu), ``devices`` (see :func:`normalize_devices`),
    CPU ``threads``; memory: ``batch_bytes`` per backend call, ``staging_buffers`` (>= 2),
    ``max_host_bytes`` / ``max_device_bytes`` (the budget; default from the machine); I/O:
    ``io_threads`` shard writers, ``io_dispatch`` (adaptive, pull, static), ``io_timeout`` (seconds a
    write may take; None: no deadline) and ``max_latency_s`` (how long received data may wait in
    a partly filled batch)."""

    backend: str = "auto"
    devices: str | tuple[int, ...] | None = None
    threads: int | None = None
    batch_bytes: int | None = None
    staging_buffers: int | None = None
    max_host_bytes: int | None = None
    max_device_bytes: int | None = None
    io_threads: int = 4
    io_dispatch: str = "adaptive"
    io_timeout: float | None = 60.0
    max_latency_s: float = 1.0
    #: the fault-injection seam of the I/O dispatcher: batch number -> whether its telemetry is lost
    #: (``testing.FaultInjectingSink.telemetry_lost``); None in real recordings
    io_telemetry_lost: Callable[[int], bool] | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        set_ = object.__setattr__
        given = self.devices
        set_(self, "devices", normalize_devices(given))
        if self.devices is not None and self.backend == "cpu":
            raise ValueError(f"devices={given!r} selects GPUs: it needs backend='gpu' (got 'cpu')")
        for name in ("threads", "batch_bytes", "staging_buffers", "max_host_bytes", "max_device_bytes"):
            set_(self, name, _positive_int(name, getattr(self, name)))
        if self.staging_buffers is not None and self.staging_buffers < 2:
            raise ValueError(f"staging_buffers must be an integer >= 2, got {self.staging_buffers!r}")
        set_(self, "io_threads", _positive_int("io_threads", self.io_threads, allow_none=False))
        if self.io_dispatch not in DISPATCH_MODES:
            raise ValueError(f"io_dispatch must be one of {', '.join(DISPATCH_MODES)}, got {self.io_dispatch!r}")
        set_(self, "io_timeout", _seconds("io_timeout", self.io_timeout, allow_none=True))
        set_(self, "max_latency_s", _seconds("max_latency_s", self.max_latency_s, allow_none=False))
        if self.io_telemetry_lost is not None and not callable(self.io_telemetry_lost):
            raise TypeError(
                f"io_telemetry_lost must be a callable (round_index -> bool) or None, got {self.io_telemetry_lost!r}"
            )

    @property
    def budget(self) -> MemoryBudget:
        """The memory bounds given (None: the backend's default)."""
        return MemoryBudget(self.max_host_bytes, self.max_device_bytes)


#: the keywords EngineOptions takes (what the Writer's shorthand accepts besides ARRAY_KEYWORDS)
ENGINE_KEYWORDS = tuple(f.name for f in fields(EngineOptions))


def writer_settings(
    spec: Layout | ArraySpec, options: EngineOptions | None = None, **keywords: Any
) -> tuple[ArraySpec, EngineOptions]:
    """``(ArraySpec, EngineOptions)`` from a Layout or spec, options and the Writer's keyword
    shorthand; TypeError for an unknown keyword or one that repeats what an object already says."""
    unknown = sorted(set(keywords) - set(ARRAY_KEYWORDS) - set(ENGINE_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown writer option{'s' * (len(unknown) > 1)} {', '.join(unknown)}")
    array = {k: v for k, v in keywords.items() if k in ARRAY_KEYWORDS}
    engine = {k: v for k, v in keywords.items() if k in ENGINE_KEYWORDS}
    if isinstance(spec, ArraySpec):
        if array:
            raise TypeError(f"{', '.join(sorted(array))} given with an ArraySpec, which says them already")
    elif isinstance(spec, Layout):
        spec = ArraySpec.of(spec, **array)
    else:
        raise TypeError(f"the Writer needs a Layout or an ArraySpec, got {type(spec).__name__}")
    return spec, engine_options(options, **engine)


def engine_options(options: EngineOptions | None = None, **keywords: Any) -> EngineOptions:
    """``options`` or, when None, EngineOptions from the keywords; TypeError for keywords that
    repeat what ``options`` says or that EngineOptions does not take."""
    unknown = sorted(set(keywords) - set(ENGINE_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown engine option{'s' * (len(unknown) > 1)} {', '.join(unknown)}")
    if options is None:
        return EngineOptions(**keywords)
    if not isinstance(options, EngineOptions):
        raise TypeError(f"options must be EngineOptions, got {type(options).__name__}")
    if keywords:
        raise TypeError(f"{', '.join(sorted(keywords))} given with EngineOptions, which say them already")
    return options
