"""Host CPU of the GPU path: CPU-seconds per GB and cores used, by how frames reach the Writer.

* ``append``: ``writer.append(frame)`` from pageable NumPy memory (the Writer copies into pinned staging);
* ``frame_buffer``: ``with writer.frame_buffer() as f: np.copyto(f, frame)`` (the producer copies);
* ``frame_buffer-dma``: ``with writer.frame_buffer(): pass`` -- what is left when a camera driver
  DMAs into the buffer (simulated: after every staging buffer was filled once, no CPU fills
  them, so the stored pixels repeat earlier frames; the CPU figure is the point).

    python benchmarks/host_cpu.py --gib 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_write import layout_for  # noqa: E402

from napari_tileshard import SyntheticCamera, Writer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=6.0)
    parser.add_argument("--backend", default="gpu")
    parser.add_argument("--out", default="/dev/shm/tileshard-hostcpu.zarr")
    args = parser.parse_args()
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    frames = int(args.gib * 2**30 // camera.frame_bytes) // 8 * 8
    layout = layout_for(camera.shape, (8, 128, 128))
    for mode in ("append", "frame_buffer", "frame_buffer-dma"):
        writer = Writer(args.out, layout, backend=args.backend, overwrite=True)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        with writer:
            # Until every staging buffer has held real frames once, the DMA case fills them too.
            filled_once = 3 * writer.batch_bytes // camera.frame_bytes
            for i, frame in enumerate(camera.frames(frames)):
                if mode == "append":
                    writer.append(frame)
                else:
                    with writer.frame_buffer() as place:
                        if mode == "frame_buffer" or i < filled_once:
                            np.copyto(place, frame)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        gb = frames * camera.frame_bytes / 1e9
        print(
            json.dumps(
                {
                    "mode": mode,
                    "backend": writer.stats.backend,
                    "gbps": round(gb / wall, 3),
                    "cpu_s_per_gb": round(cpu / gb, 3),
                    "cores": round(cpu / wall, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
