"""``ShardSpec``: one sharded Zarr v3 array, as ``zarr.json`` declares it, and its shard index.

The one place that parses the ``sharding_indexed`` configuration (:meth:`ShardSpec.from_metadata`,
with the reason when the array is not natively readable), writes it (:meth:`ShardSpec.to_metadata`,
what the writer publishes), and encodes, decodes and validates shard indexes, in the spirit of
zarr-python's ``_ShardIndex``.  The writer, the reader, verify and the inspector all go through it.

A shard is its chunks' bytes and the index, at the end (or the start): one ``(offset, nbytes)``
uint64 pair per chunk in row-major chunk order (``2^64-1`` twice for a chunk that does not
exist), in the ``bytes`` index codec's byte order, then (with the ``crc32c`` index codec) the
CRC32C of those pairs, little endian.

Validation (:meth:`ShardSpec.index_problems`) treats the index as hostile: every chunk must lie
inside the shard's data (checked without uint64 sums that could wrap), hold no more bytes than its
codec makes of one chunk and no fewer, and not overlap another; the CRC32C must match.  Every
problem is a :class:`ShardIndexError` naming the shard and the chunk: the reader raises the first
(:meth:`ShardSpec.decode_index`), verify reports them all.  Nothing is allocated from the entries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import crc32c
import numpy as np

from . import codecs
from .codecs import Codec

__all__ = [
    "ChunkDecodeError",
    "DATA_TYPES",
    "EMPTY",
    "LayoutLike",
    "ShardIndex",
    "ShardIndexError",
    "ShardReadError",
    "ShardSpec",
    "UnsupportedArray",
    "array_metadata",
    "grid_refusal",
]

#: the index entry of a chunk that does not exist: offset and nbytes both 2^64-1
EMPTY = 2**64 - 1
#: Zarr v3's core data types, read natively (the others are read by zarr-python)
DATA_TYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "float32", "float64", "complex64", "complex128"]
)


class ShardReadError(ValueError):
    """Shard data that cannot be trusted; says which shard, which chunk (if one) and why
    (``reason``: the message without the place)."""

    def __init__(self, key: str, chunk: int | None, message: str):
        self.key, self.chunk, self.reason = key, chunk, message
        where = key if chunk is None else f"{key} chunk {chunk}"
        super().__init__(f"{where}: {message}")


class ShardIndexError(ShardReadError):
    """A shard index that fails validation."""


class ChunkDecodeError(ShardReadError):
    """A chunk whose bytes do not decode to exactly one chunk."""


class UnsupportedArray(ValueError):
    """Metadata of an array that is not natively readable; the message says why."""


class LayoutLike(Protocol):
    """What :meth:`ShardSpec.from_layout` takes of a :class:`~napari_tileshard.format.layout.Layout`."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def shard_shape(self) -> tuple[int, ...]: ...
    @property
    def tile_shape(self) -> tuple[int, ...]: ...
    @property
    def names(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class ShardIndex:
    """A validated shard index: per chunk ``offset`` and ``nbytes`` (int64; -1 where absent)."""

    offsets: np.ndarray
    nbytes: np.ndarray

    @property
    def present(self) -> np.ndarray:
        return self.nbytes >= 0


@dataclass(frozen=True)
class ShardSpec:
    """One sharded array: its geometry, element type, inner codec, index format and keys.

    ``dtype`` is the element type in native byte order; ``endian`` the inner ``bytes`` codec's
    (None: it has no configuration, as zarr-python writes for 1-byte types).  ``fill_value`` as
    ``zarr.json`` holds it (JSON).  ``chunk_key_encoding`` is ``"default"`` (keys ``c/0/1``) or
    ``"v2"`` (keys ``0.1``), with ``separator``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    codec: Codec
    fill_value: Any = 0
    endian: str | None = "little"
    index_location: str = "end"
    index_crc: bool = True
    index_endian: str = "little"
    dimension_names: tuple[str | None, ...] | None = None
    chunk_key_encoding: str = "default"
    separator: str = "/"

    # -- geometry ----------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def chunks_per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard_shape, self.chunk_shape))

    @cached_property
    def chunks(self) -> int:
        """Chunks per shard (index entries)."""
        return math.prod(self.chunks_per_shard)

    @property
    def shard_grid(self) -> tuple[int, ...]:
        """Shards along each dim (of ``shape``)."""
        return tuple(-(-s // n) for s, n in zip(self.shape, self.shard_shape))

    @property
    def chunk_elements(self) -> int:
        return math.prod(self.chunk_shape)

    @cached_property
    def chunk_bytes(self) -> int:
        """Bytes of one decoded chunk."""
        return self.chunk_elements * self.dtype.itemsize

    @property
    def big_endian(self) -> bool:
        """Whether a decoded chunk's elements are big endian (the ``bytes`` codec's order)."""
        return self.endian == "big" and self.dtype.itemsize > 1

    @property
    def chunk_dtype(self) -> np.dtype:
        """The dtype of a decoded chunk's bytes."""
        return self.dtype.newbyteorder(">" if self.big_endian else "<") if self.dtype.itemsize > 1 else self.dtype

    @cached_property
    def min_chunk_bytes(self) -> int:
        """The fewest bytes a stored chunk may hold (the codec's, for one chunk)."""
        return self.codec.min_encoded_bytes(self.chunk_bytes)

    @cached_property
    def max_chunk_bytes(self) -> int:
        """The most bytes a stored chunk may hold (the codec's worst case for one chunk)."""
        return self.codec.max_encoded_bytes(self.chunk_bytes)

    # -- keys ----------------------------------------------------------------------------------------
    def shard_key(self, coords: Sequence[int]) -> str:
        """The store key of the shard at grid ``coords`` (relative to the array)."""
        parts = [str(int(c)) for c in coords]
        if self.chunk_key_encoding == "v2":
            return self.separator.join(parts) if parts else "0"
        return self.separator.join(["c", *parts])

    def shard_coords(self, key: str) -> tuple[int, ...] | None:
        """The grid coordinates a shard key names (relative to the array), or None when ``key``
        is not a shard key of this array's rank and encoding (coordinates are not range-checked)."""
        parts = key.split(self.separator) if key else []
        if self.chunk_key_encoding == "v2":
            parts = [] if key == "0" and not self.ndim else parts
        elif not parts or parts[0] != "c":
            return None
        else:
            parts = parts[1:]
        if len(parts) != self.ndim or not all(p.isdigit() and p.isascii() for p in parts):
            return None
        return tuple(int(p) for p in parts)

    # -- metadata ----------------------------------------------------------------------------------
    @classmethod
    def from_layout(cls, layout: LayoutLike, codec: Codec, shape0: int = 0) -> ShardSpec:
        """The array a writer records with ``layout`` and the configured ``codec``, ``shape0``
        rows published."""
        dtype = np.dtype(layout.dtype)
        return cls(
            shape=(int(shape0), *(int(s) for s in layout.shape[1:])),
            dtype=dtype,
            shard_shape=tuple(int(s) for s in layout.shard_shape),
            chunk_shape=tuple(int(s) for s in layout.tile_shape),
            codec=codec,
            fill_value=0.0 if dtype.kind == "f" else 0,
            dimension_names=tuple(layout.names),
        )

    def to_metadata(self, attributes: dict | None = None) -> dict:
        """The ``zarr.json`` of this array (standard Zarr v3, the ``sharding_indexed`` codec),
        key for key what the writer has always written."""
        meta: dict[str, Any] = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard_shape)}},
            "chunk_key_encoding": {"name": self.chunk_key_encoding, "configuration": {"separator": self.separator}},
            "fill_value": self.fill_value,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk_shape),
                        "codecs": self.codec.zarr_codecs(self.endian),
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": self.index_endian}},
                            *([{"name": "crc32c"}] if self.index_crc else []),
                        ],
                        "index_location": self.index_location,
                    },
                }
            ],
            "attributes": dict(attributes or {}),
        }
        if self.dimension_names is not None:
            meta["dimension_names"] = list(self.dimension_names)
        meta["storage_transformers"] = []
        return meta

    @classmethod
    def from_metadata(cls, meta, *, opaque: bool = False) -> ShardSpec:
        """The spec of the array ``meta`` (a ``zarr.json`` dict, as stored or as zarr-python's
        ``metadata.to_dict()`` gives it), or :class:`UnsupportedArray` saying why the array is not
        natively readable (a sharded array of another form, an unsharded array, Zarr v2).
        ``opaque``: an inner chain no registered codec is becomes an
        :class:`~napari_tileshard.format.codecs.Opaque` codec instead (its indexes can be read).
        The metadata is untrusted: anything malformed is a reason, never a KeyError."""
        if not isinstance(meta, dict):
            raise UnsupportedArray(f"metadata is a {type(meta).__name__}, not an object")
        if meta.get("zarr_format", 3) != 3:
            raise UnsupportedArray(f"a Zarr v{meta.get('zarr_format')} array")
        if meta.get("node_type", "array") != "array":
            raise UnsupportedArray(f"a {meta.get('node_type')!r} node, not an array")
        chain: Any = meta.get("codecs")
        names = _names(chain)
        if names != ["sharding_indexed"] or not isinstance(chain[0].get("configuration"), dict):
            if "sharding_indexed" in names:
                raise UnsupportedArray(f"codecs {names} are not one sharding_indexed codec")
            raise UnsupportedArray("not a sharded array (no sharding_indexed codec)")
        config = chain[0]["configuration"]
        if meta.get("storage_transformers"):
            raise UnsupportedArray("storage transformers are not supported")
        grid = meta.get("chunk_grid")
        if (
            not isinstance(grid, dict)
            or grid.get("name") != "regular"
            or not isinstance(grid.get("configuration"), dict)
        ):
            raise UnsupportedArray("not a regular chunk grid")
        shape = _shape(meta.get("shape"), "shape", 0)
        shard_shape = _shape(grid["configuration"].get("chunk_shape"), "shard shape", 1)
        chunk_shape = _shape(config.get("chunk_shape"), "chunk shape", 1)
        if not len(shape) == len(shard_shape) == len(chunk_shape):
            raise UnsupportedArray(f"shape {shape}, shard shape {shard_shape}, chunk shape {chunk_shape}: ranks differ")
        if any(s % c for s, c in zip(shard_shape, chunk_shape)):
            raise UnsupportedArray(f"shard shape {shard_shape} is not a multiple of chunk shape {chunk_shape}")
        data_type = meta.get("data_type")
        if not isinstance(data_type, str) or data_type not in DATA_TYPES:
            raise UnsupportedArray(f"data type {data_type!r} is not read natively")
        dtype = np.dtype(data_type)
        index_chain = config.get("index_codecs", [{"name": "bytes"}, {"name": "crc32c"}])
        index_names = _names(index_chain)
        if index_names not in (["bytes"], ["bytes", "crc32c"]):
            raise UnsupportedArray(f"index codecs {index_names} are not supported")
        index_endian: str = _endian(index_chain[0], "little")
        location = config.get("index_location", "end")
        if location not in ("end", "start"):
            raise UnsupportedArray(f"index location {location!r} is not supported")
        inner = config.get("codecs", [{"name": "bytes"}])
        codec = codecs.from_zarr_codecs(inner, dtype)
        if codec is None and opaque and _names(inner) and None not in _names(inner):
            codec = codecs.Opaque(chain=json.dumps(list(inner)), typesize=dtype.itemsize)
        if codec is None:
            raise UnsupportedArray(codecs.chain_refusal(inner))
        endian = None if isinstance(codec, codecs.Opaque) else _endian(inner[0], None)
        encoding, separator = _key_encoding(meta.get("chunk_key_encoding", {"name": "default"}))
        names_ = meta.get("dimension_names")
        if names_ is not None and not (_seq(names_) and all(n is None or isinstance(n, str) for n in names_)):
            raise UnsupportedArray(f"dimension names {names_!r} are not a list of strings")
        return cls(
            shape=shape,
            dtype=dtype,
            shard_shape=shard_shape,
            chunk_shape=chunk_shape,
            codec=codec,
            fill_value=meta.get("fill_value", 0),
            endian=endian,
            index_location=location,
            index_crc=len(index_names) == 2,
            index_endian=index_endian,
            dimension_names=None if names_ is None else tuple(names_),
            chunk_key_encoding=encoding,
            separator=separator,
        )

    # -- the index -------------------------------------------------------------------------------
    @cached_property
    def index_nbytes(self) -> int:
        return self.chunks * 16 + (4 if self.index_crc else 0)

    @property
    def index_at_end(self) -> bool:
        return self.index_location == "end"

    @property
    def _index_dtype(self) -> str:
        return "<u8" if self.index_endian == "little" else ">u8"

    def index_offset(self, object_size: int) -> int:
        """Where the index starts in a shard object of ``object_size`` bytes."""
        return object_size - self.index_nbytes if self.index_at_end else 0

    def data_range(self, object_size: int) -> tuple[int, int]:
        """The bytes of a shard object of ``object_size`` that chunks may occupy: (start, end)."""
        return (0, object_size - self.index_nbytes) if self.index_at_end else (self.index_nbytes, object_size)

    def encode_index(self, offsets, nbytes) -> bytes:
        """The index bytes of a shard whose chunk ``i`` lies at ``offsets[i]`` and holds
        ``nbytes[i]`` bytes (uint64 with ``EMPTY``, or int64 with -1, where absent)."""
        entries = np.empty((self.chunks, 2), dtype=np.uint64)
        entries[:, 0] = np.asarray(offsets).astype(np.uint64, copy=False)
        entries[:, 1] = np.asarray(nbytes).astype(np.uint64, copy=False)
        return self.encode_entries(entries)

    def encode_entries(self, entries: np.ndarray) -> bytes:
        """The index bytes of ``(chunks, 2)`` uint64 (offset, nbytes) pairs (``EMPTY`` where
        absent): the writer's per-shard path, one copy at most."""
        raw = np.ascontiguousarray(entries, dtype=self._index_dtype).tobytes()
        return raw + crc32c.crc32c(raw).to_bytes(4, "little") if self.index_crc else raw

    def index_entries(self, raw) -> tuple[np.ndarray, np.ndarray, bool]:
        """Decode the ``index_nbytes`` bytes of an index, unchecked: (offsets, nbytes) as uint64
        (``EMPTY`` where absent) and whether the CRC32C matches (True without one)."""
        if len(raw) != self.index_nbytes:
            raise ValueError(f"an index is {self.index_nbytes} bytes, got {len(raw)}")
        body = raw[: self.chunks * 16]
        offsets, nbytes = self.entries(body)
        return offsets, nbytes, self.crc_error("", crc32c.crc32c(body), raw[self.chunks * 16 :]) is None

    def entries(self, body) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, nbytes), uint64, of index entries ``body`` (whole 16-byte entries, no CRC)."""
        pairs = np.frombuffer(body, dtype=self._index_dtype).reshape(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    def crc_error(self, key: str, body_crc: int, stored) -> ShardIndexError | None:
        """The CRC32C mismatch, if ``body_crc`` (of the entries) is not the ``stored`` 4 bytes."""
        if self.index_crc and body_crc != int.from_bytes(stored, "little"):
            return ShardIndexError(key, None, "index CRC32C mismatch")
        return None

    def truncated_error(self, key: str, object_size: int) -> ShardIndexError | None:
        """The error of a shard object too short to hold its index, or None."""
        if object_size < self.index_nbytes:
            return ShardIndexError(
                key,
                None,
                f"shard of {object_size} bytes is shorter than its index ({self.index_nbytes} bytes): truncated",
            )
        return None

    def entry_problems(
        self, key: str, offsets, nbytes, object_size: int, first: int = 0, limit: int | None = None
    ) -> tuple[np.ndarray, list[ShardIndexError]]:
        """Check index entries ``first..`` (uint64 arrays) of a shard object of ``object_size``
        bytes, each on its own: ``(valid, problems)``, ``valid`` the entries of stored chunks that
        pass, ``problems`` at most ``limit`` errors in chunk order, one per failing chunk (an
        entry with only one half empty, a size the codec cannot make of one chunk, a chunk
        outside the shard data).  Overlaps are :meth:`overlap_problems`'."""
        offsets, nbytes = np.asarray(offsets), np.asarray(nbytes)
        data_start, data_end = self.data_range(object_size)
        lo, hi = self.min_chunk_bytes, self.max_chunk_bytes
        if (
            nbytes.size
            and lo <= int(nbytes.min())
            and int(nbytes.max()) <= hi
            and data_start <= int(offsets.min())
            and int(offsets.max()) <= data_end
            and int((offsets + nbytes).max()) <= data_end  # no wrap: both are below 2^63 here
        ):  # the common case: every chunk stored, plausibly sized, inside the data
            return np.ones(nbytes.size, dtype=bool), []
        empty_offset, empty_nbytes = offsets == np.uint64(EMPTY), nbytes == np.uint64(EMPTY)
        present = ~(empty_offset & empty_nbytes)
        half = present & (empty_offset | empty_nbytes)
        whole = present & ~half
        too_big = whole & (nbytes > np.uint64(hi))
        too_small = whole & (nbytes < np.uint64(lo))
        sized = whole & ~too_big & ~too_small
        # nbytes bounded first, then offset <= end - nbytes: no uint64 sum that could wrap
        end = np.uint64(max(data_end, 0))
        limit_ = end - np.minimum(nbytes, end)
        outside = half | (sized & ((nbytes > end) | (offsets > limit_) | (offsets < np.uint64(data_start))))
        bad = outside | too_big | too_small
        problems = []
        where = f"data is bytes {data_start}..{data_end} of {object_size}"
        for i in np.flatnonzero(bad)[:limit].tolist():
            o, n = int(offsets[i]), int(nbytes[i])
            if outside[i]:
                why = f"(offset {o}, {n} bytes) lies outside the shard data ({where})"
            elif lo == hi:
                why = f"holds {n} bytes, a tile is {lo}"
            elif too_big[i]:
                why = f"holds {n} bytes, more than {self.codec.name} makes of one tile of {self.chunk_bytes} bytes "
                why += f"(at most {hi})"
            else:
                why = f"holds {n} bytes, fewer than {self.codec.name} makes of one tile (at least {lo})"
            problems.append(ShardIndexError(key, first + i, why))
        return present & ~bad, problems

    def overlap_problems(
        self, key: str, offsets, nbytes, valid: np.ndarray, limit: int | None = None
    ) -> list[ShardIndexError]:
        """Chunks among ``valid`` (entries that passed :meth:`entry_problems`) whose bytes overlap
        an earlier-placed chunk's: at most ``limit`` errors, by offset."""
        chosen = np.flatnonzero(valid)
        if chosen.size < 2:
            return []
        starts = np.asarray(offsets)[chosen].astype(np.int64)
        order = np.argsort(starts, kind="stable")
        starts, chosen = starts[order], chosen[order]
        ends = starts + np.asarray(nbytes)[chosen].astype(np.int64)
        if not (starts[1:] < ends[:-1]).any():  # sorted by start, each apart from the next: none overlap
            return []
        reach = np.maximum.accumulate(ends)
        # which chunk reaches furthest so far: the one an overlapping chunk is named against
        latest = np.maximum.accumulate(np.where(ends == reach, np.arange(ends.size), 0))
        problems = []
        for j in (np.flatnonzero(starts[1:] < reach[:-1]) + 1)[:limit].tolist():
            a, b = int(chosen[latest[j - 1]]), int(chosen[j])
            problems.append(
                ShardIndexError(
                    key,
                    b,
                    f"(offset {int(offsets[b])}, {int(nbytes[b])} bytes) overlaps chunk {a} "
                    f"(offset {int(offsets[a])}, {int(nbytes[a])} bytes)",
                )
            )
        return problems

    def index_problems(
        self, key: str, raw, object_size: int, limit: int | None = None
    ) -> tuple[ShardIndex | None, list[ShardIndexError]]:
        """Validate the index bytes ``raw`` of shard ``key`` (an object of ``object_size`` bytes):
        ``(index, problems)``.  ``index`` holds the chunks that passed every check (-1 for the
        others and the absent ones; None when the object cannot hold an index); ``problems``,
        in order: truncation, CRC32C mismatch, per-chunk problems by chunk, overlaps (at most
        ``limit``, checked no further once it is reached)."""
        truncated = self.truncated_error(key, object_size)
        if truncated is None and len(raw) != self.index_nbytes:
            truncated = ShardIndexError(key, None, f"{len(raw)} index bytes read, {self.index_nbytes} expected")
        if truncated is not None:
            return None, [truncated]
        body = raw[: self.chunks * 16]
        crc = self.crc_error(key, crc32c.crc32c(body), raw[self.chunks * 16 :])
        problems = [crc] if crc is not None else []
        offsets, nbytes = self.entries(body)
        room = None if limit is None else limit - len(problems)
        valid, found = self.entry_problems(key, offsets, nbytes, object_size, limit=room)
        problems += found
        if limit is None or len(problems) < limit:
            room = None if limit is None else limit - len(problems)
            overlaps = self.overlap_problems(key, offsets, nbytes, valid, limit=room)
            if overlaps:
                valid = valid.copy()
                valid[[p.chunk for p in overlaps]] = False
                problems += overlaps
        starts = np.where(valid, offsets, 0).astype(np.int64)
        sizes = np.where(valid, nbytes, 0).astype(np.int64)
        return ShardIndex(np.where(valid, starts, -1), np.where(valid, sizes, -1)), problems

    def decode_index(self, key: str, raw, object_size: int) -> ShardIndex:
        """The validated index of shard ``key`` (index bytes ``raw``, an object of ``object_size``
        bytes), or the first :class:`ShardIndexError` of :meth:`index_problems`."""
        index, problems = self.index_problems(key, raw, object_size, limit=1)
        if problems:
            raise problems[0]
        assert index is not None
        return index

    def decode_indexes(
        self, keys: Sequence[str], raws: Sequence[bytes], object_sizes: Sequence[int]
    ) -> list[ShardIndex]:
        """:meth:`decode_index` of many shards: the common case (the index whole, its CRC32C right,
        every chunk stored, plausibly sized, inside the shard data, none overlapping) checked
        with NumPy over all shards at once; any other shard goes through :meth:`decode_index`,
        which raises the first :class:`ShardIndexError` (shards in the order given)."""
        count, body = len(keys), self.chunks * 16
        whole = (
            [
                len(raw) == self.index_nbytes
                and size >= self.index_nbytes
                and self.crc_error("", crc32c.crc32c(raw[:body]), raw[body:]) is None
                for raw, size in zip(raws, object_sizes)
            ]
            if self.index_crc
            else [len(raw) == self.index_nbytes and size >= self.index_nbytes for raw, size in zip(raws, object_sizes)]
        )
        rows = [i for i in range(count) if whole[i]]
        fast = np.zeros(count, dtype=bool)
        offsets = nbytes = np.zeros((0, self.chunks), dtype=np.int64)
        if rows:
            pairs = np.frombuffer(b"".join(raws[i][:body] for i in rows), dtype=self._index_dtype)
            pairs = pairs.reshape(len(rows), self.chunks, 2)
            raw_offsets, raw_nbytes = pairs[..., 0], pairs[..., 1]
            sizes = np.asarray([object_sizes[i] for i in rows], dtype=np.uint64)
            data_start = np.uint64(0 if self.index_at_end else self.index_nbytes)
            data_end = sizes - np.uint64(self.index_nbytes) if self.index_at_end else sizes
            ok = (raw_nbytes.min(axis=1) >= self.min_chunk_bytes) & (raw_nbytes.max(axis=1) <= self.max_chunk_bytes)
            ok &= (raw_offsets.min(axis=1) >= data_start) & (raw_offsets.max(axis=1) <= data_end)
            # where ok, offsets are at most the data end and sizes at most one chunk's bound: no wrap
            ends = np.where(ok[:, None], raw_offsets + raw_nbytes, 0)
            ok &= ends.max(axis=1) <= data_end
            offsets, nbytes = raw_offsets.astype(np.int64), raw_nbytes.astype(np.int64)
            order = np.argsort(offsets, axis=1, kind="stable")
            starts = np.take_along_axis(offsets, order, axis=1)
            stops = starts + np.take_along_axis(nbytes, order, axis=1)
            ok &= ~np.any(starts[:, 1:] < stops[:, :-1], axis=1)  # sorted by start, none reaches the next
            fast[rows] = ok
        row_of = {i: r for r, i in enumerate(rows)}
        return [
            ShardIndex(offsets[row_of[i]], nbytes[row_of[i]])
            if fast[i]
            else self.decode_index(keys[i], raws[i], object_sizes[i])
            for i in range(count)
        ]


