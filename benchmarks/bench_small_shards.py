"""Per-shard overhead: a recording of many small shards through the Writer, and the I/O dispatcher alone.

Writer cases (the CPU backend): 17 476 random frames of 48 x 40 uint16 in 4 x 16 x 16 tiles, 2 x 2
x 2 tiles per shard (8 740 shards of at most 8 chunks, a few KiB each; the whole recording is one
CPU batch, so all 2 185 shard epochs may be queued for storage at once), into ``memory://``
and into a local directory under /tmp, with ``io_dispatch`` adaptive (the default) and pull.  Per case: wall
seconds of ``append`` + ``close``, shards per second, CPU seconds of the process (all threads),
and a SHA-256 over every stored object (key and bytes): the output must not change with the code.

Dispatcher case: a sink whose writes cost nothing but whose workers are all held busy, so
queues keep whatever is submitted; once every worker's model is warm, ``--backlog`` shards are
queued, then ``--submits`` batches of ``--batch`` shards are submitted and timed (the planner's
cost per submission with that backlog).  Then the workers are let go and the drain of the
whole backlog is timed (their pops and steals).

    python benchmarks/bench_small_shards.py                      # everything
    python benchmarks/bench_small_shards.py --only dispatch      # the micro-benchmark alone
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.engine.dispatch import Dispatcher
from napari_tileshard.storage.sinks import Sink
from napari_tileshard.storage.urls import open_sink


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def digest(objects: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for key in sorted(objects):
        h.update(key.encode() + b"\0" + hashlib.sha256(objects[key]).digest())
    return h.hexdigest()[:16]


def directory_objects(root: Path) -> dict[str, bytes]:
    """Every object of a local store (not the lock file)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name[0] != "."}


def store_objects(store) -> dict[str, bytes]:
    """Every object of a zarr Store (``memory://`` is a ``ZarrStoreSink`` over a private ``MemoryStore``)."""
    from zarr.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    async def collect():
        keys = [key async for key in store.list()]
        return {key: (await store.get(key, default_buffer_prototype())).to_bytes() for key in keys}

    return sync(collect())


def writer_case(storage: str, mode: str, frames: np.ndarray, layout: Layout, tmp: Path) -> dict:
    if storage == "memory":
        target = open_sink("memory://")  # what Writer("memory://") opens, held here to hash its objects
    else:
        target = tmp / f"small-{mode}.zarr"
        shutil.rmtree(target, ignore_errors=True)
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    with Writer(target, layout, backend="cpu", io_dispatch=mode) as writer:
        writer.append(frames)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    shards = writer.stats.shards_written
    row = {"storage": storage, "mode": mode, "wall_s": wall, "cpu_s": cpu, "shards": shards}
    if storage == "disk":
        row["hash"] = digest(directory_objects(target))
        shutil.rmtree(target, ignore_errors=True)
    else:
        row["hash"] = digest(store_objects(target.store))
    return row


class _HeldSink(Sink):
    """Writes cost nothing; while ``hold`` is clear every write waits for it (queues fill)."""

    def __init__(self):
        self.hold = threading.Event()
        self.hold.set()
        self.writes = 0

    @property
    def location(self) -> str:
        return "held"

    def write(self, key, buffers):
        self.hold.wait()
        self.writes += 1


