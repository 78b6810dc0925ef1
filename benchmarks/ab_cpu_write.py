"""Interleaved A/B of CPU-backend variants and tensorstore, in one process, on the user's clock.

Each round runs every engine once (tensorstore and each named variant of ``Writer(backend="cpu")``),
the order rotating from round to round, so all see the same background load; ratios are taken
per round (pairwise), then median (min-max) over the rounds.  A variant sets switches of
:mod:`napari_tileshard.engine.backends.cpu` (UPPER-case names; ``staging.NAME``: of
:mod:`napari_tileshard.engine.staging`, e.g. ``staging._PARALLEL_COPY_BYTES=1099511627776``;
``collector.NAME`` likewise) and ``Writer`` keywords (lower-case, e.g. ``batch_bytes=16777216``
or ``io_dispatch=pull``; ``switchinterval=0.0005``: the interpreter's, for this
variant's runs); ``base`` with nothing set is the default.  The clock runs from
``Writer()`` (tensorstore: ``ts.open``) to ``close()`` as ``bench_write.py --clock user``;
CPU-s/GB is the process's CPU time over the same span, and ``append`` the part of it on the
caller's thread and the staging copy's helpers (tensorstore: the harness's copy of frames into
slabs), as ``cpu_stages.py`` counts them.

    python benchmarks/ab_cpu_write.py --gib 1 --rounds 5 --tiles 64k-d2,256k-d2 \\
        --variant base= --variant serial=staging._PARALLEL_COPY_BYTES=1099511627776 --out /dev/shm/abcpu
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_write import layout_for, tile_cases  # noqa: E402
from cpu_many_cores import write_tensorstore  # noqa: E402
from cpu_stages import thread_cpu_seconds  # noqa: E402

from napari_tileshard import Layout, SyntheticCamera, Writer  # noqa: E402
from napari_tileshard.engine import collector as collector_module  # noqa: E402
from napari_tileshard.engine import staging as staging_module  # noqa: E402
from napari_tileshard.engine.backends import cpu as cpu_module  # noqa: E402

#: modules whose switches a variant may set: ``NAME`` (the CPU backend's), ``staging.NAME`` or
#: ``collector.NAME``
MODULES = {"": cpu_module, "staging": staging_module, "collector": collector_module}


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """``name=KEY=v,key=v`` -> (name, cpu-module switches, Writer keywords)."""
    name, _, settings = text.partition("=")
    switches, keywords = {}, {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        number: float | int | str
        try:
            number = float(value) if "." in value else int(value)
        except ValueError:  # a Writer keyword that takes a name, e.g. io_dispatch=pull
            number = value
        if key.split(".")[-1].lstrip("_").isupper():
            switches[key] = number
        else:
            keywords[key] = number
    return name, switches, keywords


def case_layout(case: str, tile, camera) -> Layout:
    """The layout of a tile case: shards 1 tile deep x 1024 x 1024 px, or ``default``:
    ``Layout.default_for`` of the camera's frames (2 x 256² tiles, 4 tiles deep x 1024² shards)."""
    if case == "default":
        return Layout.default_for((0, *camera.shape), "uint16")
    return layout_for(camera.shape, tile)


def cases(names: list[str]):
    """(name, tile shape) of each case: ``bench_write``'s tile cases and ``default``."""
    known = [name for name in names if name != "default"]
    found = dict(tile_cases(known))
    default = Layout.default_for((0, 2048, 2048), "uint16").tile_shape
    return [(name, default if name == "default" else found[name]) for name in names]


