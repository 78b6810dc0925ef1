"""Cold start of ``napari-tileshard record`` as a user runs it: a fresh process, the default
2048² synthetic camera, ``--frames 64``; seconds to the command's first output line, to its end,
and its peak RSS.  One JSON line per run; give each version's ``src`` to compare versions
(``git archive <commit> src | tar -x -C old``):

    python benchmarks/record_cold_start.py --src old/src --label old --runs 2
    python benchmarks/record_cold_start.py --src src --label new --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(src: str, label: str, frames: int, backend: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="cold-record-")) / "r.zarr"
    argv = [sys.executable, "-m", "napari_tileshard.apps.cli", "record", str(out), "--frames", str(frames)]
    argv += ["--overwrite", "--no-progress", "--backend", backend]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=dict(os.environ, PYTHONPATH=src), stderr=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    assert proc.stderr is not None
    first = None
    for _ in proc.stderr:
        if first is None:
            first = time.perf_counter() - start
    proc.wait()
    total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far (KiB)
    shutil.rmtree(out.parent, ignore_errors=True)
    return {
        "label": label,
        "first_output_s": round(first if first is not None else float("nan"), 2),
        "total_s": round(total, 2),
        "peak_rss_mib": round(peak / 1024) if peak > before else None,
        "rc": proc.returncode,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--label", default="this")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(one_run(args.src, args.label, args.frames, args.backend)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
