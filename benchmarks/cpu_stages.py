"""The CPU backend's physical limit and where its CPU seconds go, per stage.

* :func:`zstd_ceiling.zstd_ceiling`: libzstd level-N on the same tiles, one thread, times the
  cores: no writer of this codec can beat it on this machine.
* :func:`stage_seconds`: a real ``Writer(backend="cpu")`` run (the user's clock, ``Writer()`` to
  ``close()``) with its CPU seconds split by stage.  Each thread's CPU time comes from the kernel
  (``/proc/self/task``, read after ``sync()``, just before ``close()``), so nothing is left out:
  ``append`` (the caller's thread and the staging copy's helpers), ``tile`` and ``compress``
  (the encode threads, split by timing ``tile_cpu``/``compress_cpu`` with ``time.thread_time``),
  ``encode-other`` (the rest of the encode threads: task scheduling, slot sizes), ``collect``
  (aggregate, offsets and index of each shard: the collector thread), ``write`` (the I/O threads:
  the shard files) and ``close`` (what the process spent after ``sync()``).

    python benchmarks/cpu_stages.py --gib 1 --tiles 64k-d2,1m
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_write import layout_for, setup_tensorstore, tile_cases  # noqa: E402
from zstd_ceiling import zstd_ceiling  # noqa: E402

from napari_tileshard import Layout, SyntheticCamera, Writer  # noqa: E402
from napari_tileshard.engine.backends import cpu as cpu_module  # noqa: E402

STAGES = ("append", "tile", "compress", "encode-other", "collect", "write", "close")
#: thread name prefixes of each stage (the Writer's thread names)
_THREAD_STAGES = {
    "MainThread": "append",
    "tileshard-copy": "append",
    "tileshard-cpu": "encode",
    "tileshard-collector": "collect",
    "tileshard-io": "write",
}


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of this process, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


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


def stage_seconds(camera, frames: int, tile, out: Path, level: int, user_clock: bool = False) -> dict:
    """One CPU-backend run with its stages timed; CPU-s/GB per stage and GB/s.  ``tile``: a tile
    shape (the shards of ``layout_for``) or a whole ``Layout``; ``user_clock``: the clock starts
    before ``Writer()`` (as a user's does), else once it is made."""
    clock = StageClock()
    clock.wrap(cpu_module, "tile_cpu", "tile")
    clock.wrap(cpu_module, "compress_cpu", "compress")
    per_thread: dict[str, float] = collections.defaultdict(float)
    layout = tile if isinstance(tile, Layout) else layout_for(camera.shape, tile)
    try:
        shutil.rmtree(out, ignore_errors=True)
        before = thread_cpu_seconds()
        if user_clock:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        writer = Writer(out, layout, codec="zstd", level=level, backend="cpu", overwrite=True)
        if not user_clock:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        for frame in camera.frames(frames):
            writer.append(frame)
        writer.sync()
        synced = time.process_time()
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid, seconds in thread_cpu_seconds().items():
            name = names.get(tid, "")
            stage = next((s for prefix, s in _THREAD_STAGES.items() if name.startswith(prefix)), "close")
            per_thread[stage] += seconds - before.get(tid, 0.0)
        writer.close()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        clock.restore()
        shutil.rmtree(out, ignore_errors=True)
    gb = frames * camera.frame_bytes / 1e9
    stages = {
        "append": per_thread["append"],
        "tile": clock.seconds["tile"],
        "compress": clock.seconds["compress"],
        "encode-other": per_thread["encode"] - clock.seconds["tile"] - clock.seconds["compress"],
        "collect": per_thread["collect"],
        "write": per_thread["write"],
        "close": time.process_time() - synced,
    }
    return {"gbps": gb / wall, "cpu_s_per_gb": cpu / gb, "stages": {k: v / gb for k, v in stages.items()}}


def tensorstore_seconds(camera, frames: int, tile, out: Path, level: int) -> dict:
    """The same frames through tensorstore (bench_write's harness): CPU-s/GB of the caller's thread
    (gathering frames into shard-epoch slabs, our ``append``) and of tensorstore's own threads."""
    shutil.rmtree(out, ignore_errors=True)
    before = thread_cpu_seconds()
    run = setup_tensorstore(camera, frames, tile, out, level)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    main_thread = threading.main_thread().native_id
    run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    caller = thread_cpu_seconds()[main_thread] - before.get(main_thread, 0.0)
    shutil.rmtree(out, ignore_errors=True)
    gb = frames * camera.frame_bytes / 1e9
    return {
        "gbps": gb / wall,
        "cpu_s_per_gb": cpu / gb,
        "stages": {"append": caller / gb, "tensorstore": (cpu - caller) / gb},
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tiles", default="64k-d2,256k-d2,1m-d8,1m,4m")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="rounds, ours and tensorstore taking turns; medians")
    parser.add_argument("--no-tensorstore", action="store_true")
    parser.add_argument("--out", default="/dev/shm/tileshard-stages")
    args = parser.parse_args(argv)
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    root = Path(args.out)
    columns = STAGES + ("tensorstore",)
    print(f"# {os.cpu_count()} CPUs; CPU-s per GB of input, medians of {args.repeat}; stores in {root}")
    header = f"{'tile':8s} {'engine':14s} {'GB/s':>6s} {'of ceil':>7s} {'CPU-s/GB':>8s} "
    print(header + " ".join(f"{c:>12s}" for c in columns))
    for name, tile in tile_cases(args.tiles.split(",")):
        frames = math.ceil(int(args.gib * 2**30 // camera.frame_bytes) / tile[0]) * tile[0]
        ceiling = zstd_ceiling(camera, tile, args.level)
        runs: dict[str, list[dict]] = {"tileshard-cpu": [], "tensorstore": []}
        for round_ in range(args.repeat):
            order = ["tileshard-cpu"] + ([] if args.no_tensorstore else ["tensorstore"])
            for engine in order[round_ % len(order) :] + order[: round_ % len(order)]:
                measure = stage_seconds if engine == "tileshard-cpu" else tensorstore_seconds
                runs[engine].append(measure(camera, frames, tile, root / f"{engine}.zarr", args.level))
        print(
            f"{name:8s} {'libzstd x ' + str(os.cpu_count()):14s} {ceiling['ceiling_gbps']:6.2f} {1:7.2f} "
            f"{ceiling['zstd_cpu_s_per_gb']:8.2f} "
            + " ".join(f"{ceiling['zstd_cpu_s_per_gb'] if c == 'compress' else math.nan:12.2f}" for c in columns)
        )
        for engine, rows in runs.items():
            if not rows:
                continue
            gbps = statistics.median(r["gbps"] for r in rows)
            print(
                f"{name:8s} {engine:14s} {gbps:6.2f} {gbps / ceiling['ceiling_gbps']:7.2f} "
                f"{statistics.median(r['cpu_s_per_gb'] for r in rows):8.2f} "
                + " ".join(f"{statistics.median(r['stages'].get(c, math.nan) for r in rows):12.2f}" for c in columns),
                flush=True,
            )


if __name__ == "__main__":
    main()
