"""The microscopist's day (issue items 1, 6, 7), with a real viewer under Xvfb: recording from
stack and live layers, a dock that reads at napari's default window size with the inspector
docked too, and the inspector opened from the menu."""

from pathlib import Path

import numpy as np
import pytest
import zarr

pytest.importorskip("napari")
pytest.importorskip("qtpy")

from napari_tileshard import Dim, Layout, Writer, verify
from napari_tileshard.apps.recorder import WAIT_HINT_S, RecorderSettings, recent_recordings

pytestmark = pytest.mark.qt


def small_layout(frame=(64, 48)):
    return Layout([Dim("t", 0, 4, 1), Dim("y", frame[0], 32, 2), Dim("x", frame[1], 16, 2)], "uint16")


@pytest.fixture
def docked(make_napari_viewer, qtbot):
    """The recorder docked as napari docks a plugin widget (a window not shown: napari's leak check
    finds the viewer of a shown one still referenced when this fixture stops the recording)."""
    viewer = make_napari_viewer()
    dock, widget = viewer.window.add_plugin_dock_widget("napari-tileshard", "Tile/Shard Recorder")
    yield viewer, dock, widget
    widget.stop(wait=True)


def frames_in_status(widget) -> int | None:
    """The frame count the status line shows (None before its first refresh)."""
    text = widget.stats_label.text()
    return int(text.split("frames ")[1].split(" ")[0]) if "frames " in text else None


# -- 1. recording from a layer ------------------------------------------------------------------
def test_a_stack_layer_records_each_plane_once_and_the_recording_ends_by_itself(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    stack = np.random.default_rng(2).integers(0, 4000, (40, 64, 48)).astype(np.uint16)
    viewer.add_image(stack, name="stack")
    out = tmp_path / "stack.zarr"
    widget.form.source.value = "stack"
    widget.form.output.value = str(out)
    assert widget.settings.layout.shape == (0, 64, 48), widget.form.message.text()
    widget.start()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=30_000)  # nobody pressed Stop
    np.testing.assert_array_equal(zarr.open_array(out)[:], stack)
    assert widget.stats.frames == widget.stats.rows_complete == 40
    assert frames_in_status(widget) == 40
    message = widget.form.message.text()
    assert message.startswith("all 40 planes of layer 'stack' were recorded: recorded 40 frames into stack.zarr")
    assert str(out) in widget.form.message.toolTip()
    assert widget.preview.layer.data.shape == (40, 64, 48)
    assert verify(out).ok


def test_a_live_layer_records_a_frame_per_assignment_and_per_refresh_of_an_in_place_change(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    camera = viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")
    out = tmp_path / "live.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", source="camera")
    widget.start()
    frames = [np.full((64, 48), i + 1, np.uint16) for i in range(5)]
    for frame in frames:
        camera.data = frame
    qtbot.waitUntil(lambda: widget.stats.frames == 5, timeout=10_000)
    expected = [frame.copy() for frame in frames]
    camera.data[10, 20] = 999  # a live-view plugin writing into the layer's buffer ...
    camera.refresh()  # ... and asking napari to redraw it
    qtbot.waitUntil(lambda: widget.stats.frames == 6, timeout=10_000)
    camera.visible = False  # redraws that change nothing record nothing
    camera.visible = True
    camera.contrast_limits = (0, 500)
    qtbot.waitUntil(lambda: frames_in_status(widget) == 6, timeout=5_000)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    written = zarr.open_array(out)[:]
    np.testing.assert_array_equal(written, np.stack([*expected, camera.data]))
    assert widget.stats.frames == written.shape[0] == frames_in_status(widget) == 6


def test_a_live_layer_that_does_not_change_says_so_and_an_empty_recording_leaves_no_store(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")
    out = tmp_path / "idle.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", source="camera")
    widget.start()
    qtbot.waitUntil(
        lambda: "waiting for layer 'camera' to change" in widget.stats_label.text(),
        timeout=int((WAIT_HINT_S + 5) * 1000),
    )
    assert "refresh()" in widget.stats_label.text()
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    assert not out.exists()  # no empty array marked complete
    assert widget.form.message.text() == (
        "nothing was recorded (layer 'camera' did not change): the empty store idle.zarr was removed"
    )
    assert widget.form.output_text == str(out)  # the name is free again: no -002
    assert widget.preview.layer is None and not [layer for layer in viewer.layers if "preview" in layer.name]
    assert str(out) not in list(recent_recordings)


def test_closing_the_dock_mid_recording_keeps_what_was_recorded_or_leaves_nothing(docked, qtbot, tmp_path):
    viewer, dock, widget = docked
    camera = viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")
    out = tmp_path / "closed.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", source="camera")
    widget.start()
    for i in range(3):
        camera.data = np.full((64, 48), i, np.uint16)
    qtbot.waitUntil(lambda: widget.stats.frames == 3, timeout=10_000)
    dock.destroyOnClose()  # the dock's close button
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    assert zarr.open_array(out).attrs["tileshard"]["state"] == "complete"
    assert zarr.open_array(out).shape[0] == 3 and verify(out).ok


