"""Start and stop one recording: the Qt-free :class:`~napari_tileshard.apps.recorder.Recorder` on a
QThread, frames from image layers (:class:`~napari_tileshard.apps.recorder.LayerSource`, wired to
the layers' napari events here) or the synthetic camera, and finalisation of the store however the
recording ends (Stop, a stack recorded to its end, an error, the dock or the whole viewer closing).
"""

from __future__ import annotations

from dataclasses import replace

from qtpy.QtCore import QEvent, QObject, QThread, Signal

from ..apps.preview import PreviewReader
from ..apps.recorder import LayerSource, Recorder, RecorderSettings, RecorderStats

__all__ = ["RecordingController"]


class _RecorderThread(QThread):
    """Runs :meth:`Recorder.run` and relays its callbacks as signals.

    On progress the newest complete frame of every level is read back from the store for the
    preview by a :class:`~napari_tileshard.apps.preview.PreviewReader` — on a reader thread of its
    own, never on the recording thread (a slow read must not hold back frames) nor on the GUI
    thread (no tile decoding on the event loop); it skips to the newest progress when reads are
    slower than shard epochs complete.
    """

    progress = Signal(object, object, object)  # stats, [(row, frame) per level] or None, row 0 likewise
    finished_recording = Signal(object)  # stats

    def __init__(self, recorder: Recorder, parent=None):
        super().__init__(parent)
        self.recorder = recorder
        settings = recorder.settings.preview_settings()  # several streams: the first one's image
        self._reader = PreviewReader(settings.output, settings.pyramid(), settings.ome, self.progress.emit)
        recorder.on_progress = self._progress
        recorder.on_finished = self._finished

    def _progress(self, stats: RecorderStats) -> None:
        self._reader.note(replace(stats), stats.rows_complete)  # the recording thread only leaves a note

    def _finished(self, stats: RecorderStats) -> None:
        self._reader.finish()  # the final state is shown from the finalized store
        self.finished_recording.emit(stats)

    def run(self) -> None:
        self._reader.start()
        self.recorder.run()


class RecordingController(QObject):
    """Owns the recording in progress; everything it reports arrives on the GUI thread.

    ``starting(settings)`` is emitted synchronously before any frame is taken (the preview
    creates its layer then, on the click rather than mid-recording), ``progress(stats, newest, first)``
    per completed shard epoch, and ``finished(stats)`` once the store is finalized and the thread
    has ended.
    """

    starting = Signal(object)
    progress = Signal(object, object, object)
    finished = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._recorder: Recorder | None = None
        self._thread: _RecorderThread | None = None
        self._sources: list[LayerSource] = []  # the layers being recorded, their events connected
        self._active = False
        self._finalizing = None
        self._last_stats = RecorderStats()
        self._watched_window = None

    @property
    def is_recording(self) -> bool:
        """True from start() until the store is finalized and ``finished`` has been emitted."""
        return self._active

    @property
    def stats(self) -> RecorderStats:
        return self._recorder.stats if self._recorder is not None else self._last_stats

    def start(self, settings: RecorderSettings, source_layer=None, stream_layers=None) -> None:
        """Record ``settings`` from ``source_layer`` (None: the synthetic camera), or with
        ``settings.streams`` from ``stream_layers`` (stream name -> image layer), each into its
        own array of the collection.

        Raises ValueError, TypeError or OSError, before anything starts, when the Recorder refuses
        the settings or a layer cannot be recorded with them.
        """
        if self._active:
            return
        recorder = Recorder(settings)
        if settings.streams:
            for name in settings.streams:
                layer = (stream_layers or {}).get(name)
                if layer is None:
                    raise ValueError(f"layer {name!r} is gone")
                recorder.add_layer(layer, name)
        elif source_layer is not None:
            recorder.add_layer(source_layer)
        elif settings.source != "synthetic":
            raise ValueError(f"layer {settings.source!r} is gone")
        self._recorder = recorder
        self._thread = _RecorderThread(recorder, self)
        self._thread.progress.connect(self.progress)
        self._thread.finished_recording.connect(self._on_finished)
        self._active = True
        self.starting.emit(settings)
        self._thread.start()
        for source in recorder.sources:
            if not source.is_stack:  # a live layer: each change is a frame
                source.layer.events.data.connect(source.assigned)
                source.layer.events.set_data.connect(source.refreshed)
                self._sources.append(source)
        recorder.start_sources()

    @property
    def layer_sources(self) -> list[LayerSource]:
        """The layers the current (or last) recording took its frames from."""
        return list(self._recorder.sources) if self._recorder is not None else []

    def hint(self) -> str | None:
        """What the sources of the recording in progress report (see ``Recorder.hint``)."""
        return self._recorder.hint() if self._recorder is not None and self._active else None

    def _disconnect_source(self) -> None:
        for source in self._sources:
            source.layer.events.data.disconnect(source.assigned)
            source.layer.events.set_data.disconnect(source.refreshed)
        self._sources = []

    def stop(self, wait: bool = False) -> None:
        """Ask the recording to finish; with ``wait``, return once the store is finalized."""
        recorder, thread = self._recorder, self._thread
        if recorder is None or thread is None or not self._active:
            return
        self._disconnect_source()
        recorder.stop()
        if self._finalizing is None:
            from napari.utils import progress

            self._finalizing = progress(total=0, desc="finalizing recording")
        if wait:
            thread.wait()
            from qtpy.QtWidgets import QApplication

            QApplication.processEvents()  # delivers finished_recording -> _on_finished
            if self._active:  # the signal could not be delivered (e.g. the viewer is closing)
                self._on_finished(recorder.stats)

    def _on_finished(self, stats: RecorderStats) -> None:
        if not self._active:
            return  # already taken by stop(wait=True)
        self._disconnect_source()
        if self._thread is not None:
            self._thread.wait()
        self._active = False
        self._last_stats = stats
        if self._finalizing is not None:
            self._finalizing.close()
            self._finalizing = None
        self.finished.emit(stats)

    # -- the viewer closing ------------------------------------------------------------
    def watch(self, window) -> None:
        """Finalize the recording before ``window`` (the viewer's main window) closes."""
        if window is not None and window is not self._watched_window:
            window.installEventFilter(self)
            self._watched_window = window

    def eventFilter(self, obj: QObject | None, event: QEvent | None) -> bool:
        if event is not None and event.type() == QEvent.Type.Close:
            self.stop(wait=True)
        return False
