"""Chunk codecs: the one module that knows a codec's levels, bounds, bitstream and Zarr metadata.

Each codec is a small frozen dataclass, as zarr-python's are, whose fields are its configuration
(``level``, ``typesize``); :data:`CODECS` holds one default instance per name and
:meth:`Codec.configure` makes the one a writer uses.  Backends, ``zarr.json``, verify and the CLI
ask the codec object instead of comparing names, so a new codec is one class here (plus tests).
The GPU backend is described, not imported: ``gpu`` says what nvCOMP does for the codec.
"""

from __future__ import annotations

import functools
import re
import struct
import threading
from dataclasses import dataclass, replace
from typing import ClassVar

import numcodecs.blosc
import numpy as np
import zstandard
from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec

_MAX_CHUNK_BYTES = 2**31 - 1  # the Layout's tile limit
_local = threading.local()  # zstandard contexts are not thread-safe: one per thread and level


class CodecError(ValueError):
    """A chunk that does not decode to exactly one chunk of the expected size; says why."""


@dataclass(frozen=True)
class GpuSupport:
    """What the GPU backend does for a codec."""

    nvcomp: str | None  # nvCOMP's batched algorithm; None: the GPU stores tiles as they are
    max_chunk_bytes: int = _MAX_CHUNK_BYTES
    levels: bool = True  # False: nvCOMP has no level, the level is recorded but not applied


@dataclass(frozen=True)
class Codec:
    """A chunk codec: ``bytes`` serialisation (little endian) plus at most one compressor."""

    name: ClassVar[str]
    #: inclusive range of ``level``; None: the level is accepted and ignored
    level_range: ClassVar[tuple[int, int] | None] = None
    max_chunk_bytes: ClassVar[int] = _MAX_CHUNK_BYTES
    #: None: the GPU backend cannot produce this codec's bitstream (``gpu_unsupported_reason`` says why)
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

    def max_encoded_bytes(self, nbytes: int) -> int:
        """Worst-case encoded size of one chunk of ``nbytes``."""
        raise NotImplementedError

    def min_encoded_bytes(self, nbytes: int) -> int:
        return 1

    def encode(self, buffer):
        """One chunk's encoded bytes (compressors release the GIL: backends call this from threads)."""
        return self._encoder()(buffer)

    def _encoder(self):
        """buffer -> encoded bytes, for the calling thread (fetched once per batch of tiles)."""
        raise NotImplementedError

    #: True when :meth:`encode_tiles` may return views of its input (the caller must then keep the
    #: tiles alive and unchanged until the chunks are written)
    encoded_tiles_alias_input: ClassVar[bool] = False

    def encode_tiles(self, tiles: np.ndarray) -> tuple[list, list[int]]:
        """Encode each row of ``tiles`` (uint8, one tile per row): (buffers whose concatenation is
        the chunks in order, encoded size per tile).

        The generic path: one :meth:`encode` per tile.  A codec with a native batch encoder
        overrides it; its output must equal this one's byte for byte (``tests/test_codecs.py``).
        """
        return self.encode_tiles_one_by_one(tiles)

    def encode_tiles_one_by_one(self, tiles: np.ndarray) -> tuple[list, list[int]]:
        """:meth:`encode_tiles` with one encoder call per tile (the reference of batch encoders)."""
        encode = self._encoder()
        chunks = [encode(tile) for tile in tiles]
        return chunks, [len(c) for c in chunks]

    def decode(self, data, nbytes: int) -> bytes:
        """Exactly ``nbytes`` decoded bytes, or :class:`CodecError`; never allocates more."""
        raise NotImplementedError

    def _compressors(self) -> list:
        return []

    def zarr_codecs(self) -> list[dict]:
        """The sharding codec's inner chain, as zarr-python's own codec classes write it."""
        return [codec.to_dict() for codec in [BytesCodec(endian="little"), *self._compressors()]]

    @classmethod
    def from_zarr_codecs(cls, chain: list[dict], dtype) -> Codec | None:
        """This codec, configured as the inner chain ``chain`` (zarr's dict form) of a ``dtype``
        array says, or None when the chain is not this codec's."""
        names = [c["name"] for c in chain]
        if names[:1] != ["bytes"] or names[1:] != [c.to_dict()["name"] for c in cls()._compressors()]:
            return None
        config = cls._config(chain[1]["configuration"]) if len(chain) > 1 else {}
        return None if config is None else cls(typesize=np.dtype(dtype).itemsize, **config)

    @classmethod
    def _config(cls, compressor: dict) -> dict | None:
        """Field values from the compressor's zarr configuration (None: not this codec)."""
        return {}

    def to_dict(self) -> dict:
        return {"name": self.name, "configuration": {"level": self.level, "typesize": self.typesize}}

    @staticmethod
    def from_dict(data: dict) -> Codec:
        codec, config = get(data["name"]), data.get("configuration", {})
        return replace(
            codec, level=codec.validate_level(config.get("level", codec.level)), typesize=int(config.get("typesize", 1))
        )


@dataclass(frozen=True)
class Raw(Codec):
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

    def decode(self, data, nbytes):
        if len(data) != nbytes:
            raise CodecError(f"raw chunk holds {len(data)} bytes, expected {nbytes}")
        return bytes(data)