def dispatch_case(mode: str, backlog: int, submits: int, batch: int, workers: int = 4) -> dict:
    sink = _HeldSink()
    dispatcher = Dispatcher(sink, workers, mode)
    payload = [bytes(4096)]
    seq = iter(range(10**9))

    def batch_of(n):
        return [(f"c/{next(seq)}/0/0", payload) for _ in range(n)]

    for _ in range(1000):  # warm every worker's model (>= 2 samples each): the planner runs
        if mode != "adaptive" or min(dispatcher.model_samples) >= 2:
            break
        for future in dispatcher.submit(batch_of(workers)):
            future.result()
    else:
        raise RuntimeError("the workers' models did not warm up")
    sink.hold.clear()
    futures = []
    for _ in range(workers):  # every worker takes one write and waits in it
        futures += dispatcher.submit(batch_of(1))
    time.sleep(0.05)
    for start in range(0, backlog, batch):
        futures += dispatcher.submit(batch_of(min(batch, backlog - start)))
    fallback = dispatcher.stats().fallback_rounds
    times = []
    for _ in range(submits):
        t0 = time.perf_counter()
        futures += dispatcher.submit(batch_of(batch))
        times.append(time.perf_counter() - t0)
    if dispatcher.stats().fallback_rounds != fallback:
        raise RuntimeError("a timed submission was placed statically (fallback): not the planner's cost")
    t0 = time.perf_counter()
    sink.hold.set()
    for future in futures:
        future.result()
    drain = time.perf_counter() - t0
    dispatcher.shutdown()
    stats = dispatcher.stats()
    return {
        "mode": mode,
        "backlog": backlog,
        "batch": batch,
        "submit_us_median": 1e6 * statistics.median(times),
        "submit_us_mean": 1e6 * statistics.mean(times),
        "drain_s": drain,
        "drain_shards_per_s": len(futures) / drain,
        "moves": stats.moves,
        "steals": stats.steals,
        "fallback_rounds": stats.fallback_rounds,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["writer", "dispatch"])
    parser.add_argument("--frames", type=int, default=17476)
    parser.add_argument("--repeat", type=int, default=3, help="Writer runs per case; medians")
    parser.add_argument("--backlogs", type=int, nargs="+", default=[0, 1000, 10000])
    parser.add_argument("--submits", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict = {"writer": [], "dispatch": []}

    if args.only != "dispatch":
        small = Layout([Dim("t", 0, 4, 2), Dim("y", 48, 16, 2), Dim("x", 40, 16, 2)], "uint16")
        frames = np.random.default_rng(0).integers(0, 4000, (args.frames, 48, 40), dtype=np.uint16)
        tmp = Path(tempfile.mkdtemp(prefix="bench-small-"))
        print(
            f"Writer, {args.frames} frames 48x40 uint16, CPU backend, {os.cpu_count()} cores; medians of {args.repeat}"
        )
        print(f"{'storage':8} {'mode':9} {'wall s':>7} {'shards/s':>9} {'CPU s':>6} {'shards':>7}  hash")
        try:
            for storage in ("memory", "disk"):
                for mode in ("adaptive", "pull"):
                    runs = []
                    for _ in range(args.repeat):
                        runs.append(writer_case(storage, mode, frames, small, tmp))
                    wall = statistics.median(r["wall_s"] for r in runs)
                    cpu = statistics.median(r["cpu_s"] for r in runs)
                    hashes = {r.get("hash") for r in runs}
                    row = {
                        **runs[0],
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "walls": [round(r["wall_s"], 3) for r in runs],
                        "shards_per_s": runs[0]["shards"] / wall,
                    }
                    results["writer"].append(row)
                    print(
                        f"{storage:8} {mode:9} {wall:7.2f} {row['shards_per_s']:9.0f} {cpu:6.2f} {row['shards']:7d}  "
                        f"{','.join(sorted(hashes))}  runs {row['walls']}",
                        flush=True,
                    )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    if args.only != "writer":
        print(f"\nDispatcher alone: 4 workers held busy, batches of {args.batch} x 4 KiB, {args.submits} timed submits")
        print(f"{'mode':9} {'backlog':>7} {'submit us (median)':>18} {'mean':>7} {'drain s':>8} {'drain /s':>9}")
        for mode in ("adaptive", "pull"):
            for backlog in args.backlogs:
                row = dispatch_case(mode, backlog, args.submits, args.batch)
                results["dispatch"].append(row)
                print(
                    f"{mode:9} {backlog:7d} {row['submit_us_median']:18.1f} {row['submit_us_mean']:7.1f} "
                    f"{row['drain_s']:8.3f} {row['drain_shards_per_s']:9.0f}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
