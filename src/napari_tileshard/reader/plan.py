"""The read plan of :class:`~napari_tileshard.reader.shard_reader.ShardReader`: pure, deterministic, no I/O.

A sharded array's chunk byte ranges are known from each shard's index (the design source
``shared/design/chunked-loader.md`` calls it the metadata pass), which
:meth:`ShardSpec.decode_index <napari_tileshard.format.ShardSpec.decode_index>` validates.  This module

* packs the chunks a selection needs into *reads* (:func:`pack_runs`): contiguous byte ranges of
  one shard, in storage order, that bridge gaps up to ``gap_bytes`` and stop at
  ``max_read_bytes``; a chunk is never split (one larger than the cap gets a read of its own);
* numbers the reads globally (shards in row-major grid order, then by offset), so that
  :meth:`ReadPlan.owned_by` gives read ``i`` to worker ``i % world_size`` and every process
  agrees on ownership without talking.

Everything is computed from integers already checked, with NumPy over all chunks of a shard.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "DEFAULT_GAP_BYTES",
    "Block",
    "DimPart",
    "Read",
    "ReadPlan",
    "dim_parts",
    "distinct",
    "normalize_selection",
    "number_reads",
    "pack_runs",
    "progression_parts",
    "single_runs",
]

#: gaps between needed chunks up to this are read through rather than split into two requests.
#: One request costs ~10-100 µs locally and 10-50 ms on an object store, 1 MiB at 1-5 GB/s about
#: 0.2-1 ms: bridging 1 MiB is cheaper than a second request on any store.
DEFAULT_GAP_BYTES = 1 << 20


@dataclass(eq=False)
class Read:
    """One range request: bytes ``start..stop`` of shard ``key``, holding whole chunks.

    ``chunks``: the chunk numbers (row-major inside the shard) in storage order, ``offsets``
    where each starts inside the read, ``nbytes`` their sizes.  ``block``: which block of the
    plan (one per shard) the chunks are placed into, ``slots`` their box positions in it.
    """

    index: int
    key: str
    block: int
    start: int
    stop: int
    chunks: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    slots: np.ndarray

    @property
    def size(self) -> int:
        return self.stop - self.start

    def as_tuple(self) -> tuple:
        return (
            self.index,
            self.key,
            self.block,
            self.start,
            self.stop,
            tuple(self.chunks.tolist()),
            tuple(self.offsets.tolist()),
            tuple(self.nbytes.tolist()),
            tuple(self.slots.tolist()),
        )

    def __eq__(self, other):
        return isinstance(other, Read) and self.as_tuple() == other.as_tuple()

    def __repr__(self):
        return f"Read({self.index}, {self.key!r}, bytes {self.start}..{self.stop}, {len(self.chunks)} chunks)"


def pack_runs(
    offsets: np.ndarray, nbytes: np.ndarray, gap_bytes: int, max_read_bytes: int
) -> list[tuple[int, int, np.ndarray]]:
    """Pack chunks (``offsets``/``nbytes`` of the chunks needed, any order) into runs:
    ``[(start, stop, positions)]`` with ``positions`` into the inputs, in storage order.

    A run takes the next chunk while the gap before it is at most ``gap_bytes`` and the run stays
    within ``max_read_bytes``; a chunk is never split, so one larger than the cap is a run alone.
    """
    order = np.argsort(offsets, kind="stable")
    starts, ends = offsets[order], offsets[order] + nbytes[order]
    runs: list[tuple[int, int, np.ndarray]] = []
    if not order.size:
        return runs
    # Break where the gap is too wide (vectorised); then cut each group at the cap (a walk over
    # the group's chunk ends, which needs the running start, so it is a loop over runs only).
    breaks = np.flatnonzero(starts[1:] - ends[:-1] > gap_bytes) + 1
    if not breaks.size and int(ends[-1]) - int(starts[0]) <= max_read_bytes:
        return [(int(starts[0]), int(ends[-1]), order)]  # the common case: one run (a whole shard)
    for group in np.split(np.arange(order.size), breaks):
        first = int(group[0])
        last_possible = int(group[-1])
        while first <= last_possible:
            run_start = int(starts[first])
            # the last chunk (>= first) whose end stays within the cap: ends are increasing
            last = int(np.searchsorted(ends[first : last_possible + 1], run_start + max_read_bytes, side="right"))
            last = first + max(last, 1) - 1
            runs.append((run_start, int(ends[last]), order[first : last + 1]))
            first = last + 1
    return runs


def single_runs(
    offsets: np.ndarray, nbytes: np.ndarray, gap_bytes: int, max_read_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pack_runs` for many shards at once, where it gives one run per shard: ``offsets``
    and ``nbytes`` are ``(shards, chunks)`` (int64, -1 where absent), the chunks each shard needs.
    Returns ``(whole, order, starts, sizes)``: per shard whether its chunks are all stored and
    make one run (gaps up to ``gap_bytes``, within ``max_read_bytes``), the chunks' storage
    order (positions into the row) and their offsets and sizes in that order.  The run of a
    ``whole`` row is ``starts[0] .. starts[-1] + sizes[-1]`` with positions ``order``, exactly
    what :func:`pack_runs` returns for it; other rows need :func:`pack_runs`."""
    order = np.argsort(offsets, axis=1, kind="stable")
    starts = np.take_along_axis(offsets, order, axis=1)
    sizes = np.take_along_axis(nbytes, order, axis=1)
    if not offsets.shape[1]:
        return np.zeros(offsets.shape[0], dtype=bool), order, starts, sizes
    ends = starts + sizes
    whole = sizes.min(axis=1) >= 0
    whole &= np.all(starts[:, 1:] - ends[:, :-1] <= gap_bytes, axis=1)
    whole &= ends[:, -1] - starts[:, 0] <= max_read_bytes
    return whole, order, starts, sizes


