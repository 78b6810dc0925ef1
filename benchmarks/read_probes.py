"""Probes behind the Read section of docs/benchmarks.md (where a ShardReader's time goes).

Each subcommand reads an existing recording (``bench_read.py --keep`` writes one, e.g.
``/dev/shm/tileshard-read/256k.zarr``) and prints what it measured:

    python benchmarks/read_probes.py engines PATH gpu-device,gpu-host,cpu,cpu:prefetch=8 [--repeat 3]
        whole-array GB/s (best of --repeat) and the median single-plane read, per reader setting
    python benchmarks/read_probes.py timeline PATH
        CUDA events around every H2D, realign, nvCOMP call and un-tiling launch of three GPU reads,
        then the host-side costs before the first decode (plan, batches, first fetch)
    python benchmarks/read_probes.py host-read PATH
        the shard files read (os.preadv) into pinned, reused and fresh memory by 1-32 threads
    python benchmarks/read_probes.py zstd-threads PATH
        zstd decode rate of the recording's chunks by 1-16 threads (numcodecs / python-zstandard)
    python benchmarks/read_probes.py plan
        planning time of a 256-shard whole-array read (a small recording of its own, CPU only)
    python benchmarks/read_probes.py fetch-cold PATH [--repeat 6]
        the reader's own fetch of a whole-array plan (no decoding) from the disk, its pages evicted
        before each pass, with and without the OS hinted ahead (fetch.WILL_NEED_BYTES), alternately

For an A/B of two versions of the code, run this file from each version's tree.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import ShardReader


def engines(path: str, names: str, repeat: int) -> None:
    for name in names.split(","):
        engine, *settings = name.split(":")
        options = {key: int(value) for key, value in (s.split("=") for s in settings)}
        device = engine == "gpu-device"
        reader = ShardReader(path, backend="cpu" if engine == "cpu" else "gpu", **options)
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            out = reader.read(..., device=device)
            if device:
                import cupy

                cupy.cuda.Device().synchronize()
            times.append(time.perf_counter() - started)
            nbytes = out.nbytes
            del out
        planes = []
        for t in np.random.default_rng(0).integers(0, reader.shape[0], 10).tolist():
            started = time.perf_counter()
            reader.read((t,))
            planes.append(time.perf_counter() - started)
        row = {
            "gbps": round(nbytes / min(times) / 1e9, 2),
            "all_s": [round(t, 3) for t in times],
            "plane_ms": round(1e3 * statistics.median(planes), 1),
        }
        print(name, json.dumps(row), flush=True)
        reader.close()


def timeline(path: str) -> None:
    import cupy

    from napari_tileshard.gpu import nvcomp as _nvcomp

    marks: list[tuple] = []  # (stream, stage, start event, end event)

    def event(stream_ptr: int):
        recorded = cupy.cuda.Event()
        recorded.record(cupy.cuda.ExternalStream(stream_ptr))
        return recorded

    # Wrapped for the probe only: the read path calls them through these module attributes.
    memcpy = cupy.cuda.runtime.memcpyAsync

    def timed_memcpy(dst, src, size, kind, stream):
        start = event(stream)
        memcpy(dst, src, size, kind, stream)
        marks.append(("copy" if kind == 1 else "compute", "H2D" if kind == 1 else "D2H", start, event(stream)))

    decompress = _nvcomp.decompress_async

    def timed_decompress(*args):
        start = event(args[-1])
        decompress(*args)
        marks.append(("compute", "nvcomp", start, event(args[-1])))

    cupy.cuda.runtime.memcpyAsync = timed_memcpy
    _nvcomp.decompress_async = timed_decompress
    reader = ShardReader(path, backend="gpu")
    gpu = reader._gpu_reader()
    for name in ("_untile", "_realign"):
        kernel = getattr(gpu, name)

        def timed(grid, block, args, stream=None, kernel=kernel, name=name):
            ptr = (stream or cupy.cuda.get_current_stream()).ptr
            start = event(ptr)
            kernel(grid, block, args, stream=cupy.cuda.ExternalStream(ptr))
            marks.append(("compute", name, start, event(ptr)))

        setattr(gpu, name, timed)
    for rep in range(3):
        marks.clear()
        cupy.cuda.Device().synchronize()
        started = time.perf_counter()
        origin = cupy.cuda.Event()
        origin.record(gpu.stream)
        out = reader.read(..., device=True)
        cupy.cuda.Device().synchronize()
        wall = time.perf_counter() - started
        busy: collections.Counter = collections.Counter()
        spans = []
        for stream, stage, start, end in marks:
            busy[stage] += cupy.cuda.get_elapsed_time(start, end)
            spans.append((stream, cupy.cuda.get_elapsed_time(origin, start), cupy.cuda.get_elapsed_time(origin, end)))
        compute = sorted((a, b) for stream, a, b in spans if stream == "compute")
        covered, current = 0.0, None
        for a, b in compute:  # union of the compute stream's busy intervals
            if current is None or a > current[1]:
                covered += (current[1] - current[0]) if current else 0.0
                current = [a, b]
            else:
                current[1] = max(current[1], b)
        covered += (current[1] - current[0]) if current else 0.0
        print(
            f"read {rep}: wall {wall * 1e3:.0f} ms ({out.nbytes / wall / 1e9:.1f} GB/s); compute stream: first op at "
            f"{compute[0][0]:.1f} ms, last ends {max(b for _, b in compute):.1f} ms, busy {covered:.1f} ms;",
            {k: f"{v:.1f} ms" for k, v in busy.items()},
            flush=True,
        )
        del out
    started = time.perf_counter()
    plan = reader.plan(...)
    print(f"plan: {1e3 * (time.perf_counter() - started):.1f} ms (indexes cached)")
    started = time.perf_counter()
    batches = gpu.batches(plan)
    print(f"batches: {1e3 * (time.perf_counter() - started):.1f} ms, {len(batches)} batches")
    started = time.perf_counter()
    gpu._fetch(batches[0])
    print(f"first fetch: {1e3 * (time.perf_counter() - started):.1f} ms ({batches[0].staging_bytes / 1e6:.0f} MB)")


def _shard_files(path: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names if name != "zarr.json")


def host_read(path: str) -> None:
    import cupy

    files = _shard_files(path)
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    targets = {
        "pinned": np.frombuffer(cupy.cuda.alloc_pinned_memory(total), np.uint8, total),
        "reused": np.ones(total, np.uint8),
        "fresh": None,
    }

    def run(target, threads: int) -> float:
        def one(i: int) -> None:
            fd = os.open(files[i], os.O_RDONLY)
            try:
                buffer = np.empty(sizes[i], np.uint8) if target is None else target[offsets[i] : offsets[i] + sizes[i]]
                os.preadv(fd, [memoryview(buffer)], 0)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(one, range(len(files))))
            return total / (time.perf_counter() - started) / 1e9

    print(f"{len(files)} files, {total / 1e9:.2f} GB")
    for threads in (1, 2, 4, 8, 16, 32):
        rates = {name: max(run(target, threads) for _ in range(2)) for name, target in targets.items()}
        print(f"threads {threads:2d}: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()), flush=True)


def zstd_threads(path: str) -> None:
    import numcodecs.zstd
    import zstandard

    reader = ShardReader(path, backend="cpu")
    chunks = []
    for name in _shard_files(path)[:8]:
        index = reader.shard_index(os.path.relpath(name, path))
        data = Path(name).read_bytes()
        chunks += [data[o : o + n] for o, n in zip(index.offsets.tolist(), index.nbytes.tolist()) if n > 0]
    n = reader.chunk_bytes
    print(f"{len(chunks)} chunks of {n} bytes; ratio {len(chunks) * n / sum(map(len, chunks)):.2f}", flush=True)

    def numcodecs_into(items) -> None:
        dest = np.empty(n, np.uint8)
        for chunk in items:
            numcodecs.zstd.decompress(chunk, dest)

    def zstandard_context(items) -> None:
        context = zstandard.ZstdDecompressor()
        for chunk in items:
            context.decompress(chunk, max_output_size=n)

    for name, decode in (("numcodecs into", numcodecs_into), ("zstandard ctx", zstandard_context)):
        for threads in (1, 4, 8, 16):
            rounds = 4 * threads
            with ThreadPoolExecutor(threads) as pool:
                started = time.perf_counter()
                list(pool.map(decode, [chunks] * rounds))
                seconds = time.perf_counter() - started
            print(f"{name:16s} threads {threads:2d}: {rounds * len(chunks) * n / seconds / 1e9:.2f} GB/s", flush=True)


def plan_time() -> None:
    from napari_tileshard import Dim, Layout, Writer

    layout = Layout([Dim("t", 512, 8, 1), Dim("y", 256, 32, 4), Dim("x", 256, 32, 4)], "uint16")
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/plan.zarr"
        with Writer(path, layout, backend="cpu") as writer:
            writer.append(np.random.default_rng(0).integers(0, 100, (512, 256, 256), dtype=np.uint16))
        reader = ShardReader(path, backend="cpu")
        reader.plan(...)  # every index read once and cached
        for label, selection in (
            ("whole array", ...),
            ("one plane", (100,)),
            ("a crop", (slice(0, 64), slice(10, 200))),
        ):
            best = min(_timed(reader.plan, selection) for _ in range(5))
            plan = reader.plan(selection)
            print(f"{label}: {best * 1e3:.2f} ms, {len(plan.blocks)} shards, {len(plan.reads)} reads")


def fetch_cold(path: str, repeat: int) -> None:
    from bench_read import evict

    from napari_tileshard.reader import fetch

    rates: dict[int, list[float]] = {}
    saved = fetch.WILL_NEED_BYTES
    try:
        for round_ in range(repeat):
            for window in (saved, 0) if round_ % 2 == 0 else (0, saved):
                fetch.WILL_NEED_BYTES = window
                with ShardReader(path, backend="cpu") as reader:
                    plan = reader.plan(...)
                    evict(Path(path))
                    started, total = time.perf_counter(), 0
                    for read, _buffer in reader._fetched(plan.reads):
                        total += read.size
                    rates.setdefault(window, []).append(total / (time.perf_counter() - started) / 1e9)
    finally:
        fetch.WILL_NEED_BYTES = saved
    for window, values in rates.items():
        print(
            f"hinted ahead {window >> 20} MiB: file bytes {statistics.median(values):.2f} GB/s (median), "
            f"{min(values):.2f}-{max(values):.2f} over {len(values)} passes",
            flush=True,
        )


def _timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["engines", "timeline", "host-read", "zstd-threads", "plan", "fetch-cold"])
    parser.add_argument("path", nargs="?")
    parser.add_argument("engines", nargs="?", default="gpu-device,gpu-host,cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.probe == "plan":
        return plan_time()
    if not args.path:
        parser.error(f"{args.probe} needs the path of a recording")
    if args.probe == "engines":
        return engines(args.path, args.engines, args.repeat)
    if args.probe == "fetch-cold":
        return fetch_cold(args.path, args.repeat)
    {"timeline": timeline, "host-read": host_read, "zstd-threads": zstd_threads}[args.probe](args.path)


if __name__ == "__main__":
    main()
