"""The staging ring: buffers after the first are allocated in the background where the backend
allows it (the GPU's pinned buffers), so a Writer arms without waiting for them."""

import threading
import time

import numpy as np
import pytest

from napari_tileshard import Dim, Layout
from napari_tileshard.engine.backends.cpu import CpuBackend
from napari_tileshard.engine.staging import StagingRing

LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 2), Dim("x", 8, 4, 2)], "uint16")


class SlowSecondBuffer(CpuBackend):
    """A backend whose buffers after the first take until ``release`` is set (as pinning does)."""

    stages_in_background = True

    def __init__(self, fail: bool = False):
        super().__init__(LAYOUT, threads=1)
        self.release = threading.Event()
        self.allocated: list[int] = []
        self.fail = fail

    def allocate_staging(self, nbytes):
        if self.allocated:
            assert self.release.wait(10)
            if self.fail:
                raise MemoryError("cannot pin 4096 bytes")
        buffer = np.zeros(nbytes, np.uint8)
        self.allocated.append(buffer.ctypes.data)
        return buffer


def test_the_ring_returns_before_its_later_buffers_exist_and_takes_them_first_when_they_do():
    backend = SlowSecondBuffer()
    start = time.perf_counter()
    ring = StagingRing(backend, 4096, 3)
    assert time.perf_counter() - start < 5  # the later buffers are still waiting
    assert len(backend.allocated) == 1 and ring.count == 3
    assert ring.acquire(block=True) is True
    first = ring.buffer.ctypes.data
    ring.copy_in(memoryview(np.ones(4096, np.uint8)))
    ring.submit(1)
    # the backend still reads the first buffer and the others are not there: nothing to take without waiting
    assert ring.acquire(block=False) is False or ring.buffer.ctypes.data != first
    backend.release.set()
    assert ring.acquire(block=True) is True
    assert ring.buffer.ctypes.data != first and ring.buffer.ctypes.data in backend.allocated
    assert ring.count == 3
    ring.close()
    backend.close()


def test_a_background_allocation_error_surfaces_at_the_next_buffer_and_close_waits_for_it():
    backend = SlowSecondBuffer(fail=True)
    ring = StagingRing(backend, 4096, 2)
    ring.acquire(block=True)
    ring.copy_in(memoryview(np.ones(4096, np.uint8)))
    ring.submit(1)
    backend.release.set()
    with pytest.raises(MemoryError, match="cannot pin 4096 bytes"):
        ring.acquire(block=True)
    ring.close()
    backend.close()


def test_backends_that_cannot_refuse_later_allocate_every_buffer_up_front():
    backend = CpuBackend(LAYOUT, threads=1)
    assert backend.stages_in_background is False
    ring = StagingRing(backend, 4096, 3)
    assert ring.count == 3
    ring.close()
    backend.close()
