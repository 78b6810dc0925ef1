"""The "Inspect shards" dock widget: shard/tile grids, per-chunk compression map, shard table.

Everything it shows comes from :func:`napari_tileshard.apps.inspect_shards.inspect_array`, which
reads only shard indexes.  A collection (several images: a MultiWriter run, an MDA's positions)
shows an *image* picker listing them; the inspector shows the one picked.  Grids are 2-D Shapes
layers over the last two dimensions (napari
broadcasts them along the others, e.g. the append dimension); the per-chunk map is an image of
exactly the array's shape (:class:`~napari_tileshard.apps.inspect_shards.PixelMap`: each pixel
shows its chunk's value, an edge chunk's padding gets none), so it lies on the data at every zoom
and its slider ends at the array's last row.

The store is picked by typing, by a directory dialog (Browse…) or from this session's recordings
(the path list, most recent first).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from qtpy.QtCore import QEvent, Qt, QTimer
from qtpy.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from ..apps.inspect_shards import EMPTY_CHUNK, ImageEntry, Inspection, PixelMap, inspect_array, list_images
from ..apps.recorder import recent_recordings
from ..apps.recorder_form import OWN_LAYER_KEY
from ..apps.verify import verify
from .labels import WrappedLabel

__all__ = ["InspectorWidget", "grid_rectangles"]

#: the shard table's headers, short so that it fits a dock; their meaning in :data:`_COLUMN_TIPS`
_COLUMNS = ("shard", "bytes", "chunks", "ratio", "CRC", "check")
_COLUMN_TIPS = (
    "the shard's key (its file) in the store",
    "the shard file's size in bytes",
    "chunks present / chunks the shard can hold",
    "mean compression ratio of the shard's chunks (their padding left out)",
    "whether the shard index's CRC32C matches",
    "Check chunks: every chunk decoded (- until run)",
)
#: planes of the chunk map larger than this (pixels) are shown as a multiscale layer
_MAX_MAP_PLANE = 4096 * 4096


class _RecentPaths(QComboBox):
    """An editable path field whose list is this session's recordings, read each time it opens."""

    def showPopup(self) -> None:
        text = self.currentText()
        self.blockSignals(True)
        self.clear()
        self.addItems(list(recent_recordings))
        self.setEditText(text)
        self.blockSignals(False)
        super().showPopup()


def grid_rectangles(shape, cell) -> list[np.ndarray]:
    """Rectangles (corner pairs) of a regular grid of ``cell`` over a 2-D ``shape``, clipped.

    In napari pixel ``j`` is centred on ``j``, so a block of pixels ``[a, b)`` spans
    ``[a - 0.5, b - 0.5]``: the corners are shifted by half a pixel to sit on pixel edges.
    """
    rects = []
    for y0 in range(0, shape[0], cell[0]):
        for x0 in range(0, shape[1], cell[1]):
            y1, x1 = min(shape[0], y0 + cell[0]), min(shape[1], x0 + cell[1])
            rects.append(np.array([[y0, x0], [y1, x1]], dtype=float) - 0.5)
    return rects


