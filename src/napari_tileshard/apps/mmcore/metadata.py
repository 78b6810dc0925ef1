"""What a pymmcore-plus recording says about itself: the camera, the images' OME axes, the
collection and the per-frame metadata.

* :class:`CameraInfo`: the frame geometry and the sequence buffer, from pymmcore-plus's summary
  metadata (``image_infos[0]``, ``devices``, ``system_info``).
* :func:`image_layout`: each image's :class:`~napari_tileshard.format.layout.Layout`, the
  package's default tiling with the sequence's axes, units and scales (the pixel size, the z step,
  the time interval); :func:`omero_metadata`: the channel names and display windows.
* :class:`FrameTable`: each frame's metadata as numbers (:data:`FRAME_COLUMNS`, the
  ``frame_metadata`` array) and as the full JSON record (``frame_metadata_json``).
* :func:`open_collection` / :func:`finish_collection`: the ``bioformats2raw.layout`` root group
  (the same layout as pymmcore-plus's default ome-writers sink), its summary metadata and the
  ``tileshard_mmcore`` attributes: the state of the recording, its series and axes, which frames
  were written as fill and why, the sink's statistics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from ...format.layout import Layout
from ...storage.errors import StoreExistsError

__all__ = [
    "FRAME_COLUMNS",
    "RECORDING_ATTRIBUTE",
    "CameraInfo",
    "FrameTable",
    "axis_description",
    "finish_collection",
    "image_layout",
    "image_names",
    "jsonable",
    "omero_metadata",
    "open_collection",
    "refuse_existing",
]

#: the columns of the ``frame_metadata`` array, one row per frame received (``stored`` 0: dropped)
FRAME_COLUMNS = ("series", "frame", "runner_time_ms", "exposure_ms", "x_um", "y_um", "z_um", "stored")
#: the root group's attribute that marks a TileShardSink recording and describes it
RECORDING_ATTRIBUTE = "tileshard_mmcore"


@dataclass(frozen=True)
class CameraInfo:
    """The camera's frames and pymmcore-plus's sequence buffer, from the summary metadata."""

    height: int
    width: int
    dtype: np.dtype
    pixel_size_um: float = 0.0  # 0: unknown
    bit_depth: int | None = None  # a 12-bit camera fills uint16 frames up to 4095
    buffer_mb: float | None = None  # pymmcore-plus's sequence (circular) buffer in MiB, when recorded

    @classmethod
    def from_summary(cls, meta) -> CameraInfo:
        """Read from pymmcore-plus's summary metadata (what its engine's ``setup_sequence`` returns).
        Raises ValueError without ``image_infos`` and NotImplementedError for several cameras."""
        try:
            info = dict(meta["image_infos"][0])
        except (TypeError, KeyError, IndexError):
            raise ValueError(
                "TileShardSink needs pymmcore-plus's summary metadata (meta['image_infos'][0]) from the "
                f"engine's setup_sequence, got {meta!r}"
            ) from None
        if info.get("num_camera_adapter_channels", 1) > 1:
            raise NotImplementedError("multi-camera acquisitions (a camera axis) are not supported by TileShardSink")
        dtype = np.dtype(info["dtype"])
        return cls(
            height=int(info["height"]),
            width=int(info["width"]),
            dtype=dtype,
            pixel_size_um=float(info.get("pixel_size_um") or 0.0),
            bit_depth=_bit_depth(meta),
            buffer_mb=_buffer_mb(meta),
        )

    @property
    def frame_bytes(self) -> int:
        return self.height * self.width * self.dtype.itemsize

    @property
    def description(self) -> str:
        """``"512x128 uint16"``: width by height, as cameras are described."""
        return f"{self.width}x{self.height} {self.dtype.name}"

    @property
    def buffer_frames(self) -> int | None:
        """Frames the sequence buffer holds, when its size is recorded."""
        return int(self.buffer_mb * 2**20 // self.frame_bytes) if self.buffer_mb else None


def _bit_depth(meta) -> int | None:
    try:
        for device in meta["devices"]:
            if device.get("type") == "CameraDevice" or "CameraDevice" in str(device.get("type")):
                for prop in device.get("properties", ()):
                    if str(prop.get("name")).endswith("BitDepth") and prop.get("value"):
                        return int(prop["value"])
    except (TypeError, KeyError, ValueError):
        pass
    return None


def _buffer_mb(meta) -> float | None:
    try:
        value = float(meta["system_info"]["sequence_buffer_size_mb"])
    except (TypeError, KeyError, ValueError):
        return None
    return value if value > 0 and math.isfinite(value) else None


def image_layout(
    inner_sizes: Mapping[str, int],
    camera: CameraInfo,
    sequence,
    *,
    tile: Mapping[str, int] | None = None,
    tiles_per_shard: Mapping[str, int] | None = None,
) -> Layout:
    """The layout of each image: the axes ``inner_sizes`` (t, c, z, ... in the sequence's order)
    then y and x from the camera, the package's one tiling (:meth:`Layout.default_for`: the sizes
    ``tile``/``tiles_per_shard`` name, checked and clamped to the frame; the default elsewhere), and
    the OME type, unit and scale of every axis.

    The first axis grows as rows complete (the series' Writer is unbounded): a run that stops early
    (cancelled, fell behind) keeps the rows it has, and the store claims no row it never wrote.
    Frames are still placed by the sequence's sizes."""
    tile, tiles_per_shard = dict(tile or {}), dict(tiles_per_shard or {})
    names = (*inner_sizes, "y", "x")
    unknown = sorted((set(tile) | set(tiles_per_shard)) - set(names))
    if unknown:
        raise ValueError(f"tile/tiles_per_shard name axes {unknown} that this sequence does not have {names}")
    height, width = camera.height, camera.width
    counts = list(inner_sizes.values())
    shape = (0, *counts[1:], height, width) if counts else (height, width)  # one image: a plane
    # checked and clamped to the camera's frame as every entry point's tiling is
    base = Layout.default_for(shape, camera.dtype, names, tile=tile, tiles_per_shard=tiles_per_shard)
    pixel_um = camera.pixel_size_um
    dims = []
    for dim in base.dims:
        if dim.name in ("y", "x"):
            kind, unit, scale = None, ("micrometer" if pixel_um > 0 else None), (pixel_um if pixel_um > 0 else 1.0)
        else:
            kind, unit, scale = axis_description(dim.name, sequence)
        dims.append(dataclasses.replace(dim, kind=kind, unit=unit, scale=scale))
    return Layout(dims, camera.dtype)


def axis_description(axis: str, sequence) -> tuple[str | None, str | None, float]:
    """The OME type, unit and scale of one of the sequence's axes: the time plan's interval, the
    z plan's step (1 where the sequence does not say)."""
    if axis == "t":
        interval = getattr(getattr(sequence, "time_plan", None), "interval", None)
        seconds = interval.total_seconds() if interval is not None else 0.0
        return "time", "second", seconds if seconds > 0 else 1.0
    if axis == "c":
        return "channel", None, 1.0
    if axis == "z":
        step = getattr(getattr(sequence, "z_plan", None), "step", None)
        return "space", "micrometer", float(step) if step else 1.0
    return "other", None, 1.0


def image_names(sequence, keys: Sequence[tuple], series_axes: Sequence[str]) -> list[str | None]:
    """Each series' image name from the stage positions' names (``A1``; ``A1 g2`` for a grid
    position), None where the sequence names none; a name given twice gets the series number."""
    positions = getattr(sequence, "stage_positions", ()) or ()
    names: list[str | None] = []
    for key in keys:
        index = dict(zip(series_axes, key))
        p = index.get("p", 0)
        name = getattr(positions[p], "name", None) if p < len(positions) else None
        if name and "g" in index:
            name = f"{name} g{index['g']}"
        names.append(str(name) if name else None)
    repeated = {n for n in names if n is not None and names.count(n) > 1}
    return [f"{n} ({k})" if n in repeated else n for k, n in enumerate(names)]


def omero_metadata(sequence, dtype: np.dtype, bit_depth: int | None) -> dict | None:
    """The ``omero`` object of each image: the sequence's channel names, their display window the
    camera's range (its bit depth when recorded); None without channels."""
    channels = getattr(sequence, "channels", ()) or ()
    if not channels:
        return None
    top = float(2**bit_depth - 1) if bit_depth else float(np.iinfo(dtype).max if dtype.kind in "ui" else 1.0)
    return {
        "channels": [
            {
                "label": str(ch.config),
                "active": True,
                "window": {"start": 0.0, "end": top, "min": 0.0, "max": top},
                "color": "FFFFFF",
            }
            for ch in channels
        ]
    }


class FrameTable:
    """Each frame's metadata as pymmcore-plus hands it over: a row of numbers (:data:`FRAME_COLUMNS`,
    NaN where a value is absent) and the full record as JSON.  Rows are added from two threads (the
    MDA thread for dropped frames, the feeder for the others)."""

    def __init__(self) -> None:
        self._rows: list[tuple[float, ...]] = []
        self._records: list[str] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, series: int, frame: int, meta, *, stored: bool) -> None:
        meta = dict(meta or {})
        position = meta.get("position") or {}
        row = (
            series,
            frame,
            _number(meta.get("runner_time_ms")),
            _number(meta.get("exposure_ms")),
            _number(position.get("x")),
            _number(position.get("y")),
            _number(position.get("z")),
            1.0 if stored else 0.0,
        )
        record = json.dumps(meta, default=_json_default)  # the text jsonable(meta) dumps to, in one pass
        with self._lock:
            self._rows.append(row)
            self._records.append(record)

    def write(self, root: zarr.Group, inner_axes: Sequence[str]) -> None:
        """The ``frame_metadata`` and ``frame_metadata_json`` arrays of the root group."""
        with self._lock:
            rows = np.asarray(self._rows, dtype="float64").reshape(-1, len(FRAME_COLUMNS))
            texts = list(self._records)
        table = root.create_array("frame_metadata", shape=rows.shape, dtype="float64", overwrite=True)
        table[...] = rows
        table.attrs.put({"columns": list(FRAME_COLUMNS), "frame": f"row-major index over axes {tuple(inner_axes)}"})
        records = root.create_array("frame_metadata_json", shape=(len(texts),), dtype=str, overwrite=True)
        if texts:
            records[...] = np.asarray(texts, dtype=object)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def jsonable(value: Any) -> Any:
    """pymmcore-plus metadata as JSON: pydantic models dumped, tuples as lists, the rest as text."""
    return json.loads(json.dumps(value, default=_json_default))


