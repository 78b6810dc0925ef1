"""The Writer end to end: what goes in comes back out of zarr-python and tensorstore."""

import warnings

import numpy as np
import pytest
import zarr
from conftest import read_back, read_tensorstore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from napari_tileshard import SUPPORTED_DTYPES, Dim, IncompleteFrameWarning, Layout, Writer, verify

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def random_data(shape, dtype, rng):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.normal(0, 1000, shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 4))
    unbounded = draw(st.booleans())
    dims = []
    for d in range(rank):
        size = draw(st.integers(1, 12 if rank > 2 else 40))
        dims.append(
            Dim(f"d{d}", 0 if (d == 0 and unbounded) else size, draw(st.integers(1, 7)), draw(st.integers(1, 3)))
        )
    dtype = draw(st.sampled_from(SUPPORTED_DTYPES))
    layout = Layout(dims, dtype)
    rows = draw(st.integers(0, 25)) if unbounded else dims[0].size
    feeding = draw(st.sampled_from(["frames", "stack", "bytes"]))
    pieces = draw(st.lists(st.integers(1, 997), min_size=1, max_size=6))
    batch_bytes = draw(st.sampled_from([1, 3 * layout.epoch_bytes, 1 << 20]))
    return layout, rows, feeding, pieces, batch_bytes, draw(st.integers(0, 2**32 - 1))


def feed(writer, data, feeding, pieces):
    layout = writer.layout
    if feeding == "stack":
        writer.append(data.reshape((-1,) + layout.frame_shape))
    elif feeding == "frames":
        for frame in data.reshape((-1,) + layout.frame_shape):
            writer.append(frame)
    else:  # odd-sized byte pieces through write(), retrying what was not consumed
        raw = memoryview(data.tobytes())
        i = 0
        while raw.nbytes:
            piece = raw[: pieces[i % len(pieces)]]
            i += 1
            rest = writer.write(piece)
            raw = raw[piece.nbytes - rest.nbytes :]


@given(cases())
@_SETTINGS
def test_round_trip_any_layout(tmp_path_factory, backend, case):
    layout, rows, feeding, pieces, batch_bytes, seed = case
    path = tmp_path_factory.mktemp("rt") / "out.zarr"
    data = random_data((rows,) + layout.shape[1:], layout.dtype, np.random.default_rng(seed))
    with Writer(path, layout, codec="zstd", level=1, backend=backend, batch_bytes=batch_bytes) as writer:
        feed(writer, data, feeding, pieces)
    out = read_back(path)
    assert out.shape == data.shape
    np.testing.assert_array_equal(out, data)
    np.testing.assert_array_equal(read_tensorstore(path), data)
    assert verify(path).ok
    assert writer.stats.bytes_in == data.nbytes


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_every_dtype_and_codec(tmp_path, backend, dtype, codec):
    layout = Layout([Dim("t", 0, 3, 2), Dim("y", 21, 8, 2), Dim("x", 19, 8, 1)], dtype)
    data = random_data((14, 21, 19), dtype, np.random.default_rng(1))
    with Writer(tmp_path / "a.zarr", layout, codec=codec, backend=backend) as writer:
        writer.append(data)
    np.testing.assert_array_equal(read_back(tmp_path / "a.zarr"), data)
    np.testing.assert_array_equal(read_tensorstore(tmp_path / "a.zarr"), data)


def test_tile_rows_longer_than_an_encode_box_round_trip(tmp_path, backend):
    """1 MiB tiles, 3 to a shard's tile row: the CPU backend cuts and compresses a row in boxes of
    2 MiB (2 tiles, then 1), edge tiles and an edge shard included; the store reads back as the
    frames with zarr-python and tensorstore."""
    layout = Layout([Dim("t", 0, 8, 1), Dim("y", 300, 128, 2), Dim("x", 1400, 512, 3)], "uint16")
    assert layout.tile_bytes == 1 << 20
    data = random_data((16, 300, 1400), "uint16", np.random.default_rng(3))
    with Writer(tmp_path / "big.zarr", layout, level=1, backend=backend) as writer:
        writer.append(data)
    np.testing.assert_array_equal(read_back(tmp_path / "big.zarr"), data)
    np.testing.assert_array_equal(read_tensorstore(tmp_path / "big.zarr"), data)


