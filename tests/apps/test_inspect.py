"""Shard inspector core: maps from the indexes only, checked against a full independent parse."""

import numpy as np
import zarr
from zarr.storage import LocalStore

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.apps.inspect_shards import EMPTY_CHUNK, inspect_array


class CountingStore(LocalStore):
    """Counts the bytes handed out for shard objects."""

    shard_bytes = 0

    async def get(self, key, prototype=None, byte_range=None):
        buffer = await super().get(key, prototype, byte_range)
        if key.startswith("c/") and buffer is not None:
            type(self).shard_bytes += len(buffer.to_bytes())
        return buffer


def test_chunk_map_equals_full_parse_and_reads_only_indexes(tmp_path):
    # odd layout: edge shards along y and x, a partial last shard epoch along t
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 40, 16, 2), Dim("x", 24, 8, 2)], "uint16")
    path = tmp_path / "odd.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(SyntheticCamera((40, 24), "uint16", seed=1).stack(7))
    CountingStore.shard_bytes = 0
    result = inspect_array(CountingStore(path, read_only=True))
    assert result.chunk_bytes.shape == (4, 3, 3)  # chunk grid
    # independent: decode each chunk's size from the full shard bytes
    expected = np.full((4, 3, 3), EMPTY_CHUNK)
    for shard in (path / "c").rglob("*"):
        if not shard.is_file():
            continue
        t, y, x = map(int, shard.relative_to(path / "c").parts)
        raw = shard.read_bytes()
        index = np.frombuffer(raw[-(8 * 16 + 4) : -4], "<u8").reshape(2, 2, 2, 2)
        for wt in range(2):
            for wy in range(2):
                for wx in range(2):
                    ct, cy, cx = 2 * t + wt, 2 * y + wy, 2 * x + wx
                    if ct < 4 and cy < 3 and cx < 3 and index[wt, wy, wx, 0] != 2**64 - 1:
                        expected[ct, cy, cx] = index[wt, wy, wx, 1]
    np.testing.assert_array_equal(result.chunk_bytes, expected)
    assert (result.chunk_bytes[3, :, :] == EMPTY_CHUNK).sum() == 0  # 7 frames -> chunk row 3 has frame 6
    n_shards = len(result.shards)
    assert n_shards == 2 * 2 * 2
    assert CountingStore.shard_bytes == n_shards * (8 * 16 + 4)  # index bytes only, never chunk data
    assert all(s.crc_ok for s in result.shards)
    edge = next(s for s in result.shards if s.coords == (0, 1, 1))
    # one chunk row (y 32..40) x one column (x 16..24)
    assert edge.chunks_possible == 8 and edge.chunks_present == 2 * 1 * 1
    assert np.nanmin(result.chunk_ratio) > 1


def test_corrupted_index_shows_as_crc_mismatch(tmp_path):
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 32, 8, 2)], "uint16")
    path = tmp_path / "c.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(np.arange(4 * 32, dtype=np.uint16).reshape(4, 32))
    shard = path / "c" / "1" / "0"
    raw = bytearray(shard.read_bytes())
    raw[-8] ^= 0x01
    shard.write_bytes(bytes(raw))
    rows = {s.key: s.crc_ok for s in inspect_array(path).shards}
    assert rows["c/1/0"] is False and rows["c/0/0"] is True
    assert zarr.open_array(path).shape == (4, 32)


