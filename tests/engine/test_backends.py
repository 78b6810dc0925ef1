"""The backend registry, the constructors' options and the typed tickets (no GPU needed)."""

import importlib.util
import inspect
import logging
import subprocess
import sys

import numpy as np
import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import layouts

from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.engine.backends import (
    BACKENDS,
    REGISTRY,
    available_backends,
    gpu_unavailable_reason,
    is_available,
    select_backend,
)
from napari_tileshard.engine.backends.cpu import CpuBackend, CpuTicket
from napari_tileshard.engine.backends.gpu import GpuBackend
from napari_tileshard.engine.writer import estimate_memory
from napari_tileshard.format import codecs
from napari_tileshard.format.pyramid import plan_pyramid
from napari_tileshard.gpu import probe as gpu_probe

LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 10, 4, 2), Dim("x", 9, 4, 2)], "uint16")


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def test_importing_the_backends_and_stages_needs_no_cupy():
    # CuPy made unimportable (zarr itself imports it where it is installed, so its mere presence
    # in sys.modules proves nothing): every backend module must still import.
    out = _run(
        "import sys\n"
        "sys.modules['cupy'] = None\n"
        "import napari_tileshard.engine.backends, napari_tileshard.engine.backends.cpu\n"
        "import napari_tileshard.engine.backends.gpu\n"
        "from napari_tileshard.engine.backends.stages import tile, reduce, compress, aggregate\n"
        "import napari_tileshard.engine.writer\n"
        "print(napari_tileshard.engine.writer.estimate_memory(napari_tileshard.Layout(\n"
        "    [napari_tileshard.Dim('t', 0, 2), napari_tileshard.Dim('x', 8, 4)]))['gpu_device'] > 0)"
    )
    assert out.strip() == "True"


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_the_probe_answers_without_importing_anything():
    out = _run(
        "import sys\n"
        "from napari_tileshard.engine.backends import available_backends\n"
        "print(available_backends()['gpu']); print('cupy' in sys.modules)"
    )
    reason, imported = out.strip().splitlines()
    assert reason.startswith("CuPy is not installed") and imported == "False"


def test_cheap_reasons(monkeypatch):
    if importlib.util.find_spec("cupy") is None:
        assert gpu_probe._cheap_reason().startswith("CuPy is not installed")
    monkeypatch.setattr(gpu_probe.importlib.util, "find_spec", lambda name: object())
    for hidden in ("", "-1", " "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert gpu_probe._cheap_reason() == f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={hidden!r})"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_probe._cheap_reason() is None  # the rest needs CuPy


def test_registry_lists_every_backend_with_a_reason():
    assert BACKENDS == ("auto", "cpu", "gpu")
    assert list(REGISTRY) == ["gpu", "cpu"]  # auto's order
    listed = available_backends()
    assert list(listed) == ["gpu", "cpu"] and listed["cpu"] is None
    assert listed["gpu"] == gpu_unavailable_reason() == is_available("gpu")
    # A codec the GPU cannot encode is a reason on any machine, given before the machine's own.
    assert available_backends("blosc-lz4")["gpu"] == codecs.gpu_support("blosc-lz4")
    assert is_available("cpu", "blosc-lz4") is None
    with pytest.raises(ValueError, match="not one of"):
        is_available("tpu")
    with pytest.raises(ValueError, match=r"backend 'tpu' is not one of auto, cpu, gpu"):
        select_backend("tpu", LAYOUT, "zstd", 1)
    assert REGISTRY["cpu"].load() is CpuBackend and REGISTRY["gpu"].load() is GpuBackend


def test_auto_takes_the_first_usable_backend_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="napari_tileshard.engine.backends"):
        backend = select_backend("auto", LAYOUT, "blosc-lz4", 1)
    try:
        assert backend.name == "cpu"
        assert codecs.gpu_support("blosc-lz4") in caplog.text and "using the CPU backend" in caplog.text
    finally:
        backend.close()
    if gpu_unavailable_reason() is not None:
        with pytest.raises(RuntimeError, match="backend='gpu' was requested but the GPU backend is not usable: "):
            select_backend("gpu", LAYOUT, "zstd", 1)
    with pytest.raises(ValueError, match="is not supported by the GPU backend"):  # the codec first, anywhere
        select_backend("gpu", LAYOUT, "blosc-lz4", 1)


