"""Shard bytes checked against the sharding_indexed spec, independently of the writer's code."""

import json

import google_crc32c
import numpy as np
import pytest
import zstandard

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
EMPTY = 2**64 - 1


def parse_shard(raw: bytes, chunks: int):
    """Index at the end: chunks x (offset, nbytes) uint64 LE, then CRC32C (LE) of those bytes."""
    index_raw, crc = raw[-(chunks * 16 + 4) : -4], raw[-4:]
    assert int.from_bytes(crc, "little") == google_crc32c.value(index_raw)
    pairs = [
        (int.from_bytes(index_raw[i : i + 8], "little"), int.from_bytes(index_raw[i + 8 : i + 16], "little"))
        for i in range(0, len(index_raw), 16)
    ]
    return pairs, len(raw) - (chunks * 16 + 4)


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_shard_bytes_follow_the_spec(tmp_path, backend, codec):
    # y: 3 tiles of 8 (last partial) in shards of 2 tiles -> an edge shard with an empty slot;
    # t: 5 frames in tiles of 2, 2 tiles per shard -> a partial last shard epoch.
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 20, 8, 2), Dim("x", 16, 8, 1)], "uint16")
    frames = SyntheticCamera((20, 16), "uint16", seed=9).stack(5)
    path = tmp_path / "spec.zarr"
    with Writer(path, layout, codec=codec, level=3, backend=backend) as writer:
        writer.append(frames)
    meta = json.loads((path / "zarr.json").read_text())
    assert meta["shape"] == [5, 20, 16]
    assert meta["dimension_names"] == ["t", "y", "x"]
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [4, 16, 8]
    sharding = meta["codecs"][0]
    assert sharding["name"] == "sharding_indexed"
    assert sharding["configuration"]["chunk_shape"] == [2, 8, 8]
    assert sharding["configuration"]["index_location"] == "end"
    files = sorted(p.relative_to(path / "c").as_posix() for p in (path / "c").rglob("*") if p.is_file())
    assert files == [f"{t}/{y}/{x}" for t in range(2) for y in range(2) for x in range(2)]
    tile_bytes = 2 * 8 * 8 * 2
    chunks = 2 * 2 * 1
    for name in files:
        t, y, x = map(int, name.split("/"))
        pairs, data_end = parse_shard((path / "c" / name).read_bytes(), chunks)
        raw = (path / "c" / name).read_bytes()
        for chunk, (offset, nbytes) in enumerate(pairs):
            wt, wy = divmod(chunk, 2)
            exists = (2 * t + wt) * 2 < 5 and (2 * y + wy) < 3
            if not exists:
                assert (offset, nbytes) == (EMPTY, EMPTY), (name, chunk)
                continue
            assert offset + nbytes <= data_end
            blob = raw[offset : offset + nbytes]
            if codec == "zstd":
                assert blob[:4] == ZSTD_MAGIC
                stream = zstandard.ZstdDecompressor().decompressobj()
                decoded = stream.decompress(blob)
                assert stream.unused_data == b""  # exactly one frame per chunk
            else:
                decoded = blob
            assert len(decoded) == tile_bytes
            tile = np.frombuffer(decoded, "<u2").reshape(2, 8, 8)
            rows = slice(2 * (2 * t + wt), 2 * (2 * t + wt) + 2)
            ys = slice(8 * (2 * y + wy), 8 * (2 * y + wy) + 8)
            expected = np.zeros((2, 8, 8), np.uint16)
            block = frames[rows, ys, 8 * x : 8 * x + 8]
            expected[: block.shape[0], : block.shape[1], : block.shape[2]] = block
            np.testing.assert_array_equal(tile, expected)  # edge tiles padded with the fill value 0