def test_inspector_widget_overlays_and_table(make_napari_viewer, qtbot, tmp_path):
    import pytest

    pytest.importorskip("napari")
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 40, 16, 2), Dim("x", 24, 8, 2)], "uint16")
    path = tmp_path / "odd.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(SyntheticCamera((40, 24), "uint16", seed=1).stack(7))
    viewer = make_napari_viewer()
    viewer.add_image(zarr.open_array(path)[:], name="data")
    shard = path / "c" / "0" / "0" / "0"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-6] + bytes([raw[-6] ^ 1]) + raw[-5:])  # flip a bit inside the index
    widget = InspectorWidget(viewer)
    widget.open(str(path))
    shard_grid = widget._layers["shard grid"]
    tile_grid = widget._layers["tile grid"]
    # shards of 32 x 16 px over a 40 x 24 plane: 2 x 2, edge shards clipped to the array
    corners = sorted((tuple(r.min(axis=0) + 0.5), tuple(r.max(axis=0) + 0.5)) for r in shard_grid.data)
    assert corners == [((0, 0), (32, 16)), ((0, 16), (32, 24)), ((32, 0), (40, 16)), ((32, 16), (40, 24))]
    assert len(tile_grid.data) == 3 * 3  # tiles of 16 x 8
    ratio_layer = widget._layers["chunk ratio"]
    # the map spans exactly the array (7 x 40 x 24), not the padded chunk grid (8 x 48 x 24):
    # each pixel shows the ratio of the chunk holding it, empty chunks NaN (transparent)
    assert ratio_layer.data.shape == (7, 40, 24) and tuple(ratio_layer.scale) == (1, 1, 1)
    ratio = widget.inspection.chunk_ratio
    expanded = np.repeat(np.repeat(np.repeat(ratio, 2, 0), 16, 1), 8, 2)[:7, :40, :24]
    np.testing.assert_array_equal(np.asarray(ratio_layer.data), expanded.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(ratio), widget.inspection.chunk_bytes == EMPTY_CHUNK)
    assert np.all(np.asarray(ratio_layer.data[0, 16:32, 16:24]) == np.float32(ratio[0, 1, 2]))
    assert viewer.dims.range[0].stop == 6  # the slider ends at the last row
    crc = {widget.table.item(i, 0).text(): widget.table.item(i, 4).text() for i in range(widget.table.rowCount())}
    assert crc["c/0/0/0"] == "mismatch" and list(crc.values()).count("ok") == 7
    row = [widget.table.item(i, 0).text() for i in range(widget.table.rowCount())].index("c/1/1/1")
    widget.jump_to(row)
    assert viewer.dims.current_step[0] == 4  # shard epoch 1 starts at frame 4
    selected = widget._layers["selected"].data[0]
    assert tuple(selected.min(axis=0) + 0.5) == (32, 16) and tuple(selected.max(axis=0) + 0.5) == (40, 24)
    # the on-demand chunk check runs on a worker thread and fills the last column
    worker = widget.check_chunks()
    qtbot.waitUntil(lambda: widget.check_report is not None, timeout=20_000)
    qtbot.waitUntil(lambda: not worker.is_running, timeout=20_000)
    checks = {widget.table.item(i, 0).text(): widget.table.item(i, 5).text() for i in range(widget.table.rowCount())}
    assert "CRC32C" in checks["c/0/0/0"] and checks["c/1/1/1"] == "ok"


def test_unsharded_and_foreign_arrays(tmp_path):
    # unsharded zarr-python array: chunk grid and per-chunk object sizes
    plain = zarr.create_array(
        tmp_path / "plain.zarr",
        shape=(5, 9),
        chunks=(2, 4),
        dtype="uint16",
        compressors=zarr.codecs.ZstdCodec(level=1),
        fill_value=0,
    )
    plain[:] = np.arange(45, dtype=np.uint16).reshape(5, 9)
    result = inspect_array(tmp_path / "plain.zarr")
    assert result.chunk_bytes.shape == (3, 3) and (result.chunk_bytes > 0).all()
    sizes = {
        p.relative_to(tmp_path / "plain.zarr" / "c").as_posix(): p.stat().st_size
        for p in (tmp_path / "plain.zarr" / "c").rglob("*")
        if p.is_file()
    }
    assert result.chunk_bytes[2, 1] == sizes["2/1"]
    # sharded array written by tensorstore
    ts = __import__("pytest").importorskip("tensorstore")
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path / "ts.zarr")},
        "metadata": {
            "shape": [6, 10],
            "data_type": "uint16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 8]}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [2, 4],
                        "codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "zstd", "configuration": {"level": 1}},
                        ],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    },
                }
            ],
        },
        "create": True,
    }
    store = ts.open(spec).result()
    store[...].write(np.arange(60, dtype=np.uint16).reshape(6, 10)).result()
    foreign = inspect_array(tmp_path / "ts.zarr")
    assert foreign.chunk_bytes.shape == (3, 3) and (foreign.chunk_bytes > 0).all()
    assert all(s.crc_ok for s in foreign.shards) and len(foreign.shards) == 4


def test_ten_thousand_shards_open_from_index_bytes_only(tmp_path):
    import time

    layout = Layout([Dim("t", 0, 1, 1), Dim("x", 100, 1, 1)], "uint8")  # one chunk per shard
    path = tmp_path / "many.zarr"
    with Writer(path, layout, backend="cpu", codec="none") as writer:
        writer.append(np.arange(100 * 100, dtype=np.uint64).astype(np.uint8).reshape(100, 100))
    CountingStore.shard_bytes = 0
    start = time.perf_counter()
    result = inspect_array(CountingStore(path, read_only=True))
    elapsed = time.perf_counter() - start
    assert len(result.shards) == 10_000
    assert CountingStore.shard_bytes == 10_000 * (16 + 4)  # one index per shard, no chunk data
    assert elapsed < 60


