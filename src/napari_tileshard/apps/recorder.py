"""The recording loop, free of Qt: source -> bounded queue -> Writer, with live statistics.

The napari dock (``_qt/recording_controller.py``) hosts :meth:`Recorder.run` on a QThread and
relays its callbacks as signals; scripts and the benchmarks run it on a plain thread
(``Recorder.start()``).

Sources push frames with :meth:`Recorder.push`.  The queue between source and writer is
bounded; the policy decides what happens when it is full: ``"block"`` makes the source wait
(nothing is lost), ``"drop"`` discards the frame and counts it.

An image layer is a source through :class:`LayerSource` (:meth:`Recorder.add_layer`): a *stack*
(more dims than a frame) is recorded plane by plane, once, and the recording then ends by itself;
a *live* layer (one frame, which a camera plugin keeps replacing or changing in place) records one
frame per change.  A recording that received no frame leaves no store behind.
"""

from __future__ import annotations

import gc
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.multi_writer import MultiWriter
from ..engine.options import EngineOptions
from ..engine.staging import copy_frame
from ..engine.writer import Writer, compression_ratio
from ..format.array_spec import ArraySpec
from ..format.layout import Layout
from ..format.pyramid import Pyramid, plan_pyramid
from ..storage.overwrite import overwrite_refusal
from ..storage.places import overlap, places_read_by
from .camera import SyntheticCamera

__all__ = [
    "POLICIES",
    "PREVIEW_LATENCY_S",
    "WAIT_HINT_S",
    "freeze_objects",
    "LayerSource",
    "LiveRate",
    "RecentRecordings",
    "Recorder",
    "RecorderSettings",
    "RecorderStats",
    "recent_recordings",
    "thaw_objects",
]

log = logging.getLogger(__name__)

POLICIES = ("block", "drop")
#: seconds without a frame from a live layer after which the status says the recording waits for it
WAIT_HINT_S = 3.0
#: seconds a received frame may wait in a partly filled Writer batch (EngineOptions.max_latency_s)
PREVIEW_LATENCY_S = 0.25
#: seconds over which the live rate (RecorderStats.rate_fps) is measured
RATE_WINDOW_S = 1.0
_STOP = object()


