"""Recording every MDA run on a core, each into a store of its own (the recorder dock's
"Micro-Manager (pymmcore-plus)" source)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from ...storage.sinks import check_store_path
from ..recorder_form import next_output
from .signals import connect_on_mda_thread
from .sink import TileShardSink

__all__ = ["MMCORE_SOURCE", "MDARecorder", "mmcore_available"]

#: the recorder dock's name of this source
MMCORE_SOURCE = "Micro-Manager (pymmcore-plus)"


def mmcore_available() -> bool:
    """pymmcore-plus can be imported here (without importing it)."""
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
        self._next: TileShardSink | None = None  # the next run's sink, made (and warming up) ahead
        self._stop_after_run = False

    @property
    def sink(self) -> TileShardSink | None:
        """The sink of the current (or last) run."""
        return self.sinks[-1] if self.sinks else None

    @property
    def started(self) -> bool:
        return self._detach is not None

    def start(self) -> MDARecorder:
        """Record the runs from now on; the first run's sink prepares the GPU for the core's
        camera meanwhile, in the background (:meth:`TileShardSink.warm_up`)."""
        if self._detach is None:
            self._detach = connect_on_mda_thread(self.core.mda.events, self)
            self._next = TileShardSink(self._next_path(), core=self.core, **self.sink_options)
            self._next.warm_up(self.core, background=True)
        return self

    def _next_path(self) -> str:
        """The output, then numbered names after it; a name taken meanwhile is skipped (never
        replaced unless ``overwrite`` says so)."""
        path = self.output if not self.sinks else next_output(self.sinks[-1].path)
        if not self.sink_options.get("overwrite") and Path(path).expanduser().exists():
            path = next_output(path)
        return path

    def stop(self) -> None:
        """No later run is recorded; a run in progress is recorded to its end."""
        if self._detach is not None and not self._running():
            self._detach()
            self._detach = None
        elif self._detach is not None:
            self._stop_after_run = True

    def _running(self) -> bool:
        return self.sink is not None and self.sink.recording

    def sequenceStarted(self, sequence, meta=None) -> None:  # noqa: N802 (pymmcore-plus's signal names)
        sink, self._next = self._next, None
        if sink is None or Path(sink.path).expanduser().exists() and not self.sink_options.get("overwrite"):
            sink = TileShardSink(self._next_path(), core=self.core, **self.sink_options)
        self.sinks.append(sink)
        sink.sequenceStarted(sequence, meta)  # a failure is said in one line and stops the MDA

    def frameReady(self, img, event, meta) -> None:  # noqa: N802
        if self._running():
            self.sink.frameReady(img, event, meta)  # type: ignore[union-attr]

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