def test_new_shards_appear_on_refresh_and_other_writers(tmp_path):
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 16, 8, 1)], "uint16")
    path = tmp_path / "growing.zarr"
    writer = Writer(path, layout, backend="cpu", batch_bytes=1, max_latency_s=0.01)
    writer.append(np.zeros((2, 16), np.uint16))
    writer.flush()
    first = len(inspect_array(path).shards)
    writer.append(np.ones((4, 16), np.uint16))
    writer.flush()
    assert len(inspect_array(path).shards) == first + 4  # two more shard epochs x two shards
    writer.close()
    # zarr-python's own sharded writer
    sharded = zarr.create_array(
        tmp_path / "zp.zarr", shape=(4, 16), chunks=(2, 8), shards=(2, 16), dtype="uint16", fill_value=0
    )
    sharded[:] = np.arange(64, dtype=np.uint16).reshape(4, 16)
    zp = inspect_array(tmp_path / "zp.zarr")
    assert len(zp.shards) == 2 and (zp.chunk_bytes > 0).all() and all(s.crc_ok for s in zp.shards)


def test_acquire_zarr_output(tmp_path):
    az = __import__("pytest").importorskip("acquire_zarr")
    settings = az.StreamSettings(store_path=str(tmp_path / "az.zarr"), overwrite=True)
    settings.arrays = [
        az.ArraySettings(
            output_key="0",
            data_type=az.DataType.UINT16,
            compression=az.CompressionSettings(compressor=az.Compressor.ZSTD, codec=az.CompressionCodec.ZSTD, level=1),
            dimensions=[
                az.Dimension(
                    name="t", kind=az.DimensionType.TIME, array_size_px=0, chunk_size_px=2, shard_size_chunks=1
                ),
                az.Dimension(
                    name="y", kind=az.DimensionType.SPACE, array_size_px=32, chunk_size_px=16, shard_size_chunks=2
                ),
                az.Dimension(
                    name="x", kind=az.DimensionType.SPACE, array_size_px=32, chunk_size_px=16, shard_size_chunks=1
                ),
            ],
        )
    ]
    stream = az.ZarrStream(settings)
    for i in range(4):
        stream.append(np.full((32, 32), i, np.uint16))
    stream.close()
    result = inspect_array(tmp_path / "az.zarr" / "0")
    assert result.chunk_bytes.shape == (2, 2, 2) and (result.chunk_bytes > 0).all()
    assert len(result.shards) == 2 * 1 * 2 and all(s.crc_ok for s in result.shards)


def test_a_refresh_of_a_growing_recording_reads_only_new_and_edge_shards(tmp_path):
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 16, 8, 1)], "uint16")  # 2 shards per epoch, 1 chunk each
    path = tmp_path / "growing.zarr"
    writer = Writer(path, layout, backend="cpu", batch_bytes=1, max_latency_s=0.01)
    writer.append(np.arange(8 * 16, dtype=np.uint16).reshape(8, 16))  # 4 shard epochs
    writer.flush()
    earlier = inspect_array(path)
    assert len(earlier.shards) == 8
    writer.append(np.full((3, 16), 7, np.uint16))  # one more epoch and a partial one
    writer.close()
    CountingStore.shard_bytes = 0
    refreshed = inspect_array(CountingStore(path, read_only=True), previous=earlier)
    assert CountingStore.shard_bytes == 4 * (16 + 4)  # the 4 new shards' indexes, nothing else
    full = inspect_array(path)  # the same as reading every index
    assert refreshed.shards == full.shards and len(full.shards) == 12
    np.testing.assert_array_equal(refreshed.chunk_bytes, full.chunk_bytes)
    # a different geometry shares nothing with an earlier inspection
    other = tmp_path / "other.zarr"
    with Writer(other, Layout([Dim("t", 0, 4, 1), Dim("x", 16, 8, 1)], "uint16"), backend="cpu") as w:
        w.append(np.zeros((8, 16), np.uint16))
    CountingStore.shard_bytes = 0
    assert len(inspect_array(CountingStore(other, read_only=True), previous=earlier).shards) == 4
    assert CountingStore.shard_bytes == 4 * (16 + 4)


