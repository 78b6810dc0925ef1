"""Every registered codec object: decode_into what it and zarr-python encode, bounded decoding that
refuses anything but exactly one chunk (without allocating from sizes in the data), to_dict /
from_dict, zarr-python's own codec dicts resolved to our codecs and back, writable vs read-only,
and the GPU description.  tests/format/test_codecs.py has the writer's end-to-end side."""

import dataclasses
import tracemalloc
import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ZstdCodec

from napari_tileshard.format import CODECS, codecs, libzstd
from napari_tileshard.format.codecs import (
    REGISTRY,
    Blosc,
    BloscLz4,
    Codec,
    CodecError,
    Gzip,
    Raw,
    Zstd,
    from_zarr_codecs,
    get,
    gpu_decode_support,
    gpu_support,
    names,
)

#: per registered codec: a configured instance and zarr-python's codec that writes the same chain
ZARR = {
    "zstd": (Zstd(level=3, typesize=2), [ZstdCodec(level=3, checksum=False)]),
    "none": (Raw(typesize=2), []),
    "blosc-lz4": (BloscLz4(level=5, typesize=2), [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=2)]),
    "blosc": (
        Blosc(cname="zstd", level=2, shuffle="bitshuffle", typesize=2),
        [BloscCodec(cname="zstd", clevel=2, shuffle="bitshuffle", typesize=2)],
    ),
    "gzip": (Gzip(level=6, typesize=2), [GzipCodec(level=6)]),
}
ALL = list(REGISTRY)


def test_every_registered_codec_is_covered():
    assert set(ZARR) == set(REGISTRY)


def _tiles():
    rng = np.random.default_rng(1)
    return [
        (np.cumsum(rng.integers(0, 3, 2048), dtype=np.uint16) % 300).astype(np.uint16).view(np.uint8),
        rng.integers(0, 256, 5000, dtype=np.uint8),  # incompressible
        np.zeros(4096, np.uint8),
        np.arange(2, dtype=np.uint8),
    ]


def _zarr_encode(name, tile: np.ndarray) -> bytes:
    """The chunk numcodecs (zarr-python's codecs' engine) makes of ``tile``, as zarr-python configures it."""
    import numcodecs

    codec, chain = ZARR[name]
    if not chain:
        return tile.tobytes()
    config = chain[0].to_dict()["configuration"]
    if name == "zstd":
        return bytes(numcodecs.Zstd(level=config["level"], checksum=config["checksum"]).encode(tile))
    if name == "gzip":
        return bytes(numcodecs.GZip(level=config["level"]).encode(tile))
    shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[config["shuffle"]]
    return bytes(numcodecs.Blosc(cname=config["cname"], clevel=config["clevel"], shuffle=shuffle).encode(tile))


@pytest.mark.parametrize("name", ALL)
def test_decode_into_what_we_and_zarr_python_encode(name):
    codec = ZARR[name][0]
    for tile in _tiles():
        chunks = [_zarr_encode(name, tile), bytes(codec.encode(tile))]
        for chunk in chunks:
            assert codec.min_encoded_bytes(tile.nbytes) <= len(chunk) <= codec.max_encoded_bytes(tile.nbytes)
            dest = np.full(tile.nbytes, 0xAB, np.uint8)
            codec.decode_into(chunk, dest)
            np.testing.assert_array_equal(dest, tile)
            codec.decode_into(memoryview(chunk), dest)  # any bytes-like: a view into a read buffer
            assert codec.decode(chunk, tile.nbytes) == tile.tobytes()


