"""Read back a recording with ShardReader and its peers: whole-array and random single-plane reads.

The recording is written first by our Writer (2048² uint16 frames from SyntheticCamera, zstd
level 1, tiles of the chosen size, shards of 1 x 1024 x 1024 pixels), unless ``--path`` names an
existing array.  Each engine then reads the whole array (best of ``--repeat``) and ``--planes``
random single planes (median and worst, the napari scrubbing case).  Requests issued per GB are
counted for ours (``ShardReader.stats``) and for zarr-python (a counting store).  On a GPU machine
the nvCOMP batched zstd decompress of one shard's chunks already on the device (the ceiling of
the GPU path) and pinned H2D bandwidth are measured too.

Engines: tileshard-cpu, tileshard-gpu-host (decoded on the GPU, NumPy out), tileshard-gpu-device
(CuPy out), tensorstore, zarr-python, zarrs (zarr-python with the zarrs codec pipeline, if
installed).  Unavailable engines are reported and skipped.

Example (the command in docs/benchmarks.md):
    python benchmarks/bench_read.py --gib 1 --tile 256k --out /dev/shm/tileshard-read
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer  # noqa: E402

TILES = {"64k": (8, 64, 64), "256k": (8, 128, 128), "1m": (32, 128, 128)}
ENGINES = ("tileshard-cpu", "tileshard-gpu-host", "tileshard-gpu-device", "tensorstore", "zarr-python", "zarrs")


def write_recording(path: Path, gib: float, tile) -> None:
    camera = SyntheticCamera((2048, 2048), "uint16")
    frames = int(gib * 2**30 // camera.frame_bytes)
    frames -= frames % tile[0]
    layout = Layout(
        [
            Dim("t", frames, tile[0], 1),
            Dim("y", 2048, tile[1], 1024 // tile[1]),
            Dim("x", 2048, tile[2], 1024 // tile[2]),
        ],
        "uint16",
    )
    shutil.rmtree(path, ignore_errors=True)
    with Writer(path, layout, backend="auto") as writer:
        for i in range(frames):
            writer.append(camera.frame(i))


def _zarr_store(path, counter):
    from zarr.storage import LocalStore

    class CountingStore(LocalStore):
        async def get(self, key, prototype=None, byte_range=None):
            counter[0] += 1
            return await super().get(key, prototype, byte_range)

        async def get_partial_values(self, prototype, key_ranges):
            key_ranges = list(key_ranges)
            counter[0] += len(key_ranges)
            return await super().get_partial_values(prototype, key_ranges)

    return CountingStore(path, read_only=True)


def engine_reader(name: str, path: Path):
    """``(read(selection) -> array, requests() -> int or None)`` for engine ``name``; ImportError
    or RuntimeError when it cannot run here."""
    if name.startswith("tileshard"):
        backend = "cpu" if name == "tileshard-cpu" else "gpu"
        reader = ShardReader(path, backend=backend)
        device = name == "tileshard-gpu-device"

        def read(selection):
            out = reader.read(selection, device=device)
            if device:
                import cupy

                cupy.cuda.get_current_stream().synchronize()
            return out

        return read, lambda: reader.stats.requests + reader.stats.index_requests
    if name == "tensorstore":
        import tensorstore as ts

        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
        return (lambda selection: store[selection].read().result()), lambda: None
    import zarr

    if name == "zarrs":
        import zarrs  # noqa: F401

        zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})
    else:
        zarr.config.set({"codec_pipeline.path": "zarr.core.codec_pipeline.BatchedCodecPipeline"})
    counter = [0]
    array = zarr.open_array(_zarr_store(path, counter), mode="r")
    return (lambda selection: array[selection]), lambda: counter[0]


def measure(name: str, path: Path, planes: int, repeat: int, frames: int) -> dict:
    read, requests = engine_reader(name, path)
    whole = []
    for _ in range(repeat):
        before = requests()
        started = time.perf_counter()
        out = read(...)
        whole.append(time.perf_counter() - started)
        used = requests()
        nbytes = out.nbytes
    rng = np.random.default_rng(0)
    plane_times = []
    for t in rng.integers(0, frames, planes).tolist():
        started = time.perf_counter()
        read((t,))
        plane_times.append(time.perf_counter() - started)
    best = min(whole)
    result = {
        "engine": name,
        "whole_s": round(best, 3),
        "whole_gbps": round(nbytes / best / 1e9, 2),
        "plane_median_ms": round(1e3 * statistics.median(plane_times), 1),
        "plane_worst_ms": round(1e3 * max(plane_times), 1),
    }
    if used is not None and before is not None:
        result["requests_per_gb"] = round((used - before) / (nbytes / 1e9), 1)
    return result


def gpu_ceilings(path: Path) -> dict:
    """nvCOMP's batched zstd decompress alone on the chunks of the first device batch of a whole
    read (already on the device: the ceiling of the GPU path), and pinned H2D bandwidth."""
    import cupy

    reader = ShardReader(path, backend="gpu")
    gpu = reader._gpu_reader()
    batch = max(gpu.batches(reader.plan(...)), key=lambda b: b.chunks)
    seconds = gpu.time_decompress(batch)
    host = gpu._fetch(batch)
    device = cupy.empty(batch.staging_bytes, dtype=cupy.uint8)
    device.set(host[: batch.staging_bytes])
    cupy.cuda.runtime.deviceSynchronize()
    started = time.perf_counter()
    for _ in range(5):
        device.set(host[: batch.staging_bytes])
    cupy.cuda.runtime.deviceSynchronize()
    h2d = 5 * batch.staging_bytes / (time.perf_counter() - started) / 1e9
    return {
        "nvcomp_decode_gbps": round(batch.chunks * reader.chunk_bytes / seconds / 1e9, 2),
        "chunks_per_call": batch.chunks,
        "pinned_h2d_gbps": round(h2d, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, help="an existing array (else one is written to --out)")
    parser.add_argument("--out", type=Path, default=Path("/dev/shm/tileshard-read"))
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tile", choices=sorted(TILES), default="256k")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--planes", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    path = args.path
    if path is None:
        path = args.out / f"{args.tile}.zarr"
        started = time.perf_counter()
        write_recording(path, args.gib, TILES[args.tile])
        print(f"wrote {path} in {time.perf_counter() - started:.1f} s", flush=True)
    frames = ShardReader(path, backend="cpu").shape[0]
    results = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "path": str(path),
        "tile": args.tile,
        "engines": [],
    }
    for name in args.engines.split(","):
        try:
            row = measure(name, path, args.planes, args.repeat, frames)
        except (ImportError, RuntimeError, ValueError) as exc:
            print(f"{name}: skipped ({exc})", flush=True)
            continue
        results["engines"].append(row)
        print(json.dumps(row), flush=True)
    try:
        results["gpu_ceilings"] = gpu_ceilings(path)
        print(json.dumps(results["gpu_ceilings"]))
    except (ImportError, RuntimeError, ValueError) as exc:
        print(f"GPU ceilings: skipped ({exc})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
