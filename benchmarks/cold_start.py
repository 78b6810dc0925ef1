"""Cold start of one recording in a fresh process: arm time, first appends, memory.

Prints one JSON line: time to import, to construct the Writer (arm), per-append latency of the
first 100 frames (median and max, ms), close time, peak RSS (MiB) and, with the GPU backend, the
CuPy pool's bytes and pinned bytes held.  Run it once per case in a fresh process, e.g.

    python benchmarks/cold_start.py --backend gpu --frame 2048x2048 --out /dev/shm/cold.zarr
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

start = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import numpy as np  # noqa: E402

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer  # noqa: E402

imported = time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gpu")
    parser.add_argument("--frame", default="2048x2048")
    parser.add_argument("--tile", default="8,128,128")
    parser.add_argument("--out", default="/dev/shm/tileshard-cold.zarr")
    parser.add_argument("--recordings", type=int, default=1, help="recordings in this process (arm time of each)")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest calls of the first arm")
    parser.add_argument("--batch-mib", type=int, default=None)
    parser.add_argument("--fps", type=float, default=0, help="pace appends like a camera (0: as fast as possible)")
    parser.add_argument("--appends", type=int, default=100, help="appends per recording (first 100 reported apart)")
    parser.add_argument("--warm-up", action="store_true", help="Writer.warm_up first (widget, MDA sink)")
    args = parser.parse_args()
    h, w = (int(v) for v in args.frame.split("x"))
    tt, ty, tx = (int(v) for v in args.tile.split(","))
    layout = Layout([Dim("t", 0, tt, 1), Dim("y", h, ty, 4), Dim("x", w, tx, 4)], "uint16")
    frames = SyntheticCamera((h, w), "uint16", seed=0).stack(8)
    options = {"batch_bytes": args.batch_mib << 20} if args.batch_mib else {}
    warm_up_s = None
    if args.warm_up:
        t0 = time.perf_counter()
        Writer.warm_up(layout, backend=args.backend, **options)
        warm_up_s = time.perf_counter() - t0
    arms = []
    for recording in range(args.recordings):
        profiler = None
        if args.profile and not recording:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        writer = Writer(args.out, layout, backend=args.backend, overwrite=True, **options)
        arms.append(time.perf_counter() - t0)
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile)
        latencies = []
        period = 1 / args.fps if args.fps else 0.0
        start_appends = time.perf_counter()
        for i in range(args.appends):
            if period:  # a camera's pace: the next frame arrives at its time, not when the Writer is ready
                time.sleep(max(0.0, start_appends + i * period - time.perf_counter()))
            t = time.perf_counter()
            writer.append(frames[i % 8])
            latencies.append(time.perf_counter() - t)
        later = latencies[100:]
        latencies = latencies[:100]
        held = writer.memory_held() if hasattr(writer, "memory_held") else None  # before close hands them on
        t = time.perf_counter()
        writer.close()
        closed = time.perf_counter() - t
    armed = arms[0]
    result = {
        "backend": writer.stats.backend,
        "import_s": round(imported, 3),
        "warm_up_s": round(warm_up_s, 3) if warm_up_s is not None else None,
        "arm_s": round(armed, 3),
        "later_arms_s": [round(a, 3) for a in arms[1:]],
        "append_p50_ms": round(float(np.median(latencies)) * 1e3, 2),
        "append_max_ms": round(max(latencies) * 1e3, 1),
        "later_append_p99_ms": round(float(np.percentile(later, 99)) * 1e3, 1) if later else None,
        "later_append_max_ms": round(max(later) * 1e3, 1) if later else None,
        "close_s": round(closed, 3),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "estimate": writer.memory_estimate(),
    }
    if args.backend == "gpu":
        import cupy

        result["cupy_pool_mib"] = cupy.get_default_memory_pool().total_bytes() >> 20
        if held:
            result["held_mib"] = {kind: n >> 20 for kind, n in held.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
