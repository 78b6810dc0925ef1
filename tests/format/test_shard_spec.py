"""ShardSpec: zarr.json to spec and back (our arrays, zarr-python's, tensorstore's), every reason an
array is refused, keys, and the shard index (encode, decode, validate) against a NumPy reference."""

import dataclasses
import json

import crc32c
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ShardingCodec, ZstdCodec

from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer, verify
from napari_tileshard.format import EMPTY
from napari_tileshard.format.codecs import Blosc, BloscLz4, Gzip, Opaque, Raw, Zstd
from napari_tileshard.format.metadata import metadata_bytes
from napari_tileshard.format.shard_spec import ShardIndexError, ShardSpec, UnsupportedArray, array_metadata

LAYOUT = Layout([Dim("t", 0, 2, 2), Dim("y", 21, 8, 2), Dim("x", 19, 5, 3)], "uint16")


def _normalised(meta: dict) -> dict:
    """``meta`` as zarr-python understands it (defaults filled in, tuples as lists)."""
    from zarr.core.metadata.v3 import ArrayV3Metadata

    return json.loads(json.dumps(ArrayV3Metadata.from_dict(dict(meta)).to_dict(), default=list))


# -- our arrays ---------------------------------------------------------------------------------------
def test_array_metadata_is_what_the_writer_has_always_written():
    """A literal copy of store.array_metadata's output before the format layer existed: the bytes
    of every zarr.json the writer publishes stay the same."""
    meta = array_metadata(LAYOUT, "zstd", 3, 7, {"a": 1})
    expected = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [7, 21, 19],
        "data_type": "uint16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 16, 15]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [2, 8, 5],
                    "codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "zstd", "configuration": {"level": 3, "checksum": False}},
                    ],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    "index_location": "end",
                },
            }
        ],
        "attributes": {"a": 1},
        "dimension_names": ["t", "y", "x"],
        "storage_transformers": [],
    }
    assert metadata_bytes(meta) == metadata_bytes(expected)  # key order included
    uint8 = Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "uint8")
    assert array_metadata(uint8, "none", 1, 0)["codecs"][0]["configuration"]["codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}}  # as before, also for 1-byte types
    ]
    assert array_metadata(Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "float32"), "none", 1, 0)["fill_value"] == 0.0


@pytest.mark.parametrize("codec", ["zstd", "none", "blosc-lz4"])
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_our_zarr_json_round_trips_byte_for_byte(tmp_path, codec, dtype):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 16, 8, 2), Dim("x", 12, 4, 3)], dtype)
    path = tmp_path / "a.zarr"
    with Writer(path, layout, codec=codec, level=2, backend="cpu", ome=True) as writer:
        writer.append(np.zeros((5, 16, 12), dtype))
    for level in range(writer.pyramid.levels):
        raw = (path / str(level) / "zarr.json").read_bytes()
        meta = json.loads(raw)
        spec = ShardSpec.from_metadata(meta)
        assert metadata_bytes(spec.to_metadata(meta["attributes"])) == raw
        assert spec.codec.name == codec and spec.codec.typesize == np.dtype(dtype).itemsize
        assert spec.dtype == np.dtype(dtype) and spec.dimension_names == ("t", "y", "x")


def test_from_layout_is_the_layouts_geometry():
    spec = ShardSpec.from_layout(LAYOUT, Zstd(level=3, typesize=2), 7)
    assert (spec.shape, spec.shard_shape, spec.chunk_shape) == ((7, 21, 19), (4, 16, 15), (2, 8, 5))
    assert spec.chunks_per_shard == (2, 2, 3) and spec.chunks == LAYOUT.chunks_per_shard == 12
    assert spec.chunk_bytes == LAYOUT.tile_bytes == 160 and spec.shard_grid == (2, 2, 2)
    assert spec.index_nbytes == 12 * 16 + 4 and spec.data_range(1000) == (0, 1000 - 196)


