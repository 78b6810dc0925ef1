"""The NumPy reference of the Huffman-only zstd encoder: every frame decoded by libzstd
(python-zstandard, one-shot and streaming) and compared exactly; the frame's structure read back
by a small parser written here from RFC 8878 (block types, stream counts, tree descriptions);
code lengths against pure-Python references (heapq Huffman, brute force under a small limit)."""

import heapq
import itertools

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from napari_tileshard import SUPPORTED_DTYPES, SyntheticCamera
from napari_tileshard.format.huffman_zstd import (
    MAX_BLOCK_SIZE,
    MAX_CODE_LENGTH,
    _frame_header,
    code_lengths,
    encode_frame,
    xxh64,
)

RAW, RLE, COMPRESSED = 0, 1, 2
#: magic (4) + descriptor (1) + content size (at most 4 below 128 MiB)
FRAME_HEADER_MAX = 9


def decoded(frame: bytes) -> bytes:
    """``frame`` decoded by libzstd one-shot and streaming (both must agree)."""
    one_shot = zstandard.ZstdDecompressor().decompress(frame)
    streamed = zstandard.ZstdDecompressor().decompressobj().decompress(frame)
    assert streamed == one_shot
    return one_shot


def blocks_of(frame: bytes) -> list[dict]:
    """The blocks of one frame, read with RFC 8878 3.1.1 (not with the encoder's code)."""
    assert frame[:4] == b"\x28\xb5\x2f\xfd"
    descriptor = frame[4]
    assert descriptor & 0x20, "single segment"
    assert descriptor & 0x1B == 0, "no dictionary, reserved bits clear"
    size_bytes = [1, 2, 4, 8][descriptor >> 6]
    pos = 5 + size_bytes
    blocks = []
    while True:
        header = int.from_bytes(frame[pos : pos + 3], "little")
        pos += 3
        kind, size, last = (header >> 1) & 3, header >> 3, header & 1
        content = frame[pos : pos + (1 if kind == RLE else size)]
        pos += len(content)
        block = {"type": kind, "size": size}
        if kind == COMPRESSED:
            literals_type, size_format = content[0] & 3, (content[0] >> 2) & 3
            assert literals_type == 2, "Compressed_Literals_Block"
            header_size = {0: 3, 1: 3, 2: 4, 3: 5}[size_format]
            lh = int.from_bytes(content[:header_size], "little")
            bits = {0: 10, 1: 10, 2: 14, 3: 18}[size_format]
            block["regenerated"] = (lh >> 4) & ((1 << bits) - 1)
            literals_size = lh >> (4 + bits)
            block["streams"] = 1 if size_format == 0 else 4
            block["tree_header"] = content[header_size]
            assert content[header_size + literals_size :] == b"\x00", "0 sequences, nothing after"
        blocks.append(block)
        if last:
            break
    assert pos == len(frame) - (4 if descriptor & 0x04 else 0)
    return blocks