def array_metadata(layout: LayoutLike, codec, level: int, shape0: int, attributes=None) -> dict:
    """Standard Zarr v3 array metadata with the ``sharding_indexed`` codec for ``layout`` (what
    the writer publishes); ``codec``: a codec name or :class:`~napari_tileshard.format.codecs.Codec`."""
    configured = codecs.get(codec).configure(level, layout.dtype)
    return ShardSpec.from_layout(layout, configured, shape0).to_metadata(attributes)


def grid_refusal(meta: dict) -> str | None:
    """Why an array's ``zarr.json`` has a chunk grid no reader can use (a shard or chunk shape
    holding 0, a negative number or a non-integer: zarr-python divides by it), or None.  Checked
    for any Zarr v3 array, sharded or not, before zarr-python is given the metadata."""
    grid = meta.get("chunk_grid")
    if isinstance(grid, dict) and isinstance(grid.get("configuration"), dict):
        try:
            _shape(grid["configuration"].get("chunk_shape"), "the chunk grid's chunk shape", 1)
        except UnsupportedArray as exc:
            return str(exc)
    pending = list(meta.get("codecs") or []) if _seq(meta.get("codecs")) else []
    while pending:
        codec = pending.pop()
        if not isinstance(codec, dict) or codec.get("name") != "sharding_indexed":
            continue
        config = codec.get("configuration")
        if not isinstance(config, dict):
            continue
        try:
            _shape(config.get("chunk_shape"), "the sharding codec's chunk shape", 1)
        except UnsupportedArray as exc:
            return str(exc)
        if _seq(config.get("codecs")):
            pending.extend(config["codecs"])  # nested sharding
    return None


