"""Public test hooks: a Sink that injects storage faults, deterministically.

Reliability tests (ours, and anyone building on the Writer) wrap a real sink in
:class:`FaultInjectingSink` and pass it as the Writer's ``store``: faults go through the same
seam as real storage errors, no private attribute is patched.
"""

from __future__ import annotations

import fnmatch
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..engine.dispatch import current_worker
from ..storage.errors import TransientStorageError, WriteCancelledError
from ..storage.sinks import Sink, byte_views, check_key
from ..storage.urls import open_sink

__all__ = ["FaultInjectingSink", "SlowDownError", "StorageFaults"]


class SlowDownError(TransientStorageError):
    """An injected S3 "503 SlowDown" answer (what an object store says when throttling)."""


@dataclass(frozen=True)
class StorageFaults:
    """Seeded storage faults for :class:`FaultInjectingSink` (same seed, same faults).

    * ``service_s`` + ``nbytes / service_bytes_per_s``: a simulated storage service time added to
      every write attempt (a benchmark's stand-in for a network or disk of known speed);
    * ``slow_worker`` / ``slow_factor``: on that I/O dispatcher worker
      (:func:`napari_tileshard.engine.dispatch.current_worker`) the simulated time is ``slow_factor`` times
      as long (the simulated time passes before the bytes land);
    * ``stall_every`` / ``stall_s``: about one write attempt in ``stall_every`` stalls ``stall_s``
      seconds (periodic stalls: which ones is decided by the seed, the key and the attempt);
    * ``slowdown_rate``: that share of write attempts is answered with :class:`SlowDownError`
      (503 SlowDown) after the service time, without writing;
    * ``telemetry_loss``: that share of dispatcher rounds loses its telemetry, through
      :meth:`FaultInjectingSink.telemetry_lost` handed to the dispatcher (it is no storage fault).

    Write faults hit keys matching the glob ``keys`` (default: shards, which go through the I/O
    dispatcher; ``zarr.json`` is the Publisher's and is left alone unless ``keys="*"``).
    """

    seed: int = 0
    keys: str = "*c/*"
    service_s: float = 0.0
    service_bytes_per_s: float = 0.0
    slow_worker: int | None = None
    slow_factor: float = 1.0
    stall_every: int = 0
    stall_s: float = 0.1
    slowdown_rate: float = 0.0
    telemetry_loss: float = 0.0

    def draw(self, *names) -> float:
        """A uniform number in [0, 1) fixed by the seed and ``names``."""
        return random.Random(":".join(map(str, (self.seed, *names)))).random()


