"""napari scrubbing: the plugin's own time per time-slider step, and napari's, in a real viewer.

Opens a recording with the plugin's napari reader (``napari_get_reader`` -> ``read_zarr``, the
layer data napari gets when a user drops the store) in a napari viewer, then steps the time
slider over ``--steps`` frames (forward one frame a step, the scrubbing gesture; ``--order
random`` for jumps) and times each step:

* ``plugin``: the time spent inside the plugin's reader during the step (``ShardReader.stats``
  ``busy_seconds``: plan, index, reads, decode and the hand-off of the plane to napari);
* ``step``: ``viewer.dims.set_current_step`` plus the Qt events that follow (slicing, the
  texture upload and the draw when the window is shown); ``napari`` = step - plugin.

Per step also the chunk bytes read and decoded (``stats``): a step must decode only the chunks
of the displayed plane, and the cyclic GC's runs.  ``--stages``: where the plugin's CPU goes, per
step, from each thread's CPU time inside the reader's stages (``decode``: the codec's calls,
``untile``: the strided copies into the plane, ``fetch``: the shard reads, ``plan``), p50 of the
steps that decode a new tile row and of the cache hits.  p50 and p99 (nearest rank) of each are
printed and written to ``--out``.

Needs a display: run under ``xvfb-run -a`` (or ``QT_QPA_PLATFORM=offscreen`` with ``--no-show``,
where nothing is drawn).  Without ``--path`` a recording of ``--frames`` 2048² uint16 frames
from SyntheticCamera is written first (``--tile t,y,x``, shards of one tile deep x 1024 x 1024).

    xvfb-run -a python benchmarks/bench_scrub.py --dir /tmp/scrub --steps 200 --out scrub.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer
from napari_tileshard.apps.napari_reader import napari_get_reader
from napari_tileshard.reader import cpu as cpu_reader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stages import StageClock  # noqa: E402


def write_recording(path: Path, frames: int, tile) -> None:
    camera = SyntheticCamera((2048, 2048), "uint16")
    layout = Layout(
        [
            Dim("t", frames, tile[0], 1),
            Dim("y", 2048, tile[1], 1024 // tile[1]),
            Dim("x", 2048, tile[2], 1024 // tile[2]),
        ],
        "uint16",
    )
    shutil.rmtree(path, ignore_errors=True)
    with Writer(path, layout, backend="cpu") as writer:
        for i in range(frames):
            writer.append(camera.frame(i))


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(np.ceil(q / 100 * len(ordered))) - 1))]


def stage_clock() -> StageClock:
    """CPU seconds of the reader's stages, summed over the threads that run them."""
    clock = StageClock()
    clock.wrap(cpu_reader.BlockSource, "decode", "decode")
    clock.wrap(cpu_reader, "untile_into", "untile")
    clock.wrap(ShardReader, "_fetch", "fetch")
    clock.wrap(ShardReader, "_plan", "plan")
    return clock


