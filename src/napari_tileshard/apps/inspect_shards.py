"""Qt-free core of the shard inspector: what a sharded Zarr v3 array holds, from its indexes only.

For each shard object it reads the object's size and one range (the index, at the end or the
start, as the format layer's :class:`~napari_tileshard.format.ShardSpec` says and decodes it) —
never the chunk data — so a store of many shards opens quickly.
The result is a per-chunk map of compressed bytes on the chunk (tile) grid, with -1 for empty
chunks (index ``2^64-1``), and a table of shards with their index CRC status.

A collection (``bioformats2raw.layout``) holds several images: :func:`list_images` names them and
``inspect_array(path, image=...)`` inspects one (level 0, as for a single OME-Zarr image); an array
or a single image is listed as its one image.

The store is untrusted: metadata is read through :mod:`napari_tileshard.storage.safe_read`, shard keys
are listed without following symlinks (entries pointing out of the store are noted, never read),
and the map covers the chunk grid only as far as shards exist (up to :data:`MAX_MAP_CHUNKS`), so
memory follows what is on disk, not the declared ``shape``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import zarr

from ..format import EMPTY
from ..format.ome import image_axes, image_name
from ..format.shard_spec import ShardSpec, UnsupportedArray
from ..reader.collection import CollectionImage, images_of
from ..reader.levels import open_level0
from ..storage.safe_read import StoreAccess, UnsafeStoreError
from .napari_reader import store_title

__all__ = [
    "EMPTY_CHUNK",
    "MAX_INDEX_BYTES",
    "MAX_MAP_CHUNKS",
    "ImageEntry",
    "Inspection",
    "ShardInfo",
    "inspect_array",
    "list_images",
]

EMPTY_CHUNK = -1
#: the most chunks the per-chunk map holds (8 bytes each); beyond, it covers the first rows only
MAX_MAP_CHUNKS = 1 << 24
#: the largest shard index read (a declared chunks-per-shard beyond it is refused)
MAX_INDEX_BYTES = 64 << 20


@dataclass
class ShardInfo:
    key: str
    coords: tuple[int, ...]
    file_bytes: int
    chunks_present: int
    chunks_possible: int
    compressed_bytes: int
    mean_ratio: float
    crc_ok: bool


@dataclass
class Inspection:
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunk_bytes: np.ndarray  # on the chunk grid: compressed bytes, EMPTY_CHUNK where empty or absent
    uncompressed_chunk_bytes: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    bytes_read: int = 0
    #: entries not read (symlinks out of the store, special files) and limits applied to the map
    notes: list[str] = field(default_factory=list)
    #: where the inspected array sits in the store ("" for an array, "0" for an image's level 0,
    #: "1/0" in a collection): ``f"{array_path}/{shard.key}"`` is the key verify reports
    array_path: str = ""
    #: the array's axis names (``dimension_names``, else the OME axes), or None where it has none
    axis_names: tuple[str, ...] | None = None

    def __repr__(self) -> str:
        # The chunk map holds one number per chunk (thousands): the default repr printed it whole.
        empty = int((self.chunk_bytes == EMPTY_CHUNK).sum())
        mismatches = sum(not shard.crc_ok for shard in self.shards)
        where = f", array_path={self.array_path!r}" if self.array_path else ""
        return (
            f"Inspection(shape={self.shape}, shard_shape={self.shard_shape}, chunk_shape={self.chunk_shape}, "
            f"axis_names={self.axis_names}, shards={len(self.shards)}, chunks={self.chunk_bytes.size - empty}, "
            f"empty_chunks={empty}, crc_mismatches={mismatches}, bytes_read={self.bytes_read}{where})"
        )

    @property
    def covered_shape(self) -> tuple[int, ...]:
        """The part of ``shape`` (from the origin) that the chunk map covers: where shards exist.
        Draw over this rather than ``shape``, which is only what zarr.json declares."""
        return tuple(min(s, m * c) for s, m, c in zip(self.shape, self.chunk_bytes.shape, self.chunk_shape))

    @property
    def valid_chunk_bytes(self) -> np.ndarray:
        """Uncompressed bytes of each chunk of the map that lie inside ``shape``: an edge chunk's
        padding is stored compressed but is not data, so ratios leave it out."""
        itemsize = self.uncompressed_chunk_bytes // max(1, math.prod(self.chunk_shape))
        extents = [
            np.clip(size - np.arange(n) * c, 0, c)
            for size, n, c in zip(self.shape, self.chunk_bytes.shape, self.chunk_shape)
        ]
        valid = np.ones((), dtype=np.int64) * itemsize
        for extent in extents:
            valid = np.multiply.outer(valid, extent)
        return valid

    @property
    def chunk_ratio(self) -> np.ndarray:
        """Compression ratio per chunk, of the data inside ``shape`` (NaN where empty)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.chunk_bytes > 0, self.valid_chunk_bytes / self.chunk_bytes, np.nan)


