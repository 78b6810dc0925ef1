"""The codec registry through the writer: every writable codec end to end, its metadata against
zarr-python's own, its errors, the GPU backend's refusal, and verify through the codec's decoder
(the codec objects on their own: tests/format/test_codec_objects.py).

A new codec is added to ``ZARR_CHAIN`` below (its chain written independently of codecs.py) and
is then covered by every parametrized test here.
"""

import json
import time

import crc32c
import numpy as np
import pytest
import zarr
from conftest import read_back, read_tensorstore
from zarr.codecs import BloscCodec, ZstdCodec

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer, verify
from napari_tileshard.apps.cli import main
from napari_tileshard.engine.backends import select_backend
from napari_tileshard.format import codecs
from napari_tileshard.format.shard_spec import array_metadata

#: the inner compressors zarr-python is given for each codec at ``level`` and ``itemsize``
ZARR_CHAIN = {
    "zstd": lambda level, itemsize: [ZstdCodec(level=level, checksum=False)],
    "none": lambda level, itemsize: [],
    "blosc-lz4": lambda level, itemsize: [
        BloscCodec(cname="lz4", clevel=level, shuffle="shuffle", typesize=itemsize, blocksize=0)
    ],
}
NAMES = codecs.names()


def test_every_codec_has_a_reference_chain():
    assert set(ZARR_CHAIN) == set(NAMES)


def _level(name):
    return 3 if codecs.get(name).level_range else 1


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return (np.cumsum(rng.integers(0, 3, shape), axis=-1) % 200).astype(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_round_trip_through_zarr_and_tensorstore(tmp_path, name, dtype):
    # odd sizes: edge tiles along y and x, an edge shard along x, a partial last shard epoch
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 37, 16, 2), Dim("x", 45, 16, 2)], dtype)
    data = _data((7, 37, 45), dtype)
    path = tmp_path / "a.zarr"
    with Writer(path, layout, codec=name, level=_level(name), backend="cpu") as writer:
        writer.append(data)
    np.testing.assert_array_equal(read_back(path), data)
    np.testing.assert_array_equal(read_tensorstore(path), data)
    assert verify(path).ok


@pytest.mark.parametrize("name", NAMES)
def test_pyramid_round_trip_with_pieces_that_hold_no_tile(tmp_path, name):
    # two threads split each shard along y; the small levels leave some pieces without a tile
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 33, 8, 2), Dim("x", 20, 8, 2)], "float32")
    data = _data((5, 33, 20), "float32", seed=1)
    path = tmp_path / "p.zarr"
    with Writer(path, layout, codec=name, level=_level(name), backend="cpu", ome=True, threads=2) as writer:
        writer.append(data)
    np.testing.assert_array_equal(zarr.open_array(path / "0", mode="r")[...], data)
    assert verify(path).ok


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["uint16", "float32"])
def test_metadata_is_what_zarr_writes_for_the_same_chain(tmp_path, name, dtype):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 21, 8, 2), Dim("x", 19, 5, 3)], dtype)
    level = _level(name)
    ours = array_metadata(layout, name, level, 7, {})
    reference = zarr.create_array(
        tmp_path / "ref.zarr",
        shape=(7, 21, 19),
        dtype=dtype,
        chunks=layout.tile_shape,
        shards=layout.shard_shape,
        fill_value=0,
        dimension_names=layout.names,
        compressors=ZARR_CHAIN[name](level, layout.itemsize),
    )
    theirs = json.loads((tmp_path / "ref.zarr" / "zarr.json").read_text())
    for meta in (ours, theirs):
        meta.pop("attributes", None)
        meta.pop("storage_transformers", None)
    assert ours == theirs
    assert array_metadata(layout, codecs.get(name), level, 7, {})["codecs"] == ours["codecs"]  # name or Codec
    assert codecs.from_zarr_codecs(
        reference.metadata.to_dict()["codecs"][0]["configuration"]["codecs"], dtype
    ) == codecs.get(name).configure(level, dtype)


