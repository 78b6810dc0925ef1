"""The layout math against independent NumPy references."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layouts

from napari_tileshard import Dim, Layout
from napari_tileshard.format.layout import MAX_RANK


def permutation_by_loops(layout):
    """P[i] by the definition: unravel, lift to (shard, within), ravel shard-major."""
    counts = layout.tile_count[1:]
    tps = layout.tiles_per_shard[1:]
    perm = []
    for i in range(math.prod(counts)):
        coords, rest = [], i
        for n in reversed(counts):
            coords.insert(0, rest % n)
            rest //= n
        shard = [t // p for t, p in zip(coords, tps)]
        within = [t % p for t, p in zip(coords, tps)]
        index = 0
        for value, extent in zip(shard + within, list(layout.shard_count[1:]) + list(tps)):
            index = index * extent + value
        perm.append(index)
    return np.array(perm)


@given(layouts())
@settings(max_examples=150, deadline=None)
def test_shard_permutation_matches_definition(layout):
    perm = layout.shard_permutation
    np.testing.assert_array_equal(perm, permutation_by_loops(layout))
    assert len(set(perm.tolist())) == len(perm)  # a permutation into the padded slots
    assert perm.max() < layout.slots_per_epoch
    assert layout.slot_mask.sum() == layout.tiles_per_epoch


def scatter_with_lifted_strides(layout, batch, tile_stride=None):
    """The formula of LiftedStrides' docstring, evaluated element by element with NumPy."""
    lift = layout.lifted_strides(tile_stride)
    stride = lift.tile_elements_stride
    epochs = batch.shape[0] // layout.epoch_rows
    pool = np.zeros(epochs * layout.tiles_per_epoch * stride, dtype=batch.dtype)
    coords = np.indices(batch.shape).reshape(batch.ndim, -1)
    offset = np.zeros(coords.shape[1], dtype=np.int64)
    for d in range(layout.rank):
        offset += (coords[d] // lift.tile_shape[d]) * lift.tile_stride[d]
        offset += (coords[d] % lift.tile_shape[d]) * lift.element_stride[d]
    pool[offset] = batch.reshape(-1)
    pool = pool.reshape(epochs, layout.tiles_per_epoch, stride)[:, :, : layout.tile_elements]
    return pool.reshape((epochs, layout.tiles_per_epoch) + layout.tile_shape)


@given(layouts(), st.integers(1, 3), st.integers(0, 2**31), st.integers(0, 5))
@settings(max_examples=150, deadline=None)
def test_lifted_strides_equal_reshape_transpose(layout, epochs, seed, extra_stride):
    rng = np.random.default_rng(seed)
    batch = rng.integers(1, 200, (epochs * layout.epoch_rows,) + layout.shape[1:]).astype(layout.dtype)
    expected = layout.tile_pool_reference(batch)
    scattered = scatter_with_lifted_strides(layout, batch, layout.tile_elements + extra_stride)
    np.testing.assert_array_equal(scattered, expected)
    # The NumPy path of the lift (the CPU's): the same strides, one strided copy, padding included.
    stride = layout.tile_elements + extra_stride
    pool = layout.lifted_strides(stride).scatter(batch).reshape(epochs, layout.tiles_per_epoch, stride)
    assert not pool[:, :, layout.tile_elements :].any()
    np.testing.assert_array_equal(pool[:, :, : layout.tile_elements].reshape(expected.shape), expected)
    # The pool is tile-major: tile (e, i) is the block of the array it came from, padded with 0.
    tile_coords = np.unravel_index(np.arange(layout.tiles_per_epoch), layout.tile_count[1:]) if layout.rank > 1 else ()
    for e in range(epochs):
        for i in range(min(layout.tiles_per_epoch, 6)):
            region = tuple(
                slice(int(t[i]) * n, (int(t[i]) + 1) * n) for t, n in zip(tile_coords, layout.tile_shape[1:])
            )
            block = batch[(slice(e * layout.epoch_rows, (e + 1) * layout.epoch_rows),) + region]
            tile = expected[e, i]
            np.testing.assert_array_equal(tile[tuple(slice(0, n) for n in block.shape)], block)
            padding = np.ones(tile.shape, bool)
            padding[tuple(slice(0, n) for n in block.shape)] = False
            assert not tile[padding].any()


@given(layouts(), st.integers(0, 2**31))
@settings(max_examples=100, deadline=None)
def test_shard_tiles_equal_pool_through_permutation(layout, seed):
    """The CPU backend's per-shard lift equals the tile-major pool reordered by P."""
    rng = np.random.default_rng(seed)
    epoch = rng.integers(1, 200, (layout.epoch_rows,) + layout.shape[1:]).astype(layout.dtype)
    pool = layout.tile_pool_reference(epoch)[0].reshape(layout.tiles_per_epoch, -1)
    shard_major = np.zeros((layout.slots_per_epoch, layout.tile_elements), layout.dtype)
    shard_major[layout.shard_permutation] = pool
    per_shard = np.concatenate([layout.shard_tiles(epoch, j) for j in range(layout.inner_shard_count)])
    np.testing.assert_array_equal(per_shard, shard_major[layout.slot_mask.reshape(-1)])
    if layout.rank > 1 and layout.tiles_per_shard[1] > 1:  # pieces along w_1 concatenate to the shard
        pieces = [layout.shard_tiles(epoch, 0, slice(a, a + 1)) for a in range(layout.tiles_per_shard[1])]
        np.testing.assert_array_equal(np.concatenate(pieces), layout.shard_tiles(epoch, 0))


@given(layouts(), st.integers(1, 4), st.integers(0, 5), st.integers(0, 2**31))
@settings(max_examples=100, deadline=None)
def test_lifted_strides_are_the_row_major_pool_the_gpu_kernel_unravels(layout, epochs, extra_stride, seed):
    """The tile kernel walks the pool backwards by the extents (tile_count, tile_shape), so the pool
    strides must be exactly the row-major strides of (epoch, t_1.., slot) and (n_0, ..., n_{D-1})."""
    lift = layout.lifted_strides(layout.tile_elements + extra_stride)
    assert (lift.shape, lift.tile_shape, lift.tile_count) == (layout.shape, layout.tile_shape, layout.tile_count)
    assert lift.tile_elements == layout.tile_elements
    rng = np.random.default_rng(seed)
    tile_extents = (epochs,) + layout.tile_count[1:]
    t = [rng.integers(0, n, 50) for n in tile_extents]
    n = [rng.integers(0, k, 50) for k in layout.tile_shape]
    offset = sum(t[d] * lift.tile_stride[d] + n[d] * lift.element_stride[d] for d in range(layout.rank))
    expected = np.ravel_multi_index(t, tile_extents) * lift.tile_elements_stride + np.ravel_multi_index(
        n, layout.tile_shape
    )
    np.testing.assert_array_equal(offset, expected)
    batch_shape = (epochs * layout.epoch_rows,) + layout.shape[1:]
    c = [rng.integers(0, s, 50) for s in batch_shape]
    np.testing.assert_array_equal(
        sum(c[d] * lift.input_stride[d] for d in range(layout.rank)), np.ravel_multi_index(c, batch_shape)
    )


@given(layouts(), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_shard_pieces_cover_each_shard_once(layout, seed):
    """Every contiguous range of w_1 (empty ones too) gives the tiles of those tile rows, in order."""
    rng = np.random.default_rng(seed)
    epoch = rng.integers(1, 200, (layout.epoch_rows,) + layout.shape[1:]).astype(layout.dtype)
    tps_1 = layout.tiles_per_shard[1] if layout.rank > 1 else 1
    for shard in range(layout.inner_shard_count):
        whole = layout.shard_tiles(epoch, shard)
        mask = layout.slot_mask[shard].reshape(tps_1, -1)
        for a in range(tps_1 + 1):
            for b in range(a, tps_1 + 2):
                first = int(mask[:a].sum()) if layout.rank > 1 else 0
                count = int(mask[a:b].sum()) if layout.rank > 1 else len(whole)
                np.testing.assert_array_equal(
                    layout.shard_tiles(epoch, shard, slice(a, b)), whole[first : first + count]
                )


@given(layouts(), st.integers(1, 40), st.integers(0, 2**31))
@settings(max_examples=100, deadline=None)
def test_shard_boxes_cut_a_piece_into_its_tiles_in_order(layout, max_tiles, seed):
    """The CPU backend cuts a piece box by box: the boxes' tiles, concatenated, are the piece's
    (the NumPy reference: the tile-major pool reordered by P, restricted to the piece's rows),
    and every box holds at most max_tiles slots (one at least)."""
    rng = np.random.default_rng(seed)
    epoch = rng.integers(1, 200, (layout.epoch_rows,) + layout.shape[1:]).astype(layout.dtype)
    pool = layout.tile_pool_reference(epoch)[0].reshape(layout.tiles_per_epoch, -1)
    shard_major = np.zeros((layout.slots_per_epoch, layout.tile_elements), layout.dtype)
    shard_major[layout.shard_permutation] = pool
    slots = shard_major.reshape(layout.inner_shard_count, layout.tiles_per_shard_inner, -1)
    tps = layout.tiles_per_shard[1:]
    tps_1 = tps[0] if tps else 1
    for shard in range(layout.inner_shard_count):
        mask = layout.slot_mask[shard].reshape(tps_1, -1)
        for a, b in ((0, tps_1), (0, 1), (tps_1 // 2, tps_1)):
            rows = slice(a, b)
            expected = slots[shard].reshape(tps_1, -1, layout.tile_elements)[rows][mask[rows]]
            boxes = layout.shard_boxes(rows, max_tiles)
            for box in boxes:  # the ranges it gives times the whole dims it leaves out
                slots_in_box = math.prod(len(range(*r.indices(n))) for r, n in zip(box, tps)) * math.prod(
                    tps[len(box) :]
                )
                assert slots_in_box <= max_tiles
            cut = [layout.shard_tiles(epoch, shard, box) for box in boxes]
            np.testing.assert_array_equal(
                np.concatenate(cut) if cut else np.empty((0, layout.tile_elements), layout.dtype), expected
            )


@given(layouts(), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_shard_tiles_into_a_reused_buffer_equal_a_fresh_array(layout, seed):
    """The CPU backend cuts tiles into one buffer per thread, dirty from the task before: the tiles
    (edge padding included) must not depend on what the buffer held."""
    rng = np.random.default_rng(seed)
    epoch = rng.integers(1, 200, (layout.epoch_rows,) + layout.shape[1:]).astype(layout.dtype)
    dirty = np.full(layout.tiles_per_shard_inner * layout.tile_bytes + 3, 0xA5, np.uint8)
    for shard in range(layout.inner_shard_count):
        fresh = layout.shard_tiles(epoch, shard)
        reused = layout.shard_tiles(epoch, shard, out=dirty)
        np.testing.assert_array_equal(reused, fresh)
        assert np.shares_memory(reused, dirty)
    with pytest.raises(ValueError, match=f"at least {layout.shard_tiles(epoch, 0).nbytes} bytes"):
        layout.shard_tiles(epoch, 0, out=np.empty(layout.shard_tiles(epoch, 0).nbytes - 1, np.uint8))


def test_scatter_refuses_a_batch_of_partial_epochs_and_pieces_with_gaps():
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 9, 4, 2)], "uint8")
    with pytest.raises(ValueError, match="contiguous"):
        layout.shard_bounds(0, slice(0, 2, 2))
    with pytest.raises(ValueError, match="whole tile epochs"):
        layout.lifted_strides().scatter(np.zeros((3, 9), np.uint8))
    with pytest.raises(ValueError, match="whole tile epochs"):
        layout.lifted_strides().scatter(np.zeros((2, 8), np.uint8))


def test_derived_figures_of_the_readme_layout():
    layout = Layout([Dim("t", 0, 32, 1), Dim("y", 2048, 256, 4), Dim("x", 2048, 256, 4)], "uint16")
    assert layout.frame_shape == (2048, 2048)
    assert layout.tile_bytes == 32 * 256 * 256 * 2
    assert layout.tiles_per_epoch == 64
    assert layout.inner_shard_count == 4
    assert layout.chunks_per_shard == 16
    assert layout.shard_shape == (32, 1024, 1024)
    assert layout.epoch_bytes == 32 * 2048 * 2048 * 2
    assert layout.index_bytes == 16 * 16 + 4


def test_edge_shards_have_empty_slots():
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 10, 4, 2)], "uint8")  # 3 tiles, 2 shards of 2 tiles
    assert layout.tile_count[1] == 3 and layout.shard_count[1] == 2
    np.testing.assert_array_equal(layout.slot_mask, [[True, True], [True, False]])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Dim("x", -1, 4), "size must be >= 0"),
        (lambda: Dim("x", 8, 0), "tile_size must be >= 1, got 0"),
        (lambda: Dim("x", 8, 4, 0), "tiles_per_shard must be >= 1, got 0"),
        (lambda: Dim("x", 8.5, 4), "size must be an integer, got 8.5"),
        (lambda: Dim("../x", 8, 4), "dimension name '../x' is invalid"),
        (lambda: Dim("/abs", 8, 4), "is invalid"),
        (lambda: Layout([Dim("t", 4, 2), Dim("x", 0, 4)]), "dimension 'x' (position 1) has size 0"),
        (lambda: Layout([Dim(f"d{i}", 2, 1) for i in range(MAX_RANK + 1)]), f"at most {MAX_RANK} dimensions"),
        (lambda: Layout([Dim("x", 4, 2), Dim("x", 4, 2)]), "must be unique"),
        (lambda: Layout([]), "at least one dimension"),
    ],
)
def test_invalid_layouts_name_the_value(make, message):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert message in str(info.value)


