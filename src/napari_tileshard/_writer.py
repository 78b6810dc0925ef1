"""napari writer: "Save as sharded Zarr" for image layers, through the same Writer."""

from __future__ import annotations

import numpy as np

from .layout import Dim, Layout, is_valid_name
from .writer import Writer

# The recorder widget puts its last valid settings here, so File > Save uses the same tiling.
last_settings = None


def default_layout(shape, dtype, names=None) -> Layout:
    """Tiles of up to 256 px in the last two dims and 32 along the first, 4x4 tiles per shard."""
    rank = len(shape)
    names = list(names) if names and len(names) == rank else [f"d{i}" for i in range(rank)]
    dims = []
    for d, (name, size) in enumerate(zip(names, shape)):
        if d >= rank - 2:
            dims.append(Dim(name, size, min(256, size), 4))
        elif d == 0:
            dims.append(Dim(name, size, min(32, size), 1))
        else:
            dims.append(Dim(name, size, 1, 1))
    return Layout(dims, np.dtype(dtype).name)


def _safe_name(name, i):
    return name if is_valid_name(name) else f"d{i}"


def write_image(path: str, data, meta: dict) -> list[str]:
    array = np.asarray(data)
    if array.dtype == np.bool_:
        array = array.astype(np.uint8)
    names = [_safe_name(n, i) for i, n in enumerate(meta.get("axis_labels") or [])] or None
    layout = None
    if last_settings is not None and last_settings.layout is not None:
        candidate = last_settings.layout
        if candidate.rank == array.ndim and all(s in (0, a) for s, a in zip(candidate.shape, array.shape)):
            layout = Layout([Dim(d.name, a, d.tile_size, d.tiles_per_shard) for d, a in zip(candidate.dims, array.shape)],
                            array.dtype.name)
    layout = layout or default_layout(array.shape, array.dtype, names)
    codec = getattr(last_settings, "codec", "zstd")
    level = getattr(last_settings, "level", 1)
    backend = getattr(last_settings, "backend", "auto")
    with Writer(path, layout, codec=codec, level=level, backend=backend, overwrite=True) as writer:
        step = max(1, (64 << 20) // max(1, array[0].nbytes if array.ndim else 1))
        for start in range(0, array.shape[0] if array.ndim else 1, step):
            writer.append(np.ascontiguousarray(array[start:start + step]))
    return [path]
