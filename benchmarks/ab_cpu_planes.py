"""Interleaved A/B of single-plane CPU reads (``r[t]``, a whole 2-D frame): ``ShardReader``
variants against tensorstore, each engine opened once and reading the same random planes in turn,
the order rotating from plane to plane.

A single plane is what napari's time slider and most analysis code ask for; unlike a whole-array
read it is small (one frame: 8 MiB for 2048² uint16), so the fixed costs per read (threads woken,
Python per block) weigh more.  Per engine: median and 90th-percentile milliseconds per plane, the
process's CPU milliseconds per plane and its context switches per plane (threads waiting for each
other); ratios are of the medians (tensorstore's over the engine's: above 1 is faster than
tensorstore).  Variants as ``ab_cpu_read.py``'s (``name=SWITCH=v,keyword=v``; ``ours=`` the
default reader, which has no chunk cache unless a variant sets ``cache_bytes``;
``switchinterval=S``: the interpreter's GIL switch interval during this variant's reads).

    python benchmarks/ab_cpu_planes.py --path /dev/shm/r/64k-4m.zarr --planes 60 \\
        --variant ours= --variant small=UNCACHED_READS_AS_LARGE=0
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from ab_cpu_read import parse_variant, switched  # noqa: E402

from napari_tileshard import ShardReader  # noqa: E402


def _usage() -> tuple[float, int]:
    now = resource.getrusage(resource.RUSAGE_SELF)
    return now.ru_utime + now.ru_stime, now.ru_nvcsw + now.ru_nivcsw


def _read_plane(reader, t: int, interval: float | None):
    saved = sys.getswitchinterval()
    if interval is not None:
        sys.setswitchinterval(interval)
    try:
        return reader.read((t,))
    finally:
        sys.setswitchinterval(saved)


def measure(path: Path, variants: list, planes: int, seed: int, tensorstore: bool) -> dict[str, dict]:
    """Per engine: the seconds, CPU seconds and context switches of each plane read."""
    engines: dict[str, tuple] = {}
    if tensorstore:
        import tensorstore as ts

        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
        engines["ts"] = ({}, lambda t: store[t].read().result())
    for name, switches, keywords, source in variants:
        if source:
            raise SystemExit(f"variant {name}: another source tree is not supported here (one process)")
        keywords = dict(keywords)
        interval = keywords.pop("switchinterval", None)  # the GIL switch interval during its reads
        reader = ShardReader(path, backend="cpu", **keywords)
        engines[name] = (switches, lambda t, reader=reader, interval=interval: _read_plane(reader, t, interval))
    frames = ShardReader(path, backend="cpu").shape[0]
    names = list(engines)
    runs: dict[str, dict[str, list]] = {n: {"s": [], "cpu_s": [], "switches": []} for n in names}
    for i, t in enumerate(np.random.default_rng(seed).integers(0, frames, planes).tolist()):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            switches, read = engines[name]
            with switched(switches):
                cpu0, switches0 = _usage()
                started = time.perf_counter()
                read(t)
                seconds = time.perf_counter() - started
                cpu1, switches1 = _usage()
            runs[name]["s"].append(seconds)
            runs[name]["cpu_s"].append(cpu1 - cpu0)
            runs[name]["switches"].append(switches1 - switches0)
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, action="append", required=True, help="an existing array (repeatable)")
    parser.add_argument("--planes", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variant", action="append", help="name=SWITCH=v,keyword=v (repeatable)")
    parser.add_argument("--no-tensorstore", action="store_true")
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in (args.variant or ["ours="])]
    print(f"# {os.cpu_count()} CPUs; {args.planes} planes per engine, order rotating")
    print(f"# {' '.join(sys.argv)}", flush=True)
    for path in args.path:
        runs = measure(path, variants, args.planes, args.seed, not args.no_tensorstore)
        line = [f"{path.name}:"]
        for name, run in runs.items():
            line.append(
                f"{name} median {1e3 * statistics.median(run['s']):.1f} ms p90 {1e3 * np.percentile(run['s'], 90):.1f}"
                f" CPU {1e3 * statistics.mean(run['cpu_s']):.1f} ms switches {statistics.mean(run['switches']):.0f};"
            )
        if "ts" in runs:
            reference = statistics.median(runs["ts"]["s"])
            for name in runs:
                if name != "ts":
                    line.append(f"{name}/ts {reference / statistics.median(runs[name]['s']):.2f};")
        print(" ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
