"""Convert a large zarr v2 recording on Dask: our GPU workers vs CPU workers vs the CPU peers (issue 18).

One command writes the source first (``--gib`` of 2048x2048 uint16 camera frames as zarr v2,
chunks 32x512x512, blosc lz4 + shuffle: what older rigs left behind), then converts it into the
same sharded layout (tiles 8x256x256 = 1 MiB, shards 32x1024x1024) with:

* ``gpu1`` / ``gpu2``: napari_tileshard.apps.convert on a cluster of one worker per GPU (gpu_cluster);
* ``cpu``: napari_tileshard.apps.convert with our CPU backend on CPU workers;
* ``dask``: ``dask.array`` from the source, rechunked to whole shards, stored into a zarr-python
  v3 sharded array (shard-aligned: each task writes whole shards);
* ``tensorstore``: the same Dask tasks (one per shard epoch), each writing its rows through
  tensorstore's zarr3 driver.

Each output is deleted before the next case.  The clusters are started before the clock starts
(their start-up is reported apart), and the per-task overhead of the scheduler is measured with
no-op tasks.  All cases compress with zstd level 1.

    python benchmarks/bench_convert.py --gib 64 --root /dev/shm/tileshard-convert --out convert.json
    python benchmarks/bench_convert.py --quick        # a small CPU-only smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from multiprocessing import get_context
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from napari_tileshard import Dim, Layout, SyntheticCamera  # noqa: E402

TILE_ROWS, SHARD_ROWS = 8, 32


def _write_rows(args):
    path, frame, start, stop = args
    import zarr

    block = SyntheticCamera(frame, "uint16", seed=start // SHARD_ROWS % 7).stack(SHARD_ROWS)
    array = zarr.open_array(path, mode="r+")
    for a in range(start, stop, SHARD_ROWS):
        b = min(stop, a + SHARD_ROWS)
        array[a:b] = block[: b - a]
    return stop - start


def make_source(path: Path, frames: int, frame, processes: int) -> float:
    import zarr
    from numcodecs import Blosc

    t0 = time.perf_counter()
    zarr.create_array(
        path,
        shape=(frames, *frame),
        chunks=(SHARD_ROWS, min(512, frame[0]), min(512, frame[1])),
        dtype="uint16",
        zarr_format=2,
        compressors=Blosc(cname="lz4", clevel=1, shuffle=Blosc.SHUFFLE),
        overwrite=True,
    )
    per = math.ceil(frames / SHARD_ROWS / processes) * SHARD_ROWS
    jobs = [(str(path), frame, a, min(frames, a + per)) for a in range(0, frames, per)]
    with get_context("spawn").Pool(processes) as pool:
        assert sum(pool.map(_write_rows, jobs)) == frames
    return time.perf_counter() - t0


def layout_of(frames: int, frame) -> Layout:
    ty, tx = min(256, frame[0]), min(256, frame[1])
    sy, sx = max(1, min(4, frame[0] // ty)), max(1, min(4, frame[1] // tx))
    return Layout(
        [Dim("t", frames, TILE_ROWS, SHARD_ROWS // TILE_ROWS), Dim("y", frame[0], ty, sy), Dim("x", frame[1], tx, sx)],
        "uint16",
    )


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def ours(src, dst, layout, client, backend):
    from napari_tileshard.apps.convert import convert

    report = convert(src, dst, layout, client=client, backend=backend, verify=False)
    return {
        "seconds": report.seconds,
        "bytes_out": report.bytes_out,
        "backends": sorted(report.backends),
        "task_read_share": round(report.read_seconds / report.task_seconds, 2),  # of the tasks' time
    }


def dask_to_zarr(src, dst, layout, client):
    import dask.array as da
    import zarr
    from zarr.codecs import ZstdCodec

    source = zarr.open_array(src, mode="r")
    t0 = time.perf_counter()
    target = zarr.create_array(
        dst,
        shape=source.shape,
        dtype=source.dtype,
        shards=layout.shard_shape,
        chunks=layout.tile_shape,
        compressors=ZstdCodec(level=1),
        overwrite=True,
    )
    array = da.from_zarr(source).rechunk(layout.shard_shape)  # whole shards per task: never two writers
    array.store(target, lock=False, compute=True)
    return {"seconds": time.perf_counter() - t0, "bytes_out": du(Path(dst))}


def _tensorstore_epoch(src, dst, epoch, rows):
    import tensorstore as ts
    import zarr

    source = zarr.open_array(src, mode="r")
    a, b = epoch * rows, min(source.shape[0], (epoch + 1) * rows)
    target = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": dst}}, open=True).result()
    target[a:b].write(source[a:b]).result()
    return b - a


def tensorstore_tasks(src, dst, layout, client):
    import tensorstore as ts

    t0 = time.perf_counter()
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(dst)},
        "metadata": {
            "shape": list(layout.shape),
            "data_type": "uint16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(layout.shard_shape)}},
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(layout.tile_shape),
                        "codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "zstd", "configuration": {"level": 1}},
                        ],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    },
                }
            ],
        },
        "create": True,
        "delete_existing": True,
    }
    ts.open(spec).result()
    epochs = math.ceil(layout.shape[0] / SHARD_ROWS)
    futures = client.map(
        _tensorstore_epoch, [str(src)] * epochs, [str(dst)] * epochs, range(epochs), [SHARD_ROWS] * epochs
    )
    assert sum(client.gather(futures)) == layout.shape[0]
    return {"seconds": time.perf_counter() - t0, "bytes_out": du(Path(dst))}


def _noop(i):
    return i


def task_overhead(client, n=2000) -> float:
    client.gather(client.map(_noop, range(50), pure=False))  # warm
    t0 = time.perf_counter()
    client.gather(client.map(_noop, range(n), pure=False))
    return (time.perf_counter() - t0) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=64)
    parser.add_argument("--frame", default="2048x2048")
    parser.add_argument("--root", default="/dev/shm/tileshard-convert")
    parser.add_argument("--cases", default="gpu1,gpu2,cpu,dask,tensorstore")
    parser.add_argument("--cpu-workers", type=int, default=None, help="default: all cores, one thread each")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="0.25 GiB of 512x512, CPU cases only")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.frame, args.cases = 0.25, "512x512", "cpu,dask,tensorstore"
    from distributed import Client, LocalCluster

    frame = tuple(int(v) for v in args.frame.split("x"))
    frames = int(args.gib * 2**30 // (frame[0] * frame[1] * 2)) // SHARD_ROWS * SHARD_ROWS
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cores = os.cpu_count() or 1
    results: list[dict] = []

    def emit(row):
        results.append(row)
        print(json.dumps(row), flush=True)

    src = root / "source.zarr"
    seconds = make_source(src, frames, frame, cores)
    bytes_in = frames * frame[0] * frame[1] * 2
    emit(
        {
            "case": "write the zarr v2 source",
            "gb": round(bytes_in / 1e9, 2),
            "seconds": round(seconds, 1),
            "source_gb_on_disk": round(du(src) / 1e9, 2),
            "cores": cores,
            "free_gb": round(shutil.disk_usage(root).free / 1e9, 1),
        }
    )
    layout = layout_of(frames, frame)
    cases = args.cases.split(",")
    for case in cases:
        dst = root / f"{case}.zarr"
        t0 = time.perf_counter()
        if case.startswith("gpu"):
            from napari_tileshard.apps.convert import gpu_cluster

            cluster = gpu_cluster(list(range(int(case[3:]))))
        else:
            # our CPU backend compresses each task on a thread per core itself: fewer workers
            workers = args.cpu_workers or (max(1, cores // 4) if case == "cpu" else cores)
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=":0")
        client = Client(cluster)
        client.wait_for_workers(1)
        startup = time.perf_counter() - t0
        workers = len(client.scheduler_info()["workers"])
        try:
            if case.startswith("gpu"):
                row = ours(src, dst, layout, client, "gpu")
            elif case == "cpu":
                row = ours(src, dst, layout, client, "cpu")
            elif case == "dask":
                row = dask_to_zarr(src, dst, layout, client)
            elif case == "tensorstore":
                row = tensorstore_tasks(src, dst, layout, client)
            else:
                raise SystemExit(f"unknown case {case!r}")
            overhead = task_overhead(client)
        finally:
            client.close()
            cluster.close()
        row.update(
            case=case,
            workers=workers,
            cluster_start_s=round(startup, 1),
            gbps=round(bytes_in / row["seconds"] / 1e9, 3),
            ratio=round(bytes_in / row["bytes_out"], 2),
            scheduler_s_per_task=round(overhead, 6),
            seconds=round(row["seconds"], 2),
        )
        emit(row)
        shutil.rmtree(dst, ignore_errors=True)
    by_case = {r["case"]: r for r in results if "gbps" in r}
    if "gpu1" in by_case and "gpu2" in by_case:
        emit({"gpu2_over_gpu1": round(by_case["gpu2"]["gbps"] / by_case["gpu1"]["gbps"], 2)})
    cpu_best = max((by_case[c]["gbps"] for c in ("cpu", "dask", "tensorstore") if c in by_case), default=None)
    gpu_best = max((by_case[c]["gbps"] for c in ("gpu1", "gpu2") if c in by_case), default=None)
    if cpu_best and gpu_best:
        emit({"gpu_best_over_cpu_best": round(gpu_best / cpu_best, 2)})
    shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