@dataclass(frozen=True)
class Zstd(Codec):
    name = "zstd"
    level_range = (-7, 22)
    gpu = GpuSupport(nvcomp="zstd", max_chunk_bytes=16 << 20, levels=False)

    def max_encoded_bytes(self, nbytes):
        # libzstd's ZSTD_COMPRESSBOUND (frame header and checksum included); python-zstandard
        # does not expose it
        return nbytes + (nbytes >> 8) + (((128 << 10) - nbytes) >> 11 if nbytes < (128 << 10) else 0)

    def _context(self, kind, make):
        contexts = _local.__dict__.setdefault(kind, {})
        context = contexts.get(self.level)
        if context is None:
            context = contexts[self.level] = make()
        return context

    def _encoder(self):
        return self._compressor().compress

    def _compressor(self) -> zstandard.ZstdCompressor:
        return self._context("zstd-c", lambda: zstandard.ZstdCompressor(level=self.level))

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
        chunks = list(compressed)  # views into the few buffers libzstd filled, no copy
        return chunks, list(map(len, chunks))

    def decode(self, data, nbytes):
        # zstandard rather than zarr-python's codec: zarr's decode cannot bound its output (a
        # small frame may expand to gigabytes) nor tell that bytes follow the first frame.
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd decode failed: {exc}") from None
        if declared not in (-1, zstandard.CONTENTSIZE_UNKNOWN, nbytes):
            # decompress() allocates a declared size: refuse any but the expected one
            raise CodecError(f"zstd frame declares {declared} bytes, expected {nbytes}")
        decompressor = self._context("zstd-d", zstandard.ZstdDecompressor)
        try:
            decoded = decompressor.decompress(data, max_output_size=nbytes, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            trailing = re.search(r"contains (\d+) bytes of unused data", str(exc))
            if trailing:
                raise CodecError(f"{trailing.group(1)} bytes follow the first zstd frame") from None
            raise CodecError(f"zstd decode failed: {exc} (expected {nbytes} bytes)") from None
        if len(decoded) != nbytes:
            raise CodecError(f"zstd frame decodes to {len(decoded)} bytes, expected {nbytes}")
        return decoded

    def _compressors(self):
        return [ZstdCodec(level=self.level, checksum=False)]

    @classmethod
    def _config(cls, compressor):
        return {"level": compressor["level"]}


@functools.lru_cache(maxsize=64)
def _segments(count: int, nbytes: int) -> bytes:
    """``BufferWithSegments``' (offset, length) uint64 pairs of ``count`` back-to-back pieces of ``nbytes``."""
    segments = np.empty((count, 2), dtype=np.uint64)
    segments[:, 0] = np.arange(count, dtype=np.uint64) * np.uint64(nbytes)
    segments[:, 1] = nbytes
    return segments.tobytes()


@dataclass(frozen=True)
class BloscLz4(Codec):
    """Blosc 1 with LZ4 and byte shuffle (numcodecs' Blosc, as zarr-python's BloscCodec encodes)."""

    name = "blosc-lz4"
    level_range = (0, 9)
    max_chunk_bytes = _MAX_CHUNK_BYTES - 16  # blosc 1 takes at most INT_MAX - its header
    gpu_unsupported_reason = "nvCOMP cannot produce a Blosc bitstream"
    _HEADER = 16  # BLOSC_MAX_OVERHEAD: a stored (incompressible) chunk is its input plus the header

    def max_encoded_bytes(self, nbytes):
        return nbytes + self._HEADER

    def min_encoded_bytes(self, nbytes):
        return self._HEADER

    def _encoder(self):
        # typesize passed explicitly: the tiles reach the codec as uint8 views
        level, typesize, compress = self.level, self.typesize, numcodecs.blosc.compress
        return lambda buffer: compress(buffer, b"lz4", level, numcodecs.blosc.SHUFFLE, 0, typesize)

    def decode(self, data, nbytes):
        if len(data) < self._HEADER:
            raise CodecError(f"{len(data)} bytes are shorter than a blosc header ({self._HEADER})")
        # the header's sizes, checked before blosc trusts them (it reads cbytes, writes nbytes)
        declared, _, cbytes = struct.unpack_from("<III", data, 4)
        if declared != nbytes:
            raise CodecError(f"blosc header declares {declared} bytes, expected {nbytes}")
        if cbytes != len(data):
            raise CodecError(f"blosc header declares {cbytes} compressed bytes, the chunk holds {len(data)}")
        try:
            return numcodecs.blosc.decompress(data)  # allocates the declared size, checked above
        except (RuntimeError, ValueError) as exc:
            raise CodecError(f"blosc decode failed: {exc}") from None

    def _compressors(self):
        return [BloscCodec(cname="lz4", clevel=self.level, shuffle="shuffle", typesize=self.typesize, blocksize=0)]

    @classmethod
    def _config(cls, compressor):
        if compressor.get("cname") != "lz4" or compressor.get("shuffle") != "shuffle":
            return None
        return {"level": compressor["clevel"]}


CODECS: dict[str, Codec] = {codec.name: codec for codec in (Zstd(), Raw(), BloscLz4())}


def names() -> tuple[str, ...]:
    return tuple(CODECS)


def get(codec) -> Codec:
    """The registered codec ``codec`` names (a Codec is returned as it is)."""
    if isinstance(codec, Codec):
        return codec
    try:
        return CODECS[codec]
    except (KeyError, TypeError):
        raise ValueError(f"codec {codec!r} is not one of {', '.join(CODECS)}") from None


def from_zarr_codecs(chain: list[dict], dtype) -> Codec | None:
    """The registered codec, configured, that writes this inner codec chain (None: none does)."""
    for codec in CODECS.values():
        found = codec.from_zarr_codecs(chain, dtype)
        if found is not None:
            return found
    return None


def gpu_support(codec) -> str | None:
    """Why the GPU backend refuses ``codec``, or None when it encodes it."""
    codec = get(codec)
    if codec.gpu is not None:
        return None
    supported = ", ".join(c.name for c in CODECS.values() if c.gpu is not None)
    return (
        f"codec {codec.name!r} is not supported by the GPU backend: {codec.gpu_unsupported_reason} "
        f"(the GPU backend supports {supported}); use backend='cpu' or 'auto'"
    )
