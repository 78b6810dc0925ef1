"""Our GPU Writer against chucky (acquire-project's CUDA streaming Zarr writer) on one GPU, in one run.

Both record the same frames: SyntheticCamera's 64-frame bank of 2048x2048 uint16 frames (seed 0),
replayed frame by frame, into Zarr v3 sharded arrays with zstd tiles (nvCOMP's batched zstd on
both sides, which has no level: both stores say level 1), tiles of ``--tiles`` and shards of
1 x 1024 x 1024 pixels of tiles (``bench_write.layout_for``).  Every run is a fresh process, its
CUDA context made before the clock starts; the clock is the user's: from ``Writer(...)`` to
``close()`` for ours, from creating the sink and the stream to the last shard handed to the OS
for chucky (its ``writer_flush`` and ``zarr_fs_sink_flush``).  ``stream`` GB/s leave the
creation out.  Runs alternate A/B (the order flips each round); ratios are ours / chucky per round.

Targets: ``shm`` (stores in --out, /dev/shm by default: buffered writes on both sides),
``disk`` (stores in --disk: chucky with its O_DIRECT page-aligned writes, ours buffered), and
``discard`` (chucky's pipeline with a sink that counts the shard bytes and drops them: chucky
without storage; ours has no such sink, so this row has no ratio).

    bash benchmarks/chucky/build.sh /tmp/chucky-build
    python benchmarks/chucky/compare.py --binary /tmp/chucky-build/chucky_frames --gib 4 \\
        --tiles 256k-d2,1m-d8 --targets shm,discard --rounds 3 --json $OUT/chucky_compare.json

Both stores of the last round are read back with tensorstore and compared with the bank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE.parent))

FRAME_SHAPE = (2048, 2048)
BANK_FRAMES = 64
# tile (t, y, x) of uint16; the shard is 1 tile deep and 1024 x 1024 pixels (bench_write.layout_for)
TILES = {
    "64k-d2": (2, 128, 128),
    "256k-d2": (2, 256, 256),
    "1m-d8": (8, 256, 256),
    "256k-d8": (8, 128, 128),
    "1m-d2": (2, 512, 512),
}


def shard_tiles(tile: tuple[int, int, int]) -> tuple[int, int, int]:
    return 1, max(1, 1024 // tile[1]), max(1, 1024 // tile[2])


def write_bank(path: Path) -> None:
    from napari_tileshard import SyntheticCamera

    camera = SyntheticCamera(FRAME_SHAPE, "uint16", seed=0, bank_frames=BANK_FRAMES)
    with open(path, "wb") as f:
        for frame in camera.frames(BANK_FRAMES):
            f.write(np.ascontiguousarray(frame).tobytes())


def load_bank(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16).reshape((-1, *FRAME_SHAPE))


# -- one run of ours, in its own process (python compare.py ours ...) ------------------------
def run_ours(
    bank_path: Path, tile: tuple[int, int, int], frames: int, store: Path, backend: str, per_append: int
) -> dict:
    from bench_write import layout_for

    from napari_tileshard import Writer

    bank = load_bank(bank_path)
    if backend == "gpu":
        import cupy

        cupy.zeros(1).sum().get()  # the CUDA context before the clock, as chucky_frames makes its own
    layout = layout_for(FRAME_SHAPE, tile)
    t0 = time.perf_counter()
    writer = Writer(store, layout, codec="zstd", level=1, backend=backend, overwrite=True)
    t1 = time.perf_counter()
    for i in range(0, frames, per_append):  # K consecutive bank frames per call (a view: no copy)
        k = i % len(bank)
        writer.append(bank[k] if per_append == 1 else bank[k : k + per_append])
    t_appended = time.perf_counter()
    writer.close()
    t2 = time.perf_counter()
    nbytes = frames * bank[0].nbytes
    memory = writer.memory_estimate()
    return {
        "engine": "ours",
        "frames": frames,
        "frames_per_append": per_append,
        "bytes": nbytes,
        "out_bytes": dir_bytes(store),
        "create_s": t1 - t0,
        "append_s": t_appended - t1,
        "stream_s": t2 - t1,
        "user_s": t2 - t0,
        "user_gbps": nbytes / (t2 - t0) / 1e9,
        "stream_gbps": nbytes / (t2 - t1) / 1e9,
        "batch_bytes": writer.batch_bytes,
        "memory_estimate": memory,
        "backend": str(writer.stats.backend),
    }


def gpu_name() -> str | None:
    """The GPU's name, from nvidia-smi: the parent process never opens a CUDA context."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- the parent: interleaved runs, read-back, summary ---------------------------------------
