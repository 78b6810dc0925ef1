"""The CPU paths against tensorstore and libzstd on a many-core host, in one call: every layout of
the CPU table (writes and whole-array reads), per-stage CPU seconds per GB, ratios from the same
rounds.

For each layout (2048² uint16 frames of ``SyntheticCamera``, zstd level 1, stores in ``--dir``,
``/dev/shm`` by default):

* **write**: ``Writer(backend="cpu")`` against tensorstore (frames gathered into shard-epoch
  slabs, as ``bench_write.py``'s harness), ``--gib`` per run, the user's clock (``Writer()`` /
  ``ts.open`` to ``close()``); ours split by stage from each thread's CPU time
  (``/proc/self/task``): ``append`` (the caller's thread and the staging copy's helpers),
  ``tile`` / ``compress`` (timed inside the encode threads), ``encode-other``, ``collect``,
  ``write`` (the I/O threads), ``close``; tensorstore split into the caller's slab copy and its
  own threads.  Beside them libzstd level 1 on the same tiles, contiguous in memory: one thread,
  and ``--threads`` threads at once (each compressing its share, the GIL released); and the bare
  pipeline every writer must run, shard by shard on ``--threads`` threads: tiles cut out of
  frames in memory, compressed in one batch, written as a shard file, no writer around it
  (``write_pipeline``), with ours and tensorstore as fractions of it.
* **read**: the whole array by ``ShardReader(backend="cpu")`` and by tensorstore; ours split into
  ``plan`` (the caller's thread: plan, orchestration), ``fetch`` (the store reads, timed where they run),
  ``decode`` and ``untile`` (timed inside the decode threads), ``decode-other``; the first read
  (fresh output memory) apart from the later ones (the output pool's memory); libzstd's decode of
  the same chunks, one thread and ``--threads`` threads at once (``bench_read.decode_ceiling``),
  and the bare pipeline every reader must run, shard by shard on ``--threads`` threads: the bytes
  out of the page cache, decoded in one GIL-free batch, placed by one copy, no reader around it
  (``bench_read.pipeline_ceiling``), with ours and tensorstore as fractions of it.

Engines take turns (``--rounds``, the order rotating) and ours ÷ tensorstore is taken within
each round: medians and ranges over the rounds; libzstd alone is measured once per layout, after
the first round, and each round's rate of ours is divided by it.
Issue 37's target 1: ours ≥ 1.0x tensorstore for every layout, reads and writes, and ≥ 90 % of
libzstd's rate with all threads (decode for reads, level-1 compress for writes).

On the GPU machine's host (16 cores), one call, about 6-8 minutes at the defaults (4 GiB per
run, 3 rounds, 4 layouts; the 1-thread decode pass over each 4 GiB recording is ~20 s of it):

    python benchmarks/cpu_many_cores.py --out cpu-16core.json

Here (2 cores), a smoke run of every code path in about 2 minutes:

    python benchmarks/cpu_many_cores.py --quick --out /tmp/cpu-quick.json

``--disk DIR`` also reads each recording from ``DIR`` (a local disk) with its pages evicted before
every read (``posix_fadvise(DONTNEED)`` after ``fsync``), beside the disk's own read rate of the
same files measured the same way by 1, 4 and ``--threads`` threads (stored bytes per second; times
the compression ratio, decoded bytes): issue 37's target 3 takes each read against the best of
them, or the in-memory read of the same layout where that is lower.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_read import CEILING_BATCH_BYTES, decode_ceiling, disk_ceiling, evict, pipeline_ceiling  # noqa: E402
from bench_write import tensorstore_spec, write_in_slabs  # noqa: E402
from cpu_stages import StageClock, stage_seconds, thread_cpu_seconds  # noqa: E402
from zstd_ceiling import contiguous_tiles  # noqa: E402

from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer  # noqa: E402
from napari_tileshard.format.codecs import Raw  # noqa: E402
from napari_tileshard.format.shard_spec import ShardSpec  # noqa: E402
from napari_tileshard.reader import cpu as cpu_reader  # noqa: E402

FRAME = (2048, 2048)


def layouts() -> dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """The CPU table's layouts: name -> (tile shape, tiles per shard)."""
    default = Layout.default_for((0, *FRAME), "uint16")
    return {
        "64k-4m": ((2, 128, 128), (1, 8, 8)),  # 64 KiB tiles 2 x 128², 4 MiB shards
        "256k-4m": ((2, 256, 256), (1, 4, 4)),  # 256 KiB tiles 2 x 256², 4 MiB shards
        "1m-16m": ((8, 256, 256), (1, 4, 4)),  # 1 MiB tiles 8 x 256², 16 MiB shards
        "default": (default.tile_shape, tuple(d.tiles_per_shard for d in default.dims)),
    }


