"""One camera stream over 1 and 2 GPUs, and two streams on two GPUs (issue 19).

Frames reach the Writer through ``frame_buffer()`` without a CPU fill after the staging buffers
held real frames once (a camera DMAing into pinned memory), so the host's pageable->pinned copy
does not cap what the GPUs can show; ``--append`` measures the ``append()`` path instead.
Each case records ``--gib`` of 2048x2048 uint16 in a fresh Writer; nvCOMP's ceiling is measured
per GPU on the same tiles (benchmarks/gpu_ceiling.py).

    python benchmarks/bench_multi_gpu.py --gib 16 --tiles 64k,256k,1m --max-device-gib 8 --max-host-gib 4
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_write import layout_for, tile_cases  # noqa: E402

from napari_tileshard import SyntheticCamera, Writer, release_gpu_memory  # noqa: E402


def stream(out, layout, camera, frames, devices, budget, append, result):
    # the budget is per GPU: device memory is bounded per GPU, pinned host memory in total
    budget = {**budget, "max_host_bytes": budget["max_host_bytes"] * len(devices)}
    writer = Writer(out, layout, backend="gpu", overwrite=True, devices=devices, **budget)
    filled_once = 3 * len(devices) * writer.batch_bytes // camera.frame_bytes
    cpu0, t0 = time.process_time(), time.perf_counter()
    with writer:
        for i, frame in enumerate(camera.frames(frames)):
            if append:
                writer.append(frame)
                continue
            with writer.frame_buffer() as place:
                if i < filled_once:
                    np.copyto(place, frame)
    wall = time.perf_counter() - t0
    result.update(
        devices=devices,
        gbps=round(frames * camera.frame_bytes / wall / 1e9, 3),
        cpu_s_per_gb=round((time.process_time() - cpu0) / (frames * camera.frame_bytes / 1e9), 3),
        batch_mib=writer.batch_bytes >> 20,
        backend=writer.stats.backend,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--tiles", default="256k")
    parser.add_argument("--frame", default="2048x2048")
    parser.add_argument("--max-device-gib", type=float, default=8)
    parser.add_argument("--max-host-gib", type=float, default=4)
    parser.add_argument("--append", action="store_true")
    parser.add_argument("--no-pairs", action="store_true", help="skip the two-independent-streams case")
    parser.add_argument("--out", default="/dev/shm/tileshard-multi")
    args = parser.parse_args()
    import cupy
    import gpu_ceiling

    count = cupy.cuda.runtime.getDeviceCount()
    h, w = (int(v) for v in args.frame.split("x"))
    camera = SyntheticCamera((h, w), "uint16", seed=0)
    camera.prepare()
    budget = {"max_device_bytes": int(args.max_device_gib * 2**30), "max_host_bytes": int(args.max_host_gib * 2**30)}
    for name, tile in tile_cases(args.tiles.split(",")):
        layout = layout_for(camera.shape, tile)
        frames = int(args.gib * 2**30 // camera.frame_bytes) // tile[0] * tile[0]
        for d in range(count):
            with cupy.cuda.Device(d):
                ceiling = gpu_ceiling.measure(camera, frames, layout, 1, batch_bytes=512 << 20)[0]["gbps"]
            print(json.dumps({"tile": name, "nvcomp_ceiling_gpu": d, "gbps": round(ceiling, 3)}), flush=True)
            release_gpu_memory()
        cases = [[0]] + ([[0, 1]] if count > 1 else [[0, 0]])
        for devices in cases:
            result: dict = {"tile": name, "streams": 1}
            stream(f"{args.out}-a.zarr", layout, camera, frames, devices, budget, args.append, result)
            print(json.dumps(result), flush=True)
            release_gpu_memory()
        if count > 1 and not args.no_pairs:  # two independent streams, one per GPU, at the same time
            results = [{"tile": name, "streams": 2}, {"tile": name, "streams": 2}]
            threads = [
                threading.Thread(
                    target=stream,
                    args=(f"{args.out}-{k}.zarr", layout, camera, frames, [k], budget, args.append, results[k]),
                )
                for k in range(2)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in results:
                print(json.dumps(r), flush=True)
            release_gpu_memory()


if __name__ == "__main__":
    main()
