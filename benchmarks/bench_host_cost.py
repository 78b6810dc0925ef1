"""Per-shard host cost of a ShardReader read: planning, index reads and fetching, in µs per shard.

For stores of many small shards the host's Python per shard, not decoding, bounds a read
(issue 30: the GPU path decodes a 4 MiB shard in ~0.1 ms).  Measured on an existing array
(``--path``, several allowed), for a whole-array read:

* ``plan_cold``: ``ShardReader(path).plan(...)`` on a fresh reader (every shard index read and
  validated), minus the reader's opening (timed apart);
* ``plan_warm``: the same plan again (indexes cached);
* ``fetch``: every read of the plan into the reader's buffers, on the prefetch threads, no decode;
* ``read``: the whole read (decode included), for scale.

``--compare SRC``: also run the package found under ``SRC`` (for example an older checkout's
``src``) in alternation with this one, ``--rounds`` times each, in subprocesses: A/B ratios from
one run.  The best of ``--repeat`` per round; the median over rounds is reported.

    python benchmarks/bench_host_cost.py --path /dev/shm/x/64k.zarr --compare /work/main/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "src"


def measure(path: str, repeat: int) -> dict:
    import numpy as np

    from napari_tileshard import ShardReader

    ShardReader(path, backend="cpu").read(...)  # warm the page cache and imports
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    for _ in range(repeat):
        started = time.perf_counter()
        reader = ShardReader(path, backend="cpu")
        keep("open", time.perf_counter() - started)
        started = time.perf_counter()
        plan = reader.plan(...)
        keep("plan_cold", time.perf_counter() - started)
        started = time.perf_counter()
        plan = reader.plan(...)
        keep("plan_warm", time.perf_counter() - started)
        started = time.perf_counter()
        buffers = [buffer for _, buffer in reader._fetched(plan.reads)]
        keep("fetch", time.perf_counter() - started)
        reader._recycle(buffers)
        started = time.perf_counter()
        out = reader.read(...)
        keep("read", time.perf_counter() - started)
        reader.close()
    shards = len(plan.blocks)
    result = {f"{k}_us_per_shard": round(v * 1e6 / shards, 1) for k, v in best.items() if k != "open"}
    result.update(shards=shards, reads=len(plan.reads), read_gbps=round(out.nbytes / best["read"] / 1e9, 2))
    del np
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", action="append", required=True)
    parser.add_argument("--compare", help="another package source directory, run in alternation (A/B)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a subprocess's single round
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps({p: measure(p, args.repeat) for p in args.path}))
        return 0
    sources = {"this": str(HERE)} | ({"compare": args.compare} if args.compare else {})
    rounds: dict[str, list[dict]] = {name: [] for name in sources}
    for _ in range(args.rounds):
        for name, src in sources.items():
            command = [sys.executable, __file__, "--one", "--repeat", str(args.repeat)]
            command += [x for p in args.path for x in ("--path", p)]
            env = dict(os.environ, PYTHONPATH=src)
            rounds[name].append(json.loads(subprocess.run(command, env=env, check=True, capture_output=True).stdout))
    for path in args.path:
        print(path)
        for metric in rounds["this"][0][path]:
            values = {name: [r[path][metric] for r in rs] for name, rs in rounds.items()}
            line = "  ".join(f"{name} {statistics.median(v)} [{min(v)}..{max(v)}]" for name, v in values.items())
            if args.compare and metric.endswith("per_shard"):
                ratios = [a / b for a, b in zip(values["compare"], values["this"]) if b]
                line += f"  compare/this {statistics.median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]"
            print(f"  {metric:>24}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