def check_frame(data: bytes, frame: bytes, block_size: int, checksum: bool = False) -> list[dict]:
    assert decoded(frame) == data
    blocks = blocks_of(frame)
    assert len(blocks) == max(1, -(-len(data) // block_size))
    regenerated = [len(data) - i * block_size for i in range(len(blocks))]
    for block, expected in zip(blocks, regenerated):
        size = min(block_size, expected)
        if block["type"] == COMPRESSED:
            assert block["regenerated"] == size
            assert block["size"] < size, "a compressed block is smaller than the raw one"
            assert block["streams"] == (4 if size >= 256 else 1)
        else:
            assert block["size"] == size
    assert len(frame) <= len(data) + 3 * len(blocks) + FRAME_HEADER_MAX + 4 * checksum
    return blocks


def tile_bytes(dtype, frames=2, shape=(256, 256), seed=0) -> bytes:
    return SyntheticCamera(shape, dtype, seed=seed).stack(frames).tobytes()


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_camera_tiles_round_trip_and_compress(dtype):
    data = tile_bytes(dtype)
    frame = encode_frame(data)
    blocks = check_frame(data, frame, MAX_BLOCK_SIZE)
    assert all(block["type"] == COMPRESSED for block in blocks)
    # noisy camera data: entropy coding is almost all of zstd's gain
    assert len(frame) < 1.03 * len(zstandard.ZstdCompressor(level=1).compress(data)) < len(data)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_every_supported_dtype_as_bytes(dtype):
    data = tile_bytes(dtype, frames=1, shape=(128, 96), seed=7)
    for block_size in (MAX_BLOCK_SIZE, 5000):
        check_frame(data, encode_frame(data, block_size=block_size), block_size)


def test_numpy_arrays_are_encoded_as_their_bytes():
    frames = SyntheticCamera((64, 64), "uint16", seed=2).stack(3)
    strided = frames[:, ::2, 1::3]  # not contiguous
    assert decoded(encode_frame(strided)) == strided.tobytes()
    assert decoded(encode_frame(frames)) == frames.tobytes()
    assert decoded(encode_frame(memoryview(frames.tobytes()))) == frames.tobytes()


def test_all_equal_blocks_are_rle():
    camera = tile_bytes("uint16", frames=1)
    data = bytes(MAX_BLOCK_SIZE) + camera[:MAX_BLOCK_SIZE] + b"\x07" * 1000
    frame = encode_frame(data)
    blocks = check_frame(data, frame, MAX_BLOCK_SIZE)
    assert [b["type"] for b in blocks] == [RLE, COMPRESSED, RLE]
    zeros = bytes(5 * MAX_BLOCK_SIZE + 3)
    frame = encode_frame(zeros)
    assert [b["type"] for b in check_frame(zeros, frame, MAX_BLOCK_SIZE)] == [RLE] * 6
    assert len(frame) == FRAME_HEADER_MAX + 6 * 4


def test_incompressible_blocks_are_raw():
    data = np.random.default_rng(1).integers(0, 256, 3 * MAX_BLOCK_SIZE + 77, dtype=np.uint8).tobytes()
    frame = encode_frame(data)
    blocks = check_frame(data, frame, MAX_BLOCK_SIZE)
    assert [b["type"] for b in blocks] == [RAW] * 4
    assert len(frame) == len(data) + 3 * 4 + FRAME_HEADER_MAX


def test_short_blocks_that_do_not_pay_for_their_table_are_raw():
    data = bytes(range(80))  # 6-7 bits a byte, plus 41 bytes of weights
    blocks = check_frame(data, encode_frame(data), MAX_BLOCK_SIZE)
    assert blocks[0]["type"] == RAW


def test_every_byte_value_equally_often_is_raw():
    # all 256 codes 8 bits long: weights that neither description can carry (one FSE symbol, > 128 direct)
    data = np.repeat(np.arange(256, dtype=np.uint8), 100)
    np.random.default_rng(0).shuffle(data)
    blocks = check_frame(data.tobytes(), encode_frame(data), MAX_BLOCK_SIZE)
    assert blocks[0]["type"] == RAW


@pytest.mark.parametrize("symbols", [(0, 1), (0, 255), (3, 200), (127, 128), (254, 255)])
@pytest.mark.parametrize("size", [2, 50, 255, 256, 1023, 1024, 70_000, MAX_BLOCK_SIZE])
def test_two_symbol_alphabets(symbols, size):
    rng = np.random.default_rng(size)
    data = np.array(symbols, dtype=np.uint8)[rng.integers(0, 2, size)]
    data[:2] = symbols  # both present
    blocks = check_frame(data.tobytes(), encode_frame(data), MAX_BLOCK_SIZE)
    if size >= 1024:  # one bit a byte
        assert blocks[0]["type"] == COMPRESSED
        assert blocks[0]["size"] < size / 8 + 80
    if size >= 1024 and max(symbols) > 128:
        assert blocks[0]["tree_header"] < 128, "FSE-compressed weights (direct ones stop at 128)"


@pytest.mark.parametrize("size", [1, 2, 255, 256, MAX_BLOCK_SIZE + 1])
def test_one_symbol_alphabets_are_rle(size):
    data = b"\xab" * size
    blocks = check_frame(data, encode_frame(data), MAX_BLOCK_SIZE)
    assert {b["type"] for b in blocks} == {RLE}


def test_empty_input_is_zstds_own_empty_frame():
    frame = encode_frame(b"")
    assert frame == zstandard.ZstdCompressor(level=1).compress(b"")
    assert decoded(frame) == b""
    assert decoded(encode_frame(b"", checksum=True)) == b""


def test_large_alphabets_use_fse_weights_and_small_ones_the_shorter_description():
    rng = np.random.default_rng(3)
    high = (200 + rng.geometric(0.3, 50_000) % 56).astype(np.uint8)  # symbols 200-255
    low = (rng.geometric(0.3, 50_000) % 100).astype(np.uint8)  # symbols 0-99: direct possible
    for data in (high, low):
        blocks = check_frame(data.tobytes(), encode_frame(data), MAX_BLOCK_SIZE)
        assert blocks[0]["type"] == COMPRESSED
    assert blocks_of(encode_frame(high))[0]["tree_header"] < 128


@pytest.mark.parametrize("size", [255, 256, 65_791, 65_792, 3 * 1000 + 1])
def test_sizes_at_content_size_field_boundaries_and_not_multiples_of_the_block(size):
    data = tile_bytes("uint16", frames=1)[:size]
    for block_size in (MAX_BLOCK_SIZE, 1000, 4096):
        check_frame(data, encode_frame(data, block_size=block_size), block_size)


@pytest.mark.parametrize("content_size", [0, 255, 256, 65_791, 65_792, 1 << 27])
def test_frame_header_single_segment(content_size):
    params = zstandard.get_frame_parameters(b"\x28\xb5\x2f\xfd" + _frame_header(content_size, MAX_BLOCK_SIZE, False))
    assert (params.content_size, params.window_size, params.has_checksum) == (content_size, content_size, False)


@pytest.mark.parametrize("content_size", [(1 << 27) + 1, (1 << 32) - 1, 1 << 32, 1 << 40])
@pytest.mark.parametrize(("block_size", "window"), [(MAX_BLOCK_SIZE, MAX_BLOCK_SIZE), (1000, 1024), (1, 1024)])
def test_frame_header_above_128_mib_names_a_block_sized_window(content_size, block_size, window):
    params = zstandard.get_frame_parameters(b"\x28\xb5\x2f\xfd" + _frame_header(content_size, block_size, True))
    assert (params.content_size, params.window_size, params.has_checksum) == (content_size, window, True)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, 1000, 70_001])
