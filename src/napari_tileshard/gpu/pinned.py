"""Page-locked (pinned) host memory for the GPU backend, and a recycler of fixed-size blocks.

Arming a GPU recording used to be mostly pinning: ``cudaHostAlloc`` pins about 1.5 GiB/s on the
H100 machine, while anonymous pages with transparent huge pages advised, touched, then
``cudaHostRegister``'ed pin about 3.3 GiB/s there (``benchmarks/pinning.py``,
benchmarks/results/notebook-2026-11.md): the kernel hands out and locks 2 MiB pages instead of 4 KiB ones.  So
:func:`pin` maps and registers its own memory, and falls back to ``cudaHostAlloc`` where
registering is refused.  CuPy is imported only when memory is pinned.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "PinnedPool",
    "PinnedRecycler",
    "default_read_staging_bytes",
    "gpu_numa_cpus",
    "parse_cpulist",
    "physical_memory",
    "pin",
    "read_staging_pool",
    "release_read_staging",
]

_PAGE = 4096
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable (CuPy names no constant): usable from every GPU's context
#: the limit is sized so that recording always progresses within it; should it not, pinning one
#: buffer more beats a recorder that hangs
_OVER_LIMIT_AFTER_S = 30.0
_FAULT_THREADS = 8
_FAULT_MIN_BYTES_PER_THREAD = 16 << 20
#: :class:`PinnedPool` pins in multiples of this (a transparent huge page): sizes that differ a
#: little, as the batches of two reads do, share buffers
_POOL_GRAIN = 2 << 20
log = logging.getLogger(__name__)


class _PinnedBlock:
    """One pinned allocation as NumPy sees it; NumPy views keep it (and so the pages) alive."""

    def __init__(self, address: int, nbytes: int, owner):
        self.owner = owner  # the mmap or CuPy's PinnedMemoryPointer: freed when the block is
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


def _unregister(address: int, mapping: mmap.mmap) -> None:
    import cupy

    try:
        cupy.cuda.runtime.hostUnregister(address)
    except Exception:  # noqa: BLE001 - at interpreter exit the context may be gone; the pages go with it
        pass


def parse_cpulist(text: str) -> set[int]:
    """The CPUs of a sysfs cpulist such as ``"0-15,32-47"``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_numa_cpus(device: int) -> set[int] | None:
    """The CPUs of the NUMA node the GPU ``device`` hangs off (from sysfs), or None where the
    machine has one node, the node is unknown, or this is not Linux."""
    try:
        import cupy

        bus = cupy.cuda.runtime.deviceGetPCIBusId(device).lower()
        node = int(open(f"/sys/bus/pci/devices/{bus}/numa_node").read())
        if node < 0 or len(os.listdir("/sys/devices/system/node")) <= 2:  # node0 + possible/online files
            return None
        cpus = parse_cpulist(open(f"/sys/devices/system/node/node{node}/cpulist").read())
        return cpus & os.sched_getaffinity(0) or None
    except Exception:  # noqa: BLE001 - placement is an optimisation: without it memory is where the kernel puts it
        return None


def _fault_in(pages: np.ndarray, cpus: set[int] | None = None) -> None:
    """Touch every page from several threads before registering: the kernel zeroes and maps
    them in parallel, which cudaHostRegister would do on one thread (1 GiB: 0.19 -> 0.08 s on
    the H100 machine, benchmarks/pinning.py).  With ``cpus`` (a GPU's NUMA node) the touching
    threads run there, so first touch puts the pages in that node's memory, next to the GPU."""
    threads = min(_FAULT_THREADS, os.cpu_count() or 1, pages.nbytes // _FAULT_MIN_BYTES_PER_THREAD)
    if threads < 2 and not cpus:
        return
    threads = max(1, threads)
    bounds = np.linspace(0, pages.nbytes, threads + 1).astype(np.int64) // _PAGE * _PAGE

    def touch(i: int) -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)  # this thread only (a pool thread, gone afterwards)
        pages[bounds[i] : bounds[i + 1] : _PAGE].fill(0)

    with ThreadPoolExecutor(threads, thread_name_prefix="tileshard-pin") as pool:
        list(pool.map(touch, range(threads)))


