"""The zarr store layer: atomic writes of shards and ``zarr.json`` (made by :mod:`napari_tileshard.format`).

Two sinks share one small interface (``write(key, buffers)``, ``release``, ``discard``):

* :class:`DirectorySink` for a local path (or a zarr ``LocalStore``): each object is written to a
  temporary name in the same directory and renamed over the target, so a reader (or a
  crash) never sees a torn shard or ``zarr.json``; shards are written with ``os.writev`` straight
  from the compressed buffers, without joining them first.  A lock file (``.tileshard.lock``)
  keeps a second writer out for the life of the sink.
* :class:`ZarrStoreSink` for any other zarr v3 ``Store`` (memory, fsspec, ...): one ``set`` per
  object, which is atomic for the stores that support it.

``overwrite`` removes only a store this recorder writes (a Zarr v3 array or an OME-Zarr group of
such arrays, nothing else in it), file by file; anything else is refused.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zstandard

from ._zarr_sync import sync, sync_for
from .errors import StoreExistsError, StoreVanishedError
from .locks import LockFile
from .overwrite import (
    LOCK_NAME,
    METADATA_CAP,
    TEMP_NAME,
    KeyTree,
    LocalTree,
    Unreadable,
    delete_local,
    deletion_order,
    path_depth,
    recognise,
)

__all__ = [
    "DirectorySink",
    "Sink",
    "ZarrStoreSink",
    "byte_views",
    "flat_pieces",
    "check_key",
    "check_store_path",
    "write_deadline",
]

log = logging.getLogger(__name__)

_IOV_MAX = 512


def write_deadline(io_timeout: float, nbytes: int) -> float:
    """Seconds a write of ``nbytes`` may take before it counts as stuck: ``io_timeout`` plus one
    second per MB, so a large shard on a slow (but working) link is not cut off."""
    return io_timeout + nbytes / 1e6


class Sink(ABC):
    """Where the Writer puts objects (shards, ``zarr.json``): the one storage seam.

    What every sink promises (:class:`napari_tileshard.testing.SinkTests` checks it):

    * ``write(key, buffers)`` stores the concatenation of ``buffers`` as object ``key``,
      atomically: a reader sees the previous object or the new one, never a torn one, and a write
      that raises leaves the previous object (or none) in place.  ``key`` is a relative
      ``/``-separated path (:func:`check_key`); ``buffers`` a sequence of C-contiguous bytes-like
      pieces (:func:`byte_views`: bytes, bytearray, memoryview, NumPy arrays of any dtype), empty
      pieces and an empty sequence included (an empty object).  A strided or Fortran-ordered
      piece is refused (ValueError), never silently copied.  The sink keeps no reference to the
      pieces once ``write`` returns: the caller may reuse them.  Writes come from many threads at
      once, to different keys (new nested paths included) or to the same key (the last to finish
      wins).
    * ``location`` is a non-empty string naming the store (a path or URL) for messages.
    * ``release`` ends a recording (drops the writer's lock); ``discard`` undoes a recording that
      failed before it started: it removes every object this sink wrote, its lock, and the store
      directory if this sink created it, and nothing else (an object someone else put there
      stays).  Both are idempotent.  A sink that is a view into another sink's store
      (:class:`napari_tileshard.engine.multi_writer.PrefixedSink`) leaves removal to the owner.
    * ``cancel`` (the recording failed) never raises, and writes after it still work.

    Wrappers (e.g. :class:`napari_tileshard.testing.FaultInjectingSink`) subclass this and
    :func:`~napari_tileshard.storage.urls.open_sink` passes any ``Sink`` through unchanged.
    """

    @property
    @abstractmethod
    def location(self) -> str:
        """A human-readable name of the store (a path or URL) for messages."""

    @abstractmethod
    def write(self, key: str, buffers: Sequence) -> None:
        """Store ``buffers`` (bytes-like, concatenated) as object ``key``, atomically (see the class)."""

    def release(self) -> None:
        """The recording ended: drop the lock (no-op where there is none).  Best effort: a lock
        that cannot be removed (the disk went read-only, say) is logged, never raised, so that it
        never hides how the recording itself ended."""

    def discard(self) -> None:
        """Setup failed: remove what this sink created (no-op where nothing was)."""

    def cancel(self) -> None:
        """The recording failed: cut off the writes in flight where the storage allows it (an
        object store cancels its requests; they raise :class:`~napari_tileshard.storage.errors.WriteCancelledError`).
        Best effort, never raises; writes that cannot be cut off (a local file) run to their end.
        Later writes (``zarr.json`` marked failed) are still allowed, under a short deadline where
        there is one."""


def check_key(key) -> str:
    """``key`` when it names an object inside a store: a non-empty ``/``-separated relative path
    whose parts are neither empty, ``.`` nor ``..`` (as every zarr key is: ``zarr.json``,
    ``0/c/1/2``).  Anything else is a TypeError or ValueError naming it: a key such as ``../x``
    or ``/x`` would write outside a local store."""
    if not isinstance(key, str):
        raise TypeError(f"an object key must be a str, got {type(key).__name__} {key!r}")
    if not key or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(
            f"the object key {key!r} is not a relative path of non-empty parts without '.' or '..' "
            "(e.g. 'zarr.json' or '0/c/1/2')"
        )
    return key


def byte_views(key: str, buffers) -> list[memoryview]:
    """The pieces of object ``key`` as flat byte views (no copy), empty pieces left out.

    ``buffers`` is a sequence (list, tuple) of objects with the buffer protocol: bytes,
    bytearray, memoryview, NumPy arrays of any dtype (their bytes as they lie in memory).  Each
    piece must be C-contiguous: a strided view (``a[:, ::2]``) or a Fortran-ordered array is a
    ValueError rather than a hidden copy (``numpy.ascontiguousarray`` makes one), anything else
    a TypeError; both name the key and the piece.  One bytes-like object in place of the
    sequence is a TypeError too (iterating it would write its rows or its integers).
    """
    if isinstance(buffers, str) or _is_buffer(buffers):
        raise TypeError(
            f"the buffers of object {key!r} must be a sequence of bytes-like pieces (e.g. [data]), "
            f"got one {type(buffers).__name__}"
        )
    views = []
    for index, piece in enumerate(buffers):
        try:
            view = memoryview(piece)
        except TypeError as exc:
            raise TypeError(
                f"piece {index} of object {key!r} is a {type(piece).__name__}, not a bytes-like object "
                f"(bytes, bytearray, memoryview or a NumPy array): {exc}"
            ) from None
        if not view.c_contiguous:
            raise ValueError(
                f"piece {index} of object {key!r} is not C-contiguous (shape {view.shape}, strides "
                f"{view.strides}): pass numpy.ascontiguousarray(piece) to store its elements in C order"
            )
        if view.nbytes:
            views.append(view if view.ndim == 1 and view.format == "B" else view.cast("B"))
    return views


#: types whose objects are flat, contiguous bytes by the type alone: a shard's chunks from
#: python-zstandard's batch encoder, and its index
_FLAT_TYPES = frozenset(t for t in (bytes, getattr(zstandard, "BufferSegment", None)) if t is not None)


def flat_pieces(key: str, buffers) -> list:
    """The non-empty pieces of object ``key``, for ``os.writev``: as they are where each is flat
    bytes by its type (:data:`_FLAT_TYPES`), else :func:`byte_views` (which checks each).  A shard
    of 64 KiB chunks has a piece per chunk, hundreds of shards a second: the check per piece held
    the GIL that the encode threads wait for."""
    if isinstance(buffers, (list, tuple)) and set(map(type, buffers)) <= _FLAT_TYPES:
        return list(filter(len, buffers))
    return byte_views(key, buffers)


def _is_buffer(value) -> bool:
    try:
        memoryview(value)
    except TypeError:
        return False
    return True


class DirectorySink(Sink):
    """Objects as files under ``root``, each written atomically (temporary file + rename).

    The sink holds ``root/.tileshard.lock`` from creation to :meth:`release` (or :meth:`discard`);
    a lock left by a dead process on this host is taken over, any other makes the constructor
    raise :class:`StoreLockedError`.  Writes fail with :class:`StoreVanishedError` once ``root``
    is deleted or replaced, rather than recreating it.
    """

    def __init__(self, root, overwrite: bool = False, keep_existing: bool = False):
        check_store_path(root)
        self.root = Path(root).expanduser().resolve()
        self._keep_existing = keep_existing  # resuming into our own store: nothing is checked or removed
        self._lock = LockFile(self.root, self._not_writable)
        self._created: list[Path] = []  # root and ancestors this sink made, outermost first
        self._dirs: set[str] = set()
        self._made_dirs: list[str] = []  # directories inside root this sink made
        self._written: set[str] = set()
        self._write_error: Exception | None = None  # the first failed write: later failures are secondary
        if self.root.exists() and not self.root.is_dir():
            raise StoreExistsError(f"output path {self.location!r} exists and is not a directory")
        if self.root.is_dir():
            # Read-only: a directory refused here never gets a lock file of ours.
            self._check_contents(overwrite, locked=False)
        self._make_root()
        st = os.stat(self.root)
        self._identity = (st.st_dev, st.st_ino)
        try:
            self._lock.acquire()
            self._check_contents(overwrite, locked=True)
            if keep_existing:
                self._remove_stale_temporary_files()
        except BaseException:
            self.discard()  # a root we made (e.g. on a full disk) goes again
            raise

    @classmethod
    def attach(cls, root) -> DirectorySink:
        """A sink that writes into ``root`` while another sink of this process or another one (a
        conversion's coordinator) holds its lock: no lock, no checks, writes only."""
        sink = cls.__new__(cls)
        sink.root = Path(root).expanduser().resolve()
        sink._lock = LockFile(sink.root, sink._not_writable)  # never acquired: the coordinator holds it
        sink._created, sink._dirs, sink._made_dirs, sink._written = [], set(), [], set()
        sink._write_error = None
        st = os.stat(sink.root)
        sink._identity = (st.st_dev, st.st_ino)
        sink._keep_existing = True
        return sink

    def __repr__(self):
        return f"DirectorySink({str(self.root)!r})"

    @property
    def location(self) -> str:
        return str(self.root)

    def _not_writable(self, exc: OSError) -> OSError:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return PermissionError(exc.errno, f"output path {self.location!r} is not writable: {exc.strerror}")
        # e.g. ENOSPC: keep the errno so callers can tell a full disk from a permission problem
        return OSError(exc.errno, f"output path {self.location!r} is not writable: {exc.strerror}")

    def _make_root(self) -> None:
        missing = []
        path = self.root
        while not path.exists() and path != path.parent:
            missing.append(path)
            path = path.parent
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:  # made by someone else meanwhile: not ours to remove
                continue
            except OSError as exc:
                raise self._not_writable(exc) from exc
            self._created.append(path)

    def _check_contents(self, overwrite: bool, locked: bool) -> None:
        names = [n for n in os.listdir(self.root) if not (locked and n == LOCK_NAME)]
        if not names or self._keep_existing:
            return
        if not locked and LOCK_NAME in names:
            self._lock.check_holder()  # a live writer's lock: refused before anything else
        plan = recognise(LocalTree(self.root))
        if not overwrite:  # the hint to overwrite only where an overwrite would go ahead
            raise StoreExistsError(plan.exists_message(self.location))
        refusal = plan.refusal(self.location)
        if refusal:
            raise StoreExistsError(refusal)
        if locked:
            delete_local(self.root, plan)

    def _remove_stale_temporary_files(self) -> None:
        """Continuing a store of ours (its lock held): the temporary files of writes that an
        earlier process never finished (named as :meth:`_write` names them) go; nothing else is
        touched, and symlinks are not followed."""
        for top, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(top, d))]
            for name in files:
                if TEMP_NAME.fullmatch(name) and os.path.isfile(os.path.join(top, name)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(top, name))

    def release(self) -> None:
        try:
            self._lock.release()
        except OSError as exc:
            # Secondary: storage that failed a write (read-only remount, vanished mount) fails this
            # too, and the first failure is what the Writer reports.  Left behind, the lock of a
            # dead process on this host is taken over by the next writer.
            if self._write_error is not None:
                log.warning("also: could not remove the lock file %s: %s", self._lock.path, exc.strerror or exc)
            else:
                log.warning(
                    "could not remove the lock file %s: %s; what was recorded is complete, "
                    "delete the lock once no writer is running",
                    self._lock.path,
                    exc.strerror or exc,
                )

    def discard(self) -> None:
        same = self._same_root()
        if same:
            for key in self._written:
                try:
                    os.unlink(self.root / key)
                except OSError:
                    pass
            for rel in sorted(self._made_dirs, key=path_depth, reverse=True):
                try:
                    os.rmdir(self.root / rel)
                except OSError:
                    pass
        self._written, self._made_dirs, self._dirs = set(), [], set()
        self.release()
        created, self._created = self._created, []
        if same:
            for path in reversed(created):
                try:
                    os.rmdir(path)
                except OSError:  # not empty (someone else's now) or gone
                    break

    # -- writing -------------------------------------------------------------------------
    def _same_root(self) -> bool:
        try:
            st = os.stat(self.root)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def _check_root(self) -> None:
        # The lock's identity too: a directory recreated at the same path may reuse the inode.
        if not self._same_root() or (self._lock.held and not self._lock.in_place()):
            raise StoreVanishedError(
                errno.ENOENT,
                f"the store directory {self.location!r} was deleted or moved "
                f"during the recording (or its lock file {LOCK_NAME} was removed)",
            )

    def write(self, key: str, buffers) -> None:
        pieces = flat_pieces(check_key(key), buffers)  # refused arguments are no storage failure
        try:
            self._write(key, pieces)
        except Exception as exc:  # an interrupt is no storage failure (it still propagates)
            if self._write_error is None:
                self._write_error = exc
            raise

    def _write(self, key: str, pieces: list) -> None:
        # Paths as strings, not pathlib objects: a recording writes hundreds of shards a second,
        # and building Path objects for each held the GIL that encode threads wait for.
        self._check_root()
        root = os.fspath(self.root)
        parent, _, name = key.rpartition("/")
        if parent and parent not in self._dirs:
            parts = parent.split("/")
            try:
                for i in range(1, len(parts) + 1):
                    rel = "/".join(parts[:i])
                    if rel in self._dirs:
                        continue
                    try:
                        os.mkdir(f"{root}/{rel}")  # one level at a time: never the root or above
                        self._made_dirs.append(rel)
                    except FileExistsError:
                        pass
                    self._dirs.add(rel)
            except FileNotFoundError:
                self._check_root()
                raise
        path = f"{root}/{key}"
        folder = f"{root}/{parent}" if parent else root
        tmp = f"{folder}/.{name}.{_temporary_token()}.tmp"
        # The temporary file is created inside the try that removes it: an interrupt landing just
        # after it was created (Ctrl-C while convert publishes zarr.json) left a 0-byte file.
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for start in range(0, len(pieces), _IOV_MAX):
                    _writev_all(fd, pieces[start : start + _IOV_MAX])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except FileNotFoundError:
            Path(tmp).unlink(missing_ok=True)
            self._check_root()
            raise
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._written.add(key)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None