def test_checksum_is_zstds_and_decoders_verify_it(size):
    data = np.random.default_rng(size).geometric(0.05, size).astype(np.uint8).tobytes()
    reference = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data)
    frame = encode_frame(data, checksum=True)
    assert frame[-4:] == reference[-4:]
    assert xxh64(data) & 0xFFFFFFFF == int.from_bytes(reference[-4:], "little")
    check_frame(data, frame, MAX_BLOCK_SIZE, checksum=True)
    if not size:  # python-zstandard returns b"" for a frame of content size 0 without decoding it
        return
    broken = frame[:-1] + bytes([frame[-1] ^ 1])
    with pytest.raises(zstandard.ZstdError, match="checksum"):
        zstandard.ZstdDecompressor().decompress(broken)


def test_xxh64_known_values():
    # the reference implementation's values (xxhsum -H64)
    assert xxh64(b"") == 0xEF46DB3751D8E999
    assert xxh64(b"a") == 0xD24EC4F1A98C6E5B
    assert xxh64(b"abc") == 0x44BC2CF5AD770999


@pytest.mark.parametrize("block_size", [0, -1, MAX_BLOCK_SIZE + 1])
def test_block_size_out_of_range_is_refused_naming_it(block_size):
    with pytest.raises(ValueError, match=f"got {block_size}"):
        encode_frame(b"abc", block_size=block_size)


@pytest.mark.parametrize("block_size", [1.5, "4096", True])
def test_block_size_of_another_type_is_refused_naming_it(block_size):
    with pytest.raises(TypeError, match="block_size must be an int"):
        encode_frame(b"abc", block_size=block_size)


def test_data_that_is_not_bytes_is_refused():
    with pytest.raises(TypeError, match="got str"):
        encode_frame("abc")