def caller_schedstat() -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far
    (Linux's ``/proc/thread-self/schedstat``; zeros elsewhere)."""
    try:
        run_ns, wait_ns, _ = open("/proc/thread-self/schedstat").read().split()
    except OSError:
        return 0.0, 0.0
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


#: per engine, per run: the caller thread's share of the wall time on a CPU, waiting for one
#: (runnable), and copying into staging (``WriterStats.copy_s``)
CALLER: dict[str, list[tuple[float, float, float]]] = {}


def run_ours(camera, frames, layout, out, level, switches, keywords, name="ours") -> tuple[float, float, float]:
    """(seconds, CPU seconds, CPU seconds of the caller's thread and the staging copy's helpers)."""

    def place(key):
        module, _, name = key.rpartition(".")
        return MODULES[module], name

    saved = {key: getattr(*place(key)) for key in switches}
    for key, value in switches.items():
        setattr(*place(key), type(saved[key])(value))
    keywords = dict(keywords)
    saved_interval = sys.getswitchinterval()
    sys.setswitchinterval(keywords.pop("switchinterval", saved_interval))
    try:
        shutil.rmtree(out, ignore_errors=True)
        before = thread_cpu_seconds()
        sched0 = caller_schedstat()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        writer = Writer(out, layout, codec="zstd", level=level, backend="cpu", overwrite=True, **keywords)
        with writer:
            for frame in camera.frames(frames):
                writer.append(frame)
            writer.sync()
            appending = {threading.main_thread().native_id} | {
                t.native_id for t in threading.enumerate() if t.name.startswith("tileshard-copy")
            }
            append = sum(s - before.get(tid, 0.0) for tid, s in thread_cpu_seconds().items() if tid in appending)
        wall = time.perf_counter() - wall0
        sched = caller_schedstat()
        CALLER.setdefault(name, []).append(
            ((sched[0] - sched0[0]) / wall, (sched[1] - sched0[1]) / wall, writer.stats.copy_s / wall)
        )
        return wall, time.process_time() - cpu0, append
    finally:
        sys.setswitchinterval(saved_interval)
        for key, value in saved.items():
            setattr(*place(key), value)
        shutil.rmtree(out, ignore_errors=True)


def run_tensorstore(camera, frames, layout, out, level) -> tuple[float, float, float]:
    """(seconds, CPU seconds, CPU seconds of the caller's thread: the harness's slab copy), from
    ``ts.open`` to the last write (``cpu_many_cores.write_tensorstore``)."""
    if level != 1:
        raise SystemExit("tensorstore runs at level 1 here (cpu_many_cores.write_tensorstore)")
    sched0 = caller_schedstat()
    row = write_tensorstore(camera, layout, frames, out)
    sched = caller_schedstat()
    gb = frames * camera.frame_bytes / 1e9
    seconds = gb / row["gbps"]
    CALLER.setdefault("ts", []).append(((sched[0] - sched0[0]) / seconds, (sched[1] - sched0[1]) / seconds, 0.0))
    return seconds, row["cpu_s_per_gb"] * gb, row["stages"]["append"] * gb


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tiles", default="64k-d2,256k-d2,1m-d8,default,1m,4m")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variant", action="append", default=None, help="name=SWITCH=v,keyword=v (repeatable)")
    parser.add_argument("--no-tensorstore", action="store_true")
    parser.add_argument("--out", default="/dev/shm/tileshard-ab-cpu")
    args = parser.parse_args(argv)
    variants = [parse_variant(v) for v in (args.variant or ["base="])]
    engines = ([] if args.no_tensorstore else ["ts"]) + [name for name, _, _ in variants]
    by_name = {name: (switches, keywords) for name, switches, keywords in variants}
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    camera.prepare()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    print(f"# {args.gib} GiB per run, {args.rounds} rounds, order rotating; variants {args.variant}", flush=True)
    for case, tile in cases(args.tiles.split(",")):
        layout = case_layout(case, tile, camera)
        frames = math.ceil(max(1, int(args.gib * 2**30 // camera.frame_bytes)) / tile[0]) * tile[0]
        gb = frames * camera.frame_bytes / 1e9
        runs: dict[str, list[tuple[float, float, float]]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in engines[r % len(engines) :] + engines[: r % len(engines)]:
                out = root / f"{engine}.zarr"
                if engine == "ts":
                    runs[engine].append(run_tensorstore(camera, frames, layout, out, args.level))
                else:
                    runs[engine].append(
                        run_ours(camera, frames, layout, out, args.level, *by_name[engine], name=engine)
                    )
        line = [f"{case}:"]
        caller = {e: CALLER.pop(e, []) for e in engines}
        for engine in engines:
            line.append(
                f"{engine} {statistics.median(gb / w for w, *_ in runs[engine]):.3f} GB/s "
                f"{statistics.median(c / gb for _, c, _ in runs[engine]):.2f} CPU-s/GB "
                f"(append {statistics.median(a / gb for _, _, a in runs[engine]):.2f}"
                + (
                    ", caller on-CPU / runnable / copying {:.2f} / {:.2f} / {:.2f}".format(
                        *(statistics.median(row[k] for row in caller[engine]) for k in range(3))
                    )
                    if caller[engine]
                    else ""
                )
                + ");"
            )
        reference = engines[0]
        for engine in engines[1:]:
            ratios = [a[0] / b[0] for a, b in zip(runs[reference], runs[engine])]  # speed of engine / reference
            line.append(f"{engine}/{reference} {spread(ratios)};")
        if not args.no_tensorstore and len(engines) > 2:
            first = engines[1]
            for engine in engines[2:]:
                ratios = [a[0] / b[0] for a, b in zip(runs[first], runs[engine])]
                line.append(f"{engine}/{first} {spread(ratios)};")
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
