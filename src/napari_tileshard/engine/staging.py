"""The staging ring: buffers the caller's thread fills with whole tile epochs for the backend.

A buffer is *current* while it fills, goes to the backend when full (or when a slow stream or
``flush``/``close`` asks), and comes back for refilling once the backend says its ticket no
longer reads it (``Backend.staging_free``).  Only the caller's thread touches the ring.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np

from .backends.base import Backend

__all__ = ["StagingRing", "copy_frame", "copy_holding_gil", "copy_in_parts", "copy_threads"]

_PARALLEL_COPY_BYTES = 2 << 20

#: whether the caller's thread, copying into staging alone (no helpers: the CPU backend), copies
#: holding the GIL.  NumPy's copy releases it and must take it back afterwards; on the 16-core
#: host, beside 16 encode threads taking it between their boxes, about half of the copy's wall
#: time was that wait, and the caller's copy was what every CPU write waited for
#: (benchmarks/results/cpu_16core_2026-11-27g/).  Held, an encode thread finishing a box waits
#: for the rest of one frame's memcpy instead.  Measured there, off: 0.93-0.97x the speed of the
#: released copy (64 KiB / 256 KiB / 1 MiB tiles / default, 5 rounds) at 3-9 % less CPU
#: (benchmarks/results/cpu_16core_2026-12-07b/); 2 cores 0.94-1.08x, within the noise.
HOLD_GIL_COPY = False


def copy_threads() -> int:
    """Helper threads for large copies: a frame copied into pinned staging by 4 threads ran at ~7
    GB/s on a 16-core host, as slow as nvCOMP itself (benchmarks/profile_writer.py)."""
    cores = os.cpu_count() or 1
    return max(min(3, cores - 1), min(7, cores // 2))


def copy_in_parts(destination: np.ndarray, source: np.ndarray, pool: ThreadPoolExecutor | None, threads: int) -> None:
    """``destination[...] = source`` (1-D uint8 arrays of one size); from 2 MiB on split over
    ``threads`` threads of ``pool`` and the caller's (one thread's memcpy tops out near 4 GB/s).
    Returns once every part is copied, also when interrupted."""
    n = source.nbytes
    if n < _PARALLEL_COPY_BYTES or pool is None or threads < 1:
        destination[...] = source
        return
    parts = threads + 1
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [pool.submit(np.copyto, destination[a:b], source[a:b]) for a, b in zip(bounds[1:-1], bounds[2:])]
    try:
        destination[: bounds[1]] = source[: bounds[1]]
    finally:  # even when interrupted: no copy may land in the destination after we return
        wait_futures(futures)
    for future in futures:
        future.result()


def copy_holding_gil(destination: np.ndarray, source: np.ndarray) -> None:
    """``destination[...] = source`` (1-D uint8 arrays of one size, C-contiguous) by one memcpy
    that keeps the GIL: CPython's memoryview assignment, unlike NumPy's, never releases it, so
    the calling thread has no GIL to take back afterwards."""
    destination.data[:] = source.data  # ndarray.data: a memoryview of the array


_shared_pool: ThreadPoolExecutor | None = None
_shared_pool_lock = threading.Lock()


#: helpers of :func:`copy_frame`: its copy runs beside the Writer's own into staging, and 4
#: threads copied as fast as 8 on the H100 host (17.5 vs 16.7 GB/s, benchmarks/copy_paths.py),
#: while 16 copying at once got 10 GB/s together
_FRAME_COPY_HELPERS = 3


def copy_frame(data) -> np.ndarray:
    """A copy of ``data`` (an array, or anything ``np.array`` takes), large contiguous arrays
    copied by a few threads (:func:`copy_in_parts`, one pool shared by its callers): a live
    layer's frame is copied on the thread that changed it, napari's."""
    if not (isinstance(data, np.ndarray) and data.flags.c_contiguous and data.nbytes >= _PARALLEL_COPY_BYTES):
        return np.array(data, copy=True)
    helpers = min(_FRAME_COPY_HELPERS, copy_threads())
    global _shared_pool
    with _shared_pool_lock:
        if _shared_pool is None and helpers > 0:
            _shared_pool = ThreadPoolExecutor(helpers, thread_name_prefix="tileshard-frame-copy")
    frame = np.empty_like(data)
    copy_in_parts(frame.reshape(-1).view(np.uint8), data.reshape(-1).view(np.uint8), _shared_pool, helpers)
    return frame


class StagingRing:
    def __init__(self, backend: Backend, batch_bytes: int, count: int):
        self._backend = backend
        self.batch_bytes = batch_bytes
        self._free = [[backend.allocate_staging(batch_bytes), None] for _ in range(count)]  # [buffer, ticket]
        self._current: list = []  # [buffer, ticket] while filling; empty between buffers
        self.fill = 0  # bytes in the current buffer
        self.fill_started = 0.0  # when the current buffer got its first byte (time.monotonic)
        self.host_ranges: list[list[int]] = []  # byte ranges of the current buffer filled from the host
        helpers = backend.staging_copy_helpers()
        self._copy_threads = copy_threads() if helpers is None else helpers  # helpers of the caller's thread
        self._copy_pool = (
            ThreadPoolExecutor(self._copy_threads, thread_name_prefix="tileshard-copy")
            if self._copy_threads > 0
            else None
        )

    @property
    def count(self) -> int:
        return len(self._free) + bool(self._current)

    @property
    def buffer(self):
        """The current buffer (None before :meth:`acquire`)."""
        return self._current[0] if self._current else None

    @property
    def full(self) -> bool:
        return self.fill == self.batch_bytes

    def acquire(self, block: bool) -> bool:
        """Make a free buffer current; False if none is free and ``block`` is False."""
        if self._current:
            return True
        entry = self._free[0]
        if entry[1] is not None and not self._backend.staging_free(entry[1], block=block):
            return False
        self._current = self._free.pop(0)
        self.fill = 0
        self.host_ranges = []
        return True

    def copy_in(self, data, device: bool = False) -> int:
        """Copy what fits of ``data`` (a memoryview, or a 1-D uint8 CuPy array with ``device``)
        into the current buffer; returns the bytes taken."""
        buffer = self._current[0]
        n = min(data.nbytes, self.batch_bytes - self.fill)
        if device:
            self._backend.write_device(buffer, self.fill, data[:n])
        else:
            self._copy(buffer[self.fill : self.fill + n], np.frombuffer(data[:n], dtype=np.uint8))
        self.commit(n, host=not device)
        return n

    def commit(self, n: int, host: bool = True) -> None:
        """Count the next ``n`` bytes of the current buffer as filled (by :meth:`copy_in`, or in
        place by the producer through ``Writer.frame_buffer``)."""
        if host:
            self.note_host_range(self.fill, self.fill + n)
        if not self.fill:
            self.fill_started = time.monotonic()
        self.fill += n

    def note_host_range(self, start: int, stop: int) -> None:
        """Remember which bytes came from host memory (the GPU uploads only those)."""
        if self.host_ranges and self.host_ranges[-1][1] == start:
            self.host_ranges[-1][1] = stop
        else:
            self.host_ranges.append([start, stop])

    def _copy(self, destination: np.ndarray, source: np.ndarray) -> None:
        if self._copy_pool is None and HOLD_GIL_COPY:
            copy_holding_gil(destination, source)
        else:
            copy_in_parts(destination, source, self._copy_pool, self._copy_threads)

    def pad(self, epoch_bytes: int, itemsize: int) -> int:
        """Zero the unfilled part of the current buffer's last epoch (bytes of an incomplete frame
        among it are never published: Writer.close() warns of them); returns its epoch count."""
        epochs = math.ceil(self.fill / epoch_bytes)
        self._current[0][self.fill : epochs * epoch_bytes] = 0
        self.note_host_range(self.fill, epochs * epoch_bytes)
        return epochs

    def submit(self, epochs: int, rows: int | None = None):
        """Hand the current buffer's first ``epochs`` to the backend; the buffer goes back to
        the free list (refilled once the backend releases it).  Returns the backend's ticket."""
        entry, self._current = self._current, []
        entry[1] = self._backend.submit(entry[0], epochs, self.host_ranges, rows=rows)
        self.fill = 0
        self._free.append(entry)
        return entry[1]

    def submit_provisional(self, epoch_bytes: int, itemsize: int, rows: int):
        """Encode the current buffer as it is, zero-padded, keeping it current (``flush``): later
        bytes replace the padding, so the range the padding marked is forgotten again."""
        ranges = [list(r) for r in self.host_ranges]
        epochs = self.pad(epoch_bytes, itemsize)
        ticket = self._backend.submit(self._current[0], epochs, self.host_ranges, rows=rows)
        self.host_ranges = ranges
        return ticket

    def close(self) -> None:
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
        for entry in self._free:  # tickets reference the backend's buffers: let them go with the backend
            entry[1] = None
