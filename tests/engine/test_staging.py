"""The staging ring's copies: every byte lands, whichever way the copy goes."""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from napari_tileshard.engine.staging import copy_frame, copy_holding_gil, copy_in_parts


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_copy_in_parts_alone_into_a_slice_of_a_ring():
    ring = np.zeros(10 << 20, dtype=np.uint8)
    source = _bytes((5 << 20) + 3, seed=1)
    copy_in_parts(ring[1000 : 1000 + source.nbytes], source, None, 0)
    np.testing.assert_array_equal(ring[1000 : 1000 + source.nbytes], source)
    assert not ring[:1000].any() and not ring[1000 + source.nbytes :].any()


def test_copy_in_parts_alone_from_a_strided_source():
    source = _bytes(2 * (3 << 20), seed=2)[::2]
    destination = np.zeros(source.size, dtype=np.uint8)
    copy_in_parts(destination, source, None, 0)
    np.testing.assert_array_equal(destination, source)


def test_copy_in_parts_with_helpers():
    source = _bytes((6 << 20) + 11, seed=3)
    destination = np.zeros_like(source)
    with ThreadPoolExecutor(3) as pool:
        copy_in_parts(destination, source, pool, 3)
    np.testing.assert_array_equal(destination, source)


def test_copy_frame_is_a_copy():
    frame = _bytes(4 << 20, seed=4).view(np.uint16).reshape(1024, 2048)
    copied = copy_frame(frame)
    np.testing.assert_array_equal(copied, frame)
    frame[0, 0] ^= 1
    assert copied[0, 0] != frame[0, 0]


def test_copy_holding_gil_into_a_slice_of_a_ring():
    ring = np.zeros(10 << 20, dtype=np.uint8)
    source = _bytes((5 << 20) + 3, seed=5)
    copy_holding_gil(ring[1000 : 1000 + source.nbytes], source)
    np.testing.assert_array_equal(ring[1000 : 1000 + source.nbytes], source)
    assert not ring[:1000].any() and not ring[1000 + source.nbytes :].any()
    with pytest.raises(ValueError):
        copy_holding_gil(ring[:10], source)


def test_copy_holding_gil_lets_no_other_thread_run_during_the_copy():
    """The point of it: the copy never lets the GIL go (a NumPy copy of this size does), so a
    thread running Python makes no progress while it runs.  A long switch interval keeps the
    caller from being asked to drop the GIL between its clock and the copy."""
    source = _bytes(64 << 20, seed=6)
    destination = np.zeros_like(source)
    ticks: list[float] = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.25)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)  # the spinner runs; the caller takes the GIL back within the interval
        start = time.perf_counter()
        copy_holding_gil(destination, source)
        end = time.perf_counter()
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    np.testing.assert_array_equal(destination, source)
    assert ticks, "the spinner never ran"
    assert not [t for t in ticks if start < t < end]