@dataclass
class Block:
    """The part of the output one shard fills: along each dim a :class:`DimPart`; the box of
    chunks they need is the product of the parts' chunks, numbered row-major ("box positions")."""

    key: str
    shard: tuple[int, ...]
    parts: tuple[DimPart, ...]
    #: chunk number inside the shard (row-major) of each box position
    box_chunks: np.ndarray
    #: box positions whose chunk is absent (fill value); set when the index is known
    missing: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: box positions taken from a reader's chunk cache instead of being read (decoded chunk bytes);
    #: only in a reader's internal plans, never in ``ShardReader.plan``'s
    cached: dict = field(default_factory=dict)

    @property
    def region(self) -> tuple[slice, ...]:
        """Where the block lies in the output (before integer dims are dropped)."""
        return tuple(slice(p.lo, p.hi) for p in self.parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(p.hi - p.lo for p in self.parts)

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(len(p.chunks) for p in self.parts)

    def chunk_region(self, box_position: int) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """(region inside the block, region inside the decoded chunk) of one box position: the
        chunk's elements that the selection takes and where they go.  Selections are arithmetic
        progressions along each dim, so both are slices."""
        coords = np.unravel_index(box_position, self.box_shape)
        out, inside = [], []
        for part, b in zip(self.parts, coords):
            lo = int(np.searchsorted(part.chunk_of, b, side="left"))
            hi = int(np.searchsorted(part.chunk_of, b, side="right"))
            first, last = int(part.within[lo]), int(part.within[hi - 1])
            step = int(part.within[lo + 1] - first) if hi - lo > 1 else 1
            out.append(slice(lo, hi))
            inside.append(slice(first, last + 1, step))
        return tuple(out), tuple(inside)


@dataclass
class ReadPlan:
    """Reads in their global order and the blocks they fill; deterministic for a given array state
    and selection."""

    shape: tuple[int, ...]  # the output's shape before integer dims are dropped
    out_shape: tuple[int, ...]
    blocks: list[Block]
    reads: list[Read]

    def __iter__(self):
        return iter(self.reads)

    def __len__(self) -> int:
        return len(self.reads)

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.reads)

    def owned_by(self, rank: int, world_size: int) -> ReadPlan:
        """The reads worker ``rank`` of ``world_size`` owns: those with ``index % world_size == rank``
        (each read once over all ranks; the same answer in every process)."""
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in 0..{world_size - 1}, got {rank!r}")
        return ReadPlan(
            self.shape, self.out_shape, self.blocks, [r for r in self.reads if r.index % world_size == rank]
        )

    def as_tuples(self) -> list[tuple]:
        return [r.as_tuple() for r in self.reads]


def number_reads(per_block: Sequence[list[tuple]]) -> list[Read]:
    """Reads numbered in plan order: blocks in order, each block's runs in storage order; each
    run is ``(key, block, start, stop, chunks, offsets, nbytes, slots)``."""
    reads: list[Read] = []
    for runs in per_block:
        for run in runs:
            reads.append(Read(len(reads), *run))
    return reads


