"""Output memory of the CPU read path: large arrays from a pool of mappings that dropped results
give back.

A read's output is fresh memory, and touching fresh memory is where much of a read's CPU went:
the kernel faults every page in and zeroes it.  On the 2-core VM that cost 0.5-0.7 CPU-s per GiB
with 4 KiB pages and 0.16-2.6 with the huge pages NumPy asks for (huge pages come from the blocks
the VM gave back to its host, which the host faults in again), as much as decoding the chunks:
``perf`` of a whole read put ``clear_page_erms`` at 37 % of its samples.  An array handed out by
:meth:`OutputPool.empty` lies in an anonymous mapping that the pool keeps; once nothing refers to
that memory any more (the array, its views, a buffer taken from it: CPython counts them all as
references to the mapping), the next output of a size that fits reuses it, faulted in already.
A large mapping given back (a whole-array read's) has its pages marked ``MADV_FREE`` where the
platform has it, so under memory pressure the kernel takes them without writing anything out
(and the next user faults them in again); small ones (planes, the chunk cache's decoded units,
given back at every step of napari's time slider) are kept as they are.

A mapping made afresh is counted as a miss of its size; :meth:`OutputPool.replenish` (run on a
background thread by readers with a chunk cache) makes as many idle mappings of those sizes, their
pages faulted in, so that the next read of the same shape finds touched memory.  While napari's
chunk cache grows (every decoded unit is new memory) that moved 7-9 CPU-ms per 16 MiB tile row off
the time slider's step on the 2-core VM, into the time napari spends drawing.

The pool keeps at most ``max_bytes`` of mappings (the least recently used forgotten first).
Where reference counts cannot tell whether memory is in use (not CPython, or a free-threaded
build), where anonymous mappings fail, for arrays below ``min_bytes`` (the allocator reuses freed
memory of that size itself) and with ``TILESHARD_POOL_BYTES=0``, :meth:`OutputPool.empty` is
``np.empty``.
"""

from __future__ import annotations

import mmap
import sys
import sysconfig
import threading
import weakref

import numpy as np

from ..gpu.pinned import physical_memory
from .settings import pool_bytes_setting

__all__ = [
    "MIN_POOLED_BYTES",
    "OutputPool",
    "REPLENISH_MAX_BYTES",
    "default_pool_bytes",
    "output_pool",
    "pool_unsupported_reason",
    "set_output_pool",
]

#: arrays smaller than this come from ``np.empty``: the allocator's own reuse of freed memory
#: works there (the chunk cache's decoded units of napari's steps, 2 MiB, did not: half of their
#: pages were fresh at every step)
MIN_POOLED_BYTES = 1 << 20

#: mappings of at least this size have their pages marked ``MADV_FREE`` when given back (where the
#: platform has it): the kernel may take them under memory pressure.  Costs ~0.05 s per GiB given
#: back and ~0.07 CPU-s per GiB reused (the 2-core VM), against 0.5-2.6 for fresh memory and 0.01
#: for memory kept as it is: paid on large outputs only.
FREE_PAGES_MIN_BYTES = 64 << 20

#: the most :meth:`OutputPool.replenish` faults in per call: a read's planes and cache units (a
#: 2048² plane and its tile row: 24 MiB), never a whole-array read's outputs
REPLENISH_MAX_BYTES = 64 << 20

#: the most the pool keeps in mappings below :data:`FREE_PAGES_MIN_BYTES` (planes, the chunk
#: cache's decoded units: 512 MiB for the napari reader's cache), whose idle pages stay resident
SMALL_MAPPINGS_MAX_BYTES = 1 << 30


def pool_unsupported_reason(implementation: str | None = None, gil_disabled: bool | None = None) -> str | None:
    """Why the pool cannot be used (None: it can): it needs CPython's exact reference counts,
    which a free-threaded build does not keep while threads run.  Defaults: this interpreter."""
    implementation = sys.implementation.name if implementation is None else implementation
    if gil_disabled is None:
        gil_disabled = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    if implementation != "cpython":
        return f"{implementation}: reference counts do not tell whether memory is in use"
    if gil_disabled:
        return "a free-threaded CPython: reference counts are not exact while threads run"
    return None


