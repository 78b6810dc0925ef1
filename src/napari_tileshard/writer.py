"""The Writer: drives staging -> backend -> shard accumulation -> store.

Threads and buffers (see ``docs/design.md``):

* the caller's thread copies incoming bytes into one of ``staging_buffers`` staging buffers of
  ``batch_epochs`` whole tile epochs and submits a full buffer to the backend;
* a collector thread takes backend results in order, feeds the :class:`ShardAccumulator` and
  hands completed shards to a small I/O pool;
* the collector lets at most two batches' worth of shard epochs wait on storage; when an
  epoch's shards are on disk it rewrites ``zarr.json`` so that ``shape[0]`` covers it (unbounded arrays).

Backpressure: ``write`` returns the unconsumed tail when no staging buffer is free, ``append``
waits.  Errors on any thread stop the Writer; the next call raises :class:`WriterError`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from .backends import select_backend
from .backends.base import CODECS
from .layout import Layout
from .ome import group_metadata
from .pyramid import Pyramid, level_fraction, plan_pyramid
from .shard import ShardAccumulator
from .store import METADATA_KEY, array_metadata, metadata_bytes, open_sink

log = logging.getLogger(__name__)

_POLL_S = 0.05
_PENDING_BATCHES = 2  # compressed batches that may wait on storage before the collector waits
_PARALLEL_COPY_BYTES = 2 << 20


def _is_device_array(array) -> bool:
    return hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray)


class WriterError(RuntimeError):
    """The Writer stopped because storage or a backend failed; what was complete is on disk."""


@dataclass
class WriterStats:
    backend: str
    frames: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    shards_written: int = 0
    elapsed_s: float = 0.0
    rows_complete: int = 0  # rows along dim 0 whose shards are all on disk

    @property
    def compression_ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else float("nan")

    @property
    def throughput_gbps(self) -> float:
        return self.bytes_in / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "compression_ratio": self.compression_ratio,
                "throughput_gbps": self.throughput_gbps}


def _validate_level(codec: str, level) -> int:
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is not one of {', '.join(CODECS)}")
    if not isinstance(level, (int, np.integer)) or isinstance(level, bool):
        raise TypeError(f"level must be an integer, got {level!r}")
    if codec == "zstd" and not -7 <= level <= 22:
        raise ValueError(f"zstd level must be in -7..22, got {level}")
    return int(level)


def estimate_memory(layout: Layout, batch_bytes: int | None = None, pyramid: Pyramid | None = None) -> dict[str, int]:
    """Host bytes with the CPU backend and host/device bytes with the GPU backend, by default batching.

    Pure arithmetic (no device is touched): what the widget shows before recording starts.
    """
    from .backends.cpu import CpuBackend
    from .backends.gpu import GpuBackend

    pyramid = pyramid or Pyramid.single(layout)
    cpu_batch = max(1, (batch_bytes or CpuBackend.preferred_batch_bytes) // layout.epoch_bytes) * layout.epoch_bytes
    gpu = GpuBackend.estimate(layout, batch_bytes or GpuBackend.default_batch_bytes_for(layout),
                              layouts=pyramid.layouts)
    compressed_epoch = sum(lay.tiles_per_epoch * lay.compressed_tile_bound() for lay in pyramid.layouts)
    in_flight = (1 + 2 * max(1, cpu_batch // layout.epoch_bytes)) * compressed_epoch
    cpu_levels = int(cpu_batch * (level_fraction(pyramid) - 1) * (8 if pyramid.method == "mean" else 2) / 4)
    return {"cpu_host": 2 * cpu_batch + in_flight + cpu_levels, "gpu_host": gpu["host"] + in_flight,
            "gpu_device": gpu["device"]}


class Writer:
    """Stream frames into a sharded Zarr v3 array.

    ``store`` is a path or a zarr v3 ``Store``.  ``batch_bytes`` sets how much input one backend
    call gets (rounded to whole tile epochs, at least one; default: the backend's preference,
    64-256 MiB on the CPU, 0.5-1 GiB on the GPU); ``staging_buffers`` how many such batches may be
    buffered (>= 2 so the caller fills one while the backend encodes another; default: the
    backend's preference, 2 on the CPU, 3 on the GPU).  ``max_latency_s`` bounds how long
    received data waits in a partly filled batch: at the first tile-epoch boundary after that
    time the complete epochs are submitted anyway, so a slow stream still reaches the disk (and
    survives a crash) within about that time.

    ``ome=True`` writes an OME-Zarr 0.5 group instead of a bare array: level 0 at ``0/`` and a
    pyramid of ``downsample`` levels (``"mean"``, ``"max"``, ``"min"``, ``"decimate"``) over
    ``downsample_dims`` (default the last two dims) at ``1/``, ``2/``, ... computed by the backend
    from each batch while recording (:mod:`napari_tileshard.pyramid`), up to ``max_levels``.
    ``attributes`` (JSON-serialisable) go into the array's attributes, or the group's next to ``ome``.
    """

    def __init__(self, store, layout: Layout, *, codec: str = "zstd", level: int = 1,
                 backend: str = "auto", overwrite: bool = False, batch_bytes: int | None = None,
                 staging_buffers: int | None = None, io_threads: int = 4, threads: int | None = None,
                 attributes: dict | None = None, max_latency_s: float = 1.0, ome: bool = False,
                 downsample: str = "mean", downsample_dims=None, max_levels: int | None = None):
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a Layout, got {type(layout).__name__}")
        if not isinstance(max_latency_s, (int, float)) or not max_latency_s > 0:
            raise ValueError(f"max_latency_s must be a positive number of seconds, got {max_latency_s!r}")
        self.max_latency_s = float(max_latency_s)
        self.layout = layout
        self.codec = codec
        self.level = _validate_level(codec, level)
        if staging_buffers is not None and (not isinstance(staging_buffers, int) or staging_buffers < 2):
            raise ValueError(f"staging_buffers must be an integer >= 2, got {staging_buffers!r}")
        self.ome = bool(ome)
        self.pyramid = (plan_pyramid(layout, downsample, downsample_dims, max_levels) if ome
                        else Pyramid.single(layout))
        self._group = group_metadata(self.pyramid, "", attributes) if ome else None  # validates attributes
        options = {"threads": threads} if threads else {}
        if ome:
            options["pyramid"] = self.pyramid
        self._backend = select_backend(backend, layout, codec, self.level, **options)
        try:
            self._setup(store, overwrite, batch_bytes, staging_buffers, io_threads, attributes)
        except BaseException:
            self._backend.close()
            raise

    def _setup(self, store, overwrite, batch_bytes, staging_buffers, io_threads, attributes):
        layout = self.layout
        target = batch_bytes or self._backend.preferred_batch_bytes
        if not isinstance(target, (int, np.integer)) or target < 1:
            raise ValueError(f"batch_bytes must be a positive integer, got {batch_bytes!r}")
        epochs = max(1, int(target) // layout.epoch_bytes)
        if layout.epoch_count is not None:
            epochs = min(epochs, layout.epoch_count)
        self.batch_epochs = epochs
        self.batch_bytes = epochs * layout.epoch_bytes
        self._capacity = None if layout.unbounded else layout.total_elements * layout.itemsize
        self._attributes = dict(attributes or {})
        # Buffers (and the GPU's memory check) before the store is touched: a refusal leaves no trace.
        staging_buffers = staging_buffers or self._backend.preferred_staging_buffers
        self._free = [[self._backend.allocate_staging(self.batch_bytes), None] for _ in range(staging_buffers)]
        self._sink = open_sink(store, overwrite)
        self.stats = WriterStats(backend=self._backend.describe())
        self._prefixes = [f"{k}/" for k in range(self.pyramid.levels)] if self.ome else [""]
        self._metadata_rows = 0 if layout.unbounded else layout.shape[0]
        self._write_metadata(self._metadata_rows)
        if self.ome:  # after the level arrays exist, so the group never names a missing dataset
            name = getattr(self._sink, "root", None)
            self._group["attributes"]["ome"]["multiscales"][0]["name"] = name.stem if name else "image"
            self._sink.write(METADATA_KEY, [metadata_bytes(self._group)])
        self._current = None  # [buffer, ticket] being filled
        self._fill = 0
        self._fill_started = 0.0
        self._host_ranges: list[list[int]] = []
        self._epochs_submitted = 0
        self._accumulators = [ShardAccumulator(lay) for lay in self.pyramid.layouts]
        self._submitted: queue.Queue = queue.Queue(maxsize=staging_buffers)
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="tileshard-io")
        self._copy_threads = min(3, (os.cpu_count() or 1) - 1)
        self._copy_pool = (ThreadPoolExecutor(self._copy_threads, thread_name_prefix="tileshard-copy")
                           if self._copy_threads > 0 else None)
        shard_epochs_per_batch = -(-self.batch_epochs // layout.tiles_per_shard[0])
        self._max_pending_shard_epochs = max(2, _PENDING_BATCHES * shard_epochs_per_batch)
        self._pending_io: list[tuple[list, int]] = []  # (futures, rows complete once they finish)
        self._stats_lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        self._start = time.perf_counter()
        self._collector = threading.Thread(target=self._collect, name="tileshard-collector", daemon=True)
        self._collector.start()

    # -- public API ---------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def location(self) -> str:
        return self._sink.location

    @property
    def closed(self) -> bool:
        return self._closed

    def memory_estimate(self) -> dict[str, int]:
        """Upper bound of the bytes the Writer holds: staging, compressed shards in flight, device."""
        layout = self.layout
        estimate = self._backend.memory_estimate(self.batch_bytes, len(self._free) + (self._current is not None))
        # The open shard epoch plus those waiting on storage, at the worst-case compressed size.
        shard_epoch_bound = layout.tiles_per_shard[0] * sum(
            lay.tiles_per_epoch * lay.compressed_tile_bound() for lay in self.pyramid.layouts)
        estimate["host"] += (1 + self._max_pending_shard_epochs) * shard_epoch_bound
        return estimate

    def append(self, array) -> None:
        """Append frames (an array whose trailing shape is the frame shape) to the stream.

        NumPy arrays, or CuPy arrays: with the GPU backend those go device-to-device into the
        batch's input buffer without visiting the host.
        """
        self._check_open()
        if _is_device_array(array):
            if self._backend.accepts_device_arrays:
                self._check_frames(array)
                data = array.reshape(-1).view("uint8")
                self._check_capacity(data.nbytes)
                while data.nbytes:
                    data = self._write(data, block=True, device=True)
                return
            array = array.get()  # the CPU backend works on host memory
        data = self._as_bytes(array)
        self._check_capacity(data.nbytes)
        while data.nbytes:
            data = self._write(data, block=True)

    def write(self, buffer) -> memoryview:
        """Copy what fits of ``buffer`` (bytes of the row-major stream); return the unconsumed tail."""
        self._check_open()
        try:
            data = memoryview(buffer)
        except TypeError as exc:
            raise TypeError(f"write() needs a bytes-like object, got {type(buffer).__name__}") from exc
        if not data.c_contiguous:
            raise ValueError("write() needs a C-contiguous buffer")
        data = data.cast("B") if data.ndim != 1 or data.format != "B" else data
        self._check_capacity(data.nbytes)
        return self._write(data, block=False)

    def flush(self) -> None:
        """Write everything received so far, including partial shards; the stream continues."""
        self._check_open()
        self._drain()
        provisional = [[] for _ in self._accumulators]
        if self._fill:
            buffer = self._current[0]
            ranges = [list(r) for r in self._host_ranges]
            epochs = self._pad_current()
            ticket = self._backend.submit(buffer, epochs, self._host_ranges, rows=self._rows_in_current())
            provisional = self._backend.result(ticket)
            self._host_ranges = ranges  # the padding is provisional: later (device) bytes replace it
        shards = [(k, shard) for k, accumulator in enumerate(self._accumulators)
                  for shard in accumulator.pending(provisional[k])]
        self._store_shards(shards, wait=True)
        if self.layout.unbounded:
            self._write_metadata(self._rows_received())
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, finalize ``zarr.json`` and release buffers, threads and the device."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._error is None and self._fill:
                rows = self._rows_in_current()
                self._submit_current(self._pad_current(), rows)
            self._put_submitted(None)
            self._collector.join()
            if self._error is None:
                self._store_shards([(k, shard) for k, accumulator in enumerate(self._accumulators)
                                    for shard in accumulator.take_pending()], wait=True)
                if self.layout.unbounded:
                    self._write_metadata(self._rows_received())
                self.stats.rows_complete = self._rows_received()
        except BaseException as exc:  # noqa: BLE001 - recorded and re-raised below
            self._fail(exc)
        finally:
            self._finish_io()
            self._io.shutdown(wait=True)
            if self._copy_pool is not None:
                self._copy_pool.shutdown(wait=True)
            self._backend.close()
            self.stats.elapsed_s = time.perf_counter() - self._start
        self._raise_if_failed()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return f"<Writer {self._sink.location} {self.layout!r} backend={self.backend} {state}>"

    # -- input -------------------------------------------------------------------------
    def _as_bytes(self, array) -> memoryview:
        if isinstance(array, np.generic):  # a single element (rank-1 layouts), e.g. from iterating
            array = np.asarray(array)
        if not isinstance(array, np.ndarray):
            raise TypeError(f"append() needs a NumPy or CuPy array, got {type(array).__name__}")
        self._check_frames(array)
        return memoryview(array.reshape(-1).view(np.uint8))

    def _check_frames(self, array) -> None:
        """dtype, trailing frame shape and contiguity, for NumPy and CuPy arrays alike."""
        layout = self.layout
        if array.dtype != layout.dtype:
            raise TypeError(f"append() got dtype {array.dtype.str} ({array.dtype.name}), the layout holds "
                            f"{layout.dtype.name}")
        frame = layout.frame_shape
        if array.ndim < len(frame) or tuple(array.shape[array.ndim - len(frame):]) != frame:
            raise ValueError(f"append() got shape {array.shape}: its trailing dimensions must equal the "
                             f"frame shape {frame}")
        if not array.flags.c_contiguous:
            raise ValueError(f"append() got a non-contiguous array of shape {array.shape}; pass a contiguous "
                             "copy (np.ascontiguousarray)")

    def _check_capacity(self, nbytes: int) -> None:
        if self._capacity is not None and self.stats.bytes_in + nbytes > self._capacity:
            left = self._capacity - self.stats.bytes_in
            raise ValueError(f"{nbytes} more bytes exceed the declared array shape {self.layout.shape}: "
                             f"only {left} bytes ({left // self.layout.itemsize} elements) are left")

    def _write(self, data, block: bool, device: bool = False):
        """Copy ``data`` (bytes: a memoryview, or a 1-D uint8 CuPy array with ``device``) into staging."""
        while data.nbytes:
            if self._fill == self.batch_bytes and not self._submit_full(block):
                break
            if self._current is None and not self._acquire(block):
                break
            buffer = self._current[0]
            n = min(data.nbytes, self.batch_bytes - self._fill)
            if device:
                self._backend.write_device(buffer, self._fill, data[:n])
            else:
                self._copy(buffer[self._fill : self._fill + n], np.frombuffer(data[:n], dtype=np.uint8))
                self._note_host_range(self._fill, self._fill + n)
            if not self._fill:
                self._fill_started = time.monotonic()
            self._fill += n
            self.stats.bytes_in += n
            data = data[n:]
            if (self._fill % self.layout.epoch_bytes == 0 and self._fill < self.batch_bytes
                    and time.monotonic() - self._fill_started > self.max_latency_s):
                self._submit_current(self._fill // self.layout.epoch_bytes)  # slow stream: don't wait
        if self._fill == self.batch_bytes:
            self._submit_full(block)
        self.stats.frames = self.stats.bytes_in // (self.layout.frame_elements * self.layout.itemsize)
        return data

    def _note_host_range(self, start: int, stop: int) -> None:
        """Remember which staging bytes came from host memory (the GPU uploads only those)."""
        if self._host_ranges and self._host_ranges[-1][1] == start:
            self._host_ranges[-1][1] = stop
        else:
            self._host_ranges.append([start, stop])

    def _copy(self, destination: np.ndarray, source: np.ndarray) -> None:
        """Copy into staging; large pieces in parallel (one thread's memcpy tops out near 4 GB/s)."""
        n = source.nbytes
        if n < _PARALLEL_COPY_BYTES or self._copy_pool is None:
            destination[...] = source
            return
        parts = self._copy_threads + 1
        bounds = [n * i // parts for i in range(parts + 1)]
        futures = [self._copy_pool.submit(np.copyto, destination[a:b], source[a:b])
                   for a, b in zip(bounds[1:-1], bounds[2:])]
        destination[: bounds[1]] = source[: bounds[1]]
        for future in futures:
            future.result()

    def _submit_full(self, block: bool) -> bool:
        """Submit the full current buffer; without ``block``, only if the pipeline has room."""
        if not block and self._submitted.full():
            return False
        self._submit_current(self.batch_epochs)
        return True

    def _acquire(self, block: bool) -> bool:
        """Make a free staging buffer current; False if none is free and ``block`` is False."""
        while True:
            self._raise_if_failed()
            entry = self._free[0]
            if entry[1] is None or self._backend.staging_free(entry[1], block=False):
                break
            if not block:
                return False
            self._backend.staging_free(entry[1], block=True)
        self._current = self._free.pop(0)
        self._fill = 0
        self._host_ranges = []
        return True

    def _pad_current(self) -> int:
        """Zero the unfilled part of the current buffer's last epoch; returns its epoch count."""
        layout = self.layout
        if self._fill % layout.itemsize:
            warnings.warn(f"the stream ends inside an element ({self._fill % layout.itemsize} stray bytes); "
                          "they are padded with zeros", stacklevel=3)
        epochs = math.ceil(self._fill / layout.epoch_bytes)
        self._current[0][self._fill : epochs * layout.epoch_bytes] = 0
        self._note_host_range(self._fill, epochs * layout.epoch_bytes)
        return epochs

    def _rows_in_current(self) -> int:
        """Rows along dim 0 that the current (partly filled) buffer holds data for."""
        return math.ceil(self._fill / (self.layout.row_elements * self.layout.itemsize))

    def _submit_current(self, epochs: int, rows: int | None = None) -> None:
        entry, self._current, self._fill = self._current, None, 0
        entry[1] = self._backend.submit(entry[0], epochs, self._host_ranges, rows=rows)
        self._put_submitted((entry[1], self._epochs_submitted))
        self._epochs_submitted += epochs
        self._free.append(entry)

    def _put_submitted(self, item) -> None:
        while True:
            self._raise_if_failed(closing_ok=item is None)
            try:
                self._submitted.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _rows_received(self) -> int:
        return math.ceil(self.stats.bytes_in / (self.layout.row_elements * self.layout.itemsize))

    # -- collector thread ----------------------------------------------------------------
    def _collect(self) -> None:
        while True:
            try:
                item = self._submitted.get(timeout=_POLL_S)
            except queue.Empty:
                self._reap_io()  # publish epochs whose shards finished writing while idle
                continue
            try:
                if item is None:
                    return
                if self._error is not None:
                    continue  # drain without work so producers never block on a dead pipeline
                ticket, first_epoch = item
                levels = self._backend.result(ticket)
                for offset in range(len(levels[0])):
                    # Level k's tile epoch e lies in level 0's: their shard epochs complete together.
                    shards = [(k, shard) for k, accumulator in enumerate(self._accumulators)
                              for shard in accumulator.add(first_epoch + offset, levels[k][offset])]
                    if shards:
                        self._store_shards(shards, wait=False)
                self._reap_io()
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc)
            finally:
                self._submitted.task_done()

    def _drain(self) -> None:
        """Wait until the collector has processed everything submitted and storage caught up."""
        while self._submitted.unfinished_tasks:
            self._raise_if_failed()
            time.sleep(0.002)
        self._finish_io()
        self._raise_if_failed()

    # -- storage -------------------------------------------------------------------------
    def _store_shards(self, shards, wait: bool) -> None:
        if not shards:
            return
        futures = [self._io.submit(self._write_shard, k, shard) for k, shard in shards]
        shard_epoch = shards[0][1].coords[0]
        rows = min((shard_epoch + 1) * self.layout.shard_epoch_rows, self._rows_received())
        self._pending_io.append((futures, rows))
        limit = 0 if wait else self._max_pending_shard_epochs
        while len(self._pending_io) > limit:
            self._complete_oldest_io()

    def _write_shard(self, level: int, shard) -> None:
        key = self._prefixes[level] + self.pyramid.layouts[level].shard_key(shard.coords)
        self._sink.write(key, shard.buffers + [shard.index])
        with self._stats_lock:
            self.stats.bytes_out += shard.nbytes
            self.stats.shards_written += 1

    def _complete_oldest_io(self) -> None:
        futures, rows = self._pending_io.pop(0)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            self._fail(errors[0])
            self._raise_if_failed()
        self.stats.rows_complete = max(self.stats.rows_complete, rows)
        if self.layout.unbounded and rows > self._metadata_rows:
            self._write_metadata(rows)

    def _reap_io(self) -> None:
        """Publish (zarr.json shape) every leading shard epoch whose writes are all done."""
        try:
            while self._pending_io and all(f.done() for f in self._pending_io[0][0]):
                self._complete_oldest_io()
        except WriterError:
            pass  # recorded by _fail

    def _finish_io(self) -> None:
        while self._pending_io:
            try:
                self._complete_oldest_io()
            except WriterError:
                pass  # recorded by _fail; the remaining writes are still waited for

    def _write_metadata(self, rows: int) -> None:
        """Publish ``rows`` of level 0 (and the matching rows of every level) in the arrays' zarr.json."""
        attributes = {} if self.ome else self._attributes
        try:
            for k, (layout, prefix) in enumerate(zip(self.pyramid.layouts, self._prefixes)):
                metadata = array_metadata(layout, self.codec, self.level, self.pyramid.level_rows(k, rows),
                                          attributes)
                self._sink.write(prefix + METADATA_KEY, [metadata_bytes(metadata)])
        except OSError as exc:  # the store keeps its previous zarr.json (atomic replace): stop here
            self._fail(exc)
            self._raise_if_failed()
        self._metadata_rows = rows

    # -- errors --------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            log.error("writer for %s failed: %s", self._sink.location, exc)
            self._error = exc

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the Writer for {self._sink.location} is closed")
        self._raise_if_failed()

    def _raise_if_failed(self, closing_ok: bool = False) -> None:
        if self._error is not None and not closing_ok:
            exc = self._error
            raise WriterError(f"writing {self._sink.location} failed: {type(exc).__name__}: {exc}") from exc
