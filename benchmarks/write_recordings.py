"""Write camera recordings of the CPU table's layouts (``cpu_many_cores.layouts``: 64k-4m, 256k-4m,
1m-16m, default) and of ``bench_read.TILES`` (e.g. 256k: 8 x 128² tiles in 16 MiB shards), for
the read A/Bs that take ``--path``.  ``--backend cpu`` (default) writes libzstd's level-1 frames,
as a CPU user's recording; ``auto`` is the GPU backend where there is one (nvCOMP's frames, which
a CPU decodes at about a third of the rate: ``results/cpu_16core_2026-11-28b/`` call m).

    python benchmarks/write_recordings.py --dir /dev/shm/rec --gib 2 --layouts 64k-4m,1m-16m,256k,default
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_read import TILES  # noqa: E402
from cpu_many_cores import FRAME, gigabytes, layouts, make_layout, write_recording  # noqa: E402

from napari_tileshard import SyntheticCamera  # noqa: E402


def layout_of(name: str, frames: int):
    """The named layout for ``frames`` frames (rounded down to whole tile epochs)."""
    if name in layouts():
        tile, per_shard = layouts()[name]
    elif name in TILES:
        tile = TILES[name]
        per_shard = (1, max(1, 1024 // tile[1]), max(1, 1024 // tile[2]))
    else:
        raise SystemExit(f"unknown layout {name!r}; known: {', '.join([*layouts(), *TILES])}")
    return make_layout(tile, per_shard, max(tile[0], frames - frames % tile[0]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--layouts", default="64k-4m,256k-4m,1m-16m,default")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "auto", "gpu"])
    args = parser.parse_args(argv)
    camera = SyntheticCamera(FRAME, "uint16")
    frames = int(args.gib * 2**30 // camera.frame_bytes)
    args.dir.mkdir(parents=True, exist_ok=True)
    for name in args.layouts.split(","):
        layout = layout_of(name, frames)
        write_recording(camera, layout, layout.shape[0], args.dir / f"{name}.zarr", backend=args.backend)
        print(f"{name}: {layout.shape[0]} frames, {gigabytes(layout.shape[0]):.2f} GB, tiles {layout.tile_shape}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
