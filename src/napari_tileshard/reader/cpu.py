"""The CPU path of :class:`~napari_tileshard.reader.shard_reader.ShardReader`: decode chunks on
threads and place them into the output.

A block (the part of a plan in one shard) is cut into units, sub-boxes of its chunks that are
contiguous in row-major box order (:func:`unit_boxes`); each unit is one task on the decode pool:
its chunks decoded by the codec's native ``decode_into`` into a per-thread scratch buffer
(reused, so no page faults), then placed into the output by a few strided NumPy copies
(:func:`untile_into`), one per head/middle/tail piece, never one per chunk.  The decoders and the
copies release the GIL.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from itertools import product

import numpy as np

from ..format.codecs import Codec, CodecError, HeadsPatch
from ..format.shard_spec import ChunkDecodeError
from .fetch import DISK_FETCH_AHEAD_BYTES, FREE_BUFFER_BYTES, DiskFetches
from .memory import output_pool
from .plan import Block, DimPart, Read, ReadPlan, distinct
from .tasks import TaskPool

__all__ = ["UNIT_BYTES", "BlockSource", "CpuReadPath", "apart_order", "dim_pieces", "unit_boxes", "untile_into"]

#: the most decoded bytes one decode task handles (its scratch buffer, reused per thread)
UNIT_BYTES = 8 << 20
#: ... and the least (unless the chunks are larger): a read is cut into about four units per
#: decode thread, and each unit costs Python under the GIL.  16 cores, single 2048² planes (16 MiB
#: decoded) with 64 KiB / 256 KiB tiles: 32.9 / 33.7 ms median with 256 KiB units, 11.9 / 12.3 with
#: 1 MiB, 11.9 / 12.5 with 2 MiB, 17.9 / 17.4 with 4 MiB (tensorstore 6.4 / 5.3); 2 cores cut
#: such reads into 2 MiB units already
UNIT_MIN_BYTES = 2 << 20
#: reads decoded by at least this many workers decode each unit of chunks of at most
#: RELEASED_DECODE_MAX_CHUNK_BYTES in one native call that holds no GIL
#: (Codec.decoded_chunks_released) instead of a call per chunk: decode threads taking the GIL
#: back after every small chunk wait for each other (16 cores: 64 KiB chunks 1.55-1.61x the
#: per-chunk path in three runs; 256 KiB 1.03-1.08x; 1 MiB 0.84-0.86x, where that memory (8 MiB
#: per unit) is faulted in afresh).  Two are enough: on the 2-core VM napari's time-slider steps
#: (a 16 MiB tile row into the chunk cache) had a plugin p99 of 20.1 / 20.5 ms with it against
#: 22.4 / 23.0 chunk by chunk (default layout, forward / random, 3 alternating runs; 2x128²
#: tiles 25.3 / 22.9 against 25.9 / 24.4, 6 runs).  (Before the batch decoded into one buffer it
#: was slower there: its chunks were then copied out one by one.)
RELEASED_DECODE_MIN_WORKERS = 2
RELEASED_DECODE_MAX_CHUNK_BYTES = 256 << 10
#: ... and so do reads of at least this many decoded bytes on one thread (whole 1 GiB reads on the
#: 2-core VM: 1.07x the per-chunk path, 11 and 15 rounds)
RELEASED_DECODE_MIN_READ_BYTES = 256 << 20
#: reads of at least this many decoded bytes by a decode pool: each block's task fetches its own
#: reads (see CpuReadPath.blocks).  16 cores, whole 2 GiB reads: the prefetch threads' way was
#: 0.82-0.94x of it.  napari's steps (4-16 MiB) keep two prefetch threads beside the decode
#: threads: on 2 cores scrubbing was no faster with the task's own fetch (plugin p99 27.7 / 33.2 /
#: 29.0 ms against 27.0 / 33.6 / 25.0, alternating runs)
FETCH_IN_DECODE_TASKS_MIN_BYTES = 64 << 20
#: whether a reader without a chunk cache (every reader but napari's) reads as large reads do
#: whatever the read's size, given a decode pool: each block a task fetching its own reads.  The
#: threshold above is for napari's steps, whose decoded units go into the cache.  2-core VM,
#: single 2048² planes (8 MiB) from /dev/shm, 60 alternating reads (``ab_cpu_planes.py``, with
#: the GIL-free batch): median 12.6 / 14.1 / 14.1 ms against 15.7 / 13.9 / 14.3 (64 KiB / 256 KiB
#: / default tiles; tensorstore 10.9 / 11.0 / 10.9), 24-25 thread switches a read against 64-99
UNCACHED_READS_AS_LARGE = True
#: decode threads added to a pool reading local files on a disk (not held in memory): a thread
#: waiting for the disk (its own fetch, or a read the disk threads have not finished) leaves its
#: core idle.  2-core VM, whole 1 GiB reads with the pages evicted: 1.10 / 1.07x with a third
#: thread (64 / 256 KiB tiles), 1.02 / 1.01x once the files are cached; with the disk threads
#: (DiskFetches) 1.07 / 1.08x (median of 3 rounds, ``results/cpu_2core_2026-11-27k/``)
DISK_EXTRA_DECODE_THREADS = 1
#: whether the read-ahead (napari's next tile row, decoded while napari draws) decodes its units on
#: the decode pool rather than on its own thread alone.  16 cores, napari's time-slider steps
#: forward (``bench_scrub.py --headless 25``, 64 KiB tiles): on its own thread the read-ahead of a
#: 16 MiB tile row was not done when the next step came (one thread's decode beside a thread busy
#: in Python), and the step waited for it, 28-43 ms, while steps without read-ahead decoded the
#: row on the pool in 11-13 ms.  With the pool (and the two switches below) the plugin's p99 of
#: forward steps was 15.8-19.9 ms against 41-50 (benchmarks/results/cpu_16core_2026-11-27g/)
READ_AHEAD_ON_POOL = True
#: the read-ahead's units (at most a block): each unit takes the GIL back a few times, and beside
#: a thread busy in Python (napari drawing) every time may wait up to the interpreter's switch
#: interval.  2-core VM, a 16 MiB tile row read ahead while the main thread runs Python, median:
#: 84-88 ms in 2 MiB units, 60-67 in 4 MiB units, 53-55 with the batch's memory adopted as well
#: (below), 115-118 on the read-ahead's own thread (benchmarks/results/cpu_2core_2026-11-27g/)
READ_AHEAD_UNIT_BYTES = 4 << 20
#: whether the read-ahead's cache keeps the memory the codec's GIL-free batch decoded into (no
#: copy into the output pool's memory, one time less taking the GIL back per unit; that memory is
#: the decoded bytes' size, allocated afresh): 61-63 against 84-88 ms in the same probe (2 MiB units)
READ_AHEAD_ADOPTS_BATCH = True
#: whether a unit whose reads need only the first part of each chunk (in C order: a plane of
#: tiles several frames deep) has its chunks decoded only that far, where the codec can stop
#: early (Codec.decoded_prefixes: zstd, block by block, a libzstd call per chunk).  Not for units
#: going into the chunk cache (napari's), which keeps whole chunks for the next steps.  2-core
#: VM, single planes, two passes: 1.46-1.48x faster for 1 MiB tiles 8 frames deep, 1.21-1.22x
#: for 256 KiB ones, 1.06-1.14x for 256 KiB tiles 2 frames deep (results/cpu_2core_2026-11-28c/)
PREFIX_DECODE = True
#: ... with more decode workers than this, only where each chunk's call leaves at least
#: PREFIX_MIN_SAVED_BYTES undecoded: each call takes the GIL back among the other threads.
#: 16 cores, single planes (results/cpu_16core_2026-11-28c/): 30 % less CPU but 1.0-1.06x the
#: time for 1 MiB chunks, 1.16-1.47x the time for 256 KiB chunks 8 frames deep (4x the calls)
PREFIX_ANY_SAVING_MAX_THREADS = 2
PREFIX_MIN_SAVED_BYTES = 512 << 10
#: whether a unit whose reads need no more than the first block of each chunk (a plane of tiles
#: two frames deep, as the recorder's default layout: the first frame's half of each chunk) has
#: them decoded that far by one GIL-free call for the whole unit (Codec.decoded_heads), whatever
#: the decode threads, where beyond 2 workers such chunks are decoded whole (PREFIX_MIN_SAVED_BYTES).
#: Off until it is measured faster somewhere: 2-core VM, single planes, the same time as a call per
#: chunk (default layout 7.7 / 7.0 and 8.6 / 8.6 ms, 1m-16m 19.5 / 18.4 and 16.9 / 16.8); 16 cores,
#: with the patch worked out per unit, 13-19 % less CPU but 1.05-1.46x the time, the GIL's queue
#: longer (results/cpu_16core_2026-12-07/); worked out per block (now), the same time as whole
#: chunks (default / 256k / 1m-16m planes 0.97-1.04x), 14-23 % less CPU for default and 256k
#: (results/cpu_16core_2026-12-07b/)
HEAD_DECODE = False
#: on a machine whose process may use at most this many CPUs (Linux: ``os.sched_getaffinity``), each
#: decode thread runs on a CPU of its own (``TaskPool(cpus=)``; the one more for a disk runs
#: anywhere).  Linux wakes a thread on the CPU of the thread that woke it where that one is about
#: to wait: once the other CPU had been idle for 20-50 ms, the second of two decode threads ran on
#: the first one's CPU in 82-83 % of steps (the other CPU idle), and a 16 MiB tile row decoded by
#: two threads took 13.6-15.1 ms, as long as on one, against 7 back to back.  Pinned: 8.2-8.6 ms,
#: p99 11.5-13.1; napari's scrubbing p99 18.3-19.2 against 22.8-24.1 ms (2-core VM,
#: ``benchmarks/two_thread_decode.py``, ``bench_scrub.py``; results/cpu_2core_2026-12-07e/).
#: Beyond it (not measured there) the scheduler spreads them, as it can move a thread off a busy CPU.
PIN_DECODE_THREADS_MAX_CPUS = 2


def apart_order(blocks: Sequence[Block]) -> list[int]:
    """The blocks' indices in an order where blocks next to each other lie apart in one C-order
    output: by their place along the last dim first and along the first dim last, so that
    consecutive blocks differ along the outermost dim they can.  Two blocks side by side along
    the last dims share the output's pages (a 2048-wide uint16 plane: each row one page, half
    of it each shard's); decoded at the same time, both threads fault the same fresh pages in and
    the kernel zeroes them twice (2-core VM, a whole 1 GiB read in a fresh process: 430-480k
    page faults per GB in plan order, 253-288k in this one)."""
    return sorted(range(len(blocks)), key=lambda b: tuple(part.lo for part in reversed(blocks[b].parts)))


#: a decode unit: its box positions ``(first, stop)`` and its box ranges per dim
Unit = tuple[tuple[int, int], tuple[tuple[int, int], ...]]


def pinned_cpus(threads: int) -> tuple[int, ...]:
    """The CPUs the first of ``threads`` decode threads run on, one each (see
    PIN_DECODE_THREADS_MAX_CPUS): the process's, where it has 2 to that many and there are 2
    threads or more; else none."""
    if threads < 2 or not hasattr(os, "sched_getaffinity"):
        return ()
    allowed = sorted(os.sched_getaffinity(0))
    return tuple(allowed) if 2 <= len(allowed) <= PIN_DECODE_THREADS_MAX_CPUS else ()


@functools.lru_cache(maxsize=256)
def unit_boxes(box_shape: tuple[int, ...], max_rows: int) -> tuple[Unit, ...]:
    """Cut a block's box of chunks into units of at most ``max_rows`` chunks (at least one whole
    row of the split dim) that are contiguous in row-major box order: ``((first, stop), ranges)``
    with ``ranges[d] = (lo, hi)`` the unit's box indices along dim ``d``.  Dims before the split
    dim are single indices, dims after it whole, so a unit is a sub-box.  Cached: a read's blocks
    mostly share one box shape, and this ran on the caller's thread, under the GIL the decode
    threads wait for, once per block."""
    ndim = len(box_shape)
    if ndim == 0:
        return (((0, 1), ()),)
    after = [math.prod(box_shape[d + 1 :]) for d in range(ndim)]
    split = next(d for d in range(ndim) if after[d] <= max(1, max_rows))
    per = max(1, max(1, max_rows) // after[split])
    units = []
    for prefix in np.ndindex(*box_shape[:split]):
        for lo in range(0, box_shape[split], per):
            hi = min(lo + per, box_shape[split])
            first = int(np.ravel_multi_index(prefix + (lo,) + (0,) * (ndim - split - 1), box_shape))
            ranges = tuple((p, p + 1) for p in prefix) + ((lo, hi),) + tuple((0, n) for n in box_shape[split + 1 :])
            units.append(((first, first + (hi - lo) * after[split]), ranges))
    return tuple(units)


@functools.lru_cache(maxsize=256)  # blocks of a read share their parts along most dims
def dim_pieces(part: DimPart, lo: int, hi: int, chunk: int) -> tuple[tuple[slice, object, slice, bool], ...]:
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
    return tuple(pieces)


@functools.lru_cache(maxsize=256)  # the same parts and ranges for every plane of a read's shape
def last_within(part: DimPart, lo: int, hi: int) -> int:
    """The last element inside a chunk along ``part``'s dim that the part reads from its box
    indices ``lo..hi`` (-1: none)."""
    first, stop = np.searchsorted(part.chunk_of, [lo, hi], side="left").tolist()
    return int(part.within[first:stop].max()) if stop > first else -1


def needed_prefix(block: Block, ranges, chunk_shape: tuple[int, ...], itemsize: int) -> int:
    """The bytes at the start of each chunk of a unit (box ``ranges`` of ``block``) that hold
    every element it reads: up to the last element in C order, whose index along each dim is
    the last one read along it (an index grows with each dim's, so the last of each dim's
    elements read is the last of all)."""
    last, stride = 0, 1
    for part, (lo, hi), extent in zip(reversed(block.parts), reversed(ranges), reversed(chunk_shape)):
        last += last_within(part, lo, hi) * stride
        stride *= extent
    return (last + 1) * itemsize


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


class BlockSource:
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
        self._heads: HeadsPatch | None | bool = False  # False: not worked out yet (heads_patch)
        self._heads_lock = threading.Lock()

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

    def cached_rows(self, first: int, stop: int) -> np.ndarray | None:
        """Box positions ``first..stop`` as one array of rows when all of them come from the
        cache and lie back to back in one array there (a unit the cache adopted, read again
        with the same units: the step back to a plane of a tile row already decoded): no copy
        of them into scratch.  Else None."""
        if stop <= first or np.any(self.buffer_of[first:stop] != -2):
            return None
        rows = [self.block.cached[position] for position in range(first, stop)]
        head = rows[0]
        base = head.base  # the unit's memory (the array it was decoded into, or its pool mapping's)
        if base is None or not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
            return None
        step = head.nbytes
        address = head.__array_interface__["data"][0]
        start = address - base.__array_interface__["data"][0]
        if start < 0 or start + len(rows) * step > base.nbytes:
            return None
        for j, row in enumerate(rows):
            if (
                row.base is not base
                or not row.flags.c_contiguous
                or row.nbytes != step
                or row.__array_interface__["data"][0] != address + j * step
            ):
                return None
        return base.reshape(-1).view(np.uint8)[start : start + len(rows) * step].reshape(len(rows), step)

    def decoded_released(
        self, first: int, stop: int, chunk_bytes: int, scratch: np.ndarray | None
    ) -> np.ndarray | None:
        """Box positions ``first..stop`` decoded in one GIL-free codec call, as ``(rows,
        chunk_bytes)`` uint8 over the call's own memory, or in ``scratch`` (``(rows,
        chunk_bytes)`` uint8; None: a new array) where the call used several buffers
        (:meth:`~napari_tileshard.format.codecs.Codec.decoded_chunks_released`): when all of
        them were read into one buffer and the codec has such a call.  Else None (:meth:`decode`
        then decodes them into the caller's rows)."""
        chunks = self.in_one_buffer(first, stop)
        return None if chunks is None else self.codec.decoded_chunks_released(*chunks, chunk_bytes, scratch)

    def decoded_prefixes(
        self, first: int, stop: int, chunk_bytes: int, need: int, scratch: np.ndarray, min_saved: int = 1
    ) -> tuple[np.ndarray, int] | None:
        """Box positions ``first..stop`` decoded as far as their first ``need`` bytes into
        ``scratch`` (:meth:`~napari_tileshard.format.codecs.Codec.decoded_prefixes`): when all of
        them were read into one buffer and the codec can stop early.  Else None."""
        chunks = self.in_one_buffer(first, stop)
        return None if chunks is None else self.codec.decoded_prefixes(*chunks, chunk_bytes, need, scratch, min_saved)

    def in_one_read(self) -> bool:
        """Whether every chunk of the block is stored and was read into one buffer (what
        :meth:`decoded_heads` takes)."""
        return len(self.views) == 1 and self.present == len(self.buffer_of)

    def decoded_heads(self, first: int, stop: int, chunk_bytes: int, scratch: np.ndarray) -> np.ndarray | None:
        """Box positions ``first..stop`` of a block :meth:`in_one_read` decoded as far as each
        chunk's head in one codec call
        (:meth:`~napari_tileshard.format.codecs.Codec.decoded_heads`) into ``scratch``; what to
        patch worked out once per block, by the first unit asking.  None where the codec refused."""
        if self._heads is False:
            with self._heads_lock:
                if self._heads is False:
                    self._heads = self.codec.heads_patch(self.views[0], self.offset_of, self.nbytes_of, chunk_bytes)
        patch = self._heads
        if not isinstance(patch, HeadsPatch):
            return None
        return self.codec.decoded_heads(self.views[0], patch, first, stop, scratch)

    def in_one_buffer(self, first: int, stop: int) -> tuple[memoryview, np.ndarray, np.ndarray] | None:
        """``(buffer, offsets, sizes)`` of box positions ``first..stop`` where all of them were
        read into one buffer (the codecs' batch calls take one source); else None."""
        where = self.buffer_of[first:stop]
        buffer = int(where[0]) if where.size else -1
        if buffer < 0 or (where != buffer).any():
            return None
        return self.views[buffer], self.offset_of[first:stop], self.nbytes_of[first:stop]

    def decode(self, first: int, stop: int, rows: np.ndarray, fill: np.ndarray, released: bool = False) -> None:
        """Box positions ``first..stop`` decoded into ``rows`` (fill value where absent): one
        :meth:`~napari_tileshard.format.codecs.Codec.decode_chunks` call per read buffer they
        come from (one, mostly), not one call per chunk; ``released``: by
        :meth:`~napari_tileshard.format.codecs.Codec.decode_chunks_released` (the read-ahead, and reads by
        many decode threads: see RELEASED_DECODE_MIN_WORKERS)."""
        decode_chunks = self.codec.decode_chunks_released if released else self.codec.decode_chunks
        where = self.buffer_of[first:stop]
        if where.min() < 0:
            for j in np.flatnonzero(where < 0).tolist():
                rows[j] = fill if where[j] == -1 else self.block.cached[first + j]
        offsets = self.offset_of[first:stop].tolist()
        for buffer in distinct(where[where >= 0]).tolist():
            sizes = np.where(where == buffer, self.nbytes_of[first:stop], -1).tolist()
            try:
                decode_chunks(self.views[buffer], offsets, sizes, rows, absent=-1)
            except CodecError as exc:
                chunk = int(self.block.box_chunks[first + (exc.chunk or 0)])
                raise ChunkDecodeError(self.block.key, chunk, str(exc)) from None


class _BlockTask:
    """One block read on the decode pool: its output, its reads, and its end, once every unit of
    it is decoded or one failed (the last unit to finish recycles its buffers).

    The end is signalled by a lock held from the start and released by :meth:`finish`, which
    :meth:`wait` takes: two C calls, where a Future per block (a Condition and its lock made,
    taken to set and to read the result) was a tenth of a 16-core read's GIL time, most of it on
    the thread that queues the blocks (py-spy ``--gil``, 4 MiB shards)."""

    __slots__ = (
        "block",
        "buffers",
        "cancelled",
        "error",
        "disk",
        "nbytes",
        "out",
        "present",
        "reads",
        "remaining",
        "_end",
        "_units",
    )

    def __init__(self, block: Block, out: np.ndarray, reads: list[Read], disk: DiskFetches | None = None):
        self.block, self.out, self.reads = block, out, reads
        self.disk = disk  # the reads fetched by the reader's disk threads; None: the task fetches them
        self.nbytes = sum(read.size for read in reads)
        self.buffers: list[np.ndarray] = []
        self.present = 0  # chunks of the block its reads hold (counted by the caller's thread)
        self.remaining = 0
        self.error: BaseException | None = None
        self.cancelled = False  # the read ended before this task started: it only finishes
        self._end = threading.Lock()
        self._end.acquire()
        self._units: threading.Lock | None = None  # counts units done, where there are several

    def expect_units(self, count: int) -> None:
        self.remaining = count
        self._units = threading.Lock()

    def unit_done(self, reader, error: BaseException | None) -> None:
        assert self._units is not None
        with self._units:
            self.remaining -= 1
            if error is not None and self.error is None:
                self.error = error
            last = self.remaining == 0
        if last:
            self.finish(reader, self.error)

    def finish(self, reader, error: BaseException | None) -> None:
        if self.buffers:
            try:
                reader._recycle(self.buffers)
            except ReferenceError:  # a read given up, its reader dropped since: the buffers go with it
                pass
        self.buffers = []
        self.error = error
        self._end.release()

    def done(self) -> bool:
        return not self._end.locked()

    def wait(self) -> None:
        """Until the block is done; raises what failed in it."""
        self._end.acquire()
        self._end.release()  # done stays done
        if self.error is not None:
            raise self.error


class CpuReadPath:
    """Reads plans on the CPU for one :class:`~napari_tileshard.reader.shard_reader.ShardReader`
    (its reads fetched with prefetch through the reader, its chunk geometry, codec, cache and
    statistics): :meth:`read` a whole plan, :meth:`blocks` block by block, :meth:`decode_each`
    the chunks of one read."""

    def __init__(self, reader):
        # weakly: the reader owns its path, and a reader a script drops must go at once, with
        # its decode threads and the directories it holds open (not when the collector runs)
        self.reader = weakref.proxy(reader)
        self.codec: Codec = reader.codec
        self.chunk_bytes, self.chunk_shape = reader.chunk_bytes, reader.chunk_shape
        self.chunk_dtype = reader.chunk_dtype
        self.workers, self.cache, self.stats = reader.workers, reader.cache, reader.stats
        self.fill_bytes = np.full(reader.chunk_elements, reader.fill_value, dtype=self.chunk_dtype).view(np.uint8)
        #: threads of the decode pool: ``workers``, and DISK_EXTRA_DECODE_THREADS more for local
        #: files on a disk (not held in memory: the OS takes read-ahead hints for them)
        self.decode_threads = self.workers + (DISK_EXTRA_DECODE_THREADS if reader._objects.hints else 0)
        self._local = threading.local()  # per decode thread: its scratch buffer
        self._pool: TaskPool | None = None
        #: the least a chunk decoded in part must leave undecoded (see PREFIX_MIN_SAVED_BYTES), and
        #: whether any chunk of this array can (else no unit works out what it needs)
        self.min_saved = 1 if self.workers <= PREFIX_ANY_SAVING_MAX_THREADS else PREFIX_MIN_SAVED_BYTES
        self.decodes_in_part = self.codec.prefix_saving(self.chunk_bytes, 1) >= self.min_saved
        #: the first bytes of each chunk that one call decodes for a whole unit (0: none); set to 0
        #: once the codec refused a unit (this array's frames are not of the kind it takes)
        self.head_bytes = self.codec.head_bytes(self.chunk_bytes)

    def read(self, plan: ReadPlan) -> np.ndarray:
        """All of ``plan`` as one array of the plan's output shape."""
        out = output_pool().empty(plan.shape, dtype=self.reader.dtype)  # reused memory where it can be
        for _ in self.blocks(plan, lambda b: out[b.region], apart=True):
            pass
        return out.reshape(plan.out_shape)

    def blocks(
        self, plan: ReadPlan, target: Callable[[Block], np.ndarray] | None, apart: bool = False
    ) -> Iterator[tuple[Block, np.ndarray]]:
        """Fill each block of ``plan`` (``target(block)``: the array it is written into) and yield
        it, in plan order, once all of it is decoded.  ``apart``: the targets are parts of one
        array; where blocks are decoded at the same time (each block a task, below) they are
        taken and yielded in :func:`apart_order`, so that no two of them fault the same
        pages in.  ``target`` None (read-ahead): decode
        the chunks into the cache only, with
        :meth:`~napari_tileshard.format.codecs.Codec.decode_chunks_released` (the GIL is taken
        back a few times per unit, not per chunk, beside napari drawing), and place nothing (the
        blocks yielded are empty); its units go to the decode pool (READ_AHEAD_ON_POOL).

        With a decode pool and a read of ``FETCH_IN_DECODE_TASKS_MIN_BYTES`` or more (any read
        of a reader without a chunk cache: ``UNCACHED_READS_AS_LARGE``), each block
        is one task there that fetches its reads and decodes its first unit, its other units then
        queued as tasks of their own (:meth:`_start_block`): reads are fetched by as many threads
        as decode, and the calling thread only queues blocks and waits for them.  Otherwise (one
        thread, the read-ahead, smaller reads) a block's reads are fetched ahead (``prefetch``)
        while the one before is decoded.

        Compressed bytes in flight stay within ``max_read_bytes`` and half the recycled read
        buffers (at least one block), so a whole-array read holds at most that much compressed
        data and reuses its read buffers instead of allocating fresh ones."""
        into_cache_only = target is None
        total = sum(b.box_chunks.size for b in plan.blocks) * self.chunk_bytes
        as_large = UNCACHED_READS_AS_LARGE and self.cache is None  # with a decode pool: below
        released = into_cache_only or (
            self.chunk_bytes <= RELEASED_DECODE_MAX_CHUNK_BYTES
            and (self.workers >= RELEASED_DECODE_MIN_WORKERS or total >= RELEASED_DECODE_MIN_READ_BYTES)
        )
        if into_cache_only:
            unit = READ_AHEAD_UNIT_BYTES
        else:
            unit = min(UNIT_BYTES, max(UNIT_MIN_BYTES, total // (self.workers * 4)))
        rows = max(self.chunk_bytes, unit) // self.chunk_bytes
        reads_of: list[list[Read]] = [[] for _ in plan.blocks]
        for read in plan.reads:
            reads_of[read.block].append(read)
        window = max(1, min(self.reader.max_read_bytes, FREE_BUFFER_BYTES // 2))
        if self.workers > 1 and not into_cache_only and (total >= FETCH_IN_DECODE_TASKS_MIN_BYTES or as_large):
            order = apart_order(plan.blocks) if apart else range(len(plan.blocks))
            yield from self._blocks_on_pool(plan, target, order, reads_of, rows, released, window)
        else:
            yield from self._blocks_in_turn(plan, target, reads_of, rows, released, window)

    def _blocks_on_pool(
        self, plan: ReadPlan, target, order: Sequence[int], reads_of, rows: int, released: bool, window: int
    ):
        """:meth:`blocks` with a decode pool: a task per block, taken in ``order``, queued up to
        ``window`` compressed bytes ahead of the block the caller waits for."""
        reader, pool = self.reader, self._decode_pool()
        # Local files on a disk: the reader's disk threads fetch the reads the page cache lacks a
        # little ahead of the decode threads, so none of them waits for the disk.  The rest
        # (cached, in memory, object stores): the decode threads fetch their own reads at once.
        disk = None
        if reader._objects.hints:
            reads = [read for b in order for read in reads_of[b]]
            # each decode thread's next read on its way, however large the shards (within the window)
            largest = max((read.size for read in reads), default=0)
            ahead = min(window, max(DISK_FETCH_AHEAD_BYTES, self.decode_threads * largest))
            disk = DiskFetches(reads, reader._objects, reader._fetch, reader._disk_io(), ahead)
        pending: list[_BlockTask] = []
        in_flight = 0
        # the counts of the decode threads' work, added here once (no lock taken there, nor per block)
        waited, cache_hits, chunks = 0.0, 0, 0

        def finish() -> tuple[Block, np.ndarray]:
            nonlocal in_flight, waited, cache_hits, chunks
            task = pending.pop(0)
            started = time.perf_counter()
            try:
                task.wait()
            finally:
                waited += time.perf_counter() - started
                cache_hits += len(task.block.cached)
                chunks += task.present
            in_flight -= task.nbytes
            return task.block, task.out

        try:
            for b in order:
                block = plan.blocks[b]
                task = _BlockTask(block, target(block), reads_of[b], disk)
                pool.post(self._start_block, task, rows, released)
                pending.append(task)
                in_flight += task.nbytes
                while pending and (in_flight > window or pending[0].done()):
                    yield finish()
            while pending:
                yield finish()
        finally:
            for task in pending:  # not started yet: left undone
                task.cancelled = True
            if disk is not None:
                disk.close()
            self.stats.add(
                decode_seconds=waited,
                cache_hits=cache_hits,
                chunks_decoded=chunks,
                bytes_decoded=chunks * self.chunk_bytes,
            )

    def _start_block(self, task: _BlockTask, rows: int, released: bool) -> None:
        """A block's task on the decode pool: fetch its reads, queue its units after the first
        (:meth:`_finish_unit` each) and decode the first here."""
        block, reader = task.block, self.reader
        if task.cancelled:
            task.finish(reader, None)
            return
        try:
            for read in task.reads:  # fetched buffers go back with the block, whatever happens next
                buffer = None if task.disk is None else task.disk.take(read)
                task.buffers.append(reader._fetch(read) if buffer is None else buffer)
            source = BlockSource(block, list(zip(task.reads, task.buffers)), self.codec)
            task.present = source.present
            units = unit_boxes(block.box_shape, rows)
            if not source.present and not block.cached:  # no chunk of this block is stored: fill only
                task.out[...] = reader.fill_value
                units = ()
        except BaseException as exc:
            task.finish(reader, exc)
            return
        if len(units) <= 1:  # the whole block at once (reads of many blocks): no other unit to wait for
            task.finish(reader, self._decode_task_unit(task, source, released, units[0]) if units else None)
            return
        task.expect_units(len(units))
        work = functools.partial(self._finish_unit, task, source, released)
        for unit in units[1:]:
            try:
                self._decode_pool().post(work, unit)
            except RuntimeError:  # the pool is shutting down: this thread decodes the rest
                work(unit)
        work(units[0])

    def _finish_unit(self, task: _BlockTask, source: BlockSource, released: bool, unit) -> None:
        task.unit_done(self.reader, self._decode_task_unit(task, source, released, unit))

    def _decode_task_unit(self, task: _BlockTask, source: BlockSource, released: bool, unit) -> BaseException | None:
        """Decode one unit of a block task into its output; what went wrong, if anything (handed
        to the caller through the block)."""
        try:
            self._decode_unit(task.block, task.out, source, False, released, unit)
        except BaseException as exc:  # noqa: BLE001 - see above
            return exc
        return None

    def _blocks_in_turn(self, plan: ReadPlan, target, reads_of, rows: int, released: bool, window: int):
        """:meth:`blocks` on the calling thread, or with a decode pool for reads smaller than
        ``FETCH_IN_DECODE_TASKS_MIN_BYTES``: each block's reads fetched ahead (``prefetch``), its
        units decoded here or queued on the pool."""
        reader, stats = self.reader, self.stats
        into_cache_only = target is None
        fetched = reader._fetched(plan.reads)
        pool = self._decode_pool() if self.workers > 1 and (READ_AHEAD_ON_POOL or not into_cache_only) else None
        nothing = np.empty(0, dtype=self.reader.dtype)
        pending: list[tuple[Block, np.ndarray, list, int, list]] = []
        in_flight = 0

        def finish(entry) -> tuple[Block, np.ndarray]:
            nonlocal in_flight
            block, out, futures, nbytes, buffers = entry
            started = time.perf_counter()
            for future in futures:
                future.result()
            reader._recycle(buffers)
            stats.add(decode_seconds=time.perf_counter() - started)
            in_flight -= nbytes
            return block, out

        try:
            for b, block in enumerate(plan.blocks):
                out = nothing if target is None else target(block)
                buffers = [next(fetched) for _ in reads_of[b]]
                source = BlockSource(block, buffers, self.codec)
                units = unit_boxes(block.box_shape, rows)
                work = functools.partial(self._decode_unit, block, out, source, into_cache_only, released)
                stats.add(cache_hits=len(block.cached))
                if not source.present and (not block.cached or into_cache_only):
                    if not into_cache_only:  # no chunk of this block is stored: fill only
                        out[...] = reader.fill_value
                    units = ()
                if pool is None:
                    started = time.perf_counter()
                    for unit in units:
                        work(unit)
                    stats.add(decode_seconds=time.perf_counter() - started)
                    futures = []
                else:
                    futures = [pool.submit(work, unit) for unit in units]
                pending.append((block, out, futures, source.nbytes, [b for _, b in buffers]))
                in_flight += source.nbytes
                stats.add(chunks_decoded=source.present, bytes_decoded=source.present * self.chunk_bytes)
                while pending and (in_flight > window or not pending[0][2]):
                    yield finish(pending.pop(0))
            while pending:
                yield finish(pending.pop(0))
        finally:
            for _, _, futures, _, _ in pending:
                for future in futures:
                    future.cancel()

    def _decode_unit(
        self, block: Block, out: np.ndarray, source: BlockSource, into_cache_only: bool, released: bool, unit
    ) -> None:
        """Decode the chunks of ``unit`` (``(first, stop)`` box positions and its box ranges)
        into scratch and place them into ``out`` (the block's output), or only into the cache;
        ``released``: in one GIL-free codec call (see RELEASED_DECODE_MIN_WORKERS)."""
        (first, stop), ranges = unit
        rows = stop - first
        in_cache = source.cached_rows(first, stop) if source.block.cached and not into_cache_only else None
        if in_cache is not None:
            chunks = in_cache.view(self.chunk_dtype).reshape((rows,) + self.chunk_shape)
            untile_into(out, chunks, block, ranges, self.chunk_shape)
            return
        places = source.decoded_places(first, stop) if self.cache is not None else []
        if into_cache_only and not places:
            return  # nothing of this unit to decode into the cache
        if PREFIX_DECODE and (self.decodes_in_part or self.head_bytes) and not places and not into_cache_only:
            need = needed_prefix(block, ranges, self.chunk_shape, self.chunk_dtype.itemsize)
            partial = None
            if HEAD_DECODE and need <= self.head_bytes:
                partial = self._decoded_heads(source, first, stop)
            if partial is None and self.decodes_in_part:
                partial = (
                    source.decoded_prefixes(first, stop, self.chunk_bytes, need, self._scratch(rows), self.min_saved)
                    if self.codec.prefix_saving(self.chunk_bytes, need) >= self.min_saved
                    else None
                )
            if partial is not None:
                decoded, nbytes = partial
                self.stats.add(partial_chunks=rows, bytes_decoded=nbytes - rows * self.chunk_bytes)
                chunks = decoded.view(self.chunk_dtype).reshape((rows,) + self.chunk_shape)
                untile_into(out, chunks, block, ranges, self.chunk_shape)
                return
        if released and not places:
            # placed straight from the codec's own memory where it decoded into one buffer, not
            # copied into scratch first
            direct = source.decoded_released(first, stop, self.chunk_bytes, self._scratch(rows))
            if direct is not None:
                chunks = direct.view(self.chunk_dtype).reshape((rows,) + self.chunk_shape)
                untile_into(out, chunks, block, ranges, self.chunk_shape)
                return
        if into_cache_only and READ_AHEAD_ADOPTS_BATCH and len(places) == rows:
            direct = source.decoded_released(first, stop, self.chunk_bytes, None)
            if direct is not None:
                assert self.cache is not None
                self.cache.adopt_rows([place for _, place in places], direct)
                return
        if places and len(places) == rows:
            # every chunk of the unit goes into the cache: decode into memory the cache then
            # keeps, instead of into scratch and a copy of it (a 16 MiB copy per new tile row
            # when napari's time slider steps)
            decoded = output_pool().empty((rows, self.chunk_bytes), np.uint8)
        else:
            decoded = self._scratch(rows)
        source.decode(first, stop, decoded, self.fill_bytes, released=released)
        if places:
            assert self.cache is not None
            keys, kept = [place for _, place in places], [j for j, _ in places]
            if len(places) == rows:
                self.cache.adopt_rows(keys, decoded)
            else:
                self.cache.put_many(keys, decoded, kept)
        if into_cache_only:
            return
        chunks = decoded.view(self.chunk_dtype).reshape((rows,) + self.chunk_shape)
        untile_into(out, chunks, block, ranges, self.chunk_shape)

    def _decoded_heads(self, source: BlockSource, first: int, stop: int) -> tuple[np.ndarray, int] | None:
        """Box positions ``first..stop`` decoded as far as their first ``head_bytes`` in one call
        (:meth:`~napari_tileshard.format.codecs.Codec.decoded_heads`) into scratch, and the bytes
        decoded; None where the block's chunks are not all in one buffer, or the codec refused
        (then never tried again for this array: its frames are not of the kind the call takes,
        e.g. nvCOMP's)."""
        if not source.in_one_read():
            return None
        rows = stop - first
        heads = source.decoded_heads(first, stop, self.chunk_bytes, self._scratch(rows))
        if heads is None:
            self.head_bytes = 0
            return None
        return heads, rows * self.head_bytes

    def _scratch(self, rows: int) -> np.ndarray:
        """``rows`` chunks of this decode thread's scratch buffer (reused: no page faults)."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.shape[0] < rows:
            scratch = self._local.scratch = output_pool().empty((rows, self.chunk_bytes), np.uint8)
        return scratch[:rows]

    def decode_each(self, read: Read, buffer, place: Callable[[int, np.ndarray], None]) -> None:
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
        self.stats.add(chunks_decoded=n, bytes_decoded=n * self.chunk_bytes)

    def _decode_pool(self) -> TaskPool:
        if self._pool is None:
            self._pool = TaskPool(self.decode_threads, "tileshard-decode", pinned_cpus(self.decode_threads))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
