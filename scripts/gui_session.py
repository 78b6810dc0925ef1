"""Drive the napari widget for real: record the synthetic camera, measure GUI stalls, screenshot.

    NAPARI_CONFIG=$(mktemp -d)/settings.yaml xvfb-run -a -s "-screen 0 1920x1080x24" \
        python scripts/gui_session.py --seconds 10 --frame 1024x1024 --fps 50 --backend cpu \
        --inspector-live --screenshot docs/recorder.png --inspector-screenshot docs/inspector.png

(A fresh ``NAPARI_CONFIG``: napari then opens its window at its default size, as on a first start.)

A 5 ms QTimer runs on the GUI thread during the recording; the worst gap between its ticks
is how long the event loop stalled.  The screenshot shows the widget docked mid-recording.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path


def watch_first_epoch(store: Path, rows: int, stop: threading.Event, seen: dict) -> None:
    """Poll the store's metadata from outside the recorder: the moment its shape first covers a
    complete shard epoch (``rows`` rows) is when the first preview frame becomes possible."""
    candidates = [store / "zarr.json", store / "0" / "zarr.json"]  # plain array, or OME level 0
    while not stop.is_set():
        for meta in candidates:
            try:
                shape = json.loads(meta.read_text()).get("shape")
            except (OSError, ValueError):
                continue
            if shape and shape[0] >= rows:
                seen["epoch_on_disk"] = time.perf_counter()
                return
        time.sleep(0.002)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--frame", default="1024x1024")
    parser.add_argument("--fps", type=float, default=100)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--screenshot", default=None)
    parser.add_argument("--shot-after", type=float, default=None, help="seconds after Start (default: 4, or 60 %%)")
    parser.add_argument("--window", default=None, help="WxH of the main window (default: napari's own size)")
    parser.add_argument("--ome", action="store_true", help="record an OME-Zarr pyramid (multiscale preview)")
    parser.add_argument(
        "--inspector-screenshot", default=None, help="after stopping, open the shard inspector and shoot"
    )
    parser.add_argument(
        "--inspector-live", action="store_true", help="dock the shard inspector in live mode during the recording"
    )
    args = parser.parse_args()

    import napari
    from qtpy.QtCore import QTimer
    from qtpy.QtWidgets import QApplication

    from napari_tileshard import Dim, Layout
    from napari_tileshard.apps.recorder import RecorderSettings

    h, w = (int(v) for v in args.frame.split("x"))
    viewer = napari.Viewer(show=True)
    if args.window:
        viewer.window.resize(*(int(v) for v in args.window.split("x")))
    _, widget = viewer.window.add_plugin_dock_widget("napari-tileshard", "Tile/Shard Recorder")
    out = Path(tempfile.mkdtemp()) / "recording.zarr"
    layout = Layout([Dim("t", 0, 16, 1), Dim("y", h, 256, 2), Dim("x", w, 256, 2)], "uint16")
    widget.settings = RecorderSettings(
        output=str(out), layout=layout, backend=args.backend, fps=args.fps, policy="drop", ome=args.ome
    )
    ticks = []
    timer = QTimer()
    timer.setInterval(5)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    app = QApplication.instance()
    stop_watch, seen = threading.Event(), {}
    watcher = threading.Thread(
        target=watch_first_epoch,
        args=(out, layout.dims[0].tile_size * layout.dims[0].tiles_per_shard, stop_watch, seen),
        daemon=True,
    )
    widget.start()
    started = time.perf_counter()
    watcher.start()
    live = None
    if args.inspector_live:
        live = widget.inspect()  # re-reads the indexes every 2 s while recording
        live.live.setChecked(True)
    timer.start()
    shot_at = time.perf_counter() + (args.shot_after if args.shot_after is not None else min(4.0, args.seconds * 0.6))
    end = time.perf_counter() + args.seconds
    shot_done = False
    while time.perf_counter() < end:
        app.processEvents()
        if "preview_shown" not in seen and widget.preview.layer is not None and not widget.preview.placeholder:
            seen["preview_shown"] = time.perf_counter()  # events processed: the new data was painted
        time.sleep(0.001)
        if args.screenshot and not shot_done and time.perf_counter() > shot_at:
            timer.stop()  # the screenshot itself renders synchronously; don't count it as a stall
            viewer.window.screenshot(args.screenshot, canvas_only=False)
            shot_done = True
            ticks.append(None)
            timer.start()
    timer.stop()
    stop_watch.set()
    widget.stop(wait=True)
    gaps, gap_ends = [], []
    previous = None
    for t in ticks:
        if t is None:
            previous = None
            continue
        if previous is not None:
            gaps.append(t - previous)
            gap_ends.append(t - started)
        previous = t
    worst = sorted(range(len(gaps)), key=gaps.__getitem__)[-5:][::-1]
    print(
        "five worst gaps (ms @ s after Start): "
        + ", ".join(f"{gaps[i] * 1e3:.0f} @ {gap_ends[i] - gaps[i]:.1f}" for i in worst)
    )
    if args.inspector_screenshot:
        inspector = live if live is not None else widget.inspect()  # the one docked already, if any
        inspector.live.setChecked(False)
        inspector.open(out)  # every shard of the finished recording
        inspector.jump_to(len(inspector.inspection.shards) // 2)
        for _ in range(20):
            app.processEvents()
            time.sleep(0.05)
        viewer.window.screenshot(args.inspector_screenshot, canvas_only=False)
    stats = widget.stats
    print(
        f"GUI under recording: {stats.frames} frames of {h}x{w} uint16 at {args.fps:g} fps, backend {stats.backend}, "
        f"dropped {stats.dropped}{', inspector live' if args.inspector_live else ''}; "
        f"event-loop ticks {len(gaps)}, worst gap {max(gaps) * 1e3:.0f} ms, "
        f"99th percentile {sorted(gaps)[int(0.99 * len(gaps))] * 1e3:.0f} ms"
    )
    if "epoch_on_disk" in seen and "preview_shown" in seen:
        print(
            f"first shard epoch on disk {seen['epoch_on_disk'] - started:.2f} s after Start; first preview "
            f"frame shown {(seen['preview_shown'] - seen['epoch_on_disk']) * 1e3:.0f} ms later (target < 1 s)"
        )
    else:
        print(f"first preview not observed: {sorted(seen)}")
    viewer.close()
    shutil.rmtree(out.parent, ignore_errors=True)  # ~1 GB per session: never leave it in /tmp


if __name__ == "__main__":
    main()
