"""Memory budgets (max_host_bytes / max_device_bytes), batch planning and in-place frame buffers.

What runs everywhere: the planning arithmetic and the CPU backend.  The GPU side (estimates
against real allocations, pool limits, reuse across recordings) is in tests/engine/test_gpu_memory.py.
"""

import hashlib

import numpy as np
import pytest
from conftest import read_back
from hypothesis import given
from hypothesis import strategies as st

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.engine.backends import gpu_unavailable_reason
from napari_tileshard.engine.backends.gpu import GpuBackend
from napari_tileshard.engine.writer import estimate_memory, largest_fitting


def small_layout(frames=0):
    return Layout([Dim("t", frames, 2, 2), Dim("y", 64, 32, 2), Dim("x", 64, 32, 2)], "uint16")


def store_digest(path):
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json"):
        digest.update(file.relative_to(path).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()


@given(st.integers(1, 4000), st.integers(0, 5000))
def test_largest_fitting_is_the_largest_batch_within_the_bound(preferred, limit):
    def fits(epochs):
        return 7 * epochs + 3 <= limit  # grows with the batch, as every estimate does

    expected = max([e for e in range(1, preferred + 1) if fits(e)], default=0)
    assert largest_fitting(preferred, fits) == expected


def test_default_gpu_budget_for_2048_frames_with_256k_tiles_is_within_4_gib_device_2_gib_pinned():
    layout = Layout([Dim("t", 0, 8, 1), Dim("y", 2048, 128, 8), Dim("x", 2048, 128, 8)], "uint16")
    estimate = estimate_memory(layout)
    assert estimate["gpu_device"] <= 4 << 30
    assert estimate["gpu_host"] <= 2 << 30
    # and it is the largest batch that fits: one more tile epoch would not
    bigger = GpuBackend.estimate(layout, estimate["gpu_batch_bytes"] + layout.epoch_bytes)
    assert bigger["device"] > 4 << 30 or bigger["host"] > 2 << 30


def test_gpu_budget_defaults_follow_the_machine():
    small_gpu = GpuBackend.budget_for(device_free=6 << 30, physical_memory=64 << 30)
    assert small_gpu.device == int(0.25 * (6 << 30)) and small_gpu.host == 2 << 30
    laptop = GpuBackend.budget_for(device_free=None, physical_memory=8 << 30)
    assert laptop.device == 4 << 30 and laptop.host == 1 << 30
    # an 8-16 GB GPU keeps 4 GiB / 2 GiB whatever the host's RAM
    for free in (7 << 30, 15 << 30, 23 << 30):
        budget = GpuBackend.budget_for(device_free=free, physical_memory=512 << 30)
        assert budget.device <= 4 << 30 and budget.host == 2 << 30
    # a large GPU on a large host: half of what is free up to 16 GiB, 8 GiB pinned (RAM/8 at most)
    h100 = GpuBackend.budget_for(device_free=78 << 30, physical_memory=128 << 30)
    assert (h100.device, h100.host) == (16 << 30, 8 << 30)
    workstation = GpuBackend.budget_for(device_free=24 << 30, physical_memory=64 << 30)
    assert (workstation.device, workstation.host) == (12 << 30, 8 << 30)
    # a large GPU on a small host keeps the small bounds
    small_host = GpuBackend.budget_for(device_free=78 << 30, physical_memory=32 << 30)
    assert (small_host.device, small_host.host) == (4 << 30, 2 << 30)


def test_the_large_default_budget_gives_deep_1_mib_tiles_1_gib_calls_and_small_gpus_256_mib():
    """What the large default is for: 8x256² tiles of 2048² frames get nvCOMP calls of 1 GiB
    (1024 tiles) on a large GPU, and stay at 192-256 MiB within 4 GiB / 2 GiB on a small one."""

    def plan_batches_for_budget(layout, budget):
        return estimate_memory(layout, max_host_bytes=budget.host, max_device_bytes=budget.device)

    layout = Layout([Dim("t", 0, 8, 1), Dim("y", 2048, 256, 4), Dim("x", 2048, 256, 4)], "uint16")
    large = plan_batches_for_budget(layout, GpuBackend.budget_for(78 << 30, 128 << 30))
    small = plan_batches_for_budget(layout, GpuBackend.budget_for(12 << 30, 128 << 30))
    assert large["gpu_batch_bytes"] == 1 << 30
    assert large["gpu_device"] <= 16 << 30 and large["gpu_host"] <= 8 << 30
    assert 128 << 20 <= small["gpu_batch_bytes"] <= 256 << 20
    assert small["gpu_device"] <= 4 << 30 and small["gpu_host"] <= 2 << 30


def test_a_host_budget_shrinks_the_cpu_batch_and_the_estimate_stays_within_it(tmp_path):
    layout = small_layout()
    unbounded = Writer(tmp_path / "a.zarr", layout, backend="cpu")
    unbounded.close()
    budget = unbounded.memory_estimate()["host"] // 3
    with Writer(tmp_path / "b.zarr", layout, backend="cpu", max_host_bytes=budget) as writer:
        assert writer.batch_epochs < unbounded.batch_epochs
        assert writer.memory_estimate()["host"] <= budget
        frames = SyntheticCamera((64, 64), "uint16", seed=1).stack(10)
        writer.append(frames)
    np.testing.assert_array_equal(read_back(tmp_path / "b.zarr"), frames)


def test_a_budget_below_one_tile_epoch_is_refused_naming_the_minimum_before_the_store_exists(tmp_path):
    layout = small_layout()
    with pytest.raises(ValueError, match=r"max_host_bytes=1000 .* is below the (\d+) bytes") as info:
        Writer(tmp_path / "x.zarr", layout, backend="cpu", max_host_bytes=1000)
    assert "one tile epoch" in str(info.value)
    assert not (tmp_path / "x.zarr").exists()
    minimum = int(str(info.value).split("is below the ")[1].split(" bytes")[0])
    Writer(tmp_path / "x.zarr", layout, backend="cpu", max_host_bytes=minimum).close()  # the named minimum works


def test_an_explicit_batch_larger_than_an_explicit_budget_is_refused(tmp_path):
    layout = small_layout()
    with pytest.raises(ValueError, match="batch_bytes=67108864"):
        Writer(tmp_path / "x.zarr", layout, backend="cpu", batch_bytes=64 << 20, max_host_bytes=1 << 20)


@pytest.mark.parametrize("value", [0, -1, 1.5, "1G", True])
def test_budget_values_must_be_positive_integers(tmp_path, value):
    with pytest.raises(ValueError, match=f"max_device_bytes must be a positive integer, got {value!r}"):
        Writer(tmp_path / "x.zarr", small_layout(), backend="cpu", max_device_bytes=value)


def test_frame_buffer_fills_in_place_and_stores_what_append_stores(tmp_path, backend):
    frames = SyntheticCamera((64, 64), "uint16", seed=3).stack(11)
    with Writer(tmp_path / "append.zarr", small_layout(), backend=backend) as writer:
        writer.append(frames)
    with Writer(tmp_path / "inplace.zarr", small_layout(), backend=backend) as writer:
        for frame in frames:
            with writer.frame_buffer() as place:
                assert place.shape == (64, 64) and place.dtype == np.uint16
                place[...] = frame
        assert writer.stats.frames == 11
    np.testing.assert_array_equal(read_back(tmp_path / "inplace.zarr"), frames)
    assert store_digest(tmp_path / "inplace.zarr") == store_digest(tmp_path / "append.zarr")


def test_a_camera_that_cannot_wait_drops_frames_and_the_store_holds_exactly_the_others(tmp_path, backend):
    """frame_buffer(block=False): None when every staging buffer is busy (the caller drops the
    frame); whatever got a place is stored, in order, and nothing else."""
    frames = SyntheticCamera((64, 64), "uint16", seed=5).stack(400)
    kept = []
    with Writer(tmp_path / "x.zarr", small_layout(), backend=backend, staging_buffers=2) as writer:
        for frame in frames:
            with writer.frame_buffer(block=False) as place:
                if place is None:
                    continue
                place[...] = frame
                kept.append(frame)
        assert writer.stats.frames == len(kept)
    assert kept, "no frame got a place"
    np.testing.assert_array_equal(read_back(tmp_path / "x.zarr"), np.stack(kept))


def test_a_frame_buffer_left_by_an_exception_counts_nothing(tmp_path):
    frames = SyntheticCamera((64, 64), "uint16", seed=4).stack(3)
    with Writer(tmp_path / "x.zarr", small_layout(), backend="cpu") as writer:
        writer.append(frames[0])
        with pytest.raises(RuntimeError, match="camera timeout"):
            with writer.frame_buffer() as place:
                place[...] = 7
                raise RuntimeError("camera timeout")
        assert writer.stats.frames == 1
        writer.append(frames[1:])
    np.testing.assert_array_equal(read_back(tmp_path / "x.zarr"), frames)


def test_frame_buffer_refuses_a_stream_inside_a_frame_and_a_full_array(tmp_path):
    with Writer(tmp_path / "x.zarr", small_layout(), backend="cpu") as writer:
        writer.write(b"\0" * 10)
        with pytest.raises(ValueError, match="frame boundary, but 10 bytes of a 8192-byte frame"):
            with writer.frame_buffer():
                pass
        writer.write(b"\0" * (8192 - 10))
    with Writer(tmp_path / "y.zarr", small_layout(frames=1), backend="cpu") as writer:
        with writer.frame_buffer() as place:
            place[...] = 1
        with pytest.raises(ValueError, match="exceed the declared array shape"):
            with writer.frame_buffer():
                pass


def test_cpulists_of_numa_nodes_parse():
    from napari_tileshard.gpu.pinned import parse_cpulist

    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}


