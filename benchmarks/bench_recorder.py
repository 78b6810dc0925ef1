"""The recorder's paths against a plain paced ``Writer.append`` loop, on the same frames, in one run.

    python benchmarks/bench_recorder.py --frame 2304x2304 --backend gpu --out discard \\
        --limit 480,520,560,600,640 --seconds 60              # GPU machine: the limit, then 95 % of it
    python benchmarks/bench_recorder.py --frame 1024x1024 --backend cpu --fps 0 --paths writer,recorder \\
        --policy block --seconds 10 --repeats 3 --out /tmp/rec.zarr   # 2-core box: unpaced, best of 3

Paths (each records ``--seconds`` of ``--frame`` uint16 frames of the synthetic camera, whose
frame bank is rendered before any clock starts; the layout is ``Layout.default_for`` unless
``--tile``/``--tiles-per-shard`` say otherwise):

* ``writer``: one thread, a plain loop: wait until frame i is due (``--fps``), ``Writer.append``
  (a Writer with the default options).
  It behaves like a camera with a ``--queue``-frame buffer: frames more than ``--queue`` behind
  when the loop comes to them are dropped and counted (policy drop), or waited for (block).
* ``recorder``: the Qt-free ``Recorder`` with its synthetic camera (``feed_synthetic``): the camera
  thread paces and pushes, the recording thread appends.
* ``dock``: ``recorder`` plus what the napari dock adds: the preview reader thread reading the
  newest frame of each completed shard epoch back from the store (``PreviewReader``; not with
  ``--out discard``), and the status line formatted 4 times a second.
* ``layer``: a live image layer as a camera plugin drives it: a thread assigns a new frame to the
  layer at ``--fps`` and emits its data event (``LayerSource.assigned``: a copy, then the queue).

``--out discard`` writes into a sink that counts the shards and throws them away (a long run at
GB/s fits no memory); a path writes a store there (removed after each run unless ``--keep``).
``--limit R1,R2,...`` first runs the ``writer`` path at each rate (frames/s, ascending,
``--limit-seconds`` each) and takes the highest with no dropped frame as the paced Writer limit;
the paths then run at ``--fraction`` (0.95) of it.  ``--fps 0``: unpaced (as fast as the path
goes; use ``--policy block``).  One JSON line per run, then a table; ``--json`` keeps the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

# This checkout's code, unless PYTHONPATH names another copy of the package (an A/B against the
# code before runs this same script with PYTHONPATH=/path/to/before/src)
if not any((Path(p) / "napari_tileshard").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, SyntheticCamera, Writer  # noqa: E402
from napari_tileshard.apps.recorder import Recorder, RecorderSettings  # noqa: E402
from napari_tileshard.engine.options import EngineOptions  # noqa: E402
from napari_tileshard.storage.sinks import Sink  # noqa: E402


class DiscardSink(Sink):
    """Counts what the Writer writes and keeps nothing (a recording longer than memory holds)."""

    def __init__(self, name: str = "discard"):
        self.name = name
        self.objects = 0
        self.bytes = 0
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return f"<{self.name}>"

    def write(self, key, buffers) -> None:
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        with self._lock:
            self.objects += 1
            self.bytes += nbytes


def make_layout(frame: tuple[int, int], tile: str | None, per_shard: str | None) -> Layout:
    default = Layout.default_for((0, *frame), "uint16", ("t", "y", "x"))
    if not tile and not per_shard:
        return default
    tiles = [int(v) for v in tile.split(",")] if tile else list(default.tile_shape)
    shards = [int(v) for v in per_shard.split(",")] if per_shard else list(default.tiles_per_shard)
    return Layout([Dim(n, s, t, p) for n, s, t, p in zip("tyx", (0, *frame), tiles, shards)], "uint16")


def describe_layout(layout: Layout) -> str:
    tile = "x".join(map(str, layout.tile_shape))
    shard = "x".join(str(t * p) for t, p in zip(layout.tile_shape, layout.tiles_per_shard))
    shard_mib = layout.chunks_per_shard * layout.tile_bytes / 2**20
    return f"tiles {tile} ({layout.tile_bytes >> 10} KiB), shards {shard} ({shard_mib:.0f} MiB)"


def settings_for(args, layout: Layout, fps: float | None, output: str, source: str = "synthetic") -> RecorderSettings:
    return RecorderSettings(
        output=output,
        layout=layout,
        backend=args.backend,
        fps=fps,
        policy=args.policy,
        overwrite=True,
        queue_frames=args.queue,
        source=source,
    )


class Target:
    """Where one run writes: a DiscardSink, or a store path cleared before and after."""

    def __init__(self, out: str, keep: bool):
        self.out, self.keep = out, keep
        self.sink: DiscardSink | None = None

    def store(self):
        if self.out == "discard":
            self.sink = DiscardSink()
            return self.sink
        shutil.rmtree(self.out, ignore_errors=True)
        return self.out

    def cleanup(self) -> None:
        if self.out != "discard" and not self.keep:
            shutil.rmtree(self.out, ignore_errors=True)


def io_busy(stats) -> float:
    return sum(w.get("busy_s", 0.0) for w in (stats.io_workers or []))


def run_writer(args, layout, camera, fps, frames, target) -> dict:
    """The plain paced loop: one thread waits for each frame's time and appends it."""
    settings = settings_for(args, layout, fps or None, args.out)
    armed_at = time.perf_counter()
    writer = Writer(target.store(), settings.array_spec(), plain_options(args), overwrite=True)
    arm_s = time.perf_counter() - armed_at
    period = 1 / fps if fps else 0.0
    latencies = []
    dropped = index = 0
    append, frame, perf_counter, sleep = writer.append, camera.frame, time.perf_counter, time.sleep
    start = perf_counter()
    while index < frames:
        if period:
            now = perf_counter()
            due = start + index * period
            if due > now:
                sleep(due - now)
            elif args.policy == "drop":
                behind = int((now - start) / period) - index  # frames due that the loop has not taken
                if behind > args.queue:  # a camera's buffer of --queue frames overflowed meanwhile
                    skip = min(behind - args.queue, frames - index)
                    dropped += skip
                    index += skip
                    continue
        began = perf_counter()
        append(frame(index))
        latencies.append(perf_counter() - began)
        index += 1
    last = perf_counter()
    writer.close()
    closed = perf_counter()
    stats = writer.stats
    latencies.sort()
    return {
        "frames": frames - dropped,
        "dropped": dropped,
        "clock_s": last - start,
        "close_s": closed - last,
        "arm_s": arm_s,
        "append_s": sum(latencies),
        "copy_s": getattr(stats, "copy_s", None),  # not counted by the code before
        "append_p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else None,
        "append_p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)] if latencies else None,
        "append_max_ms": 1e3 * latencies[-1] if latencies else None,
        "bytes_out": stats.bytes_out,
        "shards": stats.shards_written,
        "io_busy_s": io_busy(stats),
        "backend": stats.backend,
    }


