"""One camera stream over 1 and 2 GPUs, and two streams on two GPUs (issue 19).

Frames reach the Writer through ``frame_buffer()`` without a CPU fill after the staging buffers
held real frames once (a camera DMAing into pinned memory), so the host's pageable->pinned copy
does not cap what the GPUs can show; ``--append`` measures the ``append()`` path instead.
Each case records ``--gib`` of 2048x2048 uint16 in a fresh Writer; nvCOMP's ceiling is measured
per GPU on the same tiles (benchmarks/gpu_ceiling.py).

    python benchmarks/bench_multi_gpu.py --gib 16 --tiles 64k,256k,1m --max-device-gib 8 --max-host-gib 4

``--paced-seconds S`` adds camera-paced runs with the drop policy (``frame_buffer(block=False)``:
a frame that finds every staging buffer busy is dropped and counted): one stream over all GPUs at
``--pace-gbps`` (default 10), and one stream per GPU at ``--pair-pace-gbps`` (default 5) each
through a MultiWriter.  Their shards go to a sink that counts and discards them: 60 s at 10 GB/s
is more than this machine's disk or RAM holds, and storage is not what these runs measure.
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

from napari_tileshard import MultiWriter, SyntheticCamera, Writer, release_gpu_memory  # noqa: E402
from napari_tileshard.storage.sinks import Sink  # noqa: E402


class DiscardSink(Sink):
    """Counts what would be stored and keeps nothing."""

    def __init__(self):
        self.bytes = 0
        self.objects = 0
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return "discard://"

    def write(self, key, buffers) -> None:
        n = sum(memoryview(b).nbytes for b in buffers)
        with self._lock:
            self.bytes += n
            self.objects += 1


def paced_camera(writer, camera, gbps, seconds, result):
    """A camera DMAing frames at ``gbps`` into the writer's pinned staging; a frame that finds no
    free place is dropped (the drop policy).  Staging is filled with real frames during the first
    cycles only (afterwards the DMA is simulated: no CPU copy), as in ``stream``."""
    frame_bytes = camera.frame_bytes
    interval = frame_bytes / (gbps * 1e9)
    frames = int(seconds / interval)
    filled_once = 3 * writer.batch_bytes // frame_bytes
    source = list(camera.frames(min(frames, 64)))
    dropped = late = 0
    drop_times: list[float] = []
    progress = {"i": 0}
    stalls = _watch_stalls(threading.get_ident(), progress, interval) if getattr(paced_camera, "watch", False) else None
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(frames):
        due = t0 + i * interval
        now = time.perf_counter()
        if now < due:
            # sleep, never spin: a spinning camera thread holds the GIL that the writers' threads
            # need (two spinning cameras starved them and dropped a third of their frames)
            time.sleep(due - now)
        elif now - due > 0.1:
            late += 1  # this thread itself fell behind the pace (not the writer)
        progress["i"] = i
        with writer.frame_buffer(block=False) as place:
            if place is None:
                dropped += 1
                drop_times.append(time.perf_counter() - t0)
            elif i < filled_once:
                np.copyto(place, source[i % len(source)])
    wall = time.perf_counter() - t0
    if stalls is not None:
        progress["done"] = True
        result["stalls"] = stalls
    result.update(
        pace_gbps=gbps,
        seconds=round(wall, 2),
        frames=frames,
        dropped=dropped,
        behind_pace=late,
        first_drop_s=round(drop_times[0], 2) if drop_times else None,
        last_drop_s=round(drop_times[-1], 2) if drop_times else None,
        dropped_after_2s=sum(t > 2 for t in drop_times),
        delivered_gbps=round((frames - dropped) * frame_bytes / wall / 1e9, 3),
        cpu_s_per_gb=round((time.process_time() - cpu0) / ((frames - dropped) * frame_bytes / 1e9 or 1), 3),
    )


class GcPauses:
    """Python's garbage-collector passes longer than 10 ms during a run: (s after start, ms, generation)."""

    def __init__(self):
        import gc

        self.t0 = time.perf_counter()
        self.long: list = []
        self._started = 0.0
        self._gc = gc
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif now - self._started > 0.01:
            pause_ms = round((now - self._started) * 1e3)
            self.long.append((round(self._started - self.t0, 2), pause_ms, info["generation"]))

    def close(self):
        self._gc.callbacks.remove(self)
        return self.long


def _watch_stalls(ident, progress, interval, limit=5):
    """Where the camera thread is when it has not moved to its next frame for 50 ms (a thread
    blocked in C with the GIL released shows its Python stack here): up to ``limit`` stacks."""
    import sys
    import traceback

    stacks: list = []

    def watch():
        last, since = -1, time.perf_counter()
        while not progress.get("done") and len(stacks) < limit:
            time.sleep(0.01)
            i = progress["i"]
            if i != last:
                last, since = i, time.perf_counter()
            elif time.perf_counter() - since > 0.05 and (not stacks or stacks[-1]["frame"] != i):
                frame = sys._current_frames().get(ident)
                if frame is not None:
                    stack = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)]
                    stuck_ms = round((time.perf_counter() - since) * 1e3)
                    stacks.append({"frame": i, "stuck_ms": stuck_ms, "stack": stack[-8:]})

    threading.Thread(target=watch, daemon=True).start()
    return stacks