# -- selections --------------------------------------------------------------------------------
def normalize_selection(selection, shape: Sequence[int]) -> tuple[list[np.ndarray], list[bool]]:
    """Per dim the selected indices (increasing int64) and whether the dim is dropped (an int),
    for a basic selection as zarr-python takes it: ints, slices with step >= 1, Ellipsis."""
    items = selection if isinstance(selection, tuple) else (selection,)
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if any(item is Ellipsis for item in items):
        at = next(i for i, item in enumerate(items) if item is Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1 :]
    if len(items) > len(shape):
        raise IndexError(f"too many indices for an array of {len(shape)} dimensions: {selection!r}")
    items = items + (slice(None),) * (len(shape) - len(items))
    indices, dropped = [], []
    for dim, (item, size) in enumerate(zip(items, shape)):
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            if not -size <= item < size:
                raise IndexError(f"index {int(item)} is out of bounds for dimension {dim} with length {size}")
            indices.append(np.array([int(item) % size], dtype=np.int64))
            dropped.append(True)
        elif isinstance(item, slice):
            start, stop, step = item.indices(size)
            if step < 1:
                raise IndexError(f"only slices with step >= 1 are supported, got {item!r} for dimension {dim}")
            indices.append(np.arange(start, stop, step, dtype=np.int64))
            dropped.append(False)
        else:
            raise IndexError(f"unsupported selection {item!r} for dimension {dim}: ints, slices and ... only")
    return indices, dropped


@dataclass(frozen=True, eq=False)
class DimPart:
    """What one shard along one dim contributes: output positions ``lo..hi``, the chunks
    (global numbers) they fall in, and per output position the chunk (index into ``chunks``)
    and the element inside it.  Compared and hashed by identity: the CPU path keeps the pieces
    it cuts a part into (``cpu.dim_pieces``), for the other blocks of a read that share it."""

    shard: int
    lo: int
    hi: int
    chunks: np.ndarray
    chunk_of: np.ndarray
    within: np.ndarray


#: progressions longer than this are split afresh by every plan (not cached): the cache holds at
#: most 64 progressions, ~200 KiB each at this length (three int64 arrays)
PROGRESSION_CACHE_MAX_COUNT = 8192


def progression_parts(index: np.ndarray, shard_size: int, chunk_size: int) -> tuple[DimPart, ...]:
    """:func:`dim_parts` of an arithmetic progression (what ints and slices select along a dim),
    the same parts, read-only, for every plan that selects the same progression: a plane read's
    parts along the frame's dims are those of the plane before (napari's time slider), and the
    pieces the CPU path cuts them into (cached by part, ``cpu.dim_pieces``) with them."""
    count = int(index.size)
    if not count or count > PROGRESSION_CACHE_MAX_COUNT:
        return tuple(dim_parts(index, shard_size, chunk_size))
    step = int(index[1] - index[0]) if count > 1 else 1
    return _progression_parts(int(index[0]), count, step, shard_size, chunk_size)


@functools.lru_cache(maxsize=64)
def _progression_parts(first: int, count: int, step: int, shard_size: int, chunk_size: int) -> tuple[DimPart, ...]:
    parts = dim_parts(first + step * np.arange(count, dtype=np.int64), shard_size, chunk_size)
    for part in parts:
        for array in (part.chunks, part.chunk_of, part.within):
            array.flags.writeable = False
    return tuple(parts)


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of the 1-D array ``values``, as ``np.unique(values)``, without
    its first call's cost: recent NumPy (2.4) imports ``numpy.ma`` there, which took 62 ms on the
    2-core VM, a third of a process's first 128 MiB read."""
    ordered = np.sort(values)
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def dim_parts(index: np.ndarray, shard_size: int, chunk_size: int) -> list[DimPart]:
    """Split one dim's selected indices by shard (vectorised over the indices)."""
    if not index.size:
        return []
    shard_of = index // shard_size
    shards, starts = np.unique(shard_of, return_index=True)
    bounds = list(starts) + [index.size]
    parts = []
    for s, lo, hi in zip(shards.tolist(), bounds[:-1], bounds[1:]):
        chunk_numbers = index[lo:hi] // chunk_size
        chunks = distinct(chunk_numbers)
        parts.append(
            DimPart(
                s,
                int(lo),
                int(hi),
                chunks,
                np.searchsorted(chunks, chunk_numbers),
                index[lo:hi] - chunk_numbers * chunk_size,
            )
        )
    return parts