@dataclass
class RecorderSettings:
    """What to record where: the programmatic face of the dock widget."""

    output: str = "recording.zarr"
    layout: Layout | None = None
    codec: str = "zstd"
    level: int = 1
    backend: str = "auto"
    source: str = "synthetic"  # "synthetic" or the name of an image layer
    fps: float | None = 50.0  # synthetic camera rate (None = as fast as possible)
    overwrite: bool = False
    policy: str = "block"
    queue_frames: int = 64
    seed: int = 0
    batch_bytes: int | None = None  # Writer batching; default: the backend's (see engine_options())
    ome: bool = False  # OME-Zarr group with a pyramid (Writer(ome=True))
    downsample: str = "mean"
    #: several sources at once: stream (layer) name -> its Layout, recorded into one collection
    #: (:class:`~napari_tileshard.engine.multi_writer.MultiWriter`) at ``output``; ``layout`` is the first's
    streams: dict[str, Layout] | None = None

    def engine_options(self) -> EngineOptions:
        """How the recording is written: the backend's own batching (what a plain Writer gets, so
        a recording runs at the Writer's speed and the dock's warm-up arms the very buffers the
        recording takes), with received frames waiting at most :data:`PREVIEW_LATENCY_S` in a
        partly filled batch, so the preview follows a slow camera within a fraction of a second."""
        return EngineOptions(backend=self.backend, batch_bytes=self.batch_bytes, max_latency_s=PREVIEW_LATENCY_S)

    def array_spec(self, layout: Layout | None = None) -> ArraySpec:
        """What the recording writes (of ``layout``, default the main one)."""
        return ArraySpec.of(
            layout or self.checked_layout(), self.codec, self.level, ome=self.ome, downsample=self.downsample
        )

    def checked_layout(self) -> Layout:
        """``layout``, which has a default only because ``output`` comes first; TypeError without one."""
        if not isinstance(self.layout, Layout):
            raise TypeError("settings.layout must be a Layout")
        return self.layout

    def validate(self, output: bool = True) -> None:
        """Raise ValueError/TypeError naming the first bad setting (``output=False``: all but the
        output path, for a recording into a store given as an object)."""
        self.checked_layout()
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not isinstance(self.queue_frames, int) or self.queue_frames < 1:
            raise ValueError(f"queue_frames must be a positive integer, got {self.queue_frames!r}")
        if self.fps is not None and not (self.fps > 0):
            raise ValueError(f"fps must be positive or None, got {self.fps!r}")
        if self.streams is not None:
            if not isinstance(self.streams, dict) or len(self.streams) < 2:
                raise ValueError(f"streams must name at least two sources, got {self.streams!r}")
            for name, stream_layout in self.streams.items():
                if not isinstance(stream_layout, Layout):
                    raise TypeError(f"stream {name!r}: its layout must be a Layout")
                self.array_spec(stream_layout)
        self.array_spec()  # raises naming a codec, level or pyramid the layout cannot have
        self.engine_options()
        if not output:
            return
        if not str(self.output).strip():
            raise ValueError("the output path is empty")
        path = Path(self.output).expanduser()
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"output {str(path)!r} exists and is not a directory")
        if path.exists() and any(path.iterdir()) and not self.overwrite:
            raise FileExistsError(f"output {str(path)!r} already exists; choose another path or allow overwrite")
        if self.overwrite:
            refusal = overwrite_refusal(path)  # the Writer's own rule, checked before anything starts
            if refusal:
                raise FileExistsError(refusal)

    def preview_settings(self) -> RecorderSettings:
        """What the preview follows: this recording, or with several streams the first one's
        image inside the collection."""
        if not self.streams:
            return self
        from dataclasses import replace

        first = next(iter(self.streams.values()))
        return replace(self, output=str(Path(self.output).expanduser() / "0"), layout=first, streams=None)

    def pyramid(self) -> Pyramid:
        """The levels this recording writes (level 0 only without ``ome``): the Writer plans the
        same from the same settings, so the preview can follow every level without asking it."""
        layout = self.checked_layout()
        return plan_pyramid(layout, self.downsample) if self.ome else Pyramid.single(layout)


@dataclass
class RecorderStats:
    frames: int = 0
    dropped: int = 0
    queue_depth: int = 0
    bytes_in: int = 0
    bytes_out: int = 0  # every shard written, an OME pyramid's levels included
    pyramid_bytes_out: int = 0  # of those, the pyramid levels' (1, 2, ...)
    shards_written: int = 0
    rows_complete: int = 0
    #: seconds since the first frame was recorded (the clock the user sees: arming the Writer and
    #: rendering the synthetic camera's frames happen before it starts)
    elapsed_s: float = 0.0
    backend: str = ""
    error: str | None = None
    recording: bool = False
    #: frames per stream when several sources are recorded
    stream_frames: dict[str, int] = field(default_factory=dict)
    #: why the recording ended by itself (every plane of a stack recorded, ...); None after Stop
    ended: str | None = None
    #: True when nothing was recorded and the empty store this recording created was removed
    discarded: bool = False
    #: frames/s and GB/s of input over the last :data:`RATE_WINDOW_S` (0 before the first frame)
    rate_fps: float = 0.0
    rate_gbps: float = 0.0
    #: the deepest the queue between source and Writer got
    max_queue: int = 0
    #: seconds from Start until the Writer was armed (frames wait in the queue meanwhile)
    arm_s: float = 0.0
    #: where the recording thread's time went: in Writer.append (its staging copy and its waits
    #: for the pipeline included), and how long frames waited in the queue, summed over frames
    append_s: float = 0.0
    queue_wait_s: float = 0.0
    #: seconds the sources' threads spent handing frames over (a live layer's copy, the queue)
    source_s: float = 0.0

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_gbps(self) -> float:
        return self.bytes_in / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def compression_ratio(self) -> float:
        """Of the full-resolution data, as :attr:`WriterStats.compression_ratio`."""
        return compression_ratio(self.bytes_in, self.bytes_out, self.pyramid_bytes_out)