#: temporary file names: this process's random part, then a count (12 hex digits in all, as
#: ``overwrite.TEMP_NAME`` expects); one random draw per process (a forked child draws its own:
#: processes of one conversion write into one store), not a uuid4 per file
_temporary_prefix = uuid.uuid4().hex[:6]
_temporary_count = itertools.count()


def _new_temporary_prefix() -> None:
    global _temporary_prefix
    _temporary_prefix = uuid.uuid4().hex[:6]


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere a child process imports this module afresh
    os.register_at_fork(after_in_child=_new_temporary_prefix)


def _temporary_token() -> str:
    return f"{_temporary_prefix}{next(_temporary_count) % (1 << 24):06x}"


def _writev_all(fd: int, pieces: list) -> None:
    """Every byte of ``pieces`` (flat: ``len`` is their bytes) to ``fd``: one writev as a rule,
    the rest again where the OS wrote part."""
    written = os.writev(fd, pieces)
    if written == sum(map(len, pieces)):
        return  # the usual case: no Python per piece
    views = [memoryview(piece).cast("B") for piece in pieces]
    while True:
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if not views:
            return
        if written:
            views[0] = views[0][written:]
        written = os.writev(fd, views)


class ZarrStoreSink(Sink):
    """Objects in any zarr v3 ``Store`` (MemoryStore, FsspecStore, ...), one ``set`` each.

    ``private``: the sink made ``store`` and no one else holds it (``memory://``): a
    ``MemoryStore``'s coroutines then run on the calling thread (``_zarr_sync.sync_for``).
    """

    def __init__(self, store, overwrite: bool = False, *, private: bool = False):
        self.store = store
        self._sync = sync_for(store, private)
        self._written: set[str] = set()
        if getattr(store, "read_only", False):
            raise PermissionError(f"store {store!r} is read-only")

        async def collect():
            return [key async for key in store.list()]

        keys = self._sync(collect())
        if not keys:
            return
        plan = recognise(KeyTree(keys, self.read_capped))
        if not overwrite:
            raise StoreExistsError(plan.exists_message(f"store {store!r}"))
        refusal = plan.refusal(self.location)
        if refusal:
            raise StoreExistsError(refusal)
        data, meta = deletion_order(plan.files)
        for key in data + meta:
            self._sync(store.delete(key))

    @classmethod
    def attach(cls, store) -> ZarrStoreSink:
        """A sink into ``store`` whose contents another sink already vetted (a conversion's tasks)."""
        sink = cls.__new__(cls)
        sink.store, sink._sync, sink._written = store, sync, set()
        return sink

    def __repr__(self):
        return f"ZarrStoreSink({self.store!r})"

    @property
    def location(self) -> str:
        return str(self.store)

    def read_capped(self, key: str) -> bytes:
        data = self.read(key)
        if data is None:
            raise FileNotFoundError(key)
        if len(data) > METADATA_CAP:
            raise Unreadable(f"is larger than {METADATA_CAP >> 20} MiB")
        return data

    def write(self, key: str, buffers) -> None:
        from zarr.buffer import default_buffer_prototype

        # Store.set takes one buffer: joining a shard's pieces (chunks, index) is the one copy it
        # costs.  A single piece is wrapped without copying only when it is immutable (bytes): a
        # MemoryStore keeps the buffer it is given, and the caller may reuse its pieces.
        views = byte_views(check_key(key), buffers)
        data = views[0] if len(views) == 1 and type(views[0].obj) is bytes else b"".join(views)
        array = np.frombuffer(data, dtype=np.uint8)
        self._sync(self.store.set(key, default_buffer_prototype().buffer.from_array_like(array)))
        self._written.add(key)

    def read(self, key: str) -> bytes | None:
        from zarr.buffer import default_buffer_prototype

        buffer = self._sync(self.store.get(key, default_buffer_prototype()))
        return None if buffer is None else buffer.to_bytes()

    def discard(self) -> None:
        written, self._written = self._written, set()
        for key in written:
            self._sync(self.store.delete(key))


def check_store_path(store) -> None:
    """Refuse an empty store path: ``""`` (or only whitespace, or ``file://`` with nothing after
    it) would otherwise resolve to the current directory and write or read there.  A ValueError
    naming the value; anything else (a Store, a Sink, a non-empty path) passes unchanged."""
    if isinstance(store, os.PathLike):
        store = os.fspath(store)
    if isinstance(store, bytes):
        text = store.decode(errors="replace")
    elif isinstance(store, str):
        text = store
    else:
        return
    path = text[len("file://") :] if text[:7].lower() == "file://" else text
    if not path.strip():
        raise ValueError(
            f"the store path {store!r} is empty: give a directory such as 'recording.zarr' or a store URL "
            "(an empty path would mean the current directory)"
        )
