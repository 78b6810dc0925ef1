"""Write the same synthetic frames with this project and its peers; print GB/s and ratios.

Every engine receives the same frames (a bank of realistic uint16 frames from SyntheticCamera,
replayed) one by one, and is timed from the first frame until its store is closed (store
creation and buffer allocation happen before, as when a recorder is armed).  Peers get
the same chunk (tile) shape, shard shape and zstd level.  GPU ceilings (nvCOMP batched encode of
device-resident tiles, pinned H2D copy) are measured in the same run when a GPU is present.

Example (the command in docs/benchmarks.md):
    python benchmarks/bench_write.py --gib 4 --out /dev/shm/tileshard-bench --json benchmarks/results/run.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # zstd_ceiling, beside this script
from zstd_ceiling import zstd_ceiling

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer

ENGINES = ("tileshard-gpu", "tileshard-cpu", "tensorstore", "zarr-python", "acquire-zarr")
# Pyramid cases (OME-Zarr, 2x mean over y/x until a level fits one tile): not in the default set.
PYRAMID_ENGINES = ("tileshard-gpu-ome", "tileshard-cpu-ome", "acquire-zarr-ome")


TILE_CASES = {
    "64k": (8, 64, 64),
    "256k": (8, 128, 128),
    "1m": (32, 128, 128),
    "4m": (32, 256, 256),
    "1m-d8": (8, 256, 256),  # deep tiles of issue 29: 8 frames of 256 x 256
    # shallow tiles, 1 or 2 frames deep (a shard epoch is then one tile epoch: 1-2 frames)
    "64k-d1": (1, 128, 256),
    "256k-d1": (1, 256, 512),
    "1m-d1": (1, 512, 1024),
    "4m-d1": (1, 1024, 2048),
    "64k-d2": (2, 128, 128),
    "256k-d2": (2, 256, 256),
    "1m-d2": (2, 512, 512),
    "4m-d2": (2, 1024, 1024),
}


def tile_cases(names):
    """Tile shapes (t, y, x) for uint16 from 64 KiB to 4 MiB (``-d1``/``-d2``: 1 or 2 frames deep),
    shards 1 x 1024 x 1024 pixels (wider where a tile is)."""
    unknown = [name for name in names if name not in TILE_CASES]
    if unknown:
        raise SystemExit(f"unknown tile case(s) {', '.join(unknown)}; known: {', '.join(TILE_CASES)}")
    return [(name, TILE_CASES[name]) for name in names]


def layout_for(frame_shape, tile, unbounded=True, frames=None):
    ty, tx = tile[1], tile[2]
    return Layout(
        [
            Dim("t", 0 if unbounded else frames, tile[0], 1),
            Dim("y", frame_shape[0], ty, max(1, 1024 // ty)),
            Dim("x", frame_shape[1], tx, max(1, 1024 // tx)),
        ],
        "uint16",
    )


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- engines ------------------------------------------------------------------------------
# Each engine is set up (store created, buffers allocated) before the clock starts, as a
# recorder is configured before an acquisition; the clock runs from the first frame until the
# store is closed.
def setup_tileshard(backend, camera, frames, tile, out, level, ome=False):
    layout = layout_for(camera.shape, tile)
    writer = Writer(out, layout, codec="zstd", level=level, backend=backend, overwrite=True, ome=ome, downsample="mean")

    def run():
        with writer:
            for frame in camera.frames(frames):
                writer.append(frame)
        return writer.stats.backend

    return run


def slabs(camera, frames, rows):
    """Frames gathered into shard-epoch slabs (the copy a slab-writing peer needs), double-buffered."""
    buffers = [np.empty((rows,) + camera.shape, camera.dtype) for _ in range(2)]
    filled, which = 0, 0
    start = 0
    for i, frame in enumerate(camera.frames(frames)):
        buffers[which][filled] = frame
        filled += 1
        if filled == rows or i == frames - 1:
            yield start, buffers[which][:filled]
            start += filled
            filled, which = 0, 1 - which


def tensorstore_spec(kvstore: dict, shape, shard_shape, tile, level: int, dtype: str = "uint16") -> dict:
    """A tensorstore ``zarr3`` spec of the same sharded array a recording writes (zstd ``level``
    tiles, a CRC32C index at the end), created anew in ``kvstore``."""
    spec = {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(tile),
                        "codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "zstd", "configuration": {"level": level}},
                        ],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    },
                }
            ],
        },
        "create": True,
    }
    if kvstore.get("driver") == "file":
        spec["delete_existing"] = True
    return spec


def write_in_slabs(store, camera, frames: int, epoch_rows: int) -> None:
    """The camera's frames into a tensorstore array, a shard epoch at a time, one write in flight
    while the next slab fills (as a recorder gives them)."""
    pending = None
    for start, slab in slabs(camera, frames, epoch_rows):
        future = store[start : start + len(slab)].write(slab)
        if pending is not None:
            pending.result()
        pending = future
    if pending is not None:
        pending.result()


def setup_tensorstore(camera, frames, tile, out, level):
    import tensorstore as ts

    layout = layout_for(camera.shape, tile, unbounded=False, frames=frames)
    kvstore = {"driver": "file", "path": str(out)}
    store = ts.open(tensorstore_spec(kvstore, [frames, *camera.shape], layout.shard_shape, tile, level)).result()

    def run():
        write_in_slabs(store, camera, frames, layout.shard_epoch_rows)
        return "tensorstore"

    return run


def setup_zarr_python(camera, frames, tile, out, level):
    import zarr

    layout = layout_for(camera.shape, tile, unbounded=False, frames=frames)
    array = zarr.create_array(
        out,
        shape=(frames, *camera.shape),
        chunks=tile,
        shards=layout.shard_shape,
        dtype="uint16",
        compressors=zarr.codecs.ZstdCodec(level=level),
        fill_value=0,
        overwrite=True,
        dimension_names=["t", "y", "x"],
    )

    def run():
        for start, slab in slabs(camera, frames, layout.shard_epoch_rows):
            array[start : start + len(slab)] = slab
        return f"zarr-python {zarr.__version__}"

    return run


def setup_acquire_zarr(camera, frames, tile, out, level, ome=False):
    import acquire_zarr as az

    layout = layout_for(camera.shape, tile)
    settings = az.StreamSettings(store_path=str(out), overwrite=True, max_threads=os.cpu_count())
    dims = [
        az.Dimension(
            name=d.name, kind=kind, array_size_px=d.size, chunk_size_px=d.tile_size, shard_size_chunks=d.tiles_per_shard
        )
        for d, kind in zip(layout.dims, (az.DimensionType.TIME, az.DimensionType.SPACE, az.DimensionType.SPACE))
    ]
    settings.arrays = [
        az.ArraySettings(
            output_key="0",
            data_type=az.DataType.UINT16,
            dimensions=dims,
            compression=az.CompressionSettings(
                compressor=az.Compressor.ZSTD, codec=az.CompressionCodec.ZSTD, level=level, shuffle=0
            ),
            **({"downsampling_method": az.DownsamplingMethod.MEAN} if ome else {}),
        )
    ]
    stream = az.ZarrStream(settings)

    def run():
        for frame in camera.frames(frames):
            stream.append(frame)
        stream.close()
        return "acquire-zarr 0.10"

    return run


def setup_engine(engine, camera, frames, tile, out, level):
    ome = engine.endswith("-ome")
    if engine.startswith("tileshard-"):
        return setup_tileshard(engine.split("-")[1], camera, frames, tile, out, level, ome)
    if engine == "acquire-zarr-ome":
        return setup_acquire_zarr(camera, frames, tile, out, level, ome=True)
    return {"tensorstore": setup_tensorstore, "zarr-python": setup_zarr_python, "acquire-zarr": setup_acquire_zarr}[
        engine
    ](camera, frames, tile, out, level)


def measure(engine, camera, frames, tile, out_root, level, user_clock=False):
    out = out_root / f"{engine}.zarr"
    shutil.rmtree(out, ignore_errors=True)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = setup_engine(engine, camera, frames, tile, out, level)
    if not user_clock:  # the armed clock: store creation and buffers before the first frame
        cpu0, wall0 = time.process_time(), time.perf_counter()
    label = run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    bytes_in = frames * camera.frame_bytes
    bytes_out = dir_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "engine": engine,
        "label": label,
        "seconds": wall,
        "gbps": bytes_in / wall / 1e9,
        "ratio": bytes_in / bytes_out,
        "cpu_s_per_gb": cpu / (bytes_in / 1e9),
        "bytes_in": bytes_in,
    }


def gpu_ceilings(camera, frames, tile, level):
    """nvCOMP batched zstd of device-resident tiles, and pinned H2D bandwidth, on this GPU."""
    import gpu_ceiling  # benchmarks/, beside this script (sys.path[0] when run as a script)

    return gpu_ceiling.measure(camera, frames, layout_for(camera.shape, tile), level)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="input GiB per case")
    parser.add_argument("--frame", action="append", default=None, help="frame shape HxW (repeatable)")
    parser.add_argument(
        "--tiles", default="64k,256k,1m,4m", help=f"comma-separated tile cases: {', '.join(TILE_CASES)}"
    )
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--out", default="/dev/shm/tileshard-bench", help="where stores are written")
    parser.add_argument("--json", default=None, help="write raw results here")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per engine, engines taking turns; the median is kept"
    )
    parser.add_argument(
        "--clock",
        choices=("armed", "user"),
        default="armed",
        help="armed: from the first frame to close (store and buffers made before); "
        "user: from creating the writer/store to close",
    )
    args = parser.parse_args(argv)
    frames_shapes = [tuple(int(v) for v in f.split("x")) for f in (args.frame or ["2048x2048"])]
    engines = [e for e in args.engines.split(",") if e]
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    results = []
    machine = f"{platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} CPUs"
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        machine += f", {props['name'].decode()}"
    except Exception:  # noqa: BLE001 - no GPU is a fine answer
        if "tileshard-gpu" in engines:
            engines.remove("tileshard-gpu")
    print(f"# machine: {machine}; sink {out_root}; zstd level {args.level}; clock {args.clock}", flush=True)
    for frame_shape in frames_shapes:
        camera = SyntheticCamera(frame_shape, "uint16", seed=0)
        camera.prepare()
        frames = max(1, int(args.gib * 2**30 // camera.frame_bytes))
        for _, tile in tile_cases(args.tiles.split(",")):
            frames_case = math.ceil(frames / tile[0]) * tile[0]
            case = {
                "frame": list(frame_shape),
                "tile": list(tile),
                "tile_kib": math.prod(tile) * 2 // 1024,
                "frames": frames_case,
                "sink": str(out_root),
            }
            rows = []
            cpu_ceiling = zstd_ceiling(camera, tile, args.level) if "tileshard-cpu" in engines else None
            if "tileshard-gpu" in engines:
                try:
                    rows.extend(gpu_ceilings(camera, frames_case, tile, args.level))
                except Exception as exc:  # noqa: BLE001
                    print(f"# ceiling measurement failed: {exc}", flush=True)
            # Engines take turns, round by round, each round starting with the next engine: every
            # engine sees the same background load and none is always the first to fault its memory in.
            runs: dict[str, list[dict]] = {engine: [] for engine in engines}
            failed: set[str] = set()
            for round_ in range(args.repeat):
                for engine in engines[round_ % len(engines) :] + engines[: round_ % len(engines)]:
                    if engine in failed:
                        continue
                    try:
                        runs[engine].append(
                            measure(engine, camera, frames_case, tile, out_root, args.level, args.clock == "user")
                        )
                    except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                        print(f"# {engine} failed: {type(exc).__name__}: {exc}", flush=True)
                        failed.add(engine)
            for engine in engines:
                if runs[engine]:
                    ordered = sorted(runs[engine], key=lambda r: r["gbps"])
                    median = dict(ordered[len(ordered) // 2])
                    median["runs_gbps"] = [r["gbps"] for r in runs[engine]]
                    rows.append(median)
            plain = {r["engine"]: r["gbps"] for r in rows}
            for r in rows:  # a pyramid case against the same engine without the pyramid, same run
                if r["engine"].endswith("-ome") and r["engine"][:-4] in plain:
                    r["vs_no_pyramid"] = r["gbps"] / plain[r["engine"][:-4]]
            ours = next((r for r in rows if r["engine"] == "tileshard-gpu"), None) or next(
                (r for r in rows if r["engine"] == "tileshard-cpu"), None
            )
            ceiling = next((r for r in rows if r["engine"] == "nvcomp-ceiling"), None)
            for r in rows:
                r.update(case)
                r["vs_tileshard"] = r["gbps"] / ours["gbps"] if ours else float("nan")
                r["of_ceiling"] = r["gbps"] / ceiling["gbps"] if ceiling else float("nan")
                results.append(r)
            print(
                f"\n## frame {frame_shape[0]}x{frame_shape[1]}, tile {tile} ({case['tile_kib']} KiB), "
                f"{frames_case} frames ({frames_case * camera.frame_bytes / 2**30:.1f} GiB)"
            )
            print(
                f"{'engine':18s} {'GB/s':>7s} {'x ours':>7s} {'of ceil':>8s} {'ratio':>6s} {'CPU s/GB':>9s} "
                f"{'vs no pyramid':>13s}"
            )
            for r in rows:
                cpu = r.get("cpu_s_per_gb", float("nan"))
                print(
                    f"{r['engine']:18s} {r['gbps']:7.2f} {r['vs_tileshard']:7.2f} {r['of_ceiling']:8.2f} "
                    f"{r.get('ratio', float('nan')):6.2f} {cpu:9.2f} {r.get('vs_no_pyramid', float('nan')):13.2f}",
                    flush=True,
                )
            by_engine = {r["engine"]: r for r in rows}
            if "tileshard-cpu" in by_engine and "tensorstore" in by_engine:
                cpu_row, ts_row = by_engine["tileshard-cpu"], by_engine["tensorstore"]
                runs = " ".join(
                    f"{a:.2f}/{b:.2f}" for a, b in zip(cpu_row.get("runs_gbps", []), ts_row.get("runs_gbps", []))
                )
                cpu_row.update(cpu_ceiling or {})
                print(
                    f"CPU backend / tensorstore: {cpu_row['gbps'] / ts_row['gbps']:.2f}x "
                    f"(host CPU-s/GB {cpu_row['cpu_s_per_gb']:.2f} vs {ts_row['cpu_s_per_gb']:.2f}; "
                    f"GB/s per round {runs})",
                    flush=True,
                )
            if cpu_ceiling is not None:
                print(
                    f"libzstd level {args.level}, one thread, same tiles: {cpu_ceiling['zstd_1thread_gbps']:.3f} GB/s "
                    f"({cpu_ceiling['zstd_cpu_s_per_gb']:.2f} CPU-s/GB) x {os.cpu_count()} cores = "
                    f"{cpu_ceiling['ceiling_gbps']:.2f} GB/s; "
                    + ", ".join(
                        f"{r['engine']} {r['gbps'] / cpu_ceiling['ceiling_gbps']:.2f}"
                        for r in rows
                        if r["engine"] in ("tileshard-cpu", "tensorstore")
                    )
                    + " of it",
                    flush=True,
                )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine, "argv": sys.argv, "results": results}, indent=1))
    shutil.rmtree(out_root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