# -- zarr-python's and tensorstore's arrays -----------------------------------------------------------
def _sharding(codecs=None, index_codecs=None, location="end", chunk_shape=(2, 3)):
    codecs = codecs if codecs is not None else [BytesCodec()]
    index_codecs = index_codecs if index_codecs is not None else [BytesCodec(), zarr.codecs.Crc32cCodec()]
    return ShardingCodec(
        chunk_shape=chunk_shape, codecs=list(codecs), index_codecs=index_codecs, index_location=location
    )


ZARR_ARRAYS = {
    "zstd-default": dict(compressors=[ZstdCodec()]),
    "zstd-checksum": dict(compressors=[ZstdCodec(level=5, checksum=True)]),
    "blosc-lz4": dict(compressors=[BloscCodec(cname="lz4", clevel=3, shuffle="shuffle")]),
    "blosc-zstd-bitshuffle": dict(compressors=[BloscCodec(cname="zstd", clevel=1, shuffle="bitshuffle")]),
    "gzip": dict(compressors=[GzipCodec(level=6)]),
    "raw-uint8": dict(compressors=None, dtype="uint8"),
    "big-endian-start-no-crc": dict(
        serializer=_sharding(
            [BytesCodec(endian="big"), ZstdCodec(level=2)], [BytesCodec(endian="big")], location="start"
        ),
        compressors=None,
    ),
    "dot-separator": dict(compressors=[ZstdCodec()], chunk_key_encoding={"name": "default", "separator": "."}),
    "v2-keys": dict(compressors=[ZstdCodec()], chunk_key_encoding={"name": "v2", "separator": "."}),
    "float-nan-fill": dict(compressors=[ZstdCodec()], dtype="float32", fill_value=float("nan")),
    "no-dimension-names": dict(compressors=[ZstdCodec()], dimension_names=None),
}


@pytest.mark.parametrize("name", list(ZARR_ARRAYS))
def test_zarr_python_arrays_round_trip_and_read_as_zarr_python(tmp_path, name):
    options = dict(shape=(9, 11), chunks=(4, 6), shards=(4, 6), dtype="uint16", fill_value=3)
    options["dimension_names"] = ("y", "x")
    options.update(ZARR_ARRAYS[name])
    if "serializer" in options:
        options.pop("shards")
    array = zarr.create_array(store=tmp_path / "a.zarr", **options)
    data = (np.arange(99).reshape(9, 11) % 7).astype(options["dtype"])
    data[:4] = options["fill_value"]  # whole chunks of fill value: absent from the shards
    array[...] = data
    stored = json.loads((tmp_path / "a.zarr" / "zarr.json").read_text())
    spec = ShardSpec.from_metadata(stored)
    assert _normalised(spec.to_metadata(stored.get("attributes"))) == _normalised(stored)
    assert ShardSpec.from_metadata(array.metadata.to_dict()) == spec  # zarr's own dict form: the same spec
    reader = ShardReader(tmp_path / "a.zarr", backend="cpu")
    assert reader.fallback_reason is None
    np.testing.assert_array_equal(reader[...], array[...])
    np.testing.assert_array_equal(reader[5:, 1::3], array[5:, 1::3])
    assert verify(tmp_path / "a.zarr").ok, str(verify(tmp_path / "a.zarr"))
    for coords in np.ndindex(*spec.shard_grid):
        key = spec.shard_key(coords)
        assert key == array.metadata.encode_chunk_key(coords) and spec.shard_coords(key) == coords


def test_zarr_python_specs_hold_the_configuration():
    meta = zarr.create_array(
        store={},
        shape=(4, 6),
        chunks=(4, 6),
        dtype="uint16",
        serializer=_sharding([BytesCodec(endian="big"), ZstdCodec(level=4, checksum=True)], [BytesCodec()], "start"),
        compressors=None,
    ).metadata.to_dict()
    spec = ShardSpec.from_metadata(meta)
    assert spec.codec == Zstd(level=4, typesize=2, checksum=True)
    assert (spec.endian, spec.big_endian, spec.chunk_dtype) == ("big", True, np.dtype(">u2"))
    assert (spec.index_location, spec.index_crc, spec.index_endian) == ("start", False, "little")
    assert spec.index_nbytes == 64 and spec.data_range(100) == (64, 100) and spec.index_offset(100) == 0
    assert spec.max_chunk_bytes == Zstd().max_encoded_bytes(12) + 4  # the checksum