def test_constructors_name_an_unknown_option():
    with pytest.raises(TypeError, match="unexpected keyword argument 'slots'"):
        CpuBackend(LAYOUT, "zstd", 1, slots=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        GpuBackend(LAYOUT, "zstd", 1, bogus=3)  # before any CUDA work: no GPU needed
    with pytest.raises(TypeError, match=r"the cpu backend takes no option 'slots' \(its options: threads, pyramid\)"):
        select_backend("cpu", LAYOUT, "zstd", 1, slots=3)
    with pytest.raises(TypeError, match="the cpu backend takes no option 'bogus'"):
        select_backend("auto", LAYOUT, "blosc-lz4", 1, bogus=1)
    with pytest.raises(TypeError, match="positional"):
        CpuBackend(LAYOUT, "zstd", 1, 4)  # options are keywords only
    backend = select_backend("cpu", LAYOUT, "zstd", 1, threads=3)
    try:
        assert backend.threads == 3
    finally:
        backend.close()


def test_options_are_explicit_keywords():
    # The Writer passes threads= whatever the backend, so the GPU takes it too.
    for cls, options in (
        (CpuBackend, {"threads", "pyramid"}),
        (GpuBackend, {"slots", "batch_bytes", "pyramid", "threads", "device"}),
    ):
        parameters = inspect.signature(cls).parameters
        assert {name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY} == options
        assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values())


@pytest.mark.parametrize("ome", [False, True])
def test_cpu_tickets_are_typed_and_results_are_per_level(ome):
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 10, 4, 2), Dim("x", 9, 4, 2)], "uint16")
    pyramid = plan_pyramid(layout, "mean") if ome else None
    backend = CpuBackend(layout, "zstd", 1, threads=2, pyramid=pyramid)
    try:
        staging = backend.allocate_staging(3 * layout.epoch_bytes)
        staging[:] = np.random.default_rng(1).integers(0, 9, staging.nbytes, dtype=np.uint8)
        ticket = backend.submit(staging, 3, rows=5)
        assert isinstance(ticket, CpuTicket)
        assert len(ticket.level0) == 3 and len(ticket.level0[0]) == layout.inner_shard_count
        assert (ticket.reduce is not None) == ome
        assert backend.staging_free(ticket) is True
        levels = backend.result(ticket)
    finally:
        backend.close()
    assert len(levels) == (pyramid.levels if ome else 1)
    for lay, epochs in zip((pyramid or plan_pyramid(layout, max_levels=1)).layouts, levels):
        assert len(epochs) == 3
        for epoch in epochs:
            assert epoch.chunk_sizes.shape == (lay.inner_shard_count, lay.tiles_per_shard_inner)
            assert ((epoch.chunk_sizes > 0) == lay.slot_mask).all()


def test_writer_rejects_an_unknown_backend_before_touching_the_store(tmp_path):
    with pytest.raises(ValueError, match="is not one of auto, cpu, gpu"):
        Writer(tmp_path / "x.zarr", LAYOUT, backend="fast")
    assert not (tmp_path / "x.zarr").exists()


