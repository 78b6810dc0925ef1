"""The "Tile/Shard Recorder" dock widget.

Qt only relays: the recording loop is :class:`napari_tileshard.recorder.Recorder`, hosted on a
QThread (``_RecorderThread``) whose signals bring progress and the end of the recording back to
the GUI thread, where the preview layer is updated by reopening the zarr store.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from qtpy.QtCore import QEvent, QObject, QThread, QTimer, Signal
from qtpy.QtWidgets import (
    QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
    QLineEdit, QPushButton, QSpinBox, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from .. import _writer
from ..backends import gpu_unavailable_reason
from ..layout import SUPPORTED_DTYPES, Dim, Layout
from ..pyramid import DOWNSAMPLE, Pyramid, plan_pyramid
from ..recorder import POLICIES, Recorder, RecorderSettings, RecorderStats

SYNTHETIC = "synthetic"
_COLUMNS = ("name", "size (0 = unbounded)", "tile", "tiles/shard", "scale", "unit")
_DEFAULT_DIMS = (("t", 0, 32, 1, 1.0, ""), ("y", 1024, 256, 4, 1.0, ""), ("x", 1024, 256, 4, 1.0, ""))


class _RecorderThread(QThread):
    """Runs Recorder.run on its own thread and relays its callbacks as signals.

    On progress it also reads the newest completed frame back from the store (on this thread,
    not the GUI's), of every pyramid level when there is one, so the preview shows it without
    decoding tiles on the event loop.
    """

    progress = Signal(object, object)  # stats, (row, frame, [(row, frame) of levels 1..]) read back
    finished_recording = Signal(object)

    def __init__(self, recorder: Recorder, parent=None):
        super().__init__(parent)
        self.recorder = recorder
        recorder.on_progress = self._progress
        recorder.on_finished = self.finished_recording.emit

    def _progress(self, stats):
        from .._reader import open_lazy

        from ..ome import open_levels

        rows = stats.rows_complete
        newest = None
        settings = self.recorder.settings
        try:
            array, _ = open_lazy(settings.output)
            if array is not None and rows > 0:
                levels = []
                if settings.ome:
                    pyramid = self.recorder.writer.pyramid
                    for k, level in enumerate((open_levels(settings.output) or [])[1:], start=1):
                        row = min(pyramid.level_rows(k, rows), level.shape[0]) - 1
                        levels.append((row, np.asarray(level[row])))
                newest = (rows - 1, np.asarray(array[rows - 1]), levels)
        except Exception:  # noqa: BLE001 - the preview is best effort; the recording goes on
            newest = None
        self.progress.emit(stats, newest)

    def run(self):
        self.recorder.run()


class RecorderWidget(QWidget):
    def __init__(self, napari_viewer, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self._thread: _RecorderThread | None = None
        self._recorder: Recorder | None = None
        self._last_stats = RecorderStats()
        self._source_layer = None
        self._active = False
        self._preview = None
        self._preview_placeholder = False
        self._recent: dict = {}  # level -> {row: frame read back off the GUI thread}
        self._pending_preview = None
        # Progress arrives per shard epoch (up to tens per second): the preview follows the
        # newest at most every 200 ms so the event loop never falls behind.
        self._preview_timer = QTimer(self)
        self._preview_timer.setSingleShot(True)
        self._preview_timer.setInterval(200)
        self._preview_timer.timeout.connect(self._apply_pending_preview)
        self._preview_follow = True
        self._finalizing = None
        self._preview_error = None
        self._levels: Pyramid | None = None
        self._build()
        self._timer = QTimer(self)
        self._timer.setInterval(250)
        self._timer.timeout.connect(self._refresh_stats)
        self.viewer.layers.events.inserted.connect(self._refresh_sources)
        self.viewer.layers.events.removed.connect(self._refresh_sources)
        self._refresh_sources()
        self._validate()
        self._watched_window = None

    # -- form ---------------------------------------------------------------------------
    def _build(self):
        layout = QVBoxLayout(self)
        dims_box = QGroupBox("Dimensions (slowest first)")
        dims_layout = QVBoxLayout(dims_box)
        self.table = QTableWidget(0, len(_COLUMNS))
        self.table.setHorizontalHeaderLabels(_COLUMNS)
        self.table.horizontalHeaderItem(4).setToolTip("pixel size or frame interval (OME-Zarr axes)")
        self.table.horizontalHeaderItem(5).setToolTip("e.g. micrometer, second (OME-Zarr axes; empty: none)")
        for row in _DEFAULT_DIMS:
            self._append_row(row)
        self.table.itemChanged.connect(self._validate)
        buttons = QHBoxLayout()
        add, remove = QPushButton("+ dim"), QPushButton("- dim")
        add.clicked.connect(lambda: self._append_row(("d", 1, 1, 1, 1.0, ""), front=True))
        remove.clicked.connect(self._remove_row)
        buttons.addWidget(add)
        buttons.addWidget(remove)
        dims_layout.addWidget(self.table)
        dims_layout.addLayout(buttons)
        layout.addWidget(dims_box)

        form = QFormLayout()
        self.source = QComboBox()
        self.source.currentIndexChanged.connect(self._validate)
        form.addRow("source", self.source)
        self.dtype = QComboBox()
        self.dtype.addItems(SUPPORTED_DTYPES)
        self.dtype.setCurrentText("uint16")
        self.dtype.currentIndexChanged.connect(self._validate)
        form.addRow("dtype", self.dtype)
        self.fps = QDoubleSpinBox()
        self.fps.setRange(0.0, 100000.0)
        self.fps.setValue(50.0)
        self.fps.setSpecialValueText("as fast as possible")
        self.fps.valueChanged.connect(self._validate)
        form.addRow("camera fps", self.fps)
        self.codec = QComboBox()
        self.codec.addItems(["zstd", "none"])
        self.codec.currentIndexChanged.connect(self._validate)
        form.addRow("codec", self.codec)
        self.level = QSpinBox()
        self.level.setRange(-7, 22)
        self.level.setValue(1)
        self.level.valueChanged.connect(self._validate)
        form.addRow("zstd level", self.level)
        self.backend = QComboBox()
        self._gpu_reason = gpu_unavailable_reason()
        self.backend.addItems(["auto", "gpu", "cpu"])
        if self._gpu_reason:
            item = self.backend.model().item(1)
            item.setEnabled(False)
            item.setText("gpu (unavailable)")
            item.setToolTip(self._gpu_reason)
            self.backend.setItemData(0, f"auto: CPU here ({self._gpu_reason})", 3)  # 3 = ToolTipRole
        self.backend.currentIndexChanged.connect(self._validate)
        form.addRow("backend", self.backend)
        self.policy = QComboBox()
        self.policy.addItems(POLICIES)
        self.policy.setItemData(0, "the source waits when the queue is full: no frame is lost", 3)
        self.policy.setItemData(1, "frames arriving at a full queue are dropped and counted", 3)
        self.policy.currentIndexChanged.connect(self._validate)
        form.addRow("when the queue is full", self.policy)
        out_row = QHBoxLayout()
        self.output = QLineEdit(str(Path.cwd() / "recording.zarr"))
        self.output.textChanged.connect(self._validate)
        browse = QPushButton("…")
        browse.clicked.connect(self._browse)
        out_row.addWidget(self.output)
        out_row.addWidget(browse)
        form.addRow("output", out_row)
        self.overwrite = QCheckBox("overwrite an existing store")
        self.overwrite.toggled.connect(self._validate)
        form.addRow("", self.overwrite)
        pyramid_row = QHBoxLayout()
        self.ome = QCheckBox("OME-Zarr with a pyramid")
        self.ome.setToolTip("write an OME-Zarr 0.5 group: full resolution at 0/ and 2x-reduced levels (y, x) "
                            "computed while recording; the preview becomes multiscale")
        self.downsample = QComboBox()
        self.downsample.addItems(DOWNSAMPLE)
        self.downsample.setEnabled(False)
        self.ome.toggled.connect(self.downsample.setEnabled)
        self.ome.toggled.connect(self._validate)
        self.downsample.currentIndexChanged.connect(self._validate)
        pyramid_row.addWidget(self.ome)
        pyramid_row.addWidget(self.downsample)
        form.addRow("format", pyramid_row)
        layout.addLayout(form)

        self.figures = QLabel()
        self.figures.setWordWrap(True)
        layout.addWidget(self.figures)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setStyleSheet("color: #e05050")
        layout.addWidget(self.message)
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
        self.stats_label = QLabel("idle")
        self.stats_label.setWordWrap(True)
        layout.addWidget(self.stats_label)
        layout.addStretch(1)

    def _append_row(self, values, front=False):
        row = 0 if front else self.table.rowCount()
        self.table.blockSignals(True)
        self.table.insertRow(row)
        for col, value in enumerate(values):
            self.table.setItem(row, col, QTableWidgetItem(str(value)))
        self.table.blockSignals(False)
        self._validate()

    def _remove_row(self):
        if self.table.rowCount() > 1:
            self.table.removeRow(0)
            self._validate()

    def _browse(self):
        path, _ = QFileDialog.getSaveFileName(self, "Record to", self.output.text(), "Zarr store (*.zarr)")
        if path:
            self.output.setText(path)

    def _refresh_sources(self, event=None):
        from napari.layers import Image

        current = self.source.currentText()
        self.source.blockSignals(True)
        self.source.clear()
        self.source.addItem(SYNTHETIC)
        for layer in self.viewer.layers:
            if isinstance(layer, Image) and not layer.name.startswith("preview:"):
                self.source.addItem(layer.name)
        index = self.source.findText(current)
        self.source.setCurrentIndex(max(0, index))
        self.source.blockSignals(False)
        self._validate()

    # -- settings ---------------------------------------------------------------------
    def _layout_from_form(self) -> Layout:
        dims = []
        for row in range(self.table.rowCount()):
            texts = [(self.table.item(row, c).text() if self.table.item(row, c) else "").strip()
                     for c in range(len(_COLUMNS))]
            try:
                size, tile, tps = (int(t) for t in texts[1:4])
            except ValueError:
                raise ValueError(f"row {row + 1} ({texts[0] or '?'}): size, tile and tiles/shard must be integers, "
                                 f"got {texts[1:4]}") from None
            try:
                scale = float(texts[4]) if texts[4] else 1.0
            except ValueError:
                raise ValueError(f"row {row + 1} ({texts[0] or '?'}): scale must be a number, got {texts[4]!r}") from None
            dims.append(Dim(texts[0], size, tile, tps, unit=texts[5] or None, scale=scale))
        dtype = self.dtype.currentText()
        layer = self._layer(self.source.currentText())
        if layer is not None:
            dtype = np.dtype(layer.data.dtype).name
            frame = tuple(np.shape(layer.data))[-2:] if len(dims) >= 3 else tuple(np.shape(layer.data))[-1:]
            expected = tuple(d.size for d in dims[-len(frame):])
            if frame != expected:
                raise ValueError(f"layer {layer.name!r} has frames of shape {frame} but the dimensions give {expected}")
        return Layout(dims, dtype)

    def _layer(self, name):
        if name == SYNTHETIC:
            return None
        return self.viewer.layers[name] if name in self.viewer.layers else None

    @property
    def settings(self) -> RecorderSettings:
        return RecorderSettings(
            output=self.output.text(), layout=self._layout_from_form(), codec=self.codec.currentText(),
            level=self.level.value(), backend=self.backend.currentText().split(" ")[0],
            source=self.source.currentText(), fps=self.fps.value() or None,
            overwrite=self.overwrite.isChecked(), policy=self.policy.currentText(), ome=self.ome.isChecked(),
            downsample=self.downsample.currentText())

    @settings.setter
    def settings(self, value: RecorderSettings):
        self.table.blockSignals(True)
        self.table.setRowCount(0)
        for dim in value.layout.dims:
            self._append_row((dim.name, dim.size, dim.tile_size, dim.tiles_per_shard, dim.scale, dim.unit or ""))
        self.table.blockSignals(False)
        self.dtype.setCurrentText(value.layout.dtype.name)
        self.output.setText(str(value.output))
        self.codec.setCurrentText(value.codec)
        self.level.setValue(value.level)
        self.backend.setCurrentIndex(("auto", "gpu", "cpu").index(value.backend))
        self.source.setCurrentText(value.source)
        self.fps.setValue(value.fps or 0.0)
        self.overwrite.setChecked(value.overwrite)
        self.policy.setCurrentText(value.policy)
        self.ome.setChecked(value.ome)
        self.downsample.setCurrentText(value.downsample)
        self._validate()

    def _validate(self, *_) -> bool:
        """Recompute the derived figures; explain what is wrong and disable Start until it is valid."""
        if not hasattr(self, "start_button") or self.is_recording:
            return False  # the running recording's settings are fixed (and its output now exists)
        try:
            settings = self.settings
            settings.validate()
            if settings.backend == "gpu" and self._gpu_reason:
                raise RuntimeError(f"GPU backend unavailable: {self._gpu_reason}")
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            self.message.setText(str(exc))
            self.figures.setText("")
            self.start_button.setEnabled(False)
            return False
        self.message.setText("")
        self.figures.setText(_figures(settings))
        self.start_button.setEnabled(not self.is_recording)
        _writer.last_settings = settings
        return True

    # -- recording --------------------------------------------------------------------
    @property
    def is_recording(self) -> bool:
        """True from start() until the store is finalized and the widget has taken the result."""
        return self._active

    @property
    def stats(self) -> RecorderStats:
        return self._recorder.stats if self._recorder is not None else self._last_stats

    def start(self) -> None:
        if self.is_recording:
            return
        if not self._validate():
            self._notify_error(f"cannot start: {self.message.text()}")
            return
        settings = self.settings
        try:
            recorder = Recorder(settings)
        except (ValueError, TypeError, OSError) as exc:
            self._notify_error(str(exc))
            return
        self._recorder = recorder
        self._thread = _RecorderThread(recorder, self)
        self._thread.progress.connect(self._on_progress)
        self._thread.finished_recording.connect(self._on_finished)
        self._preview_follow = True
        self._recent = {}
        self._active = True
        # The preview layer exists from the start (creating a layer costs the GUI a moment,
        # better on the click than mid-recording); it shows zeros until a shard epoch completes.
        layout = settings.layout
        self._levels = plan_pyramid(layout, settings.downsample) if settings.ome else Pyramid.single(layout)
        placeholder = [np.zeros((1,) + tuple(level.shape[1:]), layout.dtype) for level in self._levels.layouts]
        self._add_preview(placeholder if settings.ome else placeholder[0], list(layout.names), None,
                          placeholder=True)
        self._thread.start()
        layer = self._layer(settings.source)
        if layer is None:
            import threading

            threading.Thread(target=recorder.feed_synthetic, name="tileshard-camera", daemon=True).start()
        else:
            self._source_layer = layer
            layer.events.data.connect(self._on_layer_data)
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self._timer.start()

    def _on_layer_data(self, event=None):
        if self._recorder is not None and self._source_layer is not None:
            # A copy: the camera plugin may reuse its buffer for the next frame.
            self._recorder.push(np.array(self._source_layer.data, copy=True))

    def stop(self, wait: bool = False) -> None:
        if self._recorder is None or not self.is_recording:
            return
        self._disconnect_source()
        self._recorder.stop()
        if self._finalizing is None:
            from napari.utils import progress

            self._finalizing = progress(total=0, desc="finalizing recording")
        self.stop_button.setEnabled(False)
        if wait:
            self._thread.wait()
            from qtpy.QtWidgets import QApplication

            QApplication.processEvents()  # delivers finished_recording -> _on_finished
            if self._active:  # the signal could not be delivered (e.g. the viewer is closing)
                self._on_finished(self._recorder.stats)

    def inspect(self):
        """Dock the shard inspector on the recording (works during a recording too: Refresh)."""
        from .inspector_widget import InspectorWidget

        inspector = InspectorWidget(self.viewer)
        self.viewer.window.add_dock_widget(inspector, name="Inspect shards", area="right")
        inspector.open(self.output.text())
        inspector.live.setChecked(self.is_recording)
        return inspector

    def _disconnect_source(self):
        if self._source_layer is not None:
            self._source_layer.events.data.disconnect(self._on_layer_data)
            self._source_layer = None

    def _on_progress(self, stats: RecorderStats, newest=None) -> None:
        self._pending_preview = (stats.rows_complete, newest)
        if not self._preview_timer.isActive():
            self._preview_timer.start()

    def _apply_pending_preview(self) -> None:
        if self._pending_preview is not None and self.is_recording:
            rows, newest = self._pending_preview
            self._pending_preview = None
            self._update_preview(rows, newest=newest)

    def _on_finished(self, stats: RecorderStats) -> None:
        self._disconnect_source()
        self._timer.stop()
        self._preview_timer.stop()
        self._pending_preview = None
        self._thread.wait()
        self._active = False
        self._last_stats = stats
        if self._finalizing is not None:
            self._finalizing.close()
            self._finalizing = None
        self._refresh_stats()
        self._update_preview(stats.rows_complete, final=True)
        self.stop_button.setEnabled(False)
        self._validate()
        if stats.error:  # after _validate, which would replace the message
            self._notify_error(f"recording stopped: {stats.error} (what was written stays readable)")

    def _update_preview(self, rows: int, final: bool = False, newest=None) -> None:
        """Reopen the store: only rows whose shards are complete (zarr.json's shape says so).

        The preview is best effort: a store that can't be opened or displayed (e.g. a zarr.json
        replaced by something hostile) is reported once and the recording goes on.
        """
        if rows <= 0 or self._recorder is None:
            return
        try:
            data, names = self._preview_data(rows, final, newest)
        except Exception as exc:  # noqa: BLE001 - never let the preview take the viewer down
            if not self._preview_error:
                self._preview_error = str(exc)
                from napari.utils.notifications import show_warning

                show_warning(f"preview unavailable: {exc}")
            return
        self._preview_error = None
        if data is None:
            return
        multiscale = isinstance(data, list)
        if (self._preview is None or self._preview not in self.viewer.layers
                or multiscale != bool(self._preview.multiscale)):
            self._add_preview(data, names, newest)
        else:
            if self._preview_placeholder and newest is not None:
                low, high = np.percentile(newest[1], (0.5, 99.95))
                self._preview.contrast_limits = (float(low), float(max(high, low + 1)))
                self._preview.name = self._preview.name.split(" (")[0]
                self._preview_placeholder = False
                if self._preview.multiscale:
                    self.viewer.reset_view()  # a multiscale layer loads only the tiles in view: frame it
            step = self.viewer.dims.current_step
            last_shown = _shape(self._preview.data)[0] - 1
            self._preview_follow = step[0] >= last_shown if step else True
            self._preview.data = data
        if self._preview_follow:
            self.viewer.dims.set_current_step(0, _shape(data)[0] - 1)

    def _preview_data(self, rows: int, final: bool, newest):
        """What the preview layer shows: the complete rows, every pyramid level when there is one."""
        from .._reader import check_displayable, open_lazy
        from ..ome import open_levels

        output = self._recorder.settings.output
        levels = open_levels(output) if self._recorder.settings.ome else None
        array, names = open_lazy(output)
        if array is None:
            return None, names
        if newest is not None:  # keep the last two per level: napari re-reads the current row on change
            for k, (row, frame) in enumerate([newest[:2]] + list(newest[2])):
                recent = self._recent.setdefault(k, {})
                recent[row] = frame
                self._recent[k] = dict(sorted(recent.items())[-2:])
        if levels:
            check_displayable(levels[-1], output)
            pyramid = self._pyramid()
            return [_RowsView(level, level.shape[0] if final else min(pyramid.level_rows(k, rows), level.shape[0]),
                              None if final else self._recent.get(k))
                    for k, level in enumerate(levels)], names
        check_displayable(array, output)
        return (array if final else _RowsView(array, min(rows, array.shape[0]), self._recent.get(0))), names

    def _pyramid(self) -> Pyramid:
        """The levels of the current recording (planned once, at start)."""
        return self._levels

    def _add_preview(self, data, names, newest=None, placeholder=False):
        name = f"preview: {Path(self._recorder.settings.output).name}"
        if placeholder:
            name += " (waiting for the first shard epoch)"
        self._preview_placeholder = placeholder
        ndim = len(_shape(data))
        kwargs = {"axis_labels": names} if names and len(names) == ndim else {}
        if isinstance(data, list):
            kwargs["multiscale"] = True
        if newest is not None:
            low, high = np.percentile(newest[1], (0.5, 99.95))
            kwargs["contrast_limits"] = (float(low), float(max(high, low + 1)))
        if self._preview is not None and self._preview in self.viewer.layers:
            self.viewer.layers.remove(self._preview)
        self._preview = self.viewer.add_image(data, name=name, **kwargs)
        self._preview_follow = True

    def _refresh_stats(self) -> None:
        s = self.stats
        state = "recording" if self.is_recording else "idle"
        self.stats_label.setText(
            f"{state} | backend {s.backend or '-'} | frames {s.frames} ({s.frames_per_s:.1f}/s) | "
            f"{s.input_gbps:.3f} GB/s in | ratio {s.compression_ratio:.2f} | shards {s.shards_written} | "
            f"queue {s.queue_depth} | dropped {s.dropped}")

    def _notify_error(self, text: str) -> None:
        from napari.utils.notifications import show_error

        self.message.setText(text)
        show_error(text)

    # -- shutdown -------------------------------------------------------------------
    def showEvent(self, event):
        # Once docked, watch the main window: closing the viewer must finalize the recording.
        window = self.window()
        if window is not self and window is not self._watched_window:
            window.installEventFilter(self)
            self._watched_window = window
        super().showEvent(event)

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.Close:
            self.stop(wait=True)  # the viewer is closing: finalize the store first
        return False

    def closeEvent(self, event):
        self.stop(wait=True)
        super().closeEvent(event)


class _RowsView:
    """The first ``rows`` rows of a zarr array, lazily: napari only reads what it displays.

    ``recent`` maps rows to frames already read back from the store off the GUI thread.
    """

    def __init__(self, array, rows, recent=None):
        self.array, self.rows, self.recent = array, rows, recent or {}
        self.shape = (rows,) + tuple(array.shape[1:])
        self.dtype = array.dtype
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        first = key[0] if key else slice(None)
        if isinstance(first, slice):
            first = slice(*first.indices(self.rows))
            if first.step == 1 and first.stop - first.start == 1 and first.start in self.recent:
                return self.recent[first.start][None][(slice(None),) + tuple(key[1:])]
            if first.stop - first.start > 1 and all(isinstance(k, slice) for k in key):
                # napari's multiscale slicing crops the displayed dims over *every* row first and
                # picks the row afterwards: stay lazy so only that row is read.
                return _LazyCrop(self, key)
        else:
            first = int(first)
            if not -self.rows <= first < self.rows:
                raise IndexError(f"row {first} is not complete yet")
            first %= self.rows
            if first in self.recent:
                return self.recent[first][tuple(key[1:])]
        return self.array[(first,) + tuple(key[1:])]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.array[: self.rows], dtype=dtype)


class _LazyCrop:
    """A crop of a :class:`_RowsView` by slices, read only when indexed further or materialised."""

    def __init__(self, parent, key):
        key = tuple(key) + (slice(None),) * (parent.ndim - len(key))
        self.parent = parent
        self.ranges = [k if isinstance(k, range) else range(n)[k] for n, k in zip(parent.shape, key)]
        self.shape = tuple(len(r) for r in self.ranges)
        self.dtype = parent.dtype
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (self.ndim - len(key))
        picked = [r[k] for r, k in zip(self.ranges, key)]
        if all(isinstance(p, range) for p in picked):
            return _LazyCrop(self.parent, picked)
        return self.parent[tuple(p if isinstance(p, int) else slice(p.start, p.stop, p.step) for p in picked)]

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.parent[tuple(slice(r.start, r.stop, r.step) for r in self.ranges)], dtype=dtype)


def _shape(data) -> tuple:
    return tuple((data[0] if isinstance(data, list) else data).shape)


def _figures(settings: RecorderSettings) -> str:
    layout = settings.layout
    shard_bytes = layout.chunks_per_shard * layout.tile_bytes
    epoch_bytes = layout.epoch_bytes
    files_per_gb = 1e9 / shard_bytes
    from ..writer import estimate_memory

    pyramid = plan_pyramid(layout, settings.downsample) if settings.ome else None
    memory = estimate_memory(layout, pyramid=pyramid)
    levels = (f" · {pyramid.levels} pyramid levels, smallest {pyramid.layouts[-1].shape[-2:]}" if pyramid else "")
    return (f"tile {_size(layout.tile_bytes)} · shard {_size(shard_bytes)} ({layout.chunks_per_shard} tiles) · "
            f"{layout.tiles_per_epoch} tiles and {layout.inner_shard_count} shards per epoch "
            f"({_size(epoch_bytes)}) · {files_per_gb:.1f} files/GB{levels} · host ≈ {_size(memory['cpu_host'])} "
            f"(CPU backend) or {_size(memory['gpu_host'])} + GPU ≈ {_size(memory['gpu_device'])} (GPU backend)")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"
