"""napari writer: "Save as sharded Zarr" for image layers, through the same Writer.

What File > Save writes depends only on the layer: the one default tiling
(:meth:`~napari_tileshard.format.layout.Layout.default_for`) over its shape, zstd
level 1, backend ``auto``.  It deliberately ignores the recorder dock's settings: a Save whose
tiling changed with whichever recording was configured last could not be predicted or repeated.
"""

from __future__ import annotations

import numpy as np

from ..engine.writer import Writer
from ..format.layout import Layout, is_valid_name

__all__ = ["write_image"]


def _safe_name(name, i):
    return name if is_valid_name(name) else f"d{i}"


def write_image(path: str, data, meta: dict) -> list[str]:
    array = np.asarray(data)
    if array.dtype == np.bool_:
        array = array.astype(np.uint8)
    names = [_safe_name(n, i) for i, n in enumerate(meta.get("axis_labels") or [])] or None
    layout = Layout.default_for(array.shape, array.dtype, names)
    with Writer(path, layout, codec="zstd", level=1, backend="auto", overwrite=True) as writer:
        step = max(1, (64 << 20) // max(1, array[0].nbytes if array.ndim else 1))
        for start in range(0, array.shape[0] if array.ndim else 1, step):
            writer.append(np.ascontiguousarray(array[start : start + step]))
    return [path]
