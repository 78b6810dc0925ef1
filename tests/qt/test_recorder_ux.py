"""The recorder as a microscopist meets it (issue 14's bugs), with a real viewer under Xvfb."""

from pathlib import Path

import numpy as np
import pytest
import zarr

pytest.importorskip("napari")
pytest.importorskip("qtpy")

from napari_tileshard import Dim, Layout, Writer, verify
from napari_tileshard.apps.inspect_shards import inspect_array
from napari_tileshard.apps.recorder import RecorderSettings

pytestmark = pytest.mark.qt


def small_layout(frame=(64, 48)):
    return Layout([Dim("t", 0, 4, 1), Dim("y", frame[0], 32, 2), Dim("x", frame[1], 16, 2)], "uint16")


@pytest.fixture
def docked(make_napari_viewer, qtbot):
    """The recorder docked as napari docks a plugin widget (with its title-bar close button)."""
    viewer = make_napari_viewer()
    dock, widget = viewer.window.add_plugin_dock_widget("napari-tileshard", "Tile/Shard Recorder")
    yield viewer, dock, widget
    widget.stop(wait=True)


def test_closing_the_dock_stops_and_finishes_the_recording(docked, qtbot, tmp_path):
    viewer, dock, widget = docked
    out = tmp_path / "closed.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", fps=200.0)
    widget.start()
    qtbot.waitUntil(lambda: widget.stats.frames >= 20, timeout=20_000)
    dock.destroyOnClose()  # what the dock's close button does
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    state = zarr.open_array(out).attrs["tileshard"]
    assert state["state"] == "complete"
    rows = state["rows_written"]
    qtbot.wait(500)  # nothing keeps writing once the dock is gone
    assert zarr.open_array(out).attrs["tileshard"]["rows_written"] == rows
    assert verify(out).ok


def test_choosing_a_layer_lays_out_the_frames(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    layer = viewer.add_image(np.zeros((96, 128), np.uint8), name="camera")
    form = widget.form
    form.output.value = str(tmp_path / "layer.zarr")
    form.source.value = "camera"
    settings = widget.settings  # no ValueError about mismatching frame shapes
    assert settings.layout.shape[1:] == (96, 128) and settings.layout.dtype == np.uint8
    assert all(t <= s for t, s in zip(settings.layout.tile_shape[1:], (96, 128)))
    assert widget.start_button.isEnabled(), form.message.text()
    form.table.item(1, 2).setText("32")  # the user can still edit the proposal
    assert widget.settings.layout.tile_shape[1] == 32
    layer.data = np.zeros((200, 300), np.uint16)  # the camera changes its ROI before Start
    assert widget.settings.layout.shape[1:] == (200, 300) and widget.settings.layout.dtype == np.uint16
    assert widget.start_button.isEnabled(), form.message.text()


def test_after_a_recording_the_next_one_gets_a_fresh_name_and_no_error(docked, qtbot, tmp_path):
    _, _, widget = docked
    out = tmp_path / "recording.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", fps=200.0)
    widget.start()
    qtbot.waitUntil(lambda: widget.stats.frames >= 8, timeout=20_000)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    assert widget.start_button.isEnabled(), widget.form.message.text()
    assert widget.form.output_text == str(tmp_path / "recording-002.zarr")
    assert "already exists" not in widget.form.message.text()
    assert "e05050" not in widget.form.message.styleSheet()  # not shown as an error
    assert widget.inspect().inspection is not None  # Inspect still opens the recording just made


