"""Whether two stores are one place: a conversion must never write where it reads.

Two spellings name the same place when they resolve to the same directory or object prefix, or
when one lies inside the other (writing into a parent or a child of the source replaces or mixes
with the source's own files).  Local paths are compared as the file system sees them, not as
text: symlinks are resolved, and where a path exists its identity (device and inode) decides, so
a bind mount, ``..`` segments, a case-insensitive file system or a ``file://`` URL are the same
place as the plain path.  Object store URLs (``s3://``, ``gs://``, ``az://`` and any fsspec URL)
are compared by scheme family, bucket and prefix, ignoring empty and ``.`` segments and trailing
slashes; an endpoint is not part of the comparison (the same bucket and prefix are refused even
if ``storage_options`` might point elsewhere: refusing costs a rename, writing over a source
costs the data).  ``memory://`` stores are private to their process and never overlap.

:func:`in_memory_file_system`: whether a local path's files are held in memory (tmpfs), where
asking the OS to read them ahead only costs system calls.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = [
    "MEMORY_FILE_SYSTEMS",
    "MOUNT_TABLE",
    "Place",
    "file_system_type",
    "in_memory_file_system",
    "overlap",
    "place_of",
    "places_read_by",
]

#: where Linux lists the mounts this process sees (one per line, ``proc(5)``)
MOUNT_TABLE = "/proc/self/mountinfo"
#: file systems that keep their files in memory: nothing of them is ever read from a disk
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})

# Spellings of one object-store family (the URL forms obstore and fsspec accept for each).
_FAMILY = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "azure": "az"}


@dataclass(frozen=True)
class Place:
    """Where a store lives: a local path (as given, made absolute) or a URL's family, bucket and
    key segments.  ``None`` from :func:`place_of` means a place nothing else can share."""

    local: str | None = None
    scheme: str = ""
    bucket: str = ""
    segments: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.local is not None:
            return self.local
        return f"{self.scheme}://{'/'.join((self.bucket, *self.segments))}"


def place_of(location) -> Place | None:
    """The :class:`Place` of a path, ``file://`` or store URL, or zarr ``LocalStore``; None for a
    private store (``memory://``, a MemoryStore) or anything that names no place."""
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if isinstance(location, bytes):
        location = os.fsdecode(location)
    if not isinstance(location, str):
        root = getattr(location, "root", None)  # zarr.storage.LocalStore
        return place_of(root) if isinstance(root, (str, os.PathLike)) else None
    if "://" not in location:
        return Place(local=os.path.abspath(os.path.expanduser(location)))
    scheme, rest = location.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        return place_of(rest or ".")
    if scheme == "memory":
        return None
    parts = [p for p in rest.split("?", 1)[0].split("/") if p not in ("", ".")]
    if not parts:
        return None
    return Place(scheme=_FAMILY.get(scheme, scheme), bucket=parts[0], segments=tuple(parts[1:]))


def overlap(source, destination) -> str | None:
    """How ``destination`` overlaps ``source`` (paths, URLs or :class:`Place` objects), as words
    that finish "the destination ...": ``"is the source"``, ``"is inside the source"``,
    ``"contains the source"``; None when they are apart."""
    src = source if isinstance(source, Place) or source is None else place_of(source)
    dst = destination if isinstance(destination, Place) or destination is None else place_of(destination)
    if src is None or dst is None:
        return None
    if src.local is not None or dst.local is not None:
        if src.local is None or dst.local is None:
            return None
        return _local_overlap(src.local, dst.local)
    if (src.scheme, src.bucket) != (dst.scheme, dst.bucket):
        return None
    return _relation(src.segments, dst.segments)


def _relation(src: tuple, dst: tuple) -> str | None:
    if src == dst:
        return "is the source"
    if dst[: len(src)] == src:
        return "is inside the source"
    if src[: len(dst)] == dst:
        return "contains the source"
    return None


def _local_overlap(src: str, dst: str) -> str | None:
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    by_text = _relation(_segments(real_src), _segments(real_dst))
    if by_text:
        return by_text
    # Different text, maybe the same directory: a bind mount, a case-insensitive file system, a
    # hard-linked file.  Compare identities along each path's existing ancestors.
    src_chain, dst_chain = _identities(real_src), _identities(real_dst)
    src_id, dst_id = _identity(real_src), _identity(real_dst)
    if src_id is not None and src_id in dst_chain:
        return "is the source" if dst_id == src_id else "is inside the source"
    if dst_id is not None and dst_id in src_chain:
        return "contains the source"
    return None


def _segments(path: str) -> tuple[str, ...]:
    return tuple(p for p in os.path.normpath(path).split(os.sep) if p)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _identities(path: str) -> set[tuple[int, int]]:
    """(device, inode) of ``path`` and of every existing directory above it."""
    found = set()
    while True:
        identity = _identity(path)
        if identity is not None:
            found.add(identity)
        parent = os.path.dirname(path)
        if parent == path:
            return found
        path = parent


def places_read_by(source) -> list[Place]:
    """Where ``source`` is read from: a path or URL itself; for an array-like, the stores of the
    zarr arrays and napari-tileshard readers it is made of (a dask array's graph, the levels of a
    multiscale list, a wrapper's ``array``/``reader``) and, for a napari layer, the path it was
    opened from (``layer.source.path``) and its data's stores."""
    if isinstance(source, (str, bytes, os.PathLike)):
        return [p for p in (place_of(source),) if p is not None]
    found: list[Place] = []
    seen: set[int] = set()
    pending = [source]
    while pending and len(seen) < 10_000:
        obj = pending.pop()
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        for attr in ("store", "location"):  # zarr.Array.store; ShardReader's location
            value = getattr(obj, attr, None)
            place = place_of(value) if value is not None and not callable(value) else None
            if place is not None:
                found.append(place)
        opened_from = getattr(getattr(obj, "source", None), "path", None)  # a napari layer
        if isinstance(opened_from, (str, os.PathLike)):
            found.extend(p for p in (place_of(opened_from),) if p is not None)
        graph = getattr(obj, "dask", None)  # a dask array: the arrays its tasks read from
        if graph is not None:
            pending.extend(_graph_arrays(graph))
        for attr in ("reader", "array", "data"):  # wrappers (FirstRows, lazy views, layers)
            inner = getattr(obj, attr, None)
            if inner is not None and inner is not obj and (hasattr(inner, "shape") or isinstance(inner, (list, tuple))):
                pending.append(inner)
        if isinstance(obj, (list, tuple)) or type(obj).__name__ == "MultiScaleData":  # pyramid levels
            try:
                pending.extend(obj)
            except TypeError:
                pass
    return found


def _graph_arrays(graph) -> list:
    """The array-likes held in a dask graph's materialized layers (``from_zarr`` keeps its zarr
    array there, one entry): never materializes a layer of tasks, which may be millions."""
    layers = getattr(graph, "layers", None)
    found: list = []
    for layer in layers.values() if isinstance(layers, dict) else [graph]:
        if layers is not None and type(layer).__name__ != "MaterializedLayer":
            continue
        try:
            if len(layer) > 1000:
                continue
            found.extend(v for v in dict(layer).values() if hasattr(v, "shape"))
        except Exception:  # noqa: BLE001 - a layer that cannot be listed names no place
            continue
    return found


def file_system_type(path) -> str | None:
    """The type of the file system that ``path`` (resolved) lies on, as the kernel names it
    (``ext4``, ``tmpfs``, ``nfs4``, ...): the mount in :data:`MOUNT_TABLE` whose mount point is
    the longest prefix of the path (the latest of equal ones: it hides the others).  None where
    that table cannot be read (not Linux)."""
    try:
        with open(MOUNT_TABLE, encoding="utf-8", errors="surrogateescape") as table:
            lines = table.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(os.fspath(path))
    found, longest = None, -1
    for line in lines:
        fields = line.split()
        # mount ID, parent ID, major:minor, root, mount point, options, optional fields..., "-",
        # type, source, super options
        if "-" not in fields[5:]:
            continue
        separator = fields.index("-", 5)
        if separator + 1 >= len(fields):
            continue
        point = _unescape_mount_point(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= longest:
            found, longest = fields[separator + 1], len(point)
    return found


def in_memory_file_system(path) -> bool:
    """Whether ``path`` lies on a file system that keeps its files in memory (tmpfs, ramfs: a
    recording in ``/dev/shm``); False where not known."""
    return file_system_type(path) in MEMORY_FILE_SYSTEMS


def _unescape_mount_point(text: str) -> str:
    """A mount point as the kernel escapes it in the mount table (space, tab, newline and
    backslash as three octal digits)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), text)
