"""napari reader: any Zarr v3 array (or a group's arrays), opened lazily with its axis names.

napari offers every path a user drops to every reader, so ``napari_get_reader`` must decide
without trusting the path: it reads ``zarr.json`` through :mod:`napari_tileshard.storage.safe_read`
(regular file inside the store, capped size and nesting) and answers None for anything else,
never raising and never blocking.  Arrays are then built from that checked metadata over a
store that reads only regular files inside the store.

An array written by the Writer records in its attributes how many rows along dim 0 are fully
on disk (``tileshard.rows_written``); a bounded array's shape is its declared size from the
start, so after a crash the rows past ``rows_written`` would show as fill value: only the
written rows are shown, and the layer metadata says so.

A collection (``bioformats2raw.layout``: a :class:`MultiWriter` run, a :class:`TileShardSink` MDA,
bioformats2raw's output) opens as one image layer per image, each read as the image alone would be,
named after its stream or series, with its channel axis split into one layer per channel (named,
coloured and windowed from ``omero``); nodes beside the images that are not images (the sink's
``frame_metadata`` tables) are never shown.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..format.ome import channel_axis, image_axes, omero_channels
from ..reader.collection import CollectionImage, images_of
from ..reader.levels import _levels
from ..reader.settings import cache_bytes_setting, reader_setting
from ..reader.shard_reader import ShardReader
from ..storage.object_store import is_object_store_url
from ..storage.safe_read import StoreAccess, read_local_metadata, recording_state

__all__ = [
    "CONTRAST_PERCENTILES",
    "CONTRAST_PLANE_PIXELS",
    "FirstRows",
    "MAX_CHANNEL_LAYERS",
    "MAX_DISPLAY_SLICE_BYTES",
    "NAPARI_CACHE_BYTES",
    "READ_AHEAD_MIN_CPUS",
    "check_displayable",
    "contrast_limits",
    "fast_array",
    "napari_get_reader",
    "open_lazy",
    "read_ahead_setting",
    "read_zarr",
    "store_title",
    "written_rows",
]


def napari_get_reader(path):
    """Return a reader for a Zarr v3 store path, or None so that other readers get their turn."""
    try:
        if isinstance(path, list):
            path = path[0] if len(path) == 1 else None
        if not isinstance(path, (str, Path)):
            return None

        if _is_object_url(path):  # s3://, gs://, az://: metadata read (capped) through the store
            meta = StoreAccess(path).read_metadata("zarr.json")
            return read_zarr if isinstance(meta, dict) and meta.get("zarr_format") == 3 else None
        path = Path(path)
        if not path.is_dir():
            return None
        meta = read_local_metadata(path, "zarr.json")
    except Exception:  # noqa: BLE001 - not ours (or not safely readable): let other readers try
        return None
    return read_zarr if isinstance(meta, dict) and meta.get("zarr_format") == 3 else None


def open_lazy(path):
    """The array (or first array of a group) at ``path``, lazily, with its dimension names.

    An array with the Writer's ``rows_written`` below ``shape[0]`` comes back as a lazy
    :class:`FirstRows` view of its written rows."""
    array, names, _ = _open_lazy(path)
    return array, names


def _open_lazy(path):
    """(array or None, dimension names or None, note on rows not shown or None)."""
    import zarr

    access = StoreAccess(path)
    node = access.open_node("")
    if isinstance(node, zarr.Group):
        node = next(
            (child for child in map(access.open_node, _array_children(access)) if isinstance(child, zarr.Array)), None
        )
        if node is None:
            return None, None, None
    names = node.metadata.dimension_names if node.metadata.zarr_format == 3 else None
    array, note = written_rows(node)
    return array, (list(names) if names and all(names) else None), note


def _array_children(access):
    """Child names that hold a zarr node, sorted (zarr-python's ``Group.arrays()`` order)."""
    for name in access.list_children(""):
        for meta in ("zarr.json", ".zarray"):
            try:
                access.read_metadata(f"{name}/{meta}")
            except Exception:  # noqa: BLE001 - missing or unreadable: not an array child
                continue
            yield name
            break


def written_rows(array):
    """``(array, note)``: ``array`` itself, or a lazy slice of its first ``rows_written`` rows
    when the Writer's record says the rest were never written (``note`` says which)."""
    try:
        record = recording_state(array.metadata.attributes if array.metadata.zarr_format == 3 else None)
    except ValueError:  # a malformed record: show the array as it is, like any other tool's
        record = None
    if record is None or not array.shape or record[0] >= array.shape[0]:
        return array, None
    rows, state = record
    note = (
        f"showing rows 0..{rows - 1} of {array.shape[0]}: rows {rows}..{array.shape[0] - 1} were never "
        f"written (recording state: {state})"
    )
    return FirstRows(array, rows), note


class FirstRows:
    """The first ``rows`` rows of an array, lazily: indexing reads only what it selects.

    Not a dask slice: dask's graph has a task per chunk of the whole declared array, which a
    hostile or merely long ``shape`` makes huge; this costs nothing until indexed.
    """

    def __init__(self, array, rows: int):
        import math

        self.array, self.rows = array, int(rows)
        self.shape = (self.rows,) + tuple(array.shape[1:])
        self.dtype = array.dtype
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, key):
        import numpy as np

        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = next(i for i, k in enumerate(key) if k is Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1 :]
        first, rest = (key[0], key[1:]) if key else (slice(None), ())
        if isinstance(first, slice):
            start, stop, step = first.indices(self.rows)
            # zarr takes no negative steps (and a negative stop means "from the end"): spell them out
            first = slice(start, stop, step) if step > 0 else np.arange(start, stop, step)
        elif isinstance(first, (int, np.integer)):
            if not -self.rows <= first < self.rows:
                raise IndexError(f"row {int(first)} is outside the {self.rows} written rows")
            first = int(first) % self.rows
        else:
            index = np.asarray(first)
            if index.dtype == bool:
                if index.shape[:1] != (self.rows,):
                    raise IndexError(f"boolean index of length {index.shape[:1]} for {self.rows} rows")
                index = np.flatnonzero(index)
            if index.size and (index.min() < -self.rows or index.max() >= self.rows):
                raise IndexError(f"row index outside the {self.rows} written rows")
            first = index % self.rows if self.rows else index
        return self.array[(first,) + tuple(rest)]

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self.array[: self.rows], dtype=dtype)


