"""GPU reads as a script makes them: a fresh ShardReader for every read of a whole array.

Writes ``--gib`` of 2048² uint16 camera frames (``--tiles``: 64k = 2×128² tiles in 4 MiB shards,
256k = 2×256² in 4 MiB shards) to ``--dir``, then reads the whole array ``--reads`` times, each
time with a new reader bound to the same name, as ``r = ShardReader(p, backend="gpu"); a = r[...]``
does (the reader before is still alive while the new one reads, until the garbage collector finds
it: reader and read path refer to each other).  Per read: GB/s of the user's clock (the reader's
construction, the read and, for NumPy output, the copy to the host), for NumPy output and for
output on the device (``read(..., device=True)``).  ``--collect``: ``gc.collect()`` before each
read (the earlier readers gone).  Prints one JSON line: also CuPy's device memory in use after
each NumPy read (GB; the earlier readers not collected yet) and, with the pinned staging pool
(``napari_tileshard.gpu.pinned.read_staging_pool``), how many buffers it pinned.

    python benchmarks/bench_gpu_fresh_reads.py --tiles 64k --reads 4
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

if "--no-src" not in sys.argv:  # else napari_tileshard comes from PYTHONPATH (another version's)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer

TILES = {"64k": (2, 128, 8), "256k": (2, 256, 4)}  # (frames deep, tile side, tiles per shard side)


def write(path: Path, gib: float, tiles: str, backend: str) -> int:
    depth, side, per_shard = TILES[tiles]
    frames = max(depth, int(gib * 2**30) // (2048 * 2048 * 2) // depth * depth)
    layout = Layout([Dim("t", 0, depth, 1), Dim("y", 2048, side, per_shard), Dim("x", 2048, side, per_shard)], "uint16")
    bank = np.stack(list(SyntheticCamera((2048, 2048), "uint16", seed=0).frames(min(frames, 64))))
    shutil.rmtree(path, ignore_errors=True)
    with Writer(path, layout, codec="zstd", level=1, backend=backend) as writer:
        for first in range(0, frames, 16):
            count = min(16, frames - first)
            writer.append(bank[first % len(bank) : first % len(bank) + count])
    return frames


def pool_pinned() -> int | None:
    try:
        from napari_tileshard.gpu.pinned import read_staging_pool
    except ImportError:  # a version without the pool
        return None
    return read_staging_pool().pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm/fresh_reads.zarr")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tiles", choices=sorted(TILES), default="64k")
    parser.add_argument("--reads", type=int, default=4)
    parser.add_argument("--collect", action="store_true", help="gc.collect() before each read")
    parser.add_argument("--label", default="")
    parser.add_argument("--writer", default="gpu", help="backend of the writer (gpu, cpu)")
    parser.add_argument("--no-src", action="store_true", help="import napari_tileshard from PYTHONPATH")
    args = parser.parse_args()
    path = Path(args.dir)
    write(path, args.gib, args.tiles, args.writer)
    result: dict = {"label": args.label, "tiles": args.tiles, "collect": args.collect}
    import cupy

    for output in ("numpy", "device"):
        rates, held = [], []
        reader = None
        for _ in range(args.reads):
            if args.collect:
                gc.collect()
            started = time.perf_counter()
            reader = ShardReader(path, backend="gpu")
            data = reader[...] if output == "numpy" else reader.read(..., device=True)
            if output == "device":
                cupy.cuda.get_current_stream().synchronize()
            rates.append(round(data.nbytes / (time.perf_counter() - started) / 1e9, 2))
            del data
            held.append(round(cupy.get_default_memory_pool().used_bytes() / 1e9, 2))
        result[output] = rates
        if output == "numpy":
            result["device_gb_held_after_each"] = held
        del reader
    result["pinned_by_pool"] = pool_pinned()
    print(json.dumps(result), flush=True)
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
