"""What ``TileShardSink.append`` costs the MDA thread: microseconds per frame, no camera, no runner.

Drives the sink as pymmcore-plus's runner drives a ``SinkProtocol`` sink (``setup``, then ``append``
per frame with its event and frame metadata) for ``--frames`` timepoints of ``--shape`` uint16 frames
into a CPU sink, and reports ``stats.append_s`` per frame (the time spent inside ``append`` on the
calling thread), best of ``--repeats``.  ``--queue-frames`` at least ``--frames`` (the default) never
blocks, so the figure is append's own work (placement, the buffer watch, the queue); a smaller
queue adds the wait for the writer (back-pressure, policy ``block``).

    python benchmarks/bench_mmcore_append.py --out /tmp/bench_append
    python benchmarks/bench_mmcore_append.py --out /tmp/bench_append --queue-frames 64
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np


def run_once(out: Path, frames: list[np.ndarray], events, metas, meta: dict, sequence, queue_frames: int) -> dict:
    from napari_tileshard.apps.mmcore import TileShardSink

    path = out / "append.ome.zarr"
    shutil.rmtree(path, ignore_errors=True)
    sink = TileShardSink(path, backend="cpu", queue_frames=queue_frames)
    sink.setup(sequence, meta)
    for i, (event, frame_meta) in enumerate(zip(events, metas)):
        sink.append(frames[i % len(frames)], event, frame_meta)
    append_s, received = sink.stats.append_s, sink.stats.received
    sink.close()
    shutil.rmtree(path, ignore_errors=True)
    return {"append_us_per_frame": append_s / received * 1e6, "frames": received}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--shape", type=int, nargs=2, default=(256, 256), metavar=("HEIGHT", "WIDTH"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--queue-frames", type=int, help="the sink's queue (default: --frames, never blocks)")
    parser.add_argument("--out", type=Path, help="scratch folder (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    logging.getLogger("pymmcore-plus").setLevel(logging.CRITICAL)
    import useq

    height, width = args.shape
    rng = np.random.default_rng(0)
    frames = [rng.poisson(100, size=(height, width)).astype(np.uint16) for _ in range(16)]
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": args.frames})
    events = list(sequence)
    # what pymmcore-plus's runner hands a sink with each frame (FrameMetaV1's keys the sink reads)
    metas = [
        {
            "runner_time_ms": t * 1.0,
            "exposure_ms": 10.0,
            "position": {"x": 0.0, "y": 0.0, "z": 0.0},
            "images_remaining_in_buffer": 0,
            "hardware_triggered": False,
        }
        for t in range(args.frames)
    ]
    meta = {
        "image_infos": [{"width": width, "height": height, "dtype": "uint16", "pixel_size_um": 1.0}],
        "system_info": {"sequence_buffer_size_mb": 1024},
    }
    scratch = args.out or Path(tempfile.mkdtemp(prefix="bench_append_"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        runs = [
            run_once(scratch, frames, events, metas, meta, sequence, args.queue_frames or args.frames)
            for _ in range(args.repeats)
        ]
    finally:
        if args.out is None:
            shutil.rmtree(scratch, ignore_errors=True)
    best = min(r["append_us_per_frame"] for r in runs)
    print(
        json.dumps(
            {
                "best_append_us_per_frame": round(best, 2),
                "runs_us": [round(r["append_us_per_frame"], 2) for r in runs],
                "frames": args.frames,
                "shape": [height, width],
                "queue_frames": args.queue_frames or args.frames,
            }
        )
    )


if __name__ == "__main__":
    main()
