"""Do two decode threads get two CPUs when a step comes after the machine idled?

A 16 MiB tile row of the recorder's default layout (64 chunks of 2x256x256 uint16 camera data,
zstd level 1) is decoded by the reader's codec in two GIL-free calls of 32 chunks, one on each
of two pool threads (``TaskPool``, as the reader's decode threads), ``--steps`` times with
``--idle`` ms between steps (napari's time between time-slider steps), with the pool's threads
pinned one per CPU (the process's first two, as ``reader.cpu.pinned_cpus`` on 2 CPUs) and
not.  Per step: the wall time, both threads' CPU time, when the second half started, and
whether both halves ran on one CPU.

    python benchmarks/two_thread_decode.py --idle 0,20,50 --steps 150
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import zstandard

from napari_tileshard import SyntheticCamera
from napari_tileshard.format.codecs import Zstd
from napari_tileshard.reader.tasks import TaskPool

_libc = ctypes.CDLL(None)


def tile_row() -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Two 2048² camera frames cut into 64 chunks of 2x256x256, each a zstd level-1 frame, back to back."""
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    frames = np.stack(list(camera.frames(2)))
    chunks = frames.reshape(2, 8, 256, 8, 256).transpose(1, 3, 0, 2, 4).reshape(64, -1)
    compressor = zstandard.ZstdCompressor(level=1)
    blobs = [compressor.compress(chunk.tobytes()) for chunk in chunks]
    sizes = np.array([len(b) for b in blobs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return np.frombuffer(b"".join(blobs), np.uint8), offsets, sizes, chunks.shape[1] * chunks.itemsize


def run(pinned: bool, idle_s: float, steps: int) -> dict:
    source, offsets, sizes, chunk_bytes = tile_row()
    view, codec = memoryview(source), Zstd(level=1)
    scratch = [np.empty((32, chunk_bytes), np.uint8) for _ in range(2)]
    pool = TaskPool(2, "probe-decode", sorted(os.sched_getaffinity(0))[:2] if pinned else ())
    rows = []

    def half(h: int, step: dict) -> None:
        step["started"][h], step["where"][h], t0 = time.perf_counter(), _libc.sched_getcpu(), time.thread_time()
        part = slice(32 * h, 32 * (h + 1))
        assert codec.decoded_chunks_released(view, offsets[part], sizes[part], chunk_bytes, scratch[h]) is not None
        step["cpu"][h] = time.thread_time() - t0
        step["done"][h].set()

    for _ in range(steps + 5):
        step = {
            "started": [0.0, 0.0],
            "cpu": [0.0, 0.0],
            "where": [-1, -1],
            "done": [threading.Event(), threading.Event()],
        }
        t0 = time.perf_counter()
        pool.post(half, 0, step)
        pool.post(half, 1, step)
        for event in step["done"]:
            event.wait()
        wall = time.perf_counter() - t0
        rows.append(
            {
                "wall_ms": wall * 1e3,
                "cpu_ms": sum(step["cpu"]) * 1e3,
                "second_start_ms": (max(step["started"]) - t0) * 1e3,
                "one_cpu": step["where"][0] == step["where"][1],
            }
        )
        time.sleep(idle_s)
    pool.shutdown()
    rows = rows[5:]

    def q(key: str) -> dict:
        values = np.array([r[key] for r in rows])
        return {f"p{p}": round(float(np.percentile(values, p)), 2) for p in (50, 90, 99)} | {
            "max": round(float(values.max()), 2)
        }

    return {
        "pinned": pinned,
        "idle_ms": idle_s * 1e3,
        "wall_ms": q("wall_ms"),
        "cpu_ms": q("cpu_ms"),
        "second_start_ms": q("second_start_ms"),
        "both_on_one_cpu": round(sum(r["one_cpu"] for r in rows) / len(rows), 2),
        "cores_used_p50": round(float(np.median([r["cpu_ms"] / r["wall_ms"] for r in rows])), 2),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", default="0,20,50", help="ms between steps, comma-separated")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs Linux and two CPUs or more to run on")
    results = []
    for idle_ms in (float(v) for v in args.idle.split(",")):
        for pinned in (False, True):
            result = run(pinned, idle_ms / 1e3, args.steps)
            results.append(result)
            w, s = result["wall_ms"], result["second_start_ms"]
            arm = "pinned  " if pinned else "unpinned"
            print(
                f"idle {idle_ms:4.0f} ms, {arm}: wall p50/p99 {w['p50']:.1f} / {w['p99']:.1f} ms,"
                f" second half starts {s['p50']:.1f} ms, both on one CPU {result['both_on_one_cpu']:.0%},"
                f" cores used {result['cores_used_p50']:.2f}",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps({"results": results, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