def child(argv: list[str], timeout: float) -> dict:
    """Run one recording in a fresh process; its last stdout line is its JSON row."""
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}"
        )
    row = json.loads(lines[-1])
    row["process_s"] = time.perf_counter() - started
    if proc.stderr.strip():
        row["stderr_tail"] = proc.stderr.strip()[-500:]
    return row


def chucky_argv(
    binary: str, bank: Path, tile, frames: int, store: Path | None, unbuffered: int | None, per_append: int
) -> list[str]:
    argv = [binary, "--bank", str(bank), "--height", str(FRAME_SHAPE[0]), "--width", str(FRAME_SHAPE[1])]
    argv += ["--frames-per-append", str(per_append)]
    argv += ["--frames", str(frames), "--tile", ",".join(map(str, tile))]
    argv += ["--shard-tiles", ",".join(map(str, shard_tiles(tile))), "--level", "1"]
    if store is not None:
        argv += ["-o", str(store)]
    if unbuffered is not None:
        argv += ["--unbuffered", str(unbuffered)]
    return argv


def ours_argv(bank: Path, tile, frames: int, store: Path, backend: str, per_append: int) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "ours", "--bank", str(bank), "--backend", backend]
    argv += ["--frames-per-append", str(per_append)]
    return argv + ["--tile", ",".join(map(str, tile)), "--frames", str(frames), "--store", str(store)]