@pytest.mark.parametrize("name", ALL)
def test_decoding_is_bounded_to_exactly_one_chunk(name):
    codec = ZARR[name][0]
    tile = _tiles()[0]
    chunk = bytes(codec.encode(tile))
    for wrong in (tile.nbytes - 1, tile.nbytes + 1, 0):  # a destination that is not the chunk's size
        with pytest.raises(CodecError):
            codec.decode_into(chunk, np.empty(wrong, np.uint8))
    with pytest.raises(CodecError):
        codec.decode_into(chunk[: len(chunk) // 2], np.empty(tile.nbytes, np.uint8))  # cut short
    if codec.checks_content:
        with pytest.raises(CodecError):
            codec.decode_into(chunk + b"\0" * 8, np.empty(tile.nbytes, np.uint8))  # bytes after the chunk
        with pytest.raises(CodecError):
            codec.decode_into(b"\x01" * 40, np.empty(tile.nbytes, np.uint8))  # garbage


def test_zstd_refuses_what_it_would_have_to_allocate():
    dest = np.empty(4096, np.uint8)
    declared = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # declares 64 MiB
    unknown = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="zstd frame declares 67108864 bytes, expected 4096"):
            Zstd().decode_into(declared, dest)
        with pytest.raises(CodecError, match="zstd"):
            Zstd().decode_into(unknown, dest)  # decodes at most 4096 bytes, then refuses
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    two = zstandard.ZstdCompressor().compress(bytes(4096)) + zstandard.ZstdCompressor().compress(b"x")
    with pytest.raises(CodecError, match="bytes follow the first frame"):
        Zstd().decode_into(two, dest)


def test_gzip_and_blosc_bombs_are_refused_early():
    dest = np.empty(4096, np.uint8)
    bomb = zlib.compress(bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="does not decode to exactly 4096 bytes"):
            Gzip().decode_into(bomb, dest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    blosc = bytearray(BloscLz4(typesize=2).encode(np.zeros(4096, np.uint8)))
    blosc[4:8] = (1 << 30).to_bytes(4, "little")
    with pytest.raises(CodecError, match="blosc header declares 1073741824 bytes, expected 4096"):
        BloscLz4().decode_into(bytes(blosc), dest)
    with pytest.raises(CodecError, match="shorter than a blosc header"):
        Blosc().decode_into(b"\x02\x01", dest)


@pytest.mark.parametrize("name", ALL)
def test_to_dict_and_from_dict(name):
    codec = ZARR[name][0]
    data = codec.to_dict()
    assert data["name"] == name and Codec.from_dict(data) == codec
    assert Codec.from_dict({"name": name}) == REGISTRY[name]
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.level = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "data, error, message",
    [
        ({"name": "lz4"}, ValueError, "does not name a codec"),
        ("zstd", ValueError, "does not name a codec"),
        ({"name": "zstd", "configuration": {"speed": 1}}, ValueError, "has no field 'speed'"),
        ({"name": "zstd", "configuration": {"level": "1"}}, TypeError, "zstd level must be int"),
        ({"name": "zstd", "configuration": {"checksum": 1}}, TypeError, "zstd checksum must be bool"),
        ({"name": "blosc", "configuration": {"shuffle": "sideways"}}, ValueError, "blosc shuffle must be one of"),
        ({"name": "blosc-lz4", "configuration": {"cname": "zstd"}}, ValueError, "blosc-lz4 is cname 'lz4'"),
    ],
)
def test_from_dict_refuses_what_is_not_a_codec(data, error, message):
    with pytest.raises(error, match=message):
        Codec.from_dict(data)


ZARR_CHAINS = [
    # (zarr-python's compressors, dtype, our codec)
    ([ZstdCodec()], "uint16", Zstd(level=0, typesize=2)),
    ([ZstdCodec(level=-3, checksum=True)], "float32", Zstd(level=-3, typesize=4, checksum=True)),
    ([BloscCodec(cname="lz4", clevel=9, shuffle="shuffle")], "uint16", BloscLz4(level=9, typesize=2)),
    ([BloscCodec(cname="lz4", clevel=1, shuffle="shuffle", typesize=4)], "uint16", BloscLz4(level=1, typesize=4)),
    (
        [BloscCodec(cname="lz4hc", clevel=4, shuffle="noshuffle")],
        "uint8",
        Blosc(level=4, typesize=1, cname="lz4hc", shuffle="noshuffle"),
    ),
    (
        [BloscCodec(cname="zlib", shuffle="bitshuffle", blocksize=1024)],
        "int32",
        Blosc(level=5, typesize=4, cname="zlib", shuffle="bitshuffle", blocksize=1024),
    ),
    ([GzipCodec()], "uint16", Gzip(level=5, typesize=2)),
    ([], "uint8", Raw(typesize=1)),
    ([], "float64", Raw(typesize=8)),
]


@pytest.mark.parametrize("compressors, dtype, expected", ZARR_CHAINS)
@pytest.mark.parametrize("endian", ["little", "big"])
def test_zarr_pythons_codec_dicts_resolve_to_ours_and_back(compressors, dtype, expected, endian):
    import zarr

    array = zarr.create_array(
        store={},
        shape=(8,),
        chunks=(4,),
        shards=(8,),
        dtype=dtype,
        compressors=compressors,
        serializer=BytesCodec(endian=endian),
    )
    chain = array.metadata.to_dict()["codecs"][0]["configuration"]["codecs"]  # as zarr-python writes it
    codec = from_zarr_codecs(chain, dtype)
    assert codec == expected
    written_endian = (chain[0].get("configuration") or {}).get("endian")  # none for 1-byte types
    assert codec.zarr_codecs(written_endian) == list(chain)
    assert from_zarr_codecs(list(chain), dtype) == codec


@pytest.mark.parametrize(
    "chain, reason",
    [
        ([{"name": "bytes"}, {"name": "lz4"}], "compressor 'lz4' is not decoded natively"),
        ([{"name": "transpose"}, {"name": "bytes"}], "are not bytes + at most one compressor"),
        ([{"name": "bytes"}, {"name": "zstd"}, {"name": "gzip"}], "are not bytes + at most one compressor"),
        ([{"name": "bytes"}, {"name": "zstd", "configuration": {"level": "high"}}], "configuration"),
        ([{"name": "bytes"}, {"name": "blosc", "configuration": {"shuffle": 7}}], "configuration"),
        ([], "are not bytes"),
        ("bytes", "are not bytes"),
    ],
)
def test_chains_that_are_no_codec_of_ours(chain, reason):
    assert from_zarr_codecs(chain, "uint16") is None
    assert reason in codecs.chain_refusal(chain)


def test_the_writer_offers_the_writable_codecs_only():
    assert names() == tuple(CODECS) == ("zstd", "none", "blosc-lz4")
    assert [c.name for c in REGISTRY.values() if not c.writable] == ["blosc", "gzip"]
    for name in ("gzip", "blosc"):
        with pytest.raises(ValueError, match=f"codec '{name}' is not one of zstd, none, blosc-lz4 \\({name} is read"):
            get(name)
        with pytest.raises(ValueError, match="is not one of"):
            get(REGISTRY[name])  # an instance too
    assert get(Zstd(level=5)) == Zstd(level=5)


def test_gpu_descriptions():
    assert Zstd.gpu is not None and Zstd.gpu.nvcomp == "zstd" and Raw.gpu is not None and Raw.gpu.nvcomp is None
    assert gpu_decode_support(Zstd(), 16 << 20) is None and gpu_decode_support(Raw(), 1 << 30) is None
    assert gpu_decode_support(Zstd(), (16 << 20) + 1) == (
        f"chunks of {(16 << 20) + 1} bytes are larger than nvCOMP's zstd limit ({16 << 20} bytes)"
    )
    for codec in (BloscLz4(), Blosc(), Gzip()):
        assert gpu_decode_support(codec, 100) == (
            f"nvCOMP does not decode {codec.name!r} chunks (the GPU reader decodes zstd, none)"
        )
    assert gpu_support("zstd") is None and "not supported by the GPU backend" in gpu_support("blosc-lz4")


def test_nvcomp_needs_no_gpu_to_import_or_to_say_why():
    from napari_tileshard.gpu import nvcomp

    assert nvcomp.ALGORITHMS == ("zstd",)
    assert nvcomp.decompress_unavailable_reason("lz4") == "nvCOMP's lz4 is not bound in format/nvcomp.py"
    reason = nvcomp.decompress_unavailable_reason()
    assert reason is None or "nvcomp" in reason.lower()


def test_zstd_checksum_frames():
    codec = Zstd(level=1, checksum=True)
    tile = _tiles()[1]
    chunk = bytes(codec.encode(tile))
    assert len(chunk) == len(Zstd(level=1).encode(tile)) + 4 <= codec.max_encoded_bytes(tile.nbytes)
    assert codec.decode(chunk, tile.nbytes) == tile.tobytes()
    assert codec.zarr_codecs()[1] == {"name": "zstd", "configuration": {"level": 1, "checksum": True}}


# -- moved from tests/format/test_codecs.py: the writable codecs on their own -----------------------------------
@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("count", [0, 1, 7])
def test_batch_encode_is_byte_identical_to_one_call_per_tile(name, count):
    # zstd's batch path is one libzstd call for every tile (multi_compress_to_buffer): its chunks
    # must be the frames compress() gives one tile at a time, in order, with matching sizes
    codec = get(name).configure(3 if get(name).level_range else 1, "uint16")
    smooth = (np.arange(count * 3000) % 251).astype(np.uint16).reshape(count, 3000).view(np.uint8)
    tiles = np.concatenate([smooth, np.zeros((count, 2000), np.uint8)], 1)
    noisy = tiles[count // 2 :, ::7]  # the later tiles barely compress
    noisy[...] = np.random.default_rng(5).integers(0, 256, noisy.shape, dtype=np.uint8)
    chunks, sizes = codec.encode_tiles(tiles)
    reference = [bytes(codec.encode(tile)) for tile in tiles]
    assert sizes == [len(chunk) for chunk in reference]
    assert b"".join(memoryview(c).cast("B") for c in chunks) == b"".join(reference)
    assert [codec.decode(chunk, tiles.shape[1]) for chunk in reference] == [tile.tobytes() for tile in tiles]


def test_blosc_bytes_are_zarr_pythons():
    tile = (np.arange(4096) % 300).astype(np.uint16)
    ours = get("blosc-lz4").configure(5, "uint16").encode(tile.view(np.uint8))
    theirs = BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=2, blocksize=0)._blosc_codec.encode(tile)
    assert bytes(ours) == bytes(theirs)


def test_levels_in_range_are_accepted():
    assert get("zstd").validate_level(np.int64(-7)) == -7
    assert get("blosc-lz4").validate_level(9) == 9
    assert get("none").validate_level(99) == 99  # no level: accepted and ignored


def test_gpu_support_refuses_blosc_and_names_the_supported_codecs():
    assert gpu_support("zstd") is None and gpu_support("none") is None
    reason = gpu_support("blosc-lz4")
    assert reason == (
        "codec 'blosc-lz4' is not supported by the GPU backend: nvCOMP cannot produce a Blosc "
        "bitstream (the GPU backend supports zstd, none); use backend='cpu' or 'auto'"
    )
    assert gpu_support(get("blosc-lz4").configure(3, "uint16")) == reason


def _hostile_zstd_chunks(tile: np.ndarray) -> dict[str, bytes]:
    """zstd chunks of ``tile``'s size that decode_into refuses (or accepts) for a reason."""
    half = tile.nbytes // 2
    compress = zstandard.ZstdCompressor().compress
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress
    whole = compress(tile.tobytes())
    return {
        "two half frames": compress(tile[:half].tobytes()) + compress(tile[half:].tobytes()),
        "two unsized half frames": unsized(tile[:half].tobytes()) + unsized(tile[half:].tobytes()),
        "bytes after the frame": whole + b"\0" * 8,
        "cut short": whole[: len(whole) // 2],
        "garbage": b"\x01" * 40,
        "a frame of another size": compress(tile[:-2].tobytes()),
        "an empty frame after it": whole + compress(b""),
        "a checksum": zstandard.ZstdCompressor(write_checksum=True).compress(tile.tobytes()),
        "one repeated byte (an RLE block)": compress(bytes(tile.nbytes)),
    }


#: the two frame walks _frame_sizes chooses between (by the number of chunks)
WALKS = {"by chunk": codecs._frame_sizes_by_chunk, "at once": codecs._frame_sizes_at_once}


def _frame_bytes(chunk, walk) -> int:
    """The frame walk over one chunk."""
    data = np.frombuffer(chunk, dtype=np.uint8)
    return int(walk(data, np.zeros(1, np.int64), np.full(1, data.size, np.int64))[0])


@pytest.mark.parametrize("walk", WALKS.values(), ids=WALKS.keys())
def test_the_zstd_frame_walk_finds_where_each_frame_ends(walk):
    """The batch decode accepts a chunk only when its first frame spans all of it: the walk over
    block headers gives libzstd's compressed frame size for raw, RLE and compressed blocks, many
    blocks, a checksum, and no end where the blocks run past the chunk."""
    rng = np.random.default_rng(4)
    payloads = [
        _tiles()[0].tobytes(),
        rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes(),  # raw blocks, 3 of them
        bytes(300_000),  # RLE blocks
        (np.cumsum(rng.integers(0, 3, 400_000)) % 300).astype(np.uint16).tobytes(),  # compressed, many blocks
        b"",
    ]
    for payload in payloads:
        for compressor in (zstandard.ZstdCompressor(), zstandard.ZstdCompressor(write_checksum=True, level=9)):
            frame = compressor.compress(payload)
            assert _frame_bytes(frame, walk) == len(frame)
            assert _frame_bytes(frame + b"\0" * 5, walk) == len(frame)
            assert _frame_bytes(frame[:-1], walk) == -1


@pytest.mark.parametrize("name", ALL)
def test_decode_chunks_released_equals_decode_chunks(name):
    """The batch decoded in one native call (the read-ahead's) gives the bytes and the refusals
    of decoding chunk by chunk: rows left as they are where a chunk is absent, the position of
    a chunk refused.  For zstd also on chunks built to tell them apart."""
    codec = ZARR[name][0]
    tile = _tiles()[0]
    rng = np.random.default_rng(3)
    tiles = [(tile.view(np.uint16) + k).astype(np.uint16).view(np.uint8) for k in range(5)]
    chunks = [bytes(codec.encode(t)) for t in tiles]
    chunks[1] = b""  # absent
    offsets = np.cumsum([0] + [len(c) for c in chunks[:-1]]).tolist()
    sizes = [len(c) if c else -1 for c in chunks]
    src = memoryview(b"".join(chunks))
    per_chunk, released = (np.full((5, tile.nbytes), 0xAB, np.uint8) for _ in range(2))
    codec.decode_chunks(src, offsets, sizes, per_chunk)
    codec.decode_chunks_released(src, offsets, sizes, released)
    np.testing.assert_array_equal(released, per_chunk)
    np.testing.assert_array_equal(released[[0, 2, 3, 4]], np.stack([tiles[k] for k in (0, 2, 3, 4)]))
    assert (released[1] == 0xAB).all()
    if name != "zstd":
        return
    for why, hostile in _hostile_zstd_chunks(tile).items():
        batch = [chunks[0], hostile, chunks[2]]
        src = memoryview(b"".join(batch))
        offsets, sizes = [0, len(batch[0]), len(batch[0]) + len(hostile)], [len(c) for c in batch]
        outcomes = []
        for decode in (codec.decode_chunks, codec.decode_chunks_released):
            dest = np.zeros((3, tile.nbytes), np.uint8)
            try:
                decode(src, offsets, sizes, dest)
                outcomes.append(("decoded", dest.tobytes()))
            except CodecError as exc:
                outcomes.append(("refused", exc.chunk))
        assert outcomes[0] == outcomes[1], why
    assert rng is not None


@pytest.mark.parametrize("walk", WALKS.values(), ids=WALKS.keys())
def test_the_frame_walk_of_a_whole_batch_matches_each_frame(walk):
    """Frames of 1 to many blocks, with and without checksums, frames followed by other bytes,
    truncated ones and bytes that are no zstd frame, side by side in one buffer: the walk over all
    of them at once gives each its own frame's size (libzstd's), or -1."""
    rng = np.random.default_rng(9)
    payloads = [
        _tiles()[0].tobytes(),
        rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes(),
        bytes(300_000),
        (np.cumsum(rng.integers(0, 3, 400_000)) % 300).astype(np.uint16).tobytes(),
        b"",
    ]
    pieces, expected = [], []
    for payload in payloads:
        for compressor in (zstandard.ZstdCompressor(), zstandard.ZstdCompressor(write_checksum=True, level=9)):
            frame = compressor.compress(payload)
            pieces += [frame, frame + b"\1\2\3", frame[:-1]]
            expected += [len(frame), len(frame), -1]
    pieces += [b"\0" * 16, b"\x28\xb5\x2f\xfd", b""]
    expected += [-1, -1, -1]
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]]).astype(np.int64)
    ends = starts + np.array([len(p) for p in pieces], dtype=np.int64)
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    assert list(walk(data, starts, ends)) == expected