class InspectorWidget(QWidget):
    def __init__(self, napari_viewer, parent=None):
        super().__init__(parent)
        self.viewer = napari_viewer
        self.inspection: Inspection | None = None
        self.path: str | None = None
        self._layers: dict = {}
        self._refreshing = None  # the background refresh worker, while one runs
        self._full_refresh_pending = False  # Refresh pressed while a (live) refresh ran: run it after
        self._watched_window = None  # the main window whose closing stops the live refresh
        self._closing = False
        self._grids: dict = {}  # grid layer key -> (plane, cell, name) it shows
        self._table_rows: list[tuple] = []  # the text of each table row shown
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(4)
        row = QHBoxLayout()
        self.path_box = _RecentPaths()
        self.path_box.setEditable(True)
        self.path_box.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.path_box.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.path_box.setMinimumContentsLength(12)
        self.path_box.setToolTip(
            "a Zarr v3 array or OME-Zarr image (path or URL); the list holds this session's recordings"
        )
        path_edit = self.path_box.lineEdit()
        assert path_edit is not None  # an editable combo box has its line edit
        self.path_edit = path_edit
        self.path_edit.setPlaceholderText("path of a Zarr v3 array")
        self.path_edit.returnPressed.connect(lambda: self.open(self.path_edit.text()))
        self.path_box.activated.connect(lambda index: self.open(self.path_box.itemText(index)))
        recent = next(iter(recent_recordings), None)
        if recent:
            self.path_edit.setText(recent)  # from the menu after a recording: that one, one click away
        browse = QPushButton("Browse…")
        browse.setToolTip("choose a store (a directory) with a file dialog")
        browse.clicked.connect(self.browse)
        open_button = QPushButton("Inspect")
        open_button.clicked.connect(lambda: self.open(self.path_edit.text()))
        row.addWidget(self.path_box, 1)
        row.addWidget(browse)
        row.addWidget(open_button)
        layout.addLayout(row)
        picker = QHBoxLayout()
        self.image_label = QLabel("image")
        self.image_picker = QComboBox()
        self.image_picker.setToolTip("the image of the collection to inspect")
        self.image_picker.currentIndexChanged.connect(self._on_image_picked)
        picker.addWidget(self.image_label)
        picker.addWidget(self.image_picker, 1)
        layout.addLayout(picker)
        self.images: list[ImageEntry] = []  # the store's images (one for an array or a single image)
        self.image: str | None = None  # the path of the image shown ("" for the store's root)
        self._show_picker(False)
        toggles = QHBoxLayout()
        self.shard_grid = QCheckBox("shard grid")
        self.tile_grid = QCheckBox("tile grid")
        for box, name in ((self.shard_grid, "shard grid"), (self.tile_grid, "tile grid")):
            box.setChecked(True)
            box.toggled.connect(lambda on, n=name: self._set_visible(n, on))
            toggles.addWidget(box)
        refresh = QPushButton("Refresh")
        refresh.clicked.connect(lambda: self.refresh())
        toggles.addWidget(refresh)
        self.live = QCheckBox("live")
        self.live.setToolTip("re-read the indexes every 2 s (new shards of a running recording appear)")
        self._live_timer = QTimer(self)
        self._live_timer.setInterval(2000)
        self._live_timer.timeout.connect(lambda: self.refresh(incremental=True))
        self.live.toggled.connect(lambda on: self._live_timer.start() if on else self._live_timer.stop())
        toggles.addWidget(self.live)
        self.check_button = QPushButton("Check chunks")
        self.check_button.setToolTip("decode every chunk in the background (reads all data)")
        self.check_button.clicked.connect(self.check_chunks)
        toggles.addWidget(self.check_button)
        layout.addLayout(toggles)
        self.check_report = None
        self.summary = WrappedLabel()
        layout.addWidget(self.summary)
        self.table = QTableWidget(0, len(_COLUMNS))
        for col, (title, tip) in enumerate(zip(_COLUMNS, _COLUMN_TIPS)):
            item = QTableWidgetItem(title)
            item.setToolTip(tip)
            self.table.setHorizontalHeaderItem(col, item)
        header, rows = self.table.horizontalHeader(), self.table.verticalHeader()
        if header is not None and rows is not None:  # as wide as the dock: no scrolling sideways
            header.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
            header.setMinimumSectionSize(24)
            rows.setVisible(False)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.itemSelectionChanged.connect(self._on_select)
        layout.addWidget(self.table)

    # -- loading -----------------------------------------------------------------------
    def browse(self) -> str | None:
        """Pick a store with a directory dialog (a Zarr store is a directory) and inspect it."""
        start = self.path_edit.text().strip()
        start_dir = str(Path(start).expanduser().parent) if start and "://" not in start else ""
        path = QFileDialog.getExistingDirectory(self, "Inspect shards of a Zarr store", start_dir)
        if path:
            self.open(path)
        return path or None

    def open(self, path, image: str | None = None) -> None:
        """Inspect the array at ``path``; in a collection the image ``image`` (a name or path;
        default: the one picked before in the same collection, else its first)."""
        from napari.utils.notifications import show_error

        path = str(path)
        try:
            images = list_images(path)
            if image is None and path == self.path and any(i.path == self.image for i in images):
                image = self.image
            if image is None and images:
                image = next((i.path for i in images if i.error is None), images[0].path)
            chosen = next((i for i in images if image in (i.path, i.name)), None)
            inspection = inspect_array(path, image=image)
        except Exception as exc:  # noqa: BLE001 - shown to the user, never raised into Qt
            self.summary.setText(f"cannot inspect {path}: {exc}")
            show_error(f"cannot inspect {path}: {exc}")
            return
        if path != self.path:
            self.check_report = None  # the last chunk check (all images of a collection) was of another store
        self.path = path
        self.image = chosen.path if chosen else None
        self.path_edit.setText(self.path)
        self._list_images(images)
        self.inspection = inspection
        self._show(inspection)

    def _list_images(self, images: list[ImageEntry]) -> None:
        self.images = images
        self.image_picker.blockSignals(True)
        self.image_picker.clear()
        for entry in images:
            self.image_picker.addItem(str(entry), entry.path)
        at = next((k for k, entry in enumerate(images) if entry.path == self.image), -1)
        self.image_picker.setCurrentIndex(at)
        self.image_picker.blockSignals(False)
        self._show_picker(len(images) > 1 or any(entry.path for entry in images))  # a collection's

    def _show_picker(self, visible: bool) -> None:
        self.image_label.setVisible(visible)
        self.image_picker.setVisible(visible)

    def _on_image_picked(self, index: int) -> None:
        if self.path and 0 <= index < len(self.images) and self.images[index].path != self.image:
            self.open(self.path, image=self.images[index].path)

    def refresh(self, incremental: bool = False) -> None:
        """Re-read the indexes in the background (a recording in progress adds shards): reading
        thousands of indexes takes seconds, which the GUI thread must not wait for.  A live
        (incremental) refresh while one is running is skipped; a full one runs when it is done.
        The result is shown when it arrives.

        ``incremental`` (the live mode): shards whose size is unchanged since the inspection shown
        are taken from it, so a growing recording costs only its new shards' indexes.  The Refresh
        button reads every index."""
        if not self.path or self._closing:
            return
        if self._refreshing is not None:
            # A live tick may be skipped; a full refresh asked for is run once this one is done.
            self._full_refresh_pending = self._full_refresh_pending or not incremental
            return
        from napari.qt.threading import create_worker

        self._watch_window()
        path, image = self.path, self.image
        previous = self.inspection if incremental else None
        worker = create_worker(inspect_array, path, previous=previous, image=image, _start_thread=False)
        worker.returned.connect(lambda inspection: self._refreshed(path, image, inspection))
        worker.errored.connect(lambda exc: self.summary.setText(f"cannot inspect {path}: {exc}"))
        worker.finished.connect(self._refresh_done)
        self._refreshing = worker
        worker.start()

    @property
    def refreshing(self) -> bool:
        """True while a background refresh is reading indexes."""
        return self._refreshing is not None

    def _refreshed(self, path: str, image: str | None, inspection: Inspection) -> None:
        if (path, image) == (self.path, self.image) and not self._closing:  # not replaced meanwhile
            self.inspection = inspection
            self._show(inspection)

    def _refresh_done(self) -> None:
        self._refreshing = None
        if self._full_refresh_pending and not self._closing:
            self._full_refresh_pending = False
            self.refresh()

    # -- shutdown -------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the live mode and wait for a refresh in flight.  Called when the viewer or the dock
        closes: a worker still reading indexes would emit its result into Qt objects being deleted,
        which aborts the whole process (seen at viewer close during a live refresh)."""
        self._live_timer.stop()
        self._closing = True  # a result still arriving is not shown in a viewer being closed
        window, self._watched_window = self._watched_window, None  # no reference to a closed viewer
        if window is not None:
            window.removeEventFilter(self)
        if self._refreshing is None:
            return
        from qtpy.QtCore import QThreadPool
        from qtpy.QtWidgets import QApplication

        # napari runs its workers on the global pool; once it is idle ours has emitted its last signal
        pool = QThreadPool.globalInstance()
        if pool is not None:
            pool.waitForDone(int(timeout_s * 1000))
        QApplication.processEvents()  # deliver returned/finished while the widget still exists
        self._refreshing = None

    def eventFilter(self, obj, event) -> bool:
        if event is not None and event.type() == QEvent.Type.Close:
            self.shutdown()
        return False

    def closeEvent(self, event):
        self.shutdown()
        super().closeEvent(event)

    def event(self, event):
        # The dock's close button takes the widget out of its dock without a closeEvent (as in
        # the recorder widget): stop refreshing then too.
        if event.type() == QEvent.Type.ParentChange:
            if self.parent() is None:
                self.shutdown()
        return super().event(event)

    def _watch_window(self) -> None:
        """Watch the main window we are docked in (known once docked, so looked up when a refresh
        starts): the viewer closing must not outrun a refresh."""
        window = self.window()
        if window is not None and window is not self and window is not self._watched_window:
            window.installEventFilter(self)
            self._watched_window = window

    def _show(self, result: Inspection) -> None:
        name = Path(self.path or "").name
        picked = next((entry for entry in self.images if entry.path == self.image), None)
        if picked is not None and picked.path:  # an image of a collection
            name = f"{name} {picked.name}"
        plane = result.shape[-2:]
        labels = result.axis_names[-2:] if result.axis_names else None
        self._replace_shapes(
            "shard grid",
            (plane, result.shard_shape[-2:]),
            edge_color="yellow",
            edge_width=max(1, plane[-1] // 300),
            name=name,
            axis_labels=labels,
        )
        self._replace_shapes(
            "tile grid",
            (plane, result.chunk_shape[-2:]),
            edge_color="cyan",
            edge_width=max(1, plane[-1] // 1000),
            name=name,
            axis_labels=labels,
        )
        self._show_ratio(result, name)
        # Rows whose text is unchanged keep their items: a live refresh of a growing recording
        # then only adds the new shards' rows instead of rebuilding thousands of items.
        shown = self._table_rows
        rows = [
            (
                shard.key,
                f"{shard.file_bytes}",
                f"{shard.chunks_present} / {shard.chunks_possible}",
                f"{shard.mean_ratio:.2f}",
                "ok" if shard.crc_ok else "mismatch",
                self._check_text(shard.key),
            )
            for shard in result.shards
        ]
        self.table.setUpdatesEnabled(False)
        self.table.setRowCount(len(rows))
        for i, values in enumerate(rows):
            if i < len(shown) and shown[i] == values:
                continue
            for j, value in enumerate(values):
                self.table.setItem(i, j, QTableWidgetItem(value))
        self.table.setUpdatesEnabled(True)
        self._table_rows = rows
        empty = int((result.chunk_bytes == EMPTY_CHUNK).sum())
        bad = sum(not s.crc_ok for s in result.shards)
        self.summary.setText(
            f"{len(result.shards)} shards · {result.chunk_bytes.size - empty} chunks, {empty} empty (transparent "
            f"in the map) · {bad} index CRC mismatches · {result.bytes_read} index bytes read"
        )

    def _show_ratio(self, result: Inspection, name: str) -> None:
        """The compression ratio of every chunk, on the array's own pixels (NaN, transparent, where
        a chunk is empty); multiscale when a plane is too large to show at once."""
        ratio = result.chunk_ratio.astype(np.float32)
        if ratio.size == 0 or 0 in result.covered_shape:  # no shard yet: no map to draw
            return
        levels = PixelMap(ratio, result.chunk_shape, result.shape).levels(_MAX_MAP_PLANE)
        data = levels if len(levels) > 1 else levels[0]
        finite = ratio[np.isfinite(ratio)]
        limits = (float(finite.min()), float(max(finite.max(), finite.min() + 1e-3))) if finite.size else (0.0, 1.0)
        # The array's axis names, so that the viewer's sliders keep them (t, not -3) where the
        # inspector's layers are the only ones, or come before the data's.
        labels = {"axis_labels": result.axis_names} if result.axis_names else {}
        key = "chunk ratio"
        layer = self._layers.get(key)
        if layer is not None and layer in self.viewer.layers and layer.multiscale == (len(levels) > 1):
            layer.data = data
            layer.contrast_limits = limits
            if labels and tuple(layer.axis_labels) != tuple(result.axis_names or ()):
                layer.axis_labels = labels["axis_labels"]
            return
        if layer is not None and layer in self.viewer.layers:
            self.viewer.layers.remove(layer)
        layer = self.viewer.add_image(
            data,
            multiscale=len(levels) > 1,
            name=f"compression ratio per chunk: {name}",
            colormap="viridis",
            contrast_limits=limits,
            opacity=0.5,
            blending="translucent",
            metadata={OWN_LAYER_KEY: "inspector"},
            **labels,
        )
        layer.colorbar.visible = True
        self._layers[key] = layer

    # -- on-demand decode check ------------------------------------------------------------
    def _check_text(self, key: str) -> str:
        if self.check_report is None:
            return "-"
        inspection = self.inspection
        where = f"{inspection.array_path}/{key}" if inspection is not None and inspection.array_path else key
        problems = [p for p in self.check_report.problems if p.key == where]
        return "ok" if not problems else "; ".join(str(p.message) for p in problems[:2])

    def check_chunks(self):
        """Run verify() (every chunk decoded) on a worker thread with a progress bar."""
        import queue
        import threading

        from napari.qt.threading import thread_worker
        from napari.utils import progress

        if not self.path:
            return None
        path = self.path
        bar = progress(total=0, desc="checking chunks")

        @thread_worker
        def work():
            updates: queue.Queue = queue.Queue()
            result: dict = {}
            runner = threading.Thread(
                target=lambda: result.setdefault("report", verify(path, lambda d, n: updates.put((d, n))))
            )
            runner.start()
            while runner.is_alive() or not updates.empty():
                try:
                    yield updates.get(timeout=0.1)
                except queue.Empty:
                    continue
            return result["report"]

        def on_progress(update):
            done, total = update
            bar.total = total
            bar.n = done
            bar.refresh()

        def on_done(report):
            bar.close()
            self.check_report = report
            if self.inspection is not None:
                self._show(self.inspection)

        worker = work()
        worker.yielded.connect(on_progress)
        worker.returned.connect(on_done)
        self.check_button.setEnabled(False)
        worker.finished.connect(lambda: self.check_button.setEnabled(True))
        worker.start()
        return worker

    def _replace_shapes(self, key, grid, edge_color, edge_width, name, axis_labels=None):
        """The grid ``(plane, cell)`` as a Shapes layer; kept as it is when a refresh gives the same
        grid (a recording grows along the append dim only): re-adding layers stalls the GUI."""
        visible = (self.shard_grid if key == "shard grid" else self.tile_grid).isChecked()
        present = key in self._layers and self._layers[key] in self.viewer.layers
        signature = (tuple(grid[0]), tuple(grid[1]), name, axis_labels)
        if present and self._grids.get(key) == signature:
            return
        if present:
            self.viewer.layers.remove(self._layers[key])
        self._grids[key] = signature
        self._layers[key] = self.viewer.add_shapes(
            grid_rectangles(*grid),
            shape_type="rectangle",
            edge_color=edge_color,
            face_color="transparent",
            edge_width=edge_width,
            name=f"{key}: {name}",
            visible=visible,
            metadata={OWN_LAYER_KEY: "inspector"},
            **({"axis_labels": axis_labels} if axis_labels else {}),
        )

    def _set_visible(self, key, on) -> None:
        layer = self._layers.get(key)
        if layer is not None and layer in self.viewer.layers:
            layer.visible = on

    # -- navigation ----------------------------------------------------------------------
    def _on_select(self) -> None:
        selection = self.table.selectionModel()
        rows = selection.selectedRows() if selection is not None else []
        if not rows or self.inspection is None:
            return
        self.jump_to(rows[0].row())

    def jump_to(self, index: int) -> None:
        """Move the viewer to shard ``index`` of the table and outline it."""
        result = self.inspection
        if result is None:
            return
        shard = result.shards[index]
        start = [c * s for c, s in zip(shard.coords, result.shard_shape)]
        for axis in range(len(start) - 2):
            self.viewer.dims.set_current_step(axis, start[axis])
        y0, x0 = start[-2:]
        y1 = min(result.shape[-2], y0 + result.shard_shape[-2])
        x1 = min(result.shape[-1], x0 + result.shard_shape[-1])
        rect = [np.array([[y0, x0], [y1, x1]], dtype=float) - 0.5]
        key = "selected"
        if key in self._layers and self._layers[key] in self.viewer.layers:
            self._layers[key].data = rect
        else:
            self._layers[key] = self.viewer.add_shapes(
                rect,
                shape_type="rectangle",
                edge_color="red",
                face_color="transparent",
                edge_width=4,
                name="selected shard",
                **({"axis_labels": result.axis_names[-2:]} if result.axis_names else {}),
            )
        # napari 0.9 moved the camera to viewer.scene (viewer.camera warns); older releases lack it.
        camera = getattr(self.viewer, "scene", self.viewer).camera
        camera.center = ((y0 + y1) / 2, (x0 + x1) / 2)
