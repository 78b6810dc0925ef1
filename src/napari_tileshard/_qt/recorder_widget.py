"""The "Tile/Shard Recorder" dock widget: composes the settings form, the recording controller
and the preview layer, and adds the Start/Stop/Inspect buttons and the live statistics.

    SettingsForm (settings_form.py)  --settings-->  RecordingController (recording_controller.py)
                                                      | starting / progress / finished
                                                      v
                                                    PreviewLayer (preview_layer.py)

The recording loop itself is :class:`napari_tileshard.apps.recorder.Recorder`, free of Qt.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path

from qtpy.QtCore import QEvent, QTimer, Signal
from qtpy.QtWidgets import QHBoxLayout, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from ..apps.camera import SyntheticCamera
from ..apps.mmcore import MMCORE_SOURCE, MDARecorder
from ..apps.recorder import RecorderSettings, RecorderStats, recent_recordings
from ..apps.recorder_form import next_output, with_tiling_notes
from ..engine.writer import Writer
from .inspector_widget import InspectorWidget
from .labels import WrappedLabel
from .preview_layer import PreviewLayer
from .recording_controller import RecordingController
from .settings_form import SettingsForm

__all__ = ["RecorderWidget"]

STATS_INTERVAL_MS = 250


def _warm_up(layout, seed: int, synthetic: bool, gpu: bool, engine, options: dict) -> SyntheticCamera | None:
    """What :meth:`RecorderWidget._warm_gpu` prepares (on a worker thread): the synthetic camera's
    frames, and with ``gpu`` a recording armed and released (``Writer.warm_up``).  Returns the
    camera, whose frames the recording's camera then shares."""
    camera = None
    if synthetic:
        camera = SyntheticCamera(layout.frame_shape or (1,), layout.dtype, seed=seed)
        camera.prepare()
    if gpu:
        Writer.warm_up(layout, replace(engine, backend="gpu"), **options)
    return camera