def _frame_size_by_the_spec(chunk: bytes) -> int:
    """RFC 8878's frame walk, one chunk in plain Python: the reference for ``_frame_sizes``."""
    if len(chunk) < 9 or int.from_bytes(chunk[:4], "little") != 0xFD2FB528:
        return -1
    descriptor = chunk[4]
    if descriptor & 8:  # the reserved bit
        return -1
    single = (descriptor >> 5) & 1
    content = [single, 2, 4, 8][descriptor >> 6]
    position = 5 + (1 - single) + [0, 1, 2, 4][descriptor & 3] + content
    while position + 3 <= len(chunk):
        header = int.from_bytes(chunk[position : position + 3], "little")
        kind = (header >> 1) & 3
        if kind == 3:
            return -1
        position += 3 + (1 if kind == 1 else header >> 3)
        if header & 1:
            end = position + 4 * ((descriptor >> 2) & 1)
            return end if end <= len(chunk) else -1
    return -1


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200_000), min_size=1, max_size=6),
    checksum=st.booleans(),
    damage=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=3),
    cut=st.integers(-3, 3),
)
def test_the_frame_walks_equal_the_spec_on_damaged_frames(sizes, checksum, damage, cut):
    """Frames of raw, RLE and compressed blocks, some bytes overwritten and some frames cut
    short or followed by others: the vectorised walk over all of them equals the spec's walk,
    chunk by chunk (damaged block headers give other sizes, reserved types, or no end)."""
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    compressor = zstandard.ZstdCompressor(write_checksum=checksum)
    chunks = []
    for i, n in enumerate(sizes):
        payload = [rng.integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8), np.arange(n, dtype=np.uint8) // 7]
        frame = bytearray(compressor.compress(payload[i % 3].tobytes()))
        for at, value in damage:
            frame[at % len(frame)] = value
        chunks.append(bytes(frame[: max(0, len(frame) + cut)]) if i % 2 else bytes(frame))
    starts = np.cumsum([0] + [len(c) for c in chunks[:-1]]).astype(np.int64)
    ends = starts + np.array([len(c) for c in chunks], dtype=np.int64)
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)  # the last frame ends where the data does
    expected = [_frame_size_by_the_spec(c) for c in chunks]
    for walk in WALKS.values():
        assert list(walk(data, starts, ends)) == expected, walk.__name__


