"""GPU throughput against memory footprint: one recording per batch size, each in a fresh process.

For each batch size the GPU Writer records ``--gib`` of 2048x2048 uint16 frames (the same frame
bank for every case) and reports: arm time, steady-state GB/s (appends after the first two
batches, before close), total GB/s (first frame to close), the Writer's memory estimate, what
CuPy's device and pinned pools actually hold, and nvCOMP's batched-compress ceiling for the same
tiles at that batch size (benchmarks/gpu_ceiling.py).  Budget cases (``--budgets``) record with
``max_device_bytes``/``max_host_bytes`` instead of a batch size.

    python benchmarks/footprint_sweep.py --batches 64,128,256,512,1024 --tiles 256k,1m --gib 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_write import TILE_CASES as TILES  # noqa: E402 - benchmarks/ is on sys.path above


def one_case(
    tile_name: str, batch_mib: int | None, budget: str | None, gib: float, out: str, slots: int, ceiling: bool = True
) -> dict:
    import cupy
    import gpu_ceiling
    import numpy as np
    from bench_write import layout_for

    from napari_tileshard import SyntheticCamera, Writer
    from napari_tileshard.engine.backends.gpu import GpuBackend

    if slots:
        GpuBackend.default_slots = slots

    tile = TILES[tile_name]
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    frames = max(tile[0], int(gib * 2**30 // camera.frame_bytes) // tile[0] * tile[0])
    layout = layout_for(camera.shape, tile)
    options: dict = {}
    if batch_mib:
        options["batch_bytes"] = batch_mib << 20
    if budget:
        device_gib, host_gib = (float(v) for v in budget.split("/"))
        options.update(max_device_bytes=int(device_gib * 2**30), max_host_bytes=int(host_gib * 2**30))
    shutil.rmtree(out, ignore_errors=True)  # the previous case's store: its deletion is not this case's arming
    t0 = time.perf_counter()
    writer = Writer(out, layout, backend="gpu", overwrite=True, **options)
    arm = time.perf_counter() - t0
    device_pool = cupy.get_default_memory_pool().total_bytes()
    steady_from = 2 * writer.batch_bytes // camera.frame_bytes + 1
    latencies = np.empty(frames)
    t_steady = None
    t_first = time.perf_counter()
    for i, frame in enumerate(camera.frames(frames)):
        if i == steady_from:
            t_steady = time.perf_counter()
        t = time.perf_counter()
        writer.append(frame)
        latencies[i] = time.perf_counter() - t
    t_appended = time.perf_counter()
    held = writer.memory_held()
    writer.close()
    t_closed = time.perf_counter()
    device_peak = max(device_pool, cupy.get_default_memory_pool().total_bytes())
    frame_bytes = camera.frame_bytes
    estimate = writer.memory_estimate()
    row = {
        "tile": tile_name,
        "batch_mib": writer.batch_bytes >> 20,
        "budget": budget,
        "slots": GpuBackend.default_slots,
        "arm_s": round(arm, 3),
        "steady_gbps": round((frames - steady_from) * frame_bytes / (t_appended - t_steady) / 1e9, 3)
        if t_steady
        else None,
        "total_gbps": round(frames * frame_bytes / (t_closed - t_first) / 1e9, 3),
        # the user's clock: from Writer(...) to the end of close(), arming included
        "user_gbps": round(frames * frame_bytes / (t_closed - t0) / 1e9, 3),
        "gib": gib,
        "close_s": round(t_closed - t_appended, 3),
        "first100_max_ms": round(float(latencies[:100].max()) * 1e3, 1),
        "steady_max_ms": round(float(latencies[steady_from:].max()) * 1e3, 1) if t_steady else None,
        "estimate_device_mib": estimate["device"] >> 20,
        "estimate_host_mib": estimate["host"] >> 20,
        "cupy_device_mib": device_peak >> 20,
        "held_device_mib": held["device"] >> 20,
        "held_pinned_mib": held["host"] >> 20,
    }
    if not ceiling:
        return row
    ceiling = gpu_ceiling.measure(camera, frames, layout, 1, batch_bytes=writer.batch_bytes)
    row["nvcomp_gbps"] = round(ceiling[0]["gbps"], 3)
    row["h2d_gbps"] = round(ceiling[1]["gbps"], 3)
    row["of_ceiling"] = round(row["steady_gbps"] / row["nvcomp_gbps"], 3) if row["steady_gbps"] else None
    return row


def best_ceiling(tile_name: str, calls_mib: list[int]) -> dict:
    """nvCOMP's batched zstd alone on the same tiles, one call per batch, for each call size: the
    best of them is the physical limit a recording of these tiles is compared with."""
    import gpu_ceiling
    from bench_write import layout_for

    from napari_tileshard import SyntheticCamera

    tile = TILES[tile_name]
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    layout = layout_for(camera.shape, tile)
    rates = {}
    for mib in calls_mib:
        frames = max(tile[0], (mib << 20) // camera.frame_bytes)
        rates[mib] = round(gpu_ceiling.measure(camera, frames, layout, 1, batch_bytes=mib << 20)[0]["gbps"], 3)
    return {"tile": tile_name, "nvcomp_by_call_mib": rates, "nvcomp_best_gbps": max(rates.values())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,128,256,512,1024", help="batch sizes in MiB")
    parser.add_argument("--budgets", default="", help="DEVICE_GIB/HOST_GIB pairs, comma-separated (e.g. 4/2,2/1)")
    parser.add_argument("--defaults", action="store_true", help="also one case with the Writer's default sizing")
    parser.add_argument("--tiles", default="256k")
    parser.add_argument("--slots", type=int, default=0, help="GPU device slots (default: the backend's)")
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--out", default="/dev/shm/tileshard-sweep.zarr")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print its JSON
    parser.add_argument("--json", default=None, help="write all rows here")
    parser.add_argument("--sizes", default="", help="GiB per recording, comma-separated (default: --gib); e.g. 4,16")
    parser.add_argument("--no-ceiling", action="store_true", help="skip nvCOMP's rate at each case's own batch size")
    parser.add_argument(
        "--best",
        default="",
        help="call sizes in MiB (e.g. 256,512,1024,2048): also nvCOMP's rate per call size and its best, per tile",
    )
    args = parser.parse_args()
    if args.case:
        tile, batch, budget = args.case.split(":")
        if batch == "best":
            print(json.dumps(best_ceiling(tile, [int(v) for v in budget.split("/")])))
            return
        row = one_case(tile, int(batch) or None, budget or None, args.gib, args.out, args.slots, not args.no_ceiling)
        print(json.dumps(row))
        return
    cases = [(t, int(b), "") for t in args.tiles.split(",") for b in args.batches.split(",") if b]
    cases += [(t, 0, b) for t in args.tiles.split(",") for b in args.budgets.split(",") if b]
    if args.defaults:
        cases += [(t, 0, "") for t in args.tiles.split(",")]
    sizes = [float(v) for v in args.sizes.split(",") if v] or [args.gib]
    runs = [(case, gib) for gib in sizes for case in cases]
    if args.best:
        runs = [((t, "best", args.best.replace(",", "/")), 0.0) for t in args.tiles.split(",")] + runs
    rows = []
    for (tile, batch, budget), gib in runs:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--case",
                f"{tile}:{batch}:{budget}",
                "--gib",
                str(gib),
                "--out",
                args.out,
                "--slots",
                str(args.slots),
                *(["--no-ceiling"] if args.no_ceiling else []),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            print(f"# {tile} batch {batch} budget {budget!r} failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
