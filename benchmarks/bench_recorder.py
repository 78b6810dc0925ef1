"""Headless recorder throughput: the plugin's Qt-free recording loop fed by the synthetic camera.

    python benchmarks/bench_recorder.py --frame 2304x2304 --fps 200 --seconds 20 --policy drop --out /dev/shm/rec.zarr

Prints frames, dropped frames, input GB/s and the deepest the queue got.  With the drop
policy, zero dropped frames means the recorder kept up with the camera.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, verify
from napari_tileshard.apps.recorder import Recorder, RecorderSettings


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--frame", default="2304x2304")
    parser.add_argument("--fps", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--policy", default="drop")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tile", default="32,256,256")
    parser.add_argument("--out", default="/dev/shm/tileshard-recorder.zarr")
    args = parser.parse_args()
    h, w = (int(v) for v in args.frame.split("x"))
    t, ty, tx = (int(v) for v in args.tile.split(","))
    layout = Layout(
        [Dim("t", 0, t, 1), Dim("y", h, ty, max(1, 1024 // ty)), Dim("x", w, tx, max(1, 1024 // tx))], "uint16"
    )
    frames = int(args.fps * args.seconds)
    settings = RecorderSettings(
        output=args.out,
        layout=layout,
        backend=args.backend,
        fps=args.fps,
        policy=args.policy,
        overwrite=True,
        queue_frames=64,
    )
    recorder = Recorder(settings)
    deepest = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.01):
            deepest[0] = max(deepest[0], recorder._queue.qsize())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    stats = recorder.start(synthetic_frames=frames).join()
    wall = time.perf_counter() - start
    done.set()
    frame_bytes = h * w * 2
    report = verify(args.out)
    print(
        f"recorder headless, backend {stats.backend}: {stats.frames} frames of {h}x{w} uint16 at {args.fps:g} fps "
        f"requested ({frame_bytes * args.fps / 1e9:.2f} GB/s), policy {args.policy}: dropped {stats.dropped}, "
        f"recorded {stats.frames * frame_bytes / wall / 1e9:.2f} GB/s over {wall:.1f} s (incl. camera warm-up), "
        f"deepest queue {deepest[0]}/64, ratio {stats.compression_ratio:.2f}, "
        f"verify {'ok' if report.ok else 'FAILED'}, error {stats.error}"
    )


if __name__ == "__main__":
    main()