@pytest.mark.parametrize("dtype", ["bool", "complex64", "object", "U4"])
def test_unsupported_dtypes(dtype):
    with pytest.raises(TypeError, match="not supported"):
        Layout([Dim("x", 4, 2)], dtype=dtype)


def test_tile_larger_than_size_is_fine():
    layout = Layout([Dim("t", 3, 8), Dim("x", 5, 64)], "uint16")
    assert layout.tile_count == (1, 1)


@pytest.mark.parametrize(
    "name, unit, kind, expected",
    [
        ("y", "micrometer", None, "micrometer"),  # the spec's names as they are
        ("t", "millisecond", None, "millisecond"),
        ("z", "angstrom", None, "angstrom"),
        ("x", "um", None, "micrometer"),  # what microscopists type: stored as the spec's name
        ("x", "µm", None, "micrometer"),  # micro sign
        ("x", "\u03bcm", None, "micrometer"),  # Greek mu
        ("x", "micron", None, "micrometer"),
        ("x", "Micrometers", None, "micrometer"),
        ("x", "micrometre", None, "micrometer"),
        ("y", " nm ", None, "nanometer"),
        ("y", "mm", None, "millimeter"),
        ("y", "Mm", None, "megameter"),  # symbols are case-sensitive, as in SI
        ("y", "Å", None, "angstrom"),
        ("t", "s", None, "second"),
        ("t", "sec", None, "second"),
        ("t", "seconds", None, "second"),
        ("t", "ms", None, "millisecond"),
        ("t", "us", None, "microsecond"),
        ("t", "min", None, "minute"),
        ("t", "h", None, "hour"),
        ("frame", "s", "time", "second"),  # the axis type is the kind's where one is given
        ("lam", "nm", "other", "nm"),  # no list for other axes: kept as given
        ("c", "a.u.", None, "a.u."),
    ],
)
def test_units_are_ome_zarr_names_and_common_symbols_are_normalised(name, unit, kind, expected):
    assert Dim(name, 8, 4, kind=kind, unit=unit).unit == expected


