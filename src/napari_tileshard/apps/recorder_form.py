"""What the recorder's settings form computes, without Qt: the dimension table's text turned into
a :class:`~napari_tileshard.format.layout.Layout` (errors name the row), and the derived figures shown
under the form.

``_qt/settings_form.py`` only moves text between these functions and its widgets, so everything
a user can get wrong is testable without a display.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np

from ..engine.writer import estimate_memory
from ..format.layout import Dim, Layout, TilingWarning, is_valid_name
from .recorder import RecorderSettings
from .units import memory_size

__all__ = [
    "COLUMNS",
    "COLUMN_TIPS",
    "DEFAULT_DIMS",
    "OWN_LAYER_KEY",
    "SYNTHETIC",
    "figures",
    "frame_dims",
    "with_tiling_notes",
    "is_own_layer",
    "layout_from_rows",
    "next_output",
    "proposed_tiling",
    "rows_for_frames",
    "rows_for_layer",
]

SYNTHETIC = "synthetic"
#: the dimension table's headers: short, so that the table fits a dock without scrolling sideways;
#: what each means is in :data:`COLUMN_TIPS` (the headers' tooltips)
COLUMNS = ("dim", "size", "tile", "per shard", "scale", "unit")
COLUMN_TIPS = (
    "dimension name (t, c, z, y, x, ...), slowest first",
    "size along the dimension; 0 = unbounded: the recording appends along it as long as it runs",
    "tile (chunk) size along the dimension: each tile is compressed on its own",
    "tiles per shard along the dimension: a shard is one file holding these tiles",
    "pixel size or frame interval (OME-Zarr axes)",
    "unit, e.g. micrometer, second, µm, ms (OME-Zarr axes; empty: none)",
)
#: the dimension table's first rows: the one default tiling of 1024² uint16 frames
DEFAULT_DIMS = tuple(
    (d.name, d.size, d.tile_size, d.tiles_per_shard, 1.0, "")
    for d in Layout.default_for((0, 1024, 1024), "uint16", ("t", "y", "x")).dims
)
#: the ``metadata`` key that marks the layers this plugin adds (the recorder's preview, the
#: inspector's map): they are views of what was recorded, never sources to record
OWN_LAYER_KEY = "napari_tileshard"


def is_own_layer(layer) -> bool:
    """Whether ``layer`` is one this plugin added (see :data:`OWN_LAYER_KEY`)."""
    return OWN_LAYER_KEY in (getattr(layer, "metadata", None) or {})


def layout_from_rows(rows: Sequence[Sequence[str]], dtype: str, source=None) -> Layout:
    """The Layout described by the table's ``rows`` of text (one per dim, :data:`COLUMNS` order).

    ``source``: the image layer being recorded, or None for the synthetic camera.  A layer
    decides the dtype, and its frames must match the last dims: checked here, because otherwise
    the mismatch would only surface as a Writer error on the first frame.
    """
    names, sizes, tiles, per_shard, axes = [], [], [], [], []
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
        axes.append(Dim(texts[0], size, tile, tps, unit=texts[5] or None, scale=scale))  # the row's own check
        names.append(texts[0])
        sizes.append(size)
        tiles.append(tile)
        per_shard.append(tps)
    if source is not None:
        dtype = np.dtype(source.data.dtype).name
        shape = tuple(np.shape(source.data))
        frame = shape[-frame_dims(len(rows)) :]
        expected = tuple(sizes[-len(frame) :])
        if frame != expected:
            raise ValueError(f"layer {source.name!r} has frames of shape {frame} but the dimensions give {expected}")
    # the table's numbers are asked for as any entry point's: tiles larger than their dim are clamped
    layout = Layout.default_for(sizes, dtype, names, tile=tiles, tiles_per_shard=per_shard)
    return Layout([replace(d, unit=a.unit, scale=a.scale) for d, a in zip(layout.dims, axes)], dtype)


_Result = TypeVar("_Result")


def with_tiling_notes(check: Callable[[], _Result]) -> tuple[_Result, list[str]]:
    """``check()`` (reading and validating the form's settings) and the :class:`TilingWarning`
    notes it raised, each once, in order: what the form shows under its message instead of
    warnings on the console.  Other warnings pass on as they came."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TilingWarning)
        result = check()
    notes = []
    for warning in caught:
        if issubclass(warning.category, TilingWarning):
            notes.append(str(warning.message))
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result, list(dict.fromkeys(notes))


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


def rows_for_layer(rows: Sequence[Sequence[str]], shape: Sequence[int], labels: Sequence[str] = ()) -> list[list[str]]:
    """The table's ``rows`` laid out for a layer of ``shape``: the frame dims as
    :func:`rows_for_frames` does, and for a stack (more dims than a frame) the dims between the
    first and the frame sized as the stack's, so its planes keep their arrangement (a z stack per
    time point stays one): rows named after ``labels`` (the layer's axis labels, where they are
    valid names not in use) are added when the stack has more such dims than the table.  The
    first dim is left as it is (the recording appends along it)."""
    table = rows_for_frames(rows, shape)
    shape = tuple(int(v) for v in shape)
    frame_rank = frame_dims(len(table))
    inner = shape[1 : len(shape) - frame_rank] if len(shape) > frame_rank else ()
    table_inner = len(table) - frame_rank - 1
    if not inner or table_inner > len(inner):
        return table  # a live layer, or a table with more dims than the stack: planes fill it in order
    used = {r[0].strip() for r in table}
    labels = list(labels)[: len(shape)]
    inserted = []
    for axis in range(1, 1 + len(inner) - table_inner):
        label = str(labels[axis]) if axis < len(labels) else ""
        name = (
            label
            if is_valid_name(label) and label not in used
            else next(n for n in ("z", "c", *(f"d{k}" for k in range(1, 64))) if n not in used)
        )
        used.add(name)
        inserted.append([name, "1", "1", "1", "1.0", ""])
    table[1:1] = inserted
    for row, size in zip(table[1 : 1 + len(inner)], inner):
        row[1:4] = [str(size), "1", "1"] if row[1].strip() != str(size) else row[1:4]
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
    files_per_gb = layout.files_per_gb  # the figure the tiling's notes warn about
    pyramid = settings.pyramid()
    memory = estimate_memory(layout, pyramid=pyramid)
    levels = f" · {pyramid.levels} pyramid levels, smallest {pyramid.layouts[-1].shape[-2:]}" if settings.ome else ""
    return (
        f"tile {memory_size(layout.tile_bytes)} · shard {memory_size(shard_bytes)} ({layout.chunks_per_shard} tiles) · "
        f"{layout.tiles_per_epoch} tiles and {layout.inner_shard_count} shards per epoch "
        f"({memory_size(layout.epoch_bytes)}) · {files_per_gb:,.1f} files/GB{levels} · "
        f"host ≈ {memory_size(memory['cpu_host'])} (CPU backend) or {memory_size(memory['gpu_host'])} + "
        f"GPU ≈ {memory_size(memory['gpu_device'])} (GPU backend)"
    )
