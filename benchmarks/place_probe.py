"""How far a CPU read could go on this host: libzstd's decode alone against the bare read pipeline
(``bench_read.pipeline_ceiling``) and its variants, on the same recordings, in one process.

    python benchmarks/place_probe.py --gib 2 --rounds 2 --out probe.json
    python benchmarks/place_probe.py --quick --out /tmp/probe.json      # small, on any machine

Per layout (``cpu_many_cores.layouts``): libzstd alone (``bench_read.decode_ceiling``: one thread,
and ``--threads`` at once), then each pipeline variant, the variants' order turned each round:
``whole`` (each shard read, decoded in one batch, placed by one copy), ``place<K>`` (decoded and
placed in batches of K KiB, each placed while in the CPU's caches), ``mapped`` / ``mapped-place<K>``
(decoded straight from a mapping of the file, no copy out of the page cache), and ours
(``ShardReader(backend="cpu").read()``, best of 3).  Also the memory's copy rate on ``--threads``
threads (2 GiB, 64 MiB pieces), the bound of any placing.  JSON lines as it goes; a summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_read import decode_ceiling, pipeline_ceiling  # noqa: E402
from cpu_many_cores import FRAME, gigabytes, layouts, make_layout, write_recording  # noqa: E402

from napari_tileshard import ShardReader, SyntheticCamera  # noqa: E402


def copy_rate(threads: int, nbytes: int, piece: int = 64 << 20) -> float:
    """GB/s of bytes copied by ``threads`` threads between two touched arrays of ``nbytes``."""
    source = np.ones(nbytes, np.uint8)
    target = np.zeros(nbytes, np.uint8)
    target[:] = 2
    pieces = [(a, min(a + piece, nbytes)) for a in range(0, nbytes, piece)]

    def one(bounds) -> None:
        np.copyto(target[bounds[0] : bounds[1]], source[bounds[0] : bounds[1]])

    with ThreadPoolExecutor(threads) as pool:
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            list(pool.map(one, pieces))
            best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def read_ours(path: Path, repeat: int) -> float:
    reader = ShardReader(path, backend="cpu")
    try:
        best, nbytes = float("inf"), 0
        for _ in range(repeat):
            started = time.perf_counter()
            out = reader.read()
            best = min(best, time.perf_counter() - started)
            nbytes = out.nbytes
            del out
        return nbytes / best / 1e9
    finally:
        reader.close()


def variants(places: list[int]) -> dict[str, dict]:
    found = {"whole": {}}
    for k in places:
        found[f"place{k}"] = {"place_bytes": k << 10}
    found["mapped"] = {"mapped": True}
    for k in places[-1:]:
        found[f"mapped-place{k}"] = {"mapped": True, "place_bytes": k << 10}
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default="64k-4m,256k-4m,1m-16m")
    parser.add_argument("--places", default="256,512,1024", help="KiB per placed batch, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/tileshard-place-probe"))
    parser.add_argument("--quick", action="store_true", help="0.125 GiB, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.gib, args.rounds = 0.125, 1
    camera = SyntheticCamera(FRAME, "uint16", seed=0)
    camera.prepare()
    frame_gb = gigabytes(1)
    results: dict = {"command": " ".join(sys.argv), "threads": args.threads, "layouts": {}}
    results["copy_gbps"] = round(copy_rate(args.threads, int(min(2.0, args.gib) * (1 << 30))), 2)
    print(json.dumps({"copy_gbps": results["copy_gbps"]}), flush=True)
    ways = variants([int(k) for k in args.places.split(",") if k])
    for name in args.layouts.split(","):
        tile, per_shard = layouts()[name]
        layout = make_layout(tile, per_shard)
        epoch = layout.shard_epoch_rows
        frames = max(epoch, int(args.gib * (1 << 30) / 1e9 / frame_gb) // epoch * epoch)
        path = args.dir / f"{name}.zarr"
        write_recording(camera, layout, frames, path)
        row: dict = {"zstd": decode_ceiling(path, args.threads), "rounds": []}
        print(json.dumps({"layout": name, "zstd": row["zstd"]}), flush=True)
        names = [*ways, "ours"]
        for r in range(args.rounds):
            measured = {}
            for way in names[r % len(names) :] + names[: r % len(names)]:
                if way == "ours":
                    measured[way] = {"pipeline_gbps": round(read_ours(path, 3), 2), "pipeline_exact": True}
                else:
                    measured[way] = pipeline_ceiling(path, args.threads, **ways[way])
            row["rounds"].append(measured)
            print(json.dumps({"layout": name, "round": r, **measured}), flush=True)
        zstd_all = row["zstd"][f"zstd_{args.threads}threads_gbps"]
        row["median_gbps"] = {w: statistics.median(m[w]["pipeline_gbps"] for m in row["rounds"]) for w in names}
        row["exact"] = all(m[w].get("pipeline_exact", False) for m in row["rounds"] for w in names)
        row["of_zstd"] = {w: round(v / zstd_all, 2) for w, v in row["median_gbps"].items()}
        results["layouts"][name] = row
        shutil.rmtree(path, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"memory copy, {args.threads} threads: {results['copy_gbps']} GB/s")
    for name, row in results["layouts"].items():
        zstd = row["zstd"]
        print(
            f"{name}: libzstd 1 thread {zstd['zstd_1thread_gbps']} / {args.threads} threads "
            f"{zstd[f'zstd_{args.threads}threads_gbps']} GB/s; exact {row['exact']}"
        )
        for way, gbps in row["median_gbps"].items():
            print(f"  {way:>18}: {gbps:6.2f} GB/s  {row['of_zstd'][way]:.2f} of libzstd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