@pytest.mark.parametrize(
    "name, unit, kind, message",
    [
        ("y", "mircometer", None, "unit 'mircometer' is not an OME-Zarr space unit: did you mean 'micrometer'?"),
        ("t", "milisecond", None, "unit 'milisecond' is not an OME-Zarr time unit: did you mean 'millisecond'?"),
        ("t", "seconde", None, "did you mean 'second'?"),
        ("y", "furlong", None, "unit 'furlong' is not an OME-Zarr space unit: use one of angstrom, attometer"),
        ("y", "second", None, "unit 'second' is a time unit ('second'), not one of a space axis"),
        ("t", "um", None, "unit 'um' is a space unit ('micrometer'), not one of a time axis"),
        ("d", "s", "space", "dimension 'd' (kind='space'): unit 's' is a time unit"),
        ("x", "pixel", None, "unit 'pixel' is not a physical unit: leave the unit out (None)"),
        ("x", "px", None, "leave the unit out"),
    ],
)
def test_a_unit_ome_zarr_does_not_know_for_the_axis_is_refused_with_a_suggestion(name, unit, kind, message):
    with pytest.raises(ValueError) as info:
        Dim(name, 8, 4, kind=kind, unit=unit)
    assert message in str(info.value)
    assert f"dimension {name!r}" in str(info.value)


def test_unit_lists_are_the_ome_zarr_specs():
    from napari_tileshard.format.layout import SPACE_UNITS, TIME_UNITS

    assert len(SPACE_UNITS) == 26 and len(TIME_UNITS) == 23
    assert {"micrometer", "nanometer", "angstrom", "inch", "foot", "yard", "mile", "parsec"} <= set(SPACE_UNITS)
    assert {"second", "millisecond", "minute", "hour", "day"} <= set(TIME_UNITS)