MAX_DISPLAY_SLICE_BYTES = 1 << 30


def _is_object_url(path) -> bool:
    return is_object_store_url(path)


def read_zarr(path):
    path = path[0] if isinstance(path, list) else path
    path = path if _is_object_url(path) else Path(path)  # Path() would fold "s3://" into "s3:/"
    import zarr

    access = StoreAccess(path)
    root = access.open_node("")
    images = images_of(access, root)
    if images is not None:  # a collection: its images, never the tables beside them
        return _read_collection(path, images)
    levels = _levels(access, root)
    if levels:  # OME-Zarr: one multiscale layer; napari reads only the level it displays
        check_displayable(levels[-1], path)
        names = levels[0].metadata.dimension_names
        meta = _meta(path, list(names) if names and all(names) else None)
        meta["multiscale"] = True
        scale = _level0_scale(root)
        if scale and len(scale) == levels[0].ndim:
            meta["scale"] = scale
        units = _axis_units(root)
        if units and len(units) == levels[0].ndim:
            meta["units"] = units
        # Lazy: napari's multiscale slicing crops every row of a level before picking one.  Our
        # reader's LazySelection composes those selections and reads the picked row only; levels
        # zarr-python reads (or partly written ones) are dask arrays.
        import dask.array as da

        shown: list = []
        notes: list[str] = []
        for level in levels:
            data, note = written_rows(level)
            if note:
                notes.append(f"level {len(shown)}: {note}")
            if note and data.shape[0] == 0:
                break  # a coarser level without written rows: napari needs every level non-empty
            if not note:
                data = fast_array(data)
            if isinstance(data, ShardReader):
                shown.append(data.lazy())
            else:
                shown.append(da.from_array(data, chunks=level.shards or level.chunks))
        if notes:
            meta["metadata"]["unwritten_rows"] = "; ".join(notes)
        if not shown:
            del meta["multiscale"]
            return [(_empty_like(levels[0]), meta, "image")]
        _set_contrast_limits(meta, _display_level(shown))
        return [(shown, meta, "image")]
    if isinstance(root, zarr.Group):  # not OME: its first array
        array, names, note = _open_lazy(access)
    else:
        names = root.metadata.dimension_names if root.metadata.zarr_format == 3 else None
        names = list(names) if names and all(names) else None
        array, note = written_rows(root)
        if not note:
            array = fast_array(array)
    if array is not None:
        check_displayable(array, path)
    if array is None:
        return []
    meta = _meta(path, names)
    if note:
        meta["metadata"]["unwritten_rows"] = note
    if 0 in array.shape:
        return [(_empty_like(array), meta, "image")]
    _set_contrast_limits(meta, array)
    return [(array, meta, "image")]


