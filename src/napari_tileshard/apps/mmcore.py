"""Record pymmcore-plus multi-dimensional acquisitions (MDAs) into sharded OME-Zarr.

:class:`TileShardSink` implements pymmcore-plus's ``SinkProtocol`` (``setup``, ``append``,
``skip``, ``close``, ``get_view``) and its frame-handler protocol (``sequenceStarted``,
``frameReady``, ``sequenceFinished``), so it works as::

    core.mda.run(sequence, output=TileShardSink("run.ome.zarr"))   # pymmcore-plus 0.18 takes
    core.run_mda(sequence, output=TileShardSink("run.ome.zarr"))   # output objects as handlers

and, attached straight to ``core.mda.events`` (:meth:`TileShardSink.attach`, what the recorder
dock does), for every MDA whoever starts it (napari-micromanager, a script).

Layout (the same as pymmcore-plus's default ome-writers sink, so its readers read ours):
the store is a ``bioformats2raw.layout`` collection whose series ``0``, ``1``, ... are one
OME-Zarr image each, one per stage position (and grid position): positions may differ in their
grid shapes and are often visited in an interleaved order (``tpcz``), and OME-NGFF 0.5 allows
no position axis beside t, c, z.  Each image's dimensions are the sequence's other axes in its
axis order, then y and x from the camera (ROI and binning included), with the pixel size, the
z step and the time interval as scales and the channel names in ``omero``.

Frames are placed by their event index, not by arrival: each series keeps the next frame its
Writer needs; frames that arrive early wait (at most ``reorder_frames`` of them), frames that
never come (``skip``, dropped, cancelled) are written as the fill value and listed in the root
group's ``tileshard_mmcore`` attributes.  Per-frame metadata (everything pymmcore-plus records:
times, stage position, exposure, properties) goes into the ``frame_metadata`` (numbers) and
``frame_metadata_json`` (the full record) arrays beside the series.  Each image's first axis
grows as its rows complete, so a run that stops early keeps exactly the rows it acquired.

A camera faster than the sink fills pymmcore-plus's sequence buffer (``images_remaining_in_buffer``
in each frame's metadata, its size in the summary metadata): before it overflows (which ends the
MDA in ``MemoryError: Buffer overflowed``) the sink stops the MDA, when it knows the core
(``core=``, ``attach(core)``), and says why: the rate the sink sustained, the rate the camera
delivered and how to raise the buffer (:class:`SinkFellBehindError`).

pymmcore-plus is never imported here: the sink only reads the objects it is handed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.backends import gpu_unavailable_reason
from ..engine.options import EngineOptions
from ..engine.writer import Writer
from ..format.array_spec import ArraySpec
from ..format.codecs import get as get_codec
from ..format.layout import Layout
from ..format.pyramid import check_method
from ..reader.levels import open_level0
from ..storage.errors import StoreExistsError
from ..storage.sinks import check_store_path
from .recorder import POLICIES
from .recorder_form import next_output

log = logging.getLogger(__name__)

SERIES_AXES = ("p", "g")  # axes that select an image of the collection instead of indexing one
FRAME_COLUMNS = ("series", "frame", "runner_time_ms", "exposure_ms", "x_um", "y_um", "z_um", "stored")
_STOP = object()


class SinkFellBehindError(RuntimeError):
    """The camera delivered frames faster than the sink wrote them, until pymmcore-plus's sequence
    buffer was (nearly) full: the MDA was stopped.  What the sink received is written and complete."""


#: frames the sink receives before it may stop the MDA: the camera's and its own rates are
#: measured by then (a buffer that overflows meanwhile is still draining: the stop lands in time)
_FRAMES_TO_JUDGE = 8


def _buffer_stop_level(capacity: int) -> int:
    """Frames waiting in pymmcore-plus's buffer at which the sink stops the MDA: three quarters of
    its capacity.  The buffer absorbs hiccups; one this full under an unthrottled camera overflows
    within moments, and waiting longer is not safe: the waiting count is seen only as frames are
    taken (a fast camera fills many slots in between), and the slots a buffer really holds can be
    fewer than its size in frames (a 1 MiB buffer of 136 frames overflowed at 121)."""
    return max(1, capacity - capacity // 4)


@dataclass
class SinkStats:
    """What the sink did with the frames it was offered (read while recording or after ``close``)."""

    received: int = 0  # frames handed to append
    written: int = 0  # frames given to the Writers (received and not dropped/late)
    dropped: int = 0  # queue full under policy "drop"
    skipped: int = 0  # announced by skip()
    missing: int = 0  # never received (cancelled run, gap forced by the reorder bound): fill value
    late: int = 0  # arrived after their place had been filled: discarded
    append_s: float = 0.0  # time spent inside append() on the caller's (MDA) thread
    max_queue: int = 0
    max_camera_buffer: int = 0  # most frames seen waiting in pymmcore-plus's sequence buffer
    error: str | None = None


@dataclass
class _Series:
    name: str
    writer: Writer
    total: int | None  # frames in the series; None = unbounded
    next_frame: int = 0
    pending: dict[int, np.ndarray] = field(default_factory=dict)
    absent: dict[int, str] = field(default_factory=dict)  # frame -> reason: skipped / dropped
    fill_reasons: dict[int, str] = field(default_factory=dict)  # frames written as fill, and why


class TileShardSink:
    """A pymmcore-plus data sink writing each MDA into a sharded OME-Zarr collection.

    ``tile`` and ``tiles_per_shard`` map axis names (``t``, ``c``, ``z``, ``y``, ``x``, ...) to
    sizes; unnamed axes get the package's one default tiling (:meth:`Layout.default_for`).  ``policy``
    is what ``append`` does when ``queue_frames`` frames already wait: ``"block"`` the MDA thread
    waits, ``"drop"`` the frame is discarded and counted (it reads as the fill value).
    What is written is ``codec`` at ``level``, an OME pyramid of ``downsample`` unless ``ome=False``
    (each position's :class:`~napari_tileshard.format.array_spec.ArraySpec`); how, ``options``
    (:class:`~napari_tileshard.engine.options.EngineOptions`; ``backend=`` is its shorthand).
    ``store_for`` maps a series' location to the store its Writer writes (a wrapping Sink, say;
    default: the location).

    ``core``: the ``CMMCorePlus`` (or ``UniMMCore``) whose MDA this sink records
    (:meth:`attach` with a core sets it).  With it the sink stops the MDA when it falls so far behind a
    hardware-sequenced camera that pymmcore-plus's sequence buffer is about to overflow, and says so
    (:class:`SinkFellBehindError` from :meth:`close`, ``stats.error``, the log, and the root group's
    ``tileshard_mmcore``); without it pymmcore-plus ends the MDA itself once the buffer overflows
    (``MemoryError: Buffer overflowed``), after the sink has logged the same explanation.
    """

    def __init__(
        self,
        path,
        *,
        codec: str = "zstd",
        level: int = 1,
        backend: str = "auto",
        tile: dict[str, int] | None = None,
        tiles_per_shard: dict[str, int] | None = None,
        ome: bool = True,
        downsample: str = "mean",
        overwrite: bool = False,
        policy: str = "block",
        queue_frames: int = 64,
        reorder_frames: int | None = None,
        options: EngineOptions | None = None,
        store_for: Callable[[str], Any] | None = None,
        core=None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        for name, value in (("queue_frames", queue_frames), ("reorder_frames", reorder_frames)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, mapping in (("tile", tile), ("tiles_per_shard", tiles_per_shard)):
            if mapping is not None and not isinstance(mapping, dict):
                raise TypeError(f"{name} must map axis names to sizes, got {mapping!r}")
        check_store_path(path)  # "" would put the series at /0, /1, ...
        self.path = str(path).rstrip("/")
        # Every setting is checked here, before an MDA starts (the layouts come with the sequence).
        self.codec = get_codec(codec).configure(level, "uint8")
        self.level = level
        self.options = EngineOptions(backend=backend) if options is None else options
        if options is not None and backend != "auto":
            raise TypeError("backend= is the shorthand of options=EngineOptions(backend=...): give one of them")
        self.backend = self.options.backend
        check_method(downsample)
        self.tile = dict(tile or {})
        self.tiles_per_shard = dict(tiles_per_shard or {})
        self.ome, self.downsample, self.overwrite = bool(ome), downsample, bool(overwrite)
        self.policy = policy
        self.queue_frames = queue_frames
        self.reorder_frames = reorder_frames or queue_frames
        self.store_for = store_for  # series location -> the Writer's store (a path, zarr Store or Sink)
        self.core = core  # whose MDA to stop when the sink falls behind (None: it cannot)
        self.stats = SinkStats()
        self.series: list[_Series] = []
        self.axes: tuple[str, ...] = ()  # the image axes (without p/g, with y, x)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_frames)
        self._thread: threading.Thread | None = None
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._series_of: dict[tuple, int] = {}  # (p, g) -> series number
        self._strides: tuple[int, ...] = ()
        self._inner_axes: tuple[str, ...] = ()
        self._order: list[tuple[int, int]] | None = None  # (series, frame) in the sequence's event order
        self._order_position: dict[tuple[int, int], int] = {}
        self._cursor = 0  # position in _order after the last frame appended or skipped
        self._last_placed: tuple[int, int] | None = None
        self._series_axis_names: tuple[str, ...] = ()
        self._sequence = None
        self._arrivals = 0  # unbounded: frames numbered by arrival
        self._bounded = True
        self._rows: list[tuple] = []  # per-frame numbers (FRAME_COLUMNS + axis indices)
        self._records: list[str] = []  # per-frame JSON of pymmcore-plus's FrameMetaV1
        self._summary: dict = {}
        self._failure: BaseException | None = None
        self._started = 0.0
        self._closed = False
        # Keeping up with the camera (pymmcore-plus's sequence buffer):
        self._frame_bytes = 0
        self._frame_text = ""
        self._buffer_mb: float | None = None
        self._buffer_frames: int | None = None
        self._first_append: float | None = None
        self._camera_first_ms: float | None = None  # runner_time_ms of the first frame
        self._camera_last_ms = 0.0  # ... and of the latest one
        self._timed = 0  # frames with a runner_time_ms
        self._arrivals_full: deque[bool] = deque(maxlen=16)  # whether the latest frames found the queue full
        self._fell_behind: str | None = None

    @property
    def recording(self) -> bool:
        """Between ``setup`` and ``close``."""
        return self._thread is not None and not self._closed

    # -- pymmcore-plus SinkProtocol -----------------------------------------------------
    def setup(self, sequence, meta) -> None:
        """Create the collection and one Writer per series from the sequence and the summary
        metadata (``meta["image_infos"][0]``: width, height, dtype, pixel size of the camera)."""
        if self._thread is not None and not self._closed:
            raise RuntimeError(f"{self.path}: this sink is already recording; close() it first")
        self._reset_run_state()
        self.stats = SinkStats()
        self.series = []
        self._queue = queue.Queue(maxsize=self.queue_frames)
        info = _image_info(meta)
        if info.get("num_camera_adapter_channels", 1) > 1:
            raise NotImplementedError("multi-camera acquisitions (a camera axis) are not supported by TileShardSink")
        height, width = int(info["height"]), int(info["width"])
        dtype = np.dtype(info["dtype"])
        pixel_um = float(info.get("pixel_size_um") or 0.0)
        bit_depth = _bit_depth(meta, dtype)
        self._frame_bytes = height * width * dtype.itemsize
        self._frame_text = f"{width}x{height} {dtype.name}"
        self._buffer_mb = _buffer_mb(meta)
        if self._buffer_mb:
            self._buffer_frames = int(self._buffer_mb * 2**20 // self._frame_bytes)

        sizes, axis_order = _bounded_sizes(sequence)
        self._bounded = sizes is not None
        if sizes is None:  # a generator of events: time is the append dimension, frames in arrival order
            inner = {"t": 0}
            self._series_of = {(): 0}
            series_names = ["0"]
            image_names: list[str | None] = [None]
        else:
            inner = {a: sizes[a] for a in axis_order if a not in SERIES_AXES and sizes.get(a, 0) > 0}
            self._series_axis_names = tuple(a for a in SERIES_AXES if sizes.get(a, 0) > 0)
            self._sequence = sequence
            keys = _series_keys(sequence, sizes, axis_order)
            self._series_of = {key: i for i, key in enumerate(keys)}
            series_names = [str(i) for i in range(len(keys))]
            image_names = _image_names(sequence, keys, self._series_axis_names)
        self._inner_axes = tuple(inner)
        self.axes = (*inner, "y", "x")
        unknown = sorted((set(self.tile) | set(self.tiles_per_shard)) - set(self.axes))
        if unknown:
            raise ValueError(f"tile/tiles_per_shard name axes {unknown} that this sequence does not have {self.axes}")
        counts = list(inner.values())
        self._strides = tuple(math.prod(counts[i + 1 :]) for i in range(len(counts)))
        layout = self._layout(inner, height, width, dtype, sequence, pixel_um)
        total = None if not self._bounded else math.prod(counts)

        self._summary = _jsonable(dict(meta or {}))
        self._warm_up(layout)
        self._open_root(series_names)
        omero = _omero(sequence, dtype, bit_depth)
        try:
            for name, image_name in zip(series_names, image_names):
                location = f"{self.path}/{name}"
                writer = Writer(
                    self.store_for(location) if self.store_for else location,
                    self._spec(layout, omero, image_name or name),  # unnamed: the series path, read as none
                    self.options,
                    overwrite=self.overwrite,
                )
                self.series.append(_Series(name, writer, total))
        except BaseException:  # the Writers already open release their stores (and locks)
            for series in self.series:
                series.writer.close()
            self.series = []
            raise
        self._started = time.perf_counter()
        self._closed = False
        self._thread = threading.Thread(target=self._consume, name="tileshard-mda-sink", daemon=True)
        self._thread.start()

    def _warm_up(self, layout) -> None:
        """Arm the GPU before the camera starts (setup runs before the MDA's first event): the
        first batch of a cold GPU loads its kernels (50+ ms), which at 4 GB/s from the camera
        filled the sink's queue and overflowed pymmcore-plus's 1 GiB buffer (H100, 2048² frames)."""
        if self.backend in ("gpu", "auto") and gpu_unavailable_reason() is None:
            Writer.warm_up(self._spec(layout, None), self.options)

    def _spec(self, layout: Layout, omero, image_name: str | None = None) -> ArraySpec:
        return ArraySpec.of(
            layout,
            self.codec,
            self.level,
            ome=self.ome,
            downsample=self.downsample,
            image_name=image_name,
            ome_fields={"omero": omero} if (self.ome and omero) else None,
        )

    def append(self, img: np.ndarray, event, meta) -> bool:
        """Queue one frame (on the MDA thread; waits only when ``queue_frames`` frames wait and
        the policy is ``block``).  False when the frame was dropped."""
        start = time.perf_counter()
        self._raise_if_failed()
        if not self.recording:
            raise RuntimeError(f"{self.path}: append() before setup() or after close()")
        series, frame = self._place(event)
        self.stats.received += 1
        item = (series, frame, np.asarray(img), meta)
        accepted = True
        self._arrivals_full.append(self._queue.full())
        self._watch_camera(meta)
        if self.policy == "block":
            self._queue.put(item)
        else:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                accepted = False
                with self._lock:
                    self.stats.dropped += 1
                    self.series[series].absent[frame] = "dropped"
                self._record(series, frame, meta, stored=False)
        if accepted:
            self.stats.max_queue = max(self.stats.max_queue, self._queue.qsize())
        self.stats.append_s += time.perf_counter() - start
        return accepted

    def _watch_camera(self, meta) -> None:
        """Follow the camera's pace and pymmcore-plus's sequence buffer (frame metadata:
        ``runner_time_ms``, the camera's time for a hardware-sequenced frame, and
        ``images_remaining_in_buffer``); stop the MDA before the buffer overflows."""
        if self._first_append is None:
            self._first_append = time.perf_counter()
        if not isinstance(meta, dict):
            return
        when = meta.get("runner_time_ms")
        if isinstance(when, (int, float)) and math.isfinite(when):
            if self._camera_first_ms is None:
                self._camera_first_ms = float(when)
            self._camera_last_ms = float(when)
            self._timed += 1
        waiting = meta.get("images_remaining_in_buffer")
        if not isinstance(waiting, int) or isinstance(waiting, bool):
            return
        self.stats.max_camera_buffer = max(self.stats.max_camera_buffer, waiting)
        capacity = self._buffer_frames
        if (
            self._fell_behind is None
            and capacity
            and capacity >= 2
            and waiting >= _buffer_stop_level(capacity)
            and self.stats.received >= _FRAMES_TO_JUDGE  # rates measured, not a start-up burst
        ):
            self._stop_falling_behind(waiting)

    def _stop_falling_behind(self, waiting: int) -> None:
        """Say why (rates, the buffer and how to raise it) and stop the MDA if the core is known."""
        elapsed = time.perf_counter() - (self._first_append or self._started)
        frame_bytes = self._frame_bytes
        sink_fps = self.stats.written / elapsed if elapsed > 0 else 0.0
        first = self._camera_first_ms
        span_s = (self._camera_last_ms - first) / 1000 if first is not None else 0.0
        camera_fps = (self._timed - 1) / span_s if span_s > 0 else None
        capacity = self._buffer_frames or 0
        camera = (
            f"the camera delivered {_rate(camera_fps * frame_bytes)} ({camera_fps:.0f} frames/s)"
            if camera_fps
            else "the camera delivered them faster"
        )
        # Who is slow: a sink that cannot keep up has its queue full when frames arrive; one that
        # keeps up with what it is handed has room, and the MDA thread itself took frames too slowly.
        recent = self._arrivals_full
        full = sum(recent) / len(recent) if recent else 0.0
        bottleneck = (
            f"the sink's queue was full for {full:.0%} of the latest frames: the sink could not keep up"
            if full >= 0.5
            else f"the sink's queue had room for {1 - full:.0%} of the latest frames: the MDA thread itself was slow"
        )
        need = ""
        total = self.series[0].total if self.series else None
        taken_fps = self.stats.received / elapsed if elapsed > 0 else 0.0  # frames leaving the buffer
        if camera_fps and taken_fps < camera_fps and total is not None:
            frames = math.ceil(total * len(self.series) * (1 - taken_fps / camera_fps))
            need = f" (this run would need about {math.ceil(frames * frame_bytes / 2**20)} MiB)"
        stop = (
            "The MDA is stopped"
            if self.core is not None
            else "pymmcore-plus ends the MDA when it overflows (MemoryError: Buffer overflowed); give the sink "
            "the core (TileShardSink(..., core=core) or sink.attach(core)) to stop it first"
        )
        message = (
            f"{self.path}: frames left pymmcore-plus's sequence buffer slower than the camera filled it "
            f"({bottleneck}): the sink sustained {_rate(sink_fps * frame_bytes)} ({sink_fps:.0f} frames/s "
            f"of {self._frame_text}) while {camera}, and the buffer of {self._buffer_mb:g} MiB ({capacity} frames) "
            f"held {waiting} waiting frames. {stop}; every frame received up to then is written. Raise the "
            f"buffer with core.setCircularBufferMemoryFootprint(MiB){need}, throttle the camera (a longer "
            "exposure or an interval in the time plan), or acquire fewer frames."
        )
        self._fell_behind = message
        self.stats.error = message
        log.error("%s", message)
        if self.core is not None:
            try:
                self.core.mda.cancel()
            except Exception:  # noqa: BLE001 - the explanation stands; pymmcore-plus ends the run then
                log.exception("%s: could not stop the MDA", self.path)

    def skip(self, *, frames: int = 1) -> None:
        """The next ``frames`` events of the sequence produced no image: they read as the fill
        value and are listed in the metadata as skipped."""
        if not self._bounded:
            with self._lock:
                for _ in range(frames):
                    self.series[0].absent[self._arrivals] = "skipped"
                    self._arrivals += 1
                    self.stats.skipped += 1
            return
        order = self._event_order()
        with self._lock:
            for series, frame in order[self._cursor : self._cursor + frames]:
                self.series[series].absent[frame] = "skipped"
                self.stats.skipped += 1
            self._cursor += frames
        self._queue.put(("wake",))  # let the consumer advance over the skipped frames now

    def close(self) -> None:
        """Write what is still queued, fill the frames that never came up to the end of their
        row, close the Writers and write the metadata.  Raises the Writer's error, if any."""
        if self._thread is None or self._closed:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._closed = True
        errors = []
        for series in self.series:
            try:
                series.writer.close()
            except Exception as exc:  # every Writer is closed whatever the others did
                errors.append(exc)
        try:
            self._write_metadata()
        except Exception as exc:
            errors.append(exc)
        failure = self._failure or (errors[0] if errors else None)
        if failure is not None:
            self.stats.error = str(failure)
            raise failure
        if self._fell_behind is not None:
            raise SinkFellBehindError(self._fell_behind)

    def get_view(self):
        """A lazy (dask) array of what is on disk now: the series stacked along a leading
        position axis when there are several of one shape, else series 0 alone."""
        if not self.series:
            return None
        import dask.array as da

        arrays = [da.from_zarr(open_level0(f"{self.path}/{s.name}")) for s in self.series]
        if len(arrays) > 1 and len({a.shape for a in arrays}) == 1:
            return da.stack(arrays)
        return arrays[0]

    # -- pymmcore-plus frame-handler protocol (how `output=` takes objects in 0.18) ---
    def sequenceStarted(self, sequence, meta=None) -> None:  # noqa: N802 (pymmcore-plus's signal names)
        self.setup(sequence, meta)

    def frameReady(self, img, event, meta) -> None:  # noqa: N802
        self.append(img, event, meta)

    def sequenceFinished(self, sequence=None) -> None:  # noqa: N802
        try:
            self.close()
        except SinkFellBehindError:
            pass  # logged when it happened; in stats.error and the store's metadata
        except Exception:
            log.exception("%s: closing the recording failed", self.path)

    def attach(self, mda_events) -> Callable[[], None]:
        """Connect to ``core.mda.events`` directly: every MDA started on that core is recorded,
        its frames handed over on the MDA thread itself (through the bounded queue).  Given the
        core itself (``attach(core)``), the sink can also stop its MDA when it falls behind
        (``core=``).  Returns the function that disconnects again."""
        if hasattr(mda_events, "mda"):  # a CMMCorePlus / UniMMCore
            self.core = mda_events
            mda_events = mda_events.mda.events
        return _connect(mda_events, self, ("sequenceStarted", "frameReady", "sequenceFinished"))

    # -- placement ------------------------------------------------------------------
    def _place(self, event) -> tuple[int, int]:
        if not self._bounded:
            with self._lock:
                frame = self._arrivals
                self._arrivals += 1
            return 0, frame
        index = dict(getattr(event, "index", {}) or {})
        key = tuple(index.get(a, 0) for a in SERIES_AXES if a in self._series_axes)
        try:
            series = self._series_of[key]
            frame = sum(index.get(a, 0) * s for a, s in zip(self._inner_axes, self._strides))
        except KeyError:
            raise ValueError(f"{self.path}: event index {index} is not part of the sequence") from None
        self._last_placed = (series, frame)
        if self._order is not None:
            position = self._order_position.get((series, frame))
            if position is not None:
                self._cursor = max(self._cursor, position + 1)
        return series, frame

    @property
    def _series_axes(self) -> tuple[str, ...]:
        return self._series_axis_names

    def _event_order(self) -> list[tuple[int, int]]:
        """(series, frame) of every event in the order the sequence yields them (built on the
        first ``skip``: only a skip needs to know which events come next)."""
        if self._order is None:
            order = []
            for event in self._sequence_events():
                order.append(self._place_index(dict(event.index)))
            self._order = order
            self._order_position = {item: k for k, item in enumerate(order)}
            if self._last_placed is not None:
                self._cursor = self._order_position.get(self._last_placed, -1) + 1
        return self._order

    def _place_index(self, index: dict) -> tuple[int, int]:
        key = tuple(index.get(a, 0) for a in SERIES_AXES if a in self._series_axes)
        return self._series_of[key], sum(index.get(a, 0) * s for a, s in zip(self._inner_axes, self._strides))

    # -- consumer thread ------------------------------------------------------------
    def _consume(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if len(item) == 4:
                    series, frame, img, meta = item
                    self._take(series, frame, img)
                    self._record(series, frame, meta, stored=True)
                self._advance_all()
            self._finish()
        except BaseException as exc:  # reported by the next append/close
            self._failure = exc
            log.exception("%s: recording failed", self.path)
            while True:  # keep the MDA thread from blocking on a full queue
                if self._queue.get() is _STOP:
                    break

    def _take(self, series_number: int, frame: int, img: np.ndarray) -> None:
        series = self.series[series_number]
        if frame < series.next_frame or frame in series.pending:
            with self._lock:
                self.stats.late += 1
            return
        series.pending[frame] = img
        pending = sum(len(s.pending) for s in self.series)
        if pending > self.reorder_frames:  # the oldest gap will not be filled in time: fill it now
            oldest = min((s for s in self.series if s.pending), key=lambda s: min(s.pending) - s.next_frame)
            self._fill_until(oldest, min(oldest.pending), "missing")

    def _advance_all(self) -> None:
        for series in self.series:
            self._advance(series)

    def _advance(self, series: _Series) -> None:
        while True:
            frame = series.next_frame
            if series.total is not None and frame >= series.total:
                return
            img = series.pending.pop(frame, None)
            if img is not None:
                series.writer.append(img)
                self.stats.written += 1
            else:
                with self._lock:
                    reason = series.absent.pop(frame, None)
                if reason is None:
                    return
                self._write_fill(series, reason)
            series.next_frame += 1

    def _fill_until(self, series: _Series, stop: int, reason: str) -> None:
        while series.next_frame < stop:
            with self._lock:
                why = series.absent.pop(series.next_frame, reason)
            if why == "missing":
                self.stats.missing += 1
            self._write_fill(series, why)
            series.next_frame += 1
        self._advance(series)

    def _write_fill(self, series: _Series, reason: str) -> None:
        layout = series.writer.layout
        series.writer.append(np.zeros(layout.shape[-2:], layout.dtype))
        series.fill_reasons[series.next_frame] = reason

    def _finish(self) -> None:
        """At the end: frames still waiting go in after filling the gaps before them, and the
        last row of each series is completed so every received frame is claimed."""
        for series in self.series:
            self._advance(series)
            last = max([*series.pending, *series.absent, series.next_frame - 1], default=-1)
            row = self._frames_per_row()
            end = (last // row + 1) * row if last >= 0 else 0
            if series.total is not None:
                end = min(end, series.total)
            self._fill_until(series, end, "missing")

    def _frames_per_row(self) -> int:
        return self._strides[0] if self._strides else 1

    # -- metadata -------------------------------------------------------------------
    def _record(self, series: int, frame: int, meta, stored: bool) -> None:
        meta = dict(meta or {})
        position = meta.get("position") or {}
        row = (
            series,
            frame,
            _number(meta.get("runner_time_ms")),
            _number(meta.get("exposure_ms")),
            _number(position.get("x")),
            _number(position.get("y")),
            _number(position.get("z")),
            1.0 if stored else 0.0,
        )
        record = json.dumps(_jsonable(meta))
        with self._lock:
            self._rows.append(row)
            self._records.append(record)

    def _open_root(self, series_names: list[str]) -> None:
        import zarr

        try:
            root = zarr.open_group(self.path, mode="r")
        except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError):
            root = None
        except Exception:
            root = None
        # Only a recording of ours is replaced, and only that is offered for replacing: a folder
        # with anything else in it is refused whatever ``overwrite`` says (overwrite could not help).
        ours = root is not None and "tileshard_mmcore" in root.attrs
        if not ours and (root is not None or _holds_anything(self.path)):
            raise StoreExistsError(
                f"{self.path} exists and is not a TileShardSink recording: choose another output (it is not replaced)"
            )
        if ours and not self.overwrite:
            raise StoreExistsError(f"{self.path} already exists; pass overwrite=True to replace it")
        root = zarr.open_group(self.path, mode="a", zarr_format=3)
        root.attrs.put(
            {
                "ome": {"version": "0.5", "bioformats2raw.layout": 3},
                "pymmcore_plus": {"summary_metadata": self._summary},
                "tileshard_mmcore": {"state": "recording", "series": series_names, "axes": list(self.axes)},
            }
        )
        ome_group = root.require_group("OME")
        ome_group.attrs.put({"ome": {"version": "0.5", "series": series_names}})

    def _write_metadata(self) -> None:
        import zarr

        root = zarr.open_group(self.path, mode="a", zarr_format=3)
        rows = np.asarray(self._rows, dtype="float64").reshape(-1, len(FRAME_COLUMNS))
        table = root.create_array("frame_metadata", shape=rows.shape, dtype="float64", overwrite=True)
        table[...] = rows
        table.attrs.put({"columns": list(FRAME_COLUMNS), "frame": f"row-major index over axes {self._inner_axes}"})
        records = root.create_array("frame_metadata_json", shape=(len(self._records),), dtype=str, overwrite=True)
        if self._records:
            records[...] = np.asarray(self._records, dtype=object)
        fills = {
            s.name: {reason: sorted(f for f, r in s.fill_reasons.items() if r == reason) for reason in _REASONS}
            for s in self.series
        }
        state = "failed" if self._failure else "stopped" if self._fell_behind else "complete"
        root.attrs.update(
            {
                "tileshard_mmcore": {
                    "state": state,
                    **({"stopped": self._fell_behind} if self._fell_behind and not self._failure else {}),
                    "series": [s.name for s in self.series],
                    "axes": list(self.axes),
                    "fill_frames": fills,
                    "stats": {k: v for k, v in self.stats.__dict__.items() if k != "append_s"},
                }
            }
        )

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"{self.path}: recording failed: {self._failure}") from self._failure

    def _layout(self, inner: dict[str, int], height: int, width: int, dtype, sequence, pixel_um: float) -> Layout:
        # The first axis grows as rows complete (the series' Writer is unbounded): a run that stops
        # early (cancelled, fell behind) keeps the rows it has, and the store claims no row it never
        # wrote.  The sink still places frames by the sequence's sizes.
        names = (*inner, "y", "x")
        shape = (0, *list(inner.values())[1:], height, width) if inner else (height, width)  # one image: a plane
        base = Layout.default_for(shape, dtype, names)
        dims = []
        for dim in base.dims:
            if dim.name in ("y", "x"):
                kind, unit, scale = None, ("micrometer" if pixel_um > 0 else None), (pixel_um if pixel_um > 0 else 1.0)
            else:
                kind, unit, scale = _axis_description(dim.name, sequence)
            dims.append(
                dataclasses.replace(
                    dim,
                    tile_size=self.tile.get(dim.name, dim.tile_size),
                    tiles_per_shard=self.tiles_per_shard.get(dim.name, dim.tiles_per_shard),
                    kind=kind,
                    unit=unit,
                    scale=scale,
                )
            )
        return Layout(dims, dtype)

    def _sequence_events(self):
        return iter(self._sequence) if self._sequence is not None else iter(())


_REASONS = ("skipped", "dropped", "missing")


def _holds_anything(path: str) -> bool:
    """A local directory at ``path`` with something in it (URLs: their root zarr.json tells)."""
    if "://" in path and not path.startswith("file://"):
        return False
    local = Path(path.removeprefix("file://")).expanduser()
    try:
        return local.is_dir() and any(local.iterdir())
    except OSError:
        return False


def _bit_depth(meta, dtype: np.dtype) -> int | None:
    """The camera's bit depth (a 12-bit camera fills uint16 frames up to 4095), when recorded."""
    try:
        for device in meta["devices"]:
            if device.get("type") == "CameraDevice" or "CameraDevice" in str(device.get("type")):
                for prop in device.get("properties", ()):
                    if str(prop.get("name")).endswith("BitDepth") and prop.get("value"):
                        return int(prop["value"])
    except (TypeError, KeyError, ValueError):
        pass
    return None


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.1f} MB/s"


