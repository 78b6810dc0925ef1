"""Nonsense input: the only outcomes are a correct store or a ValueError/TypeError naming the value."""

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from napari_tileshard import Dim, IncompleteFrameWarning, Layout, Writer, verify

junk = st.one_of(
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.text(max_size=3),
    st.booleans(),
    st.integers(2**40, 2**70),
)


@given(
    size=junk,
    tile=junk,
    tiles_per_shard=junk,
    name=st.one_of(st.text(max_size=6), st.sampled_from(["../x", "/x", "a/b", "x"])),
)
@settings(max_examples=300, deadline=None)
def test_nonsense_dimensions(size, tile, tiles_per_shard, name):
    try:
        dim = Dim(name, size, tile, tiles_per_shard)
        Layout([Dim("t", 0, 1, 1), dim], "uint16")
    except (ValueError, TypeError) as exc:
        message = str(exc)
        assert any(repr(v) in message or str(v) in message for v in (size, tile, tiles_per_shard, name))
        return
    assert "/" not in dim.name and ".." not in dim.name
    assert dim.size >= 0 and dim.tile_size >= 1 and dim.tiles_per_shard >= 1
    layout = Layout([Dim("t", 0, 1, 1), dim], "uint16")
    assert layout.slot_mask.sum() == layout.tiles_per_epoch  # usable without huge allocations


arrays = st.tuples(
    st.sampled_from(["uint16", "uint8", "float32", ">u2", "int16"]),
    st.lists(st.integers(0, 5), min_size=0, max_size=4),
    st.booleans(),  # make it non-contiguous
)


@given(st.lists(arrays, min_size=1, max_size=12))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_nonsense_frames(tmp_path_factory, items):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 4, 3, 1), Dim("x", 5, 2, 2)], "uint16")
    path = tmp_path_factory.mktemp("fuzz") / "f.zarr"
    accepted = []
    rng = np.random.default_rng(len(items))
    with Writer(path, layout, backend="cpu") as writer:
        for dtype, shape, strided in items:
            array = rng.integers(0, 200, shape).astype(dtype) if shape else np.asarray(7).astype(dtype)
            if strided and array.ndim and array.shape[-1] > 1:
                array = array[..., ::2]
            try:
                writer.append(array)
            except (ValueError, TypeError) as exc:
                message = str(exc)
                assert array.dtype.str in message or str(array.shape) in message, message
                continue
            assert array.dtype == np.dtype("<u2") and array.shape[-2:] == (4, 5)
            accepted.append(array.reshape(-1, 4, 5))
    expected = np.concatenate(accepted) if accepted else np.zeros((0, 4, 5), np.uint16)
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[...], expected)
    assert verify(path).ok


@pytest.mark.parametrize("value", [b"\x00" * 3, bytearray(7), memoryview(b"abcde")])
def test_write_takes_any_byte_count(tmp_path, value):
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 3, 2, 1)], "uint16")
    incomplete = len(value) % 6  # bytes past the last whole frame of 3 uint16
    with pytest.warns(IncompleteFrameWarning, match=f"the last {incomplete} bytes") if incomplete else _nothing():
        with Writer(tmp_path / "w.zarr", layout, backend="cpu") as writer:
            assert writer.write(value).nbytes == 0
    assert zarr.open_array(tmp_path / "w.zarr").shape[0] == len(value) // 6  # whole rows only


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
