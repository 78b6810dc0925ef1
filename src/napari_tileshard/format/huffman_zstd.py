"""Standard zstd frames whose blocks hold only Huffman-coded literals: the NumPy reference encoder.

For noisy camera data almost all of zstd's gain is the entropy coding of bytes, not match finding.
A zstd frame (RFC 8878) whose compressed blocks carry every byte as a Huffman-coded literal and
zero match sequences is standard zstd: libzstd, nvCOMP, tensorstore and zarr-python read it.  This
module writes such frames with NumPy, computed the way the GPU kernels of the same format will
compute them (whole-block array operations; Python loops only over the <= 256 symbols, the <= 11
code lengths, the 4 streams and the blocks), so that the CPU test suite checks the format and
the GPU output can be compared with it byte for byte.  Not used by the Writer yet.

Names (internal to the package; not re-exported):

* :func:`encode_frame` ``(data, block_size=MAX_BLOCK_SIZE, checksum=False) -> bytes``: one frame;
* :func:`code_lengths` ``(counts, limit=MAX_CODE_LENGTH)``: optimal length-limited prefix code
  lengths (package-merge);
* :func:`xxh64` ``(data, seed=0)``: the hash of zstd's optional content checksum;
* ``MAX_BLOCK_SIZE`` (128 KiB, the format's block limit), ``MAX_CODE_LENGTH`` (11 bits).

What a frame holds (RFC 8878 section numbers):

* Frame header (3.1.1.1): magic, a descriptor with Single_Segment and Frame_Content_Size in the
  smallest field that holds it, no dictionary, the content checksum only when asked (the
  project's zstd codec writes none).  Above 128 MiB of content a Window_Descriptor (window =
  block size: no block refers to another) replaces Single_Segment, because with Single_Segment
  the window is the whole content and streaming decoders refuse windows above 2^27 by default.
* Blocks (3.1.1.2) of ``block_size`` bytes (the last one shorter), each
  - RLE when all its bytes are equal,
  - else Compressed: a Compressed_Literals_Block (3.1.1.3.1) with the Huffman tree description
    and the literals in 1 stream (< 256 bytes, as libzstd does) or 4 streams behind a jump
    table, then a Sequences_Section of 0 sequences (one byte 0),
  - or Raw when the compressed block would not be smaller (so a frame is never larger than the
    input plus 3 bytes a block and the frame header).
* Huffman codes (4.2): per block, code lengths <= 11 bits from package-merge (optimal under the
  limit; ties broken by (count, symbol) and leaves before packages, so a GPU port reproduces
  them exactly); weights described directly (4 bits each, when the largest symbol is <= 128) or
  FSE-compressed (4.2.1.2; the shorter of the two; always FSE for camera data, whose low bytes
  use symbols above 127); canonical codes assigned as the decoder rebuilds them (4.2.1.4); each
  stream written so that the decoder, reading backward, meets the bytes in order, closed by a
  1-bit marker (4.2.2).

Steps and the GPU kernels they stand for (one thread block per zstd block):

1. ``np.bincount`` of a block -> shared-memory histogram;
2. :func:`code_lengths` -> package-merge over <= 11 levels of <= 511 items (merge-path merges);
3. :func:`_tree_description` (weights, FSE of <= 255 weights) and canonical codes -> one warp;
4. per-byte bit lengths and their prefix sums (``np.cumsum``) -> a block-wide scan, which also
   gives the exact compressed size before anything is written (RLE/Raw/Compressed decided here);
5. :func:`_pack_stream` (each code shifted into 64-bit words, words summed) -> every thread
   packs its codes into words, a segmented OR per word;
6. block headers, the jump table and the frame header -> a scan over block sizes places each
   block in the frame (as the shard aggregation places tiles today).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_BLOCK_SIZE", "MAX_CODE_LENGTH", "code_lengths", "encode_frame", "xxh64"]

#: the format's largest block (RFC 8878 3.1.1.2.3, Block_Maximum_Size)
MAX_BLOCK_SIZE = 128 << 10
#: the format's longest Huffman code (RFC 8878 4.2.1)
MAX_CODE_LENGTH = 11

_MAGIC = b"\x28\xb5\x2f\xfd"  # 0xFD2FB528 little-endian
_RAW, _RLE, _COMPRESSED = 0, 1, 2  # Block_Type
_COMPRESSED_LITERALS = 2  # Literals_Block_Type
#: literals of fewer bytes go in 1 stream (libzstd's choice; the format allows 1 stream up to 1023)
_FOUR_STREAMS_MIN = 256
#: a Single_Segment frame's window is its content size; streaming libzstd refuses windows above
#: 2^27 unless told otherwise (ZSTD_WINDOWLOG_LIMIT_DEFAULT), so larger frames name a small window
_SINGLE_SEGMENT_MAX = 1 << 27
#: the FSE description of Huffman weights: table logs 5 (FSE's minimum) to 6 (the format's maximum)
_WEIGHT_TABLE_LOGS = (5, 6)
#: the tree header byte gives an FSE description's size in 7 bits
_FSE_DESCRIPTION_MAX = 127
#: the direct (4-bit) description lists at most 128 weights
_DIRECT_WEIGHTS_MAX = 128


def encode_frame(data, block_size: int = MAX_BLOCK_SIZE, checksum: bool = False) -> bytes:
    """One standard zstd frame of ``data`` (bytes-like or a NumPy array, taken as its raw bytes).

    Blocks of ``block_size`` bytes (1 to 128 KiB) are RLE, Huffman-only compressed or raw,
    whichever is smallest (see the module's docstring); ``checksum`` appends XXH64's low 4 bytes.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be 1 to {MAX_BLOCK_SIZE} bytes (128 KiB), got {block_size}")
    block_size = int(block_size)
    raw = _as_bytes(data)
    pieces = [_MAGIC, _frame_header(raw.size, block_size, checksum)]
    if raw.size == 0:  # a frame has at least one block: an empty last raw block
        pieces.append(_block_header(_RAW, 0, last=True))
    for start in range(0, raw.size, block_size):
        block = raw[start : start + block_size]
        pieces.extend(_encode_block(block, last=start + block_size >= raw.size))
    if checksum:
        pieces.append((xxh64(raw) & 0xFFFFFFFF).to_bytes(4, "little"))
    return b"".join(pieces)


def _as_bytes(data) -> np.ndarray:
    """``data``'s bytes as a flat uint8 array (no copy where the memory is contiguous)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"data must be bytes-like or a NumPy array, got {type(data).__name__}") from None
    return np.frombuffer(view.cast("B") if view.contiguous else view.tobytes(), dtype=np.uint8)


def _frame_header(content_size: int, block_size: int, checksum: bool) -> bytes:
    """Frame_Header_Descriptor, [Window_Descriptor], Frame_Content_Size (RFC 8878 3.1.1.1)."""
    checksum_flag = 0x04 if checksum else 0
    if content_size <= _SINGLE_SEGMENT_MAX:
        # Single_Segment: no window byte; the content size in 1, 2 (minus 256), 4 or 8 bytes
        if content_size < 256:
            return bytes([0x20 | checksum_flag]) + content_size.to_bytes(1, "little")
        if content_size < 65536 + 256:
            return bytes([0x60 | checksum_flag]) + (content_size - 256).to_bytes(2, "little")
        return bytes([0xA0 | checksum_flag]) + content_size.to_bytes(4, "little")
    window_log = max(10, (block_size - 1).bit_length())  # Window_Size = 2^(10 + Exponent) >= block
    size_code, size_bytes = (2, 4) if content_size < 1 << 32 else (3, 8)
    descriptor = (size_code << 6) | checksum_flag
    return bytes([descriptor, (window_log - 10) << 3]) + content_size.to_bytes(size_bytes, "little")


def _block_header(block_type: int, size: int, last: bool) -> bytes:
    return ((size << 3) | (block_type << 1) | int(last)).to_bytes(3, "little")


def _encode_block(block: np.ndarray, last: bool) -> list[bytes]:
    """The header and content of one block: RLE, compressed or raw, whichever is smallest."""
    counts = np.bincount(block, minlength=256)
    if counts.max() == block.size:
        return [_block_header(_RLE, block.size, last), block[:1].tobytes()]
    compressed = _compressed_block(block, counts)
    if compressed is None:
        return [_block_header(_RAW, block.size, last), block.tobytes()]
    return [_block_header(_COMPRESSED, sum(map(len, compressed)), last), *compressed]


def _compressed_block(block: np.ndarray, counts: np.ndarray) -> list[bytes] | None:
    """A Compressed block's content (literals section + 0 sequences), or None when it would not
    be smaller than the block itself (the size is known exactly before any bit is packed)."""
    size = block.size
    lengths = code_lengths(counts)
    description = _tree_description(lengths)
    if description is None:
        return None
    streams = 4 if size >= _FOUR_STREAMS_MIN else 1
    segment = -(-size // streams)  # streams 1-3 take (size + 3) // 4 bytes each, the 4th the rest
    bounds = [min(k * segment, size) for k in range(streams + 1)]
    bit_lengths = lengths.astype(np.uint8)[block]
    ends = np.cumsum(bit_lengths, dtype=np.int64)
    stream_bits = np.diff(np.concatenate([[0], ends[[b - 1 for b in bounds[1:]]]]))
    stream_bytes = stream_bits // 8 + 1  # the marker bit and its padding
    literals_size = len(description) + (6 if streams == 4 else 0) + int(stream_bytes.sum())
    header = _literals_header(size, literals_size, streams)
    if len(header) + literals_size + 1 >= size:
        return None
    codes = _canonical_codes(lengths)[block]
    packed = [
        _pack_stream(codes[lo:hi], bit_lengths[lo:hi], int(bits))
        for lo, hi, bits in zip(bounds[:-1], bounds[1:], stream_bits)
    ]
    jump_table = b"".join(len(p).to_bytes(2, "little") for p in packed[:3]) if streams == 4 else b""
    return [header, description, jump_table, *packed, b"\x00"]  # b"\x00": Number_of_Sequences = 0


def _literals_header(regenerated: int, compressed: int, streams: int) -> bytes:
    """Literals_Section_Header of a Compressed_Literals_Block (RFC 8878 3.1.1.3.1.1)."""
    largest = max(regenerated, compressed)
    if largest < 1 << 10:
        size_format = 0 if streams == 1 else 1
        return (_COMPRESSED_LITERALS | size_format << 2 | regenerated << 4 | compressed << 14).to_bytes(3, "little")
    if streams == 1:
        raise ValueError(f"1-stream literals hold at most 1023 bytes, got {largest}")
    if largest < 1 << 14:
        return (_COMPRESSED_LITERALS | 2 << 2 | regenerated << 4 | compressed << 18).to_bytes(4, "little")
    return (_COMPRESSED_LITERALS | 3 << 2 | regenerated << 4 | compressed << 22).to_bytes(5, "little")


def code_lengths(counts, limit: int = MAX_CODE_LENGTH) -> np.ndarray:
    """Optimal prefix code lengths of at most ``limit`` bits for symbol ``counts`` (package-merge).

    ``counts``: non-negative integers, one per symbol; at least two non-zero.  Returns int64
    lengths, 0 for absent symbols; the lengths satisfy Kraft's equality (a complete code).
    Ties are broken by (count, symbol), and leaves come before packages of equal weight.
    """
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    if counts.ndim != 1 or (counts < 0).any() or present.size < 2:
        raise ValueError(f"code lengths need a 1-D array of counts >= 0 with two or more non-zero, got {counts}")
    if present.size > 1 << limit:
        raise ValueError(f"{present.size} symbols do not fit codes of at most {limit} bits")
    symbols = present[np.argsort(counts[present], kind="stable")]  # by (count, symbol)
    leaves = counts[symbols]
    count = leaves.size
    # Lists from the deepest level (leaves only) up to level 1: each level merges the leaves with
    # the pairs ("packages") of the level below; only which items are packages is kept.
    items = leaves
    is_package_by_level = []
    for _ in range(limit - 1):
        pairs = items.size // 2 * 2
        merged = np.concatenate([leaves, items[0:pairs:2] + items[1:pairs:2]])
        by_weight = np.argsort(merged, kind="stable")  # leaves first among equal weights
        items = merged[by_weight]
        is_package_by_level.append(by_weight >= count)
    # Level 1 selects its 2n-2 lightest items; a selected package selects its two items below.
    # The leaves selected at a level are the lightest ones, so a leaf's code length is the
    # number of levels that select at least (its rank + 1) leaves.
    selected = 2 * count - 2
    leaves_selected = []
    for is_package in reversed(is_package_by_level):
        packages = int(np.count_nonzero(is_package[:selected]))
        leaves_selected.append(selected - packages)
        selected = 2 * packages
    leaves_selected.append(selected)  # the deepest level: leaves only
    ranks = np.arange(count)
    lengths = np.zeros(counts.size, dtype=np.int64)
    lengths[symbols] = (ranks[:, None] < np.array(leaves_selected)[None, :]).sum(axis=1)
    return lengths


def _weights(lengths: np.ndarray) -> np.ndarray:
    """Huffman weights (RFC 8878 4.2.1.1): max length + 1 - length, 0 for absent symbols."""
    return np.where(lengths > 0, lengths.max() + 1 - lengths, 0)


def _canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Each symbol's code (uint64, ``lengths`` bits) as the decoder assigns them (RFC 8878
    4.2.1.4): by weight, then symbol, from the lowest weight (longest code) upward."""
    weights = _weights(lengths)
    max_weight = int(weights.max())
    per_weight = np.bincount(weights, minlength=max_weight + 1)
    # The decoder's table of 2^max_length entries: weight w's symbols take 2^(w-1) entries each,
    # weight 1 first.  A code is its first entry's index >> (w - 1).
    entries = per_weight[1:] << np.arange(max_weight)
    first_entry = np.concatenate([[0, 0], np.cumsum(entries)])  # index w: where weight w starts
    by_weight = np.argsort(weights, kind="stable")
    position = np.empty_like(by_weight)
    position[by_weight] = np.arange(weights.size)
    first_of_weight = np.concatenate([[0], np.cumsum(per_weight)])[weights]
    shift = np.maximum(weights - 1, 0)
    codes = (first_entry[weights] >> shift) + position - first_of_weight
    return np.where(weights > 0, codes, 0).astype(np.uint64)


def _pack_stream(codes: np.ndarray, bit_lengths: np.ndarray, total_bits: int) -> bytes:
    """One Huffman-coded stream (RFC 8878 4.2.2): the last byte's code in the lowest bits, the
    first byte's in the highest, then a 1-bit marker and zero padding to a whole byte.

    The decoder reads the stream backward from the marker, the highest bits first, so the
    first byte's code is met first.  Each code sits at the bit offset given by the sum of the
    lengths after it; codes never share bits, so the words are their sums."""
    starts = total_bits - np.cumsum(bit_lengths, dtype=np.int64)
    word = starts >> 6
    shift = (starts & 63).astype(np.uint64)
    low = codes << shift
    # the bits that cross into the next word; shifting a uint64 by 64 is undefined, hence the mask
    high = np.where(shift == 0, np.uint64(0), codes >> ((np.uint64(64) - shift) & np.uint64(63)))
    words = np.zeros(total_bits // 64 + 2, dtype=np.uint64)
    if codes.size:
        groups = np.flatnonzero(np.concatenate([[True], word[1:] != word[:-1]]))
        used = word[groups]
        words[used] = np.add.reduceat(low, groups)
        words[used + 1] += np.add.reduceat(high, groups)
    words[total_bits >> 6] |= np.uint64(1) << np.uint64(total_bits & 63)
    return words.astype("<u8").view(np.uint8)[: total_bits // 8 + 1].tobytes()


def _tree_description(lengths: np.ndarray) -> bytes | None:
    """Huffman_Tree_Description (RFC 8878 4.2.1): the header byte and the weights of symbols 0
    to the largest present one, excluded (the decoder deduces it): FSE-compressed or 4 bits
    each, the shorter; None when neither form can describe them."""
    weights = _weights(lengths)
    listed = weights[: int(np.flatnonzero(weights)[-1])]
    options = []
    fse = _fse_compressed_weights(listed)
    if fse is not None:
        options.append(bytes([len(fse)]) + fse)
    if listed.size <= _DIRECT_WEIGHTS_MAX:
        padded = np.concatenate([listed, [0] * (listed.size % 2)]).astype(np.uint8)
        options.append(bytes([127 + listed.size]) + (padded[0::2] << 4 | padded[1::2]).tobytes())
    return min(options, key=len) if options else None


def _fse_compressed_weights(weights: np.ndarray) -> bytes | None:
    """Weights as an FSE table description and a 2-state FSE bitstream (RFC 8878 4.2.1.2), at the
    table log that gives the fewer bytes; None when FSE cannot describe them (fewer than 3
    weights or one distinct value, as libzstd) or the result exceeds 127 bytes."""
    counts = np.bincount(weights)
    if weights.size <= 2 or np.count_nonzero(counts) < 2:
        return None
    best = None
    for table_log in _WEIGHT_TABLE_LOGS:
        norm = _normalized_counts(counts, table_log)
        encoded = _write_ncount(norm, table_log) + _fse_encode(weights, norm, table_log)
        if best is None or len(encoded) < len(best):
            best = encoded
    return best if best is not None and len(best) <= _FSE_DESCRIPTION_MAX else None


def _normalized_counts(counts: np.ndarray, table_log: int) -> list[int]:
    """Counts scaled to sum to 2^table_log, every present symbol at least 1: rounded, then the
    difference taken from (or given to) the symbols where a step costs (gains) the most bits
    least (most).  Loops over at most 13 symbols."""
    table_size = 1 << table_log
    total = int(counts.sum())
    norm = [max(1, round(c * table_size / total)) if c else 0 for c in counts.tolist()]
    while sum(norm) > table_size:
        candidates = [s for s, n in enumerate(norm) if n > 1]
        s = min(candidates, key=lambda s: counts[s] * np.log2(norm[s] / (norm[s] - 1)))
        norm[s] -= 1
    while sum(norm) < table_size:
        s = max((s for s, n in enumerate(norm) if n), key=lambda s: counts[s] * np.log2((norm[s] + 1) / norm[s]))
        norm[s] += 1
    return norm


class _BitWriter:
    """Bits appended from the lowest upward (zstd's forward bitstreams), as one Python int."""

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def put(self, value: int, bits: int) -> None:
        self.value |= value << self.size
        self.size += bits

    def closed_with_marker(self) -> bytes:
        """The bits, a 1-bit marker and zero padding (the end of a backward-read stream)."""
        self.put(1, 1)
        return self.padded()

    def padded(self) -> bytes:
        return self.value.to_bytes((self.size + 7) // 8, "little")


def _write_ncount(norm: list[int], table_log: int) -> bytes:
    """The FSE table description (RFC 8878 4.1.1): libzstd's FSE_writeNCount, without its
    low-probability (-1) counts, which the encoder never produces."""
    out = _BitWriter()
    out.put(table_log - 5, 4)  # Accuracy_Log - 5
    remaining = (1 << table_log) + 1
    threshold = 1 << table_log
    bits = table_log + 1
    symbol = 0
    previous_was_zero = False
    while remaining > 1:
        if previous_was_zero:  # a run of zero counts: 2-bit repeat flags, 3 = "3 more and go on"
            start = symbol
            while norm[symbol] == 0:
                symbol += 1
            while symbol >= start + 3:
                start += 3
                out.put(3, 2)
            out.put(symbol - start, 2)
        count = norm[symbol]
        symbol += 1
        small = 2 * threshold - 1 - remaining  # values below this take one bit less
        remaining -= count
        value = count + 1  # + 1: "probability 0" is written as 1
        if value >= threshold:
            value += small
        out.put(value, bits - (1 if value < small else 0))
        previous_was_zero = value == 1
        while remaining < threshold:
            bits -= 1
            threshold >>= 1
    return out.padded()


def _fse_tables(norm: list[int], table_log: int) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """The decoder's table for ``norm`` (RFC 8878 4.1.1: symbol spread, then per state its number
    of bits and baseline) and, per symbol, the state whose range [baseline, baseline + 2^bits)
    holds each next state (what an encoder needs to step backward) and its first state (the
    lowest: it reads the most bits, at least one)."""
    table_size = 1 << table_log
    step = (table_size >> 1) + (table_size >> 3) + 3  # odd: k * step visits every state once
    spread = np.empty(table_size, dtype=np.int64)
    spread[(np.arange(table_size) * step) & (table_size - 1)] = np.repeat(np.arange(len(norm)), norm)
    bits = np.empty(table_size, dtype=np.int64)
    baseline = np.empty(table_size, dtype=np.int64)
    state_for, first_state = [], []
    for symbol, count in enumerate(norm):
        states = np.flatnonzero(spread == symbol)  # ascending: the first ones take one bit more
        x = count + np.arange(count)
        bits[states] = table_log - np.floor(np.log2(x)).astype(np.int64) if count else 0
        baseline[states] = (x << bits[states]) - table_size
        by_baseline = np.argsort(baseline[states])
        state_for.append(np.repeat(states[by_baseline], 1 << bits[states][by_baseline]).tolist())
        first_state.append(int(states[0]) if count else -1)
    return bits.tolist(), baseline.tolist(), state_for, first_state


def _fse_encode(symbols: np.ndarray, norm: list[int], table_log: int) -> bytes:
    """The 2-state FSE bitstream of Huffman weights (RFC 8878 4.2.1.2), as libzstd writes it.

    The decoder starts with state 1 then state 2 (read from the stream's end), then decodes the
    even-indexed symbols with state 1 and the odd ones with state 2, each followed by the bits of
    its state's next state; it stops when the bits run out, emitting the other state's symbol.
    So the encoder walks the symbols backward: the last two pick their symbol's first state (it
    reads at least one bit, which ends the stream), every earlier one the state whose range
    holds its successor's state, writing the successor's offset in that range; then state 2's
    and state 1's first states.  A loop over <= 255 weights (one thread on a GPU)."""
    bits, baseline, state_for, first_state = _fse_tables(norm, table_log)
    out = _BitWriter()
    values = symbols.tolist()
    state = [0, 0]
    for k in range(len(values) - 1, -1, -1):
        parity, symbol = k & 1, values[k]
        if k >= len(values) - 2:
            state[parity] = first_state[symbol]
            continue
        successor = state[parity]
        current = state_for[symbol][successor]
        out.put(successor - baseline[current], bits[current])
        state[parity] = current
    out.put(state[1], table_log)
    out.put(state[0], table_log)
    return out.closed_with_marker()


_P1, _P2, _P3, _P4, _P5 = (
    0x9E3779B185EBCA87,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5,
)
_MASK64 = (1 << 64) - 1


def _rotl64(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (64 - bits))) & _MASK64


def _xxh64_round(accumulator: int, lane: int) -> int:
    return _rotl64((accumulator + lane * _P2) & _MASK64, 31) * _P1 & _MASK64


def xxh64(data, seed: int = 0) -> int:
    """XXH64 of ``data``'s bytes (zstd's Content_Checksum is its low 4 bytes, seed 0).

    Each of the 4 accumulators depends on the one before, 32 bytes at a time, so this loops over
    32-byte stripes (a checksum is optional and off by default)."""
    raw = _as_bytes(data)
    size = raw.size
    stripes = size // 32
    if stripes:
        lanes = raw[: stripes * 32].view("<u8").reshape(stripes, 4).tolist()
        v1, v2, v3, v4 = (seed + _P1 + _P2) & _MASK64, (seed + _P2) & _MASK64, seed, (seed - _P1) & _MASK64
        for a, b, c, d in lanes:
            v1, v2, v3, v4 = _xxh64_round(v1, a), _xxh64_round(v2, b), _xxh64_round(v3, c), _xxh64_round(v4, d)
        h = (_rotl64(v1, 1) + _rotl64(v2, 7) + _rotl64(v3, 12) + _rotl64(v4, 18)) & _MASK64
        for v in (v1, v2, v3, v4):
            h = ((h ^ _xxh64_round(0, v)) * _P1 + _P4) & _MASK64
    else:
        h = (seed + _P5) & _MASK64
    h = (h + size) & _MASK64
    tail = raw[stripes * 32 :]
    words = len(tail) // 8
    for lane in tail[: words * 8].view("<u8").tolist():
        h = (_rotl64(h ^ _xxh64_round(0, lane), 27) * _P1 + _P4) & _MASK64
    tail = tail[words * 8 :]
    if len(tail) >= 4:
        h = (_rotl64(h ^ (int(tail[:4].view("<u4")[0]) * _P1 & _MASK64), 23) * _P2 + _P3) & _MASK64
        tail = tail[4:]
    for byte in tail.tolist():
        h = _rotl64(h ^ (byte * _P5 & _MASK64), 11) * _P1 & _MASK64
    h ^= h >> 33
    h = h * _P2 & _MASK64
    h ^= h >> 29
    h = h * _P3 & _MASK64
    return h ^ (h >> 32)
