"""The recorder's settings form: dimension table, source, codec, backend, output, OME switch.

Parsing and the derived figures are :mod:`napari_tileshard.recorder_form` (Qt-free); this module
moves values between widgets and :class:`~napari_tileshard.recorder.RecorderSettings`, and shows
what is wrong with them.
"""

from __future__ import annotations

from pathlib import Path

from qtpy.QtCore import Qt, Signal
from qtpy.QtGui import QStandardItemModel
from qtpy.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .. import codecs
from ..backends import gpu_unavailable_reason
from ..layout import SUPPORTED_DTYPES
from ..pyramid import DOWNSAMPLE
from ..recorder import POLICIES, RecorderSettings
from ..recorder_form import COLUMNS, DEFAULT_DIMS, SYNTHETIC, figures, frame_dims, layout_from_rows, rows_for_frames

# The one colour set by hand: errors must read as errors on both napari themes, and the themes'
# own "error" colour is too dark to read as text on the dark one.
ERROR_STYLE = "color: #e05050"
INFO_STYLE = ""  # the theme's own text colour
_BACKENDS = ("auto", "gpu", "cpu")


class SettingsForm(QWidget):
    """Emits ``validated(ok)`` after every change it checked; frozen while a recording runs."""

    validated = Signal(bool)

    def __init__(self, viewer, parent=None):
        super().__init__(parent)
        self.viewer = viewer
        self._frozen = False
        self._watched_layer = None  # the source layer whose data changes re-adapt the table
        self._gpu_reason = gpu_unavailable_reason()
        #: why the GPU backend can't run here (None: it can)
        self.gpu_reason = self._gpu_reason
        self._build()
        viewer.layers.events.inserted.connect(self.refresh_sources)
        viewer.layers.events.removed.connect(self.refresh_sources)
        self.refresh_sources()

    def _build(self) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        dims_box = QGroupBox("Dimensions (slowest first)")
        dims_layout = QVBoxLayout(dims_box)
        self.table = QTableWidget(0, len(COLUMNS))
        tooltips = {
            4: "pixel size or frame interval (OME-Zarr axes)",
            5: "e.g. micrometer, second (OME-Zarr axes; empty: none)",
        }
        for col, title in enumerate(COLUMNS):
            header = QTableWidgetItem(title)
            header.setToolTip(tooltips.get(col, ""))
            self.table.setHorizontalHeaderItem(col, header)
        for row in DEFAULT_DIMS:
            self._append_row(row)
        self.table.itemChanged.connect(self.validate)
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
        self.source.currentIndexChanged.connect(self._source_changed)
        form.addRow("source", self.source)
        self.dtype = QComboBox()
        self.dtype.addItems(SUPPORTED_DTYPES)
        self.dtype.setCurrentText("uint16")
        self.dtype.currentIndexChanged.connect(self.validate)
        form.addRow("dtype", self.dtype)
        self.fps = QDoubleSpinBox()
        self.fps.setRange(0.0, 100000.0)
        self.fps.setValue(50.0)
        self.fps.setSpecialValueText("as fast as possible")
        self.fps.valueChanged.connect(self.validate)
        form.addRow("camera fps", self.fps)
        self.codec = QComboBox()
        self.codec.addItems(codecs.names())  # the registry: a new codec shows up here by itself
        form.addRow("codec", self.codec)
        self.level = QSpinBox()
        self.level.setValue(1)
        self.level.valueChanged.connect(self.validate)
        form.addRow("level", self.level)
        self.codec.currentIndexChanged.connect(self._codec_changed)
        self._apply_level_range()
        self.backend = QComboBox()
        self.backend.addItems(_BACKENDS)
        model = self.backend.model()
        # A QComboBox's own model is a QStandardItemModel: its items can be disabled one by one.
        gpu_item = model.item(1) if isinstance(model, QStandardItemModel) else None
        if self._gpu_reason and gpu_item is not None:
            gpu_item.setEnabled(False)
            gpu_item.setText("gpu (unavailable)")
            gpu_item.setToolTip(self._gpu_reason)
            self.backend.setItemData(0, f"auto: CPU here ({self._gpu_reason})", Qt.ItemDataRole.ToolTipRole)
        self.backend.currentIndexChanged.connect(self.validate)
        form.addRow("backend", self.backend)
        self.policy = QComboBox()
        self.policy.addItems(POLICIES)
        self.policy.setItemData(
            0, "the source waits when the queue is full: no frame is lost", Qt.ItemDataRole.ToolTipRole
        )
        self.policy.setItemData(
            1, "frames arriving at a full queue are dropped and counted", Qt.ItemDataRole.ToolTipRole
        )
        self.policy.currentIndexChanged.connect(self.validate)
        form.addRow("when the queue is full", self.policy)
        out_row = QHBoxLayout()
        self.output = QLineEdit(str(Path.cwd() / "recording.zarr"))
        self.output.textChanged.connect(self.validate)
        browse = QPushButton("…")
        browse.clicked.connect(self._browse)
        out_row.addWidget(self.output)
        out_row.addWidget(browse)
        form.addRow("output", out_row)
        self.overwrite = QCheckBox("overwrite an existing store")
        self.overwrite.toggled.connect(self.validate)
        form.addRow("", self.overwrite)
        pyramid_row = QHBoxLayout()
        self.ome = QCheckBox("OME-Zarr with a pyramid")
        self.ome.setToolTip(
            "write an OME-Zarr 0.5 group: full resolution at 0/ and 2x-reduced levels (y, x) "
            "computed while recording; the preview becomes multiscale"
        )
        self.downsample = QComboBox()
        self.downsample.addItems(DOWNSAMPLE)
        self.downsample.setEnabled(False)
        self.ome.toggled.connect(self.downsample.setEnabled)
        self.ome.toggled.connect(self.validate)
        self.downsample.currentIndexChanged.connect(self.validate)
        pyramid_row.addWidget(self.ome)
        pyramid_row.addWidget(self.downsample)
        form.addRow("format", pyramid_row)
        layout.addLayout(form)

        self.figures = QLabel()
        self.figures.setWordWrap(True)
        layout.addWidget(self.figures)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setStyleSheet(ERROR_STYLE)
        layout.addWidget(self.message)

    def _append_row(self, values, front=False) -> None:
        row = 0 if front else self.table.rowCount()
        self.table.blockSignals(True)
        self.table.insertRow(row)
        for col, value in enumerate(values):
            self.table.setItem(row, col, QTableWidgetItem(str(value)))
        self.table.blockSignals(False)
        self.validate()

    def _remove_row(self) -> None:
        if self.table.rowCount() > 1:
            self.table.removeRow(0)
            self.validate()

    def _browse(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Record to", self.output.text(), "Zarr store (*.zarr)")
        if path:
            self.output.setText(path)

    def refresh_sources(self, event=None) -> None:
        """List the synthetic camera and the viewer's image layers (never a recorder's preview)."""
        from napari.layers import Image

        current = self.source.currentText()
        self.source.blockSignals(True)
        self.source.clear()
        self.source.addItem(SYNTHETIC)
        for layer in self.viewer.layers:
            if isinstance(layer, Image) and not layer.name.startswith("preview:"):
                self.source.addItem(layer.name)
        self.source.setCurrentIndex(max(0, self.source.findText(current)))
        self.source.blockSignals(False)
        self._source_changed()

    def _source_changed(self, *_) -> None:
        """A layer chosen as the source lays out the table: its frame shape and dtype (tiles
        proposed to fit; the user can still edit them), and again when its data shape changes."""
        layer = self.source_layer()
        if layer is not self._watched_layer:
            if self._watched_layer is not None:
                self._watched_layer.events.data.disconnect(self._source_changed)
            if layer is not None:
                layer.events.data.connect(self._source_changed)
            self._watched_layer = layer
        if layer is not None and not self._frozen:
            self._adapt_to(layer)
        self.validate()

    def _adapt_to(self, layer) -> None:
        import numpy as np

        rows = [[self._cell(row, col) for col in range(len(COLUMNS))] for row in range(self.table.rowCount())]
        frame = tuple(np.shape(layer.data))[-frame_dims(len(rows)) :]
        current = tuple(r[1].strip() for r in rows[-len(frame) :])
        if current != tuple(str(v) for v in frame):
            self.table.blockSignals(True)
            for row, values in enumerate(rows_for_frames(rows, frame)):
                for col, value in enumerate(values):
                    self.table.setItem(row, col, QTableWidgetItem(value))
            self.table.blockSignals(False)
        self.dtype.blockSignals(True)
        self.dtype.setCurrentText(np.dtype(layer.data.dtype).name)
        self.dtype.blockSignals(False)

    def source_layer(self, name: str | None = None):
        """The image layer named ``name`` (default: the selected source), None for the synthetic camera."""
        name = self.source.currentText() if name is None else name
        if name == SYNTHETIC or name not in self.viewer.layers:
            return None
        return self.viewer.layers[name]

    # -- settings ---------------------------------------------------------------------
    def _cell(self, row: int, col: int) -> str:
        item = self.table.item(row, col)
        return item.text() if item is not None else ""

    @property
    def settings(self) -> RecorderSettings:
        """The form's values; raises ValueError naming the row or layer when they make no Layout."""
        rows = [[self._cell(row, col) for col in range(len(COLUMNS))] for row in range(self.table.rowCount())]
        return RecorderSettings(
            output=self.output.text(),
            layout=layout_from_rows(rows, self.dtype.currentText(), self.source_layer()),
            codec=self.codec.currentText(),
            level=self.level.value(),
            backend=self.backend.currentText().split(" ")[0],
            source=self.source.currentText(),
            fps=self.fps.value() or None,
            overwrite=self.overwrite.isChecked(),
            policy=self.policy.currentText(),
            ome=self.ome.isChecked(),
            downsample=self.downsample.currentText(),
        )

    @settings.setter
    def settings(self, value: RecorderSettings) -> None:
        layout = value.checked_layout()
        self.table.blockSignals(True)
        self.table.setRowCount(0)
        for dim in layout.dims:
            self._append_row((dim.name, dim.size, dim.tile_size, dim.tiles_per_shard, dim.scale, dim.unit or ""))
        self.table.blockSignals(False)
        self.dtype.setCurrentText(layout.dtype.name)
        self.output.setText(str(value.output))
        self.codec.setCurrentText(value.codec)
        self.level.setValue(value.level)
        self.backend.setCurrentIndex(_BACKENDS.index(value.backend))
        self.source.setCurrentText(value.source)
        self.fps.setValue(value.fps or 0.0)
        self.overwrite.setChecked(value.overwrite)
        self.policy.setCurrentText(value.policy)
        self.ome.setChecked(value.ome)
        self.downsample.setCurrentText(value.downsample)
        self.validate()

    def freeze(self, frozen: bool) -> None:
        """While a recording runs its settings are fixed, and its output now exists: checking the
        form then would only report "already exists"."""
        self._frozen = frozen

    def _apply_level_range(self) -> None:
        """The level's range is the chosen codec's (a codec without levels keeps its spin box off)."""
        level_range = codecs.get(self.codec.currentText()).level_range
        self.level.setEnabled(bool(level_range))
        if level_range:
            self.level.setRange(*level_range)

    def _codec_changed(self, *_) -> None:
        self._apply_level_range()
        self.validate()

    def validate(self, *_) -> bool:
        """Recompute the derived figures; explain what is wrong.  False while frozen."""
        if self._frozen or not hasattr(self, "message"):
            return False
        try:
            settings = self.settings
            settings.validate()
            if settings.backend == "gpu" and self._gpu_reason:
                raise RuntimeError(f"GPU backend unavailable: {self._gpu_reason}")
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            self.message.setStyleSheet(ERROR_STYLE)
            self.message.setText(str(exc))
            self.figures.setText("")
            self.validated.emit(False)
            return False
        self.message.setText("")
        self.figures.setText(figures(settings))
        self.validated.emit(True)
        return True

    def show_error(self, text: str) -> None:
        from napari.utils.notifications import show_error

        self.message.setStyleSheet(ERROR_STYLE)
        self.message.setText(text)
        show_error(text)

    def show_info(self, text: str) -> None:
        """A message that is not an error (e.g. where the next recording goes)."""
        self.message.setStyleSheet(INFO_STYLE)
        self.message.setText(text)
