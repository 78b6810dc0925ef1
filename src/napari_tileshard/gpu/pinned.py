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

__all__ = ["PinnedRecycler", "gpu_numa_cpus", "parse_cpulist", "pin"]

_PAGE = 4096
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable (CuPy names no constant): usable from every GPU's context
#: the limit is sized so that recording always progresses within it; should it not, pinning one
#: buffer more beats a recorder that hangs
_OVER_LIMIT_AFTER_S = 30.0
_FAULT_THREADS = 8
_FAULT_MIN_BYTES_PER_THREAD = 16 << 20
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
