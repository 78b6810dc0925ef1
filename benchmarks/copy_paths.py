"""How fast a camera frame reaches the GPU's input buffer, by each way there is: the Writer's copy
into pinned staging (one thread, or split over helper threads as ``copy_in_parts`` does), and a
copy from the frame's own (pageable) memory straight to the device (CUDA stages it itself).

    python benchmarks/copy_paths.py --frame 2304x2304 --frames 400

Frames come from the synthetic camera's bank (50-64 distinct frames: more than the caches hold),
as in the recorder.  Prints GB/s per way, median of 3 passes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# This checkout's code, unless PYTHONPATH names another copy of the package (an A/B against the
# code before runs this same script with PYTHONPATH=/path/to/before/src)
if not any((Path(p) / "napari_tileshard").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import SyntheticCamera  # noqa: E402
from napari_tileshard.engine.staging import copy_in_parts, copy_threads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frame", default="2304x2304")
    parser.add_argument("--frames", type=int, default=400)
    args = parser.parse_args()
    h, w = (int(v) for v in args.frame.split("x"))
    camera = SyntheticCamera((h, w), "uint16", seed=0)
    camera.prepare()
    bank = [camera.frame(i).reshape(-1).view(np.uint8) for i in range(camera.bank_frames)]
    nbytes = bank[0].nbytes
    try:
        import cupy

        from napari_tileshard.gpu.pinned import pin

        destination = pin(nbytes * 8)  # eight frames' room, as a staging buffer has more
        device = cupy.empty(nbytes, dtype=cupy.uint8)
    except Exception:  # noqa: BLE001 - no GPU: host copies only
        cupy = None
        destination = np.empty(nbytes * 8, dtype=np.uint8)
    ways = {}
    for threads in sorted({0, 3, copy_threads(), 15}):
        pool = ThreadPoolExecutor(threads) if threads else None

        def host(i: int, pool=pool, threads=threads) -> None:
            slot = (i % 8) * nbytes
            copy_in_parts(destination[slot : slot + nbytes], bank[i % len(bank)], pool, threads)

        ways[f"into {'pinned' if cupy else 'host'} staging, {threads + 1} threads"] = host
    if cupy is not None:

        def pageable(i: int) -> None:  # cudaMemcpy from pageable memory: synchronous, the GIL released
            cupy.cuda.runtime.memcpy(device.data.ptr, bank[i % len(bank)].ctypes.data, nbytes, 1)

        ways["pageable frame -> device (cudaMemcpy)"] = pageable
    print(f"# {args.frame} uint16 frames ({nbytes / 1e6:.1f} MB), {args.frames} per pass, median of 3 passes")
    for name, way in ways.items():
        rates = []
        for _ in range(3):
            way(0)
            start = time.perf_counter()
            for i in range(args.frames):
                way(i)
            rates.append(args.frames * nbytes / (time.perf_counter() - start) / 1e9)
        rate = statistics.median(rates)
        print(f"{rate:7.2f} GB/s  {1e3 * nbytes / 1e9 / rate:6.3f} ms/frame  {name}")


if __name__ == "__main__":
    main()
