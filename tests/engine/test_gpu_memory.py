"""The GPU backend's memory: budgets against real allocations, small GPUs (CuPy pool limits),
and buffers kept for the next recording (identical output, fast arming)."""

import hashlib
import time

import numpy as np
import pytest
from conftest import read_back

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer, release_gpu_memory
from napari_tileshard.engine.backends import gpu_unavailable_reason
from napari_tileshard.engine.backends.gpu import GpuBackend

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu():
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU backend not usable here: {reason}")
    import cupy

    release_gpu_memory()
    pool = cupy.get_default_memory_pool()
    yield cupy
    pool.set_limit(size=0)
    release_gpu_memory()


def layout_2048(frames=0, tile=(8, 128, 128)):
    t, y, x = tile
    return Layout([Dim("t", frames, t, 1), Dim("y", 2048, y, 1024 // y), Dim("x", 2048, x, 1024 // x)], "uint16")


def digest(path):
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json"):
        h.update(file.relative_to(path).as_posix().encode() + file.read_bytes())
    return h.hexdigest()


def record(path, layout, frames, **options):
    t0 = time.perf_counter()
    writer = Writer(path, layout, backend="gpu", **options)
    armed = time.perf_counter() - t0
    with writer:
        writer.append(frames)
        held = writer.memory_held()
    return writer, armed, held


@pytest.fixture(scope="module")
def frames():
    return SyntheticCamera((2048, 2048), "uint16", seed=5).stack(40)


def test_default_budget_holds_for_2048_frames_with_256k_tiles(tmp_path, gpu, frames):
    writer, _, held = record(tmp_path / "a.zarr", layout_2048(), frames)
    estimate, budget = writer.memory_estimate(), writer.memory_budget
    assert estimate["device"] <= budget.device and estimate["host"] <= budget.host
    # the default follows the machine: 4 GiB / 2 GiB at most, 16 GiB / 8 GiB on a large GPU and host
    assert budget.device <= GpuBackend.LARGE_MAX_DEVICE_BYTES and budget.host <= GpuBackend.LARGE_MAX_HOST_BYTES
    assert 0 < held["device"] <= estimate["device"]
    assert 0 < held["host"] <= estimate["host"]
    # CuPy's own count of device memory in use agrees with the budget
    assert gpu.get_default_memory_pool().used_bytes() <= estimate["device"]
    np.testing.assert_array_equal(read_back(tmp_path / "a.zarr"), frames)


@pytest.mark.parametrize("device_gib", [2, 6])
def test_a_small_gpu_records_within_its_budget(tmp_path, gpu, frames, device_gib):
    """A pool limit makes a small GPU of the large one; the budget keeps the writer inside it."""
    budget = device_gib << 30
    gpu.get_default_memory_pool().set_limit(size=budget)
    writer, _, held = record(tmp_path / "a.zarr", layout_2048(), frames, max_device_bytes=budget)
    assert held["device"] <= writer.memory_estimate()["device"] <= budget
    np.testing.assert_array_equal(read_back(tmp_path / "a.zarr"), frames)


def test_a_budget_the_device_cannot_give_is_refused_before_recording(tmp_path, gpu):
    gpu.get_default_memory_pool().set_limit(size=1 << 30)
    with pytest.raises(MemoryError, match=r"needs about .* GiB of device memory .*pool limit 1\.00 GiB"):
        Writer(tmp_path / "a.zarr", layout_2048(), backend="gpu", max_device_bytes=3 << 30)
    assert not (tmp_path / "a.zarr").exists()


def test_a_device_budget_below_one_tile_epoch_names_the_minimum(tmp_path):
    with pytest.raises(ValueError, match=r"max_device_bytes=100000000 .* is below the \d+ bytes .* one tile epoch"):
        Writer(tmp_path / "a.zarr", layout_2048(), backend="gpu", max_device_bytes=100_000_000)
    assert not (tmp_path / "a.zarr").exists()


def test_a_second_recording_reuses_the_buffers_arms_fast_and_writes_the_same_bytes(tmp_path, gpu, frames):
    first, first_arm, first_held = record(tmp_path / "a.zarr", layout_2048(), frames)
    _, second_arm, second_held = record(tmp_path / "b.zarr", layout_2048(), frames)
    # the same device buffers, not new ones (pinned output buffers may still be pinning in the
    # background while the first recording runs, so host bytes held are compared with the estimate)
    assert second_held["device"] == first_held["device"]
    assert first_held["host"] <= second_held["host"] <= first.memory_budget.host
    assert second_arm < 0.2, f"second arm took {second_arm:.3f} s (first {first_arm:.3f} s)"
    assert digest(tmp_path / "a.zarr") == digest(tmp_path / "b.zarr")
    released = release_gpu_memory()
    assert released["device"] >= first_held["device"] and released["host"] >= first_held["host"]


def test_warm_up_prepares_the_next_recording(tmp_path, frames):
    estimate = Writer.warm_up(layout_2048(), backend="gpu")
    assert estimate["device"] <= GpuBackend.LARGE_MAX_DEVICE_BYTES
    _, armed, _ = record(tmp_path / "a.zarr", layout_2048(), frames)
    assert armed < 0.2, f"arming after warm_up took {armed:.3f} s"
    np.testing.assert_array_equal(read_back(tmp_path / "a.zarr"), frames)


def test_buffers_kept_for_a_layout_serve_one_that_differs_only_in_names_units_and_scales(tmp_path, frames):
    """What the buffers depend on is the geometry: a pymmcore-plus run (its own time interval as
    the t scale) arms from a warm-up made before its sequence was known."""
    Writer.warm_up(layout_2048(), backend="gpu")
    described = Layout([Dim("t", 0, 8, 1, kind="time", unit="second", scale=0.25), *layout_2048().dims[1:]], "uint16")
    _, armed, _ = record(tmp_path / "a.zarr", described, frames)
    assert armed < 0.2, f"arming after warm_up of the same geometry took {armed:.3f} s"
    np.testing.assert_array_equal(read_back(tmp_path / "a.zarr"), frames)


def test_a_new_layout_releases_the_kept_buffers_first(tmp_path, gpu, frames):
    record(tmp_path / "a.zarr", layout_2048(), frames)
    _, _, held = record(tmp_path / "b.zarr", layout_2048(tile=(32, 128, 128)), frames[:32])
    # the first layout's buffers were given back, not held beside the second's
    assert gpu.get_default_memory_pool().total_bytes() <= held["device"] + (64 << 20)
