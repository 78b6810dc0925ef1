"""The CPU backend's arm time and peak memory with the defaults a user gets, one fresh process per
run: ``Writer(...)`` (arm) until it returns, the first ``append``, the user's clock to ``close()``,
and the process's peak RSS above what it held before the Writer (the frame bank included in
neither).  Run it with each version's ``src`` first on ``PYTHONPATH`` to compare versions
(``git archive <commit> src | tar -x -C old``):

    PYTHONPATH=old/src python benchmarks/cpu_arm_memory.py --runs 3 --label old > old.jsonl
    PYTHONPATH=src     python benchmarks/cpu_arm_memory.py --runs 3 --label new > new.jsonl

It only uses the API every version has (``Writer(path, layout, codec=, level=, backend=)``).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CASES = {  # name: (tile t, y, x), tiles per shard (t, y, x); 2048² uint16 frames
    "default": None,  # Layout.default_for
    "64KiB-tiles/4MiB-shards": ((2, 128, 128), (1, 8, 8)),
    "1MiB-tiles/16MiB-shards": ((8, 256, 256), (1, 4, 4)),
}


def rss_now_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def one_run(case: str, gib: float, out: Path) -> dict:
    import numpy as np

    from napari_tileshard import Dim, Layout, Writer

    spec = CASES[case]
    if spec is None:
        layout = Layout.default_for((0, 2048, 2048), "uint16")
    else:
        (tt, ty, tx), (st, sy, sx) = spec
        layout = Layout([Dim("t", 0, tt, st), Dim("y", 2048, ty, sy), Dim("x", 2048, tx, sx)], "uint16")
    rng = np.random.default_rng(0)
    bank = [rng.integers(0, 2**12, (2048, 2048), dtype=np.uint16) >> np.uint16(k % 4) for k in range(8)]
    frames = int(gib * 2**30 // (2048 * 2048 * 2))
    shutil.rmtree(out, ignore_errors=True)
    before_kib = rss_now_kib()
    t0 = time.perf_counter()
    writer = Writer(str(out), layout, codec="zstd", level=1, backend="cpu")
    armed = time.perf_counter()
    writer.append(bank[0])
    first = time.perf_counter()
    for i in range(1, frames):
        writer.append(bank[i % len(bank)])
    writer.close()
    end = time.perf_counter()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shutil.rmtree(out, ignore_errors=True)
    return {
        "case": case,
        "gib": gib,
        "arm_s": armed - t0,
        "first_append_s": first - armed,
        "user_clock_gbps": frames * 2048 * 2048 * 2 / (end - t0) / 1e9,
        "peak_rss_above_start_mib": (peak_kib - before_kib) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="/dev/shm/cpu_arm_memory.zarr")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.gib, Path(args.out))))
        return
    for run in range(args.runs):
        for case in args.cases.split(","):
            result = subprocess.run(
                [sys.executable, __file__, "--one", case, "--gib", str(args.gib), "--out", args.out],
                capture_output=True,
                text=True,
                check=True,
            )
            record = {"label": args.label, "run": run, **json.loads(result.stdout)}
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
