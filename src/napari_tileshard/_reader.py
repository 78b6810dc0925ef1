"""napari reader: any Zarr v3 array (or a group's arrays), opened lazily with its axis names."""

from __future__ import annotations

import json
from pathlib import Path


def _is_zarr_v3(path: Path) -> bool:
    try:
        meta = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("zarr_format") == 3


def napari_get_reader(path):
    """Return a reader for a Zarr v3 store path, or None so that other readers get their turn."""
    if isinstance(path, list):
        path = path[0] if len(path) == 1 else None
    if not isinstance(path, (str, Path)):
        return None
    path = Path(path)
    return read_zarr if path.is_dir() and _is_zarr_v3(path) else None


def open_lazy(path):
    """The array (or first array of a group) at ``path``, lazily, with its dimension names."""
    import zarr

    node = zarr.open(str(path), mode="r")
    if isinstance(node, zarr.Group):
        arrays = sorted(node.arrays(), key=lambda kv: kv[0])
        if not arrays:
            return None, None
        node = arrays[0][1]
    names = node.metadata.dimension_names if node.metadata.zarr_format == 3 else None
    return node, (list(names) if names and all(names) else None)


MAX_DISPLAY_SLICE_BYTES = 1 << 30


def read_zarr(path):
    path = Path(path[0] if isinstance(path, list) else path)
    from .ome import open_levels

    levels = open_levels(path)
    if levels:  # OME-Zarr: one multiscale layer; napari reads only the level it displays
        check_displayable(levels[-1], path)
        names = levels[0].metadata.dimension_names
        meta = _meta(path, list(names) if names and all(names) else None)
        meta["multiscale"] = True
        scale = _level0_scale(path)
        if scale and len(scale) == levels[0].ndim:
            meta["scale"] = scale
        # Lazy (dask): napari's multiscale slicing crops every row of a level before picking one.
        import dask.array as da

        return [([da.from_array(level, chunks=level.shards or level.chunks) for level in levels], meta, "image")]
    array, names = open_lazy(path)
    if array is not None:
        check_displayable(array, path)
    if array is None or 0 in array.shape:
        return [] if array is None else [(_empty_like(array), _meta(path, names), "image")]
    return [(array, _meta(path, names), "image")]


def check_displayable(array, path) -> None:
    """napari reads a whole 2-D slice at full resolution: refuse declared frames too large for that
    (a corrupted or hostile zarr.json must not make the viewer allocate its declared size)."""
    import math

    import numpy as np

    plane = array.shape[-2:] if array.ndim >= 2 else array.shape
    nbytes = math.prod(plane) * np.dtype(array.dtype).itemsize
    if nbytes > MAX_DISPLAY_SLICE_BYTES:
        raise ValueError(f"{path}: frames of shape {tuple(plane)} ({nbytes / 2**30:.1f} GiB each) are too large "
                         f"to display without a multiscale pyramid (limit {MAX_DISPLAY_SLICE_BYTES >> 20} MiB)")


def _level0_scale(path: Path):
    """Level 0's OME scale transformation (pixel size, frame interval), or None."""
    import zarr

    try:
        transforms = zarr.open_group(str(path), mode="r").attrs["ome"]["multiscales"][0]["datasets"][0][
            "coordinateTransformations"]
        return [float(v) for v in next(t["scale"] for t in transforms if t.get("type") == "scale")]
    except (KeyError, IndexError, TypeError, ValueError, StopIteration):
        return None


def _meta(path: Path, names):
    meta = {"name": path.stem, "metadata": {"path": str(path)}}
    if names:
        meta["axis_labels"] = names
    return meta


def _empty_like(array):
    import numpy as np

    # napari cannot show a zero-length axis: a single fill-value frame stands in until data arrives.
    return np.zeros((1,) + tuple(max(1, s) for s in array.shape[1:]), dtype=array.dtype)
