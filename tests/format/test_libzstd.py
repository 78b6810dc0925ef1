"""libzstd's own frame decoder (format/libzstd.py) as Zstd's batch decode: the same bytes as
python-zstandard chunk by chunk, one call per run of chunks back to back, and every chunk it
refuses decoded chunk by chunk, which names it; the setting that switches it off."""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
import time
import types

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from napari_tileshard.format import codecs, libzstd
from napari_tileshard.format.codecs import CodecError, Zstd

needs_libzstd = pytest.mark.skipif(
    libzstd._loaded() is None, reason="no libzstd with an exported C API here (numcodecs' or the system's)"
)


@pytest.fixture(autouse=True)
def _libzstd_on(monkeypatch):
    """These tests are of the default decoder, whatever the environment running them says."""
    monkeypatch.setenv(libzstd.DECODER_SETTING, "auto")


def _chunks(count: int, chunk_bytes: int, seed: int, level: int = 1):
    rng = np.random.default_rng(seed)
    tiles = np.cumsum(rng.integers(0, 4, (count, chunk_bytes // 2)), axis=1).astype(np.uint16).view(np.uint8)
    compressor = zstandard.ZstdCompressor(level=level)
    return tiles, [compressor.compress(t.tobytes()) for t in tiles]


def _layout(chunks: list[bytes], gaps: list[int]) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The chunks in one buffer, ``gaps[i]`` bytes of other data before chunk ``i``."""
    parts, offsets, at = [], [], 0
    for chunk, gap in zip(chunks, gaps):
        parts.append(b"\xa5" * gap)
        at += gap
        offsets.append(at)
        parts.append(chunk)
        at += len(chunk)
    return b"".join(parts), np.array(offsets, dtype=np.int64), np.array([len(c) for c in chunks], dtype=np.int64)


def test_the_setting_picks_the_decoder_and_names_a_bad_value(monkeypatch):
    monkeypatch.setenv(libzstd.DECODER_SETTING, "zstandard")
    assert libzstd.frame_decoder() is None
    monkeypatch.setenv(libzstd.DECODER_SETTING, "fast")
    with pytest.raises(ValueError, match="TILESHARD_ZSTD_DECODER.*'fast'"):
        libzstd.frame_decoder()
    monkeypatch.setenv(libzstd.DECODER_SETTING, "auto")
    assert libzstd.frame_decoder() is libzstd._loaded()


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="numcodecs' Linux x86-64 wheels export libzstd's API; elsewhere python-zstandard decodes",
)
def test_linux_finds_a_libzstd_with_the_multi_frame_call():
    decoder = libzstd._loaded()
    assert decoder is not None and decoder.version >= 10400
    assert decoder.origin in ("numcodecs", "system")


@needs_libzstd
@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 48),  # both sides of codecs._HEADERS_IN_PYTHON_MAX
    chunk_kib=st.sampled_from([1, 4, 64, 200]),
    gaps=st.lists(st.sampled_from([0, 0, 0, 1, 7]), min_size=48, max_size=48),
    absent=st.lists(st.booleans(), min_size=48, max_size=48),
    level=st.sampled_from([-1, 1, 3]),
)
def test_libzstd_decodes_what_python_zstandard_decodes(count, chunk_kib, gaps, absent, level):
    """Chunks back to back or apart in the source, some rows absent: every present row as
    python-zstandard decodes it, absent rows untouched, in one libzstd call per run."""
    tiles, chunks = _chunks(count, chunk_kib << 10, seed=count * 7 + chunk_kib, level=level)
    src, offsets, nbytes = _layout(chunks, gaps[:count])
    sizes = np.where(absent[:count], -1, nbytes)
    codec = Zstd(level=level)
    for decode in (codec.decode_chunks, codec.decode_chunks_released):
        dest = np.full(tiles.shape, 0x3C, np.uint8)
        decode(memoryview(src), offsets.tolist(), sizes.tolist(), dest, absent=-1)
        for i in range(count):
            expected = np.full(tiles.shape[1], 0x3C, np.uint8) if absent[i] else tiles[i]
            np.testing.assert_array_equal(dest[i], expected)
    whole = codec.decoded_chunks_released(memoryview(src), offsets, nbytes, tiles.shape[1])
    np.testing.assert_array_equal(whole, tiles)


@needs_libzstd
def test_one_libzstd_call_per_run_of_chunks_back_to_back():
    tiles, chunks = _chunks(6, 8192, seed=3)
    src, offsets, nbytes = _layout(chunks, [0, 0, 5, 0, 0, 0])  # two runs: chunks 0-1 and 2-5
    calls = []
    decoder = libzstd._loaded()

    class Counting:
        def decode_frames(self, *args):
            calls.append(args)
            return decoder.decode_frames(*args)

    dest = np.zeros_like(tiles)
    assert Zstd._frames_into(Counting(), memoryview(src), offsets, nbytes, dest)
    np.testing.assert_array_equal(dest, tiles)
    assert len(calls) == 2


@needs_libzstd
@pytest.mark.parametrize("count", [3, codecs._HEADERS_IN_PYTHON_MAX + 2])  # headers read in Python, and in NumPy
@pytest.mark.parametrize("damage", ["not_zstd", "shorter", "other_size", "no_size", "trailing"])
def test_what_libzstd_refuses_is_decoded_chunk_by_chunk_and_named(damage, count):
    """A damaged chunk fails the batch and is named by the chunk-by-chunk decode; a frame that
    declares no size is decoded right, chunk by chunk (libzstd could not place the rows after
    it); bytes after a chunk's frame are refused as they are without libzstd."""
    tiles, chunks = _chunks(count, 65536, seed=9)
    chunks = list(chunks)
    if damage == "not_zstd":
        chunks[2] = np.random.default_rng(1).integers(0, 256, len(chunks[2]), dtype=np.uint8).tobytes()
    elif damage == "shorter":
        chunks[2] = chunks[2][:-10]
    elif damage == "other_size":
        chunks[2] = zstandard.ZstdCompressor(level=1).compress(tiles[2].tobytes()[:-2])
    elif damage == "no_size":
        stream = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
        chunks[2] = stream.compress(tiles[2].tobytes()) + stream.flush()
    else:
        chunks[2] = chunks[2] + b"\x00\x01"
    src, offsets, nbytes = _layout(chunks, [0] * count)
    codec = Zstd(level=1)
    for decode in (codec.decode_chunks, codec.decode_chunks_released):
        dest = np.zeros_like(tiles)
        if damage == "no_size":
            decode(memoryview(src), offsets.tolist(), nbytes.tolist(), dest)
            np.testing.assert_array_equal(dest, tiles)
            continue
        with pytest.raises(CodecError) as raised:
            decode(memoryview(src), offsets.tolist(), nbytes.tolist(), dest)
        assert raised.value.chunk == 2
    got = codec.decoded_chunks_released(memoryview(src), offsets, nbytes, tiles.shape[1])
    if damage == "no_size":
        np.testing.assert_array_equal(got, tiles)


@needs_libzstd
def test_content_sizes_read_every_header_layout():
    """The declared size as python-zstandard reads it, for 1-, 2-, 4- and 8-byte fields, frames
    that declare none, and several header layouts in one batch."""
    rng = np.random.default_rng(2)
    frames = []
    for n in (0, 1, 255, 256, 300, 65535, 65791, 65792, 70000, 1 << 20):
        frames.append(zstandard.ZstdCompressor(level=1).compress(rng.integers(0, 255, n, dtype=np.uint8).tobytes()))
    stream = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    frames.append(stream.compress(b"abc" * 1000) + stream.flush())
    data = np.frombuffer(b"".join(frames), dtype=np.uint8)
    starts = np.concatenate(([0], np.cumsum([len(f) for f in frames])[:-1])).astype(np.int64)
    expected = [zstandard.frame_content_size(f) for f in frames]
    expected = [-1 if size == zstandard.CONTENTSIZE_UNKNOWN else size for size in expected]
    assert len(set(data[starts + 4].tolist())) >= 4  # several layouts
    assert codecs._content_sizes(data, starts).tolist() == expected
    assert codecs._content_sizes(data, starts[4:5]).tolist() == expected[4:5]  # one layout


@needs_libzstd
def test_libzstd_decodes_without_the_gil():
    """Beside a thread busy in Python, the batch decodes many times faster than python-zstandard
    chunk by chunk, which takes the GIL back after every chunk (each time waiting up to the
    interpreter's switch interval): the libzstd call holds no GIL."""
    tiles, chunks = _chunks(64, 65536, seed=4)
    src, offsets, nbytes = _layout(chunks, [0] * 64)
    codec, dest = Zstd(level=1), np.empty_like(tiles)

    def batches_in(seconds: float, decode) -> int:
        done, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            decode(memoryview(src), offsets.tolist(), nbytes.tolist(), dest, -1)
            done += 1
        return done

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        batched = batches_in(0.5, codec.decode_chunks)
        np.testing.assert_array_equal(dest, tiles)
        chunk_by_chunk = batches_in(0.5, codec._decode_each)
    finally:
        stop.set()
        spinner.join()
    assert batched >= 3 * max(1, chunk_by_chunk), (batched, chunk_by_chunk)


@needs_libzstd
@pytest.mark.parametrize("extra", ["skippable", "empty"])
def test_frames_of_no_content_after_a_chunks_frame_add_nothing(extra):
    """Bytes after a chunk's frame that are themselves frames of no content (a skippable frame,
    an empty zstd frame) add no bytes: libzstd's batch decodes every row right, as zarr-python's
    decode (numcodecs) takes such a chunk too; it reads no block headers, only frame headers."""
    from numcodecs import Zstd as NumcodecsZstd

    tiles, chunks = _chunks(6, 65536, seed=11)
    tail = (
        (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
        if extra == "skippable"
        else zstandard.ZstdCompressor(level=1).compress(b"")
    )
    chunks = list(chunks)
    chunks[2] = chunks[2] + tail
    np.testing.assert_array_equal(np.frombuffer(NumcodecsZstd().decode(chunks[2]), np.uint8), tiles[2])
    src, offsets, nbytes = _layout(chunks, [0] * 6)
    dest = np.zeros_like(tiles)
    assert Zstd._frames_into(libzstd._loaded(), memoryview(src), offsets, nbytes, dest)
    np.testing.assert_array_equal(dest, tiles)


@needs_libzstd
def test_with_the_block_walk_switched_on_the_rows_are_the_same(monkeypatch):
    """The A/B switch that puts the block walk back (as python-zstandard's batch checks): rows
    decode as without it; a chunk holding an empty frame after its own is refused by that batch
    and decoded chunk by chunk, which takes it (as zarr-python does): the same rows either way."""
    tiles, chunks = _chunks(6, 65536, seed=12)
    chunks = list(chunks)
    chunks[4] = chunks[4] + zstandard.ZstdCompressor(level=1).compress(b"")
    src, offsets, nbytes = _layout(chunks, [0] * 6)
    decoder = libzstd._loaded()
    for walk in (False, True):
        monkeypatch.setattr(codecs, "LIBZSTD_WALKS_BLOCKS", walk)
        dest = np.zeros_like(tiles)
        assert Zstd._frames_into(decoder, memoryview(src), offsets, nbytes, dest) is not walk
        dest = np.zeros_like(tiles)
        Zstd(level=1).decode_chunks(memoryview(src), offsets.tolist(), nbytes.tolist(), dest)
        np.testing.assert_array_equal(dest, tiles)


@needs_libzstd
@settings(max_examples=30, deadline=None)
@given(
    count=st.integers(1, 5),
    chunk_kib=st.sampled_from([256, 300, 1024]),
    need_fraction=st.floats(0.0, 1.0),
    gaps=st.lists(st.sampled_from([0, 0, 3]), min_size=5, max_size=5),
    level=st.sampled_from([-1, 1, 3]),
)
def test_prefixes_are_the_first_bytes_of_the_whole_decode(count, chunk_kib, need_fraction, gaps, level):
    """Chunks decoded as far as their first ``need`` bytes: those bytes as the whole decode
    gives them, and None where no block of full size could be left undecoded."""
    tiles, chunks = _chunks(count, chunk_kib << 10, seed=count + chunk_kib + level, level=level)
    src, offsets, nbytes = _layout(chunks, gaps[:count])
    chunk_bytes = tiles.shape[1]
    need = max(1, int(need_fraction * chunk_bytes))
    result = Zstd(level=level).decoded_prefixes(memoryview(src), offsets, nbytes, chunk_bytes, need)
    block = codecs._BLOCK_CONTENT_MAX
    if chunk_bytes - -(-need // block) * block < 1:  # byte ``need`` in the last block of full ones
        assert result is None
        return
    assert result is not None
    rows, decoded = result
    assert count * need <= decoded <= count * chunk_bytes
    np.testing.assert_array_equal(rows[:, :need], tiles[:, :need])


@needs_libzstd
@pytest.mark.parametrize("damage", ["cut_short", "other_size", "not_zstd", "checksum_frames", "checksum_codec"])
def test_prefixes_refused_are_left_to_the_whole_decode(damage):
    """A chunk cut inside its needed blocks, of another declared size or no zstd frame: None
    (the caller decodes whole, which names it); frames with a content checksum are not decoded
    in part (a part goes unchecked); the next call on the thread decodes right."""
    tiles, chunks = _chunks(3, 512 << 10, seed=5)
    codec = Zstd()
    if damage == "cut_short":
        chunks[1] = chunks[1][:200]
    elif damage == "other_size":
        chunks[1] = zstandard.ZstdCompressor(level=1).compress(tiles[1, : 256 << 10].tobytes())
    elif damage == "not_zstd":
        chunks[1] = b"\x00" * len(chunks[1])
    elif damage == "checksum_frames":
        chunks = [zstandard.ZstdCompressor(level=1, write_checksum=True).compress(t.tobytes()) for t in tiles]
    else:
        codec = Zstd(checksum=True)
    src, offsets, nbytes = _layout(chunks, [0, 0, 0])
    assert codec.decoded_prefixes(memoryview(src), offsets, nbytes, tiles.shape[1], 100 << 10) is None
    _, good = _chunks(3, 512 << 10, seed=5)
    src, offsets, nbytes = _layout(good, [0, 0, 0])
    rows, _ = Zstd().decoded_prefixes(memoryview(src), offsets, nbytes, tiles.shape[1], 100 << 10)
    np.testing.assert_array_equal(rows[:, : 100 << 10], tiles[:, : 100 << 10])


@needs_libzstd
def test_a_prefix_decode_stops_at_the_block_holding_the_last_byte_needed():
    """libzstd is given one block more only where the blocks before held too little, and stops
    there: the bytes decoded are whole blocks, the fewest that hold ``need``."""
    tiles, chunks = _chunks(1, 1 << 20, seed=9)
    decoder = libzstd._loaded()
    assert decoder.decodes_prefixes
    data = np.frombuffer(chunks[0], dtype=np.uint8)
    ends = list(codecs._block_ends(data.data, 0, data.size, 0))
    assert len(ends) >= 8  # a 1 MiB frame: blocks of at most 128 KiB
    out = np.zeros(tiles.shape[1], np.uint8)
    decoded = [decoder.decode_prefix(data.ctypes.data, ends[:k], out.ctypes.data, out.size, 1) for k in (1, 2)]
    assert decoded[0] == decoded[1] > 0  # the first block was enough: the second never given
    assert decoder.decode_prefix(data.ctypes.data, ends[:1], out.ctypes.data, out.size, out.size) == -1
    assert decoder.decode_prefix(data.ctypes.data, ends, out.ctypes.data, out.size, out.size) == out.size
    np.testing.assert_array_equal(out, tiles[0])


def _heads(codec, src, offsets, nbytes, chunk_bytes, scratch=None):
    """Codec.heads_patch, then Codec.decoded_heads of all the chunks (None where either refused)."""
    patch = codec.heads_patch(src, offsets, nbytes, chunk_bytes)
    return None if patch is None else codec.decoded_heads(src, patch, 0, len(offsets), scratch)


def _first_block_content(chunk: bytes) -> int:
    """The bytes the first block of ``chunk``'s frame decodes to (libzstd's streaming decode,
    given the frame up to that block's end)."""
    data = np.frombuffer(chunk, dtype=np.uint8)
    first_end = next(codecs._block_ends(data.data, 0, data.size, 0))
    out = np.zeros(zstandard.frame_content_size(chunk), np.uint8)
    return libzstd._loaded().decode_prefix(data.ctypes.data, [first_end], out.ctypes.data, out.size, 1)


@needs_libzstd
@settings(max_examples=30, deadline=None)
@given(
    count=st.integers(1, 5),
    chunk_kib=st.sampled_from([192, 256, 300, 1024]),
    gaps=st.lists(st.sampled_from([0, 0, 3]), min_size=5, max_size=5),
    level=st.sampled_from([-1, 1, 3]),
)
def test_heads_are_the_first_block_of_the_whole_decode_in_one_call(count, chunk_kib, gaps, level):
    """Chunks of several blocks decoded as far as their first block, all in one call: each row's
    first 128 KiB as the whole decode gives them, wherever each first block holds that much
    (libzstd's frames, mostly) and the chunks lie back to back in a writable source, else None;
    the source is as it was after the call, either way."""
    tiles, chunks = _chunks(count, chunk_kib << 10, seed=count + chunk_kib + level, level=level)
    src, offsets, nbytes = _layout(chunks, gaps[:count])
    source = bytearray(src)
    chunk_bytes = tiles.shape[1]
    head = Zstd(level=level).head_bytes(chunk_bytes)
    assert head == codecs._BLOCK_CONTENT_MAX
    scratch = np.zeros((count + 1, chunk_bytes), np.uint8)
    rows = _heads(Zstd(level=level), memoryview(source), offsets, nbytes, chunk_bytes, scratch)
    assert source == src
    assert _heads(Zstd(level=level), memoryview(src), offsets, nbytes, chunk_bytes) is None  # read-only
    if any(_first_block_content(chunk) != head for chunk in chunks) or any(gaps[1:count]):
        assert rows is None
        return
    assert rows is not None and rows.shape == (count, chunk_bytes) and not rows.flags.writeable
    assert np.shares_memory(rows, scratch)  # decoded into the caller's buffer, no copy
    np.testing.assert_array_equal(rows[:, :head], tiles[:, :head])


@needs_libzstd
def test_libzstds_level_1_frames_of_camera_tiles_are_decoded_by_their_heads():
    """The writer's own frames (level 1, 2 frames of 256 x 256 uint16 a chunk): the call applies."""
    tiles, chunks = _chunks(4, 256 << 10, seed=3)
    src, offsets, nbytes = _layout(chunks, [0, 0, 0, 0])
    rows = _heads(Zstd(), memoryview(bytearray(src)), offsets, nbytes, tiles.shape[1])
    assert rows is not None
    np.testing.assert_array_equal(rows[:, : 128 << 10], tiles[:, : 128 << 10])


@needs_libzstd
def test_heads_of_a_units_chunks_decode_from_one_patch_only_where_they_follow_each_other():
    """One patch for a block's chunks, each unit's range decoded with it: the rows of chunks
    ``first..stop`` as the whole decode gives their heads; chunks stored in another order than
    the unit's (each frame would land in another row) refused; the source as it was."""
    tiles, chunks = _chunks(4, 256 << 10, seed=8)
    src, offsets, nbytes = _layout(chunks, [0, 0, 0, 0])
    source = bytearray(src)
    codec, head = Zstd(), 128 << 10
    patch = codec.heads_patch(memoryview(source), offsets, nbytes, tiles.shape[1])
    assert patch is not None
    for first, stop in [(0, 4), (1, 3), (3, 4)]:
        rows = codec.decoded_heads(memoryview(source), patch, first, stop)
        np.testing.assert_array_equal(rows[:, :head], tiles[first:stop, :head])
    backwards = codec.heads_patch(memoryview(source), offsets[::-1].copy(), nbytes[::-1].copy(), tiles.shape[1])
    assert backwards is not None and codec.decoded_heads(memoryview(source), backwards, 0, 4) is None
    assert codec.decoded_heads(memoryview(source), backwards, 2, 3) is not None  # one chunk: no order
    assert source == src


@needs_libzstd
@pytest.mark.parametrize(
    "kind", ["small_blocks", "cut_short", "other_size", "not_zstd", "checksum_frames", "one_block"]
)
def test_heads_refused_are_left_to_the_other_ways(kind):
    """None where the one call cannot give each row its own first block: frames of 64 KiB blocks
    (a 64 KiB window: as nvCOMP's blocks), a chunk cut inside its first block, a frame of another
    size, no zstd frame, frames with a content checksum; a chunk of one block has no head to
    decode (head_bytes 0).  The next call on the thread decodes right."""
    tiles, chunks = _chunks(3, 512 << 10, seed=6)
    chunk_bytes = tiles.shape[1]
    if kind == "small_blocks":
        params = zstandard.ZstdCompressionParameters.from_level(1, window_log=16)
        chunks = [zstandard.ZstdCompressor(compression_params=params).compress(t.tobytes()) for t in tiles]
        assert _first_block_content(chunks[0]) == 64 << 10
    elif kind == "cut_short":
        chunks[1] = chunks[1][:200]
    elif kind == "other_size":
        chunks[1] = zstandard.ZstdCompressor(level=1).compress(tiles[1, : 384 << 10].tobytes())
    elif kind == "not_zstd":
        chunks[1] = b"\x00" * len(chunks[1])
    elif kind == "checksum_frames":
        chunks = [zstandard.ZstdCompressor(level=1, write_checksum=True).compress(t.tobytes()) for t in tiles]
    else:
        assert Zstd().head_bytes(128 << 10) == 0 and Zstd(checksum=True).head_bytes(chunk_bytes) == 0
        assert codecs.get("none").head_bytes(chunk_bytes) == 0
        tiles, chunks = _chunks(3, 128 << 10, seed=6)
        chunk_bytes = tiles.shape[1]
    src, offsets, nbytes = _layout(chunks, [0, 0, 0])
    source = bytearray(src)
    assert _heads(Zstd(), memoryview(source), offsets, nbytes, chunk_bytes) is None
    assert source == src  # put back as it was
    tiles, good = _chunks(3, 512 << 10, seed=6)
    src, offsets, nbytes = _layout(good, [0, 0, 0])
    rows = _heads(Zstd(), memoryview(bytearray(src)), offsets, nbytes, tiles.shape[1])
    np.testing.assert_array_equal(rows[:, : 128 << 10], tiles[:, : 128 << 10])


def test_prefix_saving_counts_the_whole_blocks_after_the_one_holding_the_last_byte_needed():
    block = codecs._BLOCK_CONTENT_MAX
    assert Zstd().prefix_saving(8 * block, 1) == 7 * block
    assert Zstd().prefix_saving(8 * block, block + 1) == 6 * block
    assert Zstd().prefix_saving(2 * block, 2 * block) == 0
    assert Zstd().prefix_saving(block // 2, 1) == 0  # one block: nothing to leave
    assert Zstd(checksum=True).prefix_saving(8 * block, 1) == 0  # a part would go unchecked
    assert codecs.get("none").prefix_saving(8 * block, 1) == 0  # decoded whole


@needs_libzstd
def test_a_build_without_the_streaming_calls_decodes_whole_frames_only():
    """A libzstd that exports the one-shot call but not the streaming ones (ZSTD_decompressStream,
    ZSTD_DCtx_reset, ZSTD_DCtx_setParameter): whole frames decode, decode_prefix says -1."""
    full = libzstd._loaded()
    library = ctypes.CDLL(full.path)
    libzstd._declare(library)
    names = ("ZSTD_versionNumber", "ZSTD_decompressDCtx", "ZSTD_isError", "ZSTD_createDCtx", "ZSTD_freeDCtx")
    one_shot = types.SimpleNamespace(**{name: getattr(library, name) for name in names})
    decoder = libzstd.FrameDecoder(one_shot, "test")
    assert not decoder.decodes_prefixes
    tiles, chunks = _chunks(1, 256 << 10, seed=2)
    src = np.frombuffer(chunks[0], dtype=np.uint8)
    out = np.zeros(tiles.shape[1], np.uint8)
    assert decoder.decode_prefix(src.ctypes.data, [src.size], out.ctypes.data, out.size, 1) == -1
    assert decoder.decode_frames(src.ctypes.data, src.size, out.ctypes.data, out.size) == out.size
    np.testing.assert_array_equal(out, tiles[0])