def _json_default(value):
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_unset=True)
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def open_collection(
    path: str, series_names: Sequence[str], axes: Sequence[str], summary: dict, *, overwrite: bool
) -> None:
    """Create the collection's root group (state ``recording``) and its ``OME`` group listing the
    series.  An existing store is replaced only with ``overwrite`` and only if it is a recording
    of ours (StoreExistsError otherwise)."""
    try:
        root = zarr.open_group(path, mode="r")
    except Exception:  # no group there (missing, an array, unreadable): nothing to protect
        root = None
    # Only a recording of ours is replaced, and only that is offered for replacing: a folder
    # with anything else in it is refused whatever ``overwrite`` says (overwrite could not help).
    ours = root is not None and RECORDING_ATTRIBUTE in root.attrs
    if (not ours and (root is not None or _holds_anything(path))) or (ours and not overwrite):
        raise StoreExistsError(_exists_message(path, ours))
    root = zarr.open_group(path, mode="a", zarr_format=3)
    root.attrs.put(
        {
            "ome": {"version": "0.5", "bioformats2raw.layout": 3},
            "pymmcore_plus": {"summary_metadata": summary},
            RECORDING_ATTRIBUTE: {"state": "recording", "series": list(series_names), "axes": list(axes)},
        }
    )
    ome_group = root.require_group("OME")
    ome_group.attrs.put({"ome": {"version": "0.5", "series": list(series_names)}})


