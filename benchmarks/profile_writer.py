"""Where the Writer's time goes: per-stage wall time by thread, for one backend and layout.

    python benchmarks/profile_writer.py --backend gpu --gib 4 --tile 8,128,128 --out /dev/shm/prof.zarr

Wraps the stage functions with timers (no sampling profiler needed on the GPU machine) and
prints, per stage, the summed seconds and the share of the wall time.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import SyntheticCamera, Writer
from napari_tileshard.engine.backends.cpu import CpuBackend
from napari_tileshard.engine.collector import Collector
from napari_tileshard.engine.publish import Publisher
from napari_tileshard.engine.shards import ShardAccumulator
from napari_tileshard.engine.staging import StagingRing
from napari_tileshard.storage.sinks import Sink
from napari_tileshard.storage.urls import open_sink

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_write import layout_for  # noqa: E402

TOTALS: dict[str, float] = collections.defaultdict(float)
LOCK = threading.Lock()


def timed(owner, name, label=None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            with LOCK:
                TOTALS[label or name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


class TimingSink(Sink):
    """Storage time, per object kind, through the public Sink seam."""

    def __init__(self, store, overwrite=False):
        self.inner = open_sink(store, overwrite)

    @property
    def location(self):
        return self.inner.location

    @property
    def root(self):
        return getattr(self.inner, "root", None)

    def write(self, key, buffers):
        start = time.perf_counter()
        try:
            self.inner.write(key, buffers)
        finally:
            with LOCK:
                TOTALS["sink.write zarr.json" if key.endswith("zarr.json") else "sink.write shard"] += (
                    time.perf_counter() - start
                )

    def release(self):
        self.inner.release()

    def discard(self):
        self.inner.discard()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gpu")
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--frame", default="2048x2048")
    parser.add_argument("--tile", default="8,128,128")
    parser.add_argument("--out", default="/dev/shm/tileshard-profile.zarr")
    parser.add_argument("--batch-mib", type=int, default=None)
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.frame.split("x"))
    tile = tuple(int(v) for v in args.tile.split(","))
    camera = SyntheticCamera(shape, "uint16", seed=0)
    camera.prepare()
    frames = int(args.gib * 2**30 // camera.frame_bytes)
    layout = layout_for(shape, tile)
    # Time the stages by class (public methods of each pipeline piece), and storage through a Sink.
    for owner, names in (
        (StagingRing, ("copy_in", "acquire", "submit")),
        (Collector, ("reserve", "drain")),
        (ShardAccumulator, ("add",)),
        (Publisher, ("track", "wait")),
    ):
        for name in names:
            timed(owner, name, f"{owner.__name__}.{name}")
    backend_class = (
        CpuBackend
        if args.backend == "cpu"
        else __import__("napari_tileshard.engine.backends.gpu", fromlist=["GpuBackend"]).GpuBackend
    )
    for name in ("submit", "result", "staging_free"):
        timed(backend_class, name, f"backend.{name}")
    batch = args.batch_mib << 20 if args.batch_mib else None
    writer = Writer(TimingSink(args.out, overwrite=True), layout, backend=args.backend, batch_bytes=batch)
    start = time.perf_counter()
    for frame in camera.frames(frames):
        writer.append(frame)
    fed = time.perf_counter() - start
    writer.close()
    wall = time.perf_counter() - start
    print(
        f"{args.backend} {layout.tile_shape} batch {writer.batch_bytes >> 20} MiB: "
        f"{frames * camera.frame_bytes / wall / 1e9:.2f} GB/s "
        f"(wall {wall:.2f} s, feeding {fed:.2f} s, close {wall - fed:.2f} s)"
    )
    for name, seconds in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {seconds:7.2f} s  {seconds / wall:6.1%}")


if __name__ == "__main__":
    main()
