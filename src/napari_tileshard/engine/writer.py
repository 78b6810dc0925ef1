"""The Writer: drives staging -> backend -> shard accumulation -> store, and nothing else.

Threads and buffers (see ``docs/design.md``):

* the caller's thread copies incoming bytes into the :class:`~napari_tileshard.engine.staging.StagingRing`
  (``staging_buffers`` buffers of ``batch_epochs`` whole tile epochs) and submits a full buffer
  to the backend;
* the :class:`~napari_tileshard.engine.collector.Collector` thread takes backend results in order,
  assembles shards and writes them on a small I/O pool;
* the :class:`~napari_tileshard.engine.publish.Publisher` rewrites ``zarr.json`` as shard writes
  complete: it alone decides what a reader may see (a contiguous prefix of fully written
  shard epochs, never past a failed write, never a partial row).

Backpressure: ``write`` returns the unconsumed tail when no staging buffer is free, ``append``
waits; the collector waits while too many shard epochs wait on storage.  Errors on any thread
stop the Writer; the next call raises :class:`WriterError`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..format import codecs
from ..format.array_spec import ArraySpec
from ..format.layout import Layout
from ..format.metadata import METADATA_KEY, metadata_bytes
from ..format.ome import group_metadata
from ..format.pyramid import Pyramid, level_fraction
from ..gpu.pinned import physical_memory
from ..storage.sinks import Sink
from ..storage.urls import open_sink
from .backends import select_backend
from .backends.base import Backend, MemoryBudget
from .backends.cpu import CpuBackend
from .backends.gpu import GpuBackend
from .collector import Collector, in_flight_bytes
from .options import EngineOptions, writer_settings
from .publish import Publisher
from .shards import EncodedEpoch
from .staging import StagingRing

__all__ = [
    "CloseAbandoned",
    "IncompleteFrameWarning",
    "Writer",
    "WriterError",
    "WriterStats",
    "compression_ratio",
    "estimate_memory",
    "largest_fitting",
    "plan_batches",
]

log = logging.getLogger(__name__)


def _is_device_array(array) -> bool:
    return hasattr(array, "__cuda_array_interface__") and not isinstance(array, np.ndarray)


#: seconds close() tries to mark a failed recording's zarr.json (storage is failing already)
_MARK_FAILED_TIMEOUT_S = 10.0


class WriterError(RuntimeError):
    """The Writer stopped because storage or a backend failed; what was complete is on disk."""


class CloseAbandoned(WriterError):
    """close() was abandoned (a second Ctrl-C): the store claims only rows that are on disk."""


def compression_ratio(bytes_in: int, bytes_out: int, pyramid_bytes_out: int = 0) -> float:
    """Input bytes over the full-resolution array's stored bytes (``bytes_out`` less an OME
    pyramid's levels, which are stored on top): the codec's ratio on the data, the same with and
    without a pyramid; NaN when nothing was stored."""
    stored = bytes_out - pyramid_bytes_out
    return bytes_in / stored if stored > 0 else float("nan")


class IncompleteFrameWarning(UserWarning):
    """close() found bytes of a frame that write() never completed: they are not recorded."""


@dataclass
class WriterStats:
    backend: str
    frames: int = 0
    bytes_in: int = 0
    bytes_out: int = 0  # every shard written, pyramid levels included: what the store holds
    pyramid_bytes_out: int = 0  # of those, the shards of pyramid levels 1, 2, ... (OME-Zarr)
    shards_written: int = 0
    elapsed_s: float = 0.0
    rows_complete: int = 0  # rows along dim 0 whose shards are all on disk
    #: seconds the caller's thread spent copying input into staging (the rest of its time in
    #: append/write is spent waiting for a free staging buffer or room in the pipeline)
    copy_s: float = 0.0
    # The I/O dispatcher (engine/dispatch/), refreshed by sync/flush/close:
    io_dispatch: str = ""
    io_workers: list = field(default_factory=list)  # per worker: shards, bytes, busy_s, errors, p50/p95
    moves: int = 0  # queued shards the planner moved off a predicted straggler
    steals: int = 0  # queued shards an idle worker took over
    hedges: int = 0  # duplicate writes of shards past the hedging deadline
    duplicate_bytes: int = 0
    retries: int = 0  # transient storage errors (503 SlowDown) retried
    fallback_rounds: int = 0  # batches placed statically (model cold or telemetry lost)
    replaced_workers: int = 0  # workers retired for being far slower than the others, and replaced
    dropped_writes: int = 0  # queued shard writes dropped after a storage failure (never publishable)
    io_timeouts: int = 0  # shard writes that got no answer within io_timeout

    @property
    def full_resolution_bytes_out(self) -> int:
        """Bytes of the full-resolution array's shards (level 0): ``bytes_out`` less the pyramid's."""
        return self.bytes_out - self.pyramid_bytes_out

    @property
    def compression_ratio(self) -> float:
        """Input bytes over the full-resolution array's stored bytes: the codec's ratio on the data.
        An OME pyramid's levels (about a third more pixels) are stored on top, in
        ``pyramid_bytes_out``, and left out here: the ratio means the same with and without it."""
        return compression_ratio(self.bytes_in, self.bytes_out, self.pyramid_bytes_out)

    @property
    def throughput_gbps(self) -> float:
        return self.bytes_in / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


def estimate_memory(
    layout: Layout,
    batch_bytes: int | None = None,
    pyramid: Pyramid | None = None,
    codec: str = "zstd",
    max_host_bytes: int | None = None,
    max_device_bytes: int | None = None,
) -> dict[str, int]:
    """Host bytes with the CPU backend and pinned host/device bytes with the GPU backend, by
    default batching (on the GPU: the batch its default memory budget gives), and that batch.

    Pure arithmetic (no device is touched; the GPU's default budget is taken at the cap of a GPU
    with 16-24 GiB free: a larger GPU on a large host gets more, :meth:`GpuBackend.budget_for`):
    what the widget shows before recording starts.  The same
    terms as :meth:`Writer.memory_estimate` of an open Writer.
    """
    pyramid = pyramid or Pyramid.single(layout)
    cpu_epochs = max(1, (batch_bytes or CpuBackend.batch_bytes_for(layout)) // layout.epoch_bytes)
    cpu_levels = int(
        cpu_epochs * layout.epoch_bytes * (level_fraction(pyramid) - 1) * (8 if pyramid.method == "mean" else 2) / 4
    )
    default = GpuBackend.budget_for(None, physical_memory())
    budget = MemoryBudget(max_host_bytes or default.host, max_device_bytes or default.device)

    def gpu(epochs: int) -> dict[str, int]:
        return GpuBackend.estimate(
            layout,
            epochs * layout.epoch_bytes,
            GpuBackend.preferred_staging_buffers,
            GpuBackend.default_slots,
            layouts=pyramid.layouts,
            nvcomp=(codecs.get(codec).gpu or codecs.GpuSupport(None)).nvcomp,
        )

    preferred = max(1, (batch_bytes or GpuBackend.default_batch_bytes_for(layout)) // layout.epoch_bytes)
    gpu_epochs = preferred if batch_bytes else largest_fitting(preferred, lambda e: budget.admits(gpu(e)))
    estimate = gpu(gpu_epochs or 1)
    return {
        "cpu_host": CpuBackend.preferred_staging_buffers * cpu_epochs * layout.epoch_bytes
        + cpu_levels
        + in_flight_bytes(pyramid, codec, cpu_epochs),
        "gpu_host": estimate["host"],
        "gpu_device": estimate["device"],
        "gpu_batch_bytes": (gpu_epochs or 1) * layout.epoch_bytes,
    }


def largest_fitting(preferred: int, fits: Callable[[int], bool]) -> int:
    """The largest batch of at most ``preferred`` tile epochs that ``fits`` (memory grows with
    the batch), or 0 if not even one epoch does."""
    if fits(preferred):
        return preferred
    if not fits(1):
        return 0
    low, high = 1, preferred  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _estimate(
    backend: Backend, pyramid: Pyramid, codec: codecs.Codec | str, epochs: int, staging_buffers: int
) -> dict[str, int]:
    estimate = backend.memory_estimate(epochs * pyramid.layouts[0].epoch_bytes, staging_buffers)
    if not backend.estimate_holds_shards:
        estimate["host"] += in_flight_bytes(pyramid, codec, epochs)
    return estimate


def plan_batches(
    backend: Backend,
    pyramid: Pyramid,
    codec: codecs.Codec | str,
    batch_bytes: int | None,
    staging_buffers: int | None,
    budget: MemoryBudget,
) -> tuple[int, int, MemoryBudget]:
    """(tile epochs per batch, staging buffers, the budget they fit: the given bounds, unset ones
    from the backend's default) for a recording.

    An explicit ``batch_bytes`` is taken as it is (checked against the bounds of ``budget`` that
    were given); otherwise the backend's preferred batch shrinks until the estimate fits the
    budget, whose unset bounds come from :meth:`Backend.default_budget`.  A budget that cannot
    hold one tile epoch is a ValueError naming the minimum.
    """
    layout = pyramid.layouts[0]
    staging = staging_buffers or backend.preferred_staging_buffers
    cap = layout.epoch_count or math.inf
    explicit = budget
    if not batch_bytes:
        default = backend.default_budget(physical_memory())
        budget = MemoryBudget(budget.host or default.host, budget.device or default.device)
    preferred = int(min(cap, max(1, (batch_bytes or backend.preferred_batch_bytes) // layout.epoch_bytes)))

    def estimate(epochs: int) -> dict[str, int]:
        return _estimate(backend, pyramid, codec, epochs, staging)

    if batch_bytes:
        epochs = preferred if budget.admits(estimate(preferred)) else 0
    else:
        epochs = largest_fitting(preferred, lambda e: budget.admits(estimate(e)))
    if not epochs and not batch_bytes and explicit.admits(estimate(1)):
        # Only the default budget is too small (large tile epochs): a default never refuses a layout
        # the machine can record; the backend's own check (free device memory) still applies.
        log.warning(
            "one tile epoch of this layout needs more memory than the default budget %s; recording with "
            "batches of one tile epoch (%s); pass max_device_bytes/max_host_bytes to bound it",
            budget,
            estimate(1),
        )
        epochs = 1
    if epochs:
        return epochs, staging, budget
    need = estimate(preferred if batch_bytes else 1)
    kind = next(k for k, bound in vars(budget).items() if bound is not None and need[k] > bound)
    bound = getattr(budget, kind)
    given = getattr(explicit, kind) is not None
    memory = "pinned host" if kind == "host" and backend.estimate_holds_shards else kind
    raise ValueError(
        f"{f'max_{kind}_bytes={bound}' if given else f'the default {kind} memory budget of {bound} bytes'} "
        f"({bound / 2**30:.2f} GiB) is below the {need[kind]} bytes ({need[kind] / 2**30:.2f} GiB) of {memory} "
        f"memory the {backend.name} backend needs for "
        f"{f'batch_bytes={batch_bytes}' if batch_bytes else 'one tile epoch'} of this layout "
        f"({layout.epoch_bytes} bytes per tile epoch); {'raise' if given else 'pass a larger'} max_{kind}_bytes"
        f"{'' if batch_bytes else ' or use smaller tiles'}"
    )


class Writer:
    """Stream frames into a sharded Zarr v3 array.

    ``store`` is a path, a zarr v3 ``Store`` or a :class:`~napari_tileshard.storage.sinks.Sink`.
    ``batch_bytes`` sets how much input one backend call gets (rounded to whole tile epochs, at
    least one; default: the backend's preference, 64-256 MiB on the CPU, 0.5-1 GiB on the GPU);
    ``staging_buffers`` how many such batches may be buffered (>= 2 so the caller fills one while
    the backend encodes another; default: the backend's preference, 2 on the CPU, 3 on the GPU).
    ``max_latency_s`` bounds how long received data waits in a partly filled batch: at the first
    tile-epoch boundary after that time the complete epochs are submitted anyway, so a slow
    stream still reaches the disk (and survives a crash) within about that time.

    Shards are written by ``io_threads`` workers of the I/O dispatcher
    (:mod:`napari_tileshard.engine.dispatch`); ``io_dispatch`` picks how shards reach them:
    ``"adaptive"`` (predicted straggler relief and hedged writes), ``"pull"`` (a shared queue)
    or ``"static"`` (round-robin).  ``stats`` reports per-worker figures, moves, hedges,
    duplicate bytes and fallback rounds.  ``io_telemetry_lost`` is for reliability tests: a
    callable ``round_index -> bool`` (e.g. :meth:`napari_tileshard.testing.FaultInjectingSink.telemetry_lost`)
    whose True makes the adaptive dispatcher lose its measurements of that batch (it places it
    round-robin and learns nothing from it); None, the default, loses nothing.

    ``ome=True`` writes an OME-Zarr 0.5 group instead of a bare array: level 0 at ``0/`` and a
    pyramid of ``downsample`` levels (``"mean"``, ``"max"``, ``"min"``, ``"decimate"``) over
    ``downsample_dims`` (default the last two dims) at ``1/``, ``2/``, ... computed by the backend
    from each batch while recording (:mod:`napari_tileshard.format.pyramid`), up to ``max_levels``.
    ``attributes`` (JSON-serialisable) go into the array's attributes, or the group's next to ``ome``;
    ``image_name`` names the OME image (default: the store's directory name); ``ome_fields`` are
    further keys of the group's ``ome`` object (``omero`` channel names, say).

    ``io_timeout`` (seconds, default 60; None: no deadline) bounds storage: a shard or ``zarr.json``
    write that gets no answer for that long (plus a second per MB of a large shard) fails the
    recording with :class:`~napari_tileshard.storage.errors.StorageTimeoutError`.  After any storage
    failure nothing queued is written (it could never be published), object-store requests in
    flight are cut off, and :meth:`close` returns within about ``io_timeout``; the store claims
    exactly the rows it holds (``docs/reliability.md``, liveness).

    The options come as two validated objects, :class:`~napari_tileshard.format.array_spec.ArraySpec`
    (what is written: ``layout`` or ``ArraySpec.of(layout, codec=..., ome=True, ...)``) and
    :class:`~napari_tileshard.engine.options.EngineOptions` (how: backend, devices, memory, I/O),
    or as the keywords above for short, which build the same two objects
    (:func:`~napari_tileshard.engine.options.writer_settings`).

    Every option is checked before the store is touched; a store the Writer creates is removed
    again if setup fails.  A local store is locked for the Writer's life (one writer per store).
    """

    _sink: Sink

    def __init__(
        self,
        store,
        layout: Layout | ArraySpec,
        options: EngineOptions | None = None,
        *,
        overwrite: bool = False,
        **keywords,
    ):
        # What is written (ArraySpec) and how (EngineOptions), each validated once; the keywords
        # are the shorthand for both (codec=, level=, ome=, ..., backend=, io_threads=, ...).
        spec, options = writer_settings(layout, options, **keywords)
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        self.spec, self.options = spec, options
        self.layout = layout = spec.layout
        self.codec = spec.codec
        self.level = spec.level
        self.io_timeout = options.io_timeout
        self.max_latency_s = options.max_latency_s
        self.ome = spec.ome is not None
        self.pyramid = spec.pyramid
        attributes = dict(spec.attributes)
        self._group = (
            group_metadata(self.pyramid, "", attributes, dict(spec.ome.fields)) if spec.ome is not None else None
        )
        self._check_shard_epoch_fits_memory()
        backend_options: dict = {"threads": options.threads} if options.threads else {}
        if options.devices is not None:
            backend_options["devices"] = options.devices
        if spec.ome is not None:
            backend_options["pyramid"] = self.pyramid
        self._backend = select_backend(options.backend, layout, self.codec, self.level, **backend_options)
        try:
            self.batch_epochs, staging_buffers, self.memory_budget = plan_batches(
                self._backend, self.pyramid, self.codec, options.batch_bytes, options.staging_buffers, options.budget
            )
            self._setup(store, overwrite, staging_buffers, options.io_threads, attributes)
        except BaseException as exc:
            self._backend.close()
            sink: Sink | None = self.__dict__.get("_sink")
            if sink is not None:
                location = sink.location
                sink.discard()  # nothing half-made stays behind
                if isinstance(exc, OSError) and not isinstance(exc, FileExistsError) and exc.errno:
                    raise OSError(exc.errno, f"could not create the store {location}: {exc.strerror}") from exc
            raise

    def _check_shard_epoch_fits_memory(self) -> None:
        """Shards are held in memory until their shard epoch is complete: refuse what cannot fit."""
        layout = self.layout
        shard_epoch_bytes = layout.tiles_per_shard[0] * sum(lay.epoch_bytes for lay in self.pyramid.layouts)
        memory = physical_memory()
        if memory and shard_epoch_bytes > memory // 2:
            raise ValueError(
                f"one shard epoch ({layout.tiles_per_shard[0]} tiles of {layout.tile_shape[0]} along "
                f"{layout.names[0]!r}) holds {shard_epoch_bytes} bytes before compression, which stay in memory "
                f"until its shards are written: more than half of this machine's {memory} bytes; use fewer "
                f"tiles_per_shard along {layout.names[0]!r}"
            )

    def _setup(self, store, overwrite, staging_buffers, io_threads, attributes):
        layout = self.layout
        self.batch_bytes = self.batch_epochs * layout.epoch_bytes
        #: tile epochs after which the batch filling now goes to the backend, below a full batch
        #: while the recording ramps up (doubling at each submission: Backend.first_batch_epochs)
        self._ramp_epochs = max(1, self._backend.first_batch_epochs(self.batch_epochs))
        self._row_bytes = layout.row_elements * layout.itemsize
        self._frame_bytes = layout.frame_elements * layout.itemsize
        total = layout.total_elements
        self._capacity = None if total is None else total * layout.itemsize
        self._error: BaseException | None = None
        self._closed = False
        self._open_frame = False  # inside a frame_buffer() block
        # Buffers (and the GPU's memory check) before the store is touched: a refusal leaves no trace.
        self._staging = StagingRing(self._backend, self.batch_bytes, staging_buffers)
        try:
            self._sink = open_sink(store, overwrite, io_timeout=self.io_timeout)
            self.stats = WriterStats(backend=self._backend.describe())
            self._prefixes = [f"{k}/" for k in range(self.pyramid.levels)] if self.ome else [""]
            self._publisher = Publisher(
                self._sink,
                self.pyramid,
                self.codec,
                self.level,
                {} if self.ome else attributes,
                self._prefixes,
                on_error=self._fail,
                on_publish=self._published,
            )
            self._publisher.begin()
            if self._group is not None:  # after the level arrays exist, so the group never names a missing dataset
                root = getattr(self._sink, "root", None)
                name = (self.spec.ome and self.spec.ome.image_name) or (root.stem if root else "image")
                self._group["attributes"]["ome"]["multiscales"][0]["name"] = name
                self._sink.write(METADATA_KEY, [metadata_bytes(self._group)])
        except BaseException:
            self._staging.close()
            raise
        self._stats_lock = threading.Lock()
        self._collector = Collector(
            self._backend,
            self.pyramid,
            self._sink,
            self._prefixes,
            self._publisher,
            io_threads=io_threads,
            io_dispatch=self.options.io_dispatch,
            io_timeout=self.io_timeout,
            io_telemetry_lost=self.options.io_telemetry_lost,
            pipeline_limit=max(staging_buffers, self._backend.batches_in_flight),
            batch_epochs=self.batch_epochs,
            failed=lambda: self._error,
            on_error=self._fail,
            on_shard=self._shard_written,
        )
        self._start = time.perf_counter()

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
        """Upper bound of the bytes the Writer holds: host (staging and compressed shards in
        flight; pinned memory with the GPU backend) and device; what the memory budget bounds."""
        return _estimate(self._backend, self.pyramid, self.codec, self.batch_epochs, self._staging.count)

    @classmethod
    def warm_up(cls, layout: Layout | ArraySpec, options: EngineOptions | None = None, **keywords) -> dict[str, int]:
        """Arm a recording of ``layout`` with ``options`` (as for a Writer) into memory and close it:
        the GPU backend keeps its buffers, compiled kernels and CUDA context for the next Writer
        with the same layout and batching, which then arms at once.  The recorder widget calls it
        when the GPU backend is chosen.  One batch per GPU runs through the pipeline (from the
        staging buffers as they are) so every kernel is loaded on every GPU.  Returns that
        recording's :meth:`memory_estimate`."""
        keywords.pop("overwrite", None)
        with cls("memory://", layout, options, **keywords) as writer:
            # One batch through every GPU: CuPy compiles or loads a kernel into a device the first
            # time it runs there, which took a camera's first frames 50+ ms per GPU (measured on
            # 2x H200: every drop of a 10 GB/s stream fell there).  A batch of one tile epoch loads
            # the same kernels as a full one; a full batch of small frames is 10 000s of shards,
            # which took minutes.  The staging buffers' own contents are encoded: no frame is copied.
            batches = len(getattr(writer._backend, "devices", ())) or 1
            shape = writer.layout
            if shape.unbounded or batches * shape.epoch_rows <= shape.shape[0]:
                writer._encode_staging_as_is(batches)
            return writer.memory_estimate()

    def memory_held(self) -> dict[str, int]:
        """Bytes the backend's buffers hold now (GPU: pinned host and device memory it allocated)."""
        return self._backend.memory_held()

    def append(self, array) -> None:
        """Append frames (an array whose trailing shape is the frame shape) to the stream.

        NumPy arrays, or CuPy arrays: with the GPU backend those go device-to-device into the
        batch's input buffer without visiting the host.
        """
        self._check_open()
        self._check_no_open_frame("append()")
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
        self._check_no_open_frame("write()")
        try:
            data = memoryview(buffer)
        except TypeError as exc:
            raise TypeError(f"write() needs a bytes-like object, got {type(buffer).__name__}") from exc
        if not data.c_contiguous:
            raise ValueError("write() needs a C-contiguous buffer")
        data = data.cast("B") if data.ndim != 1 or data.format != "B" else data
        self._check_capacity(data.nbytes)
        return self._write(data, block=False)

    @contextlib.contextmanager
    def frame_buffer(self, block: bool = True) -> Iterator[np.ndarray | None]:
        """The next frame's place in the staging buffer, to be filled in place: no copy by the Writer.

        With the GPU backend it is pinned host memory, uploaded as it is, so a camera driver
        that writes (or DMAs) a frame into it saves the pageable-to-pinned copy that
        :meth:`append` makes.  The frame counts as appended when the ``with`` block ends without
        an exception (then nothing is counted and the next frame_buffer() is the same place);
        the array must not be used after the block::

            with writer.frame_buffer() as frame:
                camera.read_into(frame)

        ``block=False`` (a camera that cannot wait: the drop policy) yields None instead of waiting
        when every staging buffer is still being encoded; the frame is then the caller's to drop.

        One frame at a time: a ``frame_buffer()``, :meth:`append` or :meth:`write` inside an open
        block raises RuntimeError (the outer frame would be lost and a zero frame recorded in its
        place).  When the block ends the yielded array becomes read-only, so a late write through
        it (which would change a frame already recorded) raises instead of landing.
        """
        self._check_open()
        self._check_no_open_frame("frame_buffer()")
        frame_bytes = self._frame_bytes
        if self.stats.bytes_in % frame_bytes:
            raise ValueError(
                f"frame_buffer() needs the stream at a frame boundary, but {self.stats.bytes_in % frame_bytes} "
                f"bytes of a {frame_bytes}-byte frame were written before"
            )
        self._check_capacity(frame_bytes)
        staging = self._staging
        if staging.full and not self._submit_current(self.batch_epochs, block=block):
            yield None
            return
        self._raise_if_failed()
        if not staging.acquire(block):
            yield None
            return
        start = staging.fill
        place = staging.buffer[start : start + frame_bytes].view(self.layout.dtype).reshape(self.layout.frame_shape)
        self._open_frame = True
        try:
            yield place
        finally:
            place.flags.writeable = False  # the place is the next frame's once this one is committed
            self._open_frame = False
        self._check_open()
        staging.commit(frame_bytes)
        self._filled(frame_bytes)
        if staging.full:
            self._submit_current(self.batch_epochs, block=block)  # not now: at the next frame

    def _encode_staging_as_is(self, batches: int) -> None:
        """Submit ``batches`` batches of one tile epoch each, of whatever the staging buffers
        hold (:meth:`warm_up`: the backend hands consecutive batches to its GPUs in turn)."""
        staging = self._staging
        for _ in range(batches):
            staging.acquire(True)
            staging.commit(self.layout.epoch_bytes)
            self._filled(self.layout.epoch_bytes)  # may submit it already (a slow stream's epoch)
            if staging.fill:
                self._submit_current(staging.fill // self.layout.epoch_bytes)

    def sync(self) -> None:
        """Wait until every batch handed to the backend so far is encoded and its complete shard
        epochs are written and published.  Unlike :meth:`flush` it writes no partial shard and
        leaves data still filling a staging buffer where it is."""
        self._check_open()
        self._drain()

    def flush(self) -> None:
        """Write everything received so far, partial shards included, and publish its whole rows.

        The stream continues.  Flushed shards are rewritten later without moving any byte a
        reader may already have located (:meth:`ShardAccumulator.flush`).
        """
        self._check_open()
        self._drain()
        provisional: list[list[EncodedEpoch]] = [[] for _ in self.pyramid.layouts]
        if self._staging.fill:
            ticket = self._staging.submit_provisional(
                self.layout.epoch_bytes, self.layout.itemsize, rows=self._rows_in_current()
            )
            provisional = self._backend.result(ticket)
        self._collector.flush(provisional, self.stats.bytes_in // self._row_bytes)
        self._raise_if_failed()

    def close(self) -> None:
        """Write what is left, finalize ``zarr.json`` and release buffers, threads, device and lock.

        The finishing runs on a helper thread while this one waits, so a Ctrl-C here is safe: the
        first (KeyboardInterrupt) logs what the close is waiting for and keeps waiting; a second
        abandons: nothing more is written, the store keeps claiming only rows that are on disk, and
        :class:`WriterError` says so.  After a storage failure it returns within about
        ``io_timeout`` (writes that cannot be cut off are abandoned, and named in the log)."""
        if self._closed:
            return
        self._closed = True
        # Waited on through an Event, not Thread.join: a KeyboardInterrupt inside join() marks a
        # live thread as stopped on Python 3.11 (bpo-45274's handling of an interrupted join).
        finished_event = threading.Event()

        def finish() -> None:
            try:
                self._finish()
            finally:
                finished_event.set()

        threading.Thread(target=finish, name="tileshard-close", daemon=True).start()
        interrupts = 0
        while not finished_event.is_set():
            try:
                finished_event.wait(0.25)
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts > 1:
                    self._fail(
                        CloseAbandoned(
                            f"closing was abandoned by a second interrupt (Ctrl-C) while waiting for "
                            f"{self._collector.describe()}"
                        )
                    )
                    break
                log.warning(
                    "closing %s: waiting for %s. Press Ctrl-C again to abandon (the store keeps only what is on disk).",
                    self._sink.location,
                    self._collector.describe(),
                )
        finished = finished_event.is_set() and self._collector.done
        self._refresh_io_stats()
        if finished:  # else a stuck stage may still use them: they go with the process
            self._staging.close()
            self._backend.close()
        if self._error is not None:
            self._publisher.mark_failed(timeout=_MARK_FAILED_TIMEOUT_S)
        if finished:  # a write still running keeps the lock: it names this (ending) process
            try:
                self._sink.release()
            except Exception as exc:  # noqa: BLE001 - never hides how the recording ended
                if self._error is None:
                    self._fail(exc)
                else:
                    log.warning("also: releasing %s failed: %s", self._sink.location, exc)
        self.stats.elapsed_s = time.perf_counter() - self._start
        self._raise_if_failed()
        self._warn_of_a_partial_frame()  # last: a warning turned into an error leaves nothing open

    def _warn_of_a_partial_frame(self) -> None:
        """Bytes of a frame that :meth:`write` never completed are not recorded (a store holds
        whole frames only): say so when closing instead of dropping them silently."""
        partial = self.stats.bytes_in % self._frame_bytes
        if partial and self._error is None:
            warnings.warn(
                f"{self._sink.location}: the last {partial} bytes given to write() are part of a frame of "
                f"{self._frame_bytes} bytes that never completed: they are not recorded (the store holds "
                f"{self.stats.bytes_in // self._frame_bytes} whole frames)",
                IncompleteFrameWarning,
                stacklevel=3,  # the caller of close() (or of __exit__)
            )

    def _finish(self) -> None:
        """close()'s work (on its helper thread): the last batch, the collector, the I/O."""
        try:
            if self._error is None and self._staging.fill:
                self._submit_current(
                    self._staging.pad(self.layout.epoch_bytes, self.layout.itemsize), self._rows_in_current()
                )
            self._collector.finish()
        except BaseException as exc:  # noqa: BLE001 - recorded and re-raised by close()
            self._fail(exc)
        finally:
            self._shutdown_io()

    def _shutdown_io(self) -> None:
        abandoned = self._collector.shutdown(timeout=self.io_timeout)
        if abandoned:
            log.error(
                "%s: %d shard writes did not end within io_timeout=%s s and were abandoned: %s",
                self._sink.location,
                len(abandoned),
                self.io_timeout,
                ", ".join(abandoned[:5]) + (" ..." if len(abandoned) > 5 else ""),
            )

    def abandon(self) -> None:
        """Undo this Writer instead of finishing it: stop its threads, free its buffers and remove
        every object it wrote (a :class:`~napari_tileshard.engine.multi_writer.MultiWriter` whose later
        stream could not be set up leaves nothing behind).  Frames appended so far are lost."""
        if self._closed:
            return
        self._closed = True
        self._fail(WriterError("abandoned"))
        try:
            self._collector.finish()
            self._shutdown_io()
        finally:
            self._staging.close()
            self._backend.close()
            self._sink.discard()

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
        if isinstance(array, np.ma.MaskedArray):
            raise TypeError(
                "append() got a masked array: its mask cannot be stored; pass array.filled(value) or np.asarray(array)"
            )
        self._check_frames(array)
        return array.reshape(-1).view(np.uint8).data

    def _check_frames(self, array) -> None:
        """dtype, trailing frame shape and contiguity, for NumPy and CuPy arrays alike."""
        layout = self.layout
        if array.dtype != layout.dtype:
            raise TypeError(
                f"append() got dtype {array.dtype.str} ({array.dtype.name}), the layout holds {layout.dtype.name}"
            )
        frame = layout.frame_shape
        if array.ndim < len(frame) or tuple(array.shape[array.ndim - len(frame) :]) != frame:
            raise ValueError(
                f"append() got shape {array.shape}: its trailing dimensions must equal the frame shape {frame}"
            )
        if not array.flags.c_contiguous:
            raise ValueError(
                f"append() got a non-contiguous array of shape {array.shape}; pass a contiguous "
                "copy (np.ascontiguousarray)"
            )

    def _check_capacity(self, nbytes: int) -> None:
        if self._capacity is not None and self.stats.bytes_in + nbytes > self._capacity:
            left = self._capacity - self.stats.bytes_in
            raise ValueError(
                f"{nbytes} more bytes exceed the declared array shape {self.layout.shape}: "
                f"only {left} bytes ({left // self.layout.itemsize} elements) are left"
            )

    def _write(self, data, block: bool, device: bool = False):
        """Copy ``data`` (bytes: a memoryview, or a 1-D uint8 CuPy array with ``device``) into staging."""
        staging = self._staging
        while data.nbytes:
            if staging.full and not self._submit_current(self.batch_epochs, block=block):
                break
            self._raise_if_failed()
            if not staging.acquire(block):
                break
            copy_started = time.perf_counter()
            n = staging.copy_in(data, device)
            self.stats.copy_s += time.perf_counter() - copy_started
            self._filled(n)
            data = data[n:]
        if staging.full:
            self._submit_current(self.batch_epochs, block=block)
        return data

    def _filled(self, n: int) -> None:
        """``n`` more bytes are in the current staging buffer: count them; the complete epochs of
        a slow stream, or of a recording's first batches (the ramp), go to the backend without
        waiting for a full batch."""
        staging = self._staging
        self.stats.bytes_in += n
        self.stats.frames = self.stats.bytes_in // self._frame_bytes
        epoch_bytes = self.layout.epoch_bytes
        if staging.fill % epoch_bytes or staging.full:
            return
        epochs = staging.fill // epoch_bytes
        if epochs >= self._ramp_epochs:
            # ramping up: the encode threads start on the first epochs while the caller copies
            # the next ones (only if the pipeline has room now; else at a later epoch)
            if self._submit_current(epochs, block=False):
                self._ramp_epochs = min(2 * epochs, self.batch_epochs)
        elif time.monotonic() - staging.fill_started > self.max_latency_s:
            # slow stream: don't wait for a full batch (only if the pipeline has room now)
            self._submit_current(epochs, block=False)

    def _rows_in_current(self) -> int:
        """Rows along dim 0 that the current (partly filled) buffer holds data for."""
        return math.ceil(self._staging.fill / self._row_bytes)

    def _submit_current(self, epochs: int, rows: int | None = None, block: bool = True) -> bool:
        """Hand the current buffer's first ``epochs`` to the backend and the collector; False if
        ``block`` is False and the pipeline is full."""
        if not self._collector.reserve(block):
            self._raise_if_failed()
            return False
        try:  # from here on every step must happen, or the stream position is lost: fail then
            ticket = self._staging.submit(epochs, rows)
            self._collector.enqueue(ticket, epochs, self.stats.bytes_in)
        except BaseException as exc:
            self._fail(exc)
            raise
        return True

    def _drain(self) -> None:
        """Wait until the collector has processed everything submitted and storage caught up."""
        self._collector.drain()
        self._refresh_io_stats()
        self._raise_if_failed()

    def _refresh_io_stats(self) -> None:
        io = self._collector.io_stats()
        stats = self.stats
        stats.io_dispatch, stats.io_workers = io.mode, io.workers
        stats.moves, stats.steals, stats.hedges = io.moves, io.steals, io.hedges
        stats.duplicate_bytes, stats.retries, stats.fallback_rounds = io.duplicate_bytes, io.retries, io.fallback_rounds
        stats.replaced_workers = io.replaced
        stats.dropped_writes, stats.io_timeouts = io.dropped, io.timeouts

    def _shard_written(self, level: int, nbytes: int) -> None:
        with self._stats_lock:
            self.stats.bytes_out += nbytes
            if level:
                self.stats.pyramid_bytes_out += nbytes
            self.stats.shards_written += 1

    def _published(self, rows: int) -> None:
        self.stats.rows_complete = rows

    # -- errors --------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            log.error("writer for %s failed: %s", self._sink.location, exc)
            self._error = exc
        collector = getattr(self, "_collector", None)
        if collector is not None:
            collector.abort(self._error)  # nothing queued can be published any more: don't write it
            collector.wake()  # a producer waiting for room must see the error

    def _check_no_open_frame(self, what: str) -> None:
        if self._open_frame:
            raise RuntimeError(
                f"{what} inside a frame_buffer() block: the frame of the open block is not appended yet "
                "(finish that block first; frame_buffer() blocks do not nest)"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"the Writer for {self._sink.location} is closed")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            exc = self._error
            raise WriterError(f"writing {self._sink.location} failed: {type(exc).__name__}: {exc}") from exc