# -- 6. the dock ----------------------------------------------------------------------------------
def test_the_dock_reads_at_the_default_window_size_with_the_inspector_docked(make_napari_viewer, qtbot):
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    viewer = make_napari_viewer(show=True)  # napari's own window size, themed
    _, widget = viewer.window.add_plugin_dock_widget("napari-tileshard", "Tile/Shard Recorder")
    viewer.window.add_dock_widget(InspectorWidget(viewer), name="Inspect shards", area="right")
    qtbot.waitUntil(lambda: widget.form.table.isVisible(), timeout=5_000)
    qtbot.wait(100)
    table = widget.form.table
    header = table.horizontalHeader()
    rows = sum(table.rowHeight(r) for r in range(table.rowCount()))
    assert table.rowCount() == 3 and table.viewport().height() >= rows  # every dimension row shows
    assert sum(header.sectionSize(c) for c in range(table.columnCount())) <= table.viewport().width()
    metrics = header.fontMetrics()
    for col in range(table.columnCount()):  # no header cut ("e (0 = unbound")
        title = table.horizontalHeaderItem(col).text()
        assert metrics.horizontalAdvance(title) <= header.sectionSize(col), title
        assert table.horizontalHeaderItem(col).toolTip()  # the long meaning is in the tooltip
    assert not widget.form.advanced.isExpanded() and not widget.form.figures.isVisible()
    widget.form.advanced.expand(animate=False)  # the rarely changed settings open on demand
    qtbot.waitUntil(lambda: widget.form.figures.isVisible(), timeout=5_000)
    assert widget.form.advanced.content().height() >= widget.form.codec.native.geometry().bottom()


def test_also_record_offers_only_image_streams(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    viewer.add_image(np.zeros((64, 48), np.uint16), name="left")
    viewer.add_image(np.zeros((64, 48), np.uint16), name="right")
    viewer.add_image(np.zeros((64, 48, 3), np.uint8), name="photo", rgb=True)
    with Writer(tmp_path / "earlier.zarr", small_layout(), backend="cpu") as writer:
        writer.append(np.ones((4, 64, 48), np.uint16))
    widget.inspect().open(tmp_path / "earlier.zarr")  # the inspector adds its ratio map, an image layer
    assert any(layer.name.startswith("compression ratio per chunk") for layer in viewer.layers)
    widget.settings = RecorderSettings(output=str(tmp_path / "x.zarr"), layout=small_layout(), backend="cpu")
    widget.start()  # a recording adds its preview, another image layer
    qtbot.waitUntil(lambda: widget.stats.frames > 0, timeout=20_000)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    form = widget.form
    form.source.value = "left"
    assert list(form.more_sources.choices) == ["right"]
    assert [n for n in form.source.choices if n not in ("synthetic", "Micro-Manager (pymmcore-plus)")] == [
        "left",
        "right",
    ]


def test_the_message_about_the_last_recording_stays_until_the_next_start(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    widget.settings = RecorderSettings(output=str(tmp_path / "a.zarr"), layout=small_layout(), backend="cpu")
    widget.start()
    qtbot.waitUntil(lambda: widget.stats.frames > 0, timeout=20_000)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    message = widget.form.message.text()
    assert "into a.zarr; the next goes to a-002.zarr" in message
    viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")  # used to wipe the message
    widget.form.codec.value = "none"
    assert widget.form.message.text() == message
    widget.start()
    assert widget.form.message.text() == ""


# -- 7. the inspector from the menu ---------------------------------------------------------------
def test_the_inspector_from_the_menu_offers_a_picker_and_this_sessions_recordings(
    make_napari_viewer, qtbot, tmp_path, monkeypatch
):
    from qtpy.QtWidgets import QFileDialog

    from napari_tileshard._qt.inspector_widget import InspectorWidget

    viewer = make_napari_viewer()
    outputs = []
    for name in ("first.zarr", "second.zarr"):
        with Writer(tmp_path / name, small_layout(), backend="cpu") as writer:
            writer.append(np.ones((4, 64, 48), np.uint16))
        recent_recordings.add(tmp_path / name)
        outputs.append(str(tmp_path / name))
    _, inspector = viewer.window.add_plugin_dock_widget("napari-tileshard", "Inspect shards")
    assert isinstance(inspector, InspectorWidget)
    assert inspector.path_edit.text() == outputs[1]  # the latest recording, one click away
    inspector.path_box.showPopup()
    listed = [inspector.path_box.itemText(i) for i in range(inspector.path_box.count())]
    inspector.path_box.hidePopup()
    assert listed[:2] == [outputs[1], outputs[0]]  # most recent first
    inspector.path_box.activated.emit(1)  # picking one from the list inspects it
    assert inspector.path == outputs[0] and inspector.inspection is not None
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *args: outputs[1])
    assert inspector.browse() == outputs[1] and inspector.path == outputs[1]


def test_the_inspectors_map_spans_exactly_the_array(make_napari_viewer, tmp_path):
    """300 x 400 frames in 256 x 256 tiles, 2050 rows in 16-row tiles: the map used to cover the
    padded 512 x 512 tiles and the slider ran to 2063."""
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    layout = Layout([Dim("t", 0, 16, 1), Dim("y", 300, 256, 2), Dim("x", 400, 256, 2)], "uint8")
    path = tmp_path / "odd.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(np.random.default_rng(0).integers(0, 3, (2050, 300, 400), dtype=np.uint8))
    viewer = make_napari_viewer()
    inspector = InspectorWidget(viewer)
    inspector.open(Path(path))
    (ratio,) = [layer for layer in viewer.layers if layer.name.startswith("compression ratio")]
    assert ratio.data.shape == (2050, 300, 400)
    assert viewer.dims.range[0].stop == 2049
    assert [r.stop for r in viewer.dims.range[1:]] == [299.5, 399.5]  # pixel edges; padded: 511.5
    chunk_ratio = inspector.inspection.chunk_ratio
    plane = np.asarray(ratio.data[2049])  # the last row: in the 129th tile of 16 rows
    assert plane.shape == (300, 400)
    assert plane[299, 399] == np.float32(chunk_ratio[128, 1, 1]) and plane[0, 0] == np.float32(chunk_ratio[128, 0, 0])
