"""GPU kernels against the NumPy references (run on the GPU machine: ``pytest -m gpu``)."""

import time

import numpy as np
import pytest
from conftest import read_back
from hypothesis import given, settings
from hypothesis import strategies as st

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.engine.backends import gpu_unavailable_reason, select_backend

REASON = gpu_unavailable_reason()
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")]


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
def test_gpu_is_listed_usable_and_auto_prefers_it():
    from napari_tileshard.engine.backends import available_backends

    assert available_backends() == {"gpu": None, "cpu": None}
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "uint8")
    backend = select_backend("auto", layout, "zstd", 1, threads=4)  # the Writer's CPU option is taken
    try:
        assert backend.name == "gpu"
    finally:
        backend.close()


def test_gpu_backend_request_without_gpu_names_the_reason():
    if REASON is None:
        pytest.skip("a GPU is usable here; this checks the error on machines without one")
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "uint8")
    with pytest.raises(RuntimeError, match="backend='gpu' was requested but the GPU backend is not usable: "):
        Writer("/tmp/never-created.zarr", layout, backend="gpu")
    assert select_backend("auto", layout, "zstd", 1).name == "cpu"


@st.composite
def gpu_layouts(draw):
    rank = draw(st.integers(1, 4))
    dims = [
        Dim(f"d{d}", draw(st.integers(1, 20)), draw(st.integers(1, 7)), draw(st.integers(1, 3))) for d in range(rank)
    ]
    return Layout(dims, draw(st.sampled_from(["uint8", "uint16", "float32", "float64"])))


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
@given(gpu_layouts(), st.integers(1, 3), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_tile_kernel_matches_numpy_reference(layout, epochs, seed):
    """The tile stage on the GPU equals the CPU's evaluation of the same lifted strides and the reference."""
    import cupy

    from napari_tileshard.engine.backends.gpu import _ALIGN, _round_up
    from napari_tileshard.engine.backends.stages.tile import tile_gpu, tile_kernel

    rng = np.random.default_rng(seed)
    batch = rng.integers(1, 250, (epochs * layout.epoch_rows,) + layout.shape[1:]).astype(layout.dtype)
    stride = _round_up(layout.tile_bytes, _ALIGN) // layout.itemsize
    elements = epochs * layout.tiles_per_epoch * stride
    pool = cupy.full(elements * layout.itemsize, 0xAB, dtype=cupy.uint8)  # poisoned
    stream = cupy.cuda.get_current_stream()  # the one that filled the pool: no race with the fill
    tile_gpu(tile_kernel(layout, stride), cupy.asarray(batch.reshape(-1).view(np.uint8)), pool, elements, stream)
    stream.synchronize()
    got = pool.get().view(layout.dtype)
    np.testing.assert_array_equal(got, layout.lifted_strides(stride).scatter(batch))
    got = got.reshape(epochs, layout.tiles_per_epoch, stride)
    assert not got[:, :, layout.tile_elements :].any()  # alignment padding written too
    expected = layout.tile_pool_reference(batch).reshape(epochs, layout.tiles_per_epoch, -1)
    np.testing.assert_array_equal(got[:, :, : layout.tile_elements], expected)


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
@pytest.mark.parametrize(
    "method, dims, dtype",
    [
        ("mean", None, "uint16"),
        ("max", ("t", "z", "y", "x"), "float16"),
        ("mean", ("t", "y", "x"), "float32"),
        ("min", None, "int32"),
    ],
)
def test_reduce_stage_on_the_gpu_equals_reduce_cpu(method, dims, dtype):
    import cupy

    from napari_tileshard.engine.backends.stages.reduce import reduce_cpu, reduce_gpu, reduce_kernel
    from napari_tileshard.format.pyramid import plan_pyramid

    pyramid = plan_pyramid(
        Layout([Dim("t", 0, 4, 1), Dim("z", 5, 2, 2), Dim("y", 37, 8, 2), Dim("x", 29, 8, 2)], dtype), method, dims
    )
    layout, epochs = pyramid.layouts[0], 3
    rows = epochs * layout.epoch_rows - 1  # a partial last epoch: its padding stays out
    rng = np.random.default_rng(5)
    batch = (rng.random((epochs * layout.epoch_rows,) + layout.shape[1:]) * 1000).astype(dtype)
    batch[rows:] = 0  # the Writer's padding (levels that keep dim 0 reduce it like any row)
    expected = reduce_cpu(pyramid, batch, epochs, rows)
    stream = cupy.cuda.get_current_stream()  # the one that uploads and zeroes: no race with them
    source = cupy.asarray(batch)
    for k in range(1, pyramid.levels):
        lay = pyramid.layouts[k]
        target = cupy.zeros(epochs * lay.epoch_elements, dtype=dtype)
        kernel = reduce_kernel(pyramid.layouts[k - 1], lay, pyramid.step_axes(k), method)
        reduce_gpu(kernel, source, target, target.size, pyramid.level_rows(k - 1, rows), stream)
        stream.synchronize()
        np.testing.assert_array_equal(target.get().reshape(expected[k - 1].shape), expected[k - 1])
        source = target


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
@given(gpu_layouts(), st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_aggregation_matches_numpy_reference(layout, epochs):
    """Whole GPU batch: packed shard-major bytes and offsets equal permute + scan + gather in NumPy."""
    import zstandard

    from napari_tileshard.engine.backends.gpu import GpuTicket

    backend = select_backend("gpu", layout, "zstd", 1)
    try:
        staging = backend.allocate_staging(epochs * layout.epoch_bytes)
        rng = np.random.default_rng(epochs)
        staging[:] = rng.integers(0, 4, staging.nbytes, dtype=np.uint8)  # compressible, not trivial
        ticket = backend.submit(staging, epochs)
        assert isinstance(ticket, GpuTicket) and ticket.epochs == epochs
        assert backend.staging_free(ticket) is True
        (encoded,) = backend.result(ticket)
    finally:
        backend.close()
    batch = staging.view(layout.dtype).reshape((epochs * layout.epoch_rows,) + layout.shape[1:])
    pool = layout.tile_pool_reference(batch)
    decompressor = zstandard.ZstdDecompressor()
    for e, epoch in enumerate(encoded):
        assert epoch.chunk_sizes.shape == (layout.inner_shard_count, layout.tiles_per_shard_inner)
        assert ((epoch.chunk_sizes > 0) == layout.slot_mask).all()
        for i, slot in enumerate(layout.shard_permutation):
            shard, within = divmod(int(slot), layout.tiles_per_shard_inner)
            start = int(epoch.chunk_sizes[shard, :within].sum())
            blob = epoch.shard_data[shard][start : start + int(epoch.chunk_sizes[shard, within])]
            assert decompressor.decompress(blob, max_output_size=layout.tile_bytes) == pool[e, i].tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "float16", "float64"])