def test_tensorstore_arrays_round_trip(tmp_path):
    ts = pytest.importorskip("tensorstore")
    metadata = {
        "shape": [9, 21],
        "data_type": "int32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 8]}},
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [2, 4],
                    "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                },
            }
        ],
    }
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "ts.zarr")}}
    store = ts.open({**spec, "metadata": metadata, "create": True}).result()
    data = np.arange(9 * 21, dtype="int32").reshape(9, 21)
    store[...] = data
    stored = json.loads((tmp_path / "ts.zarr" / "zarr.json").read_text())
    parsed = ShardSpec.from_metadata(stored)
    assert parsed.codec.name == "zstd" and parsed.chunks == 4
    assert _normalised(parsed.to_metadata(stored.get("attributes"))) == _normalised(stored)
    np.testing.assert_array_equal(ShardReader(tmp_path / "ts.zarr", backend="cpu")[...], data)


# -- refusals ----------------------------------------------------------------------------------------
def _ours(**change):
    meta = array_metadata(LAYOUT, "zstd", 1, 7)
    sharding = meta["codecs"][0]["configuration"]
    for key, value in change.items():
        target = sharding if key in ("chunk_shape", "codecs", "index_codecs", "index_location") else meta
        if value is KeyError:
            target.pop(key)
        else:
            target[key] = value
    return meta


REFUSALS = [
    ([], "metadata is a list, not an object"),
    (_ours(zarr_format=2), "a Zarr v2 array"),
    (_ours(node_type="group"), "a 'group' node, not an array"),
    (dict(_ours(), codecs=[{"name": "bytes"}, {"name": "zstd"}]), "not a sharded array (no sharding_indexed codec)"),
    ({k: v for k, v in _ours().items() if k != "codecs"}, "not a sharded array"),
    (dict(_ours(), codecs=[{"name": "transpose"}, _ours()["codecs"][0]]), "codecs ['transpose', 'sharding_indexed']"),
    (_ours(storage_transformers=[{"name": "x"}]), "storage transformers are not supported"),
    (_ours(chunk_grid={"name": "rectilinear", "configuration": {}}), "not a regular chunk grid"),
    (_ours(shape=[7, -1, 19]), "shape [7, -1, 19] is not a list of integers >= 0"),
    (_ours(shape=[7, 21]), "ranks differ"),
    (_ours(chunk_shape=[2, 8, 0]), "chunk shape [2, 8, 0] is not a list of integers >= 1"),
    (_ours(chunk_shape=[3, 8, 5]), "shard shape (4, 16, 15) is not a multiple of chunk shape (3, 8, 5)"),
    (_ours(data_type="string"), "data type 'string' is not read natively"),
    (_ours(data_type={"name": "fixed_length_utf32"}), "data type {'name': 'fixed_length_utf32'} is not read"),
    (_ours(index_codecs=[{"name": "bytes"}, {"name": "zstd"}]), "index codecs ['bytes', 'zstd'] are not supported"),
    (_ours(index_location="middle"), "index location 'middle' is not supported"),
    (
        _ours(codecs=[{"name": "bytes"}, {"name": "zstd"}, {"name": "crc32c"}]),
        "inner codecs ['bytes', 'zstd', 'crc32c'] are not bytes + at most one compressor",
    ),
    (_ours(codecs=[{"name": "transpose"}, {"name": "bytes"}]), "are not bytes + at most one compressor"),
    (_ours(codecs=[{"name": "bytes"}, {"name": "lz4"}]), "compressor 'lz4' is not decoded natively"),
    (
        _ours(codecs=[{"name": "bytes"}, {"name": "blosc", "configuration": {"cname": "brotli"}}]),
        "compressor configuration {'cname': 'brotli'} is not decoded natively",
    ),
    (_ours(codecs=[{"name": "bytes", "configuration": {"endian": "middle"}}]), "endian 'middle' is not"),
    (_ours(chunk_key_encoding={"name": "custom"}), "chunk key encoding {'name': 'custom'} is not supported"),
    (
        _ours(chunk_key_encoding={"name": "default", "configuration": {"separator": "-"}}),
        "chunk key separator '-' is not supported",
    ),
    (_ours(dimension_names="tyx"), "dimension names 'tyx' are not a list of strings"),
]


