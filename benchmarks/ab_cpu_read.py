"""Interleaved A/B of whole-array CPU reads: ``ShardReader`` (variants of it) against tensorstore.

The 2-core dev box is shared with other work, so single runs say little: each round reads the
array once with every engine, the order rotating from round to round, and the ratios are taken
per round (speed of an engine over the first engine's, same round), then median (min-max) over
the rounds.  Per engine also the CPU seconds per GB of output (the process's user + system time
over the read: less sensitive to other processes than the clock) and, with ``--check``, whether
its output equals zarr-python's (read once per array).

Engines: ``ts`` (tensorstore, zarr3 driver on the file kvstore), ``zarr`` (zarr-python), and
variants of ours, ``name=KEY=value,...``: ``KEY`` an UPPER-case switch of
:mod:`napari_tileshard.reader.cpu` (``fetch.NAME``, ``memory.NAME``, ``codecs.NAME``: of those
modules; ``places.NAME``: of storage.places, a set as names joined by ``+``, ``none``: empty),
``pool_bytes=N`` (the output pool's cap for this variant, 0: fresh output memory, as
``TILESHARD_POOL_BYTES=0``), ``switchinterval=S`` (the interpreter's GIL switch interval for
this variant's reads), or a lower-case ``ShardReader`` keyword (``workers=1``); ``ours=``
is the default reader.  A variant
``name@/path/to/src`` is our reader from another source tree, run in a subprocess that reads
the array once per round (for A/B of code versions; then every engine runs in a subprocess,
``--isolate``, so all pay the same start-up and memory state).

    python benchmarks/ab_cpu_read.py --path /dev/shm/r/64k-4m.zarr --rounds 7 --variant ours= --check
    python benchmarks/ab_cpu_read.py --tiles 64k-4m,256k-4m,1m-16m --gib 1 --rounds 7 \\
        --variant new= --variant old@/tmp/old/src --isolate
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_read import TILES, evict, write_recording  # noqa: E402

from napari_tileshard import ShardReader  # noqa: E402
from napari_tileshard.reader import memory  # noqa: E402

#: modules whose switches a variant may set: ``NAME`` (reader.cpu's), ``fetch.NAME``, ``codecs.NAME``
MODULES = {
    "": "napari_tileshard.reader.cpu",
    "fetch": "napari_tileshard.reader.fetch",
    "codecs": "napari_tileshard.format.codecs",
    "shard_reader": "napari_tileshard.reader.shard_reader",
    "memory": "napari_tileshard.reader.memory",
    "places": "napari_tileshard.storage.places",
}


def parse_variant(text: str) -> tuple[str, dict, dict, str | None]:
    """``name=KEY=v,key=v`` or ``name@src`` -> (name, switches, reader keywords, source tree)."""
    if "@" in text.partition("=")[0]:
        name, _, source = text.partition("@")
        return name, {}, {}, source
    name, _, settings = text.partition("=")
    switches, keywords = {}, {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        number: float | int | str
        try:
            number = float(value) if "." in value else int(value)
        except ValueError:  # names, e.g. places.MEMORY_FILE_SYSTEMS=none (no file system held in memory)
            number = value
        (switches if key.split(".")[-1].lstrip("_").isupper() else keywords)[key] = number
    return name, switches, keywords, None


def _converted(saved, value):
    """A variant's ``value`` as the switch's type; a set of names is given joined by ``+``
    (``none``: the empty set)."""
    if isinstance(saved, (set, frozenset)):
        return type(saved)(name for name in str(value).split("+") if name != "none")
    return type(saved)(value)


def _place(key: str):
    module, _, name = key.rpartition(".")
    return importlib.import_module(MODULES[module]), name


@contextlib.contextmanager
def switched(switches: dict):
    """A variant's switches set while the block runs, then restored: module attributes, and
    ``TILESHARD_*`` environment variables (the reader's settings, read where they are used)."""
    environment = {key: value for key, value in switches.items() if key.startswith("TILESHARD_")}
    attributes = {key: value for key, value in switches.items() if key not in environment}
    saved = {key: getattr(*_place(key)) for key in attributes}
    saved_environment = {key: os.environ.get(key) for key in environment}
    for key, value in attributes.items():
        setattr(*_place(key), _converted(saved[key], value))
    os.environ.update({key: str(value) for key, value in environment.items()})
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(*_place(key), value)
        for key, value in saved_environment.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def read_once(engine: str, path: Path, switches: dict, keywords: dict, repeat: int) -> dict:
    """Best-of-``repeat`` whole read by one engine in this process: seconds, CPU seconds, bytes."""
    keywords = dict(keywords)
    pool_bytes = keywords.pop("pool_bytes", None)
    switch_interval = keywords.pop("switchinterval", None)
    saved_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    settings = contextlib.ExitStack()
    settings.enter_context(switched(switches))
    saved_pool = memory.set_output_pool(memory.OutputPool(pool_bytes)) if pool_bytes is not None else None
    try:
        if engine == "ts":
            import tensorstore as ts

            store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()

            def read():
                return store.read().result()

            close = None
        elif engine == "zarr":
            import zarr

            array = zarr.open_array(str(path), mode="r")

            def read():
                return array[...]

            close = None
        else:
            reader = ShardReader(path, backend="cpu", **keywords)
            read, close = reader.read, reader.close
        best = None
        for _ in range(repeat):
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            out = read()
            row = {"s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0, "bytes": out.nbytes}
            row.update(usage_since(usage0))
            del out
            if best is None or row["s"] < best["s"]:
                best = row
        if close is not None:
            close()
        assert best is not None
        return best
    finally:
        sys.setswitchinterval(saved_interval)
        settings.close()
        if pool_bytes is not None:
            memory.set_output_pool(saved_pool)


def usage_since(before) -> dict:
    """Page faults and context switches of this process since ``before`` (``getrusage``): the
    kernel's share of a read (fresh pages zeroed) and how often its threads waited (the GIL,
    locks, queues: voluntary switches) or were preempted (involuntary)."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "minflt": now.ru_minflt - before.ru_minflt,
        "nvcsw": now.ru_nvcsw - before.ru_nvcsw,
        "nivcsw": now.ru_nivcsw - before.ru_nivcsw,
    }


def read_in_subprocess(engine: str, path: Path, switches: dict, keywords: dict, repeat: int, source) -> dict:
    env = dict(os.environ)
    if source:  # the other tree first; the rest of the path (wheels unpacked beside) kept
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(source).resolve()), env.get("PYTHONPATH")]))
    spec = json.dumps({"engine": engine, "path": str(path), "switches": switches, "keywords": keywords})
    command = [sys.executable, __file__, "--child", spec, "--repeat", str(repeat)]
    if source:  # the other tree's reader: this script's sys.path puts our src first, so say it again
        command = [sys.executable, "-c", _CHILD.format(src=str(Path(source).resolve())), spec, str(repeat)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{engine} in a subprocess failed: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


#: a subprocess reading with another source tree's ShardReader (its own import path first)
_CHILD = """
import json, sys, time
sys.path.insert(0, {src!r})
from napari_tileshard import ShardReader
spec, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
reader = ShardReader(spec["path"], backend="cpu", **spec["keywords"])
best = None
for _ in range(repeat):
    cpu0, wall0 = time.process_time(), time.perf_counter()
    out = reader.read()
    row = {{"s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0, "bytes": out.nbytes}}
    del out
    if best is None or row["s"] < best["s"]:
        best = row
print(json.dumps(best))
"""


def check_exact(path: Path, engines: list[str], by_name: dict) -> dict[str, bool]:
    """Each engine's whole output against zarr-python's, twice (ours: the second read lands in
    the first one's memory once that is dropped); subprocess variants of another tree are not
    checked here."""
    import zarr

    expected = zarr.open_array(str(path), mode="r")[...]
    found = {}
    for engine in engines:
        switches, keywords, source = by_name.get(engine, ({}, {}, None))
        if source:
            continue
        keywords = {k: v for k, v in keywords.items() if k != "pool_bytes"}
        with switched(switches):
            if engine == "ts":
                import tensorstore as ts

                store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
                outputs = [store.read().result]
            else:
                reader = ShardReader(path, backend="cpu", **keywords)
                outputs = [reader.read, reader.read]
            same = True
            for read in outputs:
                out = read()
                same &= bool(out.dtype == expected.dtype and np.array_equal(out, expected))
                del out
            found[engine] = same
    return found


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, action="append", help="an existing array (repeatable)")
    parser.add_argument("--tiles", default="64k-4m,256k-4m,1m-16m", help="recordings to write (without --path)")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument(
        "--write-backend",
        default="cpu",
        help="the Writer backend of the recordings it writes (cpu: libzstd level-1 frames, as a CPU user's; "
        "gpu/auto: nvCOMP's on a GPU machine, which decode ~3x slower on the CPU)",
    )
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/tileshard-ab-read"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=1, help="reads per engine per round (best kept)")
    parser.add_argument("--variant", action="append", help="name=SWITCH=v,keyword=v or name@src (repeatable)")
    parser.add_argument("--no-tensorstore", action="store_true")
    parser.add_argument("--isolate", action="store_true", help="every read in a fresh process")
    parser.add_argument("--check", action="store_true", help="outputs equal zarr-python's")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict the array's pages from the page cache before every read (reads from the disk; --repeat 1)",
    )
    parser.add_argument("--out", type=Path, help="JSON of every round")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        row = read_once(spec["engine"], Path(spec["path"]), spec["switches"], spec["keywords"], args.repeat)
        print(json.dumps(row))
        return 0
    if args.cold and args.repeat != 1:
        parser.error("--cold reads once per engine and round: --repeat 1")
    variants = [parse_variant(v) for v in (args.variant or ["ours="])]
    by_name = {name: (switches, keywords, source) for name, switches, keywords, source in variants}
    engines = ([] if args.no_tensorstore else ["ts"]) + [name for name, *_ in variants]
    isolate = args.isolate or any(source for *_, source in variants)
    paths = list(args.path or [])
    if not paths:
        args.dir.mkdir(parents=True, exist_ok=True)
        for tile in args.tiles.split(","):
            path = args.dir / f"{tile}.zarr"
            if not (path / "zarr.json").exists():
                write_recording(path, args.gib, TILES[tile], backend=args.write_backend)
            paths.append(path)
    print(f"# {os.cpu_count()} CPUs; {args.rounds} rounds, order rotating; engines {engines}; isolate={isolate}")
    print(f"# {' '.join(sys.argv)}", flush=True)
    report = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "arrays": []}
    for path in paths:
        if args.check:
            print(f"{path.name}: exact against zarr-python: {check_exact(path, engines, by_name)}", flush=True)
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in engines[r % len(engines) :] + engines[: r % len(engines)]:
                switches, keywords, source = by_name.get(engine, ({}, {}, None))
                name = "ts" if engine == "ts" else engine
                if args.cold:
                    evict(path)
                if isolate:
                    row = read_in_subprocess(name, path, switches, keywords, args.repeat, source)
                else:
                    row = read_once(name, path, switches, keywords, args.repeat)
                runs[engine].append(row)
        gb = runs[engines[0]][0]["bytes"] / 1e9
        line = [f"{path.name}:"]
        for engine in engines:
            line.append(
                f"{engine} {statistics.median(gb / x['s'] for x in runs[engine]):.2f} GB/s "
                f"{statistics.median(x['cpu_s'] / gb for x in runs[engine]):.2f} CPU-s/GB"
                + (
                    f" {statistics.median(x['minflt'] / gb for x in runs[engine]):.0f} faults/GB"
                    f" {statistics.median(x['nvcsw'] / gb for x in runs[engine]):.0f} waits/GB;"
                    if all("minflt" in x for x in runs[engine])
                    else ";"
                )
            )
        for reference in engines[:1] + engines[1:2] * (len(engines) > 2):
            for engine in engines:
                if engines.index(engine) <= engines.index(reference):
                    continue
                ratios = [a["s"] / b["s"] for a, b in zip(runs[reference], runs[engine])]
                line.append(f"{engine}/{reference} {spread(ratios)};")
        print(" ".join(line), flush=True)
        report["arrays"].append({"path": str(path), "runs": runs})
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
