"""What the recorder's settings form computes, without Qt: the dimension table's text turned into
a :class:`~napari_tileshard.format.layout.Layout` (errors name the row), and the derived figures shown
under the form.

``_qt/settings_form.py`` only moves text between these functions and its widgets, so everything
a user can get wrong is testable without a display.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..engine.writer import estimate_memory
from ..format.layout import Dim, Layout
from .recorder import RecorderSettings

SYNTHETIC = "synthetic"
COLUMNS = ("name", "size (0 = unbounded)", "tile", "tiles/shard", "scale", "unit")
#: the dimension table's first rows: the one default tiling of 1024² uint16 frames
DEFAULT_DIMS = tuple(
    (d.name, d.size, d.tile_size, d.tiles_per_shard, 1.0, "")
    for d in Layout.default_for((0, 1024, 1024), "uint16", ("t", "y", "x")).dims
)


def layout_from_rows(rows: Sequence[Sequence[str]], dtype: str, source=None) -> Layout:
    """The Layout described by the table's ``rows`` of text (one per dim, :data:`COLUMNS` order).

    ``source``: the image layer being recorded, or None for the synthetic camera.  A layer
    decides the dtype, and its frames must match the last dims: checked here, because otherwise
    the mismatch would only surface as a Writer error on the first frame.
    """
    dims = []
    for row, texts in enumerate(rows):
        texts = [t.strip() for t in texts]
        try:
            size, tile, tps = (int(t) for t in texts[1:4])
        except ValueError:
            raise ValueError(
                f"row {row + 1} ({texts[0] or '?'}): size, tile and tiles/shard must be integers, got {texts[1:4]}"
            ) from None
        try:
            scale = float(texts[4]) if texts[4] else 1.0
        except ValueError:
            raise ValueError(f"row {row + 1} ({texts[0] or '?'}): scale must be a number, got {texts[4]!r}") from None
        dims.append(Dim(texts[0], size, tile, tps, unit=texts[5] or None, scale=scale))
    if source is not None:
        dtype = np.dtype(source.data.dtype).name
        shape = tuple(np.shape(source.data))
        frame = shape[-frame_dims(len(dims)) :]
        expected = tuple(d.size for d in dims[-len(frame) :])
        if frame != expected:
            raise ValueError(f"layer {source.name!r} has frames of shape {frame} but the dimensions give {expected}")
    return Layout(dims, dtype)


def frame_dims(rank: int) -> int:
    """How many trailing dims a frame spans: the last two for rank >= 3, the last one otherwise."""
    return 2 if rank >= 3 else 1


def proposed_tiling(size: int) -> tuple[int, int]:
    """(tile, tiles per shard) for a frame dim of ``size``, as the one default tiling
    (:meth:`Layout.default_for`) has it: tiles of at most 256 (the whole dim when smaller), up to
    4 of them per shard."""
    dim = Layout.default_for((size,), "uint8").dims[0]  # a frame dim of the one default tiling
    return dim.tile_size, dim.tiles_per_shard


def rows_for_frames(rows: Sequence[Sequence[str]], frame_shape: Sequence[int]) -> list[list[str]]:
    """The table's ``rows`` with the frame dims resized to ``frame_shape`` (a layer's frames) and
    tiles proposed to fit; other dims, names, scales and units stay as the user set them."""
    table: list[list[str]] = [list(r) for r in rows]
    n = frame_dims(len(table))
    frame = tuple(int(v) for v in frame_shape)[-n:]
    for row, size in zip(table[-n:], frame):
        tile, per_shard = proposed_tiling(size)
        row[1:4] = [str(size), str(tile), str(per_shard)]
    return table


def next_output(path: str) -> str:
    """A fresh name for the next recording after ``path``: ``recording.zarr`` -> ``recording-002.zarr``,
    ``recording-002.zarr`` -> ``recording-003.zarr``, skipping names that exist."""
    from pathlib import Path

    p = Path(path)
    suffix = "".join(p.suffixes[-2:]) if p.name.endswith(".ome.zarr") else p.suffix
    stem = p.name[: len(p.name) - len(suffix)] if suffix else p.name
    base, _, number = stem.rpartition("-")
    if not (base and number.isdigit()):
        base, number = stem, "1"
    n = int(number) + 1
    while (p.parent / f"{base}-{n:03d}{suffix}").exists():
        n += 1
    return str(p.parent / f"{base}-{n:03d}{suffix}")


def figures(settings: RecorderSettings) -> str:
    """One line of what the settings imply: tile/shard/epoch sizes, files per GB, pyramid, memory."""
    layout = settings.checked_layout()
    shard_bytes = layout.chunks_per_shard * layout.tile_bytes
    files_per_gb = 1e9 / shard_bytes
    pyramid = settings.pyramid()
    memory = estimate_memory(layout, pyramid=pyramid)
    levels = f" · {pyramid.levels} pyramid levels, smallest {pyramid.layouts[-1].shape[-2:]}" if settings.ome else ""
    return (
        f"tile {size_text(layout.tile_bytes)} · shard {size_text(shard_bytes)} ({layout.chunks_per_shard} tiles) · "
        f"{layout.tiles_per_epoch} tiles and {layout.inner_shard_count} shards per epoch "
        f"({size_text(layout.epoch_bytes)}) · {files_per_gb:.1f} files/GB{levels} · "
        f"host ≈ {size_text(memory['cpu_host'])} (CPU backend) or {size_text(memory['gpu_host'])} + "
        f"GPU ≈ {size_text(memory['gpu_device'])} (GPU backend)"
    )


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