@pytest.mark.parametrize("meta, reason", REFUSALS, ids=[r for _, r in REFUSALS])
def test_every_refusal_says_why(meta, reason):
    with pytest.raises(UnsupportedArray) as refused:
        ShardSpec.from_metadata(meta)
    assert reason in str(refused.value)
    assert isinstance(refused.value, ValueError)


def test_refusals_reach_the_reader_and_verify(tmp_path):
    plain = zarr.create_array(store=tmp_path / "u.zarr", shape=(5, 5), chunks=(2, 2), dtype="uint8")
    plain[...] = 4
    reader = ShardReader(tmp_path / "u.zarr")
    assert reader.fallback_reason == "not a sharded array (no sharding_indexed codec): read by zarr-python"
    np.testing.assert_array_equal(reader[...], plain[...])
    assert [(p.key, p.message) for p in verify(tmp_path / "u.zarr").problems] == [
        ("zarr.json", "not a sharded array (no sharding_indexed codec): not checked")
    ]


def test_opaque_inner_chains_keep_the_geometry_for_the_inspector():
    meta = _ours(codecs=[{"name": "bytes"}, {"name": "lz4", "configuration": {"acceleration": 1}}])
    with pytest.raises(UnsupportedArray, match="compressor 'lz4'"):
        ShardSpec.from_metadata(meta)
    spec = ShardSpec.from_metadata(meta, opaque=True)
    assert isinstance(spec.codec, Opaque) and spec.chunks == 12 and not spec.codec.writable
    assert spec.to_metadata()["codecs"] == meta["codecs"]
    with pytest.raises(ValueError, match="not decoded natively"):
        spec.codec.decode(b"x", 160)


# -- keys ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "encoding, separator, key",
    [("default", "/", "c/3/0/12"), ("default", ".", "c.3.0.12"), ("v2", ".", "3.0.12"), ("v2", "/", "3/0/12")],
)
def test_shard_keys_and_back(encoding, separator, key):
    spec = dataclasses.replace(ShardSpec.from_layout(LAYOUT, Raw()), chunk_key_encoding=encoding, separator=separator)
    assert spec.shard_key((3, 0, 12)) == key and spec.shard_coords(key) == (3, 0, 12)
    for other in ("zarr.json", "c/3/0", "c/3/0/x", "d/3/0/1", "c/3/0/1/2", "c/-1/0/1", "", "c/³/0/1"):
        assert spec.shard_coords(other.replace("/", separator)) is None, other


def test_zero_dimensional_keys():
    spec = ShardSpec((), np.dtype("uint8"), (), (), Raw())
    assert spec.shard_key(()) == "c" and spec.shard_coords("c") == ()
    v2 = ShardSpec((), np.dtype("uint8"), (), (), Raw(), chunk_key_encoding="v2", separator=".")
    assert v2.shard_key(()) == "0" and v2.shard_coords("0") == ()


# -- the index ----------------------------------------------------------------------------------------
def _reference(offsets, nbytes, little=True, crc=True) -> bytes:
    """The spec's index bytes, written out with plain NumPy and crc32c."""
    pairs = np.stack([np.asarray(offsets, np.uint64), np.asarray(nbytes, np.uint64)], axis=1)
    body = pairs.astype("<u8" if little else ">u8").tobytes()
    return body + (crc32c.crc32c(body).to_bytes(4, "little") if crc else b"")


