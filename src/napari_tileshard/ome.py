"""OME-Zarr 0.5 output with a multiscale pyramid built while recording (first version, issue 6).

``OmeWriter`` writes a Zarr v3 group whose ``zarr.json`` carries ``attributes.ome`` (OME-NGFF
0.5 ``multiscales``) and one sharded array per level at ``0``, ``1``, ...  Each level is an ordinary
:class:`~napari_tileshard.writer.Writer`; level ``k`` receives the frames of level ``k-1``
reduced 2x over the last two (spatial) dims as they arrive, so every level grows along the
append dim with level 0.  The reduction runs in NumPy on the producer's thread (the GPU-side
reduction of issue 6 is still to do).

Reductions over each 2x2 block of pixels that lie inside the frame (edge blocks of odd sizes have
fewer): ``mean`` (integers rounded half to even), ``max``, ``min``, ``decimate`` (top-left pixel).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .layout import Dim, Layout
from .store import DirectorySink
from .writer import Writer

DOWNSAMPLE = ("mean", "max", "min", "decimate")
_KINDS = {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}


def reduce2x(frames: np.ndarray, method: str) -> np.ndarray:
    """Reduce the last two dims 2x (ceil) with ``method``: the NumPy definition of a level."""
    if method not in DOWNSAMPLE:
        raise ValueError(f"downsample {method!r} is not one of {', '.join(DOWNSAMPLE)}")
    if method == "decimate":
        return np.ascontiguousarray(frames[..., ::2, ::2])
    h, w = frames.shape[-2:]
    ph, pw = h + h % 2, w + w % 2
    lead = frames.shape[:-2]
    if method == "mean":
        padded = np.zeros(lead + (ph, pw), dtype=np.float64)
        counts = np.zeros((ph, pw), dtype=np.float64)
        padded[..., :h, :w] = frames
        counts[:h, :w] = 1
        sums = padded.reshape(lead + (ph // 2, 2, pw // 2, 2)).sum(axis=(-3, -1))
        n = counts.reshape(ph // 2, 2, pw // 2, 2).sum(axis=(-3, -1))
        mean = sums / n
        return (np.rint(mean) if frames.dtype.kind in "iu" else mean).astype(frames.dtype)
    fill = np.iinfo(frames.dtype).min if method == "max" else np.iinfo(frames.dtype).max
    if frames.dtype.kind == "f":
        fill = -np.inf if method == "max" else np.inf
    padded = np.full(lead + (ph, pw), fill, dtype=frames.dtype)
    padded[..., :h, :w] = frames
    blocks = padded.reshape(lead + (ph // 2, 2, pw // 2, 2))
    return (blocks.max(axis=(-3, -1)) if method == "max" else blocks.min(axis=(-3, -1))).astype(frames.dtype)


def level_layouts(layout: Layout, max_levels: int | None = None) -> list[Layout]:
    """Level 0 and the 2x-reduced levels, until a level's frame fits one tile (or ``max_levels``)."""
    if layout.rank < 3:
        raise ValueError("a pyramid needs at least 3 dims (append dim + two spatial dims)")
    levels = [layout]
    while max_levels is None or len(levels) < max_levels:
        last = levels[-1]
        if all(d.size <= d.tile_size for d in last.dims[-2:]):
            break
        dims = list(last.dims[:-2]) + [Dim(d.name, math.ceil(d.size / 2), min(d.tile_size, math.ceil(d.size / 2)),
                                           d.tiles_per_shard) for d in last.dims[-2:]]
        levels.append(Layout(dims, layout.dtype))
    return levels


class OmeWriter:
    """Record into an OME-Zarr 0.5 group with a pyramid; same append()/close() as Writer."""

    def __init__(self, path, layout: Layout, *, downsample: str = "mean", max_levels: int | None = None,
                 units: dict | None = None, scale: dict | None = None, attributes: dict | None = None,
                 overwrite: bool = False, **writer_options):
        if downsample not in DOWNSAMPLE:
            raise ValueError(f"downsample {downsample!r} is not one of {', '.join(DOWNSAMPLE)}")
        if attributes is not None:
            json.dumps(attributes)  # must be JSON-serialisable (raises TypeError naming the value)
        self.downsample = downsample
        self.layouts = level_layouts(layout, max_levels)
        self._sink = DirectorySink(path, overwrite)
        self.root = self._sink.root
        self._units = dict(units or {})
        self._scale = dict(scale or {})
        self._attributes = dict(attributes or {})
        self._write_group()
        self.levels = [Writer(self.root / str(k), lay, overwrite=True, **writer_options)
                       for k, lay in enumerate(self.layouts)]

    def _axes(self):
        axes = []
        for name in self.layouts[0].names:
            axis = {"name": name, "type": _KINDS.get(name, "space" if name in self.layouts[0].names[-2:] else "other")}
            if name in self._units:
                axis["unit"] = self._units[name]
            axes.append(axis)
        return axes

    def _write_group(self) -> None:
        base = [float(self._scale.get(name, 1.0)) for name in self.layouts[0].names]
        datasets = []
        for k in range(len(self.layouts)):
            factor = [1.0] * (len(base) - 2) + [2.0**k, 2.0**k]
            datasets.append({"path": str(k), "coordinateTransformations": [
                {"type": "scale", "scale": [b * f for b, f in zip(base, factor)]}]})
        ome = {"version": "0.5", "multiscales": [{"name": self.root.name, "axes": self._axes(), "datasets": datasets}]}
        group = {"zarr_format": 3, "node_type": "group", "attributes": {**self._attributes, "ome": ome}}
        self._sink.write("zarr.json", [json.dumps(group, indent=2).encode()])

    def append(self, frames) -> None:
        for k, writer in enumerate(self.levels):
            if k:
                frames = reduce2x(np.asarray(frames), self.downsample)
            writer.append(frames)

    def close(self) -> None:
        errors = []
        for writer in self.levels:
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001 - close every level, then report
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def path(self) -> Path:
        return self.root
