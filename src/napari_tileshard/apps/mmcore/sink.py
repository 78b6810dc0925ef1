"""The pymmcore-plus data sink: one MDA into one sharded OME-Zarr collection.

:class:`TileShardSink` implements pymmcore-plus's ``SinkProtocol`` (``setup``, ``append``,
``skip``, ``close``, ``get_view``) and its frame-handler protocol (``sequenceStarted``,
``frameReady``, ``sequenceFinished``).  It is the orchestrator of its package's pieces and holds
nothing else: the :class:`~.router.EventRouter` places each event (series, frame), the
:class:`~.feeder.FrameFeeder` carries frames off the MDA thread through a bounded queue, the
:class:`~.router.ReorderBuffer` hands them to each series' Writer in frame order (fill frames for
the absent ones), the :class:`~.overflow.BufferWatch` stops the MDA before pymmcore-plus's
sequence buffer overflows, and :mod:`.metadata` describes the images and the run.

pymmcore-plus is never imported here: the sink only reads the objects it is handed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...engine.backends import gpu_unavailable_reason
from ...engine.options import EngineOptions
from ...engine.writer import Writer
from ...format.array_spec import ArraySpec
from ...format.codecs import get as get_codec
from ...format.layout import Dim, Layout
from ...format.pyramid import check_method
from ...reader.levels import open_level0
from ...storage.sinks import check_store_path
from ..recorder import POLICIES, freeze_objects, thaw_objects
from .feeder import FrameFeeder
from .metadata import (
    CameraInfo,
    FrameTable,
    finish_collection,
    image_layout,
    image_names,
    jsonable,
    omero_metadata,
    open_collection,
    refuse_existing,
)
from .overflow import BufferWatch, SinkFellBehindError
from .router import EventRouter, ReorderBuffer
from .signals import connect_on_mda_thread

__all__ = ["SinkStats", "TileShardSink"]

log = logging.getLogger(__name__)

_NO_INDEX: dict[str, int] = {}
_THREAD_POLL_S = 0.05  # how often the run-end watcher looks at the thread delivering the signals


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
class _Run:
    """The pieces of one MDA, built by ``setup`` from its sequence and summary metadata."""

    router: EventRouter  # event -> (series, frame), on the MDA thread
    reorder: ReorderBuffer  # frames in frame order into the Writers, on the feeder thread
    watch: BufferWatch  # pymmcore-plus's sequence buffer, on the MDA thread
    feeder: FrameFeeder  # the bounded queue and the feeder thread between them
    table: FrameTable  # the per-frame metadata, from both threads


def _geometry(layout: Layout) -> tuple:
    """What a warm-up prepares the GPU for: the shape and tiling, not the dims' names or scales."""
    return (layout.shape, layout.tile_shape, layout.tiles_per_shard, layout.dtype.str)


