"""The GPU read path's host side on the CPU: :class:`GpuReadPath` driven through a stand-in for
CuPy and nvCOMP (``fake_device``), its output compared with zarr-python's.  Batching, the
per-batch tables, the realignment of chunks for nvCOMP, absent chunks, the un-tiling parameters
and both outputs (device array, NumPy through pinned pieces) run here on every commit; the
kernels' own code and the streams' ordering only on a GPU (the ``gpu`` tests)."""

from __future__ import annotations

import fake_device
import numpy as np
import pytest
from test_read import _zarr_array  # the same arrays the CPU path is checked on

from napari_tileshard import Dim, Layout, ShardReader, Writer
from napari_tileshard.format.shard_spec import ChunkDecodeError
from napari_tileshard.reader.gpu import GpuReadPath


def _gpu_path(reader: ShardReader, pinned=None) -> GpuReadPath:
    pinned = pinned or fake_device.pinned_pool()
    return GpuReadPath(reader, cupy_module=fake_device.cupy, nvcomp_module=fake_device.nvcomp, pinned=pinned)


@pytest.mark.parametrize(
    ("shape", "chunks", "shards", "dtype"),
    [
        ((12, 40, 36), (2, 8, 12), (4, 16, 36), "uint16"),
        ((9, 33, 17), (3, 5, 4), (3, 10, 8), "uint8"),  # edge chunks and shards
        ((6, 20, 20), (1, 10, 10), (2, 20, 20), "float32"),
        ((5, 64), (2, 16), (4, 32), "int64"),
    ],
)
@pytest.mark.parametrize("device", [False, True], ids=["numpy", "device"])
def test_gpu_read_path_equals_zarr_with_many_small_batches(tmp_path, monkeypatch, shape, chunks, shards, dtype, device):
    """Small batch caps make many batches (the ramp from 1/8 of the cap, buffers that grow from
    batch to batch); zarr-python packs chunks back to back, so nvCOMP's alignment needs them moved."""
    array = _zarr_array(tmp_path / "a.zarr", shape, chunks, shards, dtype, "zstd", fill=7)
    monkeypatch.setenv("TILESHARD_GPU_BATCH_BYTES", str(4 * int(np.prod(chunks)) * np.dtype(dtype).itemsize))
    reader = ShardReader(tmp_path / "a.zarr", backend="cpu")
    path = _gpu_path(reader)
    assert any(np.any(b.chunk_src % path.align) for b in path.batches(reader.plan(...)))  # chunks moved for nvCOMP
    selections = [..., (slice(1, None, 2),), (shape[0] - 1,), tuple(slice(1, -1) for _ in shape)]
    for selection in selections:
        plan = reader.plan(selection)
        assert len(path.batches(plan)) > 1 or selection != ...
        got = path.read(plan, device=device)
        np.testing.assert_array_equal(np.asarray(got), array[selection], err_msg=str(selection))
    path.close()


def test_gpu_read_path_reads_our_writers_shards(tmp_path):
    layout = Layout([Dim("t", 8, 2, 2), Dim("y", 64, 16, 2), Dim("x", 48, 16, 3)], "uint16")
    frames = (np.arange(8 * 64 * 48, dtype=np.uint16).reshape(8, 64, 48) * 7) % 1000
    with Writer(tmp_path / "w.zarr", layout, backend="cpu") as writer:
        writer.append(frames)
    reader = ShardReader(tmp_path / "w.zarr", backend="cpu")
    path = _gpu_path(reader)
    np.testing.assert_array_equal(path.read(reader.plan(...), device=False), frames)
    np.testing.assert_array_equal(path.read(reader.plan((3, slice(5, 60))), device=False), frames[3, 5:60])
    path.close()


def test_a_chunk_nvcomp_cannot_decode_is_named(tmp_path):
    _zarr_array(tmp_path / "a.zarr", (4, 16, 16), (2, 8, 8), (4, 16, 16), "uint16", "zstd", holes=False)
    reader = ShardReader(tmp_path / "a.zarr", backend="cpu")
    plan = reader.plan(...)
    read = plan.reads[0]
    shard = tmp_path / "a.zarr" / read.key
    raw = bytearray(shard.read_bytes())
    first = read.start + int(read.offsets[0])
    raw[first : first + 4] = b"\0\0\0\0"  # the first chunk's zstd magic number
    shard.write_bytes(bytes(raw))
    path = _gpu_path(reader)
    with pytest.raises(ChunkDecodeError, match="nvCOMP zstd decode failed"):
        path.read(plan, device=False)
    path.close()


def test_a_fresh_reader_reads_with_the_pinned_buffers_an_earlier_read_gave_back(tmp_path):
    """Each read gives its staging buffers and D2H pieces back to the pool when it ends; a new
    path (a fresh reader, the old one not yet collected) pins nothing more for the same read."""
    array = _zarr_array(tmp_path / "a.zarr", (12, 40, 36), (2, 8, 12), (4, 16, 36), "uint16", "zstd", fill=7)
    pool = fake_device.pinned_pool()
    earlier = ShardReader(tmp_path / "a.zarr", backend="cpu")  # a path's reader owns it
    first = _gpu_path(earlier, pool)
    reader = ShardReader(tmp_path / "a.zarr", backend="cpu")
    np.testing.assert_array_equal(first.read(reader.plan(...), device=False), array[...])
    pinned, idle = pool.pinned, pool.idle()
    assert pinned >= 2 and idle > 0  # staging and the two D2H pieces (one reusing the staging), all back
    second = _gpu_path(reader, pool)  # the first still alive, as a reader waiting for the collector is
    for _ in range(2):
        np.testing.assert_array_equal(second.read(reader.plan(...), device=False), array[...])
        np.testing.assert_array_equal(second.read(reader.plan((slice(1, 5),)), device=True), array[1:5])
    assert pool.pinned == pinned and pool.idle() == idle
    first.close()
    second.close()


def test_a_read_that_fails_gives_its_staging_back(tmp_path):
    _zarr_array(tmp_path / "a.zarr", (4, 16, 16), (2, 8, 8), (4, 16, 16), "uint16", "zstd", holes=False)
    reader = ShardReader(tmp_path / "a.zarr", backend="cpu")
    plan = reader.plan(...)
    shard = tmp_path / "a.zarr" / plan.reads[0].key
    raw = bytearray(shard.read_bytes())
    first = plan.reads[0].start + int(plan.reads[0].offsets[0])
    raw[first : first + 4] = b"\0\0\0\0"
    shard.write_bytes(bytes(raw))
    pool = fake_device.pinned_pool()
    path = _gpu_path(reader, pool)
    with pytest.raises(ChunkDecodeError):
        path.read(plan, device=False)
    assert pool.pinned == 1 and pool.idle() > 0
    path.close()
