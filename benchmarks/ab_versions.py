"""Two versions of the package side by side: byte-identical stores and throughput A/B.

Run it once per version with that version's ``src`` first on ``PYTHONPATH`` (the old one from
``git archive <commit> src``); it uses only the API both have (``Writer(path, layout, codec=,
level=, backend=, ome=)``, ``ShardReader(path, backend=)``).

    PYTHONPATH=old/src python benchmarks/ab_versions.py hash --backend gpu --out /dev/shm/a > old.json
    PYTHONPATH=src     python benchmarks/ab_versions.py hash --backend gpu --out /dev/shm/b > new.json
    python benchmarks/ab_versions.py compare old.json new.json
    PYTHONPATH=src python benchmarks/ab_versions.py speed --backend gpu --gib 2   # write + read GB/s

``hash``: stores of several layouts (edge tiles, deep tiles, 4-D, a bounded array), codecs (zstd,
none, blosc-lz4 on the CPU) and OME pyramids, every file's sha256.  ``speed``: the user's clock,
from ``Writer(...)`` to ``close()`` and from ``ShardReader(...)`` to the last byte, for 64 KiB and
256 KiB tiles in 4 MiB shards and 1 MiB tiles in 16 MiB shards, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from napari_tileshard import Dim, Layout, ShardReader, SyntheticCamera, Writer

HASH_CASES = [
    # name, dims (name, size, tile, tiles per shard), dtype, codecs, ome
    ("edge", [("t", 0, 2, 2), ("y", 300, 128, 2), ("x", 400, 128, 2)], "uint16", ("zstd", "none", "blosc-lz4"), False),
    ("deep", [("t", 0, 8, 1), ("y", 512, 256, 2), ("x", 512, 256, 2)], "uint16", ("zstd",), True),
    ("4d", [("t", 0, 1, 2), ("z", 3, 1, 3), ("y", 256, 128, 2), ("x", 256, 64, 4)], "uint8", ("zstd",), False),
    ("bounded", [("t", 24, 4, 2), ("y", 256, 256, 1), ("x", 384, 128, 3)], "float32", ("zstd", "none"), True),
]
SPEED_CASES = [  # name, tile (t, y, x), tiles per shard: 2048² uint16 frames
    ("64KiB-tiles/4MiB-shards", (2, 128, 128), (1, 8, 8)),
    ("256KiB-tiles/4MiB-shards", (2, 256, 256), (1, 4, 4)),
    ("1MiB-tiles/16MiB-shards", (8, 256, 256), (1, 4, 4)),
]


def layout_of(dims, dtype) -> Layout:
    return Layout([Dim(n, s, t, p) for n, s, t, p in dims], dtype)


def hash_stores(backend: str, out: Path) -> dict[str, str]:
    digests = {}
    for name, dims, dtype, codec_names, ome in HASH_CASES:
        layout = layout_of(dims, dtype)
        frame = tuple(d[1] for d in dims[1:])
        camera = SyntheticCamera(frame, dtype, seed=3)
        rows = dims[0][1] or 20
        for codec in codec_names:
            if backend == "gpu" and codec == "blosc-lz4":
                continue
            for pyramid in (False, True) if ome else (False,):
                store = out / f"{name}-{codec}-{'ome' if pyramid else 'array'}.zarr"
                shutil.rmtree(store, ignore_errors=True)
                with Writer(store, layout, codec=codec, level=1, backend=backend, ome=pyramid) as writer:
                    writer.append(np.stack(list(camera.frames(rows))))
                for path in sorted(store.rglob("*")):
                    if path.is_file() and not path.name.startswith("."):
                        digests[str(path.relative_to(out))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def speed(backend: str, gib: float, repeat: int, out: Path) -> list[dict]:
    camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
    frames = max(16, int(gib * 2**30 // camera.frame_bytes))
    bank = np.stack(list(camera.frames(64)))
    results = []
    for name, tile, per_shard in SPEED_CASES:
        layout = layout_of(
            [("t", 0, tile[0], per_shard[0]), ("y", 2048, tile[1], per_shard[1]), ("x", 2048, tile[2], per_shard[2])],
            "uint16",
        )
        store = out / f"speed-{name.split('/')[0]}.zarr"
        writes, reads, reads_device = [], [], []
        for _ in range(repeat):
            shutil.rmtree(store, ignore_errors=True)
            start = time.perf_counter()
            with Writer(store, layout, codec="zstd", level=1, backend=backend) as writer:
                for k in range(0, frames, 16):
                    writer.append(bank[k % 64 : k % 64 + 16])
            writes.append(frames * camera.frame_bytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            reader = ShardReader(str(store), backend=backend)
            data = reader[...]
            reads.append(data.nbytes / (time.perf_counter() - start) / 1e9)
            del data
            if backend == "gpu":
                start = time.perf_counter()
                reader = ShardReader(str(store), backend="gpu")
                device = reader.read(..., device=True)
                nbytes = int(device.nbytes)
                device.device.synchronize()
                reads_device.append(nbytes / (time.perf_counter() - start) / 1e9)
                del device
        results.append(
            {
                "case": name,
                "frames": frames,
                "write_gbps": max(writes),
                "read_numpy_gbps": max(reads),
                "read_device_gbps": max(reads_device) if reads_device else None,
            }
        )
        shutil.rmtree(store, ignore_errors=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("hash", "speed", "compare"))
    parser.add_argument("files", nargs="*", help="compare: the two JSON files of hash runs")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--out", default="/dev/shm/tileshard-ab")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    if args.mode == "compare":
        old, new = (json.loads(Path(f).read_text()) for f in args.files)
        differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        print(json.dumps({"files": len(old), "identical": len(old) - len(differ), "differ": differ[:20]}))
        return 1 if differ or not old else 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "hash":
        print(json.dumps(hash_stores(args.backend, out)))
    else:
        print(json.dumps(speed(args.backend, args.gib, args.repeat, out)))
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