def pin(nbytes: int, cpus: set[int] | None = None) -> np.ndarray:
    """``nbytes`` of pinned host memory as a uint8 array (zero-filled); unpinned when the last view
    goes.  ``cpus``: the NUMA node's CPUs to place the pages on (:func:`gpu_numa_cpus`)."""
    import cupy

    nbytes = max(1, int(nbytes))
    size = -(-nbytes // _PAGE) * _PAGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    pages = np.frombuffer(mapping, dtype=np.uint8)
    address = pages.ctypes.data
    _fault_in(pages, cpus)
    del pages  # no export may outlive the mapping
    try:
        cupy.cuda.runtime.hostRegister(address, size, _REGISTER_PORTABLE)
    except cupy.cuda.runtime.CUDARuntimeError:
        mapping.close()
        memory = cupy.cuda.alloc_pinned_memory(nbytes)
        block = _PinnedBlock(memory.ptr, nbytes, memory)
        array = np.asarray(block)
        array[...] = 0  # as the mapped pages are
        return array
    block = _PinnedBlock(address, nbytes, mapping)
    weakref.finalize(block, _unregister, address, mapping)
    return np.asarray(block)


class PinnedRecycler:
    """At most ``limit`` pinned buffers of ``nbytes`` that come back for reuse when their last
    view is gone.

    The GPU backend copies each batch's packed shards into one of these and the shards keep
    views into it until they are on disk.  Pinning per batch would cost more than the copy it
    saves; copying out to pageable memory would cost a core.  :meth:`take` waits while all
    ``limit`` are in use (storage backpressure) instead of pinning beyond the memory budget.
    """

    def __init__(self, nbytes: int, limit: int, cpus: set[int] | None = None):
        self.nbytes = max(1, nbytes)
        self.limit = limit
        self.cpus = cpus  # the NUMA node to place the buffers on (see pin)
        self._free: list[np.ndarray] = []
        self._allocated = 0
        self._changed = threading.Condition()

    @property
    def allocated(self) -> int:
        return self._allocated

    def reserve(self, count: int) -> None:
        """Pin up to ``count`` buffers now (may run on a background thread while recording starts)."""
        while True:
            with self._changed:
                if self._allocated >= min(count, self.limit):
                    return
                self._allocated += 1
            buffer = pin(self.nbytes, self.cpus)
            with self._changed:
                self._free.append(buffer)
                self._changed.notify_all()

    def take(self) -> np.ndarray:
        with self._changed:
            if not self._changed.wait_for(lambda: self._free or self._allocated < self.limit, _OVER_LIMIT_AFTER_S):
                log.warning(
                    "all %d pinned output buffers still held after %.0f s; pinning one more (beyond the budget)",
                    self.limit,
                    _OVER_LIMIT_AFTER_S,
                )
            buffer = self._free.pop() if self._free else None
            if buffer is None:
                self._allocated += 1
        if buffer is None:
            buffer = pin(self.nbytes, self.cpus)
        block = _PinnedBlock(buffer.ctypes.data, self.nbytes, buffer)
        weakref.finalize(block, self._give_back, buffer)
        return np.asarray(block)

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._changed:
            self._free.append(buffer)
            self._changed.notify_all()


class PinnedPool:
    """Pinned buffers of any size, taken for one piece of work and given back after it, and kept
    idle (at most ``idle_bytes`` of them, the least recently given back let go first) for the
    next taker in the process.

    The GPU reader stages every batch of shards in pinned memory.  Each reader pinned its own
    and kept it while the reader lived, so a fresh reader (one per read in a script) pinned ~1 GB
    again first: its 1 GiB read ran at 0.5-1.4 GB/s instead of 5-8.  A read takes its buffers
    from this pool and gives them back when it ends, so any later read of the process, by any
    reader, finds them pinned already.

    ``allocate(nbytes)``: new pinned memory as a uint8 array (default :func:`pin`; a stand-in
    without a GPU in tests).  Thread-safe."""

    def __init__(self, idle_bytes: int, allocate=None):
        if isinstance(idle_bytes, bool) or not isinstance(idle_bytes, int) or idle_bytes < 0:
            raise ValueError(f"idle_bytes must be a non-negative integer, got {idle_bytes!r}")
        self.idle_bytes = idle_bytes
        self._allocate = allocate or pin
        self._idle: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()
        self.pinned = 0  # buffers pinned afresh (a take that found none idle that fits)

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes``: the smallest idle one that fits, else a new one
        (``nbytes`` rounded up to 2 MiB).  Give it back with :meth:`give` once nothing reads or
        writes it any more (a copy to the device from it is done)."""
        nbytes = max(1, int(nbytes))
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.size >= nbytes]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].size))
            self.pinned += 1
        return self._allocate(-(-nbytes // _POOL_GRAIN) * _POOL_GRAIN)

    def give(self, buffer: np.ndarray) -> None:
        """Keep ``buffer`` (one :meth:`take` returned) for the next taker; beyond ``idle_bytes``
        the oldest idle buffers are let go (unpinned once nothing else refers to them)."""
        with self._lock:
            if buffer.nbytes > self.idle_bytes:
                return
            self._idle.append(buffer)
            while sum(b.nbytes for b in self._idle) > self.idle_bytes:
                self._idle.pop(0)

    def idle(self) -> int:
        """Bytes kept idle now."""
        with self._lock:
            return sum(b.nbytes for b in self._idle)

    def clear(self) -> int:
        """Let go of every idle buffer; returns their bytes."""
        with self._lock:
            idle, self._idle = self._idle, []
        return sum(b.nbytes for b in idle)


def physical_memory() -> int | None:
    """The machine's RAM in bytes (None where the platform does not say): what the memory
    budgets of the writer, the CPU reader's output pool and the GPU readers' staging follow."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_read_staging_bytes(physical_bytes: int | None = None) -> int:
    """Idle pinned bytes the GPU readers of a process keep: 2 GiB (one reader's staging at the
    default batch size), at most an eighth of the machine's memory, as the GPU backend's pinned
    budget (2 GiB where the size is unknown)."""
    if physical_bytes is None:
        physical_bytes = physical_memory() or 16 << 30
    return int(min(2 << 30, max(0, physical_bytes) // 8))


_read_staging: PinnedPool | None = None
_read_staging_lock = threading.Lock()


def read_staging_pool() -> PinnedPool:
    """The process's pool of pinned staging buffers for GPU reads (made on first use)."""
    global _read_staging
    with _read_staging_lock:
        if _read_staging is None:
            _read_staging = PinnedPool(default_read_staging_bytes())
        return _read_staging


def release_read_staging() -> int:
    """Let go of the GPU readers' idle pinned staging buffers; returns their bytes (0 where no
    GPU read ran in this process)."""
    with _read_staging_lock:
        pool = _read_staging
    return pool.clear() if pool is not None else 0
