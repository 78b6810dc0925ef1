"""``ShardReader``: fast readback of sharded Zarr v3 arrays by coalesced shard reads.

The loader design (``shared/design/chunked-loader.md``) applied to our shards: per shard the index
is read once (one suffix request, validated, cached), the chunks a selection needs are packed into
a few large reads that never split a chunk (:mod:`~napari_tileshard.reader.plan`), the next read is
fetched while the current one is decoded (:mod:`~napari_tileshard.reader.fetch`), and each chunk is
decoded by a native decoder that writes into a per-thread buffer with the GIL released, then copied
once into its place in the output (:mod:`~napari_tileshard.reader.cpu`).  ``backend="gpu"`` decodes
all chunks of a read in one nvCOMP call on the device (:mod:`~napari_tileshard.reader.gpu`).

This module is the orchestrator: it opens the array (:mod:`~napari_tileshard.reader.levels`),
chooses how it is read, keeps the caches (:mod:`~napari_tileshard.reader.cache`) and the
statistics, and plans each selection.

The array's metadata, its shard indexes and its chunk codec are the format layer's
(:class:`~napari_tileshard.format.ShardSpec`, :mod:`napari_tileshard.format.codecs`): arrays it does
not read natively (an inner chain other than ``bytes`` + at most one of zstd, blosc, gzip inside
``sharding_indexed``, unsharded arrays, Zarr v2) and ``TILESHARD_READER=zarr`` are read by
zarr-python instead (``fallback_reason`` says why), with the same selection semantics.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import product, repeat

import numpy as np

from ..format.shard_spec import ShardIndex, ShardSpec, UnsupportedArray
from ..storage.safe_read import StoreAccess
from .cache import ChunkCache, IndexCache
from .cpu import CpuReadPath
from .fetch import DISK_FETCH_THREADS, ReadBuffers, StoreObjects, hinted_ahead, prefetched
from .gpu import GpuReadPath, gpu_read_unavailable_reason
from .lazy import LazySelection
from .levels import open_array
from .memory import output_pool
from .plan import (
    DEFAULT_GAP_BYTES,
    Block,
    Read,
    ReadPlan,
    normalize_selection,
    number_reads,
    pack_runs,
    progression_parts,
    single_runs,
)
from .settings import cache_bytes_setting, max_read_bytes_setting, reader_setting, workers_setting
from .stats import ReadStats

#: the read paths in ``backend="auto"``'s order, each with why it cannot read an array here (None: it can)
READ_PATHS: dict[str, Callable[[ShardSpec], str | None]] = {
    "gpu": gpu_read_unavailable_reason,
    "cpu": lambda spec: None,
}
READ_BACKENDS = ("auto", *READ_PATHS)

__all__ = ["READ_BACKENDS", "READ_PATHS", "ReadStats", "ShardReader"]


def _store_chunk(chunks: np.ndarray, chunk_dtype, i: int, decoded: np.ndarray) -> None:
    chunks[i] = decoded.view(chunk_dtype).reshape(chunks.shape[1:])


# -- the reader ------------------------------------------------------------------------------
class ShardReader:
    """Reads any sharded Zarr v3 array (or one level of an OME-Zarr group) by coalesced reads.

    ``source``: a local path or any store URL the Writer accepts (``file://``, ``memory://``,
    fsspec URLs), a zarr ``Store``, a :class:`~napari_tileshard.storage.safe_read.StoreAccess`, or
    a zarr ``Array`` or ``Group`` opened already (its metadata is not read again: open a store once
    and hand its nodes to the readers).  ``pyramid_level``: the OME-Zarr multiscale level of a
    group (default 0; a plain array has only level 0).  ``backend``: ``"cpu"``, ``"gpu"`` (nvCOMP
    on the device; CuPy output with ``device=True``) or ``"auto"`` (the GPU where it is usable for
    this array's codec).  ``max_read_bytes``: the cap of one read (default ``TILESHARD_READ_BYTES``
    or 2 GiB); ``prefetch``: reads fetched ahead; ``workers``: decode threads (default
    ``TILESHARD_READ_WORKERS`` or the CPU count).  ``storage_options``: configure a store URL
    (endpoint, credentials, ...).  ``cache_bytes``: keep up to this many bytes of decoded chunks
    (LRU; default ``TILESHARD_CACHE_BYTES`` or 0, none) so that reading a region again (scrubbing
    back and forth in napari) costs no store reads and no decoding; CPU backend only.  With a
    cache, memory for the next read's new cache entries and output is faulted in on a background
    thread after each read that needed fresh memory (the kernel zeroing fresh pages cost 7-9 ms per
    16 MiB tile row on a 2-core VM, on the read's critical path).
    ``read_ahead`` (needs the cache): when single planes along dim 0 are read one after the
    other (napari's time slider stepped), the chunks of the next planes in that direction are
    read and decoded into the cache on a background thread while the caller shows this one; the
    next read waits for it rather than reading the same chunks again.
    """

    def __init__(
        self,
        source,
        *,
        pyramid_level: int | None = None,
        backend: str = "auto",
        max_read_bytes: int | None = None,
        prefetch: int = 2,
        gap_bytes: int = DEFAULT_GAP_BYTES,
        workers: int | None = None,
        storage_options: dict | None = None,
        cache_bytes: int | None = None,
        read_ahead: bool = False,
    ):
        if backend not in READ_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(READ_BACKENDS)}, got {backend!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        if isinstance(gap_bytes, bool) or not isinstance(gap_bytes, int) or gap_bytes < 0:
            raise ValueError(f"gap_bytes must be a non-negative integer, got {gap_bytes!r}")
        self.max_read_bytes = max_read_bytes_setting(max_read_bytes)
        self.workers = workers_setting(workers)
        self.prefetch, self.gap_bytes = prefetch, gap_bytes
        cache = cache_bytes_setting(cache_bytes)
        self.cache = ChunkCache(cache) if cache else None
        self.read_ahead = bool(read_ahead) and self.cache is not None
        self._ahead: Future | None = None  # the read-ahead in flight
        self._ahead_rows: tuple = (0, 0, "")  # its dim-0 rows lo..hi and the rest of its selection
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._last_plane: tuple | None = None  # (dim-0 index, the rest of the selection) of the last plane read
        access, array = open_array(source, pyramid_level, storage_options=storage_options)
        self.location = _location(source, access, array)
        self.array = array
        self.shape = tuple(int(s) for s in array.shape)
        self.dtype = np.dtype(array.dtype)
        self.ndim = len(self.shape)
        self.fill_value = np.array(array.metadata.fill_value, dtype=self.dtype)
        self.stats = ReadStats()
        self._objects = StoreObjects(access, self.stats)
        self._buffers = ReadBuffers()
        self.fallback_reason = self._configure(array)
        #: validated shard indexes, 16 bytes per chunk (none are read when zarr-python reads the array)
        self._indexes = IndexCache(entry_bytes=16 * self.spec.chunks if self.fallback_reason is None else 0)
        self.backend = self._choose_backend(backend)
        self._cpu: CpuReadPath | None = None
        self._gpu: GpuReadPath | None = None
        self._io: ThreadPoolExecutor | None = None  # the prefetch threads, kept across reads
        self._disk_pool: ThreadPoolExecutor | None = None  # the disk fetch threads (_disk_io)

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
        """The read path: the one asked for, or ``auto``'s first that can read this array here
        (:data:`READ_PATHS`, best first), naming why one that was asked for cannot."""
        if self.fallback_reason is not None:
            if backend not in ("auto", "cpu"):
                raise ValueError(
                    f"{self.location}: backend={backend!r} needs a natively read array ({self.fallback_reason})"
                )
            return "cpu"
        for name, unavailable in READ_PATHS.items():
            if backend not in ("auto", name):
                continue
            reason = unavailable(self.spec)
            if reason is None:
                return name
            if backend == name:
                raise ValueError(f"{self.location}: backend={name!r} is not usable: {reason}")
        raise AssertionError("the CPU path reads every natively read array")

    def __repr__(self):
        how = f"zarr-python: {self.fallback_reason}" if self.fallback_reason else f"backend={self.backend!r}"
        return f"ShardReader({self.location!r}, shape={self.shape}, dtype={self.dtype}, {how})"

    # -- the index -------------------------------------------------------------------------
    def shard_key(self, shard: tuple[int, ...]) -> str:
        key = self.spec.shard_key(shard)
        return f"{self._prefix}/{key}" if self._prefix else key

    def shard_index(self, key: str) -> ShardIndex | None:
        """The validated index of shard ``key`` (None: the shard does not exist); read once, cached."""
        found, index = self._indexes.lookup(key)
        if found:
            return index
        return self._read_indexes([key])[0]

    def _read_indexes(self, keys: list[str]) -> list[ShardIndex | None]:
        """Read, validate and cache the indexes of shards ``keys`` (one gather on remote stores)."""
        stored = [(i, read) for i, read in enumerate(self._objects.indexes(keys, self.spec)) if read is not None]
        decoded = self.spec.decode_indexes(
            [keys[i] for i, _ in stored], [raw for _, (_, raw) in stored], [size for _, (size, _) in stored]
        )
        found: list[ShardIndex | None] = [None] * len(keys)
        for (i, _), shard_index in zip(stored, decoded):
            found[i] = shard_index
        for key, maybe in zip(keys, found):
            self._indexes.put(key, maybe)
        return found

    def refresh(self) -> None:
        """Forget the cached indexes and close the store's directories and shards held open (a
        recording in progress rewrites its open shards): until then a shard is read as the
        version whose index was read."""
        self._indexes.clear()
        self._objects.close()

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
        per_dim = [progression_parts(i, s, c) for i, s, c in zip(indices, self.shard_shape, self.chunk_shape)]
        strides = [int(np.prod(self.chunks_per_shard[d + 1 :], dtype=np.int64)) for d in range(self.ndim)]
        # Shards along a dim mostly need the same chunks of themselves (all of them, or the same
        # plane): per dim, parts with equal chunk numbers inside their shard share an id, and each
        # combination of ids (a box) is built once and shared (read-only).
        local: list[list[np.ndarray]] = []
        part_box: list[list[int]] = []
        for parts, cps, stride in zip(per_dim, self.chunks_per_shard, strides):
            seen: dict[bytes, int] = {}
            numbers = [(p.chunks - p.shard * cps) * stride for p in parts]
            local.append(numbers)
            part_box.append([seen.setdefault(x.tobytes(), j) for j, x in enumerate(numbers)])
        combos = list(product(*(range(len(parts)) for parts in per_dim)))  # row-major shard order
        boxes: dict[tuple, np.ndarray] = {}
        blocks: list[Block] = []
        box_of: list[tuple] = []
        for combo in combos:
            box_key = tuple(part_box[d][j] for d, j in enumerate(combo))
            box_chunks = boxes.get(box_key)
            if box_chunks is None:
                box = np.zeros([len(local[d][j]) for d, j in enumerate(combo)], dtype=np.int64)
                for d, j in enumerate(combo):
                    box += local[d][j].reshape([-1 if e == d else 1 for e in range(self.ndim)])
                box_chunks = boxes[box_key] = box.ravel()
                box_chunks.flags.writeable = False
            shard_parts = tuple(per_dim[d][j] for d, j in enumerate(combo))
            shard = tuple(p.shard for p in shard_parts)
            blocks.append(Block(self.shard_key(shard), shard, shard_parts, box_chunks))
            box_of.append(box_key)
        indexes = self._indexes_of([block.key for block in blocks])
        runs_per_block: list[list[tuple]] = [[] for _ in blocks]
        # The common case in one NumPy pass per box over all its shards: every needed chunk
        # stored and nothing taken from the chunk cache; one run per shard where the chunks need
        # no split (pack_runs's answer, for all shards at once).  The rest, shard by shard.
        by_box: dict[tuple, list[int]] = {}
        stored: dict[int, ShardIndex] = {}
        cached_chunks = use_cache and self.cache is not None and len(self.cache) > 0
        for b, (block, index) in enumerate(zip(blocks, indexes)):
            if index is None:
                block.missing = np.arange(block.box_chunks.size)
            elif cached_chunks and self._take_cached(block, index):
                runs_per_block[b] = self._block_runs(b, block, index)
            else:  # (a block of a new tile row while napari steps: nothing of it in the cache)
                stored[b] = index
                by_box.setdefault(box_of[b], []).append(b)
        for box_key, members in by_box.items():
            box_chunks = boxes[box_key]
            offsets = np.stack([stored[b].offsets for b in members])[:, box_chunks]
            nbytes = np.stack([stored[b].nbytes for b in members])[:, box_chunks]
            whole, order, starts, sizes = single_runs(offsets, nbytes, self.gap_bytes, self.max_read_bytes)
            chunks = box_chunks[order]
            first, stop = starts[:, 0].tolist(), (starts[:, -1] + sizes[:, -1]).tolist()
            relative = starts - starts[:, :1]
            for row, b in enumerate(members):
                if whole[row]:
                    runs_per_block[b] = [
                        (blocks[b].key, b, first[row], stop[row], chunks[row], relative[row], sizes[row], order[row])
                    ]
                else:
                    runs_per_block[b] = self._block_runs(b, blocks[b], stored[b])
        return ReadPlan(shape, out_shape, blocks, number_reads(runs_per_block))

    def _indexes_of(self, keys: list[str]) -> list[ShardIndex | None]:
        """The indexes of shards ``keys``: from the cache, the others read in one batch."""
        found = [self._indexes.lookup(key) for key in keys]
        unknown = [key for key, (cached, _) in zip(keys, found) if not cached]
        read = dict(zip(unknown, self._read_indexes(unknown))) if unknown else {}
        return [index if cached else read[key] for key, (cached, index) in zip(keys, found)]

    def _take_cached(self, block: Block, index: ShardIndex) -> bool:
        """Find the block's stored chunks in the chunk cache (``block.cached``); whether any was."""
        assert self.cache is not None
        chunks = block.box_chunks
        offsets, nbytes = index.offsets[chunks], index.nbytes[chunks]
        found = self.cache.get_many(list(zip(repeat(block.key), chunks.tolist(), offsets.tolist(), nbytes.tolist())))
        # an absent chunk (size -1) has no cache entry: a lookup of it finds nothing
        block.cached = {p: decoded for p, decoded in enumerate(found) if decoded is not None}
        return bool(block.cached)

    def _block_runs(self, b: int, block: Block, index: ShardIndex) -> list[tuple]:
        """The runs of one shard's block (absent chunks, chunks in the cache (``block.cached``,
        :meth:`_take_cached`), runs split by gaps or the cap): ``(key, block, start, stop,
        chunks, offsets, nbytes, slots)`` each."""
        key = block.key
        offsets, nbytes = index.offsets[block.box_chunks], index.nbytes[block.box_chunks]
        stored = nbytes >= 0
        if not stored.all():
            block.missing = np.flatnonzero(~stored)
        if block.cached:
            stored[list(block.cached)] = False
        present = np.flatnonzero(stored)
        runs = []
        for start, stop, positions in pack_runs(offsets[present], nbytes[present], self.gap_bytes, self.max_read_bytes):
            chosen = present[positions]
            runs.append(
                (key, b, start, stop, block.box_chunks[chosen], offsets[chosen] - start, nbytes[chosen], chosen)
            )
        return runs

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
        started = time.perf_counter()
        if self.fallback_reason is not None:
            out = np.asarray(self.array[selection])
        else:
            self._wait_for_read_ahead(selection)
            plan = self._plan(selection, use_cache=self.backend == "cpu" and self.cache is not None)
            if self.backend == "gpu":
                out = self._gpu_reader().read(plan, device)
            else:
                out = self._cpu_path().read(plan)
            if self.read_ahead and self.backend == "cpu":
                self._start_read_ahead(selection)
            if self.cache is not None and self.backend == "cpu" and output_pool().missed:
                self._background().submit(output_pool().replenish)
        self.stats.add(reads=1, bytes_out=out.nbytes, busy_seconds=time.perf_counter() - started)
        return out

    def _background(self) -> ThreadPoolExecutor:
        """The one thread of work for the reads to come (read-ahead, memory faulted in ahead:
        :meth:`~napari_tileshard.reader.memory.OutputPool.replenish`), made on first use."""
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="tileshard-ahead")
        return self._ahead_pool

    # -- read-ahead (scrubbing) ------------------------------------------------------------
    def _start_read_ahead(self, selection) -> None:
        """After a single plane along dim 0 (``selection[0]`` an int): when the plane before it
        in either direction was the last one read, decode the next chunk row in that direction
        into the cache, on the read-ahead thread."""
        plane = self._plane_of(selection)
        if plane is None:
            self._last_plane = None
            return
        t, rest, items = plane
        last, self._last_plane = self._last_plane, (t, rest)
        if last is None or last[1] != rest or abs(t - last[0]) != 1:
            return
        depth = self.chunk_shape[0]
        ahead = (t // depth + 1) * depth if t > last[0] else (t // depth) * depth - 1
        if not 0 <= ahead < self.shape[0]:
            return
        row = ahead // depth * depth
        if self._ahead is not None and not self._ahead.done() and self._ahead_rows == (row, row + depth, rest):
            return  # on its way already
        self._ahead = self._background().submit(self._decode_into_cache, (ahead, *items[1:]))
        self._ahead_rows = (row, row + depth, rest)

    def _plane_of(self, selection) -> tuple[int, str, tuple] | None:
        """``(t, rest, items)`` when ``selection`` is one plane along dim 0 (an int, or a slice
        of one row, as napari's slicing asks): its row, the rest of the selection (as text, to
        compare) and the selection's items; else None."""
        items = selection if isinstance(selection, tuple) else (selection,)
        if not items or not self.shape or not self.shape[0] or Ellipsis in items[1:]:
            return None
        first = items[0]
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            t = int(first)
        elif isinstance(first, slice):
            start, stop, step = first.indices(self.shape[0])
            if stop - start != 1 or step != 1:
                return None
            t = start
        else:
            return None
        if not -self.shape[0] <= t < self.shape[0]:
            return None
        return t % self.shape[0], repr(items[1:]), items

    def _decode_into_cache(self, selection) -> None:
        """Read and decode ``selection``'s chunks that the cache lacks into the cache, on this
        thread alone (nothing is placed into an output)."""
        plan = self._plan(selection, use_cache=True)
        for _ in self._cpu_path().blocks(plan, None):
            pass

    def _wait_for_read_ahead(self, selection=Ellipsis) -> None:
        """Wait for the read-ahead in flight when ``selection`` may need its chunks (anything but
        a plane of another chunk row along dim 0): it is decoding them already.  A plane of a
        chunk row decoded before is read at once, beside it.  The read-ahead's errors are not
        the caller's: the caller's own read meets them again, if at all."""
        ahead = self._ahead
        if ahead is None:
            return
        plane = self._plane_of(selection)
        if plane is not None and not ahead.done():
            lo, hi, rest = self._ahead_rows
            if plane[1] == rest and not lo <= plane[0] < hi:
                return  # another chunk row: no chunk in common with the read-ahead
        self._ahead = None
        if ahead is not None:
            try:
                ahead.result()
            except Exception:  # noqa: BLE001 - see above
                pass

    def iter_blocks(self, selection=Ellipsis) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
        """``(region, block)`` per shard the selection touches, in storage order, with the next
        read prefetched: ``block`` is what ``read(selection)[region]`` holds."""
        return self._timed(self._blocks(selection), lambda item: item[1].nbytes)

    def _blocks(self, selection) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
        if self.fallback_reason is not None:
            out = np.asarray(self.array[selection])
            yield tuple(slice(0, n) for n in out.shape), out
            return
        plan = self.plan(selection)
        indices, dropped = normalize_selection(selection, self.shape)
        for block, data in self._cpu_path().blocks(plan, lambda b: output_pool().empty(b.shape, self.dtype)):
            region = tuple(r for r, d in zip(block.region, dropped) if not d)
            yield region, data.reshape(tuple(n for n, d in zip(block.shape, dropped) if not d))

    def iter_reads(self, plan: ReadPlan) -> Iterator[tuple[Read, np.ndarray]]:
        """Each read of ``plan`` (for example ``plan.owned_by(rank, world)``), fetched with
        prefetch and decoded: ``(read, chunks)`` with ``chunks[i]`` the decoded chunk
        ``read.chunks[i]`` of shard ``read.key`` (shape ``chunk_shape``)."""
        return self._timed(self._reads(plan), lambda item: item[1].nbytes)

    def _reads(self, plan: ReadPlan) -> Iterator[tuple[Read, np.ndarray]]:
        for read, buffer in self._fetched(plan.reads):
            chunks = np.empty((len(read.chunks),) + self.chunk_shape, dtype=self.dtype)
            started = time.perf_counter()
            self._cpu_path().decode_each(read, buffer, functools.partial(_store_chunk, chunks, self.chunk_dtype))
            self.stats.add(decode_seconds=time.perf_counter() - started)
            self._recycle([buffer])
            yield read, chunks

    def _timed(self, items: Iterator, nbytes: Callable) -> Iterator:
        """``items``, counted as one read in :attr:`stats`: the time spent producing each item
        (not the caller's time between items) and the bytes handed out."""
        self.stats.add(reads=1)
        while True:
            started = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                self.stats.add(busy_seconds=time.perf_counter() - started)
                return
            self.stats.add(busy_seconds=time.perf_counter() - started, bytes_out=nbytes(item))
            yield item

    # -- internals ---------------------------------------------------------------------------
    def _fetch(self, read: Read) -> np.ndarray:
        """The bytes of ``read`` in a recycled buffer (counted by the store objects)."""
        buffer = self._buffers.take(read.size)
        self._objects.read_into(read.key, read.start, buffer)
        return buffer

    def _disk_io(self) -> ThreadPoolExecutor:
        """The threads that fetch a large read's ranges of local files on a disk ahead of its
        decode (:meth:`~napari_tileshard.reader.cpu.CpuReadPath.blocks`), made on first use."""
        if self._disk_pool is None:
            self._disk_pool = ThreadPoolExecutor(DISK_FETCH_THREADS, thread_name_prefix="tileshard-disk")
        return self._disk_pool

    def _recycle(self, buffers) -> None:
        """Return read buffers once decoded (see :class:`~napari_tileshard.reader.fetch.ReadBuffers`)."""
        self._buffers.recycle(buffers)

    def _fetched(self, reads, fetch=None) -> Iterator[tuple]:
        """``(read, buffer)`` in order, ``prefetch`` reads fetched ahead (by ``fetch``, default
        :meth:`_fetch`): :func:`~napari_tileshard.reader.fetch.prefetched`.  The plan's reads
        (``fetch`` None) of a local store come with hints to the OS beyond those
        (:func:`~napari_tileshard.reader.fetch.hinted_ahead`)."""
        if self.prefetch and self._io is None:
            self._io = ThreadPoolExecutor(min(8, self.prefetch), thread_name_prefix="tileshard-read")
        if fetch is None and self._objects.hints and len(reads) > self.prefetch + 1:
            # more reads than the reader fetches at once: the OS reads the later ones meanwhile
            reads = hinted_ahead(reads, self._objects)
        return prefetched(reads, fetch or self._fetch, self.prefetch, self._io)

    def _cpu_path(self) -> CpuReadPath:
        if self._cpu is None:
            self._cpu = CpuReadPath(self)
        return self._cpu

    def _gpu_reader(self) -> GpuReadPath:
        if self._gpu is None:
            self._gpu = GpuReadPath(self)
        return self._gpu

    def close(self) -> None:
        self._wait_for_read_ahead()
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown()
            self._ahead_pool = None
        for pool in (self._io, self._disk_pool):
            if pool is not None:
                pool.shutdown()
        self._io = self._disk_pool = None
        self._objects.close()
        if self._cpu is not None:
            self._cpu.close()
            self._cpu = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _location(source, access: StoreAccess, array) -> str:
    """How messages name what a reader reads: the path or URL as given, else the store and the
    array's path in it."""
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        return str(source)
    path = array.store_path.path
    return f"{access.location}/{path}" if path else access.location
