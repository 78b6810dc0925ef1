"""The one default tiling (Layout.default_for), and that every entry point not told a tiling uses it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from napari_tileshard.apps.cli import build_layout, main
from napari_tileshard.apps.convert import Source, default_layout
from napari_tileshard.apps.napari_writer import write_image
from napari_tileshard.apps.recorder_form import DEFAULT_DIMS, proposed_tiling
from napari_tileshard.format.layout import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_EPOCH_BYTES,
    DEFAULT_TILE_BYTES,
    Layout,
)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((0, 2048, 2048), "uint16"),
        ((100, 300, 400), "uint8"),
        ((50, 3, 10, 512, 512), "float32"),
        ((7, 5, 2048, 2048), "uint16"),
        ((0, 4096, 4096), "uint16"),
        ((64, 64), "uint16"),
        ((1000,), "float64"),
    ],
)
def test_default_tiling_follows_its_rules(shape, dtype):
    layout = Layout.default_for(shape, dtype)
    itemsize = np.dtype(dtype).itemsize
    rank = len(shape)
    frame = 2 if rank >= 3 else 1
    for d in range(rank - frame, rank):  # frame dims: tiles of up to 256, up to 4 per shard
        assert layout.tile_shape[d] == min(256, shape[d])
        assert layout.tiles_per_shard[d] == min(4, -(-shape[d] // layout.tile_shape[d]))
    assert all(t == 1 and p == 1 for t, p in zip(layout.tile_shape[1 : rank - frame], layout.tiles_per_shard[1:]))
    if rank > frame:
        frame_tile = itemsize * int(np.prod(layout.tile_shape[rank - frame :]))
        assert layout.tile_bytes <= max(DEFAULT_TILE_BYTES, frame_tile)  # ~256 KiB tiles
        shard_bytes = layout.tile_bytes * layout.chunks_per_shard
        assert shard_bytes <= max(DEFAULT_SHARD_BYTES, layout.tile_bytes * int(np.prod(layout.tiles_per_shard[1:])))
        row = itemsize * int(np.prod(shape[1:]))
        epoch = layout.shard_epoch_rows * row
        assert epoch <= max(DEFAULT_SHARD_EPOCH_BYTES, layout.tile_shape[0] * row)


def test_default_tiling_names_and_refusals():
    assert Layout.default_for((0, 64, 64), "uint16").names == ("t", "y", "x")
    assert Layout.default_for((2, 3, 4, 64, 64), "uint16").names == ("t", "c", "z", "y", "x")
    assert Layout.default_for((2, 64, 64), "uint16", ["a", "b", "c"]).names == ("a", "b", "c")
    with pytest.raises(ValueError, match=r"2 names \['a', 'b'\] for the 3 dimensions"):
        Layout.default_for((2, 64, 64), "uint16", ["a", "b"])
    with pytest.raises(ValueError, match="1 to 8 dimensions"):
        Layout.default_for((), "uint16")


def test_every_entry_point_without_a_tiling_uses_the_default(tmp_path):
    expected = Layout.default_for((0, 96, 80), "uint16")
    cli = build_layout([0, 96, 80], None, None, "uint16")
    assert (cli.tile_shape, cli.tiles_per_shard) == (expected.tile_shape, expected.tiles_per_shard)

    source = Source("array", (12, 96, 80), np.dtype("uint16"), None)
    converted = default_layout(source)
    bounded = Layout.default_for((12, 96, 80), "uint16")
    assert (converted.tile_shape, converted.tiles_per_shard) == (bounded.tile_shape, bounded.tiles_per_shard)

    (path,) = write_image(str(tmp_path / "saved.zarr"), np.zeros((12, 96, 80), np.uint16), {})
    meta = json.loads((tmp_path / "saved.zarr" / "zarr.json").read_text())
    sharding = meta["codecs"][0]["configuration"]
    assert tuple(sharding["chunk_shape"]) == bounded.tile_shape
    assert tuple(meta["chunk_grid"]["configuration"]["chunk_shape"]) == bounded.shard_shape

    form = Layout.default_for((0, 1024, 1024), "uint16", ("t", "y", "x"))
    assert [(d[2], d[3]) for d in DEFAULT_DIMS] == list(zip(form.tile_shape, form.tiles_per_shard))
    assert proposed_tiling(300) == (256, 2) and proposed_tiling(40) == (40, 1)

    out = tmp_path / "rec.zarr"
    assert main(["record", str(out), "--shape", "0,96,80", "--frames", "4", "--backend", "cpu", "--no-progress"]) == 0
    meta = json.loads((out / "zarr.json").read_text())
    assert tuple(meta["codecs"][0]["configuration"]["chunk_shape"]) == expected.tile_shape