class TileShardSink:
    """A pymmcore-plus data sink writing each MDA into a sharded OME-Zarr collection.

    ``tile`` and ``tiles_per_shard`` map axis names (``t``, ``c``, ``z``, ``y``, ``x``, ...) to
    sizes; unnamed axes get the package's one default tiling (:meth:`Layout.default_for`).  ``policy``
    is what ``append`` does when ``queue_frames`` frames already wait: ``"block"`` the MDA thread
    waits, ``"drop"`` the frame is discarded and counted (it reads as the fill value).  At most
    ``reorder_frames`` frames (default ``queue_frames``) wait for the frames before them.
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
        for axis in {**(tile or {}), **(tiles_per_shard or {})}:  # the sizes, checked as every Dim's are
            Dim(axis, 0, (tile or {}).get(axis, 1), (tiles_per_shard or {}).get(axis, 1))
        check_store_path(path)  # "" would put the series at /0, /1, ...
        self.path = str(path).rstrip("/")
        if not overwrite:  # a script fails here, at once, rather than on the MDA's thread later
            refuse_existing(self.path)
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
        self._warming: threading.Thread | None = None  # the GPU warm-up attach(core) started
        self._warmed: tuple | None = None  # the geometry the GPU was last warmed up for
        self._finished = threading.Event()  # set while no run is open (close() has written everything)
        self._finished.set()
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self.stats = SinkStats()
        self.series_names: list[str] = []  # the collection's images: "0", "1", ... (one per position)
        self.writers: list[Writer] = []  # one per series
        self.axes: tuple[str, ...] = ()  # the image axes (without p/g, with y, x)
        self._run: _Run | None = None  # set by setup
        self._fell_behind: str | None = None  # why the MDA was stopped, once it was
        self._failed = False  # the run failed and said so (stats.error): later frames are ignored
        self._first_written: float | None = None  # perf_counter when the first frame reached a Writer
        self._closed = False

    @property
    def recording(self) -> bool:
        """Between ``setup`` and ``close``."""
        return self._run is not None and not self._closed

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Wait until the run's store is complete (``close`` has returned); False on timeout.

        After ``core.mda.run(sequence, output=sink)`` the store is usually complete at once;
        when pymmcore-plus's relay thread ended without handing over ``sequenceFinished``, the
        sink closes the run itself moments later: a script that reads the store at once calls
        this first."""
        return self._finished.wait(timeout)

    # -- pymmcore-plus SinkProtocol -----------------------------------------------------
    def setup(self, sequence, meta) -> None:
        """Create the collection and one Writer per series from the sequence and the summary
        metadata (``meta["image_infos"][0]``: width, height, dtype, pixel size of the camera)."""
        if self.recording:
            raise RuntimeError(f"{self.path}: this sink is already recording; close() it first")
        self._reset_run_state()
        camera = CameraInfo.from_summary(meta)
        router = EventRouter.from_sequence(sequence)
        self.axes = (*router.inner_axes, "y", "x")
        layout = image_layout(
            router.inner_sizes, camera, sequence, tile=self.tile, tiles_per_shard=self.tiles_per_shard
        )
        summary = jsonable(dict(meta or {}))
        series_names = [str(i) for i in range(router.series_count)]
        open_collection(self.path, series_names, self.axes, summary, overwrite=self.overwrite)
        omero = omero_metadata(sequence, camera.dtype, camera.bit_depth)
        names = image_names(sequence, router.keys, router.series_axes)
        series = []
        for name, image_name in zip(series_names, names):
            location = f"{self.path}/{name}"
            store = self.store_for(location) if self.store_for else location
            series.append((store, self._spec(layout, omero, image_name or name)))  # unnamed: the series path
        self.series_names = series_names
        per_series = router.frames_per_series
        reorder = ReorderBuffer(
            [per_series] * router.series_count,
            window=self.reorder_frames,
            frames_per_row=router.frames_per_row,
            deliver=self._deliver,
            fill=self._fill,
        )
        watch = BufferWatch(
            frame_bytes=camera.frame_bytes,
            frame_text=camera.description,
            buffer_mb=camera.buffer_mb,
            buffer_frames=camera.buffer_frames,
            planned_frames=None if per_series is None else per_series * router.series_count,
        )
        feeder = FrameFeeder(
            self.queue_frames,
            self.policy,
            take=self._take,
            advance=reorder.advance,
            finish=reorder.finish,
            prepare=lambda: self._arm(layout, series),
            label=self.path,
        )
        self._run = _Run(router, reorder, watch, feeder, FrameTable())
        self._finished.clear()
        freeze_objects()  # no full collection pauses the MDA thread or the feeder while frames come
        feeder.start()

    def _arm(self, layout: Layout, series: list) -> None:
        """The Writers, on the feeder thread while the first frames queue (the MDA thread does not
        wait for them): after the warm-up attach(core) started, if any, or one of this layout."""
        if self._warming is not None:
            self._warming.join()
        if _geometry(layout) != self._warmed:  # else the GPU is ready for it: nothing to wait for
            self._warm_up(layout)
        writers: list[Writer] = []
        try:
            for store, spec in series:
                writers.append(Writer(store, spec, self.options, overwrite=self.overwrite))
        except BaseException:  # the Writers already open release their stores (and locks)
            for writer in writers:
                writer.close()
            raise
        self.writers = writers

    def _warm_up(self, layout: Layout) -> None:
        """Arm the GPU (and release it again, keeping its buffers for the Writers) before frames
        reach it: the first batch of a cold GPU loads its kernels (50+ ms), which at 4 GB/s from
        the camera filled the sink's queue and overflowed pymmcore-plus's 1 GiB buffer (H100,
        2048² frames).  Takes milliseconds when the GPU is warm already."""
        if self.backend in ("gpu", "auto") and gpu_unavailable_reason() is None:
            Writer.warm_up(self._spec(layout, None), self.options)
            self._warmed = _geometry(layout)

    def warm_up(self, core, *, background: bool = False) -> None:
        """Prepare the GPU for this sink's recordings of ``core``'s camera: its CUDA context,
        kernels and buffers for frames of the camera's current size, as a time series records them
        (a sequence of another shape, z or channels say, arms its own at its start), so that a run
        started later arms at once.  ``background``: on a thread of its own (:meth:`wait_warm`);
        :meth:`attach` with a core does so.  Nothing to do with the CPU backend."""
        if background:
            self._warm_in_background(core)
            return
        if self.backend not in ("gpu", "auto") or gpu_unavailable_reason() is not None:
            return
        height, width = int(core.getImageHeight()), int(core.getImageWidth())
        dtype = {1: np.uint8, 2: np.uint16}.get(int(core.getBytesPerPixel()))
        if dtype is None or not height or not width:
            return  # a colour camera or none: nothing to guess from
        camera = CameraInfo(height=height, width=width, dtype=np.dtype(dtype))
        layout = image_layout({"t": 0}, camera, None, tile=self.tile, tiles_per_shard=self.tiles_per_shard)
        self._warm_up(layout)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up :meth:`attach` started (True once it ended, or when there is none)."""
        if self._warming is not None:
            self._warming.join(timeout)
            return not self._warming.is_alive()
        return True

    def _warm_in_background(self, core) -> None:
        if self.backend not in ("gpu", "auto") or (self._warming is not None and self._warming.is_alive()):
            return

        def warm() -> None:
            try:
                self.warm_up(core)
            except Exception as exc:  # noqa: BLE001 - only a head start: the run arms (and reports) itself
                log.debug("%s: warming the GPU up for %r failed: %s", self.path, core, exc)

        self._warming = threading.Thread(target=warm, name="tileshard-mda-warm-up", daemon=True)
        self._warming.start()

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
        run = self._run
        if run is None or self._closed:
            raise RuntimeError(f"{self.path}: append() before setup() or after close()")
        try:
            series, frame = run.router.place(getattr(event, "index", None) or _NO_INDEX)
        except ValueError as exc:
            raise ValueError(f"{self.path}: {exc}") from None
        stats = self.stats
        stats.received += 1
        feeder, watch = run.feeder, run.watch
        waiting = watch.observe(meta, queue_full=feeder.full(), received=stats.received)
        stats.max_camera_buffer = watch.max_waiting
        if waiting is not None:
            self._stop_falling_behind(watch, waiting)
        accepted = feeder.offer((series, frame, np.asarray(img), meta))
        if accepted:
            stats.max_queue = max(stats.max_queue, feeder.qsize())
        else:
            stats.dropped += 1
            run.reorder.mark_absent(series, frame, "dropped")
            run.table.add(series, frame, meta, stored=False)
        stats.append_s += time.perf_counter() - start
        return accepted

    def _stop_falling_behind(self, watch: BufferWatch, waiting: int) -> None:
        """Say why (rates, the buffer and how to raise it) and stop the MDA if the core is known."""
        message = watch.explain(
            path=self.path,
            waiting=waiting,
            received=self.stats.received,
            written=self.stats.written,
            can_stop=self.core is not None,
            writing_since=self._first_written,
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
        run = self._run
        if run is None or self._closed:
            raise RuntimeError(f"{self.path}: skip() before setup() or after close()")
        places = run.router.skip(frames)
        for series, frame in places:
            run.reorder.mark_absent(series, frame, "skipped")
        self.stats.skipped += len(places)
        if run.router.bounded:
            run.feeder.wake()  # let the feeder advance over the skipped frames now

    def close(self) -> None:
        """Write what is still queued, fill the frames that never came up to the end of their
        row, close the Writers and write the metadata.  Raises the Writer's error, if any."""
        run = self._run
        if run is None or self._closed:
            return
        try:
            self._close(run)
        finally:
            self._finished.set()

    def _close(self, run: _Run) -> None:
        try:
            run.feeder.stop()
        finally:
            thaw_objects()
        self._closed = True
        errors = []
        for writer in self.writers:
            try:
                writer.close()
            except Exception as exc:  # every Writer is closed whatever the others did
                errors.append(exc)
        try:
            self._write_metadata(run)
        except Exception as exc:
            errors.append(exc)
        failure = run.feeder.failure or (errors[0] if errors else None)
        if failure is not None:
            self.stats.error = str(failure)
            raise failure
        if self._fell_behind is not None:
            raise SinkFellBehindError(self._fell_behind)

    def get_view(self):
        """A lazy (dask) array of what is on disk now: the series stacked along a leading
        position axis when there are several of one shape, else series 0 alone."""
        if not self.series_names:
            return None
        import dask.array as da

        arrays = [da.from_zarr(open_level0(f"{self.path}/{name}")) for name in self.series_names]
        if len(arrays) > 1 and len({a.shape for a in arrays}) == 1:
            return da.stack(arrays)
        return arrays[0]

    # -- pymmcore-plus frame-handler protocol (how `output=` takes objects in 0.18) ---
    def sequenceStarted(self, sequence, meta=None) -> None:  # noqa: N802 (pymmcore-plus's signal names)
        try:
            self.setup(sequence, meta)
        except Exception as exc:  # noqa: BLE001 - said in one line and in stats.error; the MDA is stopped
            self._fail(exc)
            return
        if threading.current_thread() is not threading.main_thread():
            self._close_when_thread_ends(threading.current_thread())

    def _close_when_thread_ends(self, thread: threading.Thread) -> None:
        """Close the run if the thread that delivers its signals ends before ``sequenceFinished``.

        pymmcore-plus (0.18.1) relays ``output=`` handlers' signals through a thread whose stop
        and whose ``sequenceFinished`` are two slots of the same signal, the stop first: a relay
        that looks at its queue between the two ends without delivering ``sequenceFinished``
        (3 runs in 2,000 in a tight loop).  Unclosed, the run's last frames, its metadata and
        its feeder thread would be lost; this watcher closes it instead and says so.  It polls
        so as never to keep a finished interpreter alive."""
        run = self._run

        def watch() -> None:
            while self._run is run and not self._closed:
                if not thread.is_alive():  # (a thread Python did not start counts as alive: not watched)
                    if self._run is run and not self._closed:
                        log.warning(
                            "%s: the thread delivering the MDA's signals (%s) ended without "
                            "sequenceFinished; the recording is closed now",
                            self.path,
                            thread.name,
                        )
                        self.sequenceFinished()
                    return
                if not threading.main_thread().is_alive():
                    return  # the interpreter exits while that thread lives on: do not hold it
                time.sleep(_THREAD_POLL_S)

        threading.Thread(target=watch, name="tileshard-mda-run-end", daemon=False).start()

    def frameReady(self, img, event, meta) -> None:  # noqa: N802
        if self._failed:
            return  # said once already; the MDA is being stopped (or ends by itself)
        try:
            self.append(img, event, meta)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def sequenceFinished(self, sequence=None) -> None:  # noqa: N802
        try:
            self.close()
        except SinkFellBehindError:
            pass  # logged when it happened; in stats.error and the store's metadata
        except Exception as exc:  # noqa: BLE001
            if not self._failed:
                self._fail(exc, running=False)

    def _fail(self, exc: BaseException, running: bool = True) -> None:
        """The run failed (on the MDA thread, where an exception would end in a dump by the signal
        library and an MDA that goes on): say so in one line naming the store, keep it in
        ``stats.error``, ignore later frames and stop the MDA when the core is known."""
        text = str(exc) or type(exc).__name__
        message = text if text.startswith(self.path) else f"{self.path}: {text}"
        self._failed = True
        self.stats.error = message
        stop = running and self.core is not None
        log.error("%s%s", message, "; the MDA is stopped" if stop else "")
        log.debug("the failure in detail", exc_info=exc)
        if stop:
            try:
                self.core.mda.cancel()
            except Exception:  # noqa: BLE001 - the message stands
                log.debug("%s: could not stop the MDA", self.path, exc_info=True)

    def attach(self, mda_events) -> Callable[[], None]:
        """Connect to ``core.mda.events`` directly: every MDA started on that core is recorded,
        its frames handed over on the MDA thread itself (through the bounded queue).  Given the
        core itself (``attach(core)``), the sink can also stop its MDA when it falls behind or
        fails (``core=``), and it prepares the GPU for the core's camera at once, on a thread of
        its own (:meth:`warm_up`), so that the next run arms without delaying its first frames.
        Returns the function that disconnects again."""
        if hasattr(mda_events, "mda"):  # a CMMCorePlus / UniMMCore
            self.core = mda_events
            self._warm_in_background(mda_events)
            mda_events = mda_events.mda.events
        return connect_on_mda_thread(mda_events, self)

    # -- the feeder thread's side -----------------------------------------------------
    def _take(self, item: tuple[int, int, np.ndarray, Any]) -> None:
        run = self._run
        assert run is not None  # the feeder runs only while there is a run
        series, frame, img, meta = item
        if not run.reorder.take(series, frame, img):
            self.stats.late += 1
        run.table.add(series, frame, meta, stored=True)

    def _deliver(self, series: int, img: np.ndarray) -> None:
        self.writers[series].append(img)
        if self._first_written is None:
            self._first_written = time.perf_counter()
        self.stats.written += 1

    def _fill(self, series: int, frame: int, reason: str) -> None:
        if reason == "missing":
            self.stats.missing += 1
        writer = self.writers[series]
        layout = writer.layout
        writer.append(np.zeros(layout.shape[-2:], layout.dtype))

    def _raise_if_failed(self) -> None:
        failure = self._run.feeder.failure if self._run is not None else None
        if failure is not None:
            raise RuntimeError(f"{self.path}: recording failed: {failure}") from failure

    def _write_metadata(self, run: _Run) -> None:
        failed = run.feeder.failure is not None
        reorder = run.reorder
        finish_collection(
            self.path,
            run.table,
            inner_axes=run.router.inner_axes,
            state="failed" if failed else "stopped" if self._fell_behind else "complete",
            stopped=None if failed else self._fell_behind,
            series_names=self.series_names,
            axes=self.axes,
            fill_frames={name: reorder.fill_frames(i) for i, name in enumerate(self.series_names)},
            stats={k: v for k, v in asdict(self.stats).items() if k != "append_s"},
        )