def _buffer_mb(meta) -> float | None:
    """pymmcore-plus's sequence (circular) buffer in MiB, from the summary metadata."""
    try:
        value = float(meta["system_info"]["sequence_buffer_size_mb"])
    except (TypeError, KeyError, ValueError):
        return None
    return value if value > 0 and math.isfinite(value) else None


def _image_info(meta) -> dict:
    try:
        return dict(meta["image_infos"][0])
    except (TypeError, KeyError, IndexError):
        raise ValueError(
            "TileShardSink needs pymmcore-plus's summary metadata (meta['image_infos'][0]) from the "
            f"engine's setup_sequence, got {meta!r}"
        ) from None


def _bounded_sizes(sequence) -> tuple[dict[str, int] | None, tuple[str, ...]]:
    """The sequence's axis sizes in axis order, or None for a generator sequence (unknown length)."""
    axis_order = tuple(getattr(sequence, "axis_order", ()) or ())
    if not axis_order or type(sequence).__name__ == "GeneratorMDASequence":
        return None, ()
    try:
        sizes = dict(sequence.sizes)
    except ZeroDivisionError:  # useq cannot size a duration-based plan with interval 0 ("as fast as possible")
        return None, ()
    return sizes, axis_order


def _series_keys(sequence, sizes: dict[str, int], axis_order: tuple[str, ...]) -> list[tuple]:
    """The (p, g) pairs of the sequence, in the order they first occur (positions with their own
    grid plans may have different grid sizes, so they are read from the events)."""
    present = [a for a in SERIES_AXES if sizes.get(a, 0) > 0]
    if not present:
        return [()]
    positions = getattr(sequence, "stage_positions", ()) or ()
    if not any(getattr(p, "sequence", None) is not None for p in positions):
        import itertools

        ordered = [a for a in axis_order if a in present]
        keys = [dict(zip(ordered, combo)) for combo in itertools.product(*(range(sizes[a]) for a in ordered))]
        return [tuple(k[a] for a in present) for k in keys]
    seen: dict[tuple, None] = {}
    for event in sequence:
        seen.setdefault(tuple(event.index.get(a, 0) for a in present), None)
    return list(seen)