def test_gpu_output_equals_cpu_output(tmp_path, dtype):
    layout = Layout([Dim("t", 0, 4, 2), Dim("y", 70, 16, 2), Dim("x", 45, 16, 3)], dtype)
    frames = SyntheticCamera((70, 45), dtype, seed=11).stack(23)
    for backend in ("cpu", "gpu"):
        with Writer(tmp_path / f"{backend}.zarr", layout, backend=backend, batch_bytes=3 * layout.epoch_bytes) as w:
            for i in range(0, 23, 5):
                w.append(frames[i : i + 5])
    np.testing.assert_array_equal(read_back(tmp_path / "gpu.zarr"), read_back(tmp_path / "cpu.zarr"))
    np.testing.assert_array_equal(read_back(tmp_path / "gpu.zarr"), frames)


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
def test_layout_too_big_for_the_gpu_is_refused_before_start(tmp_path):
    import cupy

    free, _ = cupy.cuda.runtime.memGetInfo()
    layout = Layout([Dim("t", 0, 16, 1), Dim("y", 8192, 512, 2), Dim("x", 8192, 512, 2)], "uint16")
    with pytest.raises(MemoryError, match="GiB of device memory"):
        Writer(tmp_path / "big.zarr", layout, backend="gpu", batch_bytes=int(free))
    assert not (tmp_path / "big.zarr" / "zarr.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
def test_auto_picks_the_gpu_and_says_so(tmp_path):
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 64, 16, 2)], "uint16")
    with Writer(tmp_path / "a.zarr", layout, backend="auto") as writer:
        writer.append(np.arange(128, dtype=np.uint16).reshape(2, 64))
    assert writer.backend == "gpu" and writer.stats.backend.startswith("gpu (")


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
def test_cupy_frames_skip_the_host_and_mix_with_host_frames(tmp_path, monkeypatch):
    """CuPy frames go device-to-device; only host-filled staging bytes are uploaded."""
    import cupy

    from napari_tileshard.engine.backends.gpu import GpuBackend

    uploads = []
    original = GpuBackend.submit

    def spy(self, staging, epochs, host_ranges=None, rows=None):
        uploads.append([tuple(r) for r in host_ranges])
        return original(self, staging, epochs, host_ranges, rows)

    monkeypatch.setattr(GpuBackend, "submit", spy)
    layout = Layout([Dim("t", 0, 4, 2), Dim("y", 50, 16, 2), Dim("x", 40, 16, 2)], "uint16")
    frames = SyntheticCamera((50, 40), "uint16", seed=4).stack(19)
    with Writer(tmp_path / "d.zarr", layout, backend="gpu", batch_bytes=2 * layout.epoch_bytes) as writer:
        writer.append(cupy.asarray(frames[:8]))  # one whole batch from the device
        for i in range(8, 12):
            writer.append(frames[i])  # host
        for i in range(12, 15):
            writer.append(cupy.asarray(frames[i]))
        writer.flush()  # pads the open epoch provisionally; the next device frame replaces the padding
        for i in range(15, 19):
            writer.append(cupy.asarray(frames[i]))  # device, then a partial last batch
    np.testing.assert_array_equal(read_back(tmp_path / "d.zarr"), frames)
    frame_bytes = 50 * 40 * 2
    assert uploads[0] == []  # the first batch never touched the host
    assert uploads[1][0] == (0, 4 * frame_bytes)  # flush: host frames + the provisional padding
    assert uploads[2] == [(0, 4 * frame_bytes)]  # only the host frames were uploaded
    assert sum(b - a for a, b in uploads[3]) < 4 * frame_bytes  # padding of the partial epoch only


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"GPU backend not usable: {REASON}")
def test_cuda_error_mid_recording_keeps_what_reached_the_host(tmp_path, monkeypatch):
    import cupy

    from napari_tileshard import WriterError
    from napari_tileshard.engine.backends.gpu import GpuBackend

    calls = {"n": 0}
    original = GpuBackend.wait_ready

    def failing_wait(slot):
        calls["n"] += 1
        if calls["n"] == 3:  # the third batch fails on the device
            raise cupy.cuda.runtime.CUDARuntimeError(700)  # cudaErrorIllegalAddress
        return original(slot)

    monkeypatch.setattr(GpuBackend, "wait_ready", staticmethod(failing_wait))
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")
    path = tmp_path / "cuda-error.zarr"
    frames = SyntheticCamera((32, 32), "uint16", seed=2).stack(20)
    writer = Writer(path, layout, backend="gpu", batch_bytes=2 * layout.epoch_bytes)  # 4 frames per batch
    errors = []
    try:
        for frame in frames:
            writer.append(frame)
            time.sleep(0.01)
    except WriterError as exc:  # the failure surfaces on the next call...
        errors.append(exc)
    try:
        writer.close()  # ...and close() reports it too, after waiting for every thread
    except WriterError as exc:
        errors.append(exc)
    assert errors and "CUDA" in str(errors[0]) and str(path) in str(errors[0])
    out = read_back(path)
    assert out.shape[0] >= 8  # the two batches before the error are published
    np.testing.assert_array_equal(out, frames[: out.shape[0]])
