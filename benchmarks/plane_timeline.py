"""Where a single-plane CPU read's wall time goes: each stage's start and end on each thread,
relative to the read's start, medians over many planes (uncached ShardReader, as
``ab_cpu_planes.py`` reads).  Stages: ``plan`` (the caller's), ``post`` (the block task queued),
``task`` (the block task: from its start), ``fetch`` (its reads), ``unit k`` (decode and
placement of unit k), ``done`` (the caller has the plane).  A probe: it wraps the reader's
methods with clocks, so its times include that.

    python benchmarks/plane_timeline.py /dev/shm/rec/default.zarr --planes 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import ShardReader  # noqa: E402
from napari_tileshard.reader import cpu, shard_reader  # noqa: E402

EVENTS: list[tuple[str, str, float, float]] = []  # (stage, thread, start, end)
LOCK = threading.Lock()


def clocked(owner, name: str, stage) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            label = stage(args) if callable(stage) else stage
            with LOCK:
                EVENTS.append((label, threading.current_thread().name, start, time.perf_counter()))

    setattr(owner, name, wrapper)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--planes", type=int, default=40)
    args = parser.parse_args(argv)
    clocked(shard_reader.ShardReader, "_plan", "plan")
    clocked(shard_reader.ShardReader, "_fetch", "fetch")
    clocked(cpu.CpuReadPath, "_start_block", "task")
    clocked(cpu.CpuReadPath, "_decode_unit", lambda a: f"unit {a[-1][0][0]}")
    clocked(cpu.BlockSource, "decoded_released", "decode call")
    clocked(cpu.BlockSource, "decoded_prefixes", "decode call (part)")
    clocked(cpu, "untile_into", "untile")  # the CPU path looks the name up in its module
    reader = ShardReader(args.path, backend="cpu")
    rng = np.random.default_rng(1)
    planes = rng.integers(0, reader.shape[0], args.planes + 5).tolist()
    for t in planes[:5]:
        reader.read((t,))
    starts, ends = defaultdict(list), defaultdict(list)
    spans = []
    for t in planes[5:]:
        EVENTS.clear()
        begin = time.perf_counter()
        reader.read((t,))
        end = time.perf_counter()
        spans.append(end - begin)
        seen = defaultdict(int)
        for label, _, a, b in sorted(EVENTS, key=lambda e: e[2]):
            seen[label] += 1
            key = label if seen[label] == 1 else f"{label} #{seen[label]}"
            starts[key].append(1e3 * (a - begin))
            ends[key].append(1e3 * (b - begin))
    print(f"# {args.path.name}: {len(spans)} planes, median {1e3 * statistics.median(spans):.2f} ms")
    print(f"{'stage':<22}{'start ms':>10}{'end ms':>10}{'n':>5}")
    for key in sorted(starts, key=lambda k: statistics.median(starts[k])):
        print(
            f"{key:<22}{statistics.median(starts[key]):>10.2f}{statistics.median(ends[key]):>10.2f}{len(starts[key]):>5}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