def test_the_frame_walk_gives_the_same_sizes_on_both_sides_of_its_switch():
    frame = zstandard.ZstdCompressor().compress(_tiles()[0].tobytes())
    for count in (1, codecs._WALK_BY_CHUNK_MAX, codecs._WALK_BY_CHUNK_MAX + 1, 300):
        data = np.frombuffer(frame * count, dtype=np.uint8)
        starts = np.arange(count, dtype=np.int64) * len(frame)
        sizes = codecs._frame_sizes(data, starts, starts + len(frame))
        assert sizes.dtype == np.int64 and sizes.tolist() == [len(frame)] * count
        assert sizes.tolist() == list(codecs._frame_sizes_by_chunk(data, starts, starts + len(frame)))


@pytest.mark.parametrize(
    "spread, count, several_buffers, tail",
    [
        (4000, 16, False, 0),  # ~1.3:1
        (16, 16, False, 0),  # ~4:1: one buffer, the segments given to the batch lengthened
        (16, 2, False, 0),
        (16, 16, False, 1 << 20),  # bytes after the chunks (a shard's index, other chunks): the first lengthened alone
        (1, 16, True, 0),  # constant tiles, ~1000:1: too few bytes to lengthen the segments
    ],
)
def test_zstd_batch_into_its_own_memory_or_scratch(spread, count, several_buffers, tail, monkeypatch):
    """python-zstandard's batch call (libzstd's own decoder switched off) hands back the chunks
    over its own memory where it decoded them into one buffer (for chunks compressed more than
    2:1 too, python-zstandard sizing that buffer by the segments it is given, lengthened), and
    copies them into the scratch given where it used several; the bytes equal decoding chunk by
    chunk either way, and the returned array keeps its memory alive after the call."""
    import gc

    monkeypatch.setenv(libzstd.DECODER_SETTING, "zstandard")
    codec = ZARR["zstd"][0]
    rng = np.random.default_rng(5)
    tiles = [rng.integers(0, spread, 32768).astype(np.uint16).view(np.uint8) for _ in range(count)]
    chunks = [bytes(codec.encode(t)) for t in tiles]
    offsets = np.cumsum([0] + [len(c) for c in chunks[:-1]])
    sizes = np.array([len(c) for c in chunks])
    src = memoryview(b"".join(chunks) + b"\x5a" * tail)
    scratch = np.full((count, tiles[0].nbytes), 0xAB, np.uint8)
    got = codec.decoded_chunks_released(src, offsets, sizes, tiles[0].nbytes, scratch)
    assert got is not None
    gc.collect()
    np.testing.assert_array_equal(got, np.stack(tiles))
    assert sizes.sum() * 2 < scratch.nbytes or spread == 4000  # the cases past 2:1 are past it
    assert np.shares_memory(got, scratch) == several_buffers
    dest = np.zeros_like(scratch)
    codec.decode_chunks_released(src, offsets.tolist(), sizes.tolist(), dest)
    np.testing.assert_array_equal(dest, np.stack(tiles))


def test_batch_segments_are_lengthened_within_the_source_until_one_buffer_holds_every_chunk():
    """python-zstandard sizes its first output buffer by the segments' total, rounded up to a
    power of two: lengthened, that total rounds up to the decoded bytes; no segment runs past
    the source; the first alone where it can, else the first ones first."""
    starts, lengths = np.array([0, 10, 20]), np.array([10, 10, 10])
    for size, expected in ((1000, [45, 10, 10]), (40, [40, 15, 10]), (32, [32, 22, 11]), (30, [10, 10, 10])):
        got = codecs._one_buffer_lengths(starts, lengths, size, 100)  # a total over 64 rounds up to 128 >= 100
        assert got.tolist() == expected, size
        assert (starts + got <= max(size, 30)).all()
    assert codecs._one_buffer_lengths(starts, lengths, 1000, 40).tolist() == [13, 10, 10]  # over 32: 64 >= 40
    assert codecs._one_buffer_lengths(starts, lengths, 1000, 32) is lengths  # 30 rounds up to 32 already