def default_pool_bytes(physical_bytes: int | None = None) -> int:
    """A quarter of the machine's memory, within 1-16 GiB (2 GiB where the size is unknown)."""
    if physical_bytes is None:
        physical_bytes = physical_memory() or 0
    if physical_bytes <= 0:
        return 2 << 30
    return int(min(16 << 30, max(1 << 30, physical_bytes // 4)))


class _Mapping:
    """One anonymous mapping of the pool.  Its reference count says whether it is in use: each
    array over it holds a buffer of it, each buffer a reference.  No huge pages are asked for
    (NumPy asks for them from 4 MiB): on the 2-core VM a whole read's first output cost 3.9-4.3
    CPU-s/GB with them and 2.0-2.5 without; reused, 1.4-1.8 either way."""

    __slots__ = ("__weakref__", "map", "nbytes", "spare")

    def __init__(self, nbytes: int, populate: bool = False):
        self.nbytes = nbytes
        self.spare = populate  # made ahead by replenish(), not handed out yet
        if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private memory (a shared mapping is shmem)
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            if populate and hasattr(mmap, "MAP_POPULATE"):  # Linux: every page faulted in by mmap()
                flags |= mmap.MAP_POPULATE
                populate = False
            self.map = mmap.mmap(-1, nbytes, flags=flags)
        else:  # Windows: anonymous memory backed by the paging file
            self.map = mmap.mmap(-1, nbytes)
        if populate:  # no MAP_POPULATE: write each page once (NumPy's fill runs without the GIL)
            np.frombuffer(self.map, dtype=np.uint8).fill(0)

    def references(self) -> int:
        return sys.getrefcount(self.map)


class OutputPool:
    """Large NumPy arrays whose memory is reused once nothing refers to them (see the module).

    ``unsupported``: why the pool is off (default: :func:`pool_unsupported_reason`); then, with
    ``max_bytes`` 0, and for arrays under ``min_bytes``, :meth:`empty` is ``np.empty``."""

    def __init__(self, max_bytes: int, min_bytes: int = MIN_POOLED_BYTES, unsupported: str | None = ""):
        self.max_bytes, self.min_bytes = int(max_bytes), int(min_bytes)
        self.unsupported = pool_unsupported_reason() if unsupported == "" else unsupported
        self._mappings: list[_Mapping] = []  # least recently handed out first
        self._lock = threading.Lock()
        self._idle = self._idle_references()
        #: arrays handed out over a reused mapping / a new one
        self.reused = self.created = 0
        #: idle mappings made (and faulted in) by :meth:`replenish`
        self.replenished = 0
        self._missed: dict[int, int] = {}  # mappings made afresh by empty() since replenish(), by size

    def _idle_references(self) -> int:
        """The reference count of a mapping nothing but the pool refers to (as :meth:`_take`
        counts it), measured on a probe; turns the pool off where mappings fail."""
        if self.unsupported is not None:
            return -1
        try:
            probe = _Mapping(mmap.PAGESIZE)
        except (OSError, ValueError) as exc:
            self.unsupported = f"no anonymous mapping: {exc}"
            return -1
        idle = probe.references()
        probe.map.close()
        return idle

    @property
    def nbytes(self) -> int:
        """Bytes of the mappings the pool holds (in use or idle)."""
        with self._lock:
            return sum(m.nbytes for m in self._mappings)

    def empty(self, shape, dtype) -> np.ndarray:
        """``np.empty(shape, dtype)`` (C order), over pooled memory when large enough."""
        dtype = np.dtype(dtype)
        shape = tuple(int(n) for n in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.unsupported is not None or not self.min_bytes <= nbytes <= self.max_bytes:
            return np.empty(shape, dtype)
        # The array over a mapping is made while the lock is held: until it exists nothing counts
        # as a reference to the mapping, and another thread's _take would hand out the same memory.
        with self._lock:
            mapping = self._take(nbytes)
            if mapping is not None:
                self.reused += 1
                if mapping.spare:  # one of replenish()'s: made again by the next replenish()
                    mapping.spare = False
                    self._missed[mapping.nbytes] = self._missed.get(mapping.nbytes, 0) + 1
                root = np.frombuffer(mapping.map, dtype=np.uint8, count=nbytes)  # holds a buffer of it
        if mapping is None:
            try:
                mapping = _Mapping(nbytes)
            except (OSError, ValueError):  # out of address space or refused: the allocator's turn
                return np.empty(shape, dtype)
            with self._lock:
                root = np.frombuffer(mapping.map, dtype=np.uint8, count=nbytes)
                self._mappings.append(mapping)
                self._trim()
                self.created += 1
                self._missed[nbytes] = self._missed.get(nbytes, 0) + 1
        if mapping.nbytes >= FREE_PAGES_MIN_BYTES and hasattr(mmap, "MADV_FREE"):
            weakref.finalize(root, _given_back, weakref.ref(mapping), self._idle + 1)
        return root.view(dtype).reshape(shape)

    @property
    def missed(self) -> int:
        """Mappings :meth:`empty` made afresh or took from :meth:`replenish`'s spares since
        the last :meth:`replenish`."""
        return sum(self._missed.values())

    def replenish(self, max_bytes: int = REPLENISH_MAX_BYTES) -> int:
        """Make, for each mapping :meth:`empty` had to make afresh or took from the spares this
        makes since the last call (so that as many stay ready while a cache grows), an idle
        one of the same size with its pages faulted in (``MAP_POPULATE`` where the platform has
        it, else each page written once), up to ``max_bytes`` in all and within the pool's caps:
        the next read of the same shapes reuses touched memory instead of faulting fresh pages
        in (the kernel zeroes each one) on its critical path.  Meant for a background thread;
        returns the bytes made ready.  Misses larger than ``max_bytes`` are forgotten."""
        with self._lock:
            missed, self._missed = self._missed, {}
        made = 0
        for nbytes, count in sorted(missed.items()):
            for _ in range(count):
                if made + nbytes > max_bytes:
                    return made
                try:
                    mapping = _Mapping(nbytes, populate=True)
                except (OSError, ValueError):  # refused: the reads make their own
                    return made
                with self._lock:
                    self._mappings.append(mapping)
                    self._trim()
                    self.replenished += 1
                made += nbytes
        return made

    def _take(self, nbytes: int) -> _Mapping | None:
        """The smallest idle mapping of ``nbytes`` up to twice that, made the newest (lock held)."""
        best = None
        for mapping in self._mappings:
            if nbytes <= mapping.nbytes <= 2 * nbytes and (best is None or mapping.nbytes < best.nbytes):
                if mapping.references() == self._idle:
                    best = mapping
                    if mapping.nbytes == nbytes:
                        break
        if best is not None:
            self._mappings.remove(best)
            self._mappings.append(best)
        return best

    def _trim(self) -> None:
        """Forget the least recently used mappings while the pool holds more than ``max_bytes``,
        or more than :data:`SMALL_MAPPINGS_MAX_BYTES` in mappings too small to be marked
        ``MADV_FREE`` (their idle pages stay resident: reads of many different sizes would
        otherwise keep up to ``max_bytes`` of them); lock held.  A mapping in use is unmapped
        once its arrays are gone."""
        total = sum(m.nbytes for m in self._mappings)
        while total > self.max_bytes and self._mappings:
            total -= self._mappings.pop(0).nbytes
        small = [m for m in self._mappings if m.nbytes < FREE_PAGES_MIN_BYTES]
        excess = sum(m.nbytes for m in small) - SMALL_MAPPINGS_MAX_BYTES
        for mapping in small:  # least recently used first
            if excess <= 0:
                break
            self._mappings.remove(mapping)
            excess -= mapping.nbytes

    def clear(self) -> None:
        """Forget every mapping (those in use are unmapped once their arrays are gone)."""
        with self._lock:
            self._mappings.clear()


def _given_back(mapping_ref, references: int) -> None:
    """The array over a pooled mapping is being dropped (its buffer of the mapping still counted
    in ``references``): mark the pages ``MADV_FREE``, unless something else still refers to the
    mapping.  Runs before the array lets go of its buffer, so the pool cannot hand the mapping
    out again before this returns."""
    mapping = mapping_ref()
    if mapping is None or mapping.references() != references:
        return
    try:
        mapping.map.madvise(mmap.MADV_FREE)
    except (OSError, ValueError):  # unmapped meanwhile, or refused: nothing to give back
        pass


_pool: OutputPool | None = None
_pool_lock = threading.Lock()


def output_pool() -> OutputPool:
    """The process-wide pool of the CPU read path's outputs (``TILESHARD_POOL_BYTES``, default
    :func:`default_pool_bytes`), made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = OutputPool(pool_bytes_setting(default_pool_bytes()))
        return _pool


def set_output_pool(pool: OutputPool | None) -> OutputPool | None:
    """Make ``pool`` the process-wide pool (None: made again from the setting on next use);
    returns the previous one.  Arrays handed out keep their memory either way."""
    global _pool
    with _pool_lock:
        previous, _pool = _pool, pool
        return previous