def _spec(codec=None, chunks=8, **fields):
    """A 1-D spec of ``chunks`` chunks of 100 uint8 per shard."""
    return ShardSpec((chunks * 100,), np.dtype("uint8"), (chunks * 100,), (100,), codec or Zstd(), **fields)


@pytest.mark.parametrize("little", [True, False])
@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("location", ["end", "start"])
def test_index_encode_and_decode_against_numpy(little, crc, location):
    rng = np.random.default_rng(int(little) * 4 + int(crc) * 2 + (location == "end"))
    spec = _spec(index_endian="little" if little else "big", index_crc=crc, index_location=location)
    sizes = rng.integers(1, 120, 8)
    present = rng.random(8) < 0.7
    data_start = 0 if location == "end" else spec.index_nbytes
    offsets = data_start + np.cumsum(sizes) - sizes
    stored_offsets = np.where(present, offsets.astype(np.uint64), np.uint64(EMPTY))
    stored_sizes = np.where(present, sizes.astype(np.uint64), np.uint64(EMPTY))
    ours_u64 = spec.encode_index(stored_offsets, stored_sizes)
    ours_i64 = spec.encode_index(np.where(present, offsets, -1), np.where(present, sizes, -1))  # -1: absent
    expected = _reference(stored_offsets, stored_sizes, little, crc)
    assert ours_u64 == ours_i64 == expected and len(expected) == spec.index_nbytes
    size = int(sizes.sum()) + spec.index_nbytes
    index = spec.decode_index("k", expected, size)
    np.testing.assert_array_equal(index.offsets, np.where(present, offsets, -1))
    np.testing.assert_array_equal(index.nbytes, np.where(present, sizes, -1))
    np.testing.assert_array_equal(index.present, present)
    got_offsets, got_nbytes, crc_ok = spec.index_entries(expected)
    assert crc_ok and got_offsets.tolist() == stored_offsets.tolist() and got_nbytes.tolist() == stored_sizes.tolist()


def _index(spec, entries, size=None):
    offsets, nbytes = zip(*entries)
    raw = spec.encode_index(np.array(offsets, np.uint64), np.array(nbytes, np.uint64))
    return raw, (size if size is not None else 1000)


E = EMPTY
PROBLEMS = [
    # (entries of 4 chunks of 100 bytes (zstd: 1..163 bytes each), object size, [(chunk, message)])
    ([(0, 50), (50, 50), (E, E), (100, 10)], 1000, []),
    ([(0, 50), (E, 50), (50, 5), (E, E)], 1000, [(1, f"(offset {E}, 50 bytes) lies outside the shard data")]),
    ([(0, 50), (5, E), (60, 5), (E, E)], 1000, [(1, f"(offset 5, {E} bytes) lies outside the shard data")]),
    ([(0, 50), (900, 50), (E, E), (E, E)], 1000, [(1, "(offset 900, 50 bytes) lies outside the shard data")]),
    ([(2**64 - 8, 64), (0, 8), (E, E), (E, E)], 1000, [(0, f"(offset {2**64 - 8}, 64 bytes) lies outside")]),
    (
        [(0, 164), (164, 0), (E, E), (E, E)],
        1000,
        [
            (0, "holds 164 bytes, more than zstd makes of one tile of 100 bytes (at most 163)"),
            (1, "holds 0 bytes, fewer than zstd makes of one tile (at least 1)"),
        ],
    ),
    ([(0, 2**62), (E, E), (E, E), (E, E)], 1000, [(0, f"holds {2**62} bytes, more than zstd makes")]),
    (
        [(0, 100), (10, 20), (40, 20), (99, 1)],
        1000,
        [
            (1, "(offset 10, 20 bytes) overlaps chunk 0 (offset 0, 100 bytes)"),
            (2, "(offset 40, 20 bytes) overlaps chunk 0"),
            (3, "(offset 99, 1 bytes) overlaps chunk 0"),
        ],
    ),
    ([(0, 10), (5, 10), (E, E), (E, E)], 1000, [(1, "(offset 5, 10 bytes) overlaps chunk 0 (offset 0, 10 bytes)")]),
]


