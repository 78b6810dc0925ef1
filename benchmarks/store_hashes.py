"""Hash every file of stores written from the same input: the byte-identity check of a change.

Writes a fixed set of layouts and dtypes (edge shards, shallow and deep tiles, shards split
along y, several tile epochs per shard, a 4-D array, a pyramid, a partial last epoch, a flush)
with one backend and prints one SHA-256 per case over every file's relative path and bytes.
Run it on the code before and after a change and diff the output:

    PYTHONPATH=src python benchmarks/store_hashes.py --out /tmp/hashes > after.txt
    PYTHONPATH=src python benchmarks/store_hashes.py --recorder ...   # also through the recorder
    PYTHONPATH=src python benchmarks/store_hashes.py --bench-frames 64 ...   # and the CPU benchmark's layouts
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from pathlib import Path

import numpy as np

# This checkout's code, unless PYTHONPATH names another copy of the package (an A/B against the
# code before runs this same script with PYTHONPATH=/path/to/before/src)
if not any((Path(p) / "napari_tileshard").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout, SyntheticCamera, Writer


def cases():
    """(name, layout, frames of input, writer keywords, flush after this many frames or None)."""

    def frame_layout(dtype, frame, tile, per_shard, frames=0, shard_t=1):
        return Layout(
            [
                Dim("t", frames, tile[0], shard_t),
                Dim("y", frame[0], tile[1], per_shard[0]),
                Dim("x", frame[1], tile[2], per_shard[1]),
            ],
            dtype,
        )

    yield "u16-64k-d2", frame_layout("uint16", (1024, 1024), (2, 128, 128), (8, 8)), 12, {}, None
    yield "u16-1m-deep", frame_layout("uint16", (1024, 1024), (32, 128, 128), (8, 8)), 40, {}, None
    yield "u16-edges", frame_layout("uint16", (1000, 1300), (4, 96, 160), (4, 3)), 22, {}, None
    yield "u16-shard-t3", frame_layout("uint16", (512, 768), (2, 128, 128), (2, 4), shard_t=3), 17, {}, None
    yield "u8-edges", frame_layout("uint8", (700, 900), (3, 128, 256), (2, 2)), 13, {}, None
    yield "f32-bounded", frame_layout("float32", (512, 512), (4, 64, 64), (4, 4), frames=30), 30, {}, None
    yield "u16-level5", frame_layout("uint16", (512, 512), (2, 128, 128), (2, 2)), 10, {"level": 5}, None
    yield "u16-ome", frame_layout("uint16", (1024, 1024), (2, 128, 128), (4, 4)), 14, {"ome": True}, None
    yield "u16-flush", frame_layout("uint16", (512, 512), (4, 128, 128), (2, 2)), 18, {}, 7
    yield (
        "u16-4d",
        Layout([Dim("t", 0, 2, 1), Dim("c", 3, 1, 3), Dim("y", 300, 64, 4), Dim("x", 500, 128, 2)], "uint16"),
        9,
        {},
        None,
    )


def benchmark_cases(frames: int):
    """The CPU write benchmark's layouts (``ab_cpu_write.py``): 2048² uint16 frames of the
    synthetic camera, 64 KiB 2 x 128² and 256 KiB 2 x 256² tiles in 4 MiB shards, 1 MiB 8 x 256²
    tiles in 16 MiB shards, and the default tiling; ``frames`` frames each."""

    def frame_layout(tile, per_shard):
        return Layout([Dim("t", 0, tile[0], 1), Dim("y", 2048, tile[1], per_shard), Dim("x", 2048, tile[2], per_shard)])

    yield "bench-64k-d2", frame_layout((2, 128, 128), 8), frames, {}, None
    yield "bench-256k-d2", frame_layout((2, 256, 256), 4), frames, {}, None
    yield "bench-1m-d8", frame_layout((8, 256, 256), 4), frames, {}, None
    yield "bench-default", Layout.default_for((0, 2048, 2048), "uint16"), frames, {}, None


def frames_for(layout, count: int, seed: int) -> np.ndarray:
    shape = tuple(layout.shape[1:])
    if layout.dtype == np.uint16 and len(shape) == 2:
        camera = SyntheticCamera(shape, "uint16", seed=seed)
        return np.stack(list(camera.frames(count)))
    rng = np.random.default_rng(seed)
    data = rng.gamma(2.0, 40.0, size=(count, *shape))  # compressible, like a camera's counts
    return data.astype(layout.dtype)


def store_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tileshard")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def recorder_cases():
    """(name, RecorderSettings keywords, synthetic frames): recordings through the Qt-free recorder
    with its synthetic camera (its frames, its batching and its clock are what differs from a
    plain Writer)."""
    yield "rec-default", {"layout": Layout.default_for((0, 512, 640), "uint16", ("t", "y", "x"))}, 37
    yield "rec-ome", {"layout": Layout.default_for((0, 384, 384), "uint16", ("t", "y", "x")), "ome": True}, 21
    deep = Layout([Dim("t", 0, 8, 2), Dim("y", 300, 128, 2), Dim("x", 500, 128, 2)], "uint16")
    yield "rec-deep", {"layout": deep, "seed": 7}, 45


def record(store: Path, backend: str, keywords: dict, frames: int) -> None:
    from napari_tileshard.apps.recorder import Recorder, RecorderSettings

    settings = RecorderSettings(
        output=str(store), backend=backend, fps=None, policy="block", overwrite=True, **keywords
    )
    stats = Recorder(settings).start(synthetic_frames=frames).join()
    if stats.error or stats.frames != frames:
        raise RuntimeError(f"{store}: recorded {stats.frames} of {frames} frames: {stats.error}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--out", default="/tmp/tileshard-hashes")
    parser.add_argument("--threads", type=int, default=None, help="CPU backend threads (default: all cores)")
    parser.add_argument("--recorder", action="store_true", help="also recordings through the recorder's loop")
    parser.add_argument(
        "--bench-frames",
        type=int,
        default=0,
        help="also this many 2048² frames through each layout of the CPU write benchmark (ab_cpu_write.py)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    for name, layout, count, keywords, flush_at in [
        *cases(),
        *(benchmark_cases(args.bench_frames) if args.bench_frames else ()),
    ]:
        frames = frames_for(layout, count, seed=len(name))
        store = out / f"{name}.zarr"
        shutil.rmtree(store, ignore_errors=True)
        options = {"threads": args.threads} if args.threads else {}
        with Writer(store, layout, backend=args.backend, overwrite=True, **options, **keywords) as writer:
            for i, frame in enumerate(frames):
                writer.append(frame)
                if flush_at is not None and i + 1 == flush_at:
                    writer.flush()
        print(f"{name:14s} {store_hash(store)}", flush=True)
        shutil.rmtree(store, ignore_errors=True)
    for name, keywords, count in recorder_cases() if args.recorder else ():
        store = out / f"{name}.zarr"
        shutil.rmtree(store, ignore_errors=True)
        record(store, args.backend, keywords, count)
        print(f"{name:14s} {store_hash(store)}", flush=True)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