#: decoded chunks napari's reader keeps per array (or OME level), unless ``TILESHARD_CACHE_BYTES``
#: says otherwise: scrubbing back to a frame seen recently costs no read and no decode
NAPARI_CACHE_BYTES = 512 << 20


def fast_array(array):
    """A :class:`~napari_tileshard.reader.shard_reader.ShardReader` over ``array`` (opened already:
    its metadata is not read again; coalesced shard reads, decoded on threads, a cache of decoded
    chunks) when it reads ``array`` natively, else ``array`` itself (zarr-python): for unsharded
    arrays, other codec chains, or ``TILESHARD_READER=zarr``.

    The reader is napari's lazy array: napari indexes it with the displayed plane(s) only, and
    only the chunks those need are planned, read and decoded."""
    try:
        if reader_setting() == "zarr":
            return array
        cache = cache_bytes_setting(None, NAPARI_CACHE_BYTES)
        reader = ShardReader(array, backend="cpu", cache_bytes=cache, read_ahead=read_ahead_setting())
    except Exception:  # noqa: BLE001 - anything unexpected: zarr-python reads it as before
        return array
    return array if reader.fallback_reason is not None else reader


#: the fewest CPUs with which napari's reader reads ahead while the time slider steps
READ_AHEAD_MIN_CPUS = 4


def read_ahead_setting() -> bool:
    """Whether napari's reader decodes the next tile row along t while napari draws this one
    (``ShardReader(read_ahead=True)``): only with cores to spare.  On the 2-core dev box the
    background decode took the core napari draws on: the plugin's time per step stayed the same
    and napari's grew (p50 step 60 ms against 47 ms without, ``benchmarks/bench_scrub.py
    --ab-read-ahead 10``, 2 x 128² tiles)."""
    return (os.cpu_count() or 1) >= READ_AHEAD_MIN_CPUS


def check_displayable(array, path) -> None:
    """napari reads a whole 2-D slice at full resolution: refuse declared frames too large for that
    (a corrupted or hostile zarr.json must not make the viewer allocate its declared size)."""
    import math

    import numpy as np

    plane = array.shape[-2:] if array.ndim >= 2 else array.shape
    nbytes = math.prod(plane) * np.dtype(array.dtype).itemsize
    if nbytes > MAX_DISPLAY_SLICE_BYTES:
        raise ValueError(
            f"{path}: frames of shape {tuple(plane)} ({nbytes / 2**30:.1f} GiB each) are too large "
            f"to display without a multiscale pyramid (limit {MAX_DISPLAY_SLICE_BYTES >> 20} MiB)"
        )


def _level0_scale(group):
    """Level 0's OME scale transformation (pixel size, frame interval), or None."""
    try:
        transforms = group.attrs["ome"]["multiscales"][0]["datasets"][0]["coordinateTransformations"]
        return [float(v) for v in next(t["scale"] for t in transforms if t.get("type") == "scale")]
    except (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError):
        return None


