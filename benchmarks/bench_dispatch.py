"""Shard-write dispatch under storage faults: static round-robin vs shared pull queue vs adaptive.

Pre-encoded shard bytes (random, no compression) go through the I/O dispatcher
(``napari_tileshard.engine.dispatch``) into a local directory and into a local S3 server (moto, its own
process), wrapped in the public fault seam ``testing.FaultInjectingSink(faults=StorageFaults(...))``:
a simulated service time per write (``--service-ms`` + size / ``--service-mbps``) on top of the real
write, and per fault one worker 2x/5x/10x slower, ~1 write in 20 stalling 100 ms, 5 % of writes
answered "503 SlowDown", or 30 % of rounds losing their telemetry (the dispatcher's seam,
``Dispatcher(telemetry_lost=sink.telemetry_lost)``).  Same seed, same faults.

The producer hands over one batch (``--batch`` shards, one shard epoch) at a time, as the
Writer's collector does: paced at ``--load`` of the fault-free capacity measured first (pull queue,
unpaced), and never more than 2 batches ahead of storage (the collector's backpressure).

Per run: total time (first submit to last shard stored), p50/p99 shard write latency (a write's
first start to its first successful copy), the straggler gap (max - min worker busy time),
moves/steals/hedges, duplicate bytes; every object is read back and compared with its bytes.
``--predictors`` also scores the rate and the affine predictor on the runs' assignment logs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from napari_tileshard.engine.dispatch import MODES, PREDICTORS, Dispatcher
from napari_tileshard.testing import FaultInjectingSink, StorageFaults

MEDIANS = ("total_s", "p50_ms", "p99_ms", "gap_s")
FAULTS = {
    "none": {},
    "slow2x": {"slow_worker": 0, "slow_factor": 2.0},
    "slow5x": {"slow_worker": 0, "slow_factor": 5.0},
    "slow10x": {"slow_worker": 0, "slow_factor": 10.0},
    "stalls": {"stall_every": 20, "stall_s": 0.1},
    "slowdown503": {"slowdown_rate": 0.05},
    "telemetry_loss": {"telemetry_loss": 0.3, "slow_worker": 0, "slow_factor": 5.0},
}


def shard_payloads(count: int, nbytes: int, seed: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    # Distinct bytes per shard (a prefix with its number) without generating count x nbytes at random.
    return [(f"c/{i // 64}/{i % 64}/0", i.to_bytes(8, "little") + base[8:]) for i in range(count)]


def run_once(inner_factory, payloads, batch, mode, faults, interval_s, workers):
    sink = FaultInjectingSink(inner_factory(), faults=faults)
    dispatcher = Dispatcher(sink, workers, mode, telemetry_lost=sink.telemetry_lost)
    batches = [payloads[i : i + batch] for i in range(0, len(payloads), batch)]
    pending: list[list] = []
    start = time.perf_counter()
    for b, items in enumerate(batches):
        while len(pending) > 2:  # the collector's backpressure: 2 shard epochs wait on storage
            for future in pending.pop(0):
                future.result()
        delay = start + b * interval_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pending.append(dispatcher.submit([(key, [data]) for key, data in items]))
    for futures in pending:
        for future in futures:
            future.result()
    total = time.perf_counter() - start
    dispatcher.shutdown()
    stats = dispatcher.stats()
    inner = sink.inner
    wrong = [key for key, data in payloads if inner.read(key) != data]
    inner.discard()  # this run's objects (and directory): the next run starts on an empty store
    lat = sorted(stats.latencies_s)
    return {
        "mode": mode,
        "total_s": total,
        "p50_ms": 1e3 * lat[len(lat) // 2],
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "gap_s": stats.straggler_gap_s,
        "shards_per_worker": [w["shards"] for w in stats.workers],
        "moves": stats.moves,
        "steals": stats.steals,
        "hedges": stats.hedges,
        "duplicate_bytes": stats.duplicate_bytes,
        "duplicate_share": stats.duplicate_bytes / stats.bytes,
        "retries": stats.retries,
        "fallback_rounds": stats.fallback_rounds,
        "replaced": stats.replaced,
        "wrong_objects": len(wrong),
        "log": list(dispatcher.assignment_log),
    }


def score_predictors(logs: list[list]) -> dict[str, float]:
    """Mean absolute relative error of each predictor, trained online on each run's log in order."""
    errors: dict[str, list[float]] = {name: [] for name in PREDICTORS}
    for log in logs:
        for name, make in PREDICTORS.items():
            models: dict[int, object] = {}
            for worker, _key, _round, nbytes, seconds, kind in log:
                if "failed" in kind:
                    continue
                model = models.setdefault(worker, make())
                if model.samples >= 2 and seconds > 0:  # type: ignore[attr-defined]
                    errors[name].append(abs(model.predict(nbytes) - seconds) / seconds)  # type: ignore[attr-defined]
                model.observe(nbytes, seconds)  # type: ignore[attr-defined]
    return {name: statistics.mean(e) if e else float("nan") for name, e in errors.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--storage", nargs="+", default=["disk", "s3"], choices=["disk", "s3"])
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--shards", type=int, default=320)
    parser.add_argument("--shard-kib", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="shards per batch (one shard epoch)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--service-ms", type=float, default=4.0)
    parser.add_argument("--service-mbps", type=float, default=100.0)
    parser.add_argument("--load", type=float, default=0.7, help="pace as a share of fault-free capacity")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (modes interleaved); medians")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--predictors", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    payloads = shard_payloads(args.shards, args.shard_kib << 10, args.seed)
    common = {"seed": args.seed, "service_s": args.service_ms / 1e3, "service_bytes_per_s": args.service_mbps * 1e6}
    results, logs = [], []
    tmp = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    server = None
    try:
        for storage in args.storage:
            counter = itertools.count()
            if storage == "disk":
                factory = functools.partial(lambda c: tmp / f"run{next(c)}.zarr", counter)
            else:
                import boto3
                from bench_s3 import MotoProcess, use_endpoint

                server = MotoProcess(tmp / "moto.log")
                use_endpoint(server.endpoint)
                boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket="dispatch")

                factory = functools.partial(lambda c: f"s3://dispatch/run{next(c)}.zarr", counter)

            # Fault-free capacity (pull queue, unpaced), then the pace.
            probe = run_once(factory, payloads, args.batch, "pull", StorageFaults(**common), 0.0, args.workers)
            interval = probe["total_s"] / (args.shards / args.batch) / args.load
            print(
                f"\n{storage}: {args.shards} shards x {args.shard_kib} KiB, {args.workers} workers, batches of "
                f"{args.batch}; service {args.service_ms} ms + size/{args.service_mbps} MB/s; capacity "
                f"{args.shards / probe['total_s']:.0f} shards/s, paced at {args.load:.0%}: one batch per "
                f"{1e3 * interval:.1f} ms",
                flush=True,
            )
            print(
                f"{'fault':15} {'mode':9} {'total s':>8} {'p50 ms':>7} {'p99 ms':>7} {'gap s':>6} "
                f"{'shards/worker':>22} {'moves':>5} {'steals':>6} {'hedges':>6} {'dup %':>5} "
                f"{'fallbk':>6} {'repl':>4} {'wrong':>5}"
            )
            for fault in args.faults:
                faults = StorageFaults(**common, **FAULTS[fault])
                runs: dict[str, list] = {mode: [] for mode in args.modes}
                for r in range(args.repeat):
                    order = args.modes if r % 2 == 0 else list(reversed(args.modes))
                    for mode in order:
                        runs[mode].append(run_once(factory, payloads, args.batch, mode, faults, interval, args.workers))
                for mode in args.modes:
                    cell = runs[mode]
                    logs.extend(run.pop("log") for run in cell)
                    med = {k: statistics.median(run[k] for run in cell) for k in MEDIANS}
                    last = cell[len(cell) // 2]
                    row = {
                        "storage": storage,
                        "fault": fault,
                        **last,
                        **med,
                        "duplicate_share": max(run["duplicate_share"] for run in cell),
                        "wrong_objects": sum(run["wrong_objects"] for run in cell),
                        "total_runs_s": [round(run["total_s"], 4) for run in cell],
                    }
                    results.append(row)
                    print(
                        f"{fault:15} {mode:9} {med['total_s']:8.3f} {med['p50_ms']:7.1f} {med['p99_ms']:7.1f} "
                        f"{med['gap_s']:6.2f} {str(last['shards_per_worker']):>22} {last['moves']:5d} "
                        f"{last['steals']:6d} {last['hedges']:6d} {100 * row['duplicate_share']:5.1f} "
                        f"{last['fallback_rounds']:6d} {last['replaced']:4d} {row['wrong_objects']:5d}",
                        flush=True,
                    )
            if server is not None:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    print("\ntargets (medians):")
    for storage in args.storage:
        cells = {(r["fault"], r["mode"]): r for r in results if r["storage"] == storage}
        if ("none", "adaptive") in cells and ("none", "pull") in cells:
            ratio = cells["none", "adaptive"]["total_s"] / cells["none", "pull"]["total_s"]
            print(f"  {storage}: no fault, adaptive / pull total time = {ratio:.3f} (target <= 1.02)")
        if ("slow10x", "adaptive") in cells and ("none", "adaptive") in cells:
            ratio = cells["slow10x", "adaptive"]["total_s"] / cells["none", "adaptive"]["total_s"]
            print(f"  {storage}: 10x slow worker, adaptive total / its fault-free total = {ratio:.3f} (target <= 1.1)")
        if ("slow10x", "adaptive") in cells and ("slow10x", "pull") in cells:
            ratio = cells["slow10x", "adaptive"]["p99_ms"] / cells["slow10x", "pull"]["p99_ms"]
            print(f"  {storage}: 10x slow worker, adaptive p99 / pull p99 = {ratio:.3f} (target <= 0.5)")
    if args.predictors:
        print("\npredictor mean |relative error| (online, per worker, over every run's assignment log):")
        for name, err in score_predictors(logs).items():
            print(f"  {name:7} {err:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
