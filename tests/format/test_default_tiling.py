"""The one tiling (Layout.default_for): its default, that every entry point not told a tiling uses it,
the one check of the sizes a user asks for, and the notes of what a tiling costs."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from napari_tileshard.apps.cli import build_layout, main
from napari_tileshard.apps.convert import Source, default_layout
from napari_tileshard.apps.napari_writer import write_image
from napari_tileshard.apps.recorder_form import DEFAULT_DIMS, proposed_tiling
from napari_tileshard.format.array_spec import ArraySpec
from napari_tileshard.format.layout import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_EPOCH_BYTES,
    DEFAULT_TILE_BYTES,
    Dim,
    Layout,
    TilingWarning,
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


# -- the sizes a user asks for: checked once, the same way everywhere ------------------------------
@pytest.mark.parametrize(
    "tile, tiles_per_shard, error, message",
    [
        ((0, -5, 32), None, ValueError, "dimension 't': tile_size must be >= 1, got 0"),
        ((-1, 4, 4), None, ValueError, "dimension 't': tile_size must be >= 1, got -1"),
        ((1, -5, 32), None, ValueError, "dimension 'y': tile_size must be >= 1, got -5"),
        (None, (1, 0, 1), ValueError, "dimension 'y': tiles_per_shard must be >= 1, got 0"),
        ((1, 2.5, 4), None, TypeError, "dimension 'y': tile_size must be an integer, got 2.5"),
        ((1, True, 4), None, TypeError, "dimension 'y': tile_size must be an integer, got True"),
        ((1, 4), None, ValueError, "tile has 2 values [1, 4] for the 3 dimensions ('t', 'y', 'x')"),
        ({"q": 4}, None, ValueError, "tile names dimensions ['q'] that the array does not have ('t', 'y', 'x')"),
        ("1,4,4", None, TypeError, "tile must be one value per dimension or a mapping"),
    ],
)
def test_requested_sizes_are_refused_as_a_dim_refuses_them(tile, tiles_per_shard, error, message):
    with pytest.raises(error) as info:
        Layout.default_for((4, 64, 64), "uint16", tile=tile, tiles_per_shard=tiles_per_shard)
    assert message in str(info.value)
    if tile is not None and len(tile) == 3 and not isinstance(tile, (str, dict)):  # the same words as a Dim's
        with pytest.raises(error) as from_dims:
            Layout([Dim(n, s, t) for n, s, t in zip("tyx", (4, 64, 64), tile)], "uint16")
        assert str(from_dims.value) == str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(st.sampled_from([0, 1, 7, 40]), st.integers(1, 600), st.integers(1, 600)),
    asked=st.lists(st.one_of(st.none(), st.integers(-3, 1200)), min_size=3, max_size=3),
)
def test_a_requested_tile_is_taken_clamped_to_its_dim_or_refused(shape, asked):
    """One rule: a value < 1 is refused naming it; a tile larger than its bounded dim is clamped to
    the dim with a TilingWarning naming both; anything else is taken as asked (None: the default)."""
    default = Layout.default_for(shape, "uint16")
    if any(v is not None and v < 1 for v in asked):
        bad = next(v for v in asked if v is not None and v < 1)
        with pytest.raises(ValueError, match=rf"tile_size must be >= 1, got {bad}$"):
            Layout.default_for(shape, "uint16", tile=asked)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout = Layout.default_for(shape, "uint16", tile=asked)
    notes = [str(w.message) for w in caught if issubclass(w.category, TilingWarning)]
    expected_notes = []
    for dim, value, default_tile in zip(layout.dims, asked, default.tile_shape):
        if value is None:
            assert dim.tile_size == default_tile
        elif dim.size and value > dim.size:
            assert dim.tile_size == dim.size
            expected_notes.append(
                f"tile {value} along {dim.name!r} is larger than the dimension ({dim.size}): using {dim.size}"
            )
        else:
            assert dim.tile_size == value
    assert notes == expected_notes
    assert layout.tiles_per_shard == default.tiles_per_shard  # not asked for: the default's


def test_a_mapping_asks_for_the_dims_it_names():
    layout = Layout.default_for((0, 3, 512, 512), "uint16", ("t", "c", "y", "x"), tile={"y": 64, "x": 64})
    default = Layout.default_for((0, 3, 512, 512), "uint16", ("t", "c", "y", "x"))
    assert layout.tile_shape == (default.tile_shape[0], 1, 64, 64)
    assert layout.tiles_per_shard == default.tiles_per_shard


# -- what a tiling costs -----------------------------------------------------------------------------
def test_the_notes_of_a_tiling_that_explodes_give_the_numbers():
    """The recording of the report: 512x512 frames in tiles of 1x1x1 (131,072 files for 20 frames)."""
    layout = Layout.default_for((0, 512, 512), "uint16", tile=(1, 1, 1))
    assert layout.shard_shape == (16, 2, 2)
    small, files = layout.tiling_notes()
    assert small.startswith("chunks of 1x1x1 uint16 are 2 bytes, under 4 KiB")
    assert files.startswith("shards of 16x2x2 uint16 make 7,812,500 files per GB of data (over 10,000 per GB")
    assert layout.files_per_gb == pytest.approx(1e9 / (16 * 2 * 2 * 2))
    bounded = Layout.default_for((20, 512, 512), "uint16", tile=(1, 1, 1))
    assert "131,072 files for the whole array" in bounded.tiling_notes()[1]
    assert math.prod(bounded.shard_count) == 131_072


def test_a_tile_that_overhangs_a_layout_built_by_hand_is_kept_and_noted():
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 512, 1000, 1), Dim("x", 512, 512, 1)], "uint16")
    assert layout.tile_shape == (2, 1000, 512)  # a Layout is the Zarr tiling given (also of existing arrays)
    (note,) = layout.tiling_notes()
    assert note == "tile 1000 along 'y' is larger than the dimension (512): its chunks are padded to 1000, " + (
        "a tile of 512 holds the same"
    )


@pytest.mark.parametrize(
    "layout",
    [
        Layout([Dim("t", 4, 1), Dim("y", 8, 4), Dim("x", 8, 4)], "uint16"),  # 16 chunks of 32 bytes
        Layout([Dim("t", 1000, 1), Dim("x", 16, 16)], "uint8"),  # 1,000 chunks: still small
    ],
)
def test_a_small_bounded_array_gets_no_notes_whatever_its_tiling(layout):
    assert layout.tiling_notes() == ()


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(["uint8", "uint16", "float32", "float64"]),
    first=st.one_of(st.just(0), st.integers(16, 5000)),
    frame=st.lists(st.integers(16, 20000), min_size=1, max_size=2),
)
def test_the_default_tiling_of_frames_has_nothing_to_note(dtype, first, frame):
    """Frames of at least 16 px a side (rank 2 and 3, dim 0 unbounded or not): the default tiling
    never warns about itself."""
    layout = Layout.default_for((first, *frame), dtype)
    assert layout.tiling_notes() == ()


def test_array_spec_warns_each_note_once_per_layout():
    layout = Layout.default_for((0, 512, 512), "uint16", tile=(1, 1, 1))
    with pytest.warns(TilingWarning) as caught:
        ArraySpec.of(layout)
    assert [str(w.message) for w in caught] == list(layout.tiling_notes())
    with warnings.catch_warnings():
        warnings.simplefilter("error", TilingWarning)
        ArraySpec.of(layout)  # the same layout again (a recorder's thread after its check): quiet
        ArraySpec.of(Layout.default_for((0, 512, 512), "uint16"))  # the default: nothing to say
