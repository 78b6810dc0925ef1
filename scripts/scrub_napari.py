"""Scrubbing latency in napari: how long until a new plane is on screen after a dims step.

    xvfb-run -a -s "-screen 0 1600x1000x24" python scripts/scrub_napari.py --frames 96 --steps 50 \
        --json benchmarks/results/scrub-2core.json

Writes a 2048² uint16 OME-Zarr recording (our Writer, CPU backend, zstd level 1, tiles
``--tile``, shards one tile deep x 1024 x 1024), opens it with the plugin's reader in a real
napari viewer (Xvfb), and steps the first dim: ``--steps`` steps forward one frame at a time
(dragging the slider) and as many random jumps.  Per step: from ``dims.set_current_step`` until
the canvas has rendered the new plane (``viewer.screenshot(canvas_only=True)``, which draws the
scene now; its small read-back of the canvas pixels is included, so the figure is an upper
bound).  ``--reader zarr`` sets ``TILESHARD_READER=zarr`` (zarr-python, the rollback) for an A/B;
``--reader numpy`` loads every level into memory first: what napari itself costs per step.

With the plugin's reader, each step is also split into the plugin's own time (what its
``ShardReader``s spent reading and handing the planes over, from ``ShardReader.stats``) and
napari's (the rest: slicing events, Qt, the draw); medians and 99th percentiles of each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write(path: Path, frames: int, tile) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from napari_tileshard import Dim, Layout, SyntheticCamera, Writer

    camera = SyntheticCamera((2048, 2048), "uint16")
    layout = Layout(
        [
            Dim("t", 0, tile[0], 1),
            Dim("y", 2048, tile[1], 1024 // tile[1]),
            Dim("x", 2048, tile[2], 1024 // tile[2]),
        ],
        "uint16",
    )
    with Writer(path, layout, backend="cpu", ome=True) as writer:
        for i in range(frames):
            writer.append(camera.frame(i))


def summary(times: list[float]) -> dict:
    ms = [1e3 * t for t in times]
    return {
        "median_ms": round(statistics.median(ms), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "worst_ms": round(max(ms), 1),
        "n": len(ms),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, help="an existing OME recording (else one is written)")
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--tile", default="8x128x128")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--reader",
        choices=("tileshard", "zarr", "numpy"),
        default="tileshard",
        help="zarr: TILESHARD_READER=zarr (the rollback); numpy: every level in memory first (napari's own floor)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["TILESHARD_READER"] = "zarr" if args.reader == "zarr" else "tileshard"
    tile = tuple(int(v) for v in args.tile.split("x"))
    scratch = None
    path = args.path
    if path is None:
        scratch = Path(tempfile.mkdtemp(prefix="scrub-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        path = scratch / "recording.ome.zarr"
        started = time.perf_counter()
        write(path, args.frames, tile)
        print(f"wrote {path} in {time.perf_counter() - started:.1f} s", flush=True)

    import napari
    from qtpy.QtWidgets import QApplication

    try:  # the measurement needs the plane drawn when set_current_step returns: synchronous slicing
        napari.settings.get_settings().experimental.async_ = False
    except AttributeError:
        pass
    viewer = napari.Viewer(show=True)
    viewer.window.resize(1400, 950)
    app = QApplication.instance()
    if args.reader == "numpy":
        from napari_tileshard.apps.napari_reader import read_zarr

        ((levels, meta, _),) = read_zarr(str(path))
        layer = viewer.add_image([np.asarray(level) for level in levels], multiscale=True, name=meta["name"])
    else:
        (layer,) = viewer.open(str(path), plugin="napari-tileshard")
    viewer.reset_view()
    app.processEvents()
    frames = int(layer.data[0].shape[0] if layer.multiscale else layer.data.shape[0])
    viewer.screenshot(canvas_only=True, flash=False)

    # the ShardReaders behind the layer's levels (LazySelection.reader), whose stats time each read
    readers = {id(r): r for r in (getattr(level, "reader", None) for level in layer.data) if r is not None}

    def reading() -> float:
        return sum(r.stats.busy_seconds for r in readers.values())

    def step(t: int) -> tuple[float, float, float]:
        read_before = reading()
        started = time.perf_counter()
        viewer.dims.set_current_step(0, t)
        app.processEvents()
        sliced = time.perf_counter()
        viewer.screenshot(canvas_only=True, flash=False)
        return sliced - started, time.perf_counter() - started, reading() - read_before

    forward = [step(t) for t in range(1, min(frames, args.steps + 1))]
    rng = np.random.default_rng(0)
    jumps = [step(t) for t in rng.integers(0, frames, args.steps).tolist()]
    level = layer.data_level if layer.multiscale else 0
    result = {
        "reader": args.reader,
        "frames": frames,
        "tile": args.tile,
        "level_shown": level,
        "cpus": os.cpu_count(),
        "forward_on_screen": summary([t for _, t, _ in forward]),
        "forward_sliced": summary([s for s, _, _ in forward]),
        "random_on_screen": summary([t for _, t, _ in jumps]),
        "random_sliced": summary([s for s, _, _ in jumps]),
    }
    if readers:  # the plugin's own time per step, and napari's (the rest of the step)
        result["forward_plugin"] = summary([r for _, _, r in forward])
        result["forward_napari"] = summary([t - r for _, t, r in forward])
        result["random_plugin"] = summary([r for _, _, r in jumps])
        result["random_napari"] = summary([t - r for _, t, r in jumps])
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    viewer.close()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