@pytest.mark.gpu
def test_pinned_memory_placed_from_given_cpus_is_zeroed_and_usable():
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU backend not usable here: {reason}")
    import os

    import cupy

    from napari_tileshard.gpu.pinned import gpu_numa_cpus, pin

    cpus = gpu_numa_cpus(0) or {sorted(os.sched_getaffinity(0))[0]}
    before = os.sched_getaffinity(0)
    host = pin(64 << 20, cpus)
    assert os.sched_getaffinity(0) == before  # only the pool's threads were bound
    assert not host.any()
    host[:] = 7
    device = cupy.asarray(host)
    assert int(device.sum()) == 7 * (64 << 20)


def test_warm_up_of_small_frames_encodes_one_tile_epoch_not_a_batch_of_shards(backend):
    """A batch of 48 x 40 frames is 17 476 frames and 4 369 shards on the CPU (8x that on a GPU),
    which took warm_up 12 s here (minutes on a GPU): one tile epoch per GPU loads every kernel."""
    import time

    small = Layout([Dim("t", 0, 4, 2), Dim("y", 48, 16, 2), Dim("x", 40, 16, 2)], "uint16")
    started = time.perf_counter()
    estimate = Writer.warm_up(small, backend=backend)
    assert time.perf_counter() - started < 4
    assert estimate["host"] > 0
    bounded = Layout([Dim("t", 3, 4, 2), Dim("y", 48, 16, 2), Dim("x", 40, 16, 2)], "uint16")
    assert Writer.warm_up(bounded, backend=backend)["host"] > 0  # fewer rows than one epoch: nothing encoded