def _image_names(sequence, keys: list[tuple], present: tuple[str, ...]) -> list[str | None]:
    """Each series' image name from the stage positions' names (``A1``; ``A1 g2`` for a grid
    position), None where the sequence names none; a name given twice gets the series number."""
    positions = getattr(sequence, "stage_positions", ()) or ()
    names: list[str | None] = []
    for key in keys:
        index = dict(zip(present, key))
        p = index.get("p", 0)
        name = getattr(positions[p], "name", None) if p < len(positions) else None
        if name and "g" in index:
            name = f"{name} g{index['g']}"
        names.append(str(name) if name else None)
    repeated = {n for n in names if n is not None and names.count(n) > 1}
    return [f"{n} ({k})" if n in repeated else n for k, n in enumerate(names)]


def _axis_description(axis: str, sequence) -> tuple[str | None, str | None, float]:
    if axis == "t":
        interval = getattr(getattr(sequence, "time_plan", None), "interval", None)
        seconds = interval.total_seconds() if interval is not None else 0.0
        return "time", "second", seconds if seconds > 0 else 1.0
    if axis == "c":
        return "channel", None, 1.0
    if axis == "z":
        step = getattr(getattr(sequence, "z_plan", None), "step", None)
        return "space", "micrometer", float(step) if step else 1.0
    return "other", None, 1.0