@pytest.mark.parametrize("entries, size, expected", PROBLEMS)
def test_index_problems_are_listed_and_the_first_is_raised(entries, size, expected):
    spec = _spec(chunks=4)
    raw, size = _index(spec, entries, size)
    index, problems = spec.index_problems("c/0", raw, size)
    assert [(p.key, p.chunk) for p in problems] == [("c/0", chunk) for chunk, _ in expected]
    for problem, (chunk, message) in zip(problems, expected):
        assert problem.reason.startswith(message) and str(problem) == f"c/0 chunk {chunk}: {problem.reason}"
    bad = {chunk for chunk, _ in expected}
    assert index is not None
    assert [i for i in range(4) if index.present[i]] == [
        i for i, e in enumerate(entries) if e != (E, E) and i not in bad
    ]
    if expected:
        with pytest.raises(ShardIndexError) as raised:
            spec.decode_index("c/0", raw, size)
        assert (raised.value.chunk, raised.value.reason) == (problems[0].chunk, problems[0].reason)
        _, first = spec.index_problems("c/0", raw, size, limit=1)
        assert [str(p) for p in first] == [str(problems[0])]
    else:
        np.testing.assert_array_equal(spec.decode_index("c/0", raw, size).nbytes, index.nbytes)


def test_truncation_and_crc():
    spec = _spec(chunks=4)
    raw, _ = _index(spec, [(0, 50), (50, 50), (E, E), (100, 10)])
    for size in (0, spec.index_nbytes - 1):
        index, problems = spec.index_problems("s", raw, size)
        assert index is None and [str(p) for p in problems] == [
            f"s: shard of {size} bytes is shorter than its index (68 bytes): truncated"
        ]
    flipped = bytearray(raw)
    flipped[3] ^= 1  # chunk 0's offset 0 -> 2^24: outside, and the CRC no longer matches
    index, problems = spec.index_problems("s", bytes(flipped), 1000)
    assert [(p.chunk, p.reason.split(" (")[0]) for p in problems] == [
        (None, "index CRC32C mismatch"),
        (0, f"(offset {1 << 24}, 50 bytes) lies outside the shard data"),
    ]
    assert spec.index_entries(bytes(flipped))[2] is False
    with pytest.raises(ShardIndexError, match="^s: index CRC32C mismatch$"):
        spec.decode_index("s", bytes(flipped), 1000)
    no_crc = _spec(chunks=4, index_crc=False)
    assert no_crc.index_nbytes == 64 and no_crc.crc_error("s", 0, b"") is None


def test_raw_chunks_hold_exactly_one_tile():
    spec = _spec(Raw(), chunks=2)
    raw, _ = _index(spec, [(0, 100), (100, 99)])
    _, problems = spec.index_problems("s", raw, 1000)
    assert [(p.chunk, p.reason) for p in problems] == [(1, "holds 99 bytes, a tile is 100")]


@pytest.mark.parametrize(
    "codec, low, high", [(Raw(), 100, 100), (Zstd(), 1, 163), (Zstd(checksum=True), 1, 167), (BloscLz4(), 16, 116)]
)
def test_bounds_are_the_codecs(codec, low, high):
    spec = _spec(codec)
    assert (spec.min_chunk_bytes, spec.max_chunk_bytes) == (low, high)
    assert (codec.min_encoded_bytes(100), codec.max_encoded_bytes(100)) == (low, high)


def test_a_start_index_puts_the_data_after_it():
    spec = _spec(chunks=2, index_location="start")
    raw, _ = _index(spec, [(36, 10), (0, 10)])  # chunk 1 inside the index
    _, problems = spec.index_problems("s", raw, 100)
    assert [(p.chunk, p.reason) for p in problems] == [
        (1, "(offset 0, 10 bytes) lies outside the shard data (data is bytes 36..100 of 100)")
    ]


