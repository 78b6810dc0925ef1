"""The recorder's settings form: dimension table, source, codec, backend, output, OME switch.

The settings are magicgui widgets (``form.codec.value``, ``form.output`` a ``FileEdit``) laid out
by QFormLayouts; the dimension table is a QTableWidget (a row per dim, editable in place).

Laid out to read in a dock of napari's default window with the shard inspector docked below it:
the table is as tall as its rows and as wide as the dock (short headers, their meaning in
tooltips), and what a recording rarely changes (dtype, rate, codec, backend, queue policy, format,
more cameras) sits in collapsible sections (superqt's ``QCollapsible``), closed at first.

Parsing and the derived figures are :mod:`napari_tileshard.apps.recorder_form` (Qt-free); this module
moves values between widgets and :class:`~napari_tileshard.apps.recorder.RecorderSettings`, and shows
what is wrong with them.
"""

from __future__ import annotations

from pathlib import Path

from qtpy.QtCore import QEvent, Qt, Signal
from qtpy.QtGui import QStandardItemModel
from qtpy.QtWidgets import (
    QAbstractItemView,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QToolButton,
    QVBoxLayout,
    QWidget,
)
from superqt import QCollapsible

from ..apps.mmcore import MMCORE_SOURCE, mmcore_available
from ..apps.recorder import POLICIES, RecorderSettings
from ..apps.recorder_form import (
    COLUMN_TIPS,
    COLUMNS,
    DEFAULT_DIMS,
    SYNTHETIC,
    figures,
    frame_dims,
    is_own_layer,
    layout_from_rows,
    rows_for_frames,
    rows_for_layer,
    with_tiling_notes,
)
from ..engine.backends import available_backends, gpu_unavailable_reason
from ..format import codecs
from ..format.layout import SUPPORTED_DTYPES
from ..format.pyramid import DOWNSAMPLE
from .labels import WrappedLabel

__all__ = ["ERROR_STYLE", "INFO_STYLE", "NOTE_STYLE", "SettingsForm"]

# The one colour set by hand: errors must read as errors on both napari themes, and the themes'
# own "error" colour is too dark to read as text on the dark one.
ERROR_STYLE = "color: #e05050"
INFO_STYLE = ""  # the theme's own text colour
NOTE_STYLE = "color: #d09030"  # what a tiling costs: it records, but should be looked at