def run_recorder(args, layout, camera, fps, frames, target, dock: bool = False) -> dict:
    """The Qt-free Recorder with its synthetic camera; ``dock``: with the dock's preview reads and status."""
    settings = settings_for(args, layout, fps or None, args.out)
    store = target.store()
    recorder = make_recorder(settings, store)
    reader = status = None
    statuses = [0]
    if dock:
        if args.out != "discard":
            from napari_tileshard.apps.preview import PreviewReader

            reader = PreviewReader(settings.output, settings.pyramid(), settings.ome, lambda *_: None).start()
            recorder.on_progress = lambda s: reader.note(None, s.rows_complete)
        done = threading.Event()

        def poll() -> None:  # the dock's status line, every 250 ms
            while not done.wait(0.25):
                s = recorder.stats
                _ = (
                    f"recording | backend {s.backend} | frames {s.frames} ({getattr(s, 'rate_fps', 0):.1f}/s) | "
                    f"dropped {s.dropped} | queue {s.queue_depth}"
                )
                statuses[0] += 1

        status = threading.Thread(target=poll, daemon=True)
        status.start()
    started = time.perf_counter()
    recorder.start(synthetic_frames=frames)
    stats = recorder.join()
    closed = time.perf_counter()
    if dock:
        done.set()
        status.join()
        if reader is not None:
            reader.finish()
    return recorder_row(recorder, stats, started, closed, frames) | (
        {"preview_reads": getattr(reader, "reads", 0), "status_lines": statuses[0]} if dock else {}
    )


