"""The napari plugin under Xvfb: widget, recording on a QThread, preview, reader/writer/sample."""

import re
import warnings

import numpy as np
import pytest
import zarr

pytest.importorskip("napari")
pytest.importorskip("qtpy")

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer, verify
from napari_tileshard.apps.recorder import RecorderSettings
from napari_tileshard.format.layout import TilingWarning

pytestmark = pytest.mark.qt


@pytest.fixture
def widget(make_napari_viewer, qtbot):
    from napari_tileshard._qt.recorder_widget import RecorderWidget

    viewer = make_napari_viewer()
    w = RecorderWidget(viewer)
    viewer.window.add_dock_widget(w, name="Tile/Shard Recorder")
    yield w
    w.stop(wait=True)


def small_layout(frame=(64, 48), dtype="uint16"):
    return Layout([Dim("t", 0, 4, 1), Dim("y", frame[0], 32, 2), Dim("x", frame[1], 16, 2)], dtype)


def wait_until(qtbot, condition, timeout=30_000):
    qtbot.waitUntil(condition, timeout=timeout)


def test_record_synthetic_and_preview_grows(widget, qtbot, tmp_path):
    out = tmp_path / "synthetic.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", fps=200.0, seed=0)
    assert widget.start_button.isEnabled()
    widget.start()
    assert widget.is_recording
    extents = []

    def grown():
        layer = widget.preview.layer
        if layer is not None and not widget.preview.placeholder:  # zeros until the first shard epoch
            extents.append(layer.data.shape[0])
        return len(set(extents)) >= 3

    wait_until(qtbot, grown)
    # while recording: the rate of the last second, drops and the queue's depth (and its peak)
    live = re.compile(r"frames \d+ \(\d+\.\d/s\).* dropped 0 \| queue \d+ \(peak \d+\)")
    wait_until(qtbot, lambda: live.search(widget.stats_label.text()) is not None)
    widget.stop()
    wait_until(qtbot, lambda: not widget.is_recording)
    assert extents == sorted(extents) and all(e % 4 == 0 for e in extents)  # whole shard epochs only
    stats = widget.stats
    assert stats.error is None and stats.frames > 8 and stats.dropped == 0
    data = zarr.open_array(out)[:]
    np.testing.assert_array_equal(data, SyntheticCamera((64, 48), "uint16", seed=0).stack(stats.frames))
    assert widget.preview.layer.data.shape == data.shape  # the final array opens in place
    assert verify(out).ok
    assert "frames" in widget.stats_label.text()
    inspector = widget.inspect()  # reachable from the recorder after a recording
    assert len(inspector.inspection.shards) == 2 * -(-widget.stats.frames // 4)  # 2 shards per 4-frame epoch


def test_record_from_an_image_layer_frame_for_frame(widget, qtbot, tmp_path):
    viewer = widget.viewer
    camera_layer = viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")
    out = tmp_path / "layer.zarr"
    widget.settings = RecorderSettings(
        output=str(out), layout=small_layout(), backend="cpu", source="camera", policy="block"
    )
    widget.start()
    frames = [np.full((64, 48), i, np.uint16) + np.arange(48, dtype=np.uint16) for i in range(11)]
    for frame in frames:
        camera_layer.data = frame  # what a camera plugin does
    widget.stop()
    wait_until(qtbot, lambda: not widget.is_recording)
    np.testing.assert_array_equal(zarr.open_array(out)[:], np.stack(frames))


def test_what_a_tiling_costs_is_shown_under_the_form_and_start_stays_possible(widget, qtbot, tmp_path):
    out = tmp_path / "t6.zarr"
    layout = Layout.default_for((0, 512, 512), "uint16")
    widget.settings = RecorderSettings(output=str(out), layout=layout, backend="cpu", fps=100.0)
    form = widget.form
    assert form.notes.isHidden() and widget.start_button.isEnabled()  # the default: nothing to note
    for row in range(3):
        form.table.item(row, 2).setText("1")  # tiles of 1x1x1
    assert widget.start_button.isEnabled(), form.message.text()  # it records: a note, not an error
    notes = form.notes.text().splitlines()
    assert notes[0].startswith("note: chunks of 1x1x1 uint16 are 2 bytes, under 4 KiB")
    assert notes[1].startswith("note: shards of 16x2x2 uint16 make 7,812,500 files per GB of data")
    assert not form.notes.isHidden() and "e05050" not in form.message.styleSheet()
    form.table.item(0, 2).setText("2")
    form.table.item(1, 2).setText("1000")  # larger than the frame: clamped, as on the command line
    form.table.item(2, 2).setText("256")
    assert form.notes.text() == "note: tile 1000 along 'y' is larger than the dimension (512): using 512"
    assert widget.settings.layout.tile_shape == (2, 512, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TilingWarning)  # shown under the form: not again at Start
        widget.start()
    assert widget.is_recording
    wait_until(qtbot, lambda: widget.stats.rows_complete >= 2)
    widget.stop()
    wait_until(qtbot, lambda: not widget.is_recording)
    assert widget.stats.error is None and zarr.open_array(out).metadata.codecs[0].chunk_shape == (2, 512, 256)
    form.table.item(1, 2).setText("256")
    assert form.notes.isHidden() and form.notes.text() == ""


def test_invalid_settings_disable_start_and_explain(widget, tmp_path):
    widget.settings = RecorderSettings(output=str(tmp_path / "v.zarr"), layout=small_layout(), backend="cpu")
    assert widget.start_button.isEnabled() and "tile" in widget.form.figures.text()
    form = widget.form
    form.table.item(1, 2).setText("0")  # tile size 0
    assert not widget.start_button.isEnabled()
    assert "tile_size must be >= 1, got 0" in form.message.text()
    form.table.item(1, 2).setText("abc")
    assert "must be integers" in form.message.text()
    form.table.item(1, 2).setText("32")
    assert widget.start_button.isEnabled()
    form.table.item(1, 4).setText("-0.5")  # a negative pixel size
    assert not widget.start_button.isEnabled() and "scale must be a positive" in form.message.text()
    form.table.item(1, 4).setText("0.65")
    assert widget.start_button.isEnabled() and widget.settings.layout.dims[1].scale == 0.65
    with Writer(tmp_path / "v.zarr", small_layout(), backend="cpu") as writer:  # an earlier recording
        writer.append(np.zeros((4, 64, 48), np.uint16))
    form.output.line_edit.value = ""  # emptied as typed
    assert "output path is empty" in form.message.text()
    form.output.value = str(tmp_path / "v.zarr")
    assert not widget.start_button.isEnabled() and "already exists" in form.message.text()
    form.overwrite.value = True
    assert widget.start_button.isEnabled()


def test_writer_error_is_notified_and_store_stays_readable(widget, qtbot, tmp_path, monkeypatch):
    errors = []
    monkeypatch.setattr("napari.utils.notifications.show_error", errors.append)
    viewer = widget.viewer
    camera_layer = viewer.add_image(np.zeros((64, 48), np.uint16), name="camera")
    out = tmp_path / "err.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", source="camera")
    widget.start()
    for i in range(5):
        camera_layer.data = np.full((64, 48), i, np.uint16)
    camera_layer.data = np.zeros((10, 10), np.uint16)  # the camera changes frame size mid-recording
    wait_until(qtbot, lambda: not widget.is_recording)
    assert errors and "frame shape" in errors[0]
    assert "frame shape" in widget.form.message.text()
    np.testing.assert_array_equal(
        zarr.open_array(out)[:], np.stack([np.full((64, 48), i, np.uint16) for i in range(5)])
    )