def _axis_units(group):
    """The OME axes' units for napari (``layer.units``; "pixel" where an axis has none), or None
    when none is given or one is not a unit napari knows."""
    try:
        axes = group.attrs["ome"]["multiscales"][0]["axes"]
        units = [axis.get("unit") for axis in axes]
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if not any(units):
        return None
    import pint

    registry = pint.get_application_registry()
    try:
        for unit in units:
            if unit:
                registry.Unit(unit)
    except (pint.errors.UndefinedUnitError, ValueError, TypeError):
        return None
    return [unit or "pixel" for unit in units]


#: percentiles of the first plane napari shows that become a layer's contrast limits: a few very
#: bright pixels (beads, hot pixels) saturate instead of leaving the rest of the image near black,
#: which is what the plane's minimum and maximum (napari's choice for lazy data) did to the
#: synthetic camera's frames
CONTRAST_PERCENTILES = (0.1, 99.9)
#: the most pixels of the plane the contrast limits are taken from (a pyramid: its finest level
#: whose planes are no larger)
CONTRAST_PLANE_PIXELS = 1 << 20


def contrast_limits(data, fixed: dict[int, int] | None = None) -> list[float] | None:
    """Contrast limits for ``data`` (a lazy array of rank >= 2) from the plane napari shows first
    (the middle of every slider; ``fixed``: axis -> index for axes held elsewhere, a channel's),
    at :data:`CONTRAST_PERCENTILES`; None where the plane has no finite value or cannot be read.

    napari sets the limits of lazy data from the minimum and maximum of the first plane it
    draws, and its dtype's whole range until then, as its own readers do for arrays in memory:
    one plane is read here instead (napari's reader gets it from the chunk cache afterwards)."""
    import numpy as np

    shape = tuple(data.shape)
    if len(shape) < 2 or 0 in shape:
        return None
    fixed = fixed or {}
    index = tuple(fixed.get(axis, (size - 1) // 2) for axis, size in enumerate(shape[:-2]))
    try:
        plane = np.asarray(data[index])
    except Exception:  # noqa: BLE001 - napari's own choice then: the limits follow the first plane drawn
        log.debug("no contrast limits from %r", data, exc_info=True)
        return None
    step = max(1, int((plane.size / CONTRAST_PLANE_PIXELS) ** 0.5))
    values = plane[::step, ::step].ravel()
    if values.dtype.kind == "f":
        values = values[np.isfinite(values)]
    if values.size == 0 or values.dtype.kind not in "uif":
        return None
    low, high = (float(v) for v in np.percentile(values, CONTRAST_PERCENTILES))
    if high <= low:  # a flat plane: a window around its value
        low, high = float(values.min()), float(values.max())
        high = high if high > low else low + 1
    return [low, high]


def _display_level(levels: list):
    """The finest level of a pyramid whose planes hold at most CONTRAST_PLANE_PIXELS pixels."""
    import math

    return next((level for level in levels if math.prod(level.shape[-2:]) <= CONTRAST_PLANE_PIXELS), levels[-1])


def _set_contrast_limits(meta: dict, data) -> None:
    if "contrast_limits" not in meta and (limits := contrast_limits(data)) is not None:
        meta["contrast_limits"] = limits


def _meta(path, names):
    name = Path(path).stem if isinstance(path, Path) else Path(path.split("://", 1)[1].rstrip("/")).stem
    meta = {"name": name, "metadata": {"path": str(path)}}
    if names:
        meta["axis_labels"] = names
    return meta


def _empty_like(array):
    import numpy as np

    # napari cannot show a zero-length axis: a single fill-value frame stands in until data arrives.
    return np.zeros((1,) + tuple(max(1, s) for s in array.shape[1:]), dtype=array.dtype)


log = logging.getLogger(__name__)

#: a channel axis longer than this stays an axis of one layer instead of becoming a layer per channel
MAX_CHANNEL_LAYERS = 32


def _read_collection(path, images: list[CollectionImage]) -> list:
    """One layer per image of the collection at ``path`` (per channel where the image has a channel
    axis), each read as :func:`read_zarr` reads the image alone."""
    title = store_title(path)
    layers = []
    for image in images:
        if not image.ok:
            log.warning("%s: image %r (%s/) not shown: %s", path, image.name, image.path, image.error)
            continue
        if image.named:
            name = image.name
        else:  # series without a name of their own: after the store (and the series when there are several)
            name = title if len(images) == 1 else f"{title} {image.name}"
        for data, meta, kind in read_zarr(_child(path, image.path)):
            meta["name"] = name
            meta["metadata"].update(collection=str(path), image=image.name, image_path=image.path)
            layers.append((data, _split_channels(data, meta, image.attributes), kind))
    return layers


def _child(path, key: str):
    return f"{str(path).rstrip('/')}/{key}" if _is_object_url(path) else Path(path) / key


def store_title(path) -> str:
    """``run.ome.zarr`` -> ``run``: what a layer of an unnamed image is called."""
    name = str(path).rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".zarr", ".ome"):
        name = name.removesuffix(suffix)
    return name or str(path)


def _split_channels(data, meta: dict, attributes: dict) -> dict:
    """``meta`` with napari's ``channel_axis`` when the image has a channel axis (OME ``type:
    channel``): one layer per channel, named ``image: label`` from ``omero``, with its window
    as contrast limits and its colour (unless every channel says the same colour, where napari's
    own colours tell them apart).  Per-axis values lose the channel axis, given per channel."""
    level0 = data[0] if meta.get("multiscale") else data
    axes = image_axes(attributes)
    if axes and len(axes) == level0.ndim and "axis_labels" not in meta:
        meta["axis_labels"] = [axis["name"] for axis in axes]
    axis = channel_axis(attributes)
    if axis is None or axis >= level0.ndim or not 0 < level0.shape[axis] <= MAX_CHANNEL_LAYERS:
        return meta
    count = level0.shape[axis]
    channels = omero_channels(attributes) or []
    if len(channels) != count:
        channels = [{}] * count
    labels = [str(c.get("label") or f"channel {k}") for k, c in enumerate(channels)]
    split = dict(meta, channel_axis=axis, name=[f"{meta['name']}: {label}" for label in labels])
    for key in ("scale", "axis_labels", "units"):
        if key in meta:
            values = list(meta[key])
            del values[axis]
            split[key] = [values] * count
    split["metadata"] = [dict(meta["metadata"], channel=label) for label in labels]
    # Each channel's window from omero, else from its own first plane (not the middle channel's,
    # which the image's limits were taken from).
    shown = _display_level(data) if meta.get("multiscale") else data
    windows = [_window(c, level0.dtype) or contrast_limits(shown, {axis: k}) for k, c in enumerate(channels)]
    split.pop("contrast_limits", None)
    if all(w is not None for w in windows):
        split["contrast_limits"] = windows
    colors = [color for color in map(_color, channels) if color is not None]
    if len(colors) == count and (count == 1 or len(set(colors)) > 1):
        split["colormap"] = [
            {"name": f"omero #{color}", "colors": [[0.0, 0.0, 0.0, 1.0], [*_rgb(color), 1.0]]} for color in colors
        ]
    return split


def _window(channel: dict, dtype) -> list[float] | None:
    """The channel's display window, or None when it says nothing: missing, invalid, or the whole
    range of an integer dtype (what a writer puts when it does not know the camera's bit depth;
    napari's own contrast limits then show the data instead of a black image)."""
    import math

    import numpy as np

    window = channel.get("window")
    if not isinstance(window, dict):
        return None
    try:
        start, end = float(window["start"]), float(window["end"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (math.isfinite(start) and math.isfinite(end) and start < end):
        return None
    dtype = np.dtype(dtype)
    if dtype.kind in "ui" and start <= np.iinfo(dtype).min and end >= np.iinfo(dtype).max:
        return None
    return [start, end]


def _color(channel: dict) -> str | None:
    color = channel.get("color")
    if not isinstance(color, str) or len(color) != 6:
        return None
    try:
        int(color, 16)
    except ValueError:
        return None
    return color.upper()


def _rgb(color: str) -> list[float]:
    return [int(color[k : k + 2], 16) / 255 for k in (0, 2, 4)]