def test_a_short_recording_is_previewed_after_stop(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    camera = viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")
    out = tmp_path / "short.zarr"
    layout = Layout([Dim("t", 0, 32, 1), Dim("y", 64, 32, 2), Dim("x", 48, 16, 2)], "uint16")
    widget.settings = RecorderSettings(output=str(out), layout=layout, backend="cpu", source="camera", policy="block")
    widget.start()
    for i in range(6):  # fewer than one shard epoch (32 frames)
        camera.data = np.full((64, 48), i + 1, np.uint16)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    layer = widget.preview.layer
    assert "waiting" not in layer.name
    assert layer.data.shape[0] == 6
    np.testing.assert_array_equal(np.asarray(layer.data[5]), np.full((64, 48), 6, np.uint16))


def test_the_mean_ratio_leaves_out_the_padding_of_a_partial_shard(tmp_path):
    layout = Layout([Dim("t", 0, 32, 1), Dim("y", 64, 32, 2), Dim("x", 48, 16, 2)], "uint16")
    frames = np.random.default_rng(0).integers(0, 4, (6, 64, 48)).astype(np.uint16)
    with Writer(tmp_path / "six.zarr", layout, backend="cpu") as writer:
        writer.append(frames)
    inspection = inspect_array(tmp_path / "six.zarr")
    stored = sum(s.compressed_bytes for s in inspection.shards)
    real = frames.nbytes / stored  # 6 frames were compressed into these bytes (plus 26 of padding)
    ratios = [s.mean_ratio for s in inspection.shards]
    assert all(abs(r - real) / real < 0.5 for r in ratios), (ratios, real)
    assert np.nanmax(inspection.chunk_ratio) < 32 / 6 * real


def test_overwrite_of_a_folder_that_is_not_ours_is_refused_before_start(docked, qtbot, tmp_path):
    viewer, _, widget = docked
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "chapter1.docx").write_bytes(b"irreplaceable")
    widget.settings = RecorderSettings(output=str(folder), layout=small_layout(), backend="cpu", overwrite=True)
    assert not widget.start_button.isEnabled()
    assert "chapter1.docx" in widget.form.message.text()
    layers_before = len(viewer.layers)
    widget.start()  # a programmatic start is refused the same way
    assert not widget.is_recording and len(viewer.layers) == layers_before
    assert (folder / "chapter1.docx").read_bytes() == b"irreplaceable"
    assert sorted(p.name for p in Path(folder).iterdir()) == ["chapter1.docx"]


def test_the_reader_carries_ome_units_into_the_layer(make_napari_viewer, tmp_path):
    layout = Layout(
        [
            Dim("t", 0, 4, 1, unit="second", scale=0.5),
            Dim("y", 64, 32, 2, unit="micrometer", scale=0.65),
            Dim("x", 48, 16, 2, unit="micrometer", scale=0.65),
        ],
        "uint16",
    )
    with Writer(tmp_path / "units.ome.zarr", layout, backend="cpu", ome=True) as writer:
        writer.append(np.zeros((8, 64, 48), np.uint16))
    viewer = make_napari_viewer()
    (layer,) = viewer.open(str(tmp_path / "units.ome.zarr"), plugin="napari-tileshard")
    assert [str(u) for u in layer.units] == ["second", "micrometer", "micrometer"]
    assert list(layer.scale) == [0.5, 0.65, 0.65]


def test_the_recorder_and_the_inspector_are_in_the_menus(make_napari_viewer):
    from napari._app_model import get_app_model

    make_napari_viewer()
    app = get_app_model()

    def titles(menu):
        return [
            getattr(getattr(i, "command", None), "title", None) or getattr(i, "title", None)
            for i in app.menus.get_menu(menu)
        ]

    assert "Tile/Shard Recorder (napari-tileshard)" in titles("napari/file/acquire")
    assert "Inspect shards (napari-tileshard)" in titles("napari/file/io_utilities")
    # the Plugins submenu is named after the plugin, not after one of its widgets
    assert "napari-tileshard" in titles("napari/plugins")


def test_a_slow_preview_read_never_holds_back_frames(docked, qtbot, tmp_path, monkeypatch):
    import time

    import napari_tileshard.apps.preview as preview  # the dock's PreviewReader reads through it

    real = preview.read_newest

    def slow_read(*args, **kwargs):  # a store that takes a second to read back (network share)
        time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(preview, "read_newest", slow_read)
    _, _, widget = docked
    out = tmp_path / "slow.zarr"
    widget.settings = RecorderSettings(
        output=str(out), layout=small_layout(), backend="cpu", fps=200.0, policy="drop", queue_frames=16
    )
    widget.start()
    qtbot.wait(2500)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=15_000)
    stats = widget.stats
    assert stats.dropped == 0, f"{stats.dropped} frames dropped while the preview read"
    assert stats.frames >= 300  # ~200 fps for 2.5 s
    assert verify(out).ok


def test_the_inspectors_refresh_reads_indexes_off_the_gui_thread(make_napari_viewer, qtbot, tmp_path, monkeypatch):
    import time

    import napari_tileshard._qt.inspector_widget as inspector_module
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    out = tmp_path / "growing.zarr"
    writer = Writer(out, small_layout(), backend="cpu")
    viewer = make_napari_viewer()
    inspector = InspectorWidget(viewer)
    inspector.open(out)  # a recording that has written nothing yet
    assert inspector.inspection is not None and not inspector.inspection.shards
    writer.append(np.zeros((4, 64, 48), np.uint16))
    writer.flush()
    inspector.open(out)
    shards_before = len(inspector.inspection.shards)
    assert shards_before
    writer.append(np.ones((8, 64, 48), np.uint16))
    writer.close()
    real = inspector_module.inspect_array

    def slow_inspect(path, **options):  # thousands of shards: seconds of index reads
        time.sleep(1.0)
        return real(path, **options)

    monkeypatch.setattr(inspector_module, "inspect_array", slow_inspect)
    started = time.perf_counter()
    inspector.refresh()
    assert time.perf_counter() - started < 0.2  # the GUI thread did not wait for the reads
    qtbot.waitUntil(lambda: len(inspector.inspection.shards) > shards_before, timeout=10_000)
    qtbot.waitUntil(lambda: not inspector.refreshing, timeout=5_000)


