"""Chunk codecs: the one module that knows a codec's levels, bounds, bitstream and Zarr metadata.

Each codec is a small frozen dataclass, as zarr-python's are, whose fields are its configuration
(``level``, ``typesize``, ...); :data:`REGISTRY` holds one default instance per name, in the order
an inner codec chain is matched against them.  One object serves both directions and both devices:

* the writer: :meth:`Codec.configure` makes the one a writer uses, :meth:`Codec.encode_tiles`
  encodes a batch of tiles, :meth:`Codec.zarr_codecs` is the chain written to ``zarr.json``;
* the reader and verify: :func:`from_zarr_codecs` resolves an inner chain to a codec once, then
  :meth:`Codec.decode_into` decodes a chunk into a caller's buffer, bounded (never more than the
  destination; a chunk that does not decode to exactly one chunk is a :class:`CodecError`), and
  :meth:`Codec.min_encoded_bytes`/:meth:`Codec.max_encoded_bytes` bound what a shard index may
  claim for a chunk;
* the GPU: ``gpu`` says what nvCOMP does for the codec (its batched algorithm, used to encode and
  to decode; :mod:`napari_tileshard.gpu.nvcomp` binds it), described here, never imported.

``writable``: the codecs the writer offers (:data:`CODECS`, the CLI's and the widget's choices,
what :func:`get` returns).  The others (gzip, blosc with another compressor or shuffle) are read,
never written.  The ``bytes`` codec's byte order is the array's, not the codec's: it lives in
:class:`~napari_tileshard.format.shard_spec.ShardSpec`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import numcodecs.blosc
import numpy as np
import zstandard
from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

from . import libzstd

__all__ = [
    "Blosc",
    "BloscLz4",
    "CODECS",
    "Codec",
    "CodecError",
    "GpuSupport",
    "Gzip",
    "HeadsPatch",
    "Opaque",
    "REGISTRY",
    "Raw",
    "Zstd",
    "chain_refusal",
    "from_zarr_codecs",
    "get",
    "gpu_decode_support",
    "gpu_support",
    "names",
]

_MAX_CHUNK_BYTES = 2**31 - 1  # the Layout's tile limit
_local = threading.local()  # zstandard contexts are not thread-safe: one per thread (and level)


class CodecError(ValueError):
    """A chunk that does not decode to exactly one chunk of the expected size; says why.
    ``chunk``: its position in a :meth:`Codec.decode_chunks` batch (None otherwise)."""

    chunk: int | None = None


@dataclass(frozen=True, eq=False)
class HeadsPatch:
    """The bytes that make chunks decode to their first ``head`` bytes alone
    (:meth:`Codec.heads_patch`): chunk ``i`` is ``starts[i]`` .. ``ends[i]`` of its source, and
    ``values[i]`` go to ``positions[i]`` there for the call; ``follows[i]``: chunk ``i + 1``
    starts where chunk ``i`` ends."""

    head: int
    chunk_bytes: int
    starts: np.ndarray
    ends: np.ndarray
    follows: np.ndarray
    positions: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class GpuSupport:
    """What the GPU does for a codec, in both directions: the writer's GPU backend encodes with
    nvCOMP's batched ``nvcomp`` algorithm, the reader's GPU path decodes with it."""

    nvcomp: str | None  # nvCOMP's batched algorithm; None: the chunks are the tiles as they are
    max_chunk_bytes: int = _MAX_CHUNK_BYTES
    levels: bool = True  # False: nvCOMP has no level, the level is recorded but not applied


@dataclass(frozen=True)
class Codec:
    """A chunk codec: ``bytes`` serialisation plus at most one compressor."""

    name: ClassVar[str]
    #: the compressor's name in zarr metadata; None: none (the ``bytes`` codec alone)
    zarr_name: ClassVar[str | None] = None
    #: True: the writer offers it; False: read only
    writable: ClassVar[bool] = True
    #: inclusive range of ``level``; None: the level is accepted and ignored
    level_range: ClassVar[tuple[int, int] | None] = None
    max_chunk_bytes: ClassVar[int] = _MAX_CHUNK_BYTES
    #: None: the GPU cannot encode nor decode this codec's bitstream (``gpu_unsupported_reason`` says why)
    gpu: ClassVar[GpuSupport | None] = None
    gpu_unsupported_reason: ClassVar[str] = ""
    #: False when any chunk of the right size is valid, so decoding it proves nothing
    checks_content: ClassVar[bool] = True

    level: int = 1
    typesize: int = 1

    def validate_level(self, level) -> int:
        if not isinstance(level, (int, np.integer)) or isinstance(level, bool):
            raise TypeError(f"level must be an integer, got {level!r}")
        if self.level_range and not self.level_range[0] <= level <= self.level_range[1]:
            low, high = self.level_range
            raise ValueError(f"{self.name} level must be in {low}..{high}, got {level}")
        return int(level)

    def configure(self, level, dtype) -> Codec:
        """This codec at ``level`` for elements of ``dtype`` (validated)."""
        return replace(self, level=self.validate_level(level), typesize=np.dtype(dtype).itemsize)

    # -- bounds --------------------------------------------------------------------------------
    def max_encoded_bytes(self, nbytes: int) -> int:
        """Worst-case encoded size of one chunk of ``nbytes`` (what a shard index may claim)."""
        raise NotImplementedError

    def min_encoded_bytes(self, nbytes: int) -> int:
        return 1

    # -- encoding ------------------------------------------------------------------------------
    def encode(self, buffer):
        """One chunk's encoded bytes (compressors release the GIL: backends call this from threads)."""
        return self._encoder()(buffer)

    def _encoder(self):
        """buffer -> encoded bytes, for the calling thread (fetched once per batch of tiles)."""
        raise NotImplementedError(f"{self.name} chunks are read, not written")

    #: True when :meth:`encode_tiles` may return views of its input (the caller must then keep the
    #: tiles alive and unchanged until the chunks are written)
    encoded_tiles_alias_input: ClassVar[bool] = False

    def encode_tiles(self, tiles: np.ndarray) -> tuple[list, list[int]]:
        """Encode each row of ``tiles`` (uint8, one tile per row): (buffers whose concatenation is
        the chunks in order, encoded size per tile).

        The generic path: one :meth:`encode` per tile.  A codec with a native batch encoder
        overrides it; its output must equal this one's byte for byte (``tests/format/test_codec_objects.py``).
        """
        return self.encode_tiles_one_by_one(tiles)

    def encode_tiles_one_by_one(self, tiles: np.ndarray) -> tuple[list, list[int]]:
        """:meth:`encode_tiles` with one encoder call per tile (the reference of batch encoders)."""
        encode = self._encoder()
        chunks = [encode(tile) for tile in tiles]
        return chunks, [len(c) for c in chunks]

    # -- decoding ------------------------------------------------------------------------------
    def decode_into(self, src, dest: np.ndarray) -> None:
        """Decode the chunk ``src`` (bytes-like) into ``dest`` (contiguous uint8, exactly one
        chunk's bytes), or raise :class:`CodecError`.  Never allocates from sizes in the data:
        at most ``len(dest)`` bytes are ever produced; anything else than exactly one chunk
        (shorter, longer, bytes after it) is refused."""
        raise NotImplementedError

    def decode_chunks(self, src, offsets, nbytes, dest: np.ndarray, absent: int = -1) -> None:
        """Decode many chunks of one buffer: chunk ``i`` is bytes ``offsets[i]`` .. ``offsets[i] +
        nbytes[i]`` of ``src`` (a memoryview of bytes), decoded into row ``dest[i]`` (``dest``:
        uint8, one chunk a row); rows whose ``nbytes`` is ``absent`` are left as they are.  One
        call per batch instead of one per chunk (the reader decodes a unit of chunks per task);
        a chunk that does not decode raises :class:`CodecError` with ``.chunk`` its position."""
        decode = self.decode_into
        for i, (offset, size) in enumerate(zip(offsets, nbytes)):
            if size == absent:
                continue
            try:
                decode(src[offset : offset + size], dest[i])
            except CodecError as exc:
                exc.chunk = i
                raise

    def decode_chunks_released(self, src, offsets, nbytes, dest: np.ndarray, absent: int = -1) -> None:
        """:meth:`decode_chunks`, the same bytes and errors, decoded in one native call that takes
        the GIL back a fixed number of times per batch rather than a few times per chunk: for
        decoding on a background thread beside a thread busy in Python (napari drawing), where
        each taking back of the GIL waits up to the interpreter's switch interval (5 ms).
        Costs more CPU than :meth:`decode_chunks` where it may; by default it is that."""
        self.decode_chunks(src, offsets, nbytes, dest, absent)

    def decoded_chunks_released(
        self, src, offsets, nbytes, chunk_bytes: int, scratch: np.ndarray | None = None
    ) -> np.ndarray | None:
        """Every chunk (all present) decoded in one native call that holds no GIL: a ``(count,
        chunk_bytes)`` uint8 array over the call's own memory (kept alive by the array) where
        the call decoded them into one buffer, so the reader places chunks straight from it;
        else copied into ``scratch`` (``(count, chunk_bytes)`` uint8; None: a new array), a copy
        per buffer of the call.  None where this codec has no such call or the batch refused
        something: then :meth:`decode_chunks_released` decodes them and names what is wrong."""
        return None

    def prefix_saving(self, chunk_bytes: int, need: int) -> int:
        """The bytes of a chunk of ``chunk_bytes`` that :meth:`decoded_prefixes` would leave
        undecoded at least, asked for its first ``need`` (0: this codec decodes chunks whole)."""
        return 0

    def head_bytes(self, chunk_bytes: int) -> int:
        """The first bytes of a chunk of ``chunk_bytes`` that :meth:`decoded_heads` decodes (0:
        this codec has no such call for chunks of that size)."""
        return 0

    def heads_patch(self, src, offsets, nbytes, chunk_bytes: int) -> HeadsPatch | None:
        """What makes chunk ``i`` (bytes ``offsets[i]`` .. ``+ nbytes[i]`` of ``src``) decode to
        its first :meth:`head_bytes` alone, for :meth:`decoded_heads`; None where this codec has
        no such way or the chunks are not of the kind it takes (the caller then decodes them
        another way, which names what is wrong).  Worked out once for many chunks (a block's),
        used by each of their units."""
        return None

    def decoded_heads(self, src, patch: HeadsPatch, first: int, stop: int, scratch: np.ndarray | None = None):
        """Chunks ``first..stop`` of ``patch`` (of :meth:`heads_patch` on ``src``, which they
        lie back to back in) decoded as far as their heads, all in one native call that holds no
        GIL, into ``scratch`` (``(count, chunk_bytes)`` uint8; None: a new array): a read-only
        ``(count, chunk_bytes)`` array of which each row is valid up to the head (the rest of it
        anything).  ``src`` is changed during the call and as it was after it.  None where they
        are not back to back or the call refused."""
        return None

    def decoded_prefixes(
        self,
        src,
        offsets,
        nbytes,
        chunk_bytes: int,
        need: int,
        scratch: np.ndarray | None = None,
        min_saved: int = 1,
    ) -> tuple[np.ndarray, int] | None:
        """Every chunk (all present) decoded as far as its first ``need`` bytes (of
        ``chunk_bytes``) and no further where the codec can stop early, into ``scratch`` (``(count,
        chunk_bytes)`` uint8; None: a new array): the array (each row valid up to ``need`` bytes
        at least) and the bytes decoded in all.  None where this codec cannot stop early, it
        would leave fewer than ``min_saved`` bytes of a chunk undecoded, or something was
        refused: then the caller decodes the chunks whole (which names what is wrong)."""
        return None

    def decode(self, data, nbytes: int) -> bytes:
        """Exactly ``nbytes`` decoded bytes, or :class:`CodecError`; never allocates more."""
        dest = np.empty(nbytes, dtype=np.uint8)
        self.decode_into(data, dest)
        return dest.tobytes()

    # -- metadata ------------------------------------------------------------------------------
    def compressors(self) -> list[dict]:
        """The compressors after the ``bytes`` codec, as zarr-python's own codec classes write them."""
        return []

    def zarr_codecs(self, endian: str | None = "little") -> list[dict]:
        """The sharding codec's inner chain: ``bytes`` (with ``endian``; None: no configuration)
        then the compressors."""
        serializer: dict[str, Any] = {"name": "bytes"}
        if endian is not None:
            serializer["configuration"] = {"endian": endian}
        return [serializer, *self.compressors()]

    @classmethod
    def from_zarr_codecs(cls, chain, dtype) -> Codec | None:
        """This codec, configured as the inner chain ``chain`` (zarr's dict form) of a ``dtype``
        array says, or None when the chain is not this codec's."""
        if not _is_chain(chain) or chain[0]["name"] != "bytes":
            return None
        compressors = list(chain[1:])
        typesize = np.dtype(dtype).itemsize
        if cls.zarr_name is None:
            return cls(typesize=typesize) if not compressors else None
        if len(compressors) != 1 or compressors[0]["name"] != cls.zarr_name:
            return None
        config = compressors[0].get("configuration") or {}
        if not isinstance(config, dict):
            return None
        return cls._from_config(config, typesize)

    @classmethod
    def _from_config(cls, config: dict, typesize: int) -> Codec | None:
        """This codec from its compressor's zarr configuration (None: not this codec)."""
        return cls(typesize=typesize)

    def to_dict(self) -> dict:
        """``{"name", "configuration"}``: every field (:func:`from_dict` makes the same codec)."""
        return {"name": self.name, "configuration": dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: dict) -> Codec:
        """The registered codec ``data`` names with the fields it holds (types checked)."""
        codec = REGISTRY.get(str(data.get("name"))) if isinstance(data, dict) else None
        if codec is None:
            raise ValueError(f"{data!r} does not name a codec of {', '.join(REGISTRY)}")
        config = data.get("configuration") or {}
        fields = {f.name: f for f in dataclasses.fields(codec)}
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise ValueError(f"codec {codec.name!r} has no field {unknown[0]!r}")
        values = {}
        for key, value in config.items():
            kind = type(getattr(codec, key))
            if kind is int and _int(value):
                value = int(value)
            elif type(value) is not kind:  # bool is not int here, nor int bool
                raise TypeError(f"{codec.name} {key} must be {kind.__name__}, got {value!r}")
            values[key] = value
        return replace(codec, **values)