@pytest.mark.parametrize("name", ["zstd", "none"])
def test_cpu_backend_shards_are_the_per_tile_reference_bytes(tmp_path, name):
    """Every shard file is, byte for byte, what one independent zstandard/raw call per tile gives:
    chunks in row-major order within the shard, then the (offset, nbytes) index and its CRC32C."""
    import zstandard

    tile, per_shard, shape = (2, 16, 16), (2, 2, 2), (7, 37, 45)
    layout = Layout([Dim(d, s if d != "t" else 0, t, k) for d, s, t, k in zip("tyx", shape, tile, per_shard)], "uint16")
    data = _data(shape, "uint16", seed=6)
    with Writer(tmp_path / "a.zarr", layout, codec=name, level=_level(name), backend="cpu") as writer:
        writer.append(data)
    np.testing.assert_array_equal(read_back(tmp_path / "a.zarr"), data)

    encode = zstandard.ZstdCompressor(level=_level(name)).compress if name == "zstd" else bytes
    tiles_along = [-(-s // t) for s, t in zip(shape, tile)]  # tiles that hold array elements
    padded = np.zeros([n * t for n, t in zip(tiles_along, tile)], "uint16")  # edge tiles: fill value 0
    padded[: shape[0], : shape[1], : shape[2]] = data
    shards = [-(-n // k) for n, k in zip(tiles_along, per_shard)]
    for shard in np.ndindex(*shards):
        body, index = b"", []
        for within in np.ndindex(*per_shard):
            t = [s * k + w for s, k, w in zip(shard, per_shard, within)]
            if any(c >= n for c, n in zip(t, tiles_along)):
                index.append((2**64 - 1, 2**64 - 1))  # no such tile: an edge shard's missing chunk
                continue
            chunk = encode(padded[tuple(slice(c * n, (c + 1) * n) for c, n in zip(t, tile))].tobytes())
            index.append((len(body), len(chunk)))
            body += chunk
        raw_index = np.array(index, dtype="<u8").tobytes()
        expected = body + raw_index + crc32c.crc32c(raw_index).to_bytes(4, "little")
        key = "/".join(map(str, shard))
        assert (tmp_path / "a.zarr" / "c" / key).read_bytes() == expected, key


@pytest.mark.parametrize(
    "name, level, error, message",
    [
        ("zstd", 40, ValueError, "zstd level must be in -7..22, got 40"),
        ("zstd", -8, ValueError, "zstd level must be in -7..22, got -8"),
        ("blosc-lz4", 10, ValueError, "blosc-lz4 level must be in 0..9, got 10"),
        ("blosc-lz4", 2.0, TypeError, "level must be an integer, got 2.0"),
        ("none", True, TypeError, "level must be an integer, got True"),
    ],
)
def test_validate_level_names_the_value_and_range(tmp_path, name, level, error, message):
    with pytest.raises(error, match=message):
        codecs.get(name).validate_level(level)
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "uint8")
    with pytest.raises(error, match=message):
        Writer(tmp_path / "never.zarr", layout, codec=name, level=level, backend="cpu")
    assert not (tmp_path / "never.zarr").exists()


def test_unknown_codec_lists_the_registry(tmp_path, capsys):
    expected = f"codec 'lz4' is not one of {', '.join(NAMES)}"
    assert expected == "codec 'lz4' is not one of zstd, none, blosc-lz4"
    with pytest.raises(ValueError, match=expected):
        codecs.get("lz4")
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "uint8")
    with pytest.raises(ValueError, match=expected):
        Writer(tmp_path / "never.zarr", layout, codec="lz4", backend="cpu")
    with pytest.raises(SystemExit):
        main(["record", str(tmp_path / "x.zarr"), "--codec", "lz4"])
    assert "blosc-lz4" in capsys.readouterr().err  # argparse's choices come from the registry


def test_gpu_refusal_needs_no_gpu_and_auto_falls_back_to_the_cpu(tmp_path):
    from napari_tileshard.engine.backends.gpu import GpuBackend

    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 64, 16, 2)], "uint16")
    reason = codecs.gpu_support("blosc-lz4")
    with pytest.raises(ValueError) as refused:
        GpuBackend(layout, "blosc-lz4", 1)
    assert str(refused.value) == reason
    with pytest.raises(ValueError) as refused:  # not "no GPU": the codec is the reason everywhere
        Writer(tmp_path / "never.zarr", layout, codec="blosc-lz4", backend="gpu")
    assert str(refused.value) == reason and not (tmp_path / "never.zarr").exists()
    backend = select_backend("auto", layout, "blosc-lz4", 1)
    try:
        assert backend.name == "cpu" and backend.codec == codecs.get("blosc-lz4").configure(1, "uint16")
    finally:
        backend.close()
    with Writer(tmp_path / "auto.zarr", layout, codec="blosc-lz4", backend="auto") as writer:
        writer.append(np.arange(128, dtype=np.uint16).reshape(2, 64))
    assert writer.backend == "cpu"
    np.testing.assert_array_equal(read_back(tmp_path / "auto.zarr"), np.arange(128).reshape(2, 64))


