"""The CPU backend's physical limit and where its CPU seconds go, per stage.

* :func:`zstd_ceiling`: libzstd level-N on the same tiles, one thread (python-zstandard's
  ``multi_compress_to_buffer``, ``threads=1``, from tiles already contiguous in memory: the
  codec alone), times the cores: no writer of this codec can beat it on this machine.
* :func:`stage_seconds`: a real ``Writer(backend="cpu")`` run (the user's clock, ``Writer()`` to
  ``close()``) with each stage function wrapped in a per-thread CPU timer
  (``time.thread_time``, which counts only the calling thread): ``append`` (the caller's copy
  into staging), ``tile`` (cutting a task's tiles out of the staged frames), ``compress``
  (libzstd), ``aggregate`` (a batch's chunks grouped by shard), ``accumulate`` (offsets and
  index of each shard), ``write`` (the shard files); ``other`` is the process's CPU time left
  over (the staging copy's helper thread, scheduling, the interpreter between stages).

    python benchmarks/cpu_stages.py --gib 1 --tiles 64k-d2,1m
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_write import layout_for, tile_cases  # noqa: E402

from napari_tileshard import SyntheticCamera, Writer  # noqa: E402
from napari_tileshard.engine import shards as shards_module  # noqa: E402
from napari_tileshard.engine.backends import cpu as cpu_module  # noqa: E402
from napari_tileshard.storage import sinks as sinks_module  # noqa: E402

STAGES = ("append", "tile", "compress", "aggregate", "accumulate", "write", "other")


def contiguous_tiles(camera, frames: int, tile) -> np.ndarray:
    """The tiles of ``frames`` frames, one per row of uint8 (frames that fill whole tiles only)."""
    tz, ty, tx = tile
    h, w = camera.shape
    stack = np.stack([f for f in camera.frames(frames // tz * tz)])
    lifted = stack.reshape(-1, tz, h // ty, ty, w // tx, tx).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(lifted).reshape(-1, tz * ty * tx * stack.itemsize).view(np.uint8)


def zstd_ceiling(camera, tile, level: int, cores: int | None = None, sample_bytes: int = 256 << 20) -> dict:
    """Single-thread libzstd rate on the tiles of ``camera``'s frames (best of 3), and x cores."""
    cores = cores or os.cpu_count() or 1
    frames = max(tile[0], sample_bytes // camera.frame_bytes)
    tiles = contiguous_tiles(camera, frames, tile)
    count, nbytes = tiles.shape
    segments = np.empty((count, 2), dtype=np.uint64)
    segments[:, 0] = np.arange(count, dtype=np.uint64) * np.uint64(nbytes)
    segments[:, 1] = nbytes
    compressor = zstandard.ZstdCompressor(level=level)
    best = math.inf
    for _ in range(3):
        start = time.thread_time()
        compressor.multi_compress_to_buffer(zstandard.BufferWithSegments(tiles, segments.tobytes()), threads=1)
        best = min(best, time.thread_time() - start)
    per_thread = tiles.nbytes / best / 1e9
    return {"zstd_1thread_gbps": per_thread, "zstd_cpu_s_per_gb": 1 / per_thread, "ceiling_gbps": per_thread * cores}


class StageClock:
    """Per-thread CPU seconds of wrapped functions, summed by stage name."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()
        self._undo: list = []

    def wrap(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                with clock._lock:
                    clock.seconds[stage] += spent

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def stage_seconds(camera, frames: int, tile, out: Path, level: int) -> dict:
    """One CPU-backend run with its stages timed; CPU-s/GB per stage and GB/s."""
    clock = StageClock()
    clock.wrap(Writer, "append", "append")
    for name, stage in (
        ("tile_cpu", "tile"),
        ("compress_cpu", "compress"),
        ("slot_sizes", "aggregate"),
        ("aggregate_cpu", "aggregate"),
    ):
        if hasattr(cpu_module, name):
            clock.wrap(cpu_module, name, stage)
    clock.wrap(shards_module.ShardAccumulator, "add", "accumulate")
    clock.wrap(shards_module.ShardAccumulator, "take_pending", "accumulate")
    clock.wrap(sinks_module, "_writev_all", "write")
    try:
        shutil.rmtree(out, ignore_errors=True)
        writer = Writer(out, layout_for(camera.shape, tile), codec="zstd", level=level, backend="cpu", overwrite=True)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with writer:
            for frame in camera.frames(frames):
                writer.append(frame)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        clock.restore()
        shutil.rmtree(out, ignore_errors=True)
    gb = frames * camera.frame_bytes / 1e9
    per_gb = {stage: clock.seconds.get(stage, 0.0) / gb for stage in STAGES[:-1]}
    per_gb["other"] = cpu / gb - sum(per_gb.values())
    return {"gbps": gb / wall, "cpu_s_per_gb": cpu / gb, "stages": per_gb}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tiles", default="64k-d2,256k-d2,1m")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--out", default="/dev/shm/tileshard-stages")
    args = parser.parse_args(argv)
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    out = Path(args.out) / "cpu.zarr"
    header = f"{'tile':10s} {'GB/s':>6s} {'of ceil':>7s} {'CPU-s/GB':>8s} {'zstd-1t':>7s} "
    print(header + " ".join(f"{s:>10s}" for s in STAGES))
    for name, tile in tile_cases(args.tiles.split(",")):
        frames = math.ceil(int(args.gib * 2**30 // camera.frame_bytes) / tile[0]) * tile[0]
        ceiling = zstd_ceiling(camera, tile, args.level)
        run = stage_seconds(camera, frames, tile, out, args.level)
        print(
            f"{name:10s} {run['gbps']:6.2f} {run['gbps'] / ceiling['ceiling_gbps']:7.2f} {run['cpu_s_per_gb']:8.2f} "
            f"{ceiling['zstd_cpu_s_per_gb']:7.2f} " + " ".join(f"{run['stages'][s]:10.2f}" for s in STAGES),
            flush=True,
        )


if __name__ == "__main__":
    main()