def test_rank_up_to_max(tmp_path, backend):
    dims = [Dim("t", 0, 2, 1)] + [Dim(f"d{i}", 3, 2, 2) for i in range(1, 8)]
    layout = Layout(dims, "uint8")
    data = random_data((5,) + layout.shape[1:], "uint8", np.random.default_rng(2))
    with Writer(tmp_path / "r8.zarr", layout, backend=backend) as writer:
        writer.append(data)
    np.testing.assert_array_equal(read_back(tmp_path / "r8.zarr"), data)


def test_level_is_honoured(tmp_path, backend):
    layout = Layout([Dim("t", 0, 4, 1), Dim("y", 64, 32, 2), Dim("x", 64, 32, 2)], "uint16")
    from napari_tileshard import SyntheticCamera

    data = SyntheticCamera((64, 64), "uint16", seed=3).stack(16)
    sizes = {}
    for level in (1, 19):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Writer(tmp_path / f"l{level}.zarr", layout, level=level, backend=backend) as writer:
                writer.append(data)
        sizes[level] = writer.stats.bytes_out
        meta = zarr.open_array(tmp_path / f"l{level}.zarr").metadata.to_dict()
        assert meta["codecs"][0]["configuration"]["codecs"][1]["configuration"]["level"] == level
        level_warnings = [w for w in caught if "compression level" in str(w.message)]
        if backend == "gpu" and level != 1:  # nvCOMP's zstd has no level: say so instead of ignoring it
            assert level_warnings
        else:
            assert not level_warnings
    if backend == "cpu":
        assert sizes[19] < sizes[1]


def test_unbounded_shape_follows_completed_shard_epochs(tmp_path, backend):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 8, 4, 1)], "uint16")  # shard epoch = 4 rows
    path = tmp_path / "grow.zarr"
    frames = random_data((11, 8), "uint16", np.random.default_rng(4))
    writer = Writer(path, layout, backend=backend, batch_bytes=1)
    try:
        assert zarr.open_array(path).shape == (0, 8)
        seen = []
        for i, frame in enumerate(frames):
            writer.append(frame)
            writer.sync()  # let the pipeline catch up so the shape is deterministic
            shape0 = zarr.open_array(path).shape[0]
            seen.append(shape0)
            assert shape0 == (i + 1) // 4 * 4
            np.testing.assert_array_equal(read_back(path), frames[:shape0])
    finally:
        writer.close()
    assert zarr.open_array(path).shape == (11, 8)
    np.testing.assert_array_equal(read_back(path), frames)


def test_flush_writes_partial_shards_and_stream_continues(tmp_path, backend):
    layout = Layout([Dim("t", 0, 4, 2), Dim("y", 10, 4, 2), Dim("x", 6, 4, 1)], "int16")
    path = tmp_path / "flush.zarr"
    data = random_data((13, 10, 6), "int16", np.random.default_rng(5))
    with Writer(path, layout, backend=backend) as writer:
        writer.append(data[:5])
        writer.flush()
        np.testing.assert_array_equal(read_back(path), data[:5])
        assert verify(path).ok
        writer.append(data[5:11])
        writer.flush()
        np.testing.assert_array_equal(read_back(path), data[:11])
        writer.append(data[11:])
    np.testing.assert_array_equal(read_back(path), data)
    assert verify(path).ok


def test_fixed_size_array(tmp_path, backend):
    layout = Layout([Dim("z", 7, 3, 2), Dim("y", 9, 4, 2), Dim("x", 5, 2, 2)], "float32")
    data = random_data(layout.shape, "float32", np.random.default_rng(6))
    with Writer(tmp_path / "f.zarr", layout, backend=backend) as writer:
        writer.append(data[:3])
        writer.append(data[3:])
        with pytest.raises(ValueError, match="exceed the declared array shape"):
            writer.append(data[:1])
        with pytest.raises(ValueError, match="exceed the declared array shape"):
            writer.write(b"\x00" * 4)
    np.testing.assert_array_equal(read_back(tmp_path / "f.zarr"), data)


def test_fixed_size_short_write_reads_fill_value(tmp_path, backend):
    layout = Layout([Dim("z", 8, 2, 2), Dim("x", 6, 4, 1)], "uint8")
    data = random_data((3, 6), "uint8", np.random.default_rng(7))
    with Writer(tmp_path / "s.zarr", layout, backend=backend) as writer:
        writer.append(data)
    out = read_back(tmp_path / "s.zarr")
    assert out.shape == (8, 6)
    np.testing.assert_array_equal(out[:3], data)
    assert not out[3:].any()


