"""The recorder's preview data (napari_tileshard.apps.preview): complete rows only, lazily, the frames
read back on the recorder thread standing in for their rows."""

import math
import time
from collections import Counter

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.apps.preview import (
    MAX_BLOCKS,
    RecentFrames,
    complete_rows,
    preview_data,
    read_first,
    read_newest,
)
from napari_tileshard.storage.safe_read import SafeLocalStore


@pytest.fixture
def chunk_reads(monkeypatch):
    """Keys of chunk data (``.../c/...``) read through the store napari's preview reads from."""
    reads = []
    real = SafeLocalStore._read

    def counting(self, key, byte_range):
        if "c/" in key:
            reads.append(key)
        return real(self, key, byte_range)

    monkeypatch.setattr(SafeLocalStore, "_read", counting)
    return reads


def record(path, frames, frame=(256, 192), ome=False):
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", frame[0], 32, 2), Dim("x", frame[1], 32, 2)], "uint16")
    data = SyntheticCamera(frame, "uint16", seed=5).stack(frames)
    with Writer(path, layout, backend="cpu", ome=ome) as writer:
        writer.append(data)
    return data, writer.pyramid


def test_complete_rows_shows_the_recent_frames_and_reads_nothing_for_them(tmp_path, chunk_reads):
    out = tmp_path / "r.zarr"
    data, pyramid = record(out, 12, frame=(64, 48))
    recent = RecentFrames()
    marks = [(9, np.full((64, 48), 7, np.uint16)), (10, np.full((64, 48), 8, np.uint16))]
    recent.add([marks[0]])
    recent.add([marks[1]])
    shown, names = preview_data(out, 11, pyramid, ome=False, recent=recent)
    assert shown.shape == (11, 64, 48) and names == ["t", "y", "x"]
    chunk_reads.clear()
    np.testing.assert_array_equal(np.asarray(shown[10]), marks[1][1])  # from memory: no decode
    np.testing.assert_array_equal(np.asarray(shown[9]), marks[0][1])
    assert chunk_reads == []
    expected = data[:11].copy()
    expected[9], expected[10] = marks[0][1], marks[1][1]
    np.testing.assert_array_equal(np.asarray(shown), expected)
    assert [row for row, _ in read_newest(out, pyramid, 11, ome=False)] == [10]
    final, _ = preview_data(out, 11, pyramid, ome=False, final=True)
    assert final.shape == (12, 64, 48)  # every written row once the recording has ended


@pytest.mark.parametrize("ome", [False, True])
def test_each_preview_update_opens_the_store_once(tmp_path, ome, metadata_counting_store):
    """read_newest, read_first and preview_data each read the root's and every level's zarr.json
    once, then hand the opened arrays to the readers (it was up to six opens of the root)."""
    out = tmp_path / "r.zarr"
    data, pyramid = record(out, 12, ome=ome)
    store = metadata_counting_store(out)
    once = Counter(["zarr.json"] + ([f"{k}/zarr.json" for k in range(pyramid.levels)] if ome else []))
    assert not ome or pyramid.levels > 1

    store.metadata_reads.clear()
    newest = read_newest(store, pyramid, 11, ome=ome)
    assert store.metadata_reads == once
    assert newest[0][0] == 10 and len(newest) == (pyramid.levels if ome else 1)
    np.testing.assert_array_equal(newest[0][1], data[10])

    store.metadata_reads.clear()
    first = read_first(store, ome=ome)
    assert store.metadata_reads == once
    assert len(first) == (pyramid.levels if ome else 1)
    np.testing.assert_array_equal(first[0][1], data[0])

    store.metadata_reads.clear()
    shown, names = preview_data(store, 11, pyramid, ome=ome)
    assert store.metadata_reads == once
    level0 = shown[0] if ome else shown
    assert names == ["t", "y", "x"] and level0.shape == (11, *data.shape[1:])
    np.testing.assert_array_equal(np.asarray(level0[7]), data[7])


def test_napari_draw_reads_only_the_shown_rows_tiles(make_napari_viewer, qtbot, tmp_path, chunk_reads):
    """napari's multiscale slicing crops every row of a level before picking the current one:
    one draw must still read only the shard epoch of the row shown, at every level drawn."""
    pytest.importorskip("napari")
    out = tmp_path / "ome.zarr"
    data, pyramid = record(out, 200, ome=True)
    levels, _ = preview_data(out, 160, pyramid, ome=True)
    assert [level.shape[0] for level in levels] == [160] * pyramid.levels  # rows 160.. not complete
    viewer = make_napari_viewer()
    layer = viewer.add_image(levels, multiscale=True, contrast_limits=(0, 2000))
    viewer.reset_view()
    qtbot.wait(50)

    def draw(row):
        chunk_reads.clear()
        viewer.dims.set_current_step(0, row)
        layer.refresh()
        return {key.split("/c/")[1].split("/")[0] for key in chunk_reads}

    assert draw(101) == {"50"}  # tiles of 2 rows, one tile per shard along t: epoch 50 only
    assert layer.data_level == 0  # level 0 was drawn (the thumbnail is the coarsest level)
    np.testing.assert_array_equal(np.asarray(layer.data[0][101]), data[101])
    # The same levels handed to napari as zarr arrays read every epoch per draw: what this guards against.
    from napari_tileshard.reader.levels import open_levels

    layer.data = open_levels(out)
    assert len(draw(101)) == 100


def test_graph_stays_bounded_for_long_recordings_and_odd_chunks(tmp_path):
    odd = zarr.create_array(
        zarr.storage.MemoryStore(), shape=(10**7, 4096, 4096), chunks=(1, 1, 1), dtype="uint16", fill_value=0
    )
    start = time.perf_counter()
    lazy = complete_rows(odd, 10**7)
    assert math.prod(lazy.numblocks) <= MAX_BLOCKS and lazy.shape == odd.shape
    assert time.perf_counter() - start < 5
    assert lazy[123].numblocks == (32, 32)