def make_layout(tile, per_shard, frames: int = 0) -> Layout:
    return Layout([Dim(n, s, t, k) for n, s, t, k in zip("tyx", (frames, *FRAME), tile, per_shard)], "uint16")


def gigabytes(frames: int) -> float:
    return frames * FRAME[0] * FRAME[1] * 2 / 1e9


# -- writes ------------------------------------------------------------------------------
def write_ours(camera, layout: Layout, frames: int, out: Path) -> dict:
    """One ``Writer(backend="cpu")`` run: GB/s on the user's clock, CPU-s/GB, per stage."""
    return stage_seconds(camera, frames, layout, out, level=1, user_clock=True)


def write_tensorstore(camera, layout: Layout, frames: int, out: Path) -> dict:
    """The same frames through tensorstore (shard-epoch slabs), same clock."""
    import tensorstore as ts

    shutil.rmtree(out, ignore_errors=True)
    bounded = make_layout(layout.tile_shape, tuple(d.tiles_per_shard for d in layout.dims), frames)
    main = threading.main_thread().native_id
    before = thread_cpu_seconds().get(main, 0.0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    kvstore = {"driver": "file", "path": str(out)}
    spec = tensorstore_spec(kvstore, [frames, *FRAME], bounded.shard_shape, bounded.tile_shape, level=1)
    write_in_slabs(ts.open(spec).result(), camera, frames, bounded.shard_epoch_rows)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    caller = thread_cpu_seconds().get(main, 0.0) - before
    shutil.rmtree(out, ignore_errors=True)
    gb = gigabytes(frames)
    stages = {"append": caller / gb, "tensorstore": (cpu - caller) / gb}
    return {"gbps": gb / wall, "cpu_s_per_gb": cpu / gb, "stages": stages}


def sample_tiles(camera, tile, sample_bytes: int) -> np.ndarray:
    """Tiles of about ``sample_bytes`` of the camera's frames, one per row of uint8."""
    return contiguous_tiles(camera, max(tile[0], sample_bytes // camera.frame_bytes), tile)


def compress_ceiling(camera, tile, threads: int, sample_bytes: int) -> dict:
    """libzstd level 1 on the same tiles: one thread, and ``threads`` threads at once (each its
    share, one ``multi_compress_to_buffer`` call per ``CEILING_BATCH_BYTES`` of tiles, as a
    writer's box: the GIL released), best of 2."""
    tiles = sample_tiles(camera, tile, sample_bytes)
    count, nbytes = tiles.shape
    per_call = max(1, CEILING_BATCH_BYTES // nbytes)

    def compress(rows: range) -> None:
        compressor = zstandard.ZstdCompressor(level=1)
        for first in range(rows.start, rows.stop, per_call):
            part = tiles[first : min(first + per_call, rows.stop)]
            segments = np.empty((len(part), 2), dtype=np.uint64)
            segments[:, 0] = np.arange(len(part), dtype=np.uint64) * np.uint64(nbytes)
            segments[:, 1] = nbytes
            compressor.multi_compress_to_buffer(zstandard.BufferWithSegments(part, segments.tobytes()), threads=1)

    one = min(_timed(lambda: compress(range(count))) for _ in range(2))
    shares = [range(count * k // threads, count * (k + 1) // threads) for k in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        many = min(_timed(lambda: list(pool.map(compress, shares))) for _ in range(2))
    return {
        "zstd_1thread_gbps": tiles.nbytes / one / 1e9,
        f"zstd_{threads}threads_gbps": tiles.nbytes / many / 1e9,
        "threads": threads,
    }


def write_pipeline(camera, tile, per_shard, threads: int, sample_bytes: int, out: Path) -> dict:
    """The bare pipeline every writer of these shards must run, on ``threads`` threads with no
    writer around it: per shard (one task each, taken in turn) its tiles cut out of frames
    already in memory (one strided NumPy copy into the thread's tile buffer), compressed in one
    GIL-free libzstd batch (level 1), and written as a shard file (chunks and index, one
    ``writev``) into ``out`` (the store's file system).  Input GB/s, best of 2: the rate the
    work itself allows on this host (no caller's copy of frames, no metadata, no ordering)."""
    frames_per_epoch = tile[0] * per_shard[0]
    frames = max(frames_per_epoch, sample_bytes // camera.frame_bytes // frames_per_epoch * frames_per_epoch)
    stack = np.stack(list(camera.frames(frames)))
    shard = [t * k for t, k in zip(tile, per_shard)]
    count = per_shard[0] * per_shard[1] * per_shard[2]
    tile_bytes = tile[0] * tile[1] * tile[2] * stack.itemsize
    regions = [
        (e, y, x)
        for e in range(frames // shard[0])
        for y in range(FRAME[0] // shard[1])
        for x in range(FRAME[1] // shard[2])
    ]
    segments = np.empty((count, 2), dtype=np.uint64)
    segments[:, 0] = np.arange(count, dtype=np.uint64) * np.uint64(tile_bytes)
    segments[:, 1] = tile_bytes
    segments_bytes = segments.tobytes()
    # the shard index as the Writer encodes it (entries and their CRC32C)
    encode_index = ShardSpec.from_layout(make_layout(tile, per_shard), Raw()).encode_entries
    local = threading.local()
    out.mkdir(parents=True, exist_ok=True)

    def one(region) -> None:
        e, y, x = region
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = np.zeros((count, tile_bytes // stack.itemsize), stack.dtype)
            local.compressor = zstandard.ZstdCompressor(level=1)
        part = stack[tuple(slice(i * n, (i + 1) * n) for i, n in zip((e, y, x), shard))]
        lifted = part.reshape(per_shard[0], tile[0], per_shard[1], tile[1], per_shard[2], tile[2])
        np.copyto(buffer.reshape(per_shard + tuple(tile)), lifted.transpose(0, 2, 4, 1, 3, 5))
        batch = zstandard.BufferWithSegments(buffer, segments_bytes)
        chunks = local.compressor.multi_compress_to_buffer(batch, threads=1)
        pieces = [chunks[i] for i in range(count)]
        sizes = np.fromiter((len(c) for c in pieces), dtype=np.uint64, count=count)
        index = encode_index(np.stack([np.cumsum(sizes) - sizes, sizes], axis=1))  # offsets, sizes
        fd = os.open(out / f"{e}.{y}.{x}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.writev(fd, [*pieces, index])
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, regions[: threads * 2]))  # each thread's buffer and compressor made
            best = min(_timed(lambda: list(pool.map(one, regions))) for _ in range(2))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"pipeline_gbps": stack.nbytes / best / 1e9}


# -- reads -------------------------------------------------------------------------------
def write_recording(camera, layout: Layout, frames: int, path: Path, backend: str = "cpu") -> None:
    shutil.rmtree(path, ignore_errors=True)
    with Writer(path, layout, codec="zstd", level=1, backend=backend) as writer:
        for frame in camera.frames(frames):
            writer.append(frame)


def read_ours(path: Path, repeat: int) -> dict:
    """Whole reads by one ``ShardReader(backend="cpu")``: the first (fresh output memory) and the
    best of the next ``repeat - 1`` (the pool's memory), with CPU-s/GB per stage of the best."""
    clock = StageClock()
    clock.wrap(cpu_reader.BlockSource, "decode", "decode")
    clock.wrap(cpu_reader.BlockSource, "decoded_released", "decode")  # the batch into its own memory
    clock.wrap(cpu_reader, "untile_into", "untile")
    clock.wrap(ShardReader, "_fetch", "fetch")  # on the prefetch threads, or in the decode tasks
    groups = {"MainThread": "plan", "tileshard-read": "prefetch-threads", "tileshard-decode": "decode-threads"}
    rows = []
    try:
        with ShardReader(path, backend="cpu") as reader:
            for _ in range(max(2, repeat)):
                clock.seconds.clear()
                before = thread_cpu_seconds()
                cpu0, wall0 = time.process_time(), time.perf_counter()
                out = reader.read()
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                per_group: dict[str, float] = collections.defaultdict(float)
                names = {t.native_id: t.name for t in threading.enumerate()}
                for tid, seconds in thread_cpu_seconds().items():
                    group = next((g for p, g in groups.items() if names.get(tid, "").startswith(p)), "other")
                    per_group[group] += seconds - before.get(tid, 0.0)
                gb = out.nbytes / 1e9
                del out
                # reads fetched in the decode tasks count as fetch, not as the decode threads' other work
                fetch_in_tasks = max(0.0, clock.seconds["fetch"] - per_group["prefetch-threads"])
                stages = {
                    "plan": per_group["plan"],
                    "fetch": per_group["prefetch-threads"] + fetch_in_tasks,
                    "decode": clock.seconds["decode"],
                    "untile": clock.seconds["untile"],
                    "decode-other": per_group["decode-threads"]
                    - clock.seconds["decode"]
                    - clock.seconds["untile"]
                    - fetch_in_tasks,
                }
                rows.append(
                    {"gbps": gb / wall, "cpu_s_per_gb": cpu / gb, "stages": {k: v / gb for k, v in stages.items()}}
                )
    finally:
        clock.restore()
    best = max(rows[1:], key=lambda r: r["gbps"])
    return dict(best, first_gbps=rows[0]["gbps"], first_cpu_s_per_gb=rows[0]["cpu_s_per_gb"])


def read_tensorstore(path: Path, repeat: int) -> dict:
    import tensorstore as ts

    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
    rows = []
    for _ in range(max(2, repeat)):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        out = store.read().result()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        gb = out.nbytes / 1e9
        del out
        rows.append({"gbps": gb / wall, "cpu_s_per_gb": cpu / gb})
    best = max(rows[1:], key=lambda r: r["gbps"])
    return dict(best, first_gbps=rows[0]["gbps"], first_cpu_s_per_gb=rows[0]["cpu_s_per_gb"])


def disk_rates(path: Path, threads: int) -> dict:
    """The disk's own read rate of the files under ``path`` (pages evicted before each pass), by
    1, 4 and ``threads`` threads (``bench_read.disk_ceiling``: stored bytes per second), its best
    also in decoded bytes per second (not rounded: each read is divided by it)."""
    limits = disk_ceiling(path, threads=sorted({1, 4, threads}))
    limits["decoded_equivalent_gbps"] = limits["best_gbps"] * limits["decoded_bytes"] / limits["stored_bytes"]
    return limits


def read_cold(engine: str, path: Path) -> dict:
    """One whole read with the recording's pages evicted first."""
    evict(path)
    if engine == "ours":
        with ShardReader(path, backend="cpu") as reader:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            out = reader.read()
    else:
        import tensorstore as ts

        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        out = store.read().result()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    gb = out.nbytes / 1e9
    return {"gbps": gb / wall, "cpu_s_per_gb": cpu / gb}


# -- tables --------------------------------------------------------------------------------
def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})" if values else "-"


def summarise(rounds: list[dict], ceiling_key: str, ceiling_rounds: list[dict]) -> dict:
    """Medians of each engine over the rounds and the per-round ratios."""
    ours = [r["ours"] for r in rounds]
    theirs = [r["tensorstore"] for r in rounds if "tensorstore" in r]
    summary: dict = {
        "ours_gbps": statistics.median(r["gbps"] for r in ours),
        "ours_cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in ours),
        "ours_stages": {k: statistics.median(r["stages"][k] for r in ours) for k in ours[0]["stages"]},
        "ours_vs_ts": [a["ours"]["gbps"] / a["tensorstore"]["gbps"] for a in rounds if "tensorstore" in a],
    }
    if "first_gbps" in ours[0]:
        summary["ours_first_gbps"] = statistics.median(r["first_gbps"] for r in ours)
    if theirs:
        summary["ts_gbps"] = statistics.median(r["gbps"] for r in theirs)
        summary["ts_cpu_s_per_gb"] = statistics.median(r["cpu_s_per_gb"] for r in theirs)
        keys = theirs[0].get("stages", {})
        summary["ts_stages"] = {k: statistics.median(r["stages"][k] for r in theirs) for k in keys}
        if "first_gbps" in theirs[0]:
            summary["ts_first_gbps"] = statistics.median(r["first_gbps"] for r in theirs)
    if ceiling_rounds:
        summary["zstd_1thread_gbps"] = statistics.median(c["zstd_1thread_gbps"] for c in ceiling_rounds)
        summary["zstd_all_gbps"] = statistics.median(c[ceiling_key] for c in ceiling_rounds)
        summary["ours_vs_zstd_all"] = [r["ours"]["gbps"] / summary["zstd_all_gbps"] for r in rounds]
        if all("pipeline_gbps" in c for c in ceiling_rounds):
            summary["pipeline_gbps"] = statistics.median(c["pipeline_gbps"] for c in ceiling_rounds)
            summary["pipeline_exact"] = all(c.get("pipeline_exact", True) for c in ceiling_rounds)
            summary["ours_vs_pipeline"] = [r["ours"]["gbps"] / summary["pipeline_gbps"] for r in rounds]
            summary["ts_vs_pipeline"] = [
                r["tensorstore"]["gbps"] / summary["pipeline_gbps"] for r in rounds if "tensorstore" in r
            ]
    return summary


def table(results: dict) -> str:
    lines = [
        "| path | layout | ours GB/s | tensorstore GB/s | ours ÷ ts, median (range) "
        "| libzstd 1 thread / all threads GB/s (disk: its read rates; the limit: the best in decoded bytes, "
        "or the in-memory rate if lower) | ours ÷ that "
        "| CPU-s/GB ours (stages) | CPU-s/GB tensorstore | the bare pipeline GB/s, ours / ts ÷ it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("write", "read", "read-disk"):
        for name, s in results.get(kind, {}).items():
            stages = " / ".join(f"{k} {v:.2f}" for k, v in s["ours_stages"].items()) if "ours_stages" in s else ""
            if kind == "read-disk":  # the disk's rate where libzstd's stands
                rates = " / ".join(f"{v:.2f}" for v in s["disk_gbps"].values())
                threads = " / ".join(k.removeprefix("threads_") for k in s["disk_gbps"])
                ceiling = (
                    f"disk {rates} ({threads} threads, stored bytes; x{s['compression_ratio']:.2f} decoded, "
                    f"limit {statistics.median(s['limit_gbps']):.2f})"
                )
                limit = f"{spread(s['ours_vs_disk'])} (ts {spread(s['ts_vs_disk'])})"
            else:
                ceiling = f"{s['zstd_1thread_gbps']:.2f} / {s['zstd_all_gbps']:.2f}" if "zstd_all_gbps" in s else "-"
                limit = spread(s.get("ours_vs_zstd_all", []))
            lines.append(
                f"| {kind} | {name} | {s['ours_gbps']:.2f} | {s.get('ts_gbps', float('nan')):.2f} | "
                f"{spread(s.get('ours_vs_ts', []))} | {ceiling} | {limit} | "
                f"{s['ours_cpu_s_per_gb']:.2f} ({stages}) | {s.get('ts_cpu_s_per_gb', float('nan')):.2f} | "
                + (
                    f"{s['pipeline_gbps']:.2f}{'' if s['pipeline_exact'] else ' (NOT EXACT)'}, "
                    f"{spread(s['ours_vs_pipeline'])} / {spread(s['ts_vs_pipeline'])} |"
                    if "pipeline_gbps" in s
                    else "- |"
                )
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON of every round")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB per write run and per recording read")
    parser.add_argument("--layouts", default=",".join(layouts()))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3, help="whole reads per engine per round (first + best)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="libzstd's threads at once")
    parser.add_argument("--sample-mib", type=int, default=512, help="tiles for libzstd's compress rate")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/tileshard-many-cores"))
    parser.add_argument("--disk", type=Path, help="also read each recording from this local disk, cold")
    parser.add_argument("--no-writes", action="store_true")
    parser.add_argument("--no-reads", action="store_true")
    parser.add_argument("--no-tensorstore", action="store_true")
    parser.add_argument("--quick", action="store_true", help="0.125 GiB, 2 rounds, 32 MiB samples: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.gib, args.rounds, args.sample_mib = 0.125, 2, 32
    shapes = layouts()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in shapes]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; known: {', '.join(shapes)}")
    camera = SyntheticCamera(FRAME, "uint16", seed=0)
    camera.prepare()
    args.dir.mkdir(parents=True, exist_ok=True)
    engines = ["ours"] + ([] if args.no_tensorstore else ["tensorstore"])
    results: dict = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(sys.argv),
        "gib": args.gib,
        "rounds": args.rounds,
        "write": {},
        "read": {},
        "raw": {"write": {}, "read": {}, "read-disk": {}},
    }
    started = time.perf_counter()
    for name in names:
        tile, per_shard = shapes[name]
        layout = make_layout(tile, per_shard)
        frames = max(tile[0], int(args.gib * 2**30 // camera.frame_bytes) // tile[0] * tile[0])
        if not args.no_writes:
            rounds, ceilings = [], []
            for r in range(args.rounds):
                row = {}
                for engine in engines[r % len(engines) :] + engines[: r % len(engines)]:
                    out = args.dir / f"write-{engine}.zarr"
                    measure = write_ours if engine == "ours" else write_tensorstore
                    row[engine] = measure(camera, layout, frames, out)
                if not ceilings:  # libzstd alone once per layout, between the engines' first and second rounds
                    ceilings.append(
                        {
                            **compress_ceiling(camera, tile, args.threads, args.sample_mib << 20),
                            **write_pipeline(
                                camera, tile, per_shard, args.threads, args.sample_mib << 20, args.dir / "pipeline"
                            ),
                        }
                    )
                rounds.append(row)
                print(json.dumps({"write": name, "round": r, **row, "zstd": ceilings[-1]}), flush=True)
            results["raw"]["write"][name] = {"rounds": rounds, "zstd": ceilings}
            results["write"][name] = summarise(rounds, f"zstd_{args.threads}threads_gbps", ceilings)
        if not args.no_reads:
            path = args.dir / f"{name}.zarr"
            write_recording(camera, layout, frames, path)
            places = [("read", path)]
            if args.disk:
                target = args.disk / f"{name}.zarr"
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(path, target)
                places.append(("read-disk", target))
            for kind, place in places:
                rounds, ceilings = [], []
                for r in range(args.rounds):
                    row = {}
                    for engine in engines[r % len(engines) :] + engines[: r % len(engines)]:
                        if kind == "read":
                            read = read_ours if engine == "ours" else read_tensorstore
                            row[engine] = read(place, args.repeat)
                        else:
                            row[engine] = read_cold(engine, place)
                    if kind == "read" and not ceilings:  # once per layout (a 1-thread pass over every chunk)
                        limits = decode_ceiling(place, args.threads)
                        ceilings.append({**limits, **pipeline_ceiling(place, args.threads)})
                    elif kind == "read-disk":
                        row["disk"] = disk_rates(place, args.threads)
                    rounds.append(row)
                    print(json.dumps({kind: name, "round": r, **row}), flush=True)
                results["raw"][kind][name] = {"rounds": rounds, "zstd": ceilings}
                if kind == "read":
                    results[kind][name] = summarise(rounds, f"zstd_{args.threads}threads_gbps", ceilings)
                else:
                    for row in rounds:
                        row["ours"].setdefault("stages", {})
                        row.get("tensorstore", {}).setdefault("stages", {})
                    summary = summarise(rounds, "", [])
                    summary["disk_gbps"] = {
                        k: statistics.median(r["disk"]["disk_read_gbps"][k] for r in rounds)
                        for k in rounds[0]["disk"]["disk_read_gbps"]
                    }
                    disk = rounds[0]["disk"]
                    summary["compression_ratio"] = disk["decoded_bytes"] / disk["stored_bytes"]
                    # issue 37's target 3: the disk's best rate in decoded bytes, or the in-memory rate if lower
                    in_memory = results["read"].get(name, {}).get("ours_gbps", float("inf"))
                    summary["limit_gbps"] = [min(r["disk"]["decoded_equivalent_gbps"], in_memory) for r in rounds]
                    summary["ours_vs_disk"] = [r["ours"]["gbps"] / x for r, x in zip(rounds, summary["limit_gbps"])]
                    limits = zip(rounds, summary["limit_gbps"])
                    summary["ts_vs_disk"] = [r["tensorstore"]["gbps"] / x for r, x in limits if "tensorstore" in r]
                    results.setdefault(kind, {})[name] = summary
                if kind == "read-disk":
                    shutil.rmtree(place, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
    results["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"total {results['seconds']} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