@pytest.mark.parametrize("closing", ["widget", "viewer"])
def test_closing_finalizes_the_recording(make_napari_viewer, qtbot, tmp_path, closing):
    from napari_tileshard._qt.recorder_widget import RecorderWidget

    viewer = make_napari_viewer(show=True)
    widget = RecorderWidget(viewer)
    viewer.window.add_dock_widget(widget)
    out = tmp_path / f"{closing}-close.zarr"
    widget.settings = RecorderSettings(output=str(out), layout=small_layout(), backend="cpu", fps=500.0)
    widget.start()
    wait_until(qtbot, lambda: widget.stats.frames > 6)
    (widget if closing == "widget" else viewer).close()
    assert not widget.is_recording
    assert zarr.open_array(out).shape[0] == widget.stats.frames > 6
    assert verify(out).ok


def test_reader_writer_and_sample_contributions(make_napari_viewer, tmp_path):
    import npe2

    viewer = make_napari_viewer()
    manifest = npe2.PluginManager.instance().get_manifest("napari-tileshard")
    assert {w.display_name for w in manifest.contributions.widgets} == {"Tile/Shard Recorder", "Inspect shards"}
    viewer.open_sample("napari-tileshard", "synthetic")
    sample = viewer.layers["synthetic microscope"]
    assert sample.data.shape == (200, 512, 512)
    out = str(tmp_path / "saved.zarr")
    viewer.layers.selection = {sample}
    written = viewer.layers.save(out, selected=True, plugin="napari-tileshard")  # File > Save through npe2
    assert written == [out]
    meta = zarr.open_array(out).metadata
    assert meta.dimension_names == ("t", "y", "x") and meta.codecs[0].__class__.__name__ == "ShardingCodec"
    layers = viewer.open(out, plugin="napari-tileshard")
    np.testing.assert_array_equal(np.asarray(layers[0].data[:3]), sample.data[:3])
    assert tuple(layers[0].axis_labels) == ("t", "y", "x")


