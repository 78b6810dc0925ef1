"""The zarr store and metadata layer: array ``zarr.json`` and atomic writes of shards.

Two sinks share one small interface (``write(key, buffers)``, ``read``, ``exists``):

* :class:`DirectorySink` for a local path (or a zarr ``LocalStore``): each object is written to a
  temporary name in the same directory and renamed over the target, so a reader (or a
  crash) never sees a torn shard or ``zarr.json``; shards are written with ``os.writev`` straight
  from the compressed buffers, without joining them first.
* :class:`ZarrStoreSink` for any other zarr v3 ``Store`` (memory, fsspec, ...): one ``set`` per
  object, which is atomic for the stores that support it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from .layout import Layout

METADATA_KEY = "zarr.json"
_IOV_MAX = 512


def array_metadata(layout: Layout, codec: str, level: int, shape0: int, attributes=None) -> dict:
    """Standard Zarr v3 array metadata with the ``sharding_indexed`` codec for ``layout``."""
    inner_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if codec == "zstd":
        inner_codecs.append({"name": "zstd", "configuration": {"level": int(level), "checksum": False}})
    shape = [int(shape0)] + [int(s) for s in layout.shape[1:]]
    fill_value = 0.0 if layout.dtype.kind == "f" else 0
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": shape,
        "data_type": layout.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(layout.shard_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill_value,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(layout.tile_shape),
                    "codecs": inner_codecs,
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ],
        "attributes": dict(attributes or {}),
        "dimension_names": list(layout.names),
        "storage_transformers": [],
    }


def metadata_bytes(metadata: dict) -> bytes:
    return json.dumps(metadata, indent=2).encode()


class StoreExistsError(FileExistsError):
    pass


class Sink(ABC):
    """Where the Writer puts objects (shards, ``zarr.json``): the one storage seam.

    ``write`` stores one object atomically from a sequence of buffers (a reader sees the old
    object or the new one, never a torn one).  ``release`` ends a recording (drops the writer's
    lock); ``discard`` undoes a recording that failed before it started: it removes every object
    this sink wrote, its lock, and the store directory if this sink created it.  Both are
    idempotent.  Wrappers (e.g. :class:`napari_tileshard.testing.FaultInjectingSink`) subclass
    this and :func:`open_sink` passes any ``Sink`` through unchanged.
    """

    @property
    @abstractmethod
    def location(self) -> str:
        """A human-readable name of the store (a path or URL) for messages."""

    @abstractmethod
    def write(self, key: str, buffers: Sequence) -> None:
        """Store ``buffers`` (bytes-like, concatenated) as object ``key``, atomically."""

    def release(self) -> None:
        """The recording ended: drop the lock (no-op where there is none)."""

    def discard(self) -> None:
        """Setup failed: remove what this sink created (no-op where nothing was)."""


class DirectorySink(Sink):
    """Objects as files under ``root``, each written atomically (temporary file + rename)."""

    def __init__(self, root, overwrite: bool = False):
        self.root = Path(root).expanduser().absolute()
        if self.root.exists():
            if not self.root.is_dir():
                raise StoreExistsError(f"output path {str(self.root)!r} exists and is not a directory")
            if any(self.root.iterdir()):
                if not overwrite:
                    raise StoreExistsError(
                        f"output {str(self.root)!r} already exists and is not empty; pass overwrite=True "
                        "to replace it"
                    )
                if not (self.root / METADATA_KEY).exists():
                    raise StoreExistsError(
                        f"refusing to overwrite {str(self.root)!r}: it is not a zarr store (no zarr.json)"
                    )
                shutil.rmtree(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise PermissionError(f"output path {str(self.root)!r} is not writable: {exc.strerror}") from exc
        self._made_dirs: set[Path] = {self.root}

    def __repr__(self):
        return f"DirectorySink({str(self.root)!r})"

    @property
    def location(self) -> str:
        return str(self.root)

    def write(self, key: str, buffers) -> None:
        path = self.root / key
        parent = path.parent
        if parent not in self._made_dirs:
            parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(parent)
        tmp = parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            views = [memoryview(b).cast("B") for b in buffers]
            views = [v for v in views if v.nbytes]
            for start in range(0, len(views), _IOV_MAX):
                _writev_all(fd, views[start : start + _IOV_MAX])
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None


def _writev_all(fd: int, views: list) -> None:
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class ZarrStoreSink(Sink):
    """Objects in any zarr v3 ``Store`` (MemoryStore, FsspecStore, ...), one ``set`` each."""

    def __init__(self, store, overwrite: bool = False):
        from zarr.core.sync import sync

        self.store = store
        self._sync = sync
        if getattr(store, "read_only", False):
            raise PermissionError(f"store {store!r} is read-only")
        if self._sync(store.exists(METADATA_KEY)):
            if not overwrite:
                raise StoreExistsError(f"store {store!r} already holds a zarr node; pass overwrite=True")
            self._sync(store.delete_dir(""))

    def __repr__(self):
        return f"ZarrStoreSink({self.store!r})"

    @property
    def location(self) -> str:
        return str(self.store)

    def write(self, key: str, buffers) -> None:
        from zarr.core.buffer import default_buffer_prototype

        data = b"".join(memoryview(b).cast("B") for b in buffers)
        self._sync(self.store.set(key, default_buffer_prototype().buffer.from_bytes(data)))

    def read(self, key: str) -> bytes | None:
        from zarr.core.buffer import default_buffer_prototype

        buffer = self._sync(self.store.get(key, default_buffer_prototype()))
        return None if buffer is None else buffer.to_bytes()


def open_sink(store, overwrite: bool = False):
    """A sink for ``store``: a path, a zarr ``LocalStore`` or any other zarr v3 ``Store``; a
    :class:`Sink` is returned as it is."""
    if isinstance(store, Sink):
        return store
    if isinstance(store, (str, os.PathLike)):
        return DirectorySink(store, overwrite)
    try:
        from zarr.storage import LocalStore
    except ImportError:  # pragma: no cover - zarr is a dependency
        LocalStore = ()
    if isinstance(store, LocalStore):
        if store.read_only:
            raise PermissionError(f"store {store!r} is read-only")
        return DirectorySink(store.root, overwrite)
    if hasattr(store, "set") and hasattr(store, "get"):
        return ZarrStoreSink(store, overwrite)
    raise TypeError(f"store must be a path or a zarr v3 Store, got {type(store).__name__}")


def list_shard_keys(store, prefix: str = "") -> list[str]:
    """Keys (relative to ``prefix``) of the shard objects under ``c/`` that exist in a zarr Store,
    skipping hidden temporary files; never walks a declared grid."""
    from zarr.core.sync import sync

    async def collect():
        base = f"{prefix}/c/" if prefix else "c/"
        return [key[len(prefix) + 1:] if prefix else key async for key in store.list_prefix(base)]

    return [k for k in sync(collect()) if not k.rsplit("/", 1)[-1].startswith(".")]
