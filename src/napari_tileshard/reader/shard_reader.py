"""``ShardReader``: fast readback of sharded Zarr v3 arrays by coalesced shard reads.

The loader design (``shared/design/chunked-loader.md``) applied to our shards: per shard the index
is read once (one suffix request, validated, cached), the chunks a selection needs are packed into
a few large reads that never split a chunk (:mod:`napari_tileshard.reader.plan`), the next read is
fetched while the current one is decoded, and each chunk is decoded by a native decoder that
writes into a per-thread buffer with the GIL released, then copied once into its place in the
output.  ``backend="gpu"`` decodes all chunks of a read in one nvCOMP call on the device
(:mod:`napari_tileshard.reader.gpu`).

The array's metadata, its shard indexes and its chunk codec are the format layer's
(:class:`~napari_tileshard.format.ShardSpec`, :mod:`napari_tileshard.format.codecs`): arrays it does
not read natively (an inner chain other than ``bytes`` + at most one of zstd, blosc, gzip inside
``sharding_indexed``, unsharded arrays, Zarr v2) and ``TILESHARD_READER=zarr`` are read by
zarr-python instead (``fallback_reason`` says why), with the same selection semantics.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import product

import numpy as np

from ..format.codecs import Codec, CodecError
from ..format.shard_spec import ChunkDecodeError, ShardIndex, ShardReadError, ShardSpec, UnsupportedArray
from ..storage._zarr_sync import sync
from ..storage.safe_read import StoreAccess, open_local_file
from ..storage.urls import resolve_store
from .gpu import GpuReadPath, gpu_read_unavailable_reason
from .levels import _levels
from .plan import (
    DEFAULT_GAP_BYTES,
    Block,
    DimPart,
    Read,
    ReadPlan,
    dim_parts,
    max_read_bytes_setting,
    normalize_selection,
    number_reads,
    pack_runs,
)

#: the most index bytes cached per reader (validated offsets and sizes, 16 bytes per chunk)
INDEX_CACHE_BYTES = 256 << 20


def reader_setting() -> str:
    """``TILESHARD_READER``: ``tileshard`` (default) or ``zarr`` (zarr-python, for rollback)."""
    value = os.environ.get("TILESHARD_READER", "tileshard").strip().lower() or "tileshard"
    if value not in ("tileshard", "zarr"):
        raise ValueError(f"TILESHARD_READER must be 'tileshard' or 'zarr', got {value!r}")
    return value


def workers_setting(value: int | None = None) -> int:
    """Decode threads: ``value``, else ``TILESHARD_READ_WORKERS``, else the CPU count."""
    if value is None:
        text = os.environ.get("TILESHARD_READ_WORKERS")
        value = int(text) if text and text.strip().isdigit() else (os.cpu_count() or 1)
        if text and not text.strip().isdigit():
            raise ValueError(f"TILESHARD_READ_WORKERS must be a positive integer, got {text!r}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"workers must be a positive integer, got {value!r}")
    return int(value)


def cache_bytes_setting(value: int | None = None, default: int = 0) -> int:
    """The decoded-chunk cache's cap: ``value``, else ``TILESHARD_CACHE_BYTES``, else ``default``."""
    if value is None:
        text = os.environ.get("TILESHARD_CACHE_BYTES")
        if not text:
            return default
        if not text.strip().isdigit():
            raise ValueError(f"TILESHARD_CACHE_BYTES must be a non-negative number of bytes, got {text!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"cache_bytes must be a non-negative integer, got {value!r}")
    return int(value)


class ChunkCache:
    """A bounded LRU cache of decoded chunks (their bytes), keyed by shard key, chunk number and
    the chunk's place in the shard (offset, size): a shard written again has new places, so a
    stale entry is never hit, only aged out."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: tuple, decoded: np.ndarray) -> None:
        if decoded.nbytes > self.max_bytes:
            return
        copy = decoded.copy()
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = copy
            self.nbytes += copy.nbytes
            while self.nbytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


def _store_chunk(chunks: np.ndarray, chunk_dtype, i: int, decoded: np.ndarray) -> None:
    chunks[i] = decoded.view(chunk_dtype).reshape(chunks.shape[1:])


class LazySelection:
    """A basic selection of a :class:`ShardReader`'s array, read only when converted
    (``np.asarray``): indexing composes (ints, slices with any step, Ellipsis) and reads nothing.

    napari's multiscale slicing first crops the displayed region over every row of a level, then
    picks the current row, then converts: with this array-like only that row's chunks are
    planned, read and decoded (a dask array does the same with a task per shard and ~20 ms of
    scheduling per slice).  Index types it cannot compose (arrays, None) read the selection first.
    """

    def __init__(self, reader: ShardReader, items: tuple):
        self.reader, self.items = reader, items  # per dim of the reader: a range (kept) or an int
        self.shape = tuple(len(item) for item in items if isinstance(item, range))
        self.dtype = reader.dtype
        self.ndim = len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __repr__(self):
        return f"LazySelection(shape={self.shape}, dtype={self.dtype}, of {self.reader!r})"

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        composable = all(
            k is Ellipsis or isinstance(k, slice) or (isinstance(k, (int, np.integer)) and not isinstance(k, bool))
            for k in keys
        )
        if not composable or sum(k is Ellipsis for k in keys) > 1:
            return np.asarray(self)[key]
        if any(k is Ellipsis for k in keys):
            at = next(i for i, k in enumerate(keys) if k is Ellipsis)
            keys = keys[:at] + (slice(None),) * (self.ndim - len(keys) + 1) + keys[at + 1 :]
        if len(keys) > self.ndim:
            raise IndexError(f"too many indices for an array of {self.ndim} dimensions: {key!r}")
        keys = keys + (slice(None),) * (self.ndim - len(keys))
        composed, next_key = [], iter(keys)
        for item in self.items:
            if isinstance(item, range):
                k = next(next_key)
                composed.append(item[int(k)] if isinstance(k, (int, np.integer)) else item[k])
            else:
                composed.append(item)
        return LazySelection(self.reader, tuple(composed))

    def __array__(self, dtype=None, copy=None):
        selection, flip = [], []
        for item in self.items:
            if isinstance(item, int):
                selection.append(item)
            elif len(item) == 0:
                selection.append(slice(0, 0))
            elif item.step > 0:
                selection.append(slice(item.start, item[-1] + 1, item.step))
            else:  # read the same elements in increasing order, then reverse
                selection.append(slice(item[-1], item.start + 1, -item.step))
                flip.append(len([s for s in selection[:-1] if not isinstance(s, int)]))
        out = self.reader.read(tuple(selection))
        if flip:
            out = np.flip(out, axis=tuple(flip))
        return np.asarray(out, dtype=dtype)


# -- placing decoded chunks -------------------------------------------------------------------
#: the most decoded bytes one decode task handles (its scratch buffer, reused per thread)
UNIT_BYTES = 8 << 20
#: the most bytes of read buffers a reader keeps for reuse
FREE_BUFFER_BYTES = 256 << 20


def unit_boxes(box_shape: tuple[int, ...], max_rows: int) -> list[tuple[tuple[int, int], tuple[tuple[int, int], ...]]]:
    """Cut a block's box of chunks into units of at most ``max_rows`` chunks (at least one whole
    row of the split dim) that are contiguous in row-major box order: ``((first, stop), ranges)``
    with ``ranges[d] = (lo, hi)`` the unit's box indices along dim ``d``.  Dims before the split
    dim are single indices, dims after it whole, so a unit is a sub-box."""
    ndim = len(box_shape)
    if ndim == 0:
        return [((0, 1), ())]
    after = [int(np.prod(box_shape[d + 1 :], dtype=np.int64)) for d in range(ndim)]
    split = next(d for d in range(ndim) if after[d] <= max(1, max_rows))
    per = max(1, max(1, max_rows) // after[split])
    units = []
    for prefix in np.ndindex(*box_shape[:split]):
        for lo in range(0, box_shape[split], per):
            hi = min(lo + per, box_shape[split])
            first = int(np.ravel_multi_index(prefix + (lo,) + (0,) * (ndim - split - 1), box_shape))
            ranges = tuple((p, p + 1) for p in prefix) + ((lo, hi),) + tuple((0, n) for n in box_shape[split + 1 :])
            units.append(((first, first + (hi - lo) * after[split]), ranges))
    return units


def dim_pieces(part: DimPart, lo: int, hi: int, chunk: int) -> list[tuple[slice, object, slice, bool]]:
    """The output positions of ``part`` (relative to its block) whose box index is in ``lo..hi``,
    as pieces ``(out, box, within, whole)``: runs of whole chunks (``box`` a slice relative to
    ``lo``, ``whole`` True: the output axis splits into (chunks, chunk)) and partial chunks
    (``box`` an int, ``within`` a slice with the selection's step)."""
    boxes = np.arange(lo, hi)
    starts = np.searchsorted(part.chunk_of, boxes, side="left").tolist()
    ends = np.searchsorted(part.chunk_of, boxes, side="right").tolist()
    pieces: list[tuple[slice, object, slice, bool]] = []
    i = 0
    while i < len(starts):
        a, e = starts[i], ends[i]
        if e - a == chunk:  # all of the chunk, in order (the positions are increasing and distinct)
            j = i + 1
            while j < len(starts) and ends[j] - starts[j] == chunk:
                j += 1
            pieces.append((slice(a, ends[j - 1]), slice(i, j), slice(None), True))
            i = j
            continue
        first = int(part.within[a])
        step = int(part.within[a + 1]) - first if e - a > 1 else 1
        pieces.append((slice(a, e), i, slice(first, int(part.within[e - 1]) + 1, step), False))
        i += 1
    return pieces


def untile_into(out: np.ndarray, chunks: np.ndarray, block: Block, ranges, chunk_shape) -> None:
    """Place a unit's decoded ``chunks`` (``(rows,) + chunk_shape``, row-major over the unit's
    box ``ranges``) into ``out`` (the block's output): per combination of per-dim pieces one
    strided copy from the chunks viewed as ``(box_0, chunk_0, box_1, chunk_1, ...)``."""
    ndim = len(chunk_shape)
    unit_shape = tuple(hi - lo for lo, hi in ranges)
    order = [axis for d in range(ndim) for axis in (d, ndim + d)]
    source = chunks.reshape(unit_shape + tuple(chunk_shape)).transpose(order)
    per_dim = [dim_pieces(part, lo, hi, c) for part, (lo, hi), c in zip(block.parts, ranges, chunk_shape)]
    for pieces in product(*per_dim):
        target = out[tuple(p[0] for p in pieces)]
        if any(p[3] for p in pieces):
            split: list[int] = []
            for (out_slice, _, _, whole), c in zip(pieces, chunk_shape):
                n = out_slice.stop - out_slice.start
                split += [n // c, c] if whole else [n]
            target = np.reshape(target, split, copy=False)  # splitting an axis is always a view
        np.copyto(target, source[tuple(x for p in pieces for x in p[1:3])])


class _BlockSource:
    """Where each present chunk of a block lies among its fetched reads."""

    def __init__(self, block: Block, fetched: list[tuple[Read, np.ndarray]], codec: Codec):
        count = block.box_chunks.size
        self.block, self.codec = block, codec
        self.buffer_of = np.full(count, -1, dtype=np.int64)  # -1: absent, -2: from the cache
        self.offset_of = np.zeros(count, dtype=np.int64)
        self.nbytes_of = np.zeros(count, dtype=np.int64)
        self.start_of = np.zeros(count, dtype=np.int64)  # the read's start: offsets in the shard
        self.views = []
        for i, (read, buffer) in enumerate(fetched):
            self.buffer_of[read.slots] = i
            self.offset_of[read.slots] = read.offsets
            self.nbytes_of[read.slots] = read.nbytes
            self.start_of[read.slots] = read.start
            self.views.append(memoryview(buffer.data).cast("B"))
        if block.cached:
            self.buffer_of[list(block.cached)] = -2
        self.nbytes = sum(read.size for read, _ in fetched)
        self.present = int(np.count_nonzero(self.buffer_of >= 0))

    def decoded_places(self, first: int, stop: int) -> list[tuple[int, tuple]]:
        """``(row, cache key)`` of the chunks among ``first..stop`` that were decoded from reads."""
        rows = np.flatnonzero(self.buffer_of[first:stop] >= 0)
        positions = rows + first
        return list(
            zip(
                rows.tolist(),
                zip(
                    [self.block.key] * rows.size,
                    self.block.box_chunks[positions].tolist(),
                    (self.start_of[positions] + self.offset_of[positions]).tolist(),
                    self.nbytes_of[positions].tolist(),
                ),
            )
        )

    def decode(self, first: int, stop: int, rows: np.ndarray, fill: np.ndarray) -> None:
        """Box positions ``first..stop`` decoded into ``rows`` (fill value where absent)."""
        views, decode = self.views, self.codec.decode_into
        found = zip(
            self.buffer_of[first:stop].tolist(),
            self.offset_of[first:stop].tolist(),
            self.nbytes_of[first:stop].tolist(),
        )
        for j, (buffer, offset, nbytes) in enumerate(found):
            if buffer < 0:
                rows[j] = fill if buffer == -1 else self.block.cached[first + j]
                continue
            try:
                decode(views[buffer][offset : offset + nbytes], rows[j])
            except CodecError as exc:
                raise ChunkDecodeError(self.block.key, int(self.block.box_chunks[first + j]), str(exc)) from None


# -- stores ----------------------------------------------------------------------------------
class _Objects:
    """Ranged reads of a store's objects: ``(size, bytes)`` of an index, a range into a buffer.

    Local stores are read with ``os.preadv`` straight into the read's buffer through descriptors
    opened by :func:`safe_read.open_local_file` (regular files inside the store only): no Python
    bytes object per read, no join, no event-loop round trip per request, which zarr's
    ``LocalStore.get`` costs.  Other stores go through zarr's ``Store.get`` with byte ranges.
    """

    def __init__(self, access):
        self.access = access
        self.local = access.root is not None
        self.requests = 0
        self.bytes_read = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_read += n

    def index(self, key: str, spec: ShardSpec) -> tuple[int, bytes] | None:
        """(object size, the index bytes), or None when the shard does not exist."""
        nbytes = spec.index_nbytes
        if self.local:
            try:
                fd = open_local_file(self.access.root, key)
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                size = os.fstat(fd).st_size
                raw = os.pread(fd, nbytes, spec.index_offset(size)) if size >= nbytes else b""
            finally:
                os.close(fd)
            self._count(len(raw))
            return size, raw
        from zarr.abc.store import RangeByteRequest

        try:
            size = self._sync(self.access.store.getsize(key))
        except FileNotFoundError:
            return None
        if size < nbytes:
            return size, b""
        start = spec.index_offset(size)
        return size, self._get(key, RangeByteRequest(start, start + nbytes)).tobytes()

    def read_into(self, key: str, start: int, out: np.ndarray) -> None:
        """Bytes ``start .. start + len(out)`` of ``key`` into ``out``; ShardReadError if short."""
        if self.local:
            fd = open_local_file(self.access.root, key)
            try:
                done, view = 0, memoryview(out.data).cast("B")
                while done < len(view):
                    n = os.preadv(fd, [view[done : done + (1 << 30)]], start + done)
                    if n <= 0:
                        break
                    done += n
            finally:
                os.close(fd)
            self._count(done)
        else:
            from zarr.abc.store import RangeByteRequest

            data = self._get(key, RangeByteRequest(start, start + len(out)))
            done = len(data)
            out[:done] = data[: len(out)]
        if done != len(out):
            raise ShardReadError(key, None, f"bytes {start}..{start + len(out)} asked, {done} read: shard truncated")

    def _get(self, key, byte_range) -> np.ndarray:
        from zarr.core.buffer import default_buffer_prototype

        buffer = self._sync(self.access.store.get(key, default_buffer_prototype(), byte_range=byte_range))
        data = np.zeros(0, np.uint8) if buffer is None else buffer.as_numpy_array().view(np.uint8)
        self._count(len(data))
        return data

    @staticmethod
    def _sync(coroutine):
        return sync(coroutine)


@dataclass
class ReadStats:
    """What a reader has done so far."""

    bytes_read: int = 0
    requests: int = 0
    index_requests: int = 0
    chunks_decoded: int = 0
    bytes_decoded: int = 0
    decode_seconds: float = 0.0
    #: batched GPU decompress calls (the GPU path decodes a whole batch of blocks per call)
    device_decode_calls: int = 0
    #: chunks taken from the decoded-chunk cache (not read, not decoded)
    cache_hits: int = 0
    read_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Decoded bytes per second of wall time, in GB/s."""
        return self.bytes_decoded / self.wall_seconds / 1e9 if self.wall_seconds else 0.0

    def __str__(self):
        return (
            f"{self.bytes_read / 1e6:.1f} MB read in {self.requests} requests ({self.index_requests} index), "
            f"{self.chunks_decoded} chunks ({self.bytes_decoded / 1e6:.1f} MB) decoded in "
            f"{self.decode_seconds:.3f} s, {self.gbps:.2f} GB/s"
        )


# -- the reader ------------------------------------------------------------------------------
class ShardReader:
    """Reads any sharded Zarr v3 array (or one level of an OME-Zarr group) by coalesced reads.

    ``path``: a local path or any store URL the Writer accepts (``file://``, ``memory://``,
    fsspec URLs), or a zarr ``Store``.  ``level``: the OME-Zarr level (default 0 for a group).
    ``backend``: ``"cpu"``, ``"gpu"`` (nvCOMP on the device; CuPy output with ``device=True``) or
    ``"auto"`` (the GPU where it is usable for this array's codec).  ``max_read_bytes``: the cap
    of one read (default ``TILESHARD_READ_BYTES`` or 2 GiB); ``prefetch``: reads fetched ahead;
    ``workers``: decode threads (default ``TILESHARD_READ_WORKERS`` or the CPU count).
    ``cache_bytes``: keep up to this many bytes of decoded chunks (LRU; default
    ``TILESHARD_CACHE_BYTES`` or 0, none) so that reading a region again (scrubbing back and forth
    in napari) costs no store reads and no decoding; CPU backend only.
    """

    def __init__(
        self,
        path,
        *,
        level: int | None = None,
        backend: str = "auto",
        max_read_bytes: int | None = None,
        prefetch: int = 2,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        workers: int | None = None,
        storage_options: dict | None = None,
        cache_bytes: int | None = None,
    ):
        import zarr

        if backend not in ("auto", "cpu", "gpu"):
            raise ValueError(f"backend must be 'auto', 'cpu' or 'gpu', got {backend!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        if isinstance(gap_bytes, bool) or not isinstance(gap_bytes, int) or gap_bytes < 0:
            raise ValueError(f"gap_bytes must be a non-negative integer, got {gap_bytes!r}")
        self.max_read_bytes = max_read_bytes_setting(max_read_bytes)
        self.workers = workers_setting(workers)
        self.prefetch, self.gap_bytes = prefetch, gap_bytes
        cache = cache_bytes_setting(cache_bytes)
        self.cache = ChunkCache(cache) if cache else None
        self.location = str(path)
        access = (
            path if isinstance(path, StoreAccess) else StoreAccess(resolve_store(path, storage_options=storage_options))
        )
        node = access.open_node("")
        levels = _levels(access, node)
        if levels:
            chosen = 0 if level is None else level
            if isinstance(chosen, bool) or not isinstance(chosen, int) or not 0 <= chosen < len(levels):
                raise ValueError(f"{self.location}: level must be an integer in 0..{len(levels) - 1}, got {level!r}")
            array = levels[chosen]
        elif isinstance(node, zarr.Array):
            if level not in (None, 0):
                raise ValueError(f"{self.location}: a plain array has no level {level!r} (not OME-Zarr)")
            array = node
        else:
            raise ValueError(f"{self.location}: a group without OME-Zarr multiscales, not an array")
        self.array = array
        self.shape = tuple(int(s) for s in array.shape)
        self.dtype = np.dtype(array.dtype)
        self.ndim = len(self.shape)
        self.fill_value = np.array(array.metadata.fill_value, dtype=self.dtype)
        self.stats = ReadStats()
        self._objects = _Objects(access)
        self._index_cache: OrderedDict[str, ShardIndex | None] = OrderedDict()
        self._index_cache_bytes = 0
        self._cache_lock = threading.Lock()
        self.fallback_reason = self._configure(array)
        self.backend = self._choose_backend(backend)
        self._gpu = None
        self._local = threading.local()  # per decode thread: its scratch buffer
        self._free_buffers: list[np.ndarray] = []  # read buffers to reuse (see _take_buffer)
        self._free_bytes = 0
        self._buffer_lock = threading.Lock()

    # -- configuration ------------------------------------------------------------------
    def _configure(self, array) -> str | None:
        """Reads the array's spec (:meth:`ShardSpec.from_metadata`); returns why zarr-python reads
        this array, or None."""
        if reader_setting() == "zarr":
            return "TILESHARD_READER=zarr"
        if array.metadata.zarr_format != 3:
            return "a Zarr v2 array: read by zarr-python"
        try:
            spec = ShardSpec.from_metadata(array.metadata.to_dict())
        except UnsupportedArray as exc:
            return f"{exc}: read by zarr-python"
        self.spec = spec
        self.shard_shape, self.chunk_shape = spec.shard_shape, spec.chunk_shape
        self.chunks_per_shard = spec.chunks_per_shard
        self.chunk_elements, self.chunk_bytes = spec.chunk_elements, spec.chunk_bytes
        #: the chunk codec (:mod:`napari_tileshard.format.codecs`), resolved once
        self.codec = spec.codec
        self._prefix = array.store_path.path
        return None

    @property
    def chunk_dtype(self) -> np.dtype:
        """The dtype of a decoded chunk's bytes (the ``bytes`` codec's byte order)."""
        return self.dtype.newbyteorder(">") if self.spec.big_endian else self.dtype

    def _choose_backend(self, backend: str) -> str:
        if self.fallback_reason is not None:
            if backend == "gpu":
                raise ValueError(f"{self.location}: backend='gpu' needs a natively read array ({self.fallback_reason})")
            return "cpu"
        if backend == "cpu":
            return "cpu"
        reason = gpu_read_unavailable_reason(self.spec)
        if reason is None:
            return "gpu"
        if backend == "gpu":
            raise ValueError(f"{self.location}: backend='gpu' is not usable: {reason}")
        return "cpu"

    def __repr__(self):
        how = f"zarr-python: {self.fallback_reason}" if self.fallback_reason else f"backend={self.backend!r}"
        return f"ShardReader({self.location!r}, shape={self.shape}, dtype={self.dtype}, {how})"

    # -- the index -------------------------------------------------------------------------
    def shard_key(self, shard: tuple[int, ...]) -> str:
        key = self.spec.shard_key(shard)
        return f"{self._prefix}/{key}" if self._prefix else key

    def shard_index(self, key: str) -> ShardIndex | None:
        """The validated index of shard ``key`` (None: the shard does not exist); read once, cached."""
        with self._cache_lock:
            if key in self._index_cache:
                self._index_cache.move_to_end(key)
                return self._index_cache[key]
        found = self._objects.index(key, self.spec)
        self.stats.index_requests += 1
        index = None
        if found is not None:
            size, raw = found
            index = self.spec.decode_index(key, raw, size)
        with self._cache_lock:
            self._index_cache[key] = index
            self._index_cache_bytes += 16 * self.spec.chunks
            while self._index_cache_bytes > INDEX_CACHE_BYTES and len(self._index_cache) > 1:
                self._index_cache.popitem(last=False)
                self._index_cache_bytes -= 16 * self.spec.chunks
        return index

    def refresh(self) -> None:
        """Forget the cached indexes (a recording in progress rewrites its open shards)."""
        with self._cache_lock:
            self._index_cache.clear()
            self._index_cache_bytes = 0

    # -- the plan --------------------------------------------------------------------------
    def plan(self, selection=Ellipsis) -> ReadPlan:
        """The read plan of ``selection``: one block per shard it touches (row-major shard order),
        each with its reads in storage order; reads are numbered globally."""
        return self._plan(selection, use_cache=False)

    def _plan(self, selection, use_cache: bool) -> ReadPlan:
        """The plan; ``use_cache``: chunks found in the chunk cache are taken from it, not read
        (such a plan depends on this reader's history, so ``plan`` never does this)."""
        if self.fallback_reason is not None:
            raise ValueError(
                f"{self.location}: no read plan, the array is read by zarr-python ({self.fallback_reason})"
            )
        indices, dropped = normalize_selection(selection, self.shape)
        shape = tuple(len(i) for i in indices)
        out_shape = tuple(n for n, d in zip(shape, dropped) if not d)
        per_dim = [dim_parts(i, s, c) for i, s, c in zip(indices, self.shard_shape, self.chunk_shape)]
        strides = np.array([int(np.prod(self.chunks_per_shard[d + 1 :], dtype=np.int64)) for d in range(self.ndim)])
        blocks: list[Block] = []
        runs_per_block = []
        # Shards along a dim mostly need the same chunks of themselves (all of them, or the same
        # plane): their boxes (chunk numbers inside the shard) are computed once and shared
        # (read-only).  Planning a 4 GiB read of 256 shards took 25 ms on the H100 host, most of
        # it rebuilding the same boxes.
        local = [
            [(p.chunks - p.shard * cps) * stride for p in parts]
            for parts, cps, stride in zip(per_dim, self.chunks_per_shard, strides.tolist())
        ]
        local_keys = [[x.tobytes() for x in xs] for xs in local]
        boxes: dict[tuple, np.ndarray] = {}
        no_chunks = np.zeros(0, np.int64)
        for combo in product(*(range(len(parts)) for parts in per_dim)):
            parts = tuple(per_dim[d][j] for d, j in enumerate(combo))
            shard = tuple(p.shard for p in parts)
            box_key = tuple(local_keys[d][j] for d, j in enumerate(combo))
            box_chunks = boxes.get(box_key)
            if box_chunks is None:
                box = np.zeros([len(local[d][j]) for d, j in enumerate(combo)], dtype=np.int64)
                for d, j in enumerate(combo):
                    box += local[d][j].reshape([-1 if e == d else 1 for e in range(self.ndim)])
                box_chunks = boxes[box_key] = box.ravel()
                box_chunks.flags.writeable = False
            key = self.shard_key(shard)
            block = Block(key, shard, parts, box_chunks)
            index = self.shard_index(key)
            runs = []
            if index is None:
                block.missing = np.arange(block.box_chunks.size)
            else:
                offsets, nbytes = index.offsets[block.box_chunks], index.nbytes[block.box_chunks]
                if nbytes.size and nbytes.min() >= 0:  # every chunk present: the common case
                    present, block.missing = np.arange(nbytes.size), no_chunks
                else:
                    present = np.flatnonzero(nbytes >= 0)
                    block.missing = np.flatnonzero(nbytes < 0)
                if use_cache and self.cache is not None and present.size:
                    chunks = block.box_chunks[present].tolist()
                    places = zip(chunks, offsets[present].tolist(), nbytes[present].tolist())
                    found = [(p, self.cache.get((key, *place))) for p, place in zip(present.tolist(), places)]
                    block.cached = {p: decoded for p, decoded in found if decoded is not None}
                    if block.cached:
                        present = present[~np.isin(present, list(block.cached))]
                for start, stop, positions in pack_runs(
                    offsets[present], nbytes[present], self.gap_bytes, self.max_read_bytes
                ):
                    chosen = present[positions]
                    runs.append(
                        (
                            key,
                            len(blocks),
                            start,
                            stop,
                            block.box_chunks[chosen],
                            offsets[chosen] - start,
                            nbytes[chosen],
                            chosen,
                        )
                    )
            blocks.append(block)
            runs_per_block.append(runs)
        return ReadPlan(shape, out_shape, blocks, number_reads(runs_per_block))

    # -- reading ---------------------------------------------------------------------------
    def __getitem__(self, selection) -> np.ndarray:
        return self.read(selection)

    # array-like for napari and dask: shape, dtype, ndim, size, len, __getitem__, __array__
    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.read(Ellipsis), dtype=dtype)

    def lazy(self) -> LazySelection:
        """The whole array as a :class:`LazySelection`: indexing it composes selections and reads
        nothing; ``np.asarray`` reads just the selected region."""
        return LazySelection(self, tuple(range(n) for n in self.shape))

    def read(self, selection=Ellipsis, device: bool = False):
        """The selection as a NumPy array (``device=True``: a CuPy array, on the GPU backend),
        with zarr-python's dtype, shape and fill value."""
        if device and self.backend != "gpu":
            raise ValueError(f"device=True needs backend='gpu' (this reader decodes on the {self.backend})")
        if self.fallback_reason is not None:
            return np.asarray(self.array[selection])
        started = time.perf_counter()
        plan = self._plan(selection, use_cache=self.backend == "cpu" and self.cache is not None)
        if self.backend == "gpu":
            out = self._gpu_reader().read(plan, device)
        else:
            out = np.empty(plan.shape, dtype=self.dtype)
            for _ in self._blocks(plan, lambda b: out[b.region]):
                pass
            out = out.reshape(plan.out_shape)
        self.stats.wall_seconds += time.perf_counter() - started
        return out

    def iter_blocks(self, selection=Ellipsis) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
        """``(region, block)`` per shard the selection touches, in storage order, with the next
        read prefetched: ``block`` is what ``read(selection)[region]`` holds."""
        if self.fallback_reason is not None:
            out = self.read(selection)
            yield tuple(slice(0, n) for n in out.shape), out
            return
        plan = self.plan(selection)
        indices, dropped = normalize_selection(selection, self.shape)
        for block, data in self._blocks(plan, lambda b: np.empty(b.shape, dtype=self.dtype)):
            region = tuple(r for r, d in zip(block.region, dropped) if not d)
            yield region, data.reshape(tuple(n for n, d in zip(block.shape, dropped) if not d))

    def iter_reads(self, plan: ReadPlan) -> Iterator[tuple[Read, np.ndarray]]:
        """Each read of ``plan`` (for example ``plan.owned_by(rank, world)``), fetched with
        prefetch and decoded: ``(read, chunks)`` with ``chunks[i]`` the decoded chunk
        ``read.chunks[i]`` of shard ``read.key`` (shape ``chunk_shape``)."""
        for read, buffer in self._fetched(plan.reads):
            chunks = np.empty((len(read.chunks),) + self.chunk_shape, dtype=self.dtype)
            started = time.perf_counter()
            self._decode_each(read, buffer, functools.partial(_store_chunk, chunks, self.chunk_dtype))
            self.stats.decode_seconds += time.perf_counter() - started
            self._recycle([buffer])
            yield read, chunks

    # -- internals ---------------------------------------------------------------------------
    def _fetch(self, read: Read) -> np.ndarray:
        buffer = self._take_buffer(read.size)
        started = time.perf_counter()
        self._objects.read_into(read.key, read.start, buffer)
        self.stats.read_seconds += time.perf_counter() - started
        self.stats.requests += 1
        self.stats.bytes_read += read.size
        return buffer

    def _take_buffer(self, size: int) -> np.ndarray:
        """A read buffer of ``size`` bytes: a recycled one when one is large enough.  Reusing
        buffers saves the page faults of fresh memory on every read (on a VM, touching fresh
        memory cost more than copying the bytes out of the page cache)."""
        with self._buffer_lock:
            fits = [i for i, b in enumerate(self._free_buffers) if b.size >= size]
            if fits:
                best = min(fits, key=lambda i: self._free_buffers[i].size)
                self._free_bytes -= self._free_buffers[best].size
                return self._free_buffers.pop(best)[:size]
        return np.empty(size, dtype=np.uint8)

    def _recycle(self, buffers) -> None:
        """Return read buffers once decoded; at most :data:`FREE_BUFFER_BYTES` are kept."""
        with self._buffer_lock:
            for buffer in buffers:
                base = buffer.base if isinstance(buffer.base, np.ndarray) else buffer
                if self._free_bytes + base.size <= FREE_BUFFER_BYTES:
                    self._free_buffers.append(base)
                    self._free_bytes += base.size

    def _fetched(self, reads, fetch=None) -> Iterator[tuple[Read, np.ndarray]]:
        """``(read, buffer)`` in order, up to ``prefetch`` reads fetched ahead, on up to
        ``prefetch`` threads (at most 8: one thread copies ~5-8 GB/s out of the page cache, less
        than 16 decode threads or a GPU take)."""
        fetch = fetch or self._fetch
        if not self.prefetch:
            for read in reads:
                yield read, fetch(read)
            return
        with ThreadPoolExecutor(min(8, self.prefetch), thread_name_prefix="tileshard-read") as io:
            pending: list[tuple[Read, Future]] = []
            queue = iter(reads)
            try:
                for read in queue:
                    pending.append((read, io.submit(fetch, read)))
                    if len(pending) > self.prefetch:
                        done, future = pending.pop(0)
                        yield done, future.result()
                while pending:
                    done, future = pending.pop(0)
                    yield done, future.result()
            finally:
                for _, future in pending:
                    future.cancel()

    def _blocks(self, plan: ReadPlan, target) -> Iterator[tuple[Block, np.ndarray]]:
        """Fill each block of ``plan`` (``target(block)``: the array it is written into) and yield
        it, in plan order, once all of it is decoded.

        A block's reads are fetched (with prefetch), then the block is cut into units (sub-boxes
        of its chunks that are contiguous in row-major box order, see :func:`unit_boxes`) and each
        unit is one task on the decode pool: its chunks decoded into a per-thread scratch buffer
        (reused, so no page faults), then placed into the output by a few strided NumPy copies
        (:func:`untile_into`), one per head/middle/tail piece, never one per chunk.  The
        decoders and the copies release the GIL.  Compressed bytes in flight stay within
        ``max_read_bytes`` and half the recycled read buffers (at least one block), so a whole-
        array read holds at most that much compressed data and reuses its read buffers instead
        of allocating fresh ones (no measurable change in speed on the 16-core H100 host)."""
        reads_of: list[list[Read]] = [[] for _ in plan.blocks]
        for read in plan.reads:
            reads_of[read.block].append(read)
        total = sum(b.box_chunks.size for b in plan.blocks) * self.chunk_bytes
        unit_bytes = int(min(UNIT_BYTES, max(self.chunk_bytes, total // (self.workers * 4) or 1)))
        fetched = self._fetched(plan.reads)
        window = max(1, min(self.max_read_bytes, FREE_BUFFER_BYTES // 2))
        pool = self._decode_pool() if self.workers > 1 else None
        pending: list[tuple[Block, np.ndarray, list, int, list]] = []
        in_flight = 0

        def finish(entry) -> tuple[Block, np.ndarray]:
            nonlocal in_flight
            block, out, futures, nbytes, buffers = entry
            started = time.perf_counter()
            for future in futures:
                future.result()
            self._recycle(buffers)
            self.stats.decode_seconds += time.perf_counter() - started
            in_flight -= nbytes
            return block, out

        try:
            for b, block in enumerate(plan.blocks):
                out = target(block)
                buffers = [next(fetched) for _ in reads_of[b]]
                source = _BlockSource(block, buffers, self.codec)
                units = unit_boxes(block.box_shape, unit_bytes // self.chunk_bytes)
                work = functools.partial(self._decode_unit, block, out, source)
                self.stats.cache_hits += len(block.cached)
                if not source.present and not block.cached:  # no chunk of this block is stored: fill only
                    out[...] = self.fill_value
                    units = []
                if pool is None:
                    started = time.perf_counter()
                    for unit in units:
                        work(unit)
                    self.stats.decode_seconds += time.perf_counter() - started
                    futures = []
                else:
                    futures = [pool.submit(work, unit) for unit in units]
                pending.append((block, out, futures, source.nbytes, [b for _, b in buffers]))
                in_flight += source.nbytes
                self.stats.chunks_decoded += source.present
                self.stats.bytes_decoded += source.present * self.chunk_bytes
                while pending and (in_flight > window or not pending[0][2]):
                    yield finish(pending.pop(0))
            while pending:
                yield finish(pending.pop(0))
        finally:
            for _, _, futures, _, _ in pending:
                for future in futures:
                    future.cancel()

    def _decode_unit(self, block: Block, out: np.ndarray, source: _BlockSource, unit) -> None:
        """Decode the chunks of ``unit`` (``(first, stop)`` box positions and its box ranges)
        into scratch and place them into ``out`` (the block's output)."""
        (first, stop), ranges = unit
        rows = stop - first
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.shape[0] < rows:
            scratch = self._local.scratch = np.empty((rows, self.chunk_bytes), dtype=np.uint8)
        decoded = scratch[:rows]
        source.decode(first, stop, decoded, self._fill_bytes)
        if self.cache is not None:
            for j, place in source.decoded_places(first, stop):
                self.cache.put(place, decoded[j])
        chunks = decoded.view(self.chunk_dtype).reshape((rows,) + self.chunk_shape)
        untile_into(out, chunks, block, ranges, self.chunk_shape)

    @functools.cached_property
    def _fill_bytes(self) -> np.ndarray:
        return np.full(self.chunk_elements, self.fill_value, dtype=self.chunk_dtype).view(np.uint8)

    def _decode_each(self, read: Read, buffer, place) -> None:
        """Decode every chunk of ``read`` from ``buffer`` and hand it to ``place(i, decoded)``,
        on ``workers`` threads (the decoders and large copies release the GIL)."""
        n = len(read.chunks)
        offsets, nbytes, codec = read.offsets.tolist(), read.nbytes.tolist(), self.codec
        view = memoryview(buffer).cast("B")

        def work(first: int, stop: int) -> None:
            scratch = np.empty(self.chunk_bytes, dtype=np.uint8)
            for i in range(first, stop):
                try:
                    codec.decode_into(view[offsets[i] : offsets[i] + nbytes[i]], scratch)
                except CodecError as exc:
                    raise ChunkDecodeError(read.key, int(read.chunks[i]), str(exc)) from None
                place(i, scratch)

        groups = min(n, self.workers * 4)
        bounds = [n * g // groups for g in range(groups + 1)] if groups else [0]
        if self.workers == 1 or groups <= 1:
            work(0, n)
        else:
            pool = self._decode_pool()
            for future in [pool.submit(work, a, b) for a, b in zip(bounds[:-1], bounds[1:])]:
                future.result()
        self.stats.chunks_decoded += n
        self.stats.bytes_decoded += n * self.chunk_bytes

    _pool: ThreadPoolExecutor | None = None

    def _decode_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tileshard-decode")
        return self._pool

    def _gpu_reader(self):
        if self._gpu is None:
            self._gpu = GpuReadPath(self)
        return self._gpu

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