def test_the_preview_follows_the_newest_rows_without_reading_the_store_on_the_gui_thread(
    docked, qtbot, tmp_path, monkeypatch
):
    """While recording, the slider follows the newest complete row and the GUI thread decodes no
    tile: the frames it shows were read back on the reader thread (a decode of 16-frame-deep tiles
    per update held the GUI thread for 100-300 ms on the 2-core machine)."""
    import threading

    gui_thread = threading.current_thread()
    gui_reads = []  # zarr reads asked for on the GUI thread (zarr runs them on its own loop)
    real_getitem = zarr.Array.__getitem__

    def counting(self, selection):
        if threading.current_thread() is gui_thread:
            gui_reads.append(selection)
        return real_getitem(self, selection)

    monkeypatch.setattr(zarr.Array, "__getitem__", counting)
    viewer, _, widget = docked
    out = tmp_path / "follow.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", fps=200.0)
    widget.start()
    shown = []  # (rows in the layer, slider position) at each look

    def grown():
        layer = widget.preview.layer
        if layer is not None and not widget.preview.placeholder:
            shown.append((layer.data.shape[0], viewer.dims.current_step[0]))
        return len({rows for rows, _ in shown}) >= 4

    qtbot.waitUntil(grown, timeout=30_000)
    reads_while_recording = list(gui_reads)
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=10_000)
    assert all(step == rows - 1 for rows, step in shown), shown
    assert reads_while_recording == [], len(reads_while_recording)
    assert verify(out).ok


def test_several_layers_are_recorded_at_once_each_into_its_own_array(docked, qtbot, tmp_path):
    """Two cameras (layers of different frame shapes and dtypes): one collection, one array each,
    every frame where it belongs; the preview follows the first; the stats name both streams."""
    viewer, _, widget = docked
    left = viewer.add_image(np.zeros((64, 48), np.uint16), name="left")
    right = viewer.add_image(np.zeros((40, 72), np.uint8), name="right")
    form = widget.form
    form.output.value = str(tmp_path / "two.zarr")
    form.policy.value = "block"
    form.source.value = "left"
    form.more_sources.value = ["right"]
    settings = widget.settings
    assert list(settings.streams) == ["left", "right"]
    assert settings.streams["right"].shape[1:] == (40, 72) and settings.streams["right"].dtype == np.uint8
    assert widget.start_button.isEnabled(), form.message.text()
    widget.start()
    for i in range(5):
        left.data = np.full((64, 48), i + 1, np.uint16)
        right.data = np.full((40, 72), 10 * (i + 1), np.uint8)
    right.data = np.full((40, 72), 99, np.uint8)  # cameras need not be in step
    qtbot.waitUntil(lambda: widget.stats.frames == 11, timeout=20_000)
    qtbot.waitUntil(lambda: "left: 5 | right: 6" in widget.stats_label.text(), timeout=5_000)  # refreshed by a timer
    widget.stop()
    qtbot.waitUntil(lambda: not widget.is_recording, timeout=20_000)
    root = tmp_path / "two.zarr"
    assert zarr.open_group(root, mode="r").attrs["tileshard_collection"]["streams"] == {"left": "0", "right": "1"}
    np.testing.assert_array_equal(zarr.open_array(root / "0")[:, 0, 0], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(zarr.open_array(root / "1")[:, 0, 0], [10, 20, 30, 40, 50, 99])
    assert widget.preview.layer.data.shape == (5, 64, 48) and "[left]" in widget.preview.layer.name
    assert verify(root / "1").ok


def test_several_layers_need_a_layer_as_the_first_source(docked, tmp_path):
    viewer, _, widget = docked
    viewer.add_image(np.zeros((64, 48), np.uint16), name="left")
    form = widget.form
    form.output.value = str(tmp_path / "x.zarr")
    form.more_sources.value = ["left"]  # the source is still the synthetic camera
    with pytest.raises(ValueError, match="needs an image layer as the source"):
        _ = widget.settings
    assert not widget.start_button.isEnabled()
