"""The recording loop, free of Qt: source -> bounded queue -> Writer, with live statistics.

The napari dock (``_qt/recording_controller.py``) hosts :meth:`Recorder.run` on a QThread and
relays its callbacks as signals; scripts and the benchmarks run it on a plain thread
(``Recorder.start()``).

Sources push frames with :meth:`Recorder.push`.  The queue between source and writer is
bounded; the policy decides what happens when it is full: ``"block"`` makes the source wait
(nothing is lost), ``"drop"`` discards the frame and counts it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..engine.multi_writer import MultiWriter
from ..engine.options import EngineOptions
from ..engine.writer import Writer
from ..format.array_spec import ArraySpec
from ..format.layout import Layout
from ..format.pyramid import Pyramid, plan_pyramid
from ..storage.overwrite import overwrite_refusal
from .camera import SyntheticCamera

log = logging.getLogger(__name__)

POLICIES = ("block", "drop")
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
    batch_bytes: int | None = None  # Writer batching; default: about 1/4 s of frames (see batch())
    ome: bool = False  # OME-Zarr group with a pyramid (Writer(ome=True))
    downsample: str = "mean"
    #: several sources at once: stream (layer) name -> its Layout, recorded into one collection
    #: (:class:`~napari_tileshard.engine.multi_writer.MultiWriter`) at ``output``; ``layout`` is the first's
    streams: dict[str, Layout] | None = None

    def batch(self) -> int:
        """Bytes per Writer batch: ~0.25 s of input at ``fps`` (at least one tile epoch), so the
        preview follows within a fraction of a second at low rates and the GPU still gets large
        batches at high rates; one tile epoch when the rate is unknown (a layer source)."""
        if self.batch_bytes:
            return self.batch_bytes
        layout = self.checked_layout()
        frame_bytes = layout.frame_elements * layout.itemsize
        return max(layout.epoch_bytes, int(frame_bytes * self.fps / 4)) if self.fps else layout.epoch_bytes

    def array_spec(self, layout: Layout | None = None) -> ArraySpec:
        """What the recording writes (of ``layout``, default the main one)."""
        return ArraySpec.of(
            layout or self.checked_layout(), self.codec, self.level, ome=self.ome, downsample=self.downsample
        )

    def engine_options(self) -> EngineOptions:
        """How the recording is written."""
        return EngineOptions(backend=self.backend, batch_bytes=self.batch())

    def checked_layout(self) -> Layout:
        """``layout``, which has a default only because ``output`` comes first; TypeError without one."""
        if not isinstance(self.layout, Layout):
            raise TypeError("settings.layout must be a Layout")
        return self.layout

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the first bad setting."""
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
    bytes_out: int = 0
    shards_written: int = 0
    rows_complete: int = 0
    elapsed_s: float = 0.0
    backend: str = ""
    error: str | None = None
    recording: bool = False
    #: frames per stream when several sources are recorded
    stream_frames: dict[str, int] = field(default_factory=dict)

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_gbps(self) -> float:
        return self.bytes_in / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else float("nan")


