"""Soak: record the synthetic camera through the plugin's recorder (no GUI) for a long time.

    python benchmarks/soak.py --minutes 10 --frame 1024x1024 --fps 50 --backend auto --out /tmp/soak.zarr

Samples RSS (and GPU memory when CuPy sees a device) every second; at the end prints memory
after warm-up vs at the end, dropped frames, and the verify result.
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


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def gpu_sampler():
    """A function returning the device memory this process holds (MiB), or None without a GPU.

    CuPy is imported and the device initialised here, on the main thread, before the recorder's
    threads start (importing it first from the sampler thread while another thread creates the
    GPU backend hung a GPU soak run).
    """
    try:
        import cupy

        cupy.cuda.runtime.memGetInfo()
    except Exception:  # noqa: BLE001 - no GPU: nothing to sample
        return lambda: None

    def sample():
        # This process's CuPy pool (the writer's device buffers): other processes on a shared GPU don't count.
        return cupy.get_default_memory_pool().total_bytes() / 2**20

    return sample


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--frame", default="1024x1024")
    parser.add_argument("--fps", type=float, default=50)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default="/tmp/tileshard-soak.zarr")
    args = parser.parse_args()
    h, w = (int(v) for v in args.frame.split("x"))
    layout = Layout([Dim("t", 0, 16, 1), Dim("y", h, 256, 4), Dim("x", w, 256, 4)], "uint16")
    settings = RecorderSettings(
        output=args.out, layout=layout, backend=args.backend, fps=args.fps, policy="drop", overwrite=True
    )
    gpu_mib = gpu_sampler()
    recorder = Recorder(settings)
    samples = []
    done = threading.Event()

    def sample():
        start = time.perf_counter()
        while not done.wait(1.0):
            samples.append((time.perf_counter() - start, rss_mib(), gpu_mib(), recorder.stats.frames))
            if len(samples) % 60 == 0:  # a line a minute: progress of a long run
                t, rss, gpu, frames = samples[-1]
                print(
                    f"{t:6.0f} s: {frames} frames, dropped {recorder.stats.dropped}, RSS {rss:.0f} MiB, "
                    f"GPU pool {gpu if gpu is None else round(gpu)} MiB",
                    flush=True,
                )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    recorder.start(synthetic_frames=int(args.minutes * 60 * args.fps))
    stats = recorder.join()
    done.set()
    warm = [s for s in samples if s[0] > 30] or samples
    rss = [s[1] for s in warm]
    gpu = [s[2] for s in warm if s[2] is not None]
    report = verify(args.out)
    print(
        f"soak {args.minutes:g} min, {h}x{w} uint16 at {args.fps:g} fps, backend {stats.backend}: "
        f"{stats.frames} frames, dropped {stats.dropped}, error {stats.error}"
    )
    print(f"RSS after 30 s warm-up: min {min(rss):.0f} MiB, max {max(rss):.0f} MiB, at end {rss[-1]:.0f} MiB")
    if gpu:
        print(f"GPU memory held (CuPy pool) after warm-up: min {min(gpu):.0f} MiB, max {max(gpu):.0f} MiB")
    print(f"verify: {'ok' if report.ok else 'FAILED'} ({report.shards} shards, {report.chunks} chunks)")


if __name__ == "__main__":
    main()