def test_frame_buffer_blocks_do_not_nest_and_nothing_unwritten_is_recorded(tmp_path, backend):
    """A nested block used to be accepted: the outer frame was lost and a zero frame recorded."""
    frames = SyntheticCamera((64, 64), "uint16", seed=6).stack(3)
    with Writer(tmp_path / "x.zarr", small_layout(), backend=backend) as writer:
        with writer.frame_buffer() as outer:
            outer[...] = frames[0]
            with pytest.raises(RuntimeError, match=r"frame_buffer\(\) inside a frame_buffer\(\) block"):
                with writer.frame_buffer():
                    pass
            with pytest.raises(RuntimeError, match=r"append\(\) inside a frame_buffer\(\) block"):
                writer.append(frames[1])
            with pytest.raises(RuntimeError, match=r"write\(\) inside a frame_buffer\(\) block"):
                writer.write(frames[1].tobytes())
        assert writer.stats.frames == 1
        writer.append(frames[1:])
    np.testing.assert_array_equal(read_back(tmp_path / "x.zarr"), frames)


def test_a_frame_buffer_is_read_only_once_its_block_ends(tmp_path, backend):
    """Writing through the view after its block used to change a frame already recorded."""
    frames = SyntheticCamera((64, 64), "uint16", seed=7).stack(4)
    kept = []
    with Writer(tmp_path / "x.zarr", small_layout(), backend=backend) as writer:
        for frame in frames:
            with writer.frame_buffer() as place:
                place[...] = frame
            kept.append(place)
        for place in kept:
            with pytest.raises(ValueError, match="read-only"):
                place[...] = 0
        with pytest.raises(RuntimeError):
            with writer.frame_buffer() as place:
                raise RuntimeError("camera timeout")
        with pytest.raises(ValueError, match="read-only"):
            place[0, 0] = 1  # also after a block left by an exception
    np.testing.assert_array_equal(read_back(tmp_path / "x.zarr"), frames)


def test_a_pinned_pool_hands_out_the_smallest_idle_buffer_that_fits_and_keeps_at_most_its_idle_bytes():
    from napari_tileshard.gpu.pinned import PinnedPool

    made: list[int] = []

    def allocate(nbytes: int) -> np.ndarray:
        made.append(nbytes)
        return np.zeros(nbytes, np.uint8)

    mib = 1 << 20
    pool = PinnedPool(10 * mib, allocate=allocate)
    small, large = pool.take(1), pool.take(5 * mib + 1)
    assert made == [2 * mib, 6 * mib]  # whole huge pages
    pool.give(large)
    pool.give(small)
    assert pool.idle() == 8 * mib
    assert pool.take(mib) is small  # the smallest that fits, not the first
    assert pool.take(3 * mib) is large
    assert pool.pinned == 2 and pool.idle() == 0
    pool.give(large)
    pool.give(small)
    pool.give(pool.take(9 * mib))  # 8 + 10 MiB idle > 10: the oldest (large, then small) let go
    assert pool.idle() == 10 * mib and made[-1] == 10 * mib
    pool.give(np.zeros(11 * mib, np.uint8))  # larger than the pool keeps at all
    assert pool.idle() == 10 * mib
    assert pool.clear() == 10 * mib and pool.idle() == 0
    with pytest.raises(ValueError, match="-1"):
        PinnedPool(-1)


def test_gpu_readers_keep_at_most_2_gib_of_pinned_staging_and_an_eighth_of_the_ram():
    from napari_tileshard.gpu.pinned import default_read_staging_bytes

    assert default_read_staging_bytes(128 << 30) == 2 << 30
    assert default_read_staging_bytes(8 << 30) == 1 << 30