class PixelMap:
    """A per-chunk map (``Inspection.chunk_ratio``, say) read per pixel of the array it describes,
    without making it: element ``i`` is the value of the chunk holding pixel ``i * step``.

    Its shape is the array's (``shape``), not the chunk grid's times the chunk shape: an edge
    chunk's padding lies outside the array and gets no pixels, so a viewer's layer of it spans
    exactly the array (its time slider ends at the last row, its map at the last column).
    ``step`` subsamples (a coarser level of a multiscale view of a large plane).  It is an
    array-like (``shape``, ``dtype``, ``ndim``, ``__getitem__`` with integers, slices and
    Ellipsis), which is what napari asks of a layer's data; each read builds only what it
    returns.
    """

    def __init__(self, chunk_map: np.ndarray, chunk_shape, shape, step=None):
        self.chunk_map = np.asarray(chunk_map)
        self.chunk_shape = tuple(int(c) for c in chunk_shape)
        ndim = self.chunk_map.ndim
        if len(self.chunk_shape) != ndim or len(shape) != ndim:
            raise ValueError(
                f"a map of {ndim} dims needs a chunk shape and a shape of {ndim}, got {chunk_shape}, {shape}"
            )
        self.step = tuple(int(s) for s in (step or (1,) * ndim))
        #: the pixels of the array the map covers (``shape``, cut to where the map has chunks)
        self.extent = tuple(min(int(s), m * c) for s, m, c in zip(shape, self.chunk_map.shape, self.chunk_shape))
        self.shape = tuple(-(-e // st) for e, st in zip(self.extent, self.step))
        self.dtype = self.chunk_map.dtype
        self.ndim = ndim

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __repr__(self) -> str:
        return f"PixelMap(shape={self.shape}, chunk_shape={self.chunk_shape}, step={self.step})"

    def __getitem__(self, key) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = next(i for i, k in enumerate(key) if k is Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1 :]
        key = key + (slice(None),) * (self.ndim - len(key))
        if len(key) != self.ndim:
            raise IndexError(f"too many indices for a map of {self.ndim} dims: {key!r}")
        chunks, dropped = [], []
        for axis, (k, n, c, st) in enumerate(zip(key, self.shape, self.chunk_shape, self.step)):
            if isinstance(k, slice):
                pixels = np.arange(*k.indices(n))
            elif isinstance(k, (int, np.integer)):
                index = int(k) + n if int(k) < 0 else int(k)
                if not 0 <= index < n:
                    raise IndexError(f"index {int(k)} is out of bounds for axis {axis} of size {n}")
                pixels = np.array([index])
                dropped.append(axis)
            else:
                raise TypeError(f"a PixelMap takes integers and slices, got {k!r}")
            chunks.append(pixels * st // c)
        values = self.chunk_map[np.ix_(*chunks)]
        return values.reshape([len(c) for axis, c in enumerate(chunks) if axis not in dropped])

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[...], dtype=dtype)

    def levels(self, max_plane: int) -> list[PixelMap]:
        """This map (step 1) and coarser ones halving its last two dims until a plane holds at most
        ``max_plane`` pixels: a multiscale view, for planes too large to show at once."""
        levels = [PixelMap(self.chunk_map, self.chunk_shape, self.extent)]
        while self.ndim >= 2 and math.prod(levels[-1].shape[-2:]) > max_plane:
            step = levels[-1].step[:-2] + tuple(2 * s for s in levels[-1].step[-2:])
            levels.append(PixelMap(self.chunk_map, self.chunk_shape, self.extent, step))
        return levels


def _valid_bytes(shape, chunk_shape, coords, per_shard, present, result: Inspection) -> int:
    """Uncompressed bytes of the shard's present chunks that lie inside the array (no padding)."""
    itemsize = result.uncompressed_chunk_bytes // max(1, math.prod(chunk_shape))
    valid = np.ones((), dtype=np.int64) * itemsize
    for size, c, shard_coord, n in zip(shape, chunk_shape, coords, per_shard):
        first = shard_coord * n
        valid = np.multiply.outer(valid, np.clip(size - (first + np.arange(n)) * c, 0, c))
    return int(valid.reshape(-1)[present.reshape(-1)].sum())


@dataclass(frozen=True)
class ImageEntry:
    """One image of a collection, as the inspector's picker lists it."""

    name: str
    path: str
    #: why it cannot be inspected, or None
    error: str | None = None

    def __str__(self):
        where = f" ({self.path}/)" if self.path else ""
        return f"{self.name}{where}" + (f": {self.error}" if self.error else "")


def list_images(path) -> list[ImageEntry]:
    """The images at ``path`` (a path, URL or zarr Store) that :func:`inspect_array` takes as
    ``image``: a collection's, in its order, or the one image of an array or a single OME-Zarr
    image (its own name, else the store's; path ``""``, the store's root)."""
    access = StoreAccess(path)
    root = access.open_node("")
    images = images_of(access, root)
    if images is not None:
        return [ImageEntry(i.name, i.path, i.error) for i in images]
    return [_single_image(access, root)]


def _single_image(access: StoreAccess, root) -> ImageEntry:
    """The entry of an array or a single OME-Zarr image: its own name, else the store's."""
    attributes = dict(root.attrs) if isinstance(root, zarr.Group) else {}
    return ImageEntry(image_name(attributes) or store_title(access.location), "")


def _choose(images: list[CollectionImage], image: str | None, path) -> CollectionImage:
    if not images:
        raise ValueError(f"{path}: a collection without images")
    if image is None:
        chosen = next((i for i in images if i.ok), images[0])
    else:
        found = [i for i in images if image in (i.path, i.name)]
        if not found:
            listed = ", ".join(f"{i.name!r} ({i.path}/)" for i in images)
            raise ValueError(f"{path}: no image {image!r} in this collection; its images are {listed}")
        chosen = found[0]
    if chosen.levels is None:
        raise ValueError(f"{path}: image {chosen.name!r} ({chosen.path}/) cannot be opened: {chosen.error}")
    return chosen


def _level0(access: StoreAccess, image: str | None):
    """``(level 0, the image group's attributes)`` of the array, OME-Zarr image or collection
    image at ``access``'s root."""
    root = access.open_node("")
    images = images_of(access, root)
    if images is not None:
        chosen = _choose(images, image, access.location)
        return chosen.levels[0], chosen.attributes  # type: ignore[index]
    if image is not None:
        single = _single_image(access, root)
        if image not in (single.name, single.path):
            raise ValueError(
                f"{access.location}: no image {image!r} here; this store is one image, {single.name!r} "
                f'(image={single.name!r} or image="")'
            )
    return open_level0(access), dict(root.attrs) if isinstance(root, zarr.Group) else {}


def _axis_names(array, attributes: dict) -> tuple[str, ...] | None:
    """The array's ``dimension_names`` where every axis has one, else its OME image's axes."""
    names = array.metadata.dimension_names if array.metadata.zarr_format == 3 else None
    if names and len(names) == array.ndim and all(names):
        return tuple(str(n) for n in names)
    axes = image_axes(attributes)
    if axes and len(axes) == array.ndim:
        return tuple(axis["name"] for axis in axes)
    return None


def inspect_array(path, previous: Inspection | None = None, image: str | None = None) -> Inspection:
    """Read every shard index of the sharded array at ``path`` (a path or zarr Store; level 0 of an
    OME-Zarr group; level 0 of image ``image`` of a collection, by name or path, default its first:
    :func:`list_images`).

    ``previous``: an earlier inspection of the same array (the inspector's live refresh of a
    growing recording).  A shard whose object has the same size as then is taken from it instead
    of being read and decoded again: a recording only adds shards, and a shard written again grows
    (a flushed shard's later version starts with the flushed bytes and adds to them).  Everything
    else, and every shard when the array's geometry changed, is read as without ``previous``.
    """
    access = StoreAccess(path)
    array, attributes = _level0(access, image)
    names = _axis_names(array, attributes)
    meta = array.metadata.to_dict()
    if not any(isinstance(c, dict) and c.get("name") == "sharding_indexed" for c in meta.get("codecs", [])):
        return _inspect_unsharded(access, array, meta, names)
    try:  # any inner codec: only the indexes are read
        spec = ShardSpec.from_metadata(meta, opaque=True)
    except UnsupportedArray as exc:
        raise ValueError(f"{path}: {exc}") from None
    shape, shard_shape, chunk_shape = spec.shape, spec.shard_shape, spec.chunk_shape
    per_shard, chunks, index_bytes = spec.chunks_per_shard, spec.chunks, spec.index_nbytes
    if index_bytes > MAX_INDEX_BYTES:
        raise ValueError(
            f"{path}: {chunks} chunks per shard make an index of {index_bytes} bytes, more than the "
            f"inspector reads (MAX_INDEX_BYTES = {MAX_INDEX_BYTES})"
        )
    grid = tuple(math.ceil(s / c) for s, c in zip(shape, chunk_shape))
    prefix = array.store_path.path
    base = f"{prefix}/" if prefix else ""
    in_c = spec.chunk_key_encoding == "default" and spec.separator == "/"
    shards, notes = _shard_keys(access, base, len(shape), "c" if in_c else "", spec.separator)
    chunk_bytes, note = _chunk_map(grid, per_shard, [coords for _, coords in shards], path)
    result = Inspection(
        shape,
        shard_shape,
        chunk_shape,
        chunk_bytes,
        spec.chunk_bytes,
        notes=notes + note,
        array_path=prefix,
        axis_names=names,
    )
    known = _reusable(previous, result)
    for key, coords in shards:
        try:
            with access.open_object(base + key) as obj:
                size = obj.size
                earlier = known.get(key)
                if earlier is not None and earlier[0].file_bytes == size and _place(chunk_bytes, earlier):
                    result.shards.append(earlier[0])
                    continue
                if size < index_bytes:
                    tail = b""
                else:
                    tail = obj.read_suffix(index_bytes) if spec.index_at_end else obj.read(0, index_bytes)
        except FileNotFoundError:
            continue  # removed since it was listed
        except (UnsafeStoreError, OSError) as exc:
            result.notes.append(f"{key}: {exc}")
            continue
        if len(tail) < index_bytes:
            result.shards.append(ShardInfo(key, coords, size, 0, chunks, 0, float("nan"), False))
            continue
        result.bytes_read += len(tail)
        offsets, sizes, crc_ok = spec.index_entries(tail)
        present = ~((offsets == np.uint64(EMPTY)) & (sizes == np.uint64(EMPTY)))
        nbytes = np.where(present, sizes.astype(np.int64), EMPTY_CHUNK).reshape(per_shard)
        # Place the shard's chunks on the map, clipped to the array's extent and the map's.
        region = _region(coords, per_shard, chunk_bytes.shape)
        if all(r.stop > r.start for r in region):
            chunk_bytes[region] = nbytes[tuple(slice(0, r.stop - r.start) for r in region)]
        stored = int(nbytes[nbytes > 0].sum())
        count = int(present.sum())
        data = _valid_bytes(shape, chunk_shape, coords, per_shard, present, result)
        ratio = data / stored if stored else float("nan")
        result.shards.append(ShardInfo(key, coords, size, count, chunks, stored, ratio, bool(crc_ok)))
    return result


def _region(coords, per_shard, map_shape) -> tuple[slice, ...]:
    """The part of the chunk map that the shard at ``coords`` covers, clipped to the map."""
    start = [c * p for c, p in zip(coords, per_shard)]
    return tuple(slice(s, min(m, s + p)) for s, m, p in zip(start, map_shape, per_shard))


def _reusable(previous: Inspection | None, current: Inspection) -> dict:
    """``{key: (ShardInfo, its part of the previous chunk map)}`` from ``previous`` when it
    inspected an array of the same geometry (a growing array keeps all but its length)."""
    if previous is None or (
        previous.shard_shape,
        previous.chunk_shape,
        previous.shape[1:],
        previous.uncompressed_chunk_bytes,
    ) != (current.shard_shape, current.chunk_shape, current.shape[1:], current.uncompressed_chunk_bytes):
        return {}
    per_shard = tuple(s // c for s, c in zip(current.shard_shape, current.chunk_shape))
    # Along dim 0 only shards that lay wholly inside the array then and now: an edge shard's ratio
    # counts only its valid rows, which change as the array grows.
    rows = min(previous.shape[0], current.shape[0]) if current.shape else 0
    found = {}
    for shard in previous.shards:
        old = _region(shard.coords, per_shard, previous.chunk_bytes.shape)
        new = _region(shard.coords, per_shard, current.chunk_bytes.shape)
        inside = not shard.coords or (shard.coords[0] + 1) * current.shard_shape[0] <= rows
        if inside and old == new and shard.chunks_present and shard.crc_ok:
            found[shard.key] = (shard, new, previous.chunk_bytes[old])
    return found


def _place(chunk_bytes: np.ndarray, earlier) -> bool:
    """Put a reused shard's part of the previous map on ``chunk_bytes``; False when it no longer fits."""
    _, region, values = earlier
    if chunk_bytes[region].shape != values.shape:
        return False
    chunk_bytes[region] = values
    return True


def _shard_keys(access, base: str, ndim: int, chunk_dir: str = "c", separator: str = "/"):
    """``[(key, coords)]`` of the objects under ``chunk_dir`` whose names are chunk coordinates,
    sorted, and notes on entries not read."""
    listing = access.list_keys(base + chunk_dir) if chunk_dir else access.list_keys(base.rstrip("/"))
    notes = [f"{key[len(base) :]}: {reason}" for key, reason in listing.refused]
    found = []
    for full in listing.keys:
        key = full[len(base) :]
        name = key[len(chunk_dir) + 1 :] if chunk_dir else key
        if not chunk_dir and name.startswith("c" + separator):
            name = name[2:]
        parts = name.split(separator)
        if len(parts) != ndim or not all(p.isdigit() for p in parts):
            continue
        found.append((key, tuple(int(p) for p in parts)))
    return sorted(found), notes


def _chunk_map(grid, per_shard, coords, path) -> tuple[np.ndarray, list[str]]:
    """The per-chunk map, EMPTY_CHUNK everywhere: it covers the chunk grid as far as the existing
    objects reach (never the declared grid itself, which a 1 KB edit of zarr.json can make
    astronomically large), and at most MAX_MAP_CHUNKS chunks, cut along dim 0."""
    extent = [min(g, 1) for g in grid]
    for c in coords:
        extent = [max(e, min(g, (ci + 1) * p)) for e, g, ci, p in zip(extent, grid, c, per_shard)]
    notes = []
    row = math.prod(extent[1:])
    if extent and math.prod(extent) > MAX_MAP_CHUNKS:
        if row > MAX_MAP_CHUNKS:
            raise ValueError(
                f"{path}: one row of the chunk map holds {row} chunks, more than the inspector "
                f"shows (MAX_MAP_CHUNKS = {MAX_MAP_CHUNKS})"
            )
        rows = MAX_MAP_CHUNKS // row
        notes.append(
            f"the chunk map shows the first {rows} of {extent[0]} chunk rows along dim 0 "
            f"(MAX_MAP_CHUNKS = {MAX_MAP_CHUNKS}); the shard table lists every shard"
        )
        extent[0] = rows
    return np.full(tuple(extent), EMPTY_CHUNK, dtype=np.int64), notes


def _inspect_unsharded(access, array, meta, names) -> Inspection:
    """Unsharded (or Zarr v2) arrays: the chunk grid and each chunk object's size, no data read."""
    shape = tuple(array.shape)
    chunk_shape = tuple(array.chunks)
    grid = tuple(math.ceil(s / c) for s, c in zip(shape, chunk_shape))
    prefix = array.store_path.path
    base = f"{prefix}/" if prefix else ""
    separator = meta.get("dimension_separator") or "/"  # Zarr v2
    encoding = meta.get("chunk_key_encoding", {})
    if isinstance(encoding, dict) and "dimension_separator" not in meta:
        separator = encoding.get("configuration", {}).get("separator", "/")
    objects, notes = _shard_keys(access, base, len(shape), chunk_dir="", separator=separator)
    objects = [(k, c) for k, c in objects if all(ci < g for ci, g in zip(c, grid))]
    chunk_bytes, note = _chunk_map(grid, (1,) * len(shape), [c for _, c in objects], access.location)
    result = Inspection(
        shape,
        chunk_shape,
        chunk_shape,
        chunk_bytes,
        math.prod(chunk_shape) * np.dtype(array.dtype).itemsize,
        notes=notes + note,
        array_path=prefix,
        axis_names=names,
    )
    for key, coords in objects:
        try:
            with access.open_object(base + key) as obj:
                size = obj.size
        except FileNotFoundError:
            continue
        except (UnsafeStoreError, OSError) as exc:
            result.notes.append(f"{key}: {exc}")
            continue
        if all(c < m for c, m in zip(coords, chunk_bytes.shape)):
            chunk_bytes[coords] = size
        result.shards.append(
            ShardInfo(
                key, coords, size, 1, 1, size, result.uncompressed_chunk_bytes / size if size else float("nan"), True
            )
        )
    return result