def test_reader_declines_what_it_cannot_read(tmp_path):
    from napari_tileshard.apps.napari_reader import napari_get_reader

    (tmp_path / "notes.txt").write_text("x")
    assert napari_get_reader(str(tmp_path / "notes.txt")) is None
    assert napari_get_reader(str(tmp_path)) is None
    v2 = tmp_path / "v2.zarr"
    v2.mkdir()
    (v2 / ".zarray").write_text("{}")
    assert napari_get_reader(str(v2)) is None


def test_ome_recording_previews_the_pyramid(widget, qtbot, tmp_path):
    """OME-Zarr switch: the store is a pyramid group and the preview a multiscale layer that grows."""
    out = tmp_path / "ome.zarr"
    widget.settings = RecorderSettings(
        output=str(out), layout=small_layout((128, 96)), backend="cpu", fps=200.0, ome=True, downsample="max"
    )
    for row, (scale, unit) in enumerate([("0.05", "second"), ("0.65", "micrometer"), ("0.65", "micrometer")]):
        widget.form.table.item(row, 4).setText(scale)
        widget.form.table.item(row, 5).setText(unit)
    assert widget.form.downsample.enabled and "pyramid levels" in widget.form.figures.text()
    widget.start()

    def multiscale_grew():
        layer = widget.preview.layer
        return layer is not None and layer.multiscale and layer.data[0].shape[0] >= 8

    wait_until(qtbot, multiscale_grew)
    widget.stop()
    wait_until(qtbot, lambda: not widget.is_recording)
    stats = widget.stats
    assert stats.error is None
    layer = widget.preview.layer
    assert layer.multiscale and len(layer.data) == 4  # 128x96 -> 64x48 -> 32x24 -> 16x12 fits a 32x16 tile
    frames = SyntheticCamera((128, 96), "uint16", seed=0).stack(stats.frames)
    pyramid = widget.preview.pyramid
    for level, expected in zip(layer.data, pyramid.reference(frames)):
        np.testing.assert_array_equal(np.asarray(level), expected)
    assert verify(out).ok
    multiscale = zarr.open_group(out, mode="r").attrs["ome"]["multiscales"][0]
    assert multiscale["axes"][1] == {"name": "y", "type": "space", "unit": "micrometer"}
    assert multiscale["datasets"][2]["coordinateTransformations"][0]["scale"] == pytest.approx([0.05, 2.6, 2.6])


def test_reader_opens_an_ome_group_as_multiscale(make_napari_viewer, tmp_path):
    from napari_tileshard import Writer

    layout = Layout(
        [
            Dim("t", 0, 2, 1),
            Dim("y", 64, 16, 2, unit="micrometer", scale=0.5),
            Dim("x", 48, 16, 2, unit="micrometer", scale=0.5),
        ],
        "uint16",
    )
    out = tmp_path / "group.zarr"
    with Writer(out, layout, backend="cpu", ome=True) as writer:
        writer.append(SyntheticCamera((64, 48), "uint16", seed=1).stack(4))
    viewer = make_napari_viewer()
    (layer,) = viewer.open(str(out), plugin="napari-tileshard")
    assert layer.multiscale and len(layer.data) == writer.pyramid.levels
    assert tuple(layer.scale) == (1.0, 0.5, 0.5) and tuple(layer.axis_labels) == ("t", "y", "x")


