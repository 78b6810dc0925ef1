"""Run the GPU stages' kernels (``backends/stages/``) and one nvCOMP batch per layout, through the
GPU backend, for compute-sanitizer:

    compute-sanitizer --tool memcheck python3 scripts/sanitize_kernels.py

Layouts include edge tiles, edge shards, rank 1 and rank 4, and every element size; the
pyramid cases run the reduce kernels (odd sizes, a partial last epoch, reduction along t).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import Dim, Layout
from napari_tileshard.engine.backends import select_backend
from napari_tileshard.format.pyramid import plan_pyramid

LAYOUTS = [
    Layout([Dim("t", 0, 3, 2), Dim("y", 37, 8, 3), Dim("x", 29, 16, 1)], "uint16"),
    Layout([Dim("x", 0, 7, 1)], "uint8"),
    Layout([Dim("t", 0, 2, 1), Dim("z", 5, 2, 2), Dim("y", 9, 4, 1), Dim("x", 11, 4, 2)], "float32"),
    Layout([Dim("t", 0, 4, 1), Dim("y", 64, 64, 1), Dim("x", 64, 32, 2)], "float64"),
]

for layout in LAYOUTS:
    for codec in ("zstd", "none"):
        backend = select_backend("gpu", layout, codec, 1)
        staging = backend.allocate_staging(2 * layout.epoch_bytes)
        staging[:] = np.random.default_rng(0).integers(0, 8, staging.nbytes, dtype=np.uint8)
        (epochs,) = backend.result(backend.submit(staging, 2))
        backend.close()
        assert len(epochs) == 2
PYRAMIDS = [
    plan_pyramid(Layout([Dim("t", 0, 2, 1), Dim("y", 37, 8, 2), Dim("x", 29, 8, 2)], "uint16"), "mean"),
    plan_pyramid(
        Layout([Dim("t", 0, 4, 1), Dim("z", 5, 2, 2), Dim("y", 12, 4, 1), Dim("x", 10, 4, 2)], "float16"),
        "max",
        ("t", "z", "y", "x"),
    ),
    plan_pyramid(Layout([Dim("t", 0, 2, 1), Dim("y", 33, 8, 1), Dim("x", 17, 8, 1)], "int32"), "min"),
]
for pyramid in PYRAMIDS:
    layout = pyramid.layouts[0]
    backend = select_backend("gpu", layout, "zstd", 1, pyramid=pyramid)
    staging = backend.allocate_staging(2 * layout.epoch_bytes)
    staging[:] = np.random.default_rng(1).integers(0, 8, staging.nbytes, dtype=np.uint8)
    levels = backend.result(backend.submit(staging, 2, rows=2 * layout.epoch_rows - 1))
    backend.close()
    assert len(levels) == pyramid.levels
print("kernels ran on", len(LAYOUTS), "layouts x 2 codecs and", len(PYRAMIDS), "pyramids")
