"""pymmcore-plus MDA throughput: TileShardSink (gpu, cpu) vs pymmcore-plus's default ome-writers sink
(tensorstore, acquire-zarr), the same sequence in the same process, and where the time goes.

A ``UniMMCore`` with a pure-Python camera (``mmcore.demo``: each snap copies a pre-rendered
SyntheticCamera frame into the buffer pymmcore-plus hands it, so the camera costs one memcpy)
runs ``--frames`` timepoints with interval 0: the camera delivers as fast as pymmcore-plus emits.

Per configuration (``--repeats`` times, configurations interleaved):

* ``loop_s``: first to last frameReady on the MDA thread (what the MDA loop itself took; for the
  default sink this includes its synchronous ``append``; TileShardSink is attached to the MDA
  signals and its ``append`` only queues the frame, a bounded queue, policy block);
* ``total_s``: ``core.mda.run`` start to return: every frame written and the store closed;
* ``first_frame_s``: ``core.mda.run`` start to the first frameReady (the sink is attached to the
  core, ``sink.attach(core)``, and its GPU warm-up waited for before the run starts);
* ``append_s``: time the MDA thread spent in TileShardSink.append (ours only);
* frames/s and GB/s over ``total_s`` (input bytes), and the loop's rate.

``none`` runs the same MDA with no output: the ceiling pymmcore-plus itself sets.

    python benchmarks/bench_mda.py --out /tmp/bench_mda              # GPU machine, about 60-120 s
    python benchmarks/bench_mda.py --quick --out /tmp/bench_mda      # small check anywhere (CPU)
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np


def configurations(quick: bool) -> list[str]:
    from napari_tileshard.engine.backends import is_available

    configs = ["none"]
    if is_available("gpu") is None and not quick:
        configs.append("tileshard-gpu")
    configs.append("tileshard-cpu")
    for backend in ("tensorstore", "acquire_zarr"):
        try:
            __import__(backend)
        except ImportError:
            print(f"# {backend} is not importable: its default-sink configuration is left out", file=sys.stderr)
            continue
        configs.append(f"default-{backend.replace('_', '-')}")
        configs.append(f"default-{backend.replace('_', '-')}-zstd")
    return configs


class ProbeSink:
    """An experiment, not a sink: ``probe-hold`` takes each frame off the MDA thread through a queue
    and drops it; ``probe-copy`` also copies it into a 64-frame ring the way the Writer copies into
    staging (``copy_in_parts``, the same helper threads): what the hand-over and the copy alone
    cost the MDA, without the GPU, the shard writes or the metadata."""

    def __init__(self, copy: bool):
        import queue

        from napari_tileshard.engine.staging import copy_in_parts, copy_threads

        self.copy, self.queue = copy, queue.Queue(64)
        self.copy_in_parts, self.threads = copy_in_parts, copy_threads()
        self.ring: np.ndarray | None = None

    def sequenceStarted(self, sequence, meta=None) -> None:  # noqa: N802
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(self.threads) if self.threads else None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def frameReady(self, img, event, meta) -> None:  # noqa: N802
        self.queue.put(img)

    def sequenceFinished(self, sequence=None) -> None:  # noqa: N802
        self.queue.put(None)
        self.thread.join()
        if self.pool:
            self.pool.shutdown()

    def _run(self) -> None:
        index = 0
        while (img := self.queue.get()) is not None:
            if self.copy:
                data = img.reshape(-1).view(np.uint8)
                if self.ring is None:
                    self.ring = np.zeros(64 * data.nbytes, np.uint8)
                start = (index % 64) * data.nbytes
                self.copy_in_parts(self.ring[start : start + data.nbytes], data, self.pool, self.threads)
            index += 1


def run_once(core, sequence, config: str, out: Path, frame_bytes: int) -> dict:
    from ome_writers import AcquisitionSettings

    import napari_tileshard.engine.staging as staging_module
    from napari_tileshard.apps.mmcore import TileShardSink
    from napari_tileshard.apps.mmcore.demo import SyntheticCameraDevice
    from napari_tileshard.apps.mmcore.metadata import FrameTable
    from napari_tileshard.engine.options import EngineOptions
    from napari_tileshard.engine.writer import Writer

    closing: dict[str, float] = {}
    copy_threads, switch_interval = staging_module.copy_threads, sys.getswitchinterval()
    close, write_metadata = Writer.close, TileShardSink._write_metadata
    table_add, snap = FrameTable.add, SyntheticCameraDevice.snap
    buffer_type = type(core._seq_buffer) if hasattr(core, "_seq_buffer") else None
    pop_next = getattr(buffer_type, "pop_next", None)

    def timed(name, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                closing[name] = closing.get(name, 0.0) + time.perf_counter() - started
                closing[name + "_end"] = time.perf_counter()

        return wrapper

    path = out / f"{config}.ome.zarr"
    shutil.rmtree(path, ignore_errors=True)
    times: list[float] = []

    def frame_ready(*_):
        times.append(time.perf_counter())

    core.mda.events.frameReady.connect(frame_ready)
    sink = None
    detach = None
    output = None
    if config.startswith("probe-"):
        output = ProbeSink(copy=config == "probe-copy")
    elif config.startswith("tileshard-"):
        # tileshard-<backend>[+b<MiB>][+l<max latency, ms>][+t<copy threads>]
        # [+s<GIL switch interval, ms>][+discard][+nometa]
        backend, *variants = config.removeprefix("tileshard-").split("+")
        engine = {"backend": backend}
        discard = False
        for variant in variants:
            if variant.startswith("b"):
                engine["batch_bytes"] = int(variant[1:]) << 20
            elif variant.startswith("l"):  # how long frames may wait in a partly filled batch, ms
                engine["max_latency_s"] = float(variant[1:]) / 1e3
            elif variant.startswith("t"):  # an experiment: the staging copy's helper threads
                helpers = int(variant[1:])
                staging_module.copy_threads = lambda helpers=helpers: helpers
            elif variant.startswith("s"):  # an experiment: how often Python hands the GIL over
                sys.setswitchinterval(float(variant[1:]) / 1e3)
            elif variant == "discard":  # an experiment: shards counted and dropped, no file writes
                from bench_recorder import DiscardSink

                discard = True
            elif variant == "nometa":  # an experiment: no per-frame metadata record
                FrameTable.add = lambda self, *args, **kwargs: None
            else:
                raise ValueError(f"unknown variant {variant!r} of {config!r}")
        sink = TileShardSink(
            path,
            ome=False,
            queue_frames=64,
            options=EngineOptions(**engine),
            store_for=(lambda location: DiscardSink(location)) if discard else None,
        )
        detach = sink.attach(core)  # arms the GPU for the core's camera, as a user attaches before a run
        sink.wait_warm()
    elif config.startswith("default-"):
        backend = config.removeprefix("default-").removesuffix("-zstd")
        output = AcquisitionSettings(
            root_path=str(path),
            format={"name": "ome-zarr", "backend": backend},
            # acquire-zarr compresses zstd only inside blosc
            compression=(("blosc-zstd" if backend == "acquire-zarr" else "zstd") if config.endswith("-zstd") else None),
            overwrite=True,
        )
    start = time.perf_counter()
    # where the time after the last frame goes: the Writers' close (last batch, shard writes) and the
    # metadata; and the camera's two copies per frame (its snap, pymmcore-plus's pop_next)
    Writer.close, TileShardSink._write_metadata = timed("writer_close", close), timed("metadata", write_metadata)
    SyntheticCameraDevice.snap = timed("snap", snap)
    if pop_next is not None:
        buffer_type.pop_next = timed("pop_next", pop_next)
    try:
        core.mda.run(sequence, output=output)
    finally:
        total = time.perf_counter() - start
        Writer.close, TileShardSink._write_metadata = close, write_metadata
        FrameTable.add, SyntheticCameraDevice.snap = table_add, snap
        if pop_next is not None:
            buffer_type.pop_next = pop_next
        staging_module.copy_threads = copy_threads
        sys.setswitchinterval(switch_interval)
        if detach is not None:
            detach()
        core.mda.events.frameReady.disconnect(frame_ready)
    frames = len(times)
    loop = times[-1] - times[0] if frames > 1 else float("nan")
    first = times[0] - start if times else float("nan")
    row = {
        "config": config,
        "frames": frames,
        "total_s": round(total, 3),
        "loop_s": round(loop, 3),
        "frames_per_s": round(frames / total, 1),
        "GB_per_s": round(frames * frame_bytes / total / 1e9, 3),
        "loop_frames_per_s": round((frames - 1) / loop, 1) if frames > 1 else None,
        "after_loop_s": round(start + total - times[-1], 3) if times else None,
        "first_frame_s": round(first, 3),
        # wall ms per frame of the camera's copy into pymmcore-plus's buffer and of pop_next's copy out
        "snap_ms": round(closing.get("snap", float("nan")) / max(frames, 1) * 1e3, 3),
        "pop_ms": round(closing.get("pop_next", float("nan")) / max(frames, 1) * 1e3, 3),
    }
    if sink is not None:
        s = sink.stats
        row.update(
            append_s=round(s.append_s, 3),
            append_us_per_frame=round(s.append_s / max(s.received, 1) * 1e6, 1),
            max_queue=s.max_queue,
            dropped=s.dropped,
            written=s.written,
            error=s.error,
            writer_close_s=round(closing.get("writer_close", float("nan")), 3),
            metadata_s=round(closing.get("metadata", float("nan")), 3),
            # last frame to the Writers' close starting: the queue drained and the reorder finished
            drain_s=round(closing["writer_close_end"] - closing["writer_close"] - times[-1], 3)
            if "writer_close_end" in closing and times
            else None,
        )
    stored = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
    row["stored_MB"] = round(stored / 1e6, 1)
    shutil.rmtree(path, ignore_errors=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bench_mda")
    parser.add_argument("--frame", type=int, default=2048, help="square frame size (uint16)")
    parser.add_argument("--frames", type=int, default=400, help="timepoints per MDA")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="256² frames, 60 timepoints, one repeat, CPU only")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--configs",
        help="comma-separated configurations (default: all usable); probe-hold and probe-copy are the "
        "least a sink can do (take each frame off the MDA thread; and copy it once); tileshard-gpu+b256 (256 MiB "
        "batches) and the other +variants in run_once are experiments",
    )
    parser.add_argument("--buffer-mb", type=int, help="pymmcore-plus's sequence buffer (default: its own, 1024 MB)")
    parser.add_argument(
        "--malloc-tuned",
        action="store_true",
        help="an experiment: glibc keeps freed frames in its heap (mallopt: mmap threshold 32 MiB, no trimming), "
        "so that a frame pymmcore-plus allocates reuses one freed before instead of fresh pages",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.frame, args.frames, args.repeats = 256, 60, 1
    if args.malloc_tuned:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        print("# mallopt:", libc.mallopt(m_mmap_threshold, 32 << 20), libc.mallopt(m_trim_threshold, 2**31 - 1))
    logging.getLogger("pymmcore-plus").setLevel(logging.CRITICAL)
    import useq

    from napari_tileshard.apps.mmcore.demo import demo_core

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    core = demo_core((args.frame, args.frame), bank_frames=4)
    if args.buffer_mb:
        core.setCircularBufferMemoryFootprint(args.buffer_mb)
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": args.frames})
    frame_bytes = args.frame * args.frame * 2
    core.mda.run(useq.MDASequence(time_plan={"interval": 0, "loops": 4}))  # renders the camera's bank, warms up
    print(f"# setup {time.perf_counter() - t0:.1f} s; frame {args.frame}² uint16, {args.frames} frames per MDA")
    configs = configurations(args.quick)
    if args.configs:
        configs = args.configs.split(",")
    rows = []
    for repeat in range(args.repeats):
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            try:
                row = run_once(core, sequence, config, out, frame_bytes)
            except Exception as exc:  # one configuration failing (a buffer overflow) still reports the others
                row = {"config": config, "error": f"{type(exc).__name__}: {exc}", "failed": True}
            row["repeat"] = repeat
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n# medians of the repeats (frames/s over the whole run; loop = the MDA thread's own rate;")
    print("# x none: the median run's rate over the median rate of the MDA with no sink)")
    print(
        f"{'config':28s} {'frames/s':>9s} {'GB/s':>7s} {'x none':>7s} {'loop f/s':>9s} {'1st frame s':>11s} "
        f"{'after loop s':>12s} {'close s':>8s} {'append us/f':>11s} {'snap ms':>8s} {'pop ms':>7s}"
    )
    ceiling = None
    for config in configs:
        done = sorted(
            (r for r in rows if r["config"] == config and not r.get("failed") and not r.get("error")),
            key=lambda r: r["frames_per_s"],
        )
        if not done:
            failure = next((r["error"] for r in rows if r["config"] == config), "no run")
            print(f"{config:28s} failed: {failure}")
            continue
        median = done[len(done) // 2]
        if config == "none":
            ceiling = median["frames_per_s"]
        ratio = median["frames_per_s"] / ceiling if ceiling else float("nan")
        print(
            f"{config:28s} {median['frames_per_s']:9.1f} {median['GB_per_s']:7.3f} {ratio:7.2f} "
            f"{median['loop_frames_per_s'] or 0:9.1f} {median['first_frame_s']:11.3f} "
            f"{median['after_loop_s'] or 0:12.3f} "
            f"{median.get('writer_close_s', float('nan')):8.3f} "
            f"{median.get('append_us_per_frame', float('nan')):11.1f} "
            f"{median.get('snap_ms', float('nan')):8.3f} {median.get('pop_ms', float('nan')):7.3f}"
        )
    print(f"# total {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