def run_layer(args, layout, camera, fps, frames, target) -> dict:
    """A live layer that a camera plugin keeps assigning new frames to (napari's data event)."""

    class Layer:
        name = "camera"

        def __init__(self, data):
            self.data = data

    layer = Layer(camera.frame(camera.bank_frames - 1))
    settings = settings_for(args, layout, fps or None, args.out, source="camera")
    recorder = make_recorder(settings, target.store())
    source = recorder.add_layer(layer)
    started = time.perf_counter()
    recorder.start()
    recorder.wait_armed() if hasattr(recorder, "wait_armed") else time.sleep(1.0)
    period = 1 / fps if fps else 0.0
    clock = time.perf_counter()
    for index in range(frames):
        if period:
            delay = clock + index * period - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        layer.data = camera.frame(index)
        source.assigned()
    recorder.stop()
    stats = recorder.join()
    closed = time.perf_counter()
    return recorder_row(recorder, stats, started, closed, frames)


def plain_options(args) -> EngineOptions:
    """A plain Writer's: the defaults (the recorder's own differ in max_latency_s only)."""
    return EngineOptions(backend=args.backend)


class GcPauses:
    """The garbage collector's pauses during a run (``gc.callbacks``): count and longest per generation."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase, info) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def summary(self) -> dict:
        full = [s for g, s in self.pauses if g == 2]
        return {
            "gc_collections": len(self.pauses),
            "gc_full": len(full),
            "gc_longest_ms": 1e3 * max((s for _, s in self.pauses), default=0.0),
            "gc_total_ms": 1e3 * sum(s for _, s in self.pauses),
        }


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_recorder(settings: RecorderSettings, store) -> Recorder:
    if isinstance(store, Sink):
        return Recorder(settings, store=store)
    return Recorder(settings)


def recorder_row(recorder, stats, started, closed, offered) -> dict:
    writer = recorder.writer
    ws = writer.stats if writer is not None else None
    elapsed = stats.elapsed_s
    row = {
        "frames": stats.frames,
        "dropped": stats.dropped,
        "offered": offered,
        "clock_s": elapsed,  # first frame to last frame appended (older code: Start to the end)
        "wall_s": closed - started,  # Start to the store closed: arming, camera, recording, close
        "arm_s": getattr(stats, "arm_s", None),
        "append_s": getattr(stats, "append_s", None),
        "copy_s": getattr(ws, "copy_s", None),
        "queue_wait_s": getattr(stats, "queue_wait_s", None),
        "source_s": getattr(stats, "source_s", None),
        "max_queue": getattr(stats, "max_queue", None),
        "bytes_out": stats.bytes_out,
        "shards": stats.shards_written,
        "io_busy_s": io_busy(ws) if ws is not None else None,
        "backend": stats.backend,
        "error": stats.error,
    }
    return row


PATHS = {"writer": run_writer, "recorder": run_recorder, "dock": None, "layer": run_layer}


def run_path(path, args, layout, camera, fps, seconds, target) -> dict:
    frames = max(1, int(round((fps or args.unpaced_fps) * seconds)))
    cpu_before = cpu_seconds()
    pauses = GcPauses()
    try:
        with pauses:
            if path == "dock":
                row = run_recorder(args, layout, camera, fps, frames, target, dock=True)
            else:
                row = PATHS[path](args, layout, camera, fps, frames, target)
        row |= pauses.summary()
        if args.sync and args.out != "discard":  # what making it durable costs on top
            synced = time.perf_counter()
            os.sync()
            row["sync_s"] = time.perf_counter() - synced
    finally:
        sink = target.sink
        target.cleanup()
    row["cpu_s"] = cpu_seconds() - cpu_before  # every thread of this process, arming and closing included
    frame_bytes = layout.frame_elements * layout.itemsize
    clock = row.get("clock_s") or float("nan")
    row["cpu_s_per_gb"] = row["cpu_s"] / (row["frames"] * frame_bytes / 1e9) if row["frames"] else float("nan")
    row = {"path": path, "fps": fps, "seconds": seconds, "requested_gbps": fps * frame_bytes / 1e9} | row
    row["gbps"] = row["frames"] * frame_bytes / clock / 1e9 if clock > 0 else float("nan")
    row["fps_kept"] = row["frames"] / clock if clock > 0 else float("nan")
    if sink is not None:
        row["discarded_objects"], row["discarded_bytes"] = sink.objects, sink.bytes
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frame", default="2304x2304")
    parser.add_argument("--tile", help="tile shape t,y,x (default: the default layout's)")
    parser.add_argument("--tiles-per-shard", help="tiles per shard t,y,x (default: the default layout's)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default="discard", help="'discard' or a store path")
    parser.add_argument("--keep", action="store_true", help="keep the store of the last run")
    parser.add_argument("--fps", type=float, default=200, help="frames/s (0: unpaced)")
    parser.add_argument("--unpaced-fps", type=float, default=200, help="with --fps 0: frames = this x --seconds")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--policy", default="drop", choices=("drop", "block"))
    parser.add_argument("--queue", type=int, default=64)
    parser.add_argument("--paths", default="writer,recorder,dock")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--limit", help="rates (frames/s) at which to find the paced Writer's limit first")
    parser.add_argument("--limit-seconds", type=float, default=5)
    parser.add_argument("--fraction", type=float, default=0.95)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--sync", action="store_true", help="after each run, time os.sync() (the store made durable)")
    args = parser.parse_args(argv)
    h, w = (int(v) for v in args.frame.split("x"))
    layout = make_layout((h, w), args.tile, args.tiles_per_shard)
    frame_bytes = h * w * 2
    t0 = time.perf_counter()
    camera = SyntheticCamera((h, w), "uint16", seed=0)
    camera.prepare()
    print(f"# camera bank: {camera.bank_frames} frames of {h}x{w} rendered in {time.perf_counter() - t0:.1f} s")
    settings = settings_for(args, layout, args.fps or None, args.out)
    if args.backend in ("gpu", "auto"):
        from napari_tileshard.engine.backends import gpu_unavailable_reason

        if gpu_unavailable_reason() is None:
            t0 = time.perf_counter()
            for options in {settings.engine_options(), plain_options(args)}:  # the dock warms the recorder's
                Writer.warm_up(settings.array_spec(), options)
            print(f"# Writer.warm_up {time.perf_counter() - t0:.2f} s")
    print(f"# layout {describe_layout(layout)}; options {settings.engine_options()}; out {args.out}")
    target = Target(args.out, args.keep)
    rows = []
    fps = args.fps
    if args.limit:
        limit = None
        for rate in sorted(float(r) for r in args.limit.split(",")):
            row = run_path("writer", args, layout, camera, rate, args.limit_seconds, target)
            row["search"] = True
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["dropped"]:
                break
            limit = rate
        if limit is None:
            print("# the paced Writer dropped frames at every rate tried", flush=True)
            return 1
        fps = math.floor(args.fraction * limit)
        print(
            f"# paced Writer limit {limit:g} frames/s ({limit * frame_bytes / 1e9:.2f} GB/s); paths at "
            f"{fps:g} frames/s ({fps * frame_bytes / 1e9:.2f} GB/s)",
            flush=True,
        )
    paths = args.paths.split(",")
    for repeat in range(args.repeats):
        for path in paths if repeat % 2 == 0 else paths[::-1]:
            row = run_path(path, args, layout, camera, fps, args.seconds, target)
            row["repeat"] = repeat
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n# {describe_layout(layout)}, {h}x{w} uint16, {fps:g} frames/s requested, policy {args.policy}")
    print(
        f"{'path':9s} {'frames':>7s} {'dropped':>7s} {'GB/s':>6s} {'x writer':>8s} {'wall s':>7s} {'arm s':>6s} "
        f"{'CPU s/GB':>8s}"
    )
    best = {}
    for path in paths:
        done = [r for r in rows if r["path"] == path and not r.get("search")]
        best[path] = max(done, key=lambda r: r["gbps"] if r["gbps"] == r["gbps"] else 0)
    base = best.get("writer", {}).get("gbps")
    for path, r in best.items():
        ratio = r["gbps"] / base if base else float("nan")
        print(
            f"{path:9s} {r['frames']:7d} {r['dropped']:7d} {r['gbps']:6.2f} {ratio:8.3f} "
            f"{r.get('wall_s') or r['clock_s'] + r.get('close_s', 0):7.2f} {r.get('arm_s') or 0:6.2f} "
            f"{min(x['cpu_s_per_gb'] for x in rows if x['path'] == path and not x.get('search')):8.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