def busy_python(seconds: float) -> None:
    """Run Python on this thread for ``seconds``, holding the GIL but for the interpreter's switches
    (``--headless``'s stand-in for napari drawing a step)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


class HeadlessViewer:
    """What napari's viewer does with the layer data at a time-slider step, without Qt (``--headless``,
    for hosts without a display stack): index the plane as napari's slicing does (``data[t:t+1, :, :]``,
    on this thread), then ``draw_ms`` of Python standing in for napari's drawing (the read-ahead runs
    beside it)."""

    def __init__(self, data, draw_ms: float):
        self.data, self.draw_s = data, draw_ms / 1e3

    def step(self, t: int) -> None:
        np.asarray(self.data[t : t + 1, :, :])
        busy_python(self.draw_s)

    def close(self) -> None:
        pass


def scrub(
    path: Path,
    steps: int,
    order: str,
    show: bool,
    ab_read_ahead: int = 0,
    stages: bool = False,
    headless_draw_ms: float | None = None,
) -> dict:
    reader_function = napari_get_reader(str(path))
    assert reader_function is not None, f"{path}: not opened by the plugin"
    [(data, meta, _kind)] = reader_function(str(path))
    assert isinstance(data, ShardReader), f"the layer data is {type(data).__name__}, not the plugin's reader"
    if headless_draw_ms is not None:
        viewer = HeadlessViewer(data, headless_draw_ms)
        data[data.shape[0] // 2 : data.shape[0] // 2 + 1, :, :]  # napari's first draw (the middle frame)

        def set_step(t: int) -> None:
            viewer.step(t)
    else:
        import napari
        from qtpy.QtWidgets import QApplication

        viewer = napari.Viewer(show=show)
        viewer.add_image(data, **{k: v for k, v in meta.items() if k in ("name", "metadata", "axis_labels")})
        app = QApplication.instance()
        app.processEvents()

        def set_step(t: int) -> None:
            viewer.dims.set_current_step(0, t)
            app.processEvents()

    frames = data.shape[0]
    rng = np.random.default_rng(0)
    targets = rng.integers(0, frames, steps).tolist() if order == "random" else [(1 + i) % frames for i in range(steps)]
    stats = data.stats
    rows = []
    collections: list[tuple[int, float]] = []  # (generation, seconds) of each cyclic GC run
    started_gc = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started_gc[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started_gc[0]))

    gc.callbacks.append(on_gc)
    clock = stage_clock() if stages else None
    for k, t in enumerate(targets):
        if ab_read_ahead:  # alternate blocks of steps with and without read-ahead (interleaved A/B)
            data.read_ahead = (k // ab_read_ahead) % 2 == 0
        busy, read, decoded = stats.busy_seconds, stats.data_bytes, stats.bytes_decoded
        runs = len(collections)
        spent = dict(clock.seconds) if clock else {}
        started = time.perf_counter()
        set_step(t)
        step = time.perf_counter() - started
        plugin = stats.busy_seconds - busy
        rows.append(
            {
                "t": t,
                "step_ms": 1e3 * step,
                "plugin_ms": 1e3 * plugin,
                "napari_ms": 1e3 * (step - plugin),
                "data_bytes": stats.data_bytes - read,
                "read_ahead": data.read_ahead,
                "decoded_bytes": stats.bytes_decoded - decoded,
                "gc_ms": 1e3 * sum(seconds for _, seconds in collections[runs:]),
                "gc_full": sum(generation == 2 for generation, _ in collections[runs:]),
            }
        )
        if clock:
            rows[-1]["stages_ms"] = {n: 1e3 * (v - spent.get(n, 0.0)) for n, v in clock.seconds.items()}
    if clock:
        clock.restore()
    gc.callbacks.remove(on_gc)
    viewer.close()
    summary = {
        "steps": steps,
        "order": order,
        "shown": show and headless_draw_ms is None,
        "headless_draw_ms": headless_draw_ms,
        "read_ahead": data.read_ahead,
        "frames": frames,
        "shape": list(data.shape),
        "chunk_shape": list(data.chunk_shape),
        "shard_shape": list(data.shard_shape),
        "plane_bytes": int(np.prod(data.shape[1:])) * data.dtype.itemsize,
    }
    groups = {"all": rows[1:]}  # the first step warms napari's texture up
    if ab_read_ahead:  # the first step of each block is the switch: left out
        groups = {
            f"read_ahead={on}": [r for k, r in enumerate(rows) if k % ab_read_ahead and r["read_ahead"] == on]
            for on in (True, False)
        }
    for name, group in groups.items():
        for key in ("plugin_ms", "napari_ms", "step_ms"):
            values = [r[key] for r in group]
            summary.setdefault(name, {})[key] = {
                "p50": round(percentile(values, 50), 2),
                "p99": round(percentile(values, 99), 2),
                "max": round(max(values), 2),
            }
    summary["gc"] = {
        "collections": len(collections),
        "full": sum(generation == 2 for generation, _ in collections),
        "ms_max": round(1e3 * max((seconds for _, seconds in collections), default=0.0), 1),
        "ms_total": round(1e3 * sum(seconds for _, seconds in collections), 1),
    }
    if clock:
        for name, group in (("decoding_steps", rows[1:]), ("cache_hits", rows[1:])):
            chosen = [r for r in group if (r["decoded_bytes"] > 0) == (name == "decoding_steps")]
            keys = sorted({key for r in chosen for key in r.get("stages_ms", {})})
            summary.setdefault("stages_cpu_ms_p50", {})[name] = {
                "steps": len(chosen),
                "plugin_ms": round(percentile([r["plugin_ms"] for r in chosen], 50), 2) if chosen else None,
                **{key: round(percentile([r["stages_ms"].get(key, 0.0) for r in chosen], 50), 2) for key in keys},
            }
    summary["decoded_bytes_per_step"] = round(float(np.mean([r["decoded_bytes"] for r in rows])))
    summary["data_bytes_per_step"] = round(float(np.mean([r["data_bytes"] for r in rows])))
    summary["rows"] = rows
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, help="an existing recording")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tileshard-scrub"))
    parser.add_argument("--frames", type=int, default=256)
    parser.add_argument("--tile", default="2,128,128")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--order", choices=("forward", "random"), default="forward")
    parser.add_argument("--no-show", action="store_true", help="a hidden viewer: nothing drawn")
    parser.add_argument(
        "--ab-read-ahead", type=int, default=0, metavar="N", help="alternate blocks of N steps, read-ahead on and off"
    )
    parser.add_argument("--stages", action="store_true", help="CPU per step of the reader's stages")
    parser.add_argument(
        "--headless",
        type=float,
        metavar="DRAW_MS",
        help="no napari: index the layer data as napari's slicing does, then DRAW_MS of Python for its drawing",
    )
    parser.add_argument(
        "--switch",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="UPPER-case switches of napari_tileshard.reader.cpu for this run (A/B), e.g. READ_AHEAD_ON_POOL=0",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    for item in (part for text in args.switch for part in text.split(",")):
        name, _, value = item.partition("=")
        if not name.isupper() or not hasattr(cpu_reader, name):
            raise SystemExit(f"--switch {item!r}: no such switch in napari_tileshard.reader.cpu")
        setattr(cpu_reader, name, type(getattr(cpu_reader, name))(int(value)))
    path = args.path
    if path is None:
        tile = tuple(int(v) for v in args.tile.split(","))
        path = args.dir / f"scrub-{'x'.join(map(str, tile))}.zarr"
        write_recording(path, args.frames, tile)
    try:
        result = scrub(path, args.steps, args.order, not args.no_show, args.ab_read_ahead, args.stages, args.headless)
    finally:
        if args.path is None and not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    result.update(command=" ".join(sys.argv), machine=f"{os.cpu_count()} CPUs", path=str(path))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