@pytest.mark.parametrize("store_kind", ["memory", "local"])
def test_zarr_store_objects(tmp_path, backend, store_kind):
    from zarr.storage import LocalStore, MemoryStore

    store = MemoryStore() if store_kind == "memory" else LocalStore(tmp_path / "ls.zarr")
    layout = Layout([Dim("t", 0, 2, 2), Dim("x", 9, 4, 2)], "uint32")
    data = random_data((7, 9), "uint32", np.random.default_rng(8))
    with Writer(store, layout, backend=backend) as writer:
        writer.append(data)
    np.testing.assert_array_equal(zarr.open_array(store, mode="r")[...], data)
    assert verify(store).ok


def test_stats(tmp_path, backend):
    layout = Layout([Dim("t", 0, 4, 1), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")
    from napari_tileshard import SyntheticCamera

    with Writer(tmp_path / "s.zarr", layout, backend=backend) as writer:
        for frame in SyntheticCamera((32, 32), "uint16", seed=1).frames(10):
            writer.append(frame)
    stats = writer.stats
    assert stats.frames == 10
    assert stats.bytes_in == 10 * 32 * 32 * 2
    assert stats.shards_written == 3  # 3 shard epochs (4 + 4 + 2 frames), one shard each
    on_disk = sum(p.stat().st_size for p in (tmp_path / "s.zarr" / "c").rglob("*") if p.is_file())
    assert stats.bytes_out == on_disk
    assert stats.compression_ratio == pytest.approx(stats.bytes_in / on_disk)
    assert stats.elapsed_s > 0 and stats.throughput_gbps > 0
    assert stats.backend.startswith(backend)
    assert writer.memory_estimate()["host"] >= 2 * writer.batch_bytes


def test_memory_estimate_is_bounded_by_batches(tmp_path):
    layout = Layout([Dim("t", 0, 32, 1), Dim("y", 2048, 256, 4), Dim("x", 2048, 256, 4)], "uint16")
    with Writer(tmp_path / "m.zarr", layout, backend="cpu", batch_bytes=1) as writer:
        estimate = writer.memory_estimate()["host"]
        assert writer.batch_bytes == layout.epoch_bytes  # at least one whole tile epoch
        # two staging epochs + three epochs of worst-case compressed tiles
        assert 2 * layout.epoch_bytes < estimate < 6 * layout.epoch_bytes


def test_write_returns_unconsumed_when_pipeline_full(tmp_path):
    """write() never blocks: with every staging buffer busy it hands back the tail."""
    from napari_tileshard.testing import FaultInjectingSink

    layout = Layout([Dim("t", 0, 1, 1), Dim("x", 4, 4, 1)], "uint8")
    gate = __import__("threading").Event()
    sink = FaultInjectingSink(tmp_path / "bp.zarr", hold={"c/*": gate})  # storage stuck: the pipeline fills
    writer = Writer(sink, layout, backend="cpu", batch_bytes=1)
    try:
        data = bytes(range(40))
        rest = writer.write(data)
        assert 0 < rest.nbytes < len(data)  # some taken, then backpressure
        taken = len(data) - rest.nbytes
        gate.set()
        writer.append(np.frombuffer(bytes(rest), dtype=np.uint8).reshape(-1, 4))
    finally:
        gate.set()
        writer.close()
    assert taken % 4 == 0  # whole staging buffers (one 4-byte epoch each)
    np.testing.assert_array_equal(read_back(tmp_path / "bp.zarr").reshape(-1), np.frombuffer(data, np.uint8))


def test_stray_bytes_at_close_are_warned_about_and_not_published(tmp_path):
    """A partial row (here 1.5 elements of a 2-element row) is never claimed by zarr.json."""
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 2, 2, 1)], "uint16")
    writer = Writer(tmp_path / "p.zarr", layout, backend="cpu")
    writer.write(b"\x01\x00\x02\x00\x03")
    with pytest.warns(IncompleteFrameWarning, match="the last 1 bytes given to write"):
        writer.close()
    np.testing.assert_array_equal(read_back(tmp_path / "p.zarr"), [[1, 2]])