class FaultInjectingSink(Sink):
    """Delegates to ``inner`` (a Sink, path or zarr Store) and injects faults by key.

    * ``fail``: ``{pattern: exception}``: a write whose key matches the glob ``pattern`` raises
      the exception instead of writing (e.g. ``{"c/3/*": OSError(errno.ENOSPC, "No space")}``);
    * ``delay``: ``{pattern: seconds}``: such writes sleep first (a slow disk);
    * ``hold``: ``{pattern: threading.Event}``: such writes wait until the event is set (a write
      nothing can cut off: a hung local mount);
    * ``freeze``: ``{pattern: True}``: such writes hang until :meth:`cancel` is called, then raise
      :class:`~napari_tileshard.storage.errors.WriteCancelledError` (a frozen object-store endpoint, whose
      requests the sink can cancel);
    * ``before_write``: called with the key before every write (may raise);
    * ``faults``: seeded :class:`StorageFaults` (slow worker, stalls, 503 SlowDown, telemetry loss).

    Lost telemetry is the I/O dispatcher's fault, not the storage's, so it takes effect only where
    :meth:`telemetry_lost` is handed over: ``Writer(sink, ..., io_telemetry_lost=sink.telemetry_lost)``
    or ``Dispatcher(sink, ..., telemetry_lost=sink.telemetry_lost)``.

    ``writes`` lists the keys written (in completion order), ``attempts`` every key tried;
    ``injected`` counts the faults injected by kind.
    """

    def __init__(
        self,
        inner,
        overwrite: bool = False,
        *,
        fail: dict | None = None,
        delay: dict | None = None,
        hold: dict | None = None,
        freeze: dict | None = None,
        before_write: Callable[[str], None] | None = None,
        faults: StorageFaults | None = None,
        storage_options: dict | None = None,
    ):
        self.inner = open_sink(inner, overwrite, storage_options)
        self.faults = faults or StorageFaults()
        self.injected = {"slow": 0, "stall": 0, "slowdown": 0, "telemetry_loss": 0}
        self._tries: dict[str, int] = {}
        self.fail = dict(fail or {})
        self.delay = dict(delay or {})
        self.hold = dict(hold or {})
        self.freeze = dict(freeze or {})
        self.cancelled = threading.Event()  # set by cancel(): frozen writes give up
        self.before_write = before_write
        self.writes: list[str] = []
        self.attempts: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self):
        return f"FaultInjectingSink({self.inner!r})"

    @property
    def location(self) -> str:
        return self.inner.location

    @property
    def root(self):
        return getattr(self.inner, "root", None)

    @staticmethod
    def _match(patterns: dict, key: str):
        for pattern, value in patterns.items():
            if fnmatch.fnmatchcase(key, pattern):
                return value
        return None

    def write(self, key: str, buffers: Sequence) -> None:
        buffers = byte_views(check_key(key), buffers)  # refused as the real sink would, before any fault
        with self._lock:
            self.attempts.append(key)
            attempt = self._tries[key] = self._tries.get(key, -1) + 1
        if self.before_write is not None:
            self.before_write(key)
        event = self._match(self.hold, key)
        if event is not None:
            event.wait()
        if self._match(self.freeze, key) and not self.cancelled.is_set():
            self.cancelled.wait()
            raise WriteCancelledError(f"writing {key!r}: the request was cancelled (injected frozen endpoint)")
        seconds = self._match(self.delay, key)
        if seconds:
            time.sleep(seconds)
        exc = self._match(self.fail, key)
        if exc is not None:
            raise exc
        self._faulty_write(key, buffers, attempt)
        with self._lock:
            self.writes.append(key)

    def _faulty_write(self, key: str, buffers: Sequence, attempt: int) -> None:
        faults = self.faults
        if not fnmatch.fnmatchcase(key, faults.keys):
            self.inner.write(key, buffers)
            return
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        # The simulated time passes before the bytes land, as on a slow link or a stuck request:
        # a slow copy lands late (what a hedged copy races against).
        delay = faults.service_s + (nbytes / faults.service_bytes_per_s if faults.service_bytes_per_s else 0.0)
        if faults.stall_every and faults.draw("stall", key, attempt) * faults.stall_every < 1:
            delay += faults.stall_s
            self._count("stall")
        if faults.slow_worker is not None and current_worker() == faults.slow_worker and faults.slow_factor != 1:
            delay *= faults.slow_factor
            self._count("slow")
        if delay > 0:
            time.sleep(delay)
        if faults.slowdown_rate and faults.draw("slowdown", key, attempt) < faults.slowdown_rate:
            self._count("slowdown")
            raise SlowDownError(503, f"SlowDown: please reduce your request rate (injected, writing {key!r})")
        self.inner.write(key, buffers)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def telemetry_lost(self, round_index: int) -> bool:
        """Whether the dispatcher's measurements of batch ``round_index`` are lost: a seeded share
        ``faults.telemetry_loss`` of the batches (or those a wrapped FaultInjectingSink loses).
        The seam of ``Dispatcher(telemetry_lost=...)`` and ``Writer(io_telemetry_lost=...)``."""
        faults = self.faults
        lost = bool(faults.telemetry_loss) and faults.draw("telemetry", round_index) < faults.telemetry_loss
        if lost:
            self._count("telemetry_loss")
        return lost or (isinstance(self.inner, FaultInjectingSink) and self.inner.telemetry_lost(round_index))

    def release(self) -> None:
        self.inner.release()

    def discard(self) -> None:
        self.inner.discard()

    def cancel(self) -> None:
        self.cancelled.set()
        self.inner.cancel()