def test_huge_indexes_are_validated_in_blocks_with_the_same_answers():
    spec = _spec(chunks=1000)
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 163, 1000).astype(np.uint64)
    offsets = (np.cumsum(sizes) - sizes).astype(np.uint64)
    sizes[[10, 500, 999]] = [0, 500, 2**63]
    raw = spec.encode_index(offsets, sizes)
    size = int(offsets[-1]) + 200 + spec.index_nbytes
    _, whole = spec.index_problems("s", raw, size)
    blocks = []
    for first in range(0, 1000, 128):
        o, n = spec.entries(raw[first * 16 : min(first + 128, 1000) * 16])
        blocks += spec.entry_problems("s", o, n, size, first=first)[1]
    assert [str(p) for p in blocks] == [str(p) for p in whole] and [p.chunk for p in whole] == [10, 500, 999]


def test_the_writer_encodes_its_index_with_the_spec(tmp_path):
    path = tmp_path / "w.zarr"
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 20, 8, 2), Dim("x", 16, 8, 1)], "uint16")
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(SyntheticCamera((20, 16), "uint16", seed=9).stack(5))
    spec = ShardSpec.from_metadata(json.loads((path / "zarr.json").read_text()))
    for shard in sorted(p for p in (path / "c").rglob("*") if p.is_file()):
        blob = shard.read_bytes()
        index = spec.decode_index("k", blob[-spec.index_nbytes :], len(blob))
        assert spec.encode_index(index.offsets, index.nbytes) == blob[-spec.index_nbytes :]


def test_codec_objects_of_every_kind_are_specs_codecs():
    for codec in (Zstd(), Raw(), BloscLz4(), Blosc(), Gzip()):
        configured = codec.configure(codec.level, "uint16")
        assert ShardSpec.from_metadata(_ours(codecs=configured.zarr_codecs())).codec == configured


# -- verify reports every problem the spec finds ---------------------------------------------------
def _damaged_store(path):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 8, 4, 2), Dim("x", 4, 4, 1)], "uint16")  # 4 chunks per shard
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(SyntheticCamera((8, 4), "uint16", seed=2).stack(4))
    shard = path / "c/0/0/0"
    blob = shard.read_bytes()
    spec = ShardSpec.from_metadata(json.loads((path / "zarr.json").read_text()))
    offsets, nbytes, _ = spec.index_entries(blob[-spec.index_nbytes :])
    offsets, nbytes = offsets.copy(), nbytes.copy()
    nbytes[0] = 10**6  # more than zstd makes of one tile
    offsets[1] = 2**64 - 8  # outside (wraps in uint64 arithmetic)
    body = spec.encode_index(offsets, nbytes)[:-4]
    shard.write_bytes(blob[: -spec.index_nbytes] + body + b"\0\0\0\0")  # and a CRC that does not match
    return path


@pytest.mark.parametrize("block", [None, 2])
def test_verify_reports_every_index_problem(tmp_path, monkeypatch, block):
    import sys

    verify_module = sys.modules["napari_tileshard.apps.verify"]  # the package's ``verify`` is the function
    if block:  # the streamed index of huge shards, checked block by block
        monkeypatch.setattr(verify_module, "_INDEX_BLOCK_ENTRIES", block)
    report = verify(_damaged_store(tmp_path / "d.zarr"))
    assert [(p.key, p.chunk) for p in report.problems] == [("c/0/0/0", None), ("c/0/0/0", 0), ("c/0/0/0", 1)]
    assert report.problems[0].message == "index CRC32C mismatch"
    assert report.problems[1].message.startswith("holds 1000000 bytes, more than zstd makes of one tile of 64 bytes")
    assert report.problems[2].message.startswith(f"(offset {2**64 - 8}, ")
    assert "lies outside the shard data" in report.problems[2].message
    assert report.chunks == 4 and report.shards == 1
    with pytest.raises(ShardIndexError, match="c/0/0/0: index CRC32C mismatch"):
        ShardReader(tmp_path / "d.zarr", backend="cpu")[...]