_gc_lock = threading.Lock()
_gc_holders = 0  # recordings running with the process's objects frozen
_gc_frozen_by_us = False


def freeze_objects() -> None:
    """Move every object alive now out of the garbage collector's sight (``gc.freeze``) while
    recordings run: a full collection scans them all (about a million with napari or CuPy
    loaded), and its pause of 50-150 ms held back the recording thread long enough for a 64-frame
    queue to overflow at 550 frames/s.  Objects made during the recording are collected as usual;
    :func:`thaw_objects` hands the frozen ones back when the last recording ends (the
    recorder and ``TileShardSink`` call both).  A process that
    froze objects itself is left as it is."""
    global _gc_holders, _gc_frozen_by_us
    with _gc_lock:
        if _gc_holders == 0 and gc.get_freeze_count() == 0:
            gc.freeze()
            _gc_frozen_by_us = True
        _gc_holders += 1


def thaw_objects() -> None:
    global _gc_holders, _gc_frozen_by_us
    with _gc_lock:
        _gc_holders -= 1
        if _gc_holders == 0 and _gc_frozen_by_us:
            gc.unfreeze()
            _gc_frozen_by_us = False


class LiveRate:
    """Frames/s and bytes/s over the last ``window_s`` seconds of a count that grows (sampled at
    most every ``every_s``): what a status line shows while recording, rather than the average
    since the start."""

    def __init__(self, window_s: float = RATE_WINDOW_S, every_s: float = 0.05):
        self.window_s, self.every_s = window_s, every_s
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, frames, bytes)

    def sample(self, now: float, frames: int, nbytes: int) -> tuple[float, float] | None:
        """The counts at ``now`` (seconds); returns (frames/s, bytes/s) over the window, or None
        when this sample came too soon after the last one to be taken."""
        samples = self._samples
        if samples and now - samples[-1][0] < self.every_s:
            return None
        samples.append((now, frames, nbytes))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        then, frames_then, bytes_then = samples[0]
        if now <= then:
            return None
        return (frames - frames_then) / (now - then), (nbytes - bytes_then) / (now - then)


class RecentRecordings:
    """The stores recorded in this session, most recent first: the shard inspector offers them."""

    def __init__(self, keep: int = 20):
        self.keep = keep
        self._paths: list[str] = []
        self._lock = threading.Lock()

    def add(self, path) -> None:
        text = str(path)
        with self._lock:
            self._paths = [text] + [p for p in self._paths if p != text][: self.keep - 1]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._paths))

    def __len__(self) -> int:
        return len(self._paths)


#: this process's recordings (the recorder dock's, MDA runs', scripts' Recorder runs)
recent_recordings = RecentRecordings()