def verify(store_array: Path, bank: np.ndarray, frames: int) -> str:
    """Open a store with tensorstore (an independent Zarr v3 reader) and compare frames with the bank."""
    import tensorstore as ts

    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(store_array)}}).result()
    if tuple(array.shape) != (frames, *FRAME_SHAPE):
        return f"shape {tuple(array.shape)} != {(frames, *FRAME_SHAPE)}"
    for i in sorted({0, 1, BANK_FRAMES - 1, BANK_FRAMES, frames // 2, frames - 1} & set(range(frames))):
        got = array[i].read().result()
        if not np.array_equal(got, bank[i % len(bank)]):
            return f"frame {i} differs from the bank"
    return "ok"


def summarise(rows: list[dict]) -> list[dict]:
    table = []
    keys = sorted({(r["tile"], r["frames_per_append"], r["target"]) for r in rows})
    for tile, per_append, target in keys:
        case = [r for r in rows if (r["tile"], r["frames_per_append"], r["target"]) == (tile, per_append, target)]
        entry: dict = {"tile": tile, "frames_per_append": per_append, "target": target}
        for engine in ("chucky", "ours"):
            runs = [r for r in case if r["engine"] == engine]
            if runs:
                user = [r["user_gbps"] for r in runs]
                entry[engine] = {
                    "user_gbps_median": statistics.median(user),
                    "user_gbps_min": min(user),
                    "user_gbps_max": max(user),
                    "stream_gbps_median": statistics.median(r["stream_gbps"] for r in runs),
                    "create_s_median": statistics.median(r["create_s"] for r in runs),
                    "out_bytes": runs[-1]["out_bytes"],
                }
        ratios = []
        for rnd in sorted({r["round"] for r in case}):
            pair = {r["engine"]: r for r in case if r["round"] == rnd}
            if "ours" in pair and "chucky" in pair:
                ratios.append(pair["ours"]["user_gbps"] / pair["chucky"]["user_gbps"])
        if ratios:
            entry["ours_over_chucky"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        table.append(entry)
    return table


def gbps_cell(stats: dict | None) -> str:
    if not stats:
        return "-"
    return f"{stats['user_gbps_median']:.2f} ({stats['user_gbps_min']:.2f}-{stats['user_gbps_max']:.2f})"


def print_table(table: list[dict]) -> None:
    print(f"\n{'tile':9} {'frames/append':>13} {'target':8} {'chucky GB/s':>22} {'ours GB/s':>22} {'ours/chucky':>20}")
    for e in table:
        r = e.get("ours_over_chucky")
        ratio = f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
        chucky, ours = gbps_cell(e.get("chucky")), gbps_cell(e.get("ours"))
        print(f"{e['tile']:9} {e['frames_per_append']:>13} {e['target']:8} {chucky:>22} {ours:>22} {ratio:>20}")
    print("user's clock (create to close), median (min-max) over rounds; GB = 1e9 bytes")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "ours":  # the child that runs one recording of ours
        p = argparse.ArgumentParser()
        p.add_argument("--bank", type=Path, required=True)
        p.add_argument("--tile", required=True)
        p.add_argument("--frames", type=int, required=True)
        p.add_argument("--store", type=Path, required=True)
        p.add_argument("--backend", default="gpu")
        p.add_argument("--frames-per-append", type=int, default=1)
        a = p.parse_args(argv[1:])
        t, y, x = (int(v) for v in a.tile.split(","))
        row = run_ours(a.bank, (t, y, x), a.frames, a.store, a.backend, a.frames_per_append)
        print(json.dumps(row), flush=True)
        return 0

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default="/tmp/chucky-build/chucky_frames", help="chucky_frames (build.sh)")
    p.add_argument("--gib", type=float, default=4.0, help="data per recording (GiB of frames)")
    p.add_argument("--tiles", default="256k-d2,1m-d8", help=f"tile cases: {', '.join(TILES)}")
    p.add_argument("--targets", default="shm,discard", help="shm, disk, discard")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--appends",
        default="1",
        help="frames per append call, a list (1: a camera's frames one by one; 8: chucky's own benchmark "
        "hands it 64 MiB per call); each must divide 64",
    )
    p.add_argument("--out", type=Path, default=Path("/dev/shm/chucky-compare"), help="stores for 'shm'")
    p.add_argument("--disk", type=Path, default=Path("/tmp/chucky-compare-disk"), help="stores for 'disk'")
    p.add_argument("--bank", type=Path, default=Path("/tmp/chucky-compare-bank.u16"))
    p.add_argument("--timeout", type=float, default=240, help="seconds per recording")
    p.add_argument("--json", type=Path, help="write raw rows and the summary here")
    p.add_argument("--no-verify", action="store_true", help="skip reading the last stores back")
    p.add_argument("--our-backend", default="gpu", help="gpu (the comparison); cpu only to try the script")
    a = p.parse_args(argv)

    unknown = [t for t in a.tiles.split(",") if t not in TILES]
    targets = a.targets.split(",")
    if unknown or not set(targets) <= {"shm", "disk", "discard"}:
        raise SystemExit(f"unknown tile case or target: {unknown or targets}")
    if not os.access(a.binary, os.X_OK):
        raise SystemExit(f"no chucky_frames at {a.binary}: run benchmarks/chucky/build.sh first")
    tiles = {name: TILES[name] for name in a.tiles.split(",")}
    appends = [int(v) for v in a.appends.split(",")]
    if any(k < 1 or BANK_FRAMES % k for k in appends):
        raise SystemExit(f"--appends: each must divide {BANK_FRAMES}, got {appends}")
    frame_bytes = FRAME_SHAPE[0] * FRAME_SHAPE[1] * 2
    depth = max([t[0] for t in tiles.values()] + appends)
    frames = max(depth, int(a.gib * 2**30 // frame_bytes) // depth * depth)  # whole tiles for every case

    started = time.perf_counter()
    if not a.bank.exists() or a.bank.stat().st_size != BANK_FRAMES * frame_bytes:
        write_bank(a.bank)
    bank = load_bank(a.bank)
    print(f"bank: {len(bank)} frames in {a.bank} ({time.perf_counter() - started:.1f} s); {frames} frames a run")

    roots = {"shm": a.out, "disk": a.disk}
    for target in targets:
        if target in roots:
            roots[target].mkdir(parents=True, exist_ok=True)

    def store_for(target: str, engine: str, tile_name: str) -> Path | None:
        return None if target == "discard" else roots[target] / f"{engine}-{tile_name}.zarr"

    def record(engine: str, target: str, tile_name: str, per_append: int, frames: int = frames) -> dict:
        tile = tiles[tile_name]
        store = store_for(target, engine, tile_name)
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)
        if engine == "chucky":
            unbuffered = None if target == "disk" else 0  # tmpfs: buffered, as ours; disk: chucky's O_DIRECT
            row = child(chucky_argv(a.binary, a.bank, tile, frames, store, unbuffered, per_append), a.timeout)
            if store is not None:
                row["out_bytes"] = dir_bytes(store)
        else:
            assert store is not None
            row = child(ours_argv(a.bank, tile, frames, store, a.our_backend, per_append), a.timeout)
        return row

    commit_file = HERE.parent / "scratch" / "chucky-src" / "COMMIT"
    meta = {
        "gpu": gpu_name(),
        "chucky_commit": commit_file.read_text().strip() if commit_file.exists() else None,
        "frames": frames,
        "frame_shape": FRAME_SHAPE,
        "tiles": tiles,
    }
    rows: list[dict] = []
    failures: list[str] = []
    checks: dict[str, str] = {}

    def save() -> list[dict]:
        """The summary so far, also written to --json after every run (a killed call keeps its rows)."""
        table = summarise(rows)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            result = {**meta, "summary": table, "read_back": checks, "failures": failures, "rows": rows}
            a.json.write_text(json.dumps({**result, "elapsed_s": time.perf_counter() - started}, indent=1))
        return table

    # An engine that outlives --timeout once (a hang) is not run again: the call's time goes to
    # the other, not to more timeouts.
    hung: set[str] = set()

    # Warm-up, untimed: CuPy's kernel cache, nvCOMP's first load, the page cache of the bank.
    first_tile = next(iter(tiles))
    warm_target = "shm" if "shm" in targets else targets[0]
    for engine in ("chucky", "ours"):
        if engine == "ours" and warm_target == "discard":
            continue
        try:
            record(engine, warm_target, first_tile, 1, frames=min(frames, BANK_FRAMES))
        except subprocess.TimeoutExpired:
            hung.add(engine)
            print(f"warm-up of {engine} timed out after {a.timeout:.0f} s: not run again")
        except Exception as exc:  # a failing engine is reported; the other still runs
            print(f"warm-up of {engine} failed: {exc}")

    cases = [(tile_name, k, target) for tile_name in tiles for k in appends for target in targets]
    for rnd in range(a.rounds):
        for tile_name, per_append, target in cases:
            engines = ["chucky", "ours"] if rnd % 2 == 0 else ["ours", "chucky"]
            for engine in engines:
                if engine in hung or (engine == "ours" and target == "discard"):
                    continue
                label = f"{engine} {tile_name} x{per_append} {target}"
                try:
                    row = record(engine, target, tile_name, per_append)
                except subprocess.TimeoutExpired:
                    hung.add(engine)
                    failures.append(f"round {rnd} {label}: timed out after {a.timeout:.0f} s (not run again)")
                    print(failures[-1])
                    continue
                except Exception as exc:
                    failures.append(f"round {rnd} {label}: {exc}")
                    print(failures[-1])
                    continue
                row.update(round=rnd, tile=tile_name, target=target, frames_per_append=per_append)
                rows.append(row)
                save()
                print(
                    f"[{rnd}] {label:32} user {row['user_gbps']:.2f} GB/s  stream {row['stream_gbps']:.2f}"
                    f"  create {row['create_s']:.2f} s  out {row['out_bytes'] / 1e9:.2f} GB",
                    flush=True,
                )
                # The last round's stores are read back, then every store goes at once: one
                # store at a time in /dev/shm (16 GiB recordings make 5-8 GB stores).
                store = store_for(target, engine, tile_name)
                if store is None:
                    continue
                if rnd == a.rounds - 1 and not a.no_verify:
                    array = store / "0" if engine == "chucky" else store
                    try:
                        checks[label] = verify(array, bank, frames)
                    except Exception as exc:
                        checks[label] = f"unreadable: {exc}"
                    print(f"read-back {label}: {checks[label]}", flush=True)
                shutil.rmtree(store, ignore_errors=True)
                save()

    table = save()
    print_table(table)
    if failures:
        print(f"{len(failures)} run(s) failed (above)")
    return 1 if failures or any(v != "ok" for v in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
