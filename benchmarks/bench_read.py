"""Readback benchmark: ShardReader against tensorstore and zarr-python, whole-array and scrubbing.

One command produces the issue's table (issue 15) on the GPU machine:

    python benchmarks/bench_read.py --out benchmarks/results/read-h100.json

and issue 30's (4 and 16 MiB shards, libzstd's own decode rate beside, the engines measured in
turn three times):

    python benchmarks/bench_read.py --tiles 64k-4m,256k-4m,1m-16m --cpu-ceiling --rounds 3 --out read.json

For each tile size (64 KiB = 8 x 64 x 64, 256 KiB = 8 x 128 x 128, 1 MiB = 32 x 128 x 128) a
recording of ``--gib`` GiB (4 by default; ``--gib 16`` for the large one) of 2048² uint16 frames
from ``SyntheticCamera`` is written by our Writer (zstd level 1, shards of one tile deep x 1024 x
1024 pixels) into ``--shm-dir`` (``/dev/shm``), then copied to ``--disk-dir`` (local disk).  Each
engine reads each copy: the whole array (best of ``--repeat``, fewer when one read takes > 3 s)
and ``--planes`` random single planes ``r[t]`` (median and worst: the napari scrubbing read).

The page cache cannot be dropped here (no root); "disk" rows evict the recording's own pages
with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after an ``fsync`` before every measured read, so the
bytes come from the device, as for a fresh file (``cold_cache`` in the JSON says whether the
kernel honoured it: the pages resident after eviction are counted with ``mincore`` where
available, else not checked).

Engines: tileshard-cpu, tileshard-gpu-host (decoded on the GPU, NumPy out), tileshard-gpu-device
(CuPy out), tensorstore, zarr-python, zarrs (zarr-python with the ``zarrs`` codec pipeline, when
the package is installed).  Engines that cannot run here are reported as skipped.  Requests per
GB are counted for ours (``ShardReader.stats``) and zarr-python (a counting store), for the whole
read and per plane.  On a GPU machine, per tile size: nvCOMP's batched zstd decompress alone on
the chunks of one device batch already on the device (the ceiling of the GPU path) and pinned
H2D bandwidth.

``--isolate``: each engine's measurement runs in a fresh Python process, so that one engine's
allocations do not shape the kernel's free memory for the next (on the 2-core VM NumPy's
huge-page output faulted in after tensorstore's 4 KiB-page reads cost up to 4x the system time).

``--quick``: a 0.25 GiB recording, 256 KiB tiles, /dev/shm only, 8 planes: a smoke test (CPU
rows on a machine without a GPU).  The JSON goes to ``--out``; a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer
from napari_tileshard.format import libzstd

#: tile shapes (t, y, x) by name; shards are one tile deep x 1024 x 1024 pixels, so the shard
#: size follows: 8-deep tiles make 16 MiB shards, 2-deep 4 MiB (issue 30's layouts: "64k-4m",
#: "256k-4m", "1m-16m")
TILES = {
    "64k": (8, 64, 64),
    "256k": (8, 128, 128),
    "1m": (32, 128, 128),
    "64k-4m": (2, 128, 128),
    "256k-4m": (2, 256, 256),
    "1m-16m": (8, 256, 256),
}
ENGINES = ("tileshard-cpu", "tileshard-gpu-host", "tileshard-gpu-device", "tensorstore", "zarr-python", "zarrs")
MAX_REPEAT_SECONDS = 3.0


def write_recording(path: Path, gib: float, tile, backend: str = "auto") -> None:
    """``gib`` of camera frames in ``tile`` tiles, written by ``backend``: on a GPU machine "auto" is
    the GPU backend, whose nvCOMP frames libzstd decodes at about a third of the rate of its own
    level-1 frames (``results/cpu_16core_2026-11-28b/`` call m), so CPU read A/Bs ask for "cpu"."""
    camera = SyntheticCamera((2048, 2048), "uint16")
    frames = int(gib * 2**30 // camera.frame_bytes)
    frames = max(tile[0], frames - frames % tile[0])
    layout = Layout(
        [
            Dim("t", frames, tile[0], 1),
            Dim("y", 2048, tile[1], 1024 // tile[1]),
            Dim("x", 2048, tile[2], 1024 // tile[2]),
        ],
        "uint16",
    )
    shutil.rmtree(path, ignore_errors=True)
    with Writer(path, layout, backend=backend) as writer:
        for i in range(frames):
            writer.append(camera.frame(i))


def _files(path: Path):
    for root, _, names in os.walk(path):
        for name in names:
            yield os.path.join(root, name)


def evict(path: Path) -> dict:
    """Write back and drop the page-cache pages of every file under ``path``; returns how many
    bytes stayed resident (``mincore``, when ``mmap`` can tell) out of how many."""
    total = resident = 0
    checked = hasattr(os, "posix_fadvise")
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
            total += size
            if checked:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            resident += _resident_bytes(fd, size)
        finally:
            os.close(fd)
    return {"bytes": total, "resident_after_evict": resident, "fadvise": checked}


def disk_ceiling(path: Path, threads=(1, 4, 16), block=8 << 20) -> dict:
    """The disk's own read rate on the recording's files: every file read whole, in ``block``
    pieces into reused memory by 1, 4 and 16 threads, its pages evicted before each pass (the
    bound of any engine reading these files from this disk)."""
    files = list(_files(path))
    rates = {}
    for count in threads:
        evict(path)

        def read_file(name: str) -> int:
            buffer = bytearray(block)
            done = 0
            with open(name, "rb", buffering=0) as file:
                while n := file.readinto(buffer):
                    done += n
            return done

        started = time.perf_counter()
        with ThreadPoolExecutor(count) as pool:
            total = sum(pool.map(read_file, files))
        rates[f"threads_{count}"] = round(total / (time.perf_counter() - started) / 1e9, 2)
    with ShardReader(path, backend="cpu") as reader:
        decoded = int(np.prod(reader.shape)) * reader.dtype.itemsize
    best = max(rates.values())
    # engines report decoded bytes per second: the disk's rate in the same unit
    return {
        "disk_read_gbps": rates,
        "best_gbps": best,
        "decoded_equivalent_gbps": round(best * decoded / total, 2),
        "stored_bytes": total,
        "decoded_bytes": decoded,
    }


def _resident_bytes(fd: int, size: int) -> int:
    """Bytes of the file in the page cache (``mincore`` through ctypes), 0 when unknown."""
    if not size:
        return 0
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: a writable buffer for ctypes
        try:
            window = (ctypes.c_char * size).from_buffer(mapped)
            status = libc.mincore(ctypes.c_void_p(ctypes.addressof(window)), ctypes.c_size_t(size), vec)
            del window
        finally:
            mapped.close()
        return sum(v & 1 for v in vec) * mmap.PAGESIZE if status == 0 else 0
    except (OSError, ValueError, TypeError, BufferError):
        return 0


def _zarr_store(path, counter):
    from zarr.storage import LocalStore

    class CountingStore(LocalStore):
        async def get(self, key, prototype=None, byte_range=None):
            counter[0] += 1
            return await super().get(key, prototype, byte_range)

        async def get_partial_values(self, prototype, key_ranges):
            key_ranges = list(key_ranges)
            counter[0] += len(key_ranges)
            return await super().get_partial_values(prototype, key_ranges)

    return CountingStore(path, read_only=True)


def engine_reader(name: str, path: Path):
    """``(read(selection) -> array, requests() -> int or None)`` for engine ``name``; ImportError,
    RuntimeError or ValueError when it cannot run here."""
    if name.startswith("tileshard"):
        backend = "cpu" if name == "tileshard-cpu" else "gpu"
        reader = ShardReader(path, backend=backend)
        device = name == "tileshard-gpu-device"

        def read(selection):
            out = reader.read(selection, device=device)
            if device:
                import cupy

                cupy.cuda.get_current_stream().synchronize()
            return out

        return read, lambda: reader.stats.requests  # data and index requests
    if name == "tensorstore":
        import tensorstore as ts

        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
        return (lambda selection: store[selection].read().result()), lambda: None
    import zarr

    if name == "zarrs":
        import zarrs  # noqa: F401

        zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})
    else:
        zarr.config.set({"codec_pipeline.path": "zarr.core.codec_pipeline.BatchedCodecPipeline"})
    counter = [0]
    array = zarr.open_array(_zarr_store(path, counter), mode="r")
    return (lambda selection: array[selection]), lambda: counter[0]


def measure(name: str, path: Path, planes: int, repeat: int, frames: int, cold: bool) -> dict:
    read, requests = engine_reader(name, path)
    whole, residency = [], []
    for _ in range(repeat):
        if cold:
            residency.append(evict(path)["resident_after_evict"])
        before = requests()
        started = time.perf_counter()
        out = read(...)
        whole.append(time.perf_counter() - started)
        used = requests()
        nbytes = out.nbytes
        del out
        if whole[-1] > MAX_REPEAT_SECONDS:
            break
    if cold:
        residency.append(evict(path)["resident_after_evict"])
    rng = np.random.default_rng(0)
    plane_times = []
    plane_requests = requests()
    for t in rng.integers(0, frames, planes).tolist():
        started = time.perf_counter()
        read((t,))
        plane_times.append(time.perf_counter() - started)
    best = min(whole)
    result = {
        "engine": name,
        "whole_s": round(best, 3),
        "whole_gbps": round(nbytes / best / 1e9, 2),
        "repeats": len(whole),
        "plane_median_ms": round(1e3 * statistics.median(plane_times), 1),
        "plane_worst_ms": round(1e3 * max(plane_times), 1),
    }
    if used is not None and before is not None:
        result["requests_per_gb"] = round((used - before) / (nbytes / 1e9), 1)
        result["requests_per_plane"] = round((requests() - plane_requests) / planes, 1)
    if cold:
        result["resident_bytes_after_evict_max"] = max(residency)
    return result


def gpu_ceilings(path: Path) -> dict:
    """nvCOMP's batched zstd decompress alone on the chunks of the largest device batch of a
    whole read (already on the device: the ceiling of the GPU path), and pinned H2D bandwidth."""
    import cupy

    reader = ShardReader(path, backend="gpu")
    gpu = reader._gpu_reader()
    batch = max(gpu.batches(reader.plan(...)), key=lambda b: b.chunks)
    seconds = gpu.time_decompress(batch)
    host = gpu._fetch(batch)
    device = cupy.empty(batch.staging_bytes, dtype=cupy.uint8)
    device.set(host[: batch.staging_bytes])
    cupy.cuda.runtime.deviceSynchronize()
    started = time.perf_counter()
    for _ in range(5):
        device.set(host[: batch.staging_bytes])
    cupy.cuda.runtime.deviceSynchronize()
    h2d = 5 * batch.staging_bytes / (time.perf_counter() - started) / 1e9
    return {
        "nvcomp_decode_gbps": round(batch.chunks * reader.chunk_bytes / seconds / 1e9, 2),
        "chunks_per_call": batch.chunks,
        "pinned_h2d_gbps": round(h2d, 2),
    }


#: decoded bytes per python-zstandard batch in decode_ceiling: a reader's unit (2-8 MiB); 64 chunks
#: of 1 MiB per call decoded into 64 MiB fresh each time, slower than libzstd is
CEILING_BATCH_BYTES = 4 << 20


def decode_ceiling(path: Path, threads: int) -> dict:
    """libzstd's decode rate on the array's own chunks: one thread, then ``threads`` threads each
    decoding a share at once, and ``ceiling`` = ``threads`` x the one-thread rate (issue 30's
    limit for the CPU path); each the faster of two ways: one ``decompress`` call per chunk (a
    context reused, the output dropped: its memory reused, but the GIL taken back after every
    chunk, which with 16 threads and 64 KiB chunks measures the GIL) and python-zstandard's
    ``multi_decompress_to_buffer`` on ``CEILING_BATCH_BYTES`` of chunks per call (the GIL
    released for each, as the readers decode; per-way rates in ``ways``)."""
    from concurrent.futures import ThreadPoolExecutor

    import zstandard

    reader = ShardReader(path, backend="cpu")
    plan = reader.plan(...)
    frames = []
    for read, buffer in reader._fetched(plan.reads):
        data = bytes(buffer)
        frames += [data[o : o + n] for o, n in zip(read.offsets.tolist(), read.nbytes.tolist())]
    reader.close()
    chunk_bytes = reader.chunk_bytes
    decoded = len(frames) * chunk_bytes
    per_call = max(1, CEILING_BATCH_BYTES // chunk_bytes)
    batches = []
    for first in range(0, len(frames), per_call):
        part = frames[first : first + per_call]
        lengths = np.array([len(f) for f in part], dtype=np.uint64)
        segments = np.stack([np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64), lengths], axis=1)
        batches.append((b"".join(part), segments.tobytes(), np.full(len(part), chunk_bytes, np.uint64).tobytes()))

    def per_chunk(share) -> None:
        context = zstandard.ZstdDecompressor()
        for frame in share:
            context.decompress(frame)

    def batched(share) -> None:
        context = zstandard.ZstdDecompressor()
        for blob, segments, sizes in share:
            context.multi_decompress_to_buffer(
                zstandard.BufferWithSegments(blob, segments), decompressed_sizes=sizes, threads=1
            )

    decoder = libzstd.frame_decoder()
    frame_runs = [(np.frombuffer(blob, np.uint8), len(sizes) // 8 * chunk_bytes) for blob, _, sizes in batches]

    def libzstd_batched(share) -> None:  # the reader's own decoder: one call per batch, a reused buffer
        assert decoder is not None
        out = np.empty(per_call * chunk_bytes, np.uint8)
        for source, nbytes in share:
            if decoder.decode_frames(source.ctypes.data, source.nbytes, out.ctypes.data, nbytes) != nbytes:
                raise RuntimeError("libzstd refused the array's chunks")

    runs = [("per_chunk", per_chunk, frames), ("batched", batched, batches)]
    if decoder is not None:
        runs.append(("libzstd", libzstd_batched, frame_runs))
    ways = {}
    with ThreadPoolExecutor(threads) as pool:
        for name, decode, items in runs:
            one = min(_timed(functools.partial(decode, items)) for _ in range(2))
            shares = [items[k::threads] for k in range(threads)]
            many = min(_timed(functools.partial(_all_done, pool.map, decode, shares)) for _ in range(2))
            ways[name] = {"1thread_gbps": round(decoded / one / 1e9, 2), "all_gbps": round(decoded / many / 1e9, 2)}
    one_best = max(w["1thread_gbps"] for w in ways.values())
    return {
        "zstd_1thread_gbps": one_best,
        f"zstd_{threads}threads_gbps": max(w["all_gbps"] for w in ways.values()),
        "ceiling_gbps": round(threads * one_best, 2),
        "threads": threads,
        "ways": ways,
    }


def pipeline_ceiling(path: Path, threads: int, place_bytes: int = 0, mapped: bool = False) -> dict:
    """What a whole read costs with no reader around it: ``threads`` threads each taking whole
    shards in turn, and per shard its bytes read from the file (``os.preadv``, the descriptor
    opened beforehand), every chunk decoded in one python-zstandard batch (the GIL released) and
    the chunks placed into a touched output array by one strided NumPy copy, with no plan, no
    checks and no task machinery (a few Python calls per shard).  The work any reader of the
    array must do (the bytes out of the page cache, decoded, placed), as fast as libzstd, the
    kernel and NumPy do it on this host: ``pipeline_gbps`` (best of 2).  ``{}`` where a shard is
    not one read of all its chunks in box order or not whole (the layouts here all are).

    Variants (how far a reader's own work could go): ``place_bytes``: a shard's chunks decoded
    and placed in batches of about that many decoded bytes (sub-boxes in box order), each placed
    while still in the CPU's caches, instead of the whole shard decoded and then placed;
    ``mapped``: the shard's bytes decoded straight from a read-only ``mmap`` of the file (its pages
    populated at the map, unmapped after), not copied out of the page cache first."""
    import mmap
    import threading

    import zstandard

    from napari_tileshard.format import codecs
    from napari_tileshard.reader.cpu import unit_boxes

    reader = ShardReader(path, backend="cpu")
    plan = reader.plan(...)
    chunk_shape, chunk_bytes, ndim = reader.chunk_shape, reader.chunk_bytes, len(reader.chunk_shape)
    out = np.zeros(plan.shape, dtype=reader.dtype)  # touched, as the output pool's memory
    reads_of: list[list] = [[] for _ in plan.blocks]
    for read in plan.reads:
        reads_of[read.block].append(read)
    order = [axis for d in range(ndim) for axis in (d, ndim + d)]
    jobs, descriptors = [], []
    for block, reads in zip(plan.blocks, reads_of):
        box = tuple(block.box_shape)
        if len(reads) != 1 or not np.array_equal(reads[0].slots, np.arange(block.box_chunks.size)):
            return {}
        if tuple(block.shape) != tuple(b * c for b, c in zip(box, chunk_shape)):
            return {}
        read = reads[0]
        fd = os.open(os.path.join(str(path), read.key), os.O_RDONLY)
        descriptors.append(fd)
        whole = out[block.region]
        rows = max(1, place_bytes // chunk_bytes) if place_bytes else block.box_chunks.size
        batches = []
        for (first, stop), ranges in unit_boxes(box, rows):
            count = stop - first
            offsets, nbytes = read.offsets[first:stop], read.nbytes[first:stop]
            segments = np.empty((count, 2), dtype=np.uint64)
            segments[:, 0] = offsets
            segments[:, 1] = codecs._one_buffer_lengths(offsets, nbytes, read.size, count * chunk_bytes)
            shape = tuple(hi - lo for lo, hi in ranges)
            target = whole[tuple(slice(lo * c, hi * c) for (lo, hi), c in zip(ranges, chunk_shape))]
            target = target.reshape([n for b, c in zip(shape, chunk_shape) for n in (b, c)])
            batches.append((segments.tobytes(), count, target, shape, int(offsets[0]), int(offsets[-1] + nbytes[-1])))
        jobs.append((fd, read.start, read.size, batches))
    sizes: dict[int, bytes] = {}
    for *_, batches in jobs:
        for _, count, *_ in batches:
            sizes.setdefault(count, np.full(count, chunk_bytes, dtype=np.uint64).tobytes())
    local = threading.local()
    populate = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

    decoder = libzstd.frame_decoder()  # the reader's: libzstd's own where found
    most = max(count for *_, batches in jobs for _, count, *_ in batches)

    def decode(view, segments: bytes, count: int, begin: int, end: int) -> np.ndarray:
        if decoder is None:
            decoded = local.context.multi_decompress_to_buffer(
                zstandard.BufferWithSegments(view, segments), decompressed_sizes=sizes[count], threads=1
            )
            [(_, chunks)] = codecs._runs(decoded, count, chunk_bytes)
            return chunks
        address = np.frombuffer(view, np.uint8).ctypes.data + begin
        chunks = local.chunks[: count * chunk_bytes]
        if decoder.decode_frames(address, end - begin, chunks.ctypes.data, chunks.nbytes) != chunks.nbytes:
            raise RuntimeError("libzstd refused the array's chunks")
        return chunks.reshape(count, chunk_bytes)

    def one(job) -> None:
        fd, start, size, batches = job
        if not hasattr(local, "context"):
            local.context = zstandard.ZstdDecompressor()
            local.buffer = None if mapped else np.zeros(max(size, 64 << 20), np.uint8)
            local.chunks = np.zeros(most * chunk_bytes, np.uint8)
        mapping = None
        if mapped:
            head = start % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, size + head, flags=populate, prot=mmap.PROT_READ, offset=start - head)
            view = memoryview(mapping)[head : head + size]
        else:
            view = local.buffer[:size]
            os.preadv(fd, [view], start)
        try:
            for segments, count, target, shape, begin, end in batches:
                chunks = decode(view, segments, count, begin, end)
                np.copyto(target, chunks.view(reader.dtype).reshape(shape + tuple(chunk_shape)).transpose(order))
                del chunks
        finally:
            if mapping is not None:
                view.release()
                mapping.close()

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs[: threads * 2]))  # each thread's buffer and context made
            best = min(_timed(lambda: list(pool.map(one, jobs))) for _ in range(2))
        exact = bool(np.array_equal(out, reader.read()))  # what it placed is the array
    finally:
        for fd in descriptors:
            os.close(fd)
        reader.close()
    return {
        "pipeline_gbps": round(out.nbytes / best / 1e9, 2),
        "pipeline_exact": exact,
        "pipeline_decoder": "python-zstandard" if decoder is None else f"libzstd ({decoder.origin})",
    }


def measure_isolated(name: str, path: Path, planes: int, repeat: int, cold: bool) -> dict:
    """:func:`measure` in a fresh Python process (``--isolate``); RuntimeError with its reason
    when the engine cannot run there."""
    command = [sys.executable, __file__, "--out", os.devnull, "--path", str(path), "--measure-one", name]
    command += ["--planes", str(planes), "--repeat", str(repeat)] + ["--measure-cold"] * cold
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} in a fresh process failed: {done.stderr.strip()[-500:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if "skipped" in row:
        raise RuntimeError(row["skipped"])
    return row


def _all_done(run_map, work, items) -> None:
    list(run_map(work, items))


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def table(results: dict) -> str:
    """The issue's table, in Markdown, from the JSON results."""
    lines = [
        "| tile | where | engine | whole GB/s | ÷ tensorstore | plane median / worst ms | req/GB | req/plane |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        ts = next((r["whole_gbps"] for r in run["engines"] if r["engine"] == "tensorstore"), None)
        for row in run["engines"]:
            ratio = f"{row['whole_gbps'] / ts:.2f}×" if ts else "–"
            lines.append(
                f"| {run['tile']} | {run['where']} | {row['engine']} | {row['whole_gbps']} | {ratio} | "
                f"{row['plane_median_ms']} / {row['plane_worst_ms']} | {row.get('requests_per_gb', '–')} | "
                f"{row.get('requests_per_plane', '–')} |"
            )
        cpu = run.get("cpu_ceiling")
        if cpu:
            ours = next((r["whole_gbps"] for r in run["engines"] if r["engine"] == "tileshard-cpu"), None)
            share = f", tileshard-cpu = {ours / cpu['ceiling_gbps']:.0%} of it" if ours else ""
            measured = cpu[f"zstd_{cpu['threads']}threads_gbps"]
            lines.append(
                f"| {run['tile']} | {run['where']} | libzstd ceiling ({cpu['threads']} x {cpu['zstd_1thread_gbps']}) | "
                f"{cpu['ceiling_gbps']}{share}; {cpu['threads']} threads measured {measured} | | | | |"
            )
        disk = run.get("disk_ceiling")
        if disk:
            lines.append(
                f"| {run['tile']} | {run['where']} | the disk alone (files read whole, evicted) | "
                f"{disk['decoded_equivalent_gbps']} decoded ({disk['best_gbps']} of file bytes; "
                f"{disk['disk_read_gbps']}) | | | | |"
            )
        ceiling = run.get("gpu_ceilings")
        if ceiling:
            device = next((r["whole_gbps"] for r in run["engines"] if r["engine"] == "tileshard-gpu-device"), None)
            share = f", GPU→device = {device / ceiling['nvcomp_decode_gbps']:.0%} of it" if device else ""
            lines.append(
                f"| {run['tile']} | {run['where']} | nvCOMP ceiling ({ceiling['chunks_per_call']} chunks/call) | "
                f"{ceiling['nvcomp_decode_gbps']}{share}; pinned H2D {ceiling['pinned_h2d_gbps']} | | | | |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON results file")
    parser.add_argument("--path", type=Path, help="read this existing array instead of writing recordings")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--tiles", default="64k,256k,1m")
    parser.add_argument("--where", default="shm,disk", help="shm, disk or both")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm/tileshard-read"))
    parser.add_argument("--disk-dir", type=Path, default=Path("/var/tmp/tileshard-read"))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--planes", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the recordings")
    parser.add_argument("--quick", action="store_true", help="0.25 GiB, 256 KiB tiles, shm, 8 planes")
    parser.add_argument(
        "--cpu-ceiling", action="store_true", help="libzstd's decode rate on the same chunks (1 thread, all cores)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the engines this many times in turn (A B A B ...), keeping each one's best: "
        "on a shared machine the ratios then come from the same minutes",
    )
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="measure each engine in a fresh process: one engine's allocations do not shape the "
        "kernel's memory for the next (on the 2-core VM, huge-page faults after tensorstore's reads "
        "cost ours up to 4x the system time)",
    )
    parser.add_argument("--measure-one", help=argparse.SUPPRESS)  # --isolate's child: one engine, one JSON row
    parser.add_argument("--measure-cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_one:
        frames = ShardReader(args.path, backend="cpu").shape[0]
        try:
            row = measure(args.measure_one, args.path, args.planes, args.repeat, frames, cold=args.measure_cold)
        except (ImportError, RuntimeError, ValueError) as exc:
            row = {"skipped": str(exc)}
        print(json.dumps(row))
        return 0
    if args.quick:
        args.gib, args.tiles, args.where, args.planes = 0.25, "256k", "shm", 8
    shm = args.shm_dir if args.shm_dir.parent.exists() else Path("/tmp/tileshard-read-shm")
    results: dict = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "command": " ".join(sys.argv),
        "gib": args.gib,
        "note": "disk rows: pages evicted with posix_fadvise(DONTNEED) after fsync before each measured read",
        "runs": [],
    }
    started_all = time.perf_counter()
    for tile in [None] if args.path else args.tiles.split(","):
        places = []
        if args.path:
            places.append(("given", args.path))
        else:
            source = shm / f"{tile}.zarr"
            started = time.perf_counter()
            write_recording(source, args.gib, TILES[tile])
            print(f"wrote {source} in {time.perf_counter() - started:.1f} s", flush=True)
            if "shm" in args.where:
                places.append(("shm", source))
            if "disk" in args.where:
                target = args.disk_dir / f"{tile}.zarr"
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(source, target)
                places.append(("disk", target))
                if "shm" not in args.where:
                    shutil.rmtree(source, ignore_errors=True)
        for where, path in places:
            frames = ShardReader(path, backend="cpu").shape[0]
            run = {"tile": tile or "given", "where": where, "path": str(path), "engines": []}
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for name in args.engines.split(","):
                    if name in run.get("skipped", {}):
                        continue
                    try:
                        if args.isolate:
                            row = measure_isolated(name, path, args.planes, args.repeat, where == "disk")
                        else:
                            row = measure(name, path, args.planes, args.repeat, frames, cold=where == "disk")
                    except (ImportError, RuntimeError, ValueError) as exc:
                        print(f"{tile} {where} {name}: skipped ({exc})", flush=True)
                        run.setdefault("skipped", {})[name] = str(exc)
                        continue
                    print(json.dumps({"tile": tile, "where": where, **row}), flush=True)
                    rounds = best.get(name, {}).get("rounds", []) + [row["whole_gbps"]]
                    if name not in best or row["whole_gbps"] > best[name]["whole_gbps"]:
                        best[name] = row
                    best[name]["rounds"] = rounds
            run["engines"] = list(best.values())
            if where == "disk":
                run["disk_ceiling"] = disk_ceiling(path)
                print(json.dumps(run["disk_ceiling"]), flush=True)
            if args.cpu_ceiling:
                run["cpu_ceiling"] = decode_ceiling(path, os.cpu_count() or 1)
                print(json.dumps(run["cpu_ceiling"]), flush=True)
            if any(e.startswith("tileshard-gpu") for e in args.engines.split(",")):
                try:
                    run["gpu_ceilings"] = gpu_ceilings(path)
                    print(json.dumps(run["gpu_ceilings"]), flush=True)
                except (ImportError, RuntimeError, ValueError) as exc:
                    print(f"GPU ceilings: skipped ({exc})", flush=True)
            results["runs"].append(run)
            if not args.keep and where != "given":
                shutil.rmtree(path, ignore_errors=True)
    results["seconds"] = round(time.perf_counter() - started_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"total {results['seconds']} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