def test_preview_survives_a_hostile_zarr_json(widget, tmp_path):
    """A zarr.json replaced mid-recording by one declaring huge frames: a warning, no allocation, no crash."""
    import json

    out = tmp_path / "hostile.zarr"
    out.mkdir()
    widget.preview.begin(RecorderSettings(output=str(out), layout=small_layout(), backend="cpu"), placeholder=False)
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [10, 2**20, 2**20],
        "data_type": "uint16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 1024, 1024]}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }
    (out / "zarr.json").write_text(json.dumps(meta))
    widget.preview.update(5)
    assert widget.preview.layer is None and "too large to display" in widget.preview.error
    (out / "zarr.json").write_text("{ not json")
    widget.preview.update(6)  # unreadable: still no exception
    assert widget.preview.layer is None


def test_save_does_not_follow_the_recorders_settings(widget, qtbot, tmp_path):
    """File > Save writes the same store before and after a recording with other tiling, codec and level."""
    import json
    from pathlib import Path

    viewer = widget.viewer
    stack = viewer.add_image(
        SyntheticCamera((64, 48), "uint16", seed=2).stack(6), name="stack", axis_labels=("t", "y", "x")
    )

    def save(name):
        out = str(tmp_path / name)
        viewer.layers.selection = {stack}
        assert viewer.layers.save(out, selected=True, plugin="napari-tileshard") == [out]
        files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}
        return json.loads(files.pop("zarr.json")), files

    before = save("before.zarr")
    assert before[0]["codecs"][0]["configuration"]["chunk_shape"] == [6, 64, 48]  # the default layout
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 64, 16, 1), Dim("x", 48, 8, 3)], "uint16")
    widget.settings = RecorderSettings(
        output=str(tmp_path / "rec.zarr"), layout=layout, codec="none", level=5, backend="cpu", fps=200.0
    )
    widget.start()
    wait_until(qtbot, lambda: widget.stats.shards_written > 0)
    widget.stop()
    wait_until(qtbot, lambda: not widget.is_recording)
    recorded = zarr.open_array(tmp_path / "rec.zarr")
    assert (recorded.chunks, recorded.shards) == ((2, 16, 8), (2, 16, 24))  # it did record with its own tiling
    assert save("after.zarr") == before


def test_codec_list_and_level_range_come_from_the_registry(widget):
    from napari_tileshard.format import codecs

    combo = widget.form.codec
    assert list(combo.choices) == list(codecs.names())
    combo.value = "blosc-lz4"
    assert (widget.form.level.min, widget.form.level.max) == codecs.get("blosc-lz4").level_range
    combo.value = "none"
    assert not widget.form.level.enabled
    combo.value = "zstd"
    assert widget.form.level.enabled and widget.form.level.max == 22


def test_the_output_keeps_a_store_url_as_typed(widget):
    widget.form.output.line_edit.value = "s3://bucket/run.zarr"  # the magicgui file field, typed into
    assert widget.settings.output == "s3://bucket/run.zarr"  # not a Path, which would drop a slash


def test_the_unit_column_takes_symbols_and_explains_a_unit_ome_zarr_does_not_know(widget, tmp_path):
    widget.settings = RecorderSettings(output=str(tmp_path / "u.zarr"), layout=small_layout(), backend="cpu", ome=True)
    form = widget.form
    form.table.item(0, 5).setText("ms")
    form.table.item(1, 5).setText("µm")
    form.table.item(2, 5).setText("um")
    assert widget.start_button.isEnabled(), form.message.text()
    assert [d.unit for d in widget.settings.layout.dims] == ["millisecond", "micrometer", "micrometer"]
    form.table.item(2, 5).setText("microns per pixel")
    assert not widget.start_button.isEnabled()
    assert "dimension 'x'" in form.message.text() and "'microns per pixel'" in form.message.text()
    form.table.item(2, 5).setText("mircometer")
    assert "did you mean 'micrometer'?" in form.message.text()
    form.table.item(0, 5).setText("um")  # a space unit on the time axis
    assert "dimension 't'" in form.message.text() and "is a space unit" in form.message.text()
    form.table.item(0, 5).setText("")
    form.table.item(2, 5).setText("micrometer")
    assert widget.start_button.isEnabled(), form.message.text()