@dataclass
class Recorder:
    """One recording: a Writer fed from a bounded queue on the thread that calls :meth:`run`."""

    settings: RecorderSettings
    on_progress: Callable[[RecorderStats], None] | None = None  # called when shard epochs complete
    on_finished: Callable[[RecorderStats], None] | None = None
    stats: RecorderStats = field(default_factory=RecorderStats)

    def __post_init__(self):
        self.settings.validate()
        self._queue: queue.Queue = queue.Queue(maxsize=self.settings.queue_frames)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._feeder: threading.Thread | None = None
        self.writer: Writer | None = None
        self.multi = None  # the MultiWriter of several streams
        self._start: float = 0.0

    # -- source side -------------------------------------------------------------------
    def push(self, frame: np.ndarray, stream: str | None = None) -> bool:
        """Offer one frame (of ``stream`` when several are recorded); returns False if it was
        dropped (drop policy, queue full) or stopped."""
        if self._stopping.is_set():
            return False
        if self.settings.streams:
            if stream not in self.settings.streams:
                raise ValueError(f"stream {stream!r} is not one of {', '.join(map(repr, self.settings.streams))}")
            frame = (stream, frame)  # type: ignore[assignment]
        if self.settings.policy == "drop":
            try:
                self._queue.put_nowait(frame)
                return True
            except queue.Full:
                self.stats.dropped += 1
                return False
        while not self._stopping.is_set():
            try:
                self._queue.put(frame, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def feed_synthetic(self, frames: int | None = None) -> None:
        """Push SyntheticCamera frames at ``settings.fps`` (runs on its own thread via start())."""
        layout = self.settings.checked_layout()
        camera = SyntheticCamera(
            layout.frame_shape or (1,), layout.dtype, seed=self.settings.seed, fps=self.settings.fps
        )
        camera.prepare()
        for frame in camera.frames(frames):
            if self._stopping.is_set():
                break
            self.push(frame.reshape(layout.frame_shape))
        else:
            self.stop()

    # -- writer side -------------------------------------------------------------------
    def run(self) -> RecorderStats:
        """The recording loop: drain the queue into the Writer until stop(); always finalizes."""
        s = self.settings
        self.stats.recording = True
        self._start = time.perf_counter()
        try:
            options = s.engine_options()
            if s.streams:
                streams = {name: s.array_spec(layout) for name, layout in s.streams.items()}
                self.multi = MultiWriter(s.output, streams, options, overwrite=s.overwrite)
                self.writer = self.multi[next(iter(s.streams))]  # the first stream's: the preview's
            else:
                self.writer = Writer(s.output, s.array_spec(), options, overwrite=s.overwrite)
            self.stats.backend = self.writer.stats.backend
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stopping.is_set():
                        break
                    self._update()
                    continue
                if item is _STOP:
                    break
                if self.multi is not None:
                    name, frame = item
                    self.multi.append(name, frame)
                    self.stats.stream_frames[name] = self.stats.stream_frames.get(name, 0) + 1
                else:
                    self.writer.append(item)
                self.stats.frames += 1
                self._update()
        except Exception as exc:  # noqa: BLE001 - reported through stats/on_finished, never raised into Qt
            log.exception("recording to %s failed", s.output)
            self.stats.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._stopping.set()
            self._finalize()
        return self.stats

    def _finalize(self) -> None:
        closing = self.multi if self.multi is not None else self.writer
        if closing is not None:
            try:
                closing.close()
            except Exception as exc:  # noqa: BLE001
                if self.stats.error is None:
                    self.stats.error = f"{type(exc).__name__}: {exc}"
        self._update(final=True)
        self.stats.recording = False
        if self.on_finished:
            self.on_finished(self.stats)

    def _update(self, final: bool = False) -> None:
        stats = self.stats
        stats.elapsed_s = time.perf_counter() - self._start
        stats.queue_depth = self._queue.qsize()
        if self.writer is not None:
            every = list(self.multi.stats.values()) if self.multi is not None else [self.writer.stats]
            stats.bytes_in = sum(w.bytes_in for w in every)
            stats.bytes_out = sum(w.bytes_out for w in every)
            stats.shards_written = sum(w.shards_written for w in every)
            rows = self.writer.stats.rows_complete  # the first stream's: what the preview shows
            if rows != stats.rows_complete:
                stats.rows_complete = rows
                if self.on_progress:
                    self.on_progress(stats)

    # -- control ---------------------------------------------------------------------
    def start(self, synthetic_frames: int | None = None) -> Recorder:
        """Run headless: the loop on a thread, and the synthetic camera on another if selected."""
        self._thread = threading.Thread(target=self.run, name="tileshard-recorder", daemon=True)
        self._thread.start()
        if self.settings.source == "synthetic":
            self._feeder = threading.Thread(
                target=self.feed_synthetic, args=(synthetic_frames,), name="tileshard-camera", daemon=True
            )
            self._feeder.start()
        return self

    def stop(self) -> None:
        """Ask the loop to finish: frames already queued are written, then the store is finalized."""
        if not self._stopping.is_set():
            self._stopping.set()
            try:
                self._queue.put_nowait(_STOP)
            except queue.Full:
                pass  # the loop sees _stopping once the queue drains

    def join(self, timeout: float | None = None) -> RecorderStats:
        for thread in (self._feeder, self._thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
        return self.stats

    @property
    def is_recording(self) -> bool:
        return self.stats.recording