def _omero(sequence, dtype: np.dtype, bit_depth: int | None) -> dict | None:
    channels = getattr(sequence, "channels", ()) or ()
    if not channels:
        return None
    top = float(2**bit_depth - 1) if bit_depth else float(np.iinfo(dtype).max if dtype.kind in "ui" else 1.0)
    return {
        "channels": [
            {
                "label": str(ch.config),
                "active": True,
                "window": {"start": 0.0, "end": top, "min": 0.0, "max": top},
                "color": "FFFFFF",
            }
            for ch in channels
        ]
    }


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _jsonable(value: Any) -> Any:
    """pymmcore-plus metadata as JSON: pydantic models dumped, tuples as lists, the rest as text."""
    return json.loads(json.dumps(value, default=_json_default))


def _json_default(value):
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_unset=True)
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


MMCORE_SOURCE = "Micro-Manager (pymmcore-plus)"


def mmcore_available() -> bool:
    """pymmcore-plus can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("pymmcore_plus") is not None


class MDARecorder:
    """Records every MDA run on ``core`` while started, each into a store of its own: the first
    at ``output``, the next ones at ``recording-002.ome.zarr``, ... (what the recorder dock does
    with the "Micro-Manager (pymmcore-plus)" source: napari-micromanager starts the MDAs, we
    record them).  ``sink_options`` go to each :class:`TileShardSink`."""

    def __init__(self, core, output, *, on_finished: Callable[[TileShardSink], None] | None = None, **sink_options):
        check_store_path(output)
        self.core = core
        self.output = str(output)
        self.sink_options = sink_options
        self.on_finished = on_finished
        self.sinks: list[TileShardSink] = []
        self._detach: Callable[[], None] | None = None

    @property
    def sink(self) -> TileShardSink | None:
        """The sink of the current (or last) run."""
        return self.sinks[-1] if self.sinks else None

    @property
    def started(self) -> bool:
        return self._detach is not None

    def start(self) -> MDARecorder:
        if self._detach is None:
            self._detach = _connect(self.core.mda.events, self, ("sequenceStarted", "frameReady", "sequenceFinished"))
        return self

    def stop(self) -> None:
        """No later run is recorded; a run in progress is recorded to its end."""
        if self._detach is not None and not self._running():
            self._detach()
            self._detach = None
        elif self._detach is not None:
            self._stop_after_run = True

    _stop_after_run = False

    def _running(self) -> bool:
        return self.sink is not None and self.sink.recording

    def sequenceStarted(self, sequence, meta=None) -> None:  # noqa: N802

        path = self.output if not self.sinks else next_output(self.sinks[-1].path)
        sink = TileShardSink(path, core=self.core, **self.sink_options)
        self.sinks.append(sink)
        sink.setup(sequence, meta)

    def frameReady(self, img, event, meta) -> None:  # noqa: N802
        if self._running():
            self.sink.append(img, event, meta)  # type: ignore[union-attr]

    def sequenceFinished(self, sequence=None) -> None:  # noqa: N802
        sink = self.sink
        if sink is None:
            return
        sink.sequenceFinished(sequence)
        if self._stop_after_run:  # before telling anyone: a listener may ask whether we stopped
            self._stop_after_run = False
            self.stop()
        if self.on_finished is not None:
            self.on_finished(sink)


def _connect(mda_events, listener, names: tuple[str, ...]) -> Callable[[], None]:
    """Connect ``listener``'s methods to the MDA signals of the same names, called on the thread
    that emits them (the MDA thread) whether the signals are psygnal's or Qt's."""
    options: dict = {}
    if hasattr(mda_events, "metaObject"):  # Qt signals: a plain callable would be queued to the GUI thread
        from qtpy.QtCore import Qt

        options = {"type": Qt.ConnectionType.DirectConnection}
    slots = [getattr(listener, name) for name in names]
    for name, slot in zip(names, slots):
        getattr(mda_events, name).connect(slot, **options)

    def detach() -> None:
        for name, slot in zip(names, slots):
            try:
                getattr(mda_events, name).disconnect(slot)
            except (TypeError, RuntimeError, ValueError):  # already disconnected
                pass

    return detach