def _is_chain(chain) -> bool:
    return (
        isinstance(chain, (list, tuple))
        and bool(chain)
        and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in chain)
    )


def _int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Raw(Codec):
    """The ``bytes`` codec alone: a chunk is the tile's bytes."""

    name = "none"
    gpu = GpuSupport(nvcomp=None)
    checks_content = False
    encoded_tiles_alias_input = True

    def max_encoded_bytes(self, nbytes):
        return nbytes

    def min_encoded_bytes(self, nbytes):
        return nbytes

    def _encoder(self):
        return lambda buffer: buffer

    def encode_tiles(self, tiles):
        # One buffer for all of them, as they are contiguous already; no buffer for no tiles (a
        # zero-row array cannot be cast to bytes when the shard is written).
        return ([tiles] if len(tiles) else []), [tiles.shape[1]] * len(tiles)

    def decode_into(self, src, dest):
        if len(src) != len(dest):
            raise CodecError(f"raw chunk holds {len(src)} bytes, expected {len(dest)}")
        dest[:] = np.frombuffer(src, np.uint8)


@dataclass(frozen=True)
class Zstd(Codec):
    """One standard zstd frame per chunk (python-zstandard, libzstd)."""

    name = "zstd"
    zarr_name = "zstd"
    level_range = (-7, 22)
    gpu = GpuSupport(nvcomp="zstd", max_chunk_bytes=16 << 20, levels=False)

    #: a content checksum after each frame (zarr's ``checksum``; the writer writes none)
    checksum: bool = False

    def max_encoded_bytes(self, nbytes):
        # libzstd's ZSTD_COMPRESSBOUND (python-zstandard does not expose it), + 4 for the
        # checksum zarr's ``checksum`` adds after the frame
        bound = nbytes + (nbytes >> 8) + (((128 << 10) - nbytes) >> 11 if nbytes < (128 << 10) else 0)
        return bound + 4 * self.checksum

    def _encoder(self):
        return self._compressor().compress

    def _compressor(self) -> zstandard.ZstdCompressor:
        contexts = _local.__dict__.setdefault("zstd-c", {})
        key = (self.level, self.checksum)
        context = contexts.get(key)
        if context is None:
            context = contexts[key] = zstandard.ZstdCompressor(level=self.level, write_checksum=self.checksum)
        return context

    def encode_tiles(self, tiles):
        # One call for all the tiles: libzstd compresses them one frame each, with the GIL
        # released for the whole batch (per-tile calls contend for the GIL on many-core hosts).
        # threads=1: the caller's thread does the work, the CPU backend already runs one task per
        # core.  Same parameters and one frame per tile, so the bytes equal compress()'s.
        count, tile_bytes = tiles.shape
        if count == 0:
            return [], []
        compressed = self._compressor().multi_compress_to_buffer(
            zstandard.BufferWithSegments(tiles, _segments(count, tile_bytes)), threads=1
        )
        chunks = [compressed[i] for i in range(len(compressed))]  # views into libzstd's buffers, no copy
        return chunks, list(map(len, chunks))

    def decode_into(self, src, dest):
        # python-zstandard's stream reader decodes straight into ``dest`` (a context reused per
        # thread): no bytes object per chunk and no copy out of it, 5-8 % more decode rate than
        # decompress() + copy on the 2-core box at 64 KiB chunks (~2 us of Python per call,
        # against ~10 us for numcodecs' decompress(src, dest), its argument checks).  Bounded:
        # at most ``len(dest)`` bytes are produced; a frame that declares another size is
        # refused before decoding; one more read must find nothing (no byte follows the frame,
        # or the next frame decodes to nothing, as for zarr-python), else it is refused.
        n = len(dest)
        try:
            declared = zstandard.frame_content_size(src)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd decode failed: {exc}") from None
        if declared not in (-1, zstandard.CONTENTSIZE_UNKNOWN, n):
            raise CodecError(f"zstd frame declares {declared} bytes, expected {n}")
        context = self._decompressor()
        got = 0
        try:
            with context.stream_reader(src, read_across_frames=True, closefd=False) as reader:
                while got < n:
                    count = reader.readinto(dest[got:])
                    if not count:
                        break
                    got += count
                if got == n:
                    try:
                        extra = reader.read(1)
                    except zstandard.ZstdError:
                        extra = b"?"
                    if extra:
                        raise CodecError("zstd: bytes follow the first frame")
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd decode failed: {exc} (expected {n} bytes)") from None
        if got != n:
            raise CodecError(f"zstd frame decodes to {got} bytes, expected {n}")

    def decode_chunks(self, src, offsets, nbytes, dest, absent=-1):
        # libzstd's GIL-free call for all of them where it takes them, else one call per chunk
        if not self._present_frames_into(src, offsets, nbytes, dest, absent):
            self._decode_each(src, offsets, nbytes, dest, absent)

    def _decode_each(self, src, offsets, nbytes, dest, absent):
        super().decode_chunks(src, offsets, nbytes, dest, absent)

    def decode_chunks_released(self, src, offsets, nbytes, dest, absent=-1):
        if self._present_frames_into(src, offsets, nbytes, dest, absent):
            return
        chunk_bytes = dest.shape[1] if dest.ndim == 2 else 0
        sizes = np.asarray(nbytes, dtype=np.int64)
        rows = np.flatnonzero(sizes != absent)
        runs = None
        if rows.size and chunk_bytes:
            runs = self._decoded_runs(src, np.asarray(offsets, dtype=np.int64)[rows], sizes[rows], chunk_bytes)
        if runs is None:  # refused, or nothing to decode: chunk by chunk, which names the chunk and the reason
            self._decode_each(src, offsets, nbytes, dest, absent)
            return
        every = len(rows) == dest.shape[0]
        for first, run in runs:
            if every:
                dest[first : first + len(run)] = run
            else:
                dest[rows[first : first + len(run)]] = run

    def decoded_chunks_released(self, src, offsets, nbytes, chunk_bytes, scratch=None):
        lengths = np.asarray(nbytes, dtype=np.int64)
        decoder = libzstd.frame_decoder()
        if lengths.size and decoder is not None:
            whole = np.empty((len(lengths), chunk_bytes), dtype=np.uint8) if scratch is None else scratch
            if self._frames_into(decoder, src, np.asarray(offsets, dtype=np.int64), lengths, whole):
                return whole
        runs = self._decoded_runs(src, offsets, nbytes, chunk_bytes)
        if runs is None:
            return None
        if len(runs) == 1:
            return runs[0][1]
        whole = np.empty((len(nbytes), chunk_bytes), dtype=np.uint8) if scratch is None else scratch
        for first, run in runs:
            whole[first : first + len(run)] = run
        return whole

    def prefix_saving(self, chunk_bytes, need):
        # the blocks after the one holding byte ``need`` (full ones, but the last)
        if self.checksum:
            return 0
        return max(0, chunk_bytes - -(-need // _BLOCK_CONTENT_MAX) * _BLOCK_CONTENT_MAX)

    def head_bytes(self, chunk_bytes):
        # a frame's first block, where more blocks follow it (see decoded_heads)
        return 0 if self.checksum or chunk_bytes <= _BLOCK_CONTENT_MAX else _BLOCK_CONTENT_MAX

    def heads_patch(self, src, offsets, nbytes, chunk_bytes):
        # Each chunk's frame, its first block made its last and its declared content that
        # block's 128 KiB, then a skippable frame over the rest of the chunk (RFC 8878, 3.1.2),
        # is a zstd frame of one head; patched so in the source itself (13 or 17 bytes a chunk,
        # put back after the call), chunks back to back decode in one libzstd call over the
        # concatenated frames (ZSTD_decompressDCtx skips skippable ones), 128 KiB apart, which
        # libzstd holds each frame to; nothing copied, no byte written but the heads.  A plane of
        # tiles two frames deep needs only the first frame's bytes, each chunk's first block.  A
        # first block of less content (nvCOMP's blocks are 64 KiB) fails libzstd's check and is
        # refused, as is any damage it finds.  Only in a writable source (a read buffer of the
        # reader's own, whose chunks no other thread reads meanwhile).  The bytes to patch are
        # worked out here once for a block's chunks, with NumPy over all of them: each of its
        # units then costs a few NumPy calls and the libzstd call, as a whole decode does (16
        # cores: working them out per unit made planes 5-45 % slower than whole chunks, the decode
        # threads queueing for the GIL).  Not for frames with a content checksum (a part goes
        # unchecked).
        head = self.head_bytes(chunk_bytes)
        lengths = np.asarray(nbytes, dtype=np.int64)
        if not head or libzstd.frame_decoder() is None or not lengths.size:
            return None
        data = np.frombuffer(src, dtype=np.uint8)
        if not data.flags.writeable:
            return None
        starts = np.asarray(offsets, dtype=np.int64)
        ends = starts + lengths
        cuts = _first_block_ends(data, starts, ends)
        if cuts is None or (ends - cuts < _SKIPPABLE_HEADER_BYTES).any():
            return None
        descriptor = data[starts + 4]
        field = int(_CONTENT_FIELD_BYTES[descriptor[0]])
        if field < 4 or (_CONTENT_FIELD_BYTES[descriptor] != field).any():  # one writer's headers
            return None
        if (_content_sizes(data, starts) != chunk_bytes).any():  # each a chunk's frame
            return None
        count = len(starts)
        size_at = (starts + _CONTENT_FIELD_AT[descriptor])[:, None] + np.arange(field)
        block_at = starts + _HEADER_BYTES[descriptor]
        skip_at = cuts[:, None] + np.arange(_SKIPPABLE_HEADER_BYTES)
        positions = np.concatenate((size_at, block_at[:, None], skip_at), axis=1)
        skippable = np.empty((count, 2), dtype="<u4")
        skippable[:, 0], skippable[:, 1] = _SKIPPABLE_MAGIC, ends - cuts - _SKIPPABLE_HEADER_BYTES
        values = np.concatenate(
            (
                np.broadcast_to(np.frombuffer(np.array(head, dtype="<u8").tobytes()[:field], np.uint8), (count, field)),
                (data[block_at] | 1)[:, None],  # the first block is the frame's last
                skippable.view(np.uint8).reshape(count, _SKIPPABLE_HEADER_BYTES),
            ),
            axis=1,
        )
        return HeadsPatch(head, chunk_bytes, starts, ends, starts[1:] == ends[:-1], positions, values)

    def decoded_heads(self, src, patch, first, stop, scratch=None):
        count = stop - first
        decoder = libzstd.frame_decoder()
        if decoder is None or count <= 0:
            return None
        whole = np.empty((count, patch.chunk_bytes), dtype=np.uint8) if scratch is None else scratch
        if whole.shape[1] != patch.chunk_bytes or whole.shape[0] < count or not whole.flags.c_contiguous:
            return None
        if not patch.follows[first : stop - 1].all():
            return None  # not back to back in this order: the frames would decode into other rows
        begin, end = int(patch.starts[first]), int(patch.ends[stop - 1])
        data = np.frombuffer(src, dtype=np.uint8)
        positions = patch.positions[first:stop].reshape(-1)
        saved = data[positions]
        expected = count * patch.head
        try:
            data[positions] = patch.values[first:stop].reshape(-1)
            decoded = decoder.decode_frames(data.ctypes.data + begin, end - begin, whole.ctypes.data, expected)
        finally:
            data[positions] = saved
        if decoded != expected:
            return None
        rows = np.ndarray((count, patch.chunk_bytes), np.uint8, whole, 0, (patch.head, 1))
        rows.flags.writeable = False
        return rows

    def decoded_prefixes(self, src, offsets, nbytes, chunk_bytes, need, scratch=None, min_saved=1):
        # A zstd frame is decoded block by block (RFC 8878, 3.1.1.2: up to 128 KiB of content
        # each), so a chunk of several blocks, of which a read needs the first rows only (a plane
        # of tiles several frames deep), is decoded as far as the block holding its last needed
        # byte: a frame's first rows come from its first blocks.  Not for frames with a content
        # checksum: it covers the whole content, so a frame decoded in part goes unchecked.
        if self.prefix_saving(chunk_bytes, need) < max(1, min_saved):
            return None
        decoder = libzstd.frame_decoder()
        if decoder is None or not decoder.decodes_prefixes:
            return None
        starts = np.asarray(offsets, dtype=np.int64)
        begins, ends = starts.tolist(), (starts + np.asarray(nbytes, dtype=np.int64)).tolist()
        data = np.frombuffer(src, dtype=np.uint8)
        if not begins or not _declared_rows(data, begins, ends, chunk_bytes):
            return None
        whole = np.empty((len(begins), chunk_bytes), dtype=np.uint8) if scratch is None else scratch
        if whole.shape[1] != chunk_bytes or whole.shape[0] < len(begins) or not whole.flags.c_contiguous:
            return None
        view, source, target = data.data, data.ctypes.data, whole.ctypes.data
        skipped = -(-need // _BLOCK_CONTENT_MAX) - 1  # blocks that cannot hold all of ``need``
        decoded = 0
        for row, (begin, end) in enumerate(zip(begins, ends)):
            out = decoder.decode_prefix(
                source + begin, _block_ends(view, begin, end, skipped), target + row * chunk_bytes, chunk_bytes, need
            )
            if out < need:
                return None
            decoded += out
        return whole, decoded

    def _present_frames_into(self, src, offsets, nbytes, dest: np.ndarray, absent: int) -> bool:
        """:meth:`_frames_into` for the chunks whose ``nbytes`` is not ``absent``, each into its own row."""
        decoder = libzstd.frame_decoder()
        if decoder is None or dest.ndim != 2:
            return False
        sizes = np.asarray(nbytes, dtype=np.int64)
        rows = np.flatnonzero(sizes != absent)
        if not rows.size:
            return True
        return self._frames_into(decoder, src, np.asarray(offsets, dtype=np.int64)[rows], sizes[rows], dest, rows)

    @staticmethod
    def _frames_into(
        decoder: libzstd.FrameDecoder, src, starts: np.ndarray, lengths: np.ndarray, dest: np.ndarray, rows=None
    ) -> bool:
        """Chunk ``i`` (bytes ``starts[i]`` .. ``+ lengths[i]`` of ``src``) decoded into row
        ``rows[i]`` of ``dest`` (default: row ``i``; rows ascending) by ``decoder``
        (:mod:`.libzstd`), one GIL-free call per run of chunks that lie back to back in ``src``
        and in ``dest``; False where a check or libzstd refused (rows may then hold anything: the
        caller decodes them again another way, which names what is wrong).

        libzstd decodes a run as concatenated frames and holds each to the content size its
        header declares, so each chunk must start with a frame that declares exactly one row's
        size (:func:`_declared_rows`): a frame of another or no declared size would shift the
        rows after it.  That is enough for every row to get its own chunk's bytes, without the
        walk of each chunk's block headers the other ways run (:func:`_frame_sizes`, which cost
        16 decode threads a fifth of their GIL time): where a chunk's frame ends before its
        extent, libzstd reads the bytes left as the next frame (refused unless they are frames
        of no content, which add no bytes: zarr-python's decode takes those too); where it runs
        past its extent, the next chunk's frame is not where libzstd reads on, or the run's end
        cuts the frame (refused); a run's rows are its capacity (never more written)."""
        row_bytes = dest.shape[1] if dest.ndim == 2 else 0
        if not row_bytes or dest.dtype != np.uint8 or not dest.flags.c_contiguous:
            return False
        count = len(starts)
        if not count:
            return True
        data = np.frombuffer(src, dtype=np.uint8)
        begins = starts.tolist()
        ends = (starts + lengths).tolist()
        places = list(range(count)) if rows is None else rows.tolist()
        if LIBZSTD_WALKS_BLOCKS:  # the block walk too, as the other ways (an A/B switch)
            if (_frame_sizes(data, starts, starts + lengths) != lengths).any():
                return False
        if not _declared_rows(data, begins, ends, row_bytes):
            return False
        if places[0] < 0 or places[-1] >= dest.shape[0]:
            return False
        # a run ends where the next chunk does not follow it in src, or its row does not follow
        source, target, first = data.ctypes.data, dest.ctypes.data, 0
        for i in range(1, count + 1):
            if i < count and begins[i] == ends[i - 1] and places[i] == places[i - 1] + 1:
                continue
            expected, begin, row = (i - first) * row_bytes, begins[first], places[first]
            decoded = decoder.decode_frames(source + begin, ends[i - 1] - begin, target + row * row_bytes, expected)
            if decoded != expected:
                return False
            first = i
        return True

    def _decoded_runs(self, src, offsets, nbytes, chunk_bytes) -> list[tuple[int, np.ndarray]] | None:
        # python-zstandard's multi_decompress_to_buffer decodes every chunk with the GIL released
        # for the whole batch (libzstd's ZSTD_decompressDCtx per chunk, each into a capacity of one
        # chunk and checked to fill it exactly).  Beside a thread busy in Python, 64 KiB chunks:
        # 107 ms per 16 MiB against 1.35 s for decode_chunks; alone 15.8 ms against 11.9 (the
        # 2-core VM).  The checks run over all chunks at once (NumPy), not in Python per chunk:
        # with 16 threads decoding, per-chunk Python was what they queued for.  Each chunk must be
        # exactly one frame (the batch would ignore bytes after it); its size is checked by the
        # batch itself.  The batch decodes into buffers sized by the compressed bytes (rounded up
        # to a power of two), a new one whenever the next chunk does not fit: chunks compressed
        # more than 2:1 would land in several buffers, copied into one by the caller, so the
        # segments it is given are lengthened until their bytes size one buffer for all
        # (_one_buffer_lengths).  Returned: ``(first chunk, its run)`` per buffer.
        starts = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(nbytes, dtype=np.int64)
        if not lengths.size or (lengths < 0).any():
            return None
        data = np.frombuffer(src, dtype=np.uint8)
        if (_frame_sizes(data, starts, starts + lengths) != lengths).any():
            return None
        segments = np.empty((len(lengths), 2), dtype=np.uint64)  # (offset, length) pairs
        segments[:, 0] = starts
        segments[:, 1] = _one_buffer_lengths(starts, lengths, data.size, len(lengths) * chunk_bytes)
        try:
            decoded = self._decompressor().multi_decompress_to_buffer(
                zstandard.BufferWithSegments(src, segments.tobytes()),
                decompressed_sizes=_sizes(len(lengths), chunk_bytes),
                threads=1,
            )
        except (zstandard.ZstdError, ValueError, IndexError):
            return None
        return _runs(decoded, len(lengths), chunk_bytes)

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        context = getattr(_local, "zstd_d", None)
        if context is None:
            context = _local.zstd_d = zstandard.ZstdDecompressor()
        return context

    def compressors(self):
        return [ZstdCodec(level=self.level, checksum=self.checksum).to_dict()]

    @classmethod
    def _from_config(cls, config, typesize):
        level, checksum = config.get("level", 0), config.get("checksum", False)  # zarr's defaults
        if not _int(level) or not isinstance(checksum, bool):
            return None
        return cls(level=int(level), typesize=typesize, checksum=checksum)


_ZSTD_MAGIC = 0xFD2FB528
_DICTIONARY_ID_BYTES = np.array([0, 1, 2, 4], dtype=np.int64)
_CONTENT_SIZE_BYTES = np.array([0, 2, 4, 8], dtype=np.int64)
#: block headers walked per chunk at most; a chunk of more blocks is left to the per-chunk decode
_MAX_BLOCKS = 256


def _frame_header_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per frame header descriptor byte (RFC 8878, 3.1.1.1.1): the header's size from the
    frame's start (magic, descriptor, window, dictionary id, content size; -1: the reserved bit
    set), the checksum's size after the last block, and the content size field's bytes (0: none
    declared) and offset from the frame's start (3.1.1.1.4)."""
    descriptor = np.arange(256, dtype=np.int64)
    single_segment = (descriptor >> 5) & 1
    content_size_flag = descriptor >> 6
    content_size = np.where(content_size_flag == 0, single_segment, _CONTENT_SIZE_BYTES[content_size_flag])
    content_at = 5 + (1 - single_segment) + _DICTIONARY_ID_BYTES[descriptor & 3]
    header = content_at + content_size
    return np.where((descriptor >> 3) & 1 == 1, -1, header), 4 * ((descriptor >> 2) & 1), content_size, content_at


_HEADER_BYTES, _CHECKSUM_BYTES, _CONTENT_FIELD_BYTES, _CONTENT_FIELD_AT = _frame_header_tables()
_CONTENT_FIELD_BYTES_LIST, _CONTENT_FIELD_AT_LIST = _CONTENT_FIELD_BYTES.tolist(), _CONTENT_FIELD_AT.tolist()
#: added to a content size field's value, by its bytes: the 2-byte field counts from 256
_CONTENT_FIELD_BIAS = [0, 0, 256, 0, 0, 0, 0, 0, 0]

#: whether the libzstd batch walks each chunk's block headers as well as reading its frame
#: header (see Zstd._frames_into); a switch for A/B runs
LIBZSTD_WALKS_BLOCKS = False
#: up to this many chunks the frame headers are read in plain Python, beyond it in NumPy (2-core
#: VM, 64 KiB chunks: Python 2.3 / 9.3 / 16 / 31 us for 4 / 16 / 32 / 64 chunks, NumPy 23-27 us
#: whatever the count)
_HEADERS_IN_PYTHON_MAX = 40


def _declared_rows(data: np.ndarray, begins: list[int], ends: list[int], row_bytes: int) -> bool:
    """Whether every chunk ``data[begins[i]:ends[i]]`` starts with a zstd frame header, inside
    the chunk, that declares ``row_bytes`` of content."""
    size = data.size
    if len(begins) <= _HEADERS_IN_PYTHON_MAX:
        view = data.data
        for begin, end in zip(begins, ends):
            if begin < 0 or end > size or end - begin < 9 or _WORD(view, begin)[0] != _ZSTD_MAGIC:
                return False
            descriptor = view[begin + 4]
            field, header = _CONTENT_FIELD_BYTES_LIST[descriptor], _HEADER_BYTES_LIST[descriptor]
            if not field or header < 0 or begin + header + 3 > end:
                return False
            at = begin + _CONTENT_FIELD_AT_LIST[descriptor]
            if int.from_bytes(view[at : at + field], "little") + _CONTENT_FIELD_BIAS[field] != row_bytes:
                return False
        return True
    starts, stops = np.asarray(begins, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    if starts.min() < 0 or stops.max() > size or (stops - starts < 9).any():
        return False
    words = np.ndarray((size - 3,), dtype="<u4", buffer=data, offset=0, strides=(1,))
    header = _HEADER_BYTES[data[starts + 4]]
    if (words[starts] != _ZSTD_MAGIC).any() or (header < 0).any() or (starts + header + 3 > stops).any():
        return False
    return bool((_content_sizes(data, starts) == row_bytes).all())


def _content_sizes(data: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The content size each zstd frame at ``starts`` declares in its header, -1 where it
    declares none; over all frames at once, a few NumPy calls per header layout among them (one,
    mostly: one writer's frames).  The headers must lie in ``data`` (as :func:`_frame_sizes`
    checks: the field ends before the frame's first block)."""
    descriptor = data[starts + 4]
    sizes = np.full(len(starts), -1, dtype=np.int64)
    one = (descriptor == descriptor[0]).all()
    layouts = [int(descriptor[0])] if one else np.flatnonzero(np.bincount(descriptor)).tolist()
    for layout in layouts:
        field = int(_CONTENT_FIELD_BYTES[layout])
        if not field:
            continue
        at = starts + int(_CONTENT_FIELD_AT[layout])
        # the little-endian field at every byte offset (a view, no copy)
        fields = np.ndarray((data.size - field + 1,), dtype=f"<u{field}", buffer=data, strides=(1,))
        chosen = slice(None) if len(layouts) == 1 else descriptor == layout
        value = fields[at[chosen]].astype(np.int64)  # 8-byte sizes past 2**63: negative, never a chunk's size
        sizes[chosen] = value + _CONTENT_FIELD_BIAS[field]
    return sizes


#: up to this many chunks the frame walk goes chunk by chunk in Python, beyond it over all
#: chunks at once in NumPy (see _frame_sizes)
_WALK_BY_CHUNK_MAX = 64


def _frame_sizes(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The compressed size of the zstd frame that starts each chunk ``data[starts[i]:ends[i]]``
    (RFC 8878, 3.1.1: its header, its blocks up to the last, its checksum), as libzstd's
    ZSTD_findFrameCompressedSize, which python-zstandard does not expose; -1 where the chunk is
    no zstd frame, its blocks run past its end or it holds more than _MAX_BLOCKS blocks.

    It runs on the decode threads under the GIL (16 threads decoding 4 MiB shards asked for it
    ~1,000 times a second), so it takes the cheaper of two walks: NumPy costs a few calls per
    block header over all chunks at once, Python a few steps per block of each chunk.  The 2-core
    VM, one 4 MiB shard of camera tiles: 64 chunks of one block 29 / 31 us (NumPy / Python), 16
    of three blocks 52 / 12, 4 of eight 84 / 8, 256 of one 61 / 211."""
    if len(starts) <= _WALK_BY_CHUNK_MAX:
        return np.array(_frame_sizes_by_chunk(data, starts, ends), dtype=np.int64)
    return _frame_sizes_at_once(data, starts, ends)


_HEADER_BYTES_LIST, _CHECKSUM_BYTES_LIST = _HEADER_BYTES.tolist(), _CHECKSUM_BYTES.tolist()
_WORD = struct.Struct("<I").unpack_from


def _frame_sizes_by_chunk(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[int]:
    """:func:`_frame_sizes` one chunk after the other (a little-endian word read per block
    header)."""
    view = data.data  # a memoryview of the uint8 bytes: items are ints
    size, sizes = len(view), []
    for begin, end in zip(starts.tolist(), ends.tolist()):
        frame = -1
        if begin >= 0 and end <= size and end - begin >= 9 and _WORD(view, begin)[0] == _ZSTD_MAGIC:
            for position, last in _blocks(view, begin, end):
                if last:
                    frame_end = position + _CHECKSUM_BYTES_LIST[view[begin + 4]]
                    frame = frame_end - begin if frame_end <= end else -1
        sizes.append(frame)
    return sizes


def _blocks(view: memoryview, begin: int, end: int) -> Iterator[tuple[int, bool]]:
    """``(where it ends, whether it is the last)`` of each block of the zstd frame whose magic
    starts ``view[begin:end]``, walked as far as the caller takes them (at most _MAX_BLOCKS); it
    stops before a block whose header lies past ``end`` and at one of a reserved type, and gives
    nothing for a header with its reserved bit set."""
    header_bytes = _HEADER_BYTES_LIST[view[begin + 4]]
    position = begin + header_bytes
    for _ in range(_MAX_BLOCKS if header_bytes > 0 else 0):
        if position + 3 > end:
            return
        header = _WORD(view, position - 1)[0] >> 8  # its 3 bytes (no chunk starts with one)
        kind = header & 6
        if kind == 6:  # a reserved block type: no frame
            return
        position += 4 if kind == 2 else 3 + (header >> 3)  # an RLE block: one byte
        yield position, bool(header & 1)
        if header & 1:  # the last block
            return


def _frame_sizes_at_once(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """:func:`_frame_sizes` over all chunks at once: the header's fields from tables per
    descriptor byte; each block header one lookup in the little-endian words at every byte
    offset, over the chunks whose frames have not ended yet."""
    count = len(starts)
    sizes = np.full(count, -1, dtype=np.int64)
    # the smallest frame: magic, descriptor, one header byte more, one block header
    chunk = np.flatnonzero((starts >= 0) & (ends <= data.size) & (ends - starts >= 9))
    if not chunk.size:
        return sizes
    # the 4-byte little-endian word at every byte offset (a view, no copy): ``words[i]`` is
    # bytes i..i+3; all reads below lie inside a chunk, so within the data
    words = np.ndarray((data.size - 3,), dtype="<u4", buffer=data, offset=0, strides=(1,))
    begin, end = starts[chunk], ends[chunk]
    descriptor = data[begin + 4]
    header_bytes = _HEADER_BYTES[descriptor]
    frame = (words[begin] == _ZSTD_MAGIC) & (header_bytes > 0)
    if np.count_nonzero(frame) < frame.size:
        chunk, begin, end, header_bytes, descriptor = (a[frame] for a in (chunk, begin, end, header_bytes, descriptor))
    position = begin + header_bytes
    checksum = _CHECKSUM_BYTES[descriptor]
    for _ in range(_MAX_BLOCKS):
        whole = position + 3 <= end  # the block header lies inside the chunk
        if np.count_nonzero(whole) < whole.size:
            chunk, begin, end, position, checksum = (a[whole] for a in (chunk, begin, end, position, checksum))
            if not chunk.size:
                break
        header = (words[position - 1] >> 8).astype(np.int64)  # its 3 bytes (no chunk starts with one)
        kind = _BLOCK_KIND[header & 7]  # 0: more blocks follow, 1: the last, 2: a reserved type (no frame)
        position += 3 + np.where(header & 6 == 2, 1, header >> 3)  # an RLE block: one byte
        if np.count_nonzero(kind) == 0:
            continue
        last = kind == 1
        frame_end = position[last] + checksum[last]
        sizes[chunk[last]] = np.where(frame_end <= end[last], frame_end - begin[last], -1)
        more = kind == 0
        chunk, begin, end, position, checksum = (a[more] for a in (chunk, begin, end, position, checksum))
        if not chunk.size:
            break
    return sizes


#: the most content one zstd block holds (RFC 8878, 3.1.1.2.3: Block_Maximum_Size)
_BLOCK_CONTENT_MAX = 128 << 10


def _block_ends(view: memoryview, begin: int, end: int, skipped: int) -> Iterator[int]:
    """Where the blocks of the zstd frame at ``view[begin:end]`` (its header checked already:
    :func:`_declared_rows`) end, from ``begin``, one after the other (the first ``skipped`` not
    given), walked as far as the caller takes them (:func:`_blocks`); it stops before a block
    that runs past ``end``, and gives nothing for a frame with a content checksum (see
    Zstd.decoded_prefixes)."""
    if _CHECKSUM_BYTES_LIST[view[begin + 4]]:
        return
    for block, (position, _) in enumerate(_blocks(view, begin, end)):
        if position > end:
            return
        if block >= skipped:
            yield position - begin


def _first_block_ends(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """Where the first block of the zstd frame that starts each chunk ``data[starts[i]:ends[i]]``
    ends, over all chunks at once; None where a chunk is no zstd frame, has a content checksum,
    its first block is its last (or of a reserved type) or runs past the chunk's end."""
    if starts.min() < 0 or ends.max() > data.size or (ends - starts < 9).any():
        return None
    words = np.ndarray((data.size - 3,), dtype="<u4", buffer=data, offset=0, strides=(1,))
    descriptor = data[starts + 4]
    header = _HEADER_BYTES[descriptor]
    if (words[starts] != _ZSTD_MAGIC).any() or (header < 0).any() or _CHECKSUM_BYTES[descriptor].any():
        return None
    position = starts + header
    if (position + 3 > ends).any():
        return None
    block = (words[position - 1] >> 8).astype(np.int64)  # its 3 bytes (no chunk starts with one)
    if (_BLOCK_KIND[block & 7] != 0).any():  # the last block, or of a reserved type
        return None
    cuts = position + 3 + np.where(block & 6 == 2, 1, block >> 3)  # an RLE block: one byte
    return None if (cuts > ends).any() else cuts


#: a skippable frame's magic (any of 0x184D2A50-5F) and header: magic, then the bytes it skips (RFC 8878, 3.1.2)
_SKIPPABLE_MAGIC = 0x184D2A50
_SKIPPABLE_HEADER_BYTES = 8

#: per block header's low 3 bits (last-block flag, block type): 0 more blocks follow, 1 the last
#: block, 2 a reserved block type
_BLOCK_KIND = np.array([0, 1, 0, 1, 0, 1, 2, 2], dtype=np.int8)


def _one_buffer_lengths(starts: np.ndarray, lengths: np.ndarray, size: int, decoded: int) -> np.ndarray:
    """Segment lengths for python-zstandard's batch with which it decodes all ``decoded`` bytes
    into one buffer: it allocates the first one by the segments' total, rounded up to a power of
    two (c-ext/decompressor.c, ``decompress_worker``), so segments are lengthened, the first ones
    first and each at most to the end of the source (``size`` bytes), until that total rounds up
    to at least ``decoded``.  A lengthened segment takes in bytes after its frame, which the
    batch leaves alone: it stops at the frame's end (``ZSTD_decompressStream`` into exactly the
    chunk's size), and _frame_sizes checked that each frame ends where its chunk does.  Where
    the source has too few bytes after the frames (chunks compressed far more than 2:1, few per
    batch), ``lengths`` as they are."""
    target = (1 << max(0, decoded - 1).bit_length()) // 2 + 1  # rounds up to 2**k >= decoded
    missing = target - int(lengths.sum())
    if missing <= 0:
        return lengths
    if int(starts[0]) + int(lengths[0]) + missing <= size:  # the first segment alone (mostly): no NumPy pass
        lengthened = lengths.copy()
        lengthened[0] += missing
        return lengthened
    room = size - (starts + lengths)  # bytes after each segment, to the end of the source
    before = np.concatenate(([0], np.cumsum(room)[:-1]))
    added = np.clip(missing - before, 0, room)
    return lengths + added if int(added.sum()) >= missing else lengths


@functools.lru_cache(maxsize=64)
def _sizes(count: int, nbytes: int) -> bytes:
    """``multi_decompress_to_buffer``'s decompressed sizes: ``count`` uint64 of ``nbytes``."""
    return np.full(count, nbytes, dtype=np.uint64).tobytes()


def _runs(decoded, count: int, nbytes: int) -> list[tuple[int, np.ndarray]] | None:
    """The ``count`` segments of ``nbytes`` of a ``BufferWithSegmentsCollection`` as one array
    per buffer they lie in, back to back: ``(first segment, (segments, nbytes) array over its
    memory)``, each array keeping ``decoded`` (the memory's owner) alive; None if they do not lie
    so.  A buffer starts where a segment's offset is 0; its segments follow at ``nbytes`` steps."""
    if decoded.size() != count * nbytes or len(decoded) != count:
        return None
    if decoded[count - 1].offset == (count - 1) * nbytes:
        firsts = [0]  # one buffer: a segment in a later one would lie nearer its own buffer's start
    else:
        within = np.fromiter((decoded[j].offset for j in range(count)), dtype=np.int64, count=count)
        starting = np.flatnonzero(within == 0)
        if not starting.size or starting[0] != 0:
            return None
        run_first = starting[np.cumsum(within == 0) - 1]
        if (within != (np.arange(count) - run_first) * nbytes).any():
            return None
        firsts = starting.tolist()
    bounds = [*firsts, count]
    runs = []
    for first, stop in zip(bounds, bounds[1:]):
        address = np.frombuffer(cast(Any, decoded[first]), dtype=np.uint8).ctypes.data
        runs.append((first, np.asarray(_Memory(decoded, address, (stop - first, nbytes)))))
    return runs


class _Memory:
    """Memory at ``address`` owned by ``owner``, as NumPy takes it (``__array_interface__``): the
    array made from it holds this object, so the owner lives as long as the array."""

    def __init__(self, owner, address: int, shape: tuple[int, ...]):
        self.owner = owner
        self.__array_interface__ = {"data": (address, False), "shape": shape, "typestr": "|u1", "version": 3}


@functools.lru_cache(maxsize=64)
def _segments(count: int, nbytes: int) -> bytes:
    """``BufferWithSegments``' (offset, length) uint64 pairs of ``count`` back-to-back pieces of ``nbytes``."""
    segments = np.empty((count, 2), dtype=np.uint64)
    segments[:, 0] = np.arange(count, dtype=np.uint64) * np.uint64(nbytes)
    segments[:, 1] = nbytes
    return segments.tobytes()


_SHUFFLES = {"noshuffle": numcodecs.blosc.NOSHUFFLE, "shuffle": numcodecs.blosc.SHUFFLE}
_SHUFFLES["bitshuffle"] = numcodecs.blosc.BITSHUFFLE


@dataclass(frozen=True)
class Blosc(Codec):
    """Blosc 1 (numcodecs' Blosc, as zarr-python's BloscCodec encodes), any compressor and shuffle:
    read, not written (the writer writes :class:`BloscLz4`)."""

    name = "blosc"
    zarr_name = "blosc"
    writable = False
    level_range = (0, 9)
    max_chunk_bytes = _MAX_CHUNK_BYTES - 16  # blosc 1 takes at most INT_MAX - its header
    gpu_unsupported_reason = "nvCOMP cannot produce a Blosc bitstream"
    _HEADER: ClassVar[int] = 16  # BLOSC_MAX_OVERHEAD: a stored (incompressible) chunk is its input plus the header

    cname: str = "zstd"
    shuffle: str = "noshuffle"
    blocksize: int = 0

    def __post_init__(self):
        if self.shuffle not in _SHUFFLES:
            raise ValueError(f"blosc shuffle must be one of {', '.join(_SHUFFLES)}, got {self.shuffle!r}")
        if self.cname not in numcodecs.blosc.list_compressors():
            raise ValueError(
                f"blosc cname must be one of {', '.join(numcodecs.blosc.list_compressors())}, got {self.cname!r}"
            )

    def max_encoded_bytes(self, nbytes):
        return nbytes + self._HEADER

    def min_encoded_bytes(self, nbytes):
        return self._HEADER

    def _encoder(self):
        # typesize passed explicitly: the tiles reach the codec as uint8 views
        cname, level, shuffle = self.cname.encode(), self.level, _SHUFFLES[self.shuffle]
        blocksize, typesize, compress = self.blocksize, self.typesize, numcodecs.blosc.compress
        return lambda buffer: compress(buffer, cname, level, shuffle, blocksize, typesize)

    def decode_into(self, src, dest):
        n = len(dest)
        if len(src) < self._HEADER:
            raise CodecError(f"{len(src)} bytes are shorter than a blosc header ({self._HEADER})")
        # the header's sizes, checked before blosc trusts them (it reads cbytes, writes nbytes)
        declared, _, cbytes = struct.unpack_from("<III", src, 4)
        if declared != n:
            raise CodecError(f"blosc header declares {declared} bytes, expected {n}")
        if cbytes != len(src):
            raise CodecError(f"blosc header declares {cbytes} compressed bytes, the chunk holds {len(src)}")
        try:
            numcodecs.blosc.decompress(src, dest)
        except (RuntimeError, ValueError) as exc:
            raise CodecError(f"blosc decode failed: {exc}") from None

    def compressors(self):
        codec = BloscCodec(
            cname=cast(Any, self.cname),
            clevel=self.level,
            shuffle=cast(Any, self.shuffle),
            typesize=self.typesize,
            blocksize=self.blocksize,
        )
        return [codec.to_dict()]

    @classmethod
    def _from_config(cls, config, typesize):
        # zarr-python's defaults for what the configuration leaves out
        cname, level = config.get("cname", "zstd"), config.get("clevel", 5)
        shuffle, blocksize = config.get("shuffle", "noshuffle"), config.get("blocksize", 0)
        declared = config.get("typesize", typesize)
        if not all(_int(v) for v in (level, blocksize, declared)) or not declared > 0:
            return None
        try:
            return cls(cname=cname, level=int(level), shuffle=shuffle, blocksize=int(blocksize), typesize=int(declared))
        except ValueError:  # another cname or shuffle than this class's
            return None


@dataclass(frozen=True)
class BloscLz4(Blosc):
    """Blosc 1 with LZ4 and byte shuffle: the blosc the writer writes."""

    name = "blosc-lz4"
    writable = True

    cname: str = "lz4"
    shuffle: str = "shuffle"
    blocksize: int = 0

    def __post_init__(self):
        if (self.cname, self.shuffle, self.blocksize) != ("lz4", "shuffle", 0):
            raise ValueError("blosc-lz4 is cname 'lz4', shuffle 'shuffle', blocksize 0 (Blosc is any other)")


@dataclass(frozen=True)
class Gzip(Codec):
    """Gzip (or zlib) streams, as zarr-python's GzipCodec writes them: read, not written."""

    name = "gzip"
    zarr_name = "gzip"
    writable = False
    level_range = (0, 9)
    gpu_unsupported_reason = "nvCOMP's deflate is not bound here"

    def max_encoded_bytes(self, nbytes):
        # zlib's deflateBound plus the gzip header and trailer (with room for optional header fields)
        return nbytes + (nbytes >> 12) + (nbytes >> 14) + (nbytes >> 25) + 13 + 18 + 64

    def _encoder(self):
        level = self.level

        def encode(buffer):
            compressor = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
            return compressor.compress(buffer) + compressor.flush()

        return encode

    def decode_into(self, src, dest):
        n = len(dest)
        decompressor = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header
        try:
            data = decompressor.decompress(src, n)  # bounded: never more than one chunk
        except zlib.error as exc:
            raise CodecError(f"gzip decode failed: {exc}") from None
        if len(data) != n or not decompressor.eof or decompressor.unconsumed_tail or decompressor.unused_data:
            raise CodecError(f"gzip data does not decode to exactly {n} bytes")
        dest[:] = np.frombuffer(data, np.uint8)

    def compressors(self):
        return [GzipCodec(level=self.level).to_dict()]

    @classmethod
    def _from_config(cls, config, typesize):
        level = config.get("level", 5)  # zarr-python's default
        return cls(level=int(level), typesize=typesize) if _int(level) else None


@dataclass(frozen=True)
class Opaque(Codec):
    """An inner chain that no registered codec is, kept as zarr.json holds it (``chain``, JSON):
    what :meth:`ShardSpec.from_metadata(meta, opaque=True) <napari_tileshard.format.ShardSpec.from_metadata>`
    gives where only the shards' indexes are read (the inspector).  Never registered, never decoded."""

    name = "opaque"
    writable = False
    checks_content = False
    gpu_unsupported_reason = "not a codec decoded here"

    chain: str = "[]"

    def max_encoded_bytes(self, nbytes):
        return 2**63 - 1

    def min_encoded_bytes(self, nbytes):
        return 0

    def decode_into(self, src, dest):
        raise CodecError(f"inner codecs {self.zarr_codecs(None)} are not decoded natively")

    def zarr_codecs(self, endian: str | None = "little") -> list[dict]:
        return json.loads(self.chain)


#: every codec, by name, in the order :func:`from_zarr_codecs` tries them (the writable form first)
REGISTRY: dict[str, Codec] = {codec.name: codec for codec in (Zstd(), Raw(), BloscLz4(), Blosc(), Gzip())}
#: the codecs the writer offers (the CLI's and the widget's choices)
CODECS: dict[str, Codec] = {name: codec for name, codec in REGISTRY.items() if codec.writable}


def names() -> tuple[str, ...]:
    """The writable codecs' names."""
    return tuple(CODECS)


def get(codec) -> Codec:
    """The writable codec ``codec`` names (a writable Codec is returned as it is): the writer's
    one lookup, at its edge."""
    found = codec if isinstance(codec, Codec) else CODECS.get(codec) if isinstance(codec, str) else None
    if found is not None and found.writable:
        return found
    name = codec.name if isinstance(codec, Codec) else codec
    read_only = f" ({name} is read, not written)" if name in REGISTRY else ""
    raise ValueError(f"codec {name!r} is not one of {', '.join(CODECS)}{read_only}")


def from_zarr_codecs(chain, dtype) -> Codec | None:
    """The registered codec, configured, that this inner codec chain is (None: none is)."""
    for codec in REGISTRY.values():
        found = codec.from_zarr_codecs(chain, dtype)
        if found is not None:
            return found
    return None


def chain_refusal(chain) -> str:
    """Why :func:`from_zarr_codecs` finds no codec for ``chain`` (a sentence)."""
    names = [c.get("name") if isinstance(c, dict) else c for c in chain] if isinstance(chain, (list, tuple)) else chain
    if not _is_chain(chain) or chain[0]["name"] != "bytes" or len(chain) > 2:
        return f"inner codecs {names} are not bytes + at most one compressor"
    if not any(c.zarr_name == chain[1]["name"] for c in REGISTRY.values()):
        return f"compressor {chain[1]['name']!r} is not decoded natively"
    return f"compressor configuration {chain[1].get('configuration')!r} is not decoded natively"


def gpu_support(codec) -> str | None:
    """Why the GPU backend refuses to write ``codec``, or None when it encodes it."""
    codec = get(codec)
    if codec.gpu is not None:
        return None
    supported = ", ".join(c.name for c in CODECS.values() if c.gpu is not None)
    return (
        f"codec {codec.name!r} is not supported by the GPU backend: {codec.gpu_unsupported_reason} "
        f"(the GPU backend supports {supported}); use backend='cpu' or 'auto'"
    )


def gpu_decode_support(codec: Codec, chunk_bytes: int) -> str | None:
    """Why the GPU cannot decode chunks of ``chunk_bytes`` of ``codec``, or None when nvCOMP (or
    a copy) does; says nothing about the machine."""
    if codec.gpu is None:
        supported = ", ".join(c.name for c in REGISTRY.values() if c.gpu is not None)
        return f"nvCOMP does not decode {codec.name!r} chunks (the GPU reader decodes {supported})"
    if codec.gpu.nvcomp and chunk_bytes > codec.gpu.max_chunk_bytes:
        return (
            f"chunks of {chunk_bytes} bytes are larger than nvCOMP's {codec.gpu.nvcomp} limit "
            f"({codec.gpu.max_chunk_bytes} bytes)"
        )
    return None