def refuse_existing(path: str) -> None:
    """StoreExistsError, naming the store and what to do, when a local ``path`` holds anything:
    what :func:`open_collection` refuses without ``overwrite``, said before any MDA starts (a URL
    store is checked when the run opens it)."""
    if not _holds_anything(path):
        return
    try:
        ours = RECORDING_ATTRIBUTE in zarr.open_group(path, mode="r").attrs
    except Exception:  # not a group of ours (an array, unreadable, anything else)
        ours = False
    raise StoreExistsError(_exists_message(path, ours))


def _exists_message(path: str, ours: bool) -> str:
    if ours:
        return f"{path} already exists; pass overwrite=True to replace it (or choose another path)"
    return f"{path} exists and is not a TileShardSink recording: choose another output (it is not replaced)"


def _holds_anything(path: str) -> bool:
    """A local directory at ``path`` with something in it (URLs: their root zarr.json tells)."""
    if "://" in path and not path.startswith("file://"):
        return False
    local = Path(path.removeprefix("file://")).expanduser()
    try:
        return local.is_dir() and any(local.iterdir())
    except OSError:
        return False


def finish_collection(
    path: str,
    table: FrameTable,
    *,
    inner_axes: Sequence[str],
    state: str,
    series_names: Sequence[str],
    axes: Sequence[str],
    fill_frames: Mapping[str, Mapping[str, list[int]]],
    stats: Mapping[str, Any],
    stopped: str | None = None,
) -> None:
    """Write the frame table and the final ``tileshard_mmcore`` attributes: ``state`` (complete,
    stopped, failed), why it ``stopped`` (when it did), the fill frames by series and reason, and
    the sink's statistics."""
    root = zarr.open_group(path, mode="a", zarr_format=3)
    table.write(root, inner_axes)
    root.attrs.update(
        {
            RECORDING_ATTRIBUTE: {
                "state": state,
                **({"stopped": stopped} if stopped else {}),
                "series": list(series_names),
                "axes": list(axes),
                "fill_frames": {name: dict(fills) for name, fills in fill_frames.items()},
                "stats": dict(stats),
            }
        }
    )