def test_cpu_batches_are_the_epochs_the_threads_need_and_at_least_16_mib(tmp_path):
    # 2048^2 uint16 frames, 1024^2-pixel shards: 4 (epoch, shard) tasks per tile epoch
    def frames(depth, tile):
        return Layout(
            [Dim("t", 0, depth, 1), Dim("y", 2048, tile, 1024 // tile), Dim("x", 2048, tile, 1024 // tile)], "uint16"
        )

    shallow, deep = frames(2, 128), frames(32, 256)  # 16 MiB and 256 MiB tile epochs
    assert CpuBackend.batch_bytes_for(shallow, threads=2) == 16 << 20  # one epoch: 2 tasks a thread
    assert CpuBackend.batch_bytes_for(shallow, threads=16) == 8 * (16 << 20)  # 32 tasks
    assert CpuBackend.batch_bytes_for(frames(1, 128), threads=1) == 16 << 20  # never below 16 MiB
    assert CpuBackend.batch_bytes_for(deep, threads=16) == 256 << 20  # at most 256 MiB, but a whole epoch
    # the Writer's default batch is the backend's, and so is the estimate made before it opens
    with Writer(tmp_path / "a.zarr", shallow, backend="cpu", threads=2) as writer:
        assert writer.batch_bytes == CpuBackend.batch_bytes_for(shallow, threads=2)
    batch = CpuBackend.batch_bytes_for(shallow)  # this machine's threads
    assert estimate_memory(shallow)["cpu_host"] == estimate_memory(shallow, batch_bytes=batch)["cpu_host"]
    assert estimate_memory(shallow)["cpu_host"] < estimate_memory(shallow, batch_bytes=batch * 2)["cpu_host"]


@given(layouts(), st.integers(1, 4), st.integers(1, 17))
@settings(max_examples=80, deadline=None)
def test_cpu_task_plan_splits_each_shard_into_even_runs_of_tile_rows_cut_into_boxes(layout, epochs, threads):
    """Each (epoch, shard) task of a batch is cut into pieces along w_1, planned once per batch
    shape: the pieces cover the shard's tile rows in order, as evenly as whole rows allow (NumPy's
    reference: ``linspace`` bounds, floored), as many as keep every thread busy, each cut into
    the boxes of :meth:`Layout.shard_boxes`; ``piece_bytes`` bounds the tiles of any piece."""
    backend = CpuBackend(layout, "zstd", 1, threads=threads)
    try:
        pieces, piece_bytes = backend.task_plan(layout, epochs)
        tps_1 = layout.tiles_per_shard[1] if layout.rank > 1 else 1
        tasks = epochs * layout.inner_shard_count
        bounds = np.linspace(0, tps_1, min(tps_1, max(1, -(-2 * threads // tasks))) + 1).astype(int)
        assert [(piece.start, piece.stop) for piece, _ in pieces] == list(zip(bounds[:-1], bounds[1:]))
        box_tiles = max(1, ((2 << 20) if threads < 8 else (4 << 20)) // layout.tile_bytes)  # 4 MiB from 8 threads on
        assert all(boxes == layout.shard_boxes(piece, box_tiles) for piece, boxes in pieces)
        row_slots = layout.tiles_per_shard_inner // tps_1
        assert piece_bytes == np.diff(bounds).max() * row_slots * layout.tile_bytes
        assert backend.task_plan(layout, epochs)[0] is pieces  # planned once
    finally:
        backend.close()


def test_the_cpu_writer_copies_frames_into_staging_on_the_callers_thread_alone(tmp_path, monkeypatch):
    """The CPU backend's frames go into staging on the caller's thread alone (STAGING_COPY_HELPERS
    = 0: no copy pool, whose helpers each took the GIL back beside the encode threads); with
    helpers asked for, large frames are copied by them too; the array is the same either way."""
    import threading

    from napari_tileshard.engine.backends import cpu as cpu_module

    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 1024, 256, 2), Dim("x", 1024, 256, 2)], "uint16")
    frames = (np.arange(4 * 1024 * 1024, dtype=np.uint32) % 65521).astype(np.uint16).reshape(4, 1024, 1024)
    assert frames[0].nbytes >= 2 << 20  # large enough for the staging copy to be split
    seen = {}
    for helpers in (0, 2):
        monkeypatch.setattr(cpu_module, "STAGING_COPY_HELPERS", helpers)
        path = tmp_path / f"h{helpers}.zarr"
        with Writer(path, layout, backend="cpu") as writer:
            writer.append(frames)
            seen[helpers] = {t.name for t in threading.enumerate() if t.name.startswith("tileshard-copy")}
        np.testing.assert_array_equal(zarr.open_array(str(path), mode="r")[...], frames)
    assert seen[0] == set()
    assert len(seen[2]) == 2


def test_the_cpu_writer_holding_the_gil_for_its_copy_stores_the_same_bytes(tmp_path, monkeypatch):
    """staging.HOLD_GIL_COPY (the caller's copy into staging by a memcpy that keeps the GIL) changes
    how the frames get into staging, not one byte of the store."""
    from napari_tileshard.engine import staging

    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 1024, 256, 2), Dim("x", 1024, 256, 2)], "uint16")
    frames = (np.arange(5 * 1024 * 1024, dtype=np.uint32) % 65521).astype(np.uint16).reshape(5, 1024, 1024)
    stores = {}
    for hold in (False, True):
        monkeypatch.setattr(staging, "HOLD_GIL_COPY", hold)
        path = tmp_path / f"hold{hold}.zarr"
        with Writer(path, layout, backend="cpu") as writer:
            writer.append(frames[:3])
            for frame in frames[3:]:
                writer.append(frame)
        stores[hold] = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        np.testing.assert_array_equal(zarr.open_array(str(path), mode="r")[...], frames)
    assert stores[True] == stores[False]