class SettingsForm(QWidget):
    """Emits ``validated(ok)`` after every change it checked; frozen while a recording runs."""

    validated = Signal(bool)

    def __init__(self, viewer, parent=None):
        super().__init__(parent)
        self.viewer = viewer
        self._frozen = False
        self._watched_layer = None  # the source layer whose data changes re-adapt the table
        self._note = self._note_detail = ""  # what the last recording did: shown until the next Start (show_info)
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
        layout.setSpacing(4)
        heading = QHBoxLayout()
        heading.addWidget(QLabel("Dimensions, slowest first (size 0: unbounded)"), 1)
        add, remove = QToolButton(), QToolButton()
        add.setText("+ dim")
        add.setToolTip("add a dimension in front (slowest)")
        add.clicked.connect(lambda: self._append_row(("d", 1, 1, 1, 1.0, ""), front=True))
        remove.setText("− dim")
        remove.setToolTip("remove the first (slowest) dimension")
        remove.clicked.connect(self._remove_row)
        heading.addWidget(add)
        heading.addWidget(remove)
        layout.addLayout(heading)
        self.table = table = QTableWidget(0, len(COLUMNS))
        for col, (title, tip) in enumerate(zip(COLUMNS, COLUMN_TIPS)):
            header = QTableWidgetItem(title)
            header.setToolTip(tip)
            table.setHorizontalHeaderItem(col, header)
        # As wide as the dock and as tall as its rows: never a scroll bar, never a hidden row.
        columns, rows = _header(table.horizontalHeader()), _header(table.verticalHeader())
        columns.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        columns.setMinimumSectionSize(24)
        rows.setVisible(False)
        rows.setDefaultSectionSize(table.fontMetrics().height() + 8)
        table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        table.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        for row in DEFAULT_DIMS:
            self._append_row(row)
        table.itemChanged.connect(self.validate)
        # napari's theme restyles the table once docked: fit it again then
        table.installEventFilter(self)
        columns.installEventFilter(self)
        layout.addWidget(table)

        self._build_fields(layout)

        self.message = WrappedLabel()
        self.message.setStyleSheet(ERROR_STYLE)
        self.message.setVisible(False)  # no empty line's height while there is nothing to say
        layout.addWidget(self.message)
        # What the tiling costs (a tile clamped to its dim, tiny chunks, too many files): the
        # settings record, but the user should see it before pressing Start
        self.notes = WrappedLabel()
        self.notes.setStyleSheet(NOTE_STYLE)
        self.notes.setVisible(False)
        layout.addWidget(self.notes)

    def _fit_table(self) -> None:
        """The table's height: its header and every row (the dock gives it no less)."""
        table = self.table
        _header(table.verticalHeader()).setDefaultSectionSize(table.fontMetrics().height() + 8)
        rows = sum(table.rowHeight(row) for row in range(table.rowCount()))
        header = _header(table.horizontalHeader()).sizeHint().height()
        table.setFixedHeight(header + rows + 2 * table.frameWidth())

    def eventFilter(self, watched, event) -> bool:
        if event is not None and event.type() in _RESTYLED:
            self._fit_table()
        return False

    def _build_fields(self, layout: QVBoxLayout) -> None:
        """The settings other than the dimension table, as magicgui widgets (napari's own widget
        toolkit: labels, theme, ``.value``); only what magicgui has no option for (a disabled
        backend with its reason, per-item tooltips, the spin box's text at 0) is set on their Qt
        widgets."""
        from magicgui.types import FileDialogMode
        from magicgui.widgets import CheckBox, ComboBox, Container, FileEdit, FloatSpinBox, Select, SpinBox
        from magicgui.widgets.bases import ValueWidget, Widget

        self.source = ComboBox(choices=[SYNTHETIC])
        # Several cameras at once: more image layers, each recorded into its own array of one
        # collection (MultiWriter); the preview follows the source above.
        self.more_sources = Select(
            choices=[],
            tooltip="record these image layers too, each as its own stream (array) of one OME-Zarr "
            "collection at the output; ctrl-click to select several",
        )
        self.more_sources.native.setMaximumHeight(60)
        self.dtype = ComboBox(choices=list(SUPPORTED_DTYPES), value="uint16")
        self.fps = FloatSpinBox(min=0.0, max=100000.0, value=50.0)
        self.fps.native.setSpecialValueText("as fast as possible")
        # The registry: a new codec shows up here by itself.
        self.codec = ComboBox(choices=list(codecs.names()), value="zstd")
        self.level = SpinBox(value=1)
        # The registry lists the backends in auto's order, each with why it can't run here.
        backends = available_backends()
        self.backend = ComboBox(choices=["auto", *backends])
        combo = self.backend.native
        model = combo.model()
        # A QComboBox's own model is a QStandardItemModel: its items can be disabled one by one.
        for row, (name, reason) in enumerate(backends.items(), start=1):
            item = model.item(row) if isinstance(model, QStandardItemModel) else None
            if reason and item is not None:
                item.setEnabled(False)
                item.setText(f"{name} (unavailable)")
                item.setToolTip(reason)
        if self._gpu_reason:
            combo.setItemData(0, f"auto: CPU here ({self._gpu_reason})", Qt.ItemDataRole.ToolTipRole)
        self.policy = ComboBox(choices=list(POLICIES))
        self.policy.native.setItemData(
            0, "the source waits when the queue is full: no frame is lost", Qt.ItemDataRole.ToolTipRole
        )
        self.policy.native.setItemData(
            1, "frames arriving at a full queue are dropped and counted", Qt.ItemDataRole.ToolTipRole
        )
        self.output = FileEdit(
            mode=FileDialogMode.OPTIONAL_FILE, filter="Zarr store (*.zarr)", value=Path.cwd() / "recording.zarr"
        )
        self.overwrite = CheckBox(text="overwrite an existing store")
        self.ome = CheckBox(
            text="OME-Zarr with a pyramid",
            tooltip="write an OME-Zarr 0.5 group: full resolution at 0/ and 2x-reduced levels (y, x) "
            "computed while recording; the preview becomes multiscale",
        )
        self.downsample = ComboBox(choices=list(DOWNSAMPLE), enabled=False)
        pyramid = Container(layout="horizontal", labels=False, widgets=[self.ome, self.downsample])
        pyramid.margins = (0, 0, 0, 0)
        self.policy.native.setToolTip("what happens to frames arriving while the writer's queue is full")
        # magicgui's own Container would size each label to its text; QFormLayouts align them.
        main = QFormLayout()
        main.setContentsMargins(0, 0, 0, 0)
        rows: tuple[tuple[str, Widget], ...] = (("source", self.source), ("output", self.output))
        for label, field in rows:
            main.addRow(label, field.native)
        layout.addLayout(main)

        # One section, closed at first: a dock with the inspector below it keeps every row of the
        # table in napari's default window only with these out of the way.
        self.advanced = QCollapsible("More: camera, compression, backend, cameras", expandedIcon="▾", collapsedIcon="▸")
        self.advanced.setDuration(0)  # opens at once: no animation to wait for in a busy GUI
        section_layout = self.advanced.layout()
        if section_layout is not None:
            section_layout.setContentsMargins(0, 0, 0, 0)
        advanced = QFormLayout()
        advanced.setContentsMargins(0, 0, 0, 0)
        rows = (
            ("", self.overwrite),
            ("dtype", self.dtype),
            ("camera fps", self.fps),
            ("codec", self.codec),
            ("level", self.level),
            ("backend", self.backend),
            ("queue full", self.policy),
            ("format", pyramid),
            ("also record", self.more_sources),
        )
        for label, field in rows:
            advanced.addRow(label, field.native)
        self.advanced.addWidget(_holding(advanced))
        layout.addWidget(self.advanced)
        # What the settings imply, shown with them; outside the section, whose height is fixed when
        # it opens (a wrapped label's height changes with its text, and this text with every edit).
        self.figures = WrappedLabel()
        self.figures.setVisible(False)
        self.advanced.toggled.connect(self.figures.setVisible)
        layout.addWidget(self.figures)
        self._apply_level_range()
        self.source.changed.connect(self._source_changed)
        self.more_sources.changed.connect(self.validate)
        self.codec.changed.connect(self._codec_changed)
        self.ome.changed.connect(self._ome_changed)
        checked: tuple[ValueWidget, ...] = (
            self.dtype,
            self.fps,
            self.level,
            self.backend,
            self.policy,
            self.overwrite,
            self.downsample,
        )
        for value_widget in checked:
            value_widget.changed.connect(self.validate)
        self.output.line_edit.changed.connect(self.validate)  # as typed (``output.value`` of "" is ".")

    @property
    def output_text(self) -> str:
        """The output as typed: a path or a store URL (``output.value`` is a Path: "" would be ".",
        and ``s3://`` would lose a slash)."""
        return self.output.line_edit.value

    @output_text.setter
    def output_text(self, text: str) -> None:
        self.output.line_edit.value = text

    def _ome_changed(self, on: bool) -> None:
        self.downsample.enabled = on
        self.validate()

    def _append_row(self, values, front=False) -> None:
        row = 0 if front else self.table.rowCount()
        self.table.blockSignals(True)
        self.table.insertRow(row)
        for col, value in enumerate(values):
            self.table.setItem(row, col, QTableWidgetItem(str(value)))
        self.table.blockSignals(False)
        self._fit_table()
        self.validate()

    def _remove_row(self) -> None:
        if self.table.rowCount() > 1:
            self.table.removeRow(0)
            self._fit_table()
            self.validate()

    def _image_layers(self) -> list[str]:
        """The names of the viewer's image layers that can be recorded: not RGB, and none of the
        layers this plugin adds (the recorder's preview, the inspector's map)."""
        from napari.layers import Image

        return [
            layer.name
            for layer in self.viewer.layers
            if isinstance(layer, Image) and not layer.rgb and not is_own_layer(layer)
        ]

    def refresh_sources(self, event=None) -> None:
        """List the synthetic camera, the viewer's image layers that can be recorded and, with
        pymmcore-plus installed, the MDAs of its core."""
        current = self.source.value
        names = [SYNTHETIC, *self._image_layers()]
        if mmcore_available():  # napari-micromanager's MDAs (or any on the core) are recorded
            names.append(MMCORE_SOURCE)
        with self.source.changed.blocked():
            if tuple(self.source.choices) != tuple(names):
                self.source.choices = ()  # magicgui keeps the order of choices it has: layers before MDAs
            self.source.choices = names
            self.source.value = current if current in names else SYNTHETIC
        self._refresh_more_sources()
        self._source_changed()

    def _refresh_more_sources(self) -> None:
        """The image layers other than the source (image streams only: not the Micro-Manager
        source, not our own layers), keeping what is still selectable selected."""
        names = [n for n in self._image_layers() if n != self.source.value]
        selected = [n for n in self.more_sources.value if n in names]
        with self.more_sources.changed.blocked():
            self.more_sources.choices = names
            self.more_sources.value = selected

    def _source_changed(self, *_) -> None:
        """A layer chosen as the source lays out the table: its frame shape and dtype (tiles
        proposed to fit; the user can still edit them), and again when its data shape changes."""
        if self.more_sources.choices is not None and self.source.value in self.more_sources.choices:
            self._refresh_more_sources()
        layer = self.source_layer()
        if layer is not self._watched_layer:
            if self._watched_layer is not None:
                self._watched_layer.events.data.disconnect(self._source_changed)
            if layer is not None:
                layer.events.data.connect(self._source_changed)
            self._watched_layer = layer
        if not self._frozen:
            # A layer decides the dtype, and the camera's rate is the layer's own pace.
            self.dtype.enabled = self.fps.enabled = layer is None
            if layer is not None:
                self._adapt_to(layer)
        self.validate()

    def _adapt_to(self, layer) -> None:
        """The table laid out for ``layer``'s frames (a stack's planes keep their arrangement:
        ``rows_for_layer``); rows that already fit are left as the user set them."""
        import numpy as np

        rows = [[self._cell(row, col) for col in range(len(COLUMNS))] for row in range(self.table.rowCount())]
        proposed = rows_for_layer(rows, np.shape(layer.data), getattr(layer, "axis_labels", ()))
        if len(proposed) != len(rows) or any(a[1].strip() != b[1].strip() for a, b in zip(proposed, rows)):
            self.table.blockSignals(True)
            self.table.setRowCount(len(proposed))
            for row, values in enumerate(proposed):
                for col, value in enumerate(values):
                    self.table.setItem(row, col, QTableWidgetItem(value))
            self.table.blockSignals(False)
            self._fit_table()
        with self.dtype.changed.blocked():
            self.dtype.value = np.dtype(layer.data.dtype).name

    def source_layer(self, name: str | None = None):
        """The image layer named ``name`` (default: the selected source), None for the synthetic camera."""
        name = self.source.value if name is None else name
        if name == SYNTHETIC or name not in self.viewer.layers:
            return None
        return self.viewer.layers[name]

    # -- settings ---------------------------------------------------------------------
    def _cell(self, row: int, col: int) -> str:
        item = self.table.item(row, col)
        return item.text() if item is not None else ""

    def _streams(self, rows, layout) -> dict | None:
        """The streams of a recording of several layers (None for one): each layer laid out by the
        table, its frame dims and dtype taken from its data."""
        import numpy as np

        more = [n for n in self.more_sources.value if n != self.source.value]
        if not more:
            return None
        if self.source_layer() is None:
            raise ValueError("recording several layers needs an image layer as the source, not the synthetic camera")
        streams = {self.source.value: layout}
        for name in more:
            layer = self.source_layer(name)
            if layer is None:
                raise ValueError(f"layer {name!r} is gone")
            frame = tuple(np.shape(layer.data))[-frame_dims(len(rows)) :]
            streams[name] = layout_from_rows(rows_for_frames(rows, frame), np.dtype(layer.data.dtype).name, layer)
        return streams

    @property
    def settings(self) -> RecorderSettings:
        """The form's values; raises ValueError naming the row or layer when they make no Layout."""
        rows = [[self._cell(row, col) for col in range(len(COLUMNS))] for row in range(self.table.rowCount())]
        layout = layout_from_rows(rows, self.dtype.value, self.source_layer())
        return RecorderSettings(
            output=self.output_text,
            layout=layout,
            streams=self._streams(rows, layout),
            codec=self.codec.value,
            level=self.level.value,
            backend=self.backend.value,
            source=self.source.value,
            fps=self.fps.value or None,
            overwrite=self.overwrite.value,
            policy=self.policy.value,
            ome=self.ome.value,
            downsample=self.downsample.value,
        )

    @settings.setter
    def settings(self, value: RecorderSettings) -> None:
        layout = value.checked_layout()
        self.table.blockSignals(True)
        self.table.setRowCount(0)
        for dim in layout.dims:
            self._append_row((dim.name, dim.size, dim.tile_size, dim.tiles_per_shard, dim.scale, dim.unit or ""))
        self.table.blockSignals(False)
        self._fit_table()
        self.dtype.value = layout.dtype.name
        self.output_text = str(value.output)
        self.codec.value = value.codec
        self.level.value = value.level
        self.backend.value = value.backend
        if value.source in self.source.choices:
            self.source.value = value.source
        more = [n for n in (value.streams or {}) if n != value.source]
        self.more_sources.value = [n for n in more if n in (self.more_sources.choices or ())]
        self.fps.value = value.fps or 0.0
        self.overwrite.value = value.overwrite
        self.policy.value = value.policy
        self.ome.value = value.ome
        self.downsample.value = value.downsample
        self.validate()

    def freeze(self, frozen: bool) -> None:
        """While a recording runs its settings are fixed, and its output now exists: checking the
        form then would only report "already exists"."""
        self._frozen = frozen

    def _apply_level_range(self) -> None:
        """The level's range is the chosen codec's (a codec without levels keeps its spin box off)."""
        level_range = codecs.get(self.codec.value).level_range
        self.level.enabled = bool(level_range)
        if level_range:
            self.level.min, self.level.max = level_range

    def _codec_changed(self, *_) -> None:
        self._apply_level_range()
        self.validate()

    def validate(self, *_) -> bool:
        """Recompute the derived figures; explain what is wrong.  False while frozen."""
        if self._frozen or not hasattr(self, "message"):
            return False
        try:
            settings, notes = with_tiling_notes(self._checked_settings)
            if settings.backend == "gpu" and self._gpu_reason:
                raise RuntimeError(f"GPU backend unavailable: {self._gpu_reason}")
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            self._say(str(exc), ERROR_STYLE)
            self._show_notes([])
            self.figures.setText("")
            self.validated.emit(False)
            return False
        self._say(self._note, INFO_STYLE, self._note_detail)
        self._show_notes(notes)
        self.figures.setText(figures(settings))
        self.validated.emit(True)
        return True

    def _checked_settings(self) -> RecorderSettings:
        settings = self.settings
        settings.validate()
        return settings

    def _show_notes(self, notes: list[str]) -> None:
        self.notes.setText("\n".join(f"note: {note}" for note in notes))
        self.notes.setVisible(bool(notes))

    def show_error(self, text: str) -> None:
        from napari.utils.notifications import show_error

        self._say(text, ERROR_STYLE)
        show_error(text)

    def show_info(self, text: str, detail: str = "") -> None:
        """A message that is not an error (what the last recording did, where the next one goes),
        ``detail`` its tooltip (full paths, say): it stays while the form changes (a layer added, a
        field edited) until :meth:`clear_info` (the next Start); an error in the settings shows
        instead meanwhile."""
        self._note, self._note_detail = text, detail
        self._say(text, INFO_STYLE, detail)

    def clear_info(self) -> None:
        self._note = self._note_detail = ""
        if self.message.styleSheet() == INFO_STYLE:
            self._say("", INFO_STYLE)

    def _say(self, text: str, style: str, detail: str = "") -> None:
        self.message.setStyleSheet(style)
        self.message.setText(text)
        self.message.setToolTip(detail)
        self.message.setVisible(bool(text))


#: events after which the table's font, header or frame may have changed size
_RESTYLED = (QEvent.Type.StyleChange, QEvent.Type.FontChange, QEvent.Type.Show, QEvent.Type.Polish)


def _header(header: QHeaderView | None) -> QHeaderView:
    """A table's header (Qt's stubs allow None; a QTableWidget always has both)."""
    if header is None:
        raise RuntimeError("the table has no header")
    return header


def _holding(layout) -> QWidget:
    """A plain widget holding ``layout`` (what a QCollapsible takes)."""
    widget = QWidget()
    widget.setLayout(layout)
    return widget
