"""How fast can this machine pin host memory?  (Arming a GPU recording is mostly pinning.)

Compares, per GiB: cupy.cuda.alloc_pinned_memory (cudaHostAlloc), NumPy pages touched by one
or several threads then cudaHostRegister'ed, and the same with transparent huge pages advised.

    python benchmarks/pinning.py --gib 1
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main():
    import cupy

    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    n = int(args.gib * 2**30)
    t = time.perf_counter()
    cupy.cuda.Device(0).use()
    cupy.empty(1)
    print(f"context: {time.perf_counter() - t:.3f} s")
    runtime = cupy.cuda.runtime

    def timed(name, fn):
        t = time.perf_counter()
        keep = fn()
        dt = time.perf_counter() - t
        print(f"{name}: {dt:.3f} s for {args.gib} GiB = {args.gib / dt:.2f} GiB/s", flush=True)
        return keep

    timed("cudaHostAlloc (cupy.alloc_pinned_memory)", lambda: cupy.cuda.alloc_pinned_memory(n))
    from napari_tileshard.gpu.pinned import pin

    timed("napari_tileshard pin() (THP + cudaHostRegister)", lambda: pin(n))

    def register(threads, huge):
        buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(buf, "madvise"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        array = np.frombuffer(buf, dtype=np.uint8)
        bounds = np.linspace(0, n, threads + 1).astype(int)
        if threads:  # 0: cudaHostRegister faults the pages in itself
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: array[bounds[i] : bounds[i + 1] : 4096].fill(0), range(threads)))
        ptr = array.ctypes.data
        runtime.hostRegister(ptr, n, 0)
        runtime.hostUnregister(ptr)  # timed with the registration: the next case maps anew
        return None

    for threads in (0, 1, 8):
        for huge in (False, True):
            name = f"touch x{threads} threads{' + THP' if huge else ''} + cudaHostRegister"
            timed(name, lambda threads=threads, huge=huge: register(threads, huge))

    def touch_only(threads):
        buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        array = np.frombuffer(buf, dtype=np.uint8)
        bounds = np.linspace(0, n, threads + 1).astype(int)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: array[bounds[i] : bounds[i + 1] : 4096].fill(0), range(threads)))
        return buf

    for threads in (1, 8):
        timed(f"touch only x{threads}", lambda threads=threads: touch_only(threads))


if __name__ == "__main__":
    main()
