"""How a frame from pageable memory reaches the GPU without slowing the camera beside it.

An MDA's host side, emulated with plain threads so that each way of uploading runs in seconds:
a *camera* thread copies frames of a bank into a ring (the camera's snap into pymmcore-plus's
sequence buffer), an *MDA* thread copies each out into a fresh array (``pop_next``) and queues it,
and a *consumer* thread takes it to the GPU one way or another:

* ``none``: drops it (the camera and the MDA alone: the ceiling);
* ``copy-N``: copies it into pinned staging with N threads (the Writer's way), uploads 64 frames
  at a time;
* ``register``: page-locks the frame's own memory (``cudaHostRegister``), uploads it from there,
  unlocks it once the copy is done: no CPU copy at all;
* ``pageable``: ``cudaMemcpyAsync`` straight from the pageable frame (CUDA stages it itself).

Prints the frames/s the camera and MDA threads reach with each consumer (the rate the user's MDA
would run at) and the consumer's own time per frame.

    python benchmarks/host_upload.py --frame 2048 --frames 600 --json host_upload.json
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time

import numpy as np


def run(way: str, bank: list[np.ndarray], frames: int, ring_slots: int = 16) -> dict:
    import cupy

    from napari_tileshard.engine.staging import copy_in_parts
    from napari_tileshard.gpu.pinned import pin

    nbytes = bank[0].nbytes
    ring = [np.empty(nbytes, np.uint8) for _ in range(ring_slots)]
    filled = queue.Queue(ring_slots)
    free = queue.Queue()
    for slot in ring:
        free.put(slot)
    handed = queue.Queue(64)
    batch = 64
    staging = pin(batch * nbytes) if way.startswith("copy") else None
    device = cupy.empty(batch * nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    threads = int(way.split("-")[1]) if way.startswith("copy") else 0
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(threads) if threads else None
    consumer_s = [0.0]
    runtime = cupy.cuda.runtime

    def camera() -> None:
        for i in range(frames):
            slot = free.get()
            np.copyto(slot, bank[i % len(bank)])
            filled.put(slot)

    def mda(times: list[float]) -> None:
        for _ in range(frames):
            slot = filled.get()
            fresh = slot.copy()  # pymmcore-plus's pop_next
            free.put(slot)
            handed.put(fresh)
            times.append(time.perf_counter())
        handed.put(None)

    def consumer() -> None:
        i = 0
        pending: list = []
        while (frame := handed.get()) is not None:
            start = time.perf_counter()
            offset = (i % batch) * nbytes
            if way.startswith("copy"):
                copy_in_parts(staging[offset : offset + nbytes], frame, pool, threads)
                if i % batch == batch - 1:
                    runtime.memcpyAsync(
                        device.data.ptr, staging.ctypes.data, batch * nbytes, runtime.memcpyHostToDevice, stream.ptr
                    )
                    stream.synchronize()
            elif way == "register":
                address = frame.ctypes.data
                runtime.hostRegister(address, nbytes, 0)
                runtime.memcpyAsync(device.data.ptr + offset, address, nbytes, runtime.memcpyHostToDevice, stream.ptr)
                done = cupy.cuda.Event(block=True, disable_timing=True)
                done.record(stream)
                pending.append((done, frame))
                while pending and (pending[0][0].done or len(pending) > 8):
                    event, old = pending.pop(0)
                    event.synchronize()
                    runtime.hostUnregister(old.ctypes.data)
            elif way == "pageable":
                runtime.memcpyAsync(
                    device.data.ptr + offset, frame.ctypes.data, nbytes, runtime.memcpyHostToDevice, stream.ptr
                )
                stream.synchronize()
            consumer_s[0] += time.perf_counter() - start
            i += 1
        stream.synchronize()
        for event, old in pending:
            event.synchronize()
            runtime.hostUnregister(old.ctypes.data)

    times: list[float] = []
    workers = [
        threading.Thread(target=camera),
        threading.Thread(target=mda, args=(times,)),
        threading.Thread(target=consumer),
    ]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total = time.perf_counter() - start
    if pool:
        pool.shutdown()
    return {
        "way": way,
        "frames": frames,
        "mda_frames_per_s": round((len(times) - 1) / (times[-1] - times[0]), 1),
        "total_frames_per_s": round(frames / total, 1),
        "GB_per_s": round(frames * nbytes / total / 1e9, 2),
        "consumer_ms_per_frame": round(consumer_s[0] / frames * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frame", type=int, default=2048, help="square uint16 frames")
    parser.add_argument("--frames", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", default="none,copy-0,copy-3,copy-7,register,pageable")
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    nbytes = args.frame * args.frame * 2
    bank = [rng.integers(0, 255, nbytes, dtype=np.uint8) for _ in range(8)]
    ways = args.ways.split(",")
    rows = []
    for repeat in range(args.repeats):
        for way in ways if repeat % 2 == 0 else ways[::-1]:
            row = run(way, bank, args.frames) | {"repeat": repeat}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n# medians of {args.repeats}: {args.frame}² uint16 ({nbytes / 2**20:.0f} MiB) frames")
    base = statistics.median(r["mda_frames_per_s"] for r in rows if r["way"] == "none") if "none" in ways else None
    for way in ways:
        mine = [r for r in rows if r["way"] == way]
        rate = statistics.median(r["mda_frames_per_s"] for r in mine)
        total = statistics.median(r["total_frames_per_s"] for r in mine)
        consumer = statistics.median(r["consumer_ms_per_frame"] for r in mine)
        ratio = f"{rate / base:.2f}x none" if base else ""
        print(f"{way:10s} MDA {rate:7.1f} f/s  whole {total:7.1f} f/s  consumer {consumer:6.3f} ms/frame  {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