def test_compressed_tile_bound_is_the_codecs():
    layout = Layout([Dim("t", 0, 4, 1), Dim("x", 1000, 500, 1)], "uint16")  # 4000-byte tiles
    assert layout.compressed_tile_bound("none") == 4000
    assert layout.compressed_tile_bound(codecs.get("blosc-lz4")) == 4016
    assert layout.compressed_tile_bound("zstd") == 4000 + 15 + 62  # ZSTD_COMPRESSBOUND
    assert layout.compressed_tile_bound() == max(layout.compressed_tile_bound(n) for n in NAMES)


# -- verify decodes with the codec ------------------------------------------------------------------
def _blosc_store(path):
    layout = Layout([Dim("t", 0, 4, 2), Dim("y", 64, 32, 2), Dim("x", 64, 32, 1)], "uint16")  # 8 KiB tiles, 4 per shard
    with Writer(path, layout, codec="blosc-lz4", level=5, backend="cpu") as writer:
        writer.append(SyntheticCamera((64, 64), "uint16", seed=4).stack(16))
    return path


def _chunk(shard, chunk, chunks=4):
    raw = bytearray(shard.read_bytes())
    offset, nbytes = np.frombuffer(bytes(raw[-(chunks * 16 + 4) : -4]), "<u8").reshape(chunks, 2)[chunk]
    return raw, int(offset), int(nbytes)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda raw, offset, nbytes: raw.__setitem__(slice(offset + 4, offset + 8), (1 << 20).to_bytes(4, "little")),
            "blosc header declares 1048576 bytes, expected 8192",
        ),
        (
            lambda raw, offset, nbytes: raw.__setitem__(slice(offset + 16, offset + nbytes), bytes(nbytes - 16)),
            "blosc decode failed",
        ),
        (
            lambda raw, offset, nbytes: raw.__setitem__(
                slice(offset + 12, offset + 16), (nbytes + 9).to_bytes(4, "little")
            ),
            "compressed bytes, the chunk holds",
        ),
    ],
)
def test_verify_finds_a_corrupted_blosc_chunk(tmp_path, corrupt, message):
    path = _blosc_store(tmp_path / "b.zarr")
    assert verify(path).ok
    shard = path / "c/1/0/0"
    raw, offset, nbytes = _chunk(shard, 2)
    assert nbytes < 8192  # lz4 really compressed it
    corrupt(raw, offset, nbytes)
    shard.write_bytes(bytes(raw))
    problems = verify(path).problems
    assert [(p.key, p.chunk) for p in problems] == [("c/1/0/0", 2)], problems
    assert message in problems[0].message


def test_verify_bounds_a_blosc_chunk_by_the_codec(tmp_path):
    path = _blosc_store(tmp_path / "b.zarr")
    shard = path / "c/0/0/0"
    raw, offset, nbytes = _chunk(shard, 0)
    index = np.frombuffer(bytes(raw[-(4 * 16 + 4) : -4]), "<u8").reshape(4, 2).copy()
    index[0, 1] = 8192 + 17  # one byte more than blosc makes of one 8 KiB tile
    index[1, 1] = 15  # shorter than a blosc header
    body = index.astype("<u8").tobytes()
    shard.write_bytes(bytes(raw[: -(4 * 16 + 4)]) + body + crc32c.crc32c(body).to_bytes(4, "little"))
    problems = {p.chunk: p.message for p in verify(path).problems}
    assert set(problems) == {0, 1}
    assert "more than blosc-lz4 makes of one tile of 8192 bytes (at most 8208)" in problems[0]
    assert "fewer than blosc-lz4 makes of one tile (at least 16)" in problems[1]


def test_cli_records_and_verifies_blosc(tmp_path, capsys):
    out = tmp_path / "cli.zarr"
    assert (
        main(
            [
                "record",
                str(out),
                "--shape",
                "0,48,40",
                "--tile",
                "2,16,16",
                "--tiles-per-shard",
                "2,2,2",
                "--frames",
                "9",
                "--codec",
                "blosc-lz4",
                "--level",
                "4",
                "--backend",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    assert zarr.open_array(out, mode="r").shape == (9, 48, 40)
    assert main(["verify", str(out)]) == 0
    start = time.perf_counter()  # refused before the camera renders its 2048² frames (seconds)
    assert main(["record", str(tmp_path / "bad.zarr"), "--codec", "blosc-lz4", "--level", "12"]) == 2
    assert time.perf_counter() - start < 1.0
    assert "blosc-lz4 level must be in 0..9, got 12" in capsys.readouterr().err
    assert not (tmp_path / "bad.zarr").exists()