class RecorderWidget(QWidget):
    mda_recorded = Signal(object)  # a TileShardSink whose MDA run finished (emitted on the MDA thread)

    def __init__(self, napari_viewer, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        # The pymmcore-plus core whose MDAs the "Micro-Manager" source records: set it, or the
        # global CMMCorePlus.instance() (napari-micromanager's) is used.
        self.mmcore = None
        self.mda_recorder = None  # mmcore.MDARecorder while that source is on
        self.form = SettingsForm(napari_viewer, self)
        self.controller = RecordingController(self)
        self.preview = PreviewLayer(napari_viewer, self)
        self._last_output: str | None = None  # the store of the last recording (Inspect opens it)
        self._dock_closed = False  # closed mid-recording: its end is told by a notification

        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(4)
        layout.addWidget(self.form)
        controls = QHBoxLayout()
        self.start_button, self.stop_button = QPushButton("Start"), QPushButton("Stop")
        self.start_button.clicked.connect(self.start)
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.setEnabled(False)
        self.inspect_button = QPushButton("Inspect shards")
        self.inspect_button.setToolTip("open the shard inspector on the current output")
        self.inspect_button.clicked.connect(self.inspect)
        controls.addWidget(self.start_button)
        controls.addWidget(self.stop_button)
        controls.addWidget(self.inspect_button)
        layout.addLayout(controls)
        self.stats_label = WrappedLabel("idle")
        layout.addWidget(self.stats_label)
        layout.addStretch(1)
        # No taller than its contents: in a dock area shared with the inspector, the space left
        # goes to the inspector's shard table rather than to blank space under the statistics.
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)

        self.form.validated.connect(self.start_button.setEnabled)
        self.form.validated.connect(self._warm_gpu)
        self._warming = None  # the GPU warm-up worker while it runs
        self._warmed = None  # the settings signature warmed last
        self._warm_camera = None  # the synthetic camera whose frames were rendered ahead of Start
        self.controller.starting.connect(self.preview.begin)
        self.controller.progress.connect(self.preview.on_progress)
        self.controller.finished.connect(self._on_finished)
        self.mda_recorded.connect(self._on_mda_recorded)
        self._stats_timer = QTimer(self)
        self._stats_timer.setInterval(STATS_INTERVAL_MS)
        self._stats_timer.timeout.connect(self._refresh_stats)
        self.form.validate()

    # -- the programmatic face ----------------------------------------------------------
    @property
    def settings(self) -> RecorderSettings:
        return self.form.settings

    @settings.setter
    def settings(self, value: RecorderSettings) -> None:
        self.form.settings = value

    @property
    def is_recording(self) -> bool:
        """True from start() until the store is finalized and the widget has taken the result."""
        return self.controller.is_recording or self.mda_recorder is not None

    @property
    def stats(self) -> RecorderStats:
        return self.controller.stats

    def start(self) -> None:
        if self.is_recording:
            return
        if not self.form.validate():
            self.form.show_error(f"cannot start: {self.form.message.text()}")
            return
        # the tiling's notes are on show under the form since validate(): not again as warnings
        settings, _ = with_tiling_notes(lambda: self.form.settings)

        if settings.source == MMCORE_SOURCE:
            self._start_mda_recording(settings)
            return
        self.form.clear_info()  # what the last recording did, kept until now
        try:
            self.form.freeze(True)
            streams = {name: self.form.source_layer(name) for name in settings.streams or {}}
            with_tiling_notes(
                lambda: self.controller.start(settings, self.form.source_layer(settings.source), streams or None)
            )
        except (ValueError, TypeError, OSError) as exc:
            self.form.freeze(False)
            self.form.show_error(str(exc))
            return
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self._stats_timer.start()

    def stop(self, wait: bool = False) -> None:
        if self.is_recording:
            self.stop_button.setEnabled(False)
        if self.mda_recorder is not None:
            self.mda_recorder.stop()  # a run in progress is recorded to its end
            if not self.mda_recorder.started:
                self._mda_stopped()
        self.controller.stop(wait=wait)

    # -- Micro-Manager (pymmcore-plus) source ----------------------------------------------
    def _start_mda_recording(self, settings: RecorderSettings) -> None:
        """From Start to Stop every MDA run on the core is recorded by a TileShardSink on the MDA
        thread (each run into a store of its own); the frames never pass through the GUI thread."""
        core = self.mmcore
        if core is None:
            from pymmcore_plus import CMMCorePlus

            core = CMMCorePlus.instance()
        self.mda_recorder = MDARecorder(
            core,
            settings.output,
            on_finished=self.mda_recorded.emit,
            codec=settings.codec,
            level=settings.level,
            backend=settings.backend,
            ome=settings.ome,
            downsample=settings.downsample,
            overwrite=settings.overwrite,
            policy=settings.policy,
            queue_frames=settings.queue_frames,
        ).start()
        self.form.freeze(True)
        self.form.clear_info()
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.form.show_info(f"recording every MDA run into {settings.output} (and numbered names after it)")
        self._stats_timer.start()

    def _on_mda_recorded(self, sink) -> None:
        """A run finished: show what was written (series 0, lazily) and name the next output."""
        stats = sink.stats
        self._last_output = sink.path
        if stats.written:
            recent_recordings.add(sink.path)
        view = sink.get_view()
        if view is not None:
            self.viewer.add_image(view, name=f"mda: {Path(sink.path).name}")
        message = f"MDA recorded into {sink.path}: {stats.written} frames, {stats.dropped} dropped"
        if stats.error:
            self.form.show_error(f"{message}; error: {stats.error}")
        else:
            self.form.show_info(message)
        if self.mda_recorder is not None and not self.mda_recorder.started:
            self._mda_stopped()

    def _mda_stopped(self) -> None:
        recorder, self.mda_recorder = self.mda_recorder, None
        self._stats_timer.stop()
        self.stop_button.setEnabled(False)
        self.form.freeze(False)
        if recorder is not None and recorder.sinks:
            self.form.output_text = next_output(recorder.sinks[-1].path)
        self.form.validate()

    def inspect(self):
        """Dock the shard inspector on the recording (works during a recording too: Refresh)."""
        inspector = InspectorWidget(self.viewer)
        self.viewer.window.add_dock_widget(inspector, name="Inspect shards", area="right")
        target = self.form.output_text
        if self._last_output and not Path(target).expanduser().exists():
            target = self._last_output  # after a recording the form already names the next one
        inspector.open(target)
        inspector.live.setChecked(self.is_recording)
        return inspector

    def _on_finished(self, stats: RecorderStats) -> None:
        self._stats_timer.stop()
        self._refresh_stats()
        self.preview.finish(stats.rows_complete)
        self.stop_button.setEnabled(False)
        self.form.freeze(False)
        recorded = self.form.output_text
        if not stats.discarded:
            self._last_output = recorded
        if not stats.error and not stats.discarded:  # the next Start must not meet "already exists"
            self.form.output_text = next_output(recorded)
        self.form.validate()
        if stats.error:  # after validate(), which would replace the message
            kept = "what was written stays readable" if stats.rows_complete else "nothing was written"
            message = f"recording stopped: {stats.error} ({kept})"
            self.form.show_error(message)
        else:
            # Names in the dock (the output field shows the next path), full paths in the tooltip
            # and in the notification.
            full = self._summary(stats, recorded, self.form.output_text)
            self.form.show_info(self._summary(stats, Path(recorded).name, Path(self.form.output_text).name), full)
            if self._dock_closed:  # the message has nowhere else to go
                from napari.utils.notifications import show_info

                show_info(full)

    def _summary(self, stats: RecorderStats, recorded: str, following: str) -> str:
        """What a recording that ended without an error did, in a sentence."""
        if stats.discarded:
            live = [source.name for source in self.controller.layer_sources if not source.is_stack]
            why = f" (layer {live[0]!r} did not change)" if len(live) == 1 else ""
            return f"nothing was recorded{why}: the empty store {recorded} was removed"
        how = f"{stats.ended}: " if stats.ended else ""
        return f"{how}recorded {stats.frames} frames into {recorded}; the next goes to {following}"

    def _warm_gpu(self, ok: bool) -> None:
        """Prepare what Start needs before it is pressed, in the background: the synthetic camera's
        frames (rendered once and shared with the recording's camera) and, with the GPU chosen (or
        auto on a machine with one), a recording of the current layout and batching armed and
        released (``Writer.warm_up``: Start then finds the CUDA context, compiled kernels and
        buffers ready and arms in milliseconds)."""
        if not ok or self.is_recording or self._warming is not None:
            return
        settings = self.form.settings
        layout = settings.checked_layout()
        gpu = settings.backend in ("gpu", "auto") and not self.form.gpu_reason
        options = dict(codec=settings.codec, level=settings.level, ome=settings.ome)
        if settings.ome:
            options["downsample"] = settings.downsample
        engine = settings.engine_options()
        signature = (layout, tuple(sorted(options.items())), settings.source, settings.seed, gpu, engine)
        if signature == self._warmed:
            return
        from napari.qt.threading import create_worker

        synthetic = settings.source == "synthetic" and not settings.streams
        worker = create_worker(_warm_up, layout, settings.seed, synthetic, gpu, engine, options, _start_thread=False)
        # The worker refers to the dock weakly: a render still running when the dock closes keeps
        # neither the dock nor the viewer alive.
        dock = weakref.ref(self)

        def warmed(camera) -> None:
            if (widget := dock()) is not None:
                widget._warmed, widget._warm_camera = signature, camera

        def ended() -> None:
            if (widget := dock()) is not None:
                widget._warming = None

        worker.returned.connect(warmed)
        worker.finished.connect(ended)
        self._warming = worker
        worker.start()

    def _refresh_stats(self) -> None:
        sink = self.mda_recorder.sink if self.mda_recorder is not None else None
        if self.mda_recorder is not None:
            if sink is None:
                self.stats_label.setText("waiting for an MDA run on the Micro-Manager core")
            else:
                m = sink.stats
                self.stats_label.setText(
                    f"{'recording' if sink.recording else 'idle'} MDA | frames {m.written} of {m.received} | "
                    f"dropped {m.dropped} | skipped {m.skipped} | queue peak {m.max_queue}"
                )
            return
        s = self.stats
        recording = self.is_recording
        state = ("recording" if s.frames or s.backend else "arming") if recording else "idle"
        ratio = f"{s.compression_ratio:.2f}" if s.bytes_out else "–"
        hint = self.controller.hint()
        # While recording the rate of the last second (what the camera and the Writer do now),
        # afterwards the average of the whole recording.
        fps, gbps = (s.rate_fps, s.rate_gbps) if recording else (s.frames_per_s, s.input_gbps)
        self.stats_label.setText(
            f"{state} | backend {s.backend or '-'} | frames {s.frames} ({fps:.1f}/s) | "
            f"{gbps:.3f} GB/s in | dropped {s.dropped} | queue {s.queue_depth} (peak {s.max_queue}) | "
            f"ratio {ratio} | shards {s.shards_written}"
            + ("".join(f" | {name}: {n}" for name, n in s.stream_frames.items()) if s.stream_frames else "")
            + (f"\n{hint}" if hint else "")
        )

    # -- shutdown -------------------------------------------------------------------
    def showEvent(self, event):
        # Once docked, watch the main window: closing the viewer must finalize the recording.
        window = self.window()
        if window is not self:
            self.controller.watch(window)
        super().showEvent(event)

    def closeEvent(self, event):
        self._dock_closed = self.is_recording
        self.stop(wait=True)
        super().closeEvent(event)

    def event(self, event):
        # The dock's close button (napari's destroyOnClose) takes the widget out of its dock
        # (setParent(None)) and deletes the dock: no closeEvent reaches us.  A recording left
        # running without a UI to stop it would fill the disk: finish it.
        if event.type() == QEvent.Type.ParentChange and self.parent() is None:
            self._dock_closed = self.is_recording
            self.stop(wait=True)
        return super().event(event)