def paced_runs(args, camera, layout, budget, count):
    gpus = list(range(count)) if count > 1 else [0, 0]
    if args.backend == "cpu":  # a smoke test of this script on a machine without GPU
        return cpu_paced_runs(args, camera, layout)
    # one stream over every GPU at the camera pace
    sink = DiscardSink()
    host = {**budget, "max_host_bytes": budget["max_host_bytes"] * len(gpus)}
    result: dict = {"case": "one stream, paced, drop policy", "devices": gpus, "frame": list(camera.shape)}
    if args.warm_up:  # armed before the camera starts, as the recorder widget does
        Writer.warm_up(layout, backend="gpu", devices=gpus, **host)
    result["warmed_up"] = args.warm_up
    if args.gc_freeze:
        import gc

        gc.collect()
        gc.freeze()  # what exists now is never scanned again: no long collector pass mid-stream
    result["gc_freeze"] = args.gc_freeze
    pauses = GcPauses()
    with Writer(sink, layout, backend="gpu", devices=gpus, **host) as writer:
        paced_camera(writer, camera, args.pace_gbps, args.paced_seconds, result)
    result.update(stored_gb=round(sink.bytes / 1e9, 2), shards=sink.objects, gc_pauses_over_10ms=pauses.close())
    print(json.dumps(result), flush=True)
    release_gpu_memory()
    if args.single_only:
        return
    # two independent cameras, one per GPU, through one MultiWriter
    sink = DiscardSink()
    names = [f"camera{k}" for k in range(len(gpus))]
    results = {
        name: {"case": "independent streams (MultiWriter), paced, drop policy", "stream": name} for name in names
    }
    if args.warm_up:
        MultiWriter.warm_up(dict.fromkeys(names, layout), backend="gpu", devices=gpus, **budget)
    with MultiWriter(sink, dict.fromkeys(names, layout), backend="gpu", devices=gpus, **budget) as multi:
        threads = [
            threading.Thread(
                target=paced_camera, args=(multi[name], camera, args.pair_pace_gbps, args.paced_seconds, results[name])
            )
            for name in names
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for name in names:
        results[name].update(backend=multi.stats[name].backend)
        print(json.dumps(results[name]), flush=True)
    print(json.dumps({"case": "independent streams total", "stored_gb": round(sink.bytes / 1e9, 2)}), flush=True)
    release_gpu_memory()


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


def cpu_paced_runs(args, camera, layout):
    sink = DiscardSink()
    results = {name: {"case": "cpu smoke", "stream": name} for name in ("a", "b")}
    with MultiWriter(sink, dict.fromkeys(results, layout), backend="cpu") as multi:
        threads = [
            threading.Thread(target=paced_camera, args=(multi[n], camera, args.pair_pace_gbps, args.paced_seconds, r))
            for n, r in results.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for r in results.values():
        print(json.dumps(r), flush=True)
    print(json.dumps({"stored_gb": round(sink.bytes / 1e9, 3), "objects": sink.objects}), flush=True)


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
    parser.add_argument("--paced-seconds", type=float, default=0, help="camera-paced drop-policy runs (0: none)")
    parser.add_argument("--paced-only", action="store_true", help="only the paced runs")
    parser.add_argument("--pace-gbps", type=float, default=10)
    parser.add_argument("--pair-pace-gbps", type=float, default=5)
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false", help="start the cameras cold")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after arming")
    parser.add_argument("--single-only", action="store_true", help="paced: only the one-stream case")
    parser.add_argument("--watch-stalls", action="store_true", help="paced: record where the camera thread stalls")
    parser.add_argument("--backend", default="gpu", choices=["gpu", "cpu"], help="cpu: paced smoke test only")
    args = parser.parse_args()
    if args.backend == "cpu":
        count = 0
    else:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    h, w = (int(v) for v in args.frame.split("x"))
    camera = SyntheticCamera((h, w), "uint16", seed=0)
    camera.prepare()
    budget = {"max_device_bytes": int(args.max_device_gib * 2**30), "max_host_bytes": int(args.max_host_gib * 2**30)}
    paced_camera.watch = args.watch_stalls  # type: ignore[attr-defined]
    if args.paced_seconds:
        name, tile = tile_cases(args.tiles.split(","))[0]
        print(json.dumps({"paced_tile": name}), flush=True)
        paced_runs(args, camera, layout_for(camera.shape, tile), budget, count)
        if args.paced_only:
            return
    import gpu_ceiling

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