# -- parsing helpers (untrusted metadata) ----------------------------------------------------------
def _seq(value) -> bool:
    return isinstance(value, (list, tuple))


def _shape(value, what: str, low: int) -> tuple[int, ...]:
    if not _seq(value) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value):
        raise UnsupportedArray(f"{what} {value!r} is not a list of integers >= {low}")
    return tuple(value)


def _names(chain) -> list:
    """The codec names of a chain (None for an entry that is not a named codec)."""
    if not _seq(chain):
        return []
    return [c.get("name") if isinstance(c, dict) and isinstance(c.get("name"), str) else None for c in chain]


def _endian(codec: dict, default):
    """The ``bytes`` codec's endian, ``default`` where it has none."""
    config = codec.get("configuration")
    if not isinstance(config, dict) or "endian" not in config:
        return default
    if config["endian"] not in ("little", "big"):
        raise UnsupportedArray(f"bytes codec endian {config['endian']!r} is not 'little' or 'big'")
    return config["endian"]


def _key_encoding(encoding) -> tuple[str, str]:
    if isinstance(encoding, str):  # a bare name
        encoding = {"name": encoding}
    if not isinstance(encoding, dict) or encoding.get("name") not in ("default", "v2"):
        raise UnsupportedArray(f"chunk key encoding {encoding!r} is not supported")
    config = encoding.get("configuration") or {}
    separator = (
        config.get("separator", "/" if encoding["name"] == "default" else ".") if isinstance(config, dict) else 0
    )
    if separator not in ("/", "."):
        raise UnsupportedArray(f"chunk key separator {separator!r} is not supported")
    return encoding["name"], separator