def test_the_live_inspector_reads_only_the_new_shards(make_napari_viewer, qtbot, tmp_path):
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 16, 8, 1)], "uint16")
    path = tmp_path / "live.zarr"
    writer = Writer(path, layout, backend="cpu", batch_bytes=1, max_latency_s=0.01)
    writer.append(np.zeros((8, 16), np.uint16))
    writer.flush()
    inspector = InspectorWidget(make_napari_viewer())
    inspector.open(path)
    assert inspector.inspection.bytes_read == 8 * (16 + 4)
    writer.append(np.ones((2, 16), np.uint16))
    writer.close()
    inspector.live.setChecked(True)  # re-reads every 2 s
    qtbot.waitUntil(lambda: len(inspector.inspection.shards) == 10, timeout=10_000)
    assert inspector.inspection.bytes_read == 2 * (16 + 4)  # the new epoch's two shards only
    inspector.live.setChecked(False)
    inspector.refresh()  # the Refresh button reads every index
    qtbot.waitUntil(lambda: inspector.inspection.bytes_read == 10 * (16 + 4), timeout=10_000)


def test_closing_the_viewer_waits_for_a_refresh_in_flight(make_napari_viewer, qtbot, tmp_path):
    """A refresh still reading indexes when the viewer closes used to emit into deleted Qt objects
    and abort the process; now closing the main window stops the live mode and waits for it."""
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 64, 4, 1), Dim("x", 64, 4, 1)], "uint8")
    path = tmp_path / "many.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(np.zeros((8, 64, 64), np.uint8))  # 2048 shards: a refresh takes a while
    viewer = make_napari_viewer()
    inspector = InspectorWidget(viewer)
    viewer.window.add_dock_widget(inspector, name="Inspect shards")
    inspector.open(path)
    inspector.live.setChecked(True)
    inspector.refresh()
    assert inspector.refreshing
    viewer.close()
    assert not inspector.refreshing  # waited for: nothing emits into the deleted widget later


def _recording(tmp_path, frames=6, **writer_options):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 64, 16, 2), Dim("x", 48, 16, 2)], "uint16")
    path = tmp_path / ("rec.ome.zarr" if writer_options.get("ome") else "rec.zarr")
    with Writer(path, layout, backend="cpu", **writer_options) as writer:
        writer.append(SyntheticCamera((64, 48), "uint16", seed=2).stack(frames))
    return path


def test_an_inspection_prints_as_one_short_line(tmp_path):
    result = inspect_array(_recording(tmp_path, frames=400))
    text = repr(result)
    assert len(text) < 300 and "\n" not in text  # the chunk map (200 x 4 x 3 numbers) is summarised, not dumped
    assert text.startswith("Inspection(shape=(400, 64, 48), shard_shape=(4, 32, 32), chunk_shape=(2, 16, 16)")
    assert "axis_names=('t', 'y', 'x'), shards=400, chunks=2400, empty_chunks=0, crc_mismatches=0" in text


def test_an_array_or_a_single_image_is_listed_as_its_one_image(tmp_path):
    from napari_tileshard.apps.inspect_shards import list_images

    plain = _recording(tmp_path / "a")
    ome = _recording(tmp_path / "b", ome=True, image_name="beads")
    assert [(i.name, i.path, i.error) for i in list_images(plain)] == [("rec", "", None)]
    assert [(i.name, i.path) for i in list_images(ome)] == [("beads", "")]
    assert str(list_images(ome)[0]) == "beads"
    for path, name in ((plain, "rec"), (ome, "beads")):  # what list_images names, inspect_array takes
        assert inspect_array(path, image=name).shape == inspect_array(path).shape == (6, 64, 48)
    assert inspect_array(ome).axis_names == ("t", "y", "x")


def test_the_inspectors_layers_keep_the_arrays_axis_names(make_napari_viewer, tmp_path):
    """Alone in a viewer (opened from the recorder, before the data is), the inspector's layers
    label the sliders with the array's axes: t, not -3."""
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    viewer = make_napari_viewer()
    widget = InspectorWidget(viewer)
    widget.open(str(_recording(tmp_path)))
    assert tuple(viewer.dims.axis_labels) == ("t", "y", "x")
    assert tuple(widget._layers["chunk ratio"].axis_labels) == ("t", "y", "x")
    assert tuple(widget._layers["shard grid"].axis_labels) == ("y", "x")
