"""Liveness stress: hundreds of short Writers under injected storage faults, each call timed.

Every iteration records a random small layout through a :class:`FaultInjectingSink` with seeded
faults (stalls, 503 SlowDown, lost telemetry, a slow worker) and, in some iterations, a shard
that fails for good (ENOSPC), a frozen shard write (cut off by ``io_timeout``) or a slow write
nothing can cut off; appends, flushes, syncs and closes come in random order.  A watchdog dumps
every thread's stack and exits 3 when one call waits longer than ``--max-wait`` seconds (a hang).
After each Writer the store is checked: ``verify`` passes, the rows it claims read back as
appended.  ``--conversions N`` then runs N short conversions of random sources and layouts on one
local Dask cluster of two worker processes (convert's own, profiler off), each call timed the
same way and its output compared with the source.  Prints one summary line (iterations, calls,
failures seen, worst and p99 wait).

    python scripts/stress_liveness.py --iterations 500 --conversions 100   # the long version
    python scripts/stress_liveness.py --iterations 60 --max-wait 5  # what CI runs (tests/test_liveness.py)
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import functools
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from napari_tileshard import Dim, Layout, Writer, WriterError, verify
from napari_tileshard.testing import FaultInjectingSink, StorageFaults


class Watchdog:
    """Times each call; a call that runs past ``limit`` seconds is a hang: stacks, exit 3."""

    def __init__(self, limit: float):
        self.limit = limit
        self.waits: list[float] = []
        self._started: tuple[str, float] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def call(self, what: str, fn, *args):
        with self._lock:
            self._started = (what, time.monotonic())
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.waits.append(time.monotonic() - self._started[1])
                self._started = None

    def _watch(self):
        while True:
            time.sleep(0.1)
            with self._lock:
                started = self._started
            if started and time.monotonic() - started[1] > self.limit:
                print(f"HANG: {started[0]} has waited {time.monotonic() - started[1]:.1f} s", file=sys.stderr)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)


def one_writer(rng: random.Random, root: str, watchdog: Watchdog, i: int) -> str:
    """Record one random short stream; returns how it ended ("ok", or the failure's kind)."""
    shape = (0, rng.choice([32, 48, 64]), rng.choice([32, 48]))
    layout = Layout(
        [
            Dim("t", 0, rng.choice([1, 2, 4]), rng.choice([1, 2, 3])),
            Dim("y", shape[1], 16, rng.choice([1, 2])),
            Dim("x", shape[2], 16, rng.choice([1, 3])),
        ],
        dtype="uint16",
    )
    faults = StorageFaults(
        seed=i,
        stall_every=rng.choice([0, 5, 20]),
        stall_s=rng.choice([0.002, 0.02]),
        slowdown_rate=rng.choice([0.0, 0.1]),
        telemetry_loss=rng.choice([0.0, 0.3]),
        slow_worker=rng.choice([None, 0, 1]),
        slow_factor=3.0,
    )
    epoch = rng.randint(0, 6)
    mode = rng.choices(["clean", "fail", "freeze", "slow"], weights=[6, 2, 1, 1])[0]
    slow = threading.Event()
    kwargs: dict = {}
    if mode == "fail":
        kwargs["fail"] = {f"c/{epoch}/*": OSError(errno.ENOSPC, "No space left on device (injected)")}
    elif mode == "freeze":
        kwargs["freeze"] = {f"c/{epoch}/*": True}
    elif mode == "slow":  # a write nothing can cut off, which ends after a while
        kwargs["hold"] = {f"c/{epoch}/*": slow}
        threading.Timer(rng.uniform(0.05, 0.6), slow.set).start()
    path = os.path.join(root, f"s{i}.zarr")
    sink = FaultInjectingSink(path, faults=faults, **kwargs)
    writer = Writer(
        sink,
        layout,
        backend="cpu",
        threads=rng.choice([1, 2]),
        io_threads=rng.choice([1, 2, 4]),
        io_dispatch=rng.choice(["adaptive", "pull", "static"]),
        max_latency_s=0.01,
        batch_bytes=rng.choice([None, layout.epoch_bytes]),
        io_timeout=0.5,
        io_telemetry_lost=sink.telemetry_lost,
    )
    frames = np.arange(rng.randint(0, 40) * shape[1] * shape[2], dtype=np.uint16).reshape(-1, shape[1], shape[2])
    outcome = "ok"
    try:
        done = 0
        while done < len(frames):
            n = rng.randint(1, 5)
            watchdog.call("append", writer.append, frames[done : done + n])
            done += n
            r = rng.random()
            if r < 0.08:
                watchdog.call("flush", writer.flush)
            elif r < 0.12:
                watchdog.call("sync", writer.sync)
    except WriterError as exc:
        outcome = type(exc.__cause__).__name__
    try:
        watchdog.call("close", writer.close)
    except WriterError as exc:
        outcome = type(exc.__cause__).__name__
    slow.set()
    report = verify(path)
    if not report.ok:
        raise AssertionError(f"iteration {i} ({mode}): the store claims what it does not hold: {report.problems[:3]}")
    meta = json.loads(open(os.path.join(path, "zarr.json")).read())
    rows = meta["attributes"]["tileshard"]["rows_written"]
    if outcome == "ok" and rows != len(frames):
        raise AssertionError(f"iteration {i}: a clean recording claims {rows} rows of {len(frames)}")
    if rows:
        import zarr

        got = zarr.open_array(path, mode="r")[:rows]
        if not np.array_equal(got, frames[:rows]):
            raise AssertionError(f"iteration {i}: the {rows} claimed rows differ from what was appended")
    return outcome


def conversions(count: int, rng: random.Random, root: str, watchdog: Watchdog) -> int:
    """``count`` short conversions on one local cluster; returns how many ran."""
    import zarr
    from distributed import Client

    from napari_tileshard.apps.convert import convert, local_cluster

    with local_cluster(2) as cluster, Client(cluster) as client:
        for i in range(count):
            shape = (rng.randint(1, 40), rng.choice([32, 48, 64]), rng.choice([16, 40]))
            data = np.random.default_rng(i).integers(0, 500, shape, dtype=np.uint16)
            src = os.path.join(root, f"src{i}.zarr")
            zarr.create_array(src, shape=shape, chunks=(max(1, shape[0] // 3), *shape[1:]), dtype="uint16")[:] = data
            dst = os.path.join(root, f"dst{i}.zarr")
            tile = [rng.choice([1, 2, 4]), 16, 16]
            per_shard = [rng.choice([1, 2]), rng.choice([1, 2]), 1]
            watchdog.call(
                "convert", functools.partial(convert, src, dst, tile=tile, tiles_per_shard=per_shard, client=client)
            )
            if not np.array_equal(zarr.open_array(dst, mode="r")[:], data):
                raise AssertionError(f"conversion {i} differs from its source")
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(dst, ignore_errors=True)
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--conversions", type=int, default=0, help="short conversions after the Writers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait", type=float, default=5.0, help="a call waiting longer is a hang")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the writers' error log")
    args = parser.parse_args(argv)
    if not args.verbose:  # every injected failure is logged by its Writer: expected here
        logging.getLogger("napari_tileshard").setLevel(logging.CRITICAL)
    watchdog = Watchdog(args.max_wait)
    rng = random.Random(args.seed)
    outcomes: dict[str, int] = {}
    root = tempfile.mkdtemp(prefix="tileshard-stress-")
    start = time.monotonic()
    try:
        for i in range(args.iterations):
            outcome = one_writer(rng, root, watchdog, i)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            shutil.rmtree(os.path.join(root, f"s{i}.zarr"), ignore_errors=True)
        converted = conversions(args.conversions, rng, root, watchdog) if args.conversions else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    waits = sorted(watchdog.waits)
    summary = {
        "iterations": args.iterations,
        "conversions": converted,
        "calls": len(waits),
        "outcomes": outcomes,
        "worst_wait_s": round(waits[-1], 3) if waits else 0.0,
        "p99_wait_s": round(waits[int(0.99 * (len(waits) - 1))], 3) if waits else 0.0,
        "seconds": round(time.monotonic() - start, 1),
    }
    print(json.dumps(summary) if args.json else summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