@st.composite
def buffers(draw):
    """Data of several kinds (camera bytes, skewed, uniform, few symbols, high symbols only) and a
    block size from 1 byte to 128 KiB, at most 40 blocks and 256 KiB."""
    # block sizes over 1 B .. 128 KiB in log scale (hypothesis favours a list's first items: both orders)
    exponent = draw(st.one_of(st.sampled_from(range(18)), st.sampled_from(range(17, -1, -1))))
    block_size = draw(st.integers(max(1, 1 << exponent >> 1), 1 << exponent))
    # whole blocks plus a partial one (hypothesis alone draws mostly small sizes)
    whole = draw(st.integers(0, min(40, (256 << 10) // block_size)))
    size = min(whole * block_size + draw(st.integers(0, block_size - 1)), 256 << 10)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["camera", "skewed", "uniform", "few", "high"]))
    if kind == "camera":
        start = draw(st.integers(0, 1 << 17))
        data = np.frombuffer(tile_bytes("uint16", frames=2, seed=seed % 4), np.uint8)[start : start + size]
    elif kind == "skewed":
        data = (rng.geometric(draw(st.floats(0.01, 0.9)), size) % 256).astype(np.uint8)
    elif kind == "uniform":
        data = rng.integers(0, 256, size, dtype=np.uint8)
    elif kind == "few":
        alphabet = rng.choice(256, draw(st.integers(1, 4)), replace=False).astype(np.uint8)
        data = alphabet[rng.integers(0, alphabet.size, size)]
    else:
        data = (255 - rng.geometric(0.2, size) % 100).astype(np.uint8)
    return data.tobytes(), block_size


@settings(max_examples=60, deadline=None)
@given(buffers(), st.booleans())
def test_fuzzed_block_sizes_and_data_round_trip(case, checksum):
    data, block_size = case
    check_frame(data, encode_frame(data, block_size=block_size, checksum=checksum), block_size, checksum)


# --- code lengths: against independent references ------------------------------------------


def huffman_cost(counts) -> int:
    """Total bits of an (unlimited) Huffman code: the sum of the merged weights (heapq)."""
    heap = [c for c in counts if c]
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        total += merged
        heapq.heappush(heap, merged)
    return total


def huffman_depth(counts) -> int:
    """The longest code of an (unlimited) Huffman code (ties broken by depth: the shallowest tree)."""
    heap = [(c, 0) for c in counts if c]
    heapq.heapify(heap)
    while len(heap) > 1:
        (a, da), (b, db) = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, (a + b, max(da, db) + 1))
    return heap[0][1]


def brute_force_cost(counts, limit) -> int:
    """The cheapest complete prefix code with lengths <= limit, by trying every length vector."""
    present = [c for c in counts if c]
    best = None
    for lengths in itertools.product(range(1, limit + 1), repeat=len(present)):
        if sum(2 ** (limit - n) for n in lengths) == 2**limit:
            cost = sum(c * n for c, n in zip(present, lengths))
            best = cost if best is None else min(best, cost)
    return best


def assert_complete_and_limited(lengths, counts, limit):
    counts = np.asarray(counts)
    assert ((lengths > 0) == (counts > 0)).all()
    assert lengths.max() <= limit
    assert sum(2 ** (limit - int(n)) for n in lengths if n) == 2**limit  # Kraft's equality


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=2, max_size=256).filter(lambda c: sum(x > 0 for x in c) >= 2))
def test_code_lengths_are_optimal_complete_and_at_most_11_bits(counts):
    lengths = code_lengths(counts)
    assert_complete_and_limited(lengths, counts, MAX_CODE_LENGTH)
    cost = int((np.asarray(counts) * lengths).sum())
    assert cost >= huffman_cost(counts)
    if huffman_depth(counts) <= MAX_CODE_LENGTH:  # the limit costs nothing: Huffman's optimum
        assert cost == huffman_cost(counts)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 3), st.lists(st.integers(0, 1000), min_size=2, max_size=6))
def test_code_lengths_under_a_small_limit_match_brute_force(limit, counts):
    present = sum(c > 0 for c in counts)
    if present < 2 or present > 2**limit:
        with pytest.raises(ValueError):
            code_lengths(counts, limit=limit)
        return
    lengths = code_lengths(counts, limit=limit)
    assert_complete_and_limited(lengths, counts, limit)
    assert int((np.asarray(counts) * lengths).sum()) == brute_force_cost(counts, limit)


def test_code_lengths_of_fibonacci_counts_are_cut_to_11_bits():
    fibonacci = [1, 1]
    while len(fibonacci) < 30:
        fibonacci.append(fibonacci[-1] + fibonacci[-2])
    assert huffman_depth(fibonacci) == 29  # unlimited Huffman would need 29 bits
    lengths = code_lengths(fibonacci)
    assert_complete_and_limited(lengths, fibonacci, MAX_CODE_LENGTH)
    assert lengths.max() == MAX_CODE_LENGTH
    data = np.repeat(np.arange(25, dtype=np.uint8) * 10, fibonacci[:25])  # 196,417 bytes
    np.random.default_rng(0).shuffle(data)
    assert code_lengths(np.bincount(data)).max() == MAX_CODE_LENGTH
    check_frame(data.tobytes(), encode_frame(data), MAX_BLOCK_SIZE)


@pytest.mark.parametrize("counts", [[5], [0, 7, 0], [], [1, -1, 3]])
def test_code_lengths_refuse_fewer_than_two_symbols_or_negative_counts(counts):
    with pytest.raises(ValueError, match="two or more non-zero"):
        code_lengths(counts)