def test_slow_stream_reaches_disk_within_max_latency(tmp_path, backend):
    """A trickle of frames is not held back until a large batch fills up."""
    import time

    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 16, 8, 1)], "uint16")
    path = tmp_path / "slow.zarr"
    writer = Writer(path, layout, backend=backend, batch_bytes=1 << 20, max_latency_s=0.2)
    try:
        frames = np.arange(16 * 8, dtype=np.uint16).reshape(8, 16)
        writer.append(frames[:2])
        assert zarr.open_array(path).shape[0] == 0  # still batching
        time.sleep(0.3)
        writer.append(frames[2:4])  # an epoch boundary after max_latency_s: submitted now
        deadline = time.time() + 10
        while zarr.open_array(path).shape[0] < 4 and time.time() < deadline:
            time.sleep(0.02)
        np.testing.assert_array_equal(read_back(path), frames[:4])
    finally:
        writer.close()
    with pytest.raises(ValueError, match="max_latency_s"):
        Writer(tmp_path / "bad.zarr", layout, backend=backend, max_latency_s=0)


def test_cpu_recording_ramps_up_its_first_batches(tmp_path):
    """With many encode threads a CPU batch is many MiB of tile epochs: the first epochs go to the
    encode threads at once (batches of 1, 2, 4, ... epochs), not once a whole batch is copied."""
    import time

    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 1024, 256, 1), Dim("x", 1024, 256, 1)], "uint16")
    frames = np.zeros((40, 1024, 1024), dtype=np.uint16)
    frames[:, ::7, ::5] = np.arange(40, dtype=np.uint16)[:, None, None]
    path = tmp_path / "ramp.zarr"
    writer = Writer(path, layout, backend="cpu", threads=4, batch_bytes=32 * layout.epoch_bytes, max_latency_s=600)
    try:
        assert writer.batch_bytes == 64 << 20
        writer.append(frames[0])  # one tile epoch of a 32-epoch batch
        deadline = time.time() + 10
        while zarr.open_array(path).shape[0] < 1 and time.time() < deadline:
            time.sleep(0.02)
        assert zarr.open_array(path).shape[0] == 1  # encoded and published without waiting for 31 more
        writer.append(frames[1:])
    finally:
        writer.close()
    np.testing.assert_array_equal(read_back(path), frames)


def test_cpu_ramp_writes_the_same_bytes(tmp_path, monkeypatch):
    """The ramp changes when batches start, not what is stored: the shards are byte-identical."""
    from napari_tileshard.engine.backends import cpu as cpu_backend

    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 1024, 256, 2), Dim("x", 1024, 256, 2)], "uint16")
    frames = np.random.default_rng(0).integers(0, 64, (36, 1024, 1024), dtype=np.uint16)
    stored = {}
    for ramp in (True, False):
        monkeypatch.setattr(cpu_backend, "RAMP_UP", ramp)
        path = tmp_path / f"ramp-{ramp}.zarr"
        with Writer(path, layout, backend="cpu", threads=4, batch_bytes=16 * layout.epoch_bytes) as writer:
            for frame in frames:
                writer.append(frame)
        shards = sorted(p for p in (path / "c").rglob("*") if p.is_file())
        stored[ramp] = {p.relative_to(path).as_posix(): p.read_bytes() for p in shards}
    assert len(stored[True]) == 9 * 2 * 2 and stored[True] == stored[False]


def test_a_frame_left_incomplete_by_write_is_named_when_closing(tmp_path):
    """write() bytes short of a whole frame were dropped at close() without a word."""
    layout = Layout([Dim("t", 0, 1, 1), Dim("y", 8, 8, 1), Dim("x", 8, 8, 1)], "uint16")
    writer = Writer(tmp_path / "a.zarr", layout, backend="cpu")
    writer.write(bytes(128) + bytes(10))  # one frame of 128 bytes, then 10 of the next
    with pytest.warns(IncompleteFrameWarning, match="the last 10 bytes given to write.*the store holds 1 whole frames"):
        writer.close()
    assert writer.closed
    assert zarr.open_array(tmp_path / "a.zarr").shape[0] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Writer(tmp_path / "b.zarr", layout, backend="cpu") as whole:
            whole.write(bytes(256))  # whole frames: no warning