def _same_frame(a: np.ndarray, b: np.ndarray, block_bytes: int = 1 << 20) -> bool:
    """Whether two frames hold the same values; compared block by block, so a changed frame (the
    usual case: a camera's noise differs everywhere) is told apart after the first block."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    step = max(1, block_bytes // max(1, a.itemsize))
    equal_nan = a.dtype.kind in "fc"
    return all(
        np.array_equal(flat_a[i : i + step], flat_b[i : i + step], equal_nan=equal_nan)
        for i in range(0, flat_a.size, step)
    )


def refuse_recording_over_its_source(layer, output) -> None:
    """ValueError when ``output`` is where ``layer`` reads its frames from (a store opened in
    napari, recorded into itself with overwrite would be deleted while it is read), in any
    spelling (:func:`~napari_tileshard.storage.places.overlap`)."""
    for place in places_read_by(layer):
        how = overlap(place, output)
        if how:
            raise ValueError(
                f"layer {getattr(layer, 'name', 'layer')!r} is read from {place}, and the output {str(output)!r} "
                f"{how.replace('the source', 'that store')}: recording there would overwrite the frames being "
                "recorded; choose another output"
            )


class LayerSource:
    """The frames of an image layer (a napari layer, or anything with ``data`` and ``name``).

    A layer with more dims than a frame is a *stack*: :meth:`feed` (on a thread of its own) records
    each plane once, in the order of its leading dims, and then the source is done; changes to the
    layer meanwhile are not recorded.  A layer of one frame is *live*: a camera plugin replaces its
    data (:meth:`assigned`: napari's ``data`` event) or changes it in place and refreshes it
    (:meth:`refreshed`: napari's ``set_data`` event, which ``layer.refresh()`` emits), and each
    change records one frame.  napari emits ``set_data`` inside an assignment too (before ``data``),
    and when nothing changed (the layer shown again, re-sliced, re-scaled): a refresh records only a
    frame that differs from the last one recorded, and an assignment only an array other than the
    one just recorded (a new array of the same values is a new frame; the same array is one if it
    was changed in place).

    Raises ValueError naming the layer when its frames cannot fit the recording's layout.
    """

    def __init__(self, recorder: Recorder, layer, stream: str | None = None):
        self.recorder, self.layer, self.stream = recorder, layer, stream
        self.name = str(getattr(layer, "name", "layer"))
        layout = recorder.layout_of(stream)
        frame_shape = tuple(layout.frame_shape)
        shape = tuple(np.shape(layer.data))
        if getattr(layer, "rgb", False):
            raise ValueError(f"layer {self.name!r} is RGB; record its channels as a grey image layer")
        if len(shape) < len(frame_shape) or shape[len(shape) - len(frame_shape) :] != frame_shape:
            raise ValueError(f"layer {self.name!r} has data of shape {shape}; frames of {frame_shape} are recorded")
        leading = shape[: len(shape) - len(frame_shape)]
        #: planes of a stack (in the order of its leading dims); None for a live layer
        self.planes: int | None = math.prod(leading) if leading else None
        if self.planes is not None and not layout.unbounded:
            capacity = math.prod(layout.shape) // max(1, layout.frame_elements)
            if self.planes > capacity:
                raise ValueError(
                    f"layer {self.name!r} holds {self.planes} planes but the dimensions {layout.shape} hold "
                    f"{capacity} frames; make the first dimension larger or unbounded (0)"
                )
        self.recorded = 0
        self.done = False
        self.started_at: float | None = None
        self.last_frame_at: float | None = None
        # A live layer's frame at Start is what it showed before: the baseline of "changed", not a frame.
        self._last: np.ndarray | None = None if self.planes is not None else np.array(layer.data, copy=True)
        self._last_source = layer.data  # the array ``_last`` was copied from
        self._thread: threading.Thread | None = None

    @property
    def is_stack(self) -> bool:
        return self.planes is not None

    def start(self) -> None:
        """From now on changes count (and a stack is fed, on a thread of its own)."""
        self.started_at = time.monotonic()
        if self.is_stack:
            self._thread = threading.Thread(target=self.feed, name=f"tileshard-stack-{self.name}", daemon=True)
            self._thread.start()

    def feed(self) -> None:
        """Push every plane of the stack in order (waiting for room in the queue whatever the policy:
        a stack in memory is not a camera that cannot wait), then report the source done."""
        data = self.layer.data  # the stack as it is at Start
        frame_rank = len(self.recorder.layout_of(self.stream).frame_shape)
        leading = tuple(np.shape(data))[: np.ndim(data) - frame_rank]
        complete = True
        for index in np.ndindex(*leading):
            plane = np.array(data[index], copy=True)  # a view would change with the layer; dask computes here
            if not self.recorder.push(plane, self.stream, wait=True):
                complete = False  # stopped
                break
            self.recorded += 1
            self.last_frame_at = time.monotonic()
        self.done = complete
        if complete:
            self.recorder.source_done(self)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def assigned(self, event=None) -> None:
        """The layer's data was replaced (napari's ``data`` event): record the new frame, unless
        the refresh within the same assignment recorded this array already."""
        if self.is_stack:
            return
        data = self.layer.data
        if data is self._last_source and self._last is not None and _same_frame(np.asarray(data), self._last):
            return
        self._record(data)

    def refreshed(self, event=None) -> None:
        """The layer was redrawn (``set_data``): record its frame if it differs from the last one."""
        if self.is_stack:
            return
        data = self.layer.data
        if self._last is not None and _same_frame(np.asarray(data), self._last):
            return
        self._record(data)

    def _record(self, data) -> None:
        started = time.perf_counter()
        # A copy: the camera plugin may reuse its buffer for the next frame (on several threads:
        # a 2304x2304 frame by one took 2 ms of napari's thread at 550 frames/s).
        frame = copy_frame(data)
        self._last, self._last_source = frame, data
        if self.recorder.push(frame, self.stream):
            self.recorded += 1
            self.last_frame_at = time.monotonic()
        self.recorder.stats.source_s += time.perf_counter() - started

    def status(self, now: float | None = None) -> str | None:
        """A stack's progress; for a live layer that has not changed for :data:`WAIT_HINT_S`, that
        the recording waits for it (and what makes a frame); None otherwise."""
        if self.is_stack:
            return f"layer {self.name!r}: {self.recorded} of {self.planes} planes"
        since = self.last_frame_at or self.started_at
        if since is None:
            return None
        idle = (time.monotonic() if now is None else now) - since
        if idle < WAIT_HINT_S:
            return None
        return (
            f"waiting for layer {self.name!r} to change (nothing for {idle:.0f} s): a new image set on it, "
            "or refresh() after changing it in place, records a frame"
        )


@dataclass
class Recorder:
    """One recording: a Writer fed from a bounded queue on the thread that calls :meth:`run`.

    :meth:`run` arms the Writer first; the synthetic camera renders its frames meanwhile and
    starts delivering only once the Writer is armed, so neither counts on the recording's clock
    (``stats.elapsed_s`` runs from the first frame) nor makes a fast camera drop frames at the
    start.  Frames of other sources wait in the queue until then.

    ``store``: where the Writer writes instead of ``settings.output`` (a
    :class:`~napari_tileshard.storage.sinks.Sink` or a zarr store: a benchmark's sink that
    discards, a test's faulty one); one stream only.
    """

    settings: RecorderSettings
    on_progress: Callable[[RecorderStats], None] | None = None  # called when shard epochs complete
    on_finished: Callable[[RecorderStats], None] | None = None
    stats: RecorderStats = field(default_factory=RecorderStats)
    store: Any = None

    def __post_init__(self):
        self.settings.validate(output=self.store is None)
        if self.store is not None and self.settings.streams:
            raise ValueError("a store object takes one stream; several streams are recorded into settings.output")
        self._queue: queue.Queue = queue.Queue(maxsize=self.settings.queue_frames)
        self._stopping = threading.Event()
        self._armed = threading.Event()
        self._thread: threading.Thread | None = None
        self._feeder: threading.Thread | None = None
        self.writer: Writer | None = None
        self.multi = None  # the MultiWriter of several streams
        self._first_frame_at: float | None = None  # perf_counter when the first frame recorded was pushed
        self._rate = LiveRate()
        self._frozen = False  # this recording keeps the process's older objects out of the collector's sight
        #: the image layers recorded (:meth:`add_layer`)
        self.sources: list[LayerSource] = []

    # -- source side -------------------------------------------------------------------
    def layout_of(self, stream: str | None = None) -> Layout:
        """The layout frames of ``stream`` are recorded into (the one layout without streams)."""
        if self.settings.streams:
            if stream not in self.settings.streams:
                raise ValueError(f"stream {stream!r} is not one of {', '.join(map(repr, self.settings.streams))}")
            return self.settings.streams[stream]
        return self.settings.checked_layout()

    def add_layer(self, layer, stream: str | None = None) -> LayerSource:
        """Record ``layer`` (into ``stream`` when several are recorded) once started: see
        :class:`LayerSource`.  Raises ValueError naming the layer when its frames don't fit."""
        refuse_recording_over_its_source(layer, self.settings.output)
        source = LayerSource(self, layer, stream)
        self.sources.append(source)
        return source

    def source_done(self, source: LayerSource) -> None:
        """A stack was recorded to its last plane; once every source is such a finished stack the
        recording ends by itself (a live layer keeps it going until Stop)."""
        if all(s.is_stack and s.done for s in self.sources):
            self.stop(ended="; ".join(f"all {s.planes} planes of layer {s.name!r} were recorded" for s in self.sources))

    def hint(self, now: float | None = None) -> str | None:
        """What the sources report (a stack's progress, a live layer that has not changed for a
        while), for the status line; None when there is nothing to say."""
        notes = [note for note in (source.status(now) for source in self.sources) if note]
        return "; ".join(notes) or None

    def push(self, frame: np.ndarray, stream: str | None = None, wait: bool | None = None) -> bool:
        """Offer one frame (of ``stream`` when several are recorded); returns False if it was
        dropped (drop policy, queue full) or stopped.  ``wait``: wait for room in the queue (True)
        or drop (False) instead of what the policy says."""
        if self._stopping.is_set():
            return False
        if self.settings.streams:
            self.layout_of(stream)  # raises naming the streams
        item = (stream, frame, time.perf_counter())
        if wait is False or (wait is None and self.settings.policy == "drop"):
            try:
                self._queue.put_nowait(item)
                return True
            except queue.Full:
                self.stats.dropped += 1
                return False
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def feed_synthetic(self, frames: int | None = None) -> None:
        """Push SyntheticCamera frames at ``settings.fps`` (runs on its own thread via start()).

        The camera renders its frame bank (on several threads, while :meth:`run` arms the Writer)
        and waits for the Writer before its first frame: the pace it keeps starts then."""
        layout = self.settings.checked_layout()
        camera = SyntheticCamera(
            layout.frame_shape or (1,), layout.dtype, seed=self.settings.seed, fps=self.settings.fps
        )
        camera.prepare()
        if not self.wait_armed():
            return
        shape, push, stats, perf_counter = layout.frame_shape, self.push, self.stats, time.perf_counter
        for frame in camera.frames(frames):
            if self._stopping.is_set():
                break
            handed = perf_counter()
            push(frame.reshape(shape))
            stats.source_s += perf_counter() - handed
        else:
            self.stop(ended=f"the synthetic camera's {frames} frames were recorded")

    def wait_armed(self, timeout: float | None = None) -> bool:
        """Wait until the Writer is armed (True), or the recording stopped or failed before (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._armed.wait(0.1):
            if self._stopping.is_set() or (deadline is not None and time.monotonic() > deadline):
                return False
        return self.writer is not None and not self._stopping.is_set()

    @property
    def armed(self) -> bool:
        """The Writer is open: frames go to the store from now on."""
        return self._armed.is_set() and self.writer is not None

    # -- writer side -------------------------------------------------------------------
    def _arm(self) -> None:
        s = self.settings
        options = s.engine_options()
        if s.streams:
            streams = {name: s.array_spec(layout) for name, layout in s.streams.items()}
            self.multi = MultiWriter(s.output, streams, options, overwrite=s.overwrite)
            self.writer = self.multi[next(iter(s.streams))]  # the first stream's: the preview's
        else:
            store = self.store if self.store is not None else s.output
            self.writer = Writer(store, s.array_spec(), options, overwrite=s.overwrite)
        self.stats.backend = self.writer.stats.backend

    def run(self) -> RecorderStats:
        """The recording loop: arm the Writer, then drain the queue into it until stop(); always finalizes."""
        stats = self.stats
        stats.recording = True
        started = time.perf_counter()
        try:
            try:
                self._arm()
                freeze_objects()
                self._frozen = True
            finally:
                stats.arm_s = time.perf_counter() - started
                self._armed.set()  # sources waiting for the Writer go on (or see the failure)
            get, perf_counter, multi = self._queue.get, time.perf_counter, self.multi
            append = self.writer.append  # type: ignore[union-attr]
            while True:
                try:
                    item = get(timeout=0.05)
                except queue.Empty:
                    if self._stopping.is_set():
                        break
                    self._update(perf_counter())
                    continue
                if item is _STOP:
                    break
                stream, frame, pushed_at = item
                taken = perf_counter()
                if self._first_frame_at is None:
                    self._first_frame_at = pushed_at
                if multi is not None:
                    multi.append(stream, frame)
                    stats.stream_frames[stream] = stats.stream_frames.get(stream, 0) + 1
                else:
                    append(frame)
                done = perf_counter()
                stats.append_s += done - taken
                stats.queue_wait_s += taken - pushed_at
                stats.frames += 1
                self._update(done)
        except Exception as exc:  # noqa: BLE001 - reported through stats/on_finished, never raised into Qt
            log.exception("recording to %s failed", self.writer.location if self.writer else self.settings.output)
            stats.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._stopping.set()
            self._finalize()
        return stats

    def _finalize(self) -> None:
        closing = self.multi if self.multi is not None else self.writer
        if closing is not None:
            try:
                if self.stats.frames == 0 and self.stats.error is None:
                    # Nothing arrived: an empty array marked complete would read as a recording
                    # that took place.  The store this recording made goes again (an existing
                    # store replaced under ``overwrite`` was replaced at Start already).
                    closing.abandon()
                    self.stats.discarded = True
                else:
                    closing.close()
            except Exception as exc:  # noqa: BLE001
                if self.stats.error is None:
                    self.stats.error = f"{type(exc).__name__}: {exc}"
        if self.stats.frames and closing is not None and self.store is None:
            recent_recordings.add(self.settings.output)
        self._update(time.perf_counter(), final=True)
        if self._frozen:
            self._frozen = False
            thaw_objects()
        self.stats.recording = False
        if self.on_finished:
            self.on_finished(self.stats)

    def _update(self, now: float, final: bool = False) -> None:
        stats = self.stats
        if self._first_frame_at is not None and not final:  # the final state keeps the recording's clock
            stats.elapsed_s = now - self._first_frame_at
        depth = self._queue.qsize()
        stats.queue_depth = depth
        if depth > stats.max_queue:
            stats.max_queue = depth
        if self.writer is not None:
            every = list(self.multi.stats.values()) if self.multi is not None else [self.writer.stats]
            stats.bytes_in = sum(w.bytes_in for w in every)
            stats.bytes_out = sum(w.bytes_out for w in every)
            stats.pyramid_bytes_out = sum(w.pyramid_bytes_out for w in every)
            stats.shards_written = sum(w.shards_written for w in every)
            self._measure_rate(now)
            rows = self.writer.stats.rows_complete  # the first stream's: what the preview shows
            if rows != stats.rows_complete:
                stats.rows_complete = rows
                if self.on_progress:
                    self.on_progress(stats)

    def _measure_rate(self, now: float) -> None:
        stats = self.stats
        rate = self._rate.sample(now, stats.frames, stats.bytes_in)
        if rate is not None:
            stats.rate_fps, bytes_per_s = rate
            stats.rate_gbps = bytes_per_s / 1e9

    # -- control ---------------------------------------------------------------------
    def start(self, synthetic_frames: int | None = None) -> Recorder:
        """Run headless: the loop on a thread, and the sources (:meth:`start_sources`)."""
        self._thread = threading.Thread(target=self.run, name="tileshard-recorder", daemon=True)
        self._thread.start()
        self.start_sources(synthetic_frames)
        return self

    def start_sources(self, synthetic_frames: int | None = None) -> None:
        """Start the layers added (:meth:`add_layer`), or without any the synthetic camera (on a
        thread of its own) if it is the source."""
        if self.sources:
            for source in self.sources:
                source.start()
        elif self.settings.source == "synthetic":
            self._feeder = threading.Thread(
                target=self.feed_synthetic, args=(synthetic_frames,), name="tileshard-camera", daemon=True
            )
            self._feeder.start()

    def stop(self, ended: str | None = None) -> None:
        """Ask the loop to finish: frames already queued are written, then the store is finalized.
        ``ended``: why the recording ends by itself (kept in ``stats.ended``; None for a Stop)."""
        if not self._stopping.is_set():
            self.stats.ended = ended
            self._stopping.set()
            try:
                self._queue.put_nowait(_STOP)
            except queue.Full:
                pass  # the loop sees _stopping once the queue drains

    def join(self, timeout: float | None = None) -> RecorderStats:
        for source in self.sources:
            source.join(timeout)
        for thread in (self._feeder, self._thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        return self.stats

    @property
    def is_recording(self) -> bool:
        return self.stats.recording
