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

import errno
import itertools
import json
import logging
import os
import re
import socket
import stat
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

METADATA_KEY = "zarr.json"
LOCK_NAME = ".tileshard.lock"
#: the manifest of a conversion (napari_tileshard.convert): which shard epochs are done
CONVERT_MANIFEST_NAME = ".tileshard-convert.json"
_TAKEOVER_NAME = LOCK_NAME + ".takeover"
_IOV_MAX = 512
_METADATA_CAP = 16 << 20
_TEMP_NAME = re.compile(r"\.[^/]+\.[0-9a-f]{12}\.tmp")
_CHUNK_NAME = re.compile(r"[0-9]+")
_OVERWRITE_HINT = "use overwrite=True (--overwrite on the command line)"


def metadata_bytes(metadata: dict) -> bytes:
    return json.dumps(metadata, indent=2).encode()


class StoreExistsError(FileExistsError):
    pass


class StoreLockedError(StoreExistsError):
    """Another writer holds the store's lock file."""


class StoreVanishedError(OSError):
    """The store directory was deleted or replaced while a sink was writing into it."""

    def __str__(self):
        return self.strerror


class _Unreadable(Exception):
    """A metadata or lock object that cannot be trusted; the message says why."""


def _read_capped(path, cap: int) -> bytes:
    """A regular file's bytes; never follows a symlink nor blocks on a FIFO (raises _Unreadable)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _Unreadable("is not a regular file")
    if st.st_size > cap:
        raise _Unreadable(f"is larger than {cap >> 20} MiB")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
        raise _Unreadable(f"cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise _Unreadable("was replaced while being read")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise _Unreadable(f"is larger than {cap >> 20} MiB")
    return data


def _parse_metadata(data: bytes) -> dict:
    if not data.strip():
        raise _Unreadable("is empty")
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise _Unreadable("is not JSON") from None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") not in ("array", "group"):
        raise _Unreadable("is not Zarr v3 metadata")
    return meta


class _Plan:
    """What an overwrite may delete (``files``, then ``dirs`` once empty) or why it may not."""

    def __init__(self):
        self.files: list[str] = []
        self.dirs: list[str] = []
        self.foreign: list[str] = []
        self.problems: list[str] = []

    def refusal(self, location: str) -> str | None:
        parts = list(self.problems)
        if self.foreign:
            names = ", ".join(repr(n) for n in self.foreign[:5])
            if len(self.foreign) > 5:
                names += f" and {len(self.foreign) - 5} more"
            parts.append(f"it holds {names} which this recorder did not write")
        return f"refusing to overwrite {location!r}: " + "; ".join(parts) if parts else None


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _recognise(tree) -> _Plan:
    """Classify a store's tree (``tree.entries(rel)`` -> {name: "file"|"dir"|"other"},
    ``tree.read(rel)`` -> bytes) as a Zarr v3 array, an OME-Zarr group of arrays, or a collection
    of those (:class:`~napari_tileshard.multi_writer.MultiWriter`), as written here."""
    plan = _Plan()
    top = tree.entries("")
    meta = _node_metadata(tree, "", top, plan, "its zarr.json")
    if meta is None and METADATA_KEY not in top and any(_foreign_name(n, k, True) for n, k in top.items()):
        plan.problems.append("it is not a zarr store (no zarr.json)")
    _members(tree, "", top, _node_members(meta, "", plan, collection=True), plan, root=True)
    return plan


def _node_members(meta: dict | None, rel: str, plan: _Plan, collection: bool = False) -> dict:
    """What the node described by ``meta`` may hold: its chunks (an array), its levels (an
    OME-Zarr image) or, at the root, its streams (a collection)."""
    if meta is None:
        return {}
    if meta["node_type"] == "array":
        return {"c": _chunks}
    from .multi_writer import COLLECTION_KEY, is_collection  # lazily: these build on this module
    from .ome import multiscale_paths

    attributes = meta.get("attributes") or {}
    if collection and is_collection(attributes):
        members = {"OME": _series_group}
        for path in attributes[COLLECTION_KEY]["streams"].values():
            if _plain_name(path, plan, "stream"):
                members[path] = _image
        return members
    paths = multiscale_paths(attributes)
    if paths is None:
        where = f"{_join(rel, METADATA_KEY)!r}" if rel else "its zarr.json"
        plan.problems.append(f"{where} describes a group without OME-Zarr multiscales")
        return {}
    return {path: _dataset for path in paths if _plain_name(path, plan, "OME-Zarr dataset")}


def _plain_name(path, plan: _Plan, what: str) -> bool:
    if not isinstance(path, str) or "/" in path or path in ("", ".", "..", METADATA_KEY) or path.startswith("."):
        plan.problems.append(f"its {what} path {path!r} is not one this recorder writes")
        return False
    return True


def _image(tree, rel, plan) -> None:
    """One stream of a collection: an OME-Zarr image group, or a bare array."""
    entries = tree.entries(rel)
    meta = _node_metadata(tree, rel, entries, plan, f"{_join(rel, METADATA_KEY)!r}")
    if meta is None and METADATA_KEY not in entries:
        plan.problems.append(f"stream {rel!r} has no zarr.json")
    _members(tree, rel, entries, _node_members(meta, rel, plan), plan)
    plan.dirs.append(rel)


def _series_group(tree, rel, plan) -> None:
    """The collection's ``OME/`` group: its zarr.json only."""
    entries = tree.entries(rel)
    _node_metadata(tree, rel, entries, plan, f"{_join(rel, METADATA_KEY)!r}")
    _members(tree, rel, entries, {}, plan)
    plan.dirs.append(rel)


def _foreign_name(name: str, kind: str, root: bool) -> bool:
    if root and name in (LOCK_NAME, _TAKEOVER_NAME, CONVERT_MANIFEST_NAME):
        return kind != "file"
    return not (kind == "file" and _TEMP_NAME.fullmatch(name))


def _node_metadata(tree, rel, entries, plan, what) -> dict | None:
    key = _join(rel, METADATA_KEY)
    kind = entries.get(METADATA_KEY)
    if kind is None:
        return None
    try:
        if kind != "file":
            raise _Unreadable("is not a regular file")
        meta = _parse_metadata(tree.read(key))
    except _Unreadable as exc:
        plan.problems.append(f"{what} {exc}")
        return None
    except FileNotFoundError:
        plan.problems.append(f"{what} vanished while being read")
        return None
    plan.files.append(key)
    return meta


def _members(tree, rel, entries, members, plan, root=False) -> None:
    for name, kind in entries.items():
        path = _join(rel, name)
        if name == METADATA_KEY:  # classified by _node_metadata
            continue
        if kind == "dir" and name in members:
            members[name](tree, path, plan)
        elif not _foreign_name(name, kind, root):
            if name not in (LOCK_NAME, _TAKEOVER_NAME):  # the lock is the overwriter's own now
                plan.files.append(path)
        else:
            plan.foreign.append(path + "/" if kind == "dir" else path)


def _dataset(tree, rel, plan) -> None:
    entries = tree.entries(rel)
    meta = _node_metadata(tree, rel, entries, plan, f"{_join(rel, METADATA_KEY)!r}")
    if meta is not None and meta["node_type"] != "array":
        plan.problems.append(f"{_join(rel, METADATA_KEY)!r} is not array metadata")
        plan.files.remove(_join(rel, METADATA_KEY))
        meta = None
    elif meta is None and METADATA_KEY not in entries:
        plan.problems.append(f"dataset {rel!r} has no zarr.json")
    _members(tree, rel, entries, {"c": _chunks} if meta is not None else {}, plan)
    plan.dirs.append(rel)


def _chunks(tree, rel, plan) -> None:
    for name, kind in tree.entries(rel).items():
        path = _join(rel, name)
        if _CHUNK_NAME.fullmatch(name) and kind == "dir":
            _chunks(tree, path, plan)
        elif (_CHUNK_NAME.fullmatch(name) or _TEMP_NAME.fullmatch(name)) and kind == "file":
            plan.files.append(path)
        else:
            plan.foreign.append(path + "/" if kind == "dir" else path)
    plan.dirs.append(rel)


def overwrite_refusal(path) -> str | None:
    """Why ``overwrite=True`` would refuse the local directory ``path`` (it holds something this
    recorder did not write), or None when it may be replaced (or does not exist / is empty).
    Read-only: what a form checks before Start, by the same rules the Writer applies."""
    root = Path(path).expanduser()
    if not root.exists():
        return None
    if not root.is_dir():
        return f"output path {str(root)!r} exists and is not a directory"
    if not any(root.iterdir()):
        return None
    return _recognise(_LocalTree(root.resolve())).refusal(str(root))


class _LocalTree:
    def __init__(self, root: Path):
        self.root = root

    def entries(self, rel: str) -> dict:
        result = {}
        try:
            with os.scandir(self.root / rel) as it:
                for entry in it:
                    if entry.is_symlink():
                        kind = "other"
                    elif entry.is_dir(follow_symlinks=False):
                        kind = "dir"
                    else:
                        kind = "file" if entry.is_file(follow_symlinks=False) else "other"
                    result[entry.name] = kind
        except FileNotFoundError:
            pass
        return dict(sorted(result.items()))

    def read(self, rel: str) -> bytes:
        return _read_capped(self.root / rel, _METADATA_CAP)


def _open_dir(root_fd: int, rel: str) -> int:
    """A descriptor of ``rel`` under ``root_fd``, refusing any symlink on the way."""
    fd = os.dup(root_fd)
    for part in filter(None, rel.split("/")):
        try:
            fd_next = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = fd_next
    return fd


def _deletion_order(paths: list[str]) -> tuple[list[str], list[str]]:
    """Data, then ``zarr.json`` files (deepest first): an interrupted overwrite leaves a store that
    the next overwrite still recognises."""
    meta = [p for p in paths if p.rpartition("/")[2] == METADATA_KEY]
    return [p for p in paths if p.rpartition("/")[2] != METADATA_KEY], sorted(meta, key=_depth, reverse=True)


def _depth(path: str) -> int:
    return path.count("/")


def _delete_local(root: Path, plan: _Plan) -> None:
    data, meta = _deletion_order(plan.files)
    dirs = sorted(plan.dirs, key=_depth, reverse=True)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Dataset directories empty only once their zarr.json is gone: a second pass over dirs.
        for step, remove in ((data, os.unlink), (dirs, os.rmdir), (meta, os.unlink), (dirs, os.rmdir)):
            for parent, paths in itertools.groupby(step, key=lambda p: p.rpartition("/")[0]):
                try:
                    fd = _open_dir(root_fd, parent)
                except FileNotFoundError:
                    continue
                try:
                    for path in paths:
                        try:
                            remove(path.rpartition("/")[2], dir_fd=fd)
                        except OSError as exc:  # gone, or a directory with something new in it: kept
                            if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                                raise
                finally:
                    os.close(fd)
    finally:
        os.close(root_fd)


def write_deadline(io_timeout: float, nbytes: int) -> float:
    """Seconds a write of ``nbytes`` may take before it counts as stuck: ``io_timeout`` plus one
    second per MB, so a large shard on a slow (but working) link is not cut off."""
    return io_timeout + nbytes / 1e6


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
        """The recording ended: drop the lock (no-op where there is none).  Best effort: a lock
        that cannot be removed (the disk went read-only, say) is logged, never raised, so that it
        never hides how the recording itself ended."""

    def telemetry_lost(self, round_index: int) -> bool:
        """Whether the I/O dispatcher's measurements of batch ``round_index`` are lost (then it
        places that batch statically and learns nothing from it).  Real sinks never lose them;
        this is the fault-injection seam of :class:`napari_tileshard.testing.FaultInjectingSink`."""
        return False

    def discard(self) -> None:
        """Setup failed: remove what this sink created (no-op where nothing was)."""

    def cancel(self) -> None:
        """The recording failed: cut off the writes in flight where the storage allows it (an
        object store cancels its requests; they raise :class:`~napari_tileshard.errors.WriteCancelledError`).
        Best effort; writes that cannot be cut off (a local file) run to their end.  Later writes
        (``zarr.json`` marked failed) are still allowed, under a short deadline where there is one."""


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
        self._lock_path = self.root / LOCK_NAME
        self._lock_id: tuple | None = None  # (st_dev, st_ino, content) of the lock file while we hold it
        self._created: list[Path] = []  # root and ancestors this sink made, outermost first
        self._dirs: set[str] = set()
        self._made_dirs: list[str] = []  # directories inside root this sink made
        self._written: set[str] = set()
        self._write_error: BaseException | None = None  # the first failed write: later failures are secondary
        if self.root.exists() and not self.root.is_dir():
            raise StoreExistsError(f"output path {self.location!r} exists and is not a directory")
        if self.root.is_dir():
            # Read-only: a directory refused here never gets a lock file of ours.
            self._check_contents(overwrite, locked=False)
        self._make_root()
        st = os.stat(self.root)
        self._identity = (st.st_dev, st.st_ino)
        try:
            self._lock()
            self._check_contents(overwrite, locked=True)
        except BaseException:
            self.discard()  # a root we made (e.g. on a full disk) goes again
            raise

    @classmethod
    def attach(cls, root) -> DirectorySink:
        """A sink that writes into ``root`` while another sink of this process or another one (a
        conversion's coordinator) holds its lock: no lock, no checks, writes only."""
        sink = cls.__new__(cls)
        sink.root = Path(root).expanduser().resolve()
        sink._lock_path = sink.root / LOCK_NAME
        sink._lock_id = None
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
            try:
                self._holder(_read_capped(self._lock_path, 1 << 16))
            except (FileNotFoundError, _Unreadable):
                pass  # judged again when locking
        if not overwrite:
            raise StoreExistsError(
                f"output {self.location!r} already exists and is not empty; {_OVERWRITE_HINT} to replace it"
            )
        plan = _recognise(_LocalTree(self.root))
        refusal = plan.refusal(self.location)
        if refusal:
            raise StoreExistsError(refusal)
        if locked:
            _delete_local(self.root, plan)

    # -- the lock ------------------------------------------------------------------------
    def _holder(self, content: bytes) -> dict:
        """The lock's holder if it is a dead process on this host (stale); else StoreLockedError."""
        try:
            holder = json.loads(content)
            pid, host = holder["pid"], holder["host"]
            if not isinstance(pid, int) or pid <= 0 or not isinstance(host, str):
                raise TypeError
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            raise StoreLockedError(
                f"{self.location!r} is locked by another writer (unreadable lock file); "
                f"if no writer is running, delete {str(self._lock_path)!r}"
            ) from None
        if host == socket.gethostname() and not _alive(pid):
            return holder
        raise StoreLockedError(
            f"{self.location!r} is being written by pid {pid} on host {host} since "
            f"{holder.get('started', '?')}; if that process is gone, delete "
            f"{str(self._lock_path)!r}"
        )

    def _lock(self) -> None:
        content = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.now().astimezone().isoformat(timespec="seconds"),
                "tool": "napari-tileshard",
            }
        ).encode()
        for attempt in range(5):
            try:
                fd = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                pass
            except OSError as exc:
                raise self._not_writable(exc) from exc
            else:
                self._lock_id = self._fill_lock(fd, content, self._lock_path)
                return
            try:
                seen = _read_capped(self._lock_path, 1 << 16)
            except FileNotFoundError:
                continue  # released meanwhile
            except _Unreadable:
                seen = b""
            try:
                holder = self._holder(seen)
            except StoreLockedError:
                if attempt < 2 and not seen:  # a new lock is filled right after its creation
                    time.sleep(0.02)
                    continue
                raise
            if self._take_over(seen, content, holder):
                return
        raise StoreLockedError(f"{self.location!r} is locked by other writers; try again")

    def _fill_lock(self, fd: int, content: bytes, path: Path) -> tuple:
        try:
            try:
                os.write(fd, content)
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise self._not_writable(exc) from exc
        return st.st_dev, st.st_ino, content

    def _take_over(self, seen: bytes, content: bytes, holder: dict) -> bool:
        """Replace the stale lock ``seen`` by ours; a second file serialises takers-over, and the
        lock path never disappears meanwhile, so a plain O_EXCL creator cannot win too."""
        mutex = self.root / _TAKEOVER_NAME
        try:
            os.close(os.open(mutex, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        except FileExistsError:
            raise StoreLockedError(
                f"another writer is taking over the stale lock of {self.location!r}; if none is, delete {str(mutex)!r}"
            ) from None
        try:
            try:
                if _read_capped(self._lock_path, 1 << 16) != seen:
                    return False
            except (FileNotFoundError, _Unreadable):
                return False
            tmp = self.root / f"{LOCK_NAME}.{uuid.uuid4().hex[:12]}.tmp"
            lock_id = self._fill_lock(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), content, tmp)
            os.replace(tmp, self._lock_path)
            self._lock_id = lock_id
            log.warning(
                "%s: taking over the lock of pid %s (started %s), which is no longer running",
                self.location,
                holder["pid"],
                holder.get("started", "?"),
            )
            return True
        finally:
            mutex.unlink(missing_ok=True)

    def _lock_in_place(self) -> bool:
        try:
            st = os.lstat(self._lock_path)
        except OSError:
            return False
        return self._lock_id is not None and (st.st_dev, st.st_ino) == self._lock_id[:2]

    def release(self) -> None:
        if self._lock_id is None:
            return
        try:
            ours = self._lock_in_place() and _read_capped(self._lock_path, 1 << 16) == self._lock_id[2]
        except (OSError, _Unreadable):
            ours = False
        self._lock_id = None
        if not ours:
            return
        try:
            self._lock_path.unlink(missing_ok=True)
        except OSError as exc:
            # Secondary: storage that failed a write (read-only remount, vanished mount) fails this
            # too, and the first failure is what the Writer reports.  Left behind, the lock of a
            # dead process on this host is taken over by the next writer.
            if self._write_error is not None:
                log.warning("also: could not remove the lock file %s: %s", self._lock_path, exc.strerror or exc)
            else:
                log.warning(
                    "could not remove the lock file %s: %s; what was recorded is complete, "
                    "delete the lock once no writer is running",
                    self._lock_path,
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
            for rel in sorted(self._made_dirs, key=_depth, reverse=True):
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
        if not self._same_root() or (self._lock_id is not None and not self._lock_in_place()):
            raise StoreVanishedError(
                errno.ENOENT,
                f"the store directory {self.location!r} was deleted or moved "
                f"during the recording (or its lock file {LOCK_NAME} was removed)",
            )

    def write(self, key: str, buffers) -> None:
        try:
            self._write(key, buffers)
        except BaseException as exc:
            if self._write_error is None:
                self._write_error = exc
            raise

    def _write(self, key: str, buffers) -> None:
        self._check_root()
        parts = key.split("/")
        try:
            for i in range(1, len(parts)):
                rel = "/".join(parts[:i])
                if rel in self._dirs:
                    continue
                try:
                    os.mkdir(self.root / rel)  # one level at a time: never the root or above
                    self._made_dirs.append(rel)
                except FileExistsError:
                    pass
                self._dirs.add(rel)
            path = self.root / key
            tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            self._check_root()
            raise
        try:
            try:
                views = [memoryview(b).cast("B") for b in buffers]
                views = [v for v in views if v.nbytes]
                for start in range(0, len(views), _IOV_MAX):
                    _writev_all(fd, views[start : start + _IOV_MAX])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._written.add(key)

    def read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, under another user
        return True
    return True


def _writev_all(fd: int, views: list) -> None:
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class _KeyTree:
    """A zarr Store's keys seen as a directory tree, for :func:`_recognise`."""

    def __init__(self, keys, read):
        self.nodes: dict = {}
        for key in keys:
            node = self.nodes
            *dirs, name = key.split("/")
            for part in dirs:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            else:
                node.setdefault(name, None)
        self.read = read

    def entries(self, rel: str) -> dict:
        node: Any = self.nodes
        for part in filter(None, rel.split("/")):
            node = node.get(part)
        return {name: "dir" if isinstance(sub, dict) else "file" for name, sub in sorted(node.items())}


class ZarrStoreSink(Sink):
    """Objects in any zarr v3 ``Store`` (MemoryStore, FsspecStore, ...), one ``set`` each.

    ``private``: the sink made ``store`` and no one else holds it (``memory://``): a
    ``MemoryStore``'s coroutines then run on the calling thread (``_zarr_sync.sync_for``).
    """

    def __init__(self, store, overwrite: bool = False, *, private: bool = False):
        from ._zarr_sync import sync_for

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
        if not overwrite:
            raise StoreExistsError(f"store {store!r} is not empty; {_OVERWRITE_HINT} to replace it")
        plan = _recognise(_KeyTree(keys, self._read_capped))
        refusal = plan.refusal(self.location)
        if refusal:
            raise StoreExistsError(refusal)
        data, meta = _deletion_order(plan.files)
        for key in data + meta:
            self._sync(store.delete(key))

    @classmethod
    def attach(cls, store) -> ZarrStoreSink:
        """A sink into ``store`` whose contents another sink already vetted (a conversion's tasks)."""
        from ._zarr_sync import sync

        sink = cls.__new__(cls)
        sink.store, sink._sync, sink._written = store, sync, set()
        return sink

    def __repr__(self):
        return f"ZarrStoreSink({self.store!r})"

    @property
    def location(self) -> str:
        return str(self.store)

    def _read_capped(self, key: str) -> bytes:
        data = self.read(key)
        if data is None:
            raise FileNotFoundError(key)
        if len(data) > _METADATA_CAP:
            raise _Unreadable(f"is larger than {_METADATA_CAP >> 20} MiB")
        return data

    def write(self, key: str, buffers) -> None:
        from zarr.core.buffer import default_buffer_prototype

        # Store.set takes one buffer: joining a shard's pieces (chunks, index) is the one copy it
        # costs; a single piece is wrapped without copying.
        views = [memoryview(b).cast("B") for b in buffers]
        data = views[0] if len(views) == 1 else b"".join(views)
        array = np.frombuffer(data, dtype=np.uint8)
        self._sync(self.store.set(key, default_buffer_prototype().buffer.from_array_like(array)))
        self._written.add(key)

    def read(self, key: str) -> bytes | None:
        from zarr.core.buffer import default_buffer_prototype

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


def open_sink(
    store, overwrite: bool = False, storage_options: dict | None = None, io_timeout: float | None = 60.0
) -> Sink:
    """A sink for ``store``: a local path, a ``file://`` URL, ``memory://``, an object store URL
    (``s3://``, ``gs://``, ``az://`` through obstore: :class:`~napari_tileshard.object_store.ObjectStoreSink`),
    any URL an installed fsspec filesystem handles, a zarr v3 ``Store``, or a :class:`Sink`
    (returned as it is).  ``storage_options`` configure URL stores (endpoint, credentials, ...).
    A URL that no installed store handles is an error, never a local directory named after the URL.
    ``io_timeout``: the deadline of one object-store write (see ``object_store.write_deadline``)."""
    from zarr.storage import LocalStore

    if isinstance(store, Sink):
        return store
    check_store_path(store)
    if isinstance(store, str) and "://" in store:
        return _url_sink(store, overwrite, storage_options, io_timeout)
    if isinstance(store, (str, os.PathLike)):
        return DirectorySink(store, overwrite)
    if isinstance(store, LocalStore):
        if store.read_only:
            raise PermissionError(f"store {store!r} is read-only")
        return DirectorySink(store.root, overwrite)
    if hasattr(store, "set") and hasattr(store, "get"):
        return ZarrStoreSink(store, overwrite)
    raise TypeError(f"store must be a path, a store URL or a zarr v3 Store, got {type(store).__name__}")


def resolve_store(store, *, read_only: bool = True, storage_options: dict | None = None):
    """The zarr Store (or local path) that readers use for the same inputs as :func:`open_sink`."""
    check_store_path(store)
    if isinstance(store, str) and "://" in store:
        scheme = store.split("://", 1)[0].lower()
        if scheme == "file":
            return store[len("file://") :]
        if _through_obstore(store):
            from .object_store import reader_store

            return reader_store(store, storage_options, read_only=read_only)
        _check_scheme(scheme)
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(store, storage_options=storage_options, read_only=read_only)
    return store


def _through_obstore(url: str) -> bool:
    """S3, GCS and Azure URLs go through obstore when it is installed (object_store.py), else
    through fsspec (s3fs, gcsfs, adlfs) as any other URL."""
    import importlib.util

    from .object_store import is_object_store_url

    return is_object_store_url(url) and importlib.util.find_spec("obstore") is not None


def _check_scheme(scheme: str) -> None:
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as exc:
        from fsspec.registry import known_implementations

        known = known_implementations.get(scheme, {})
        hint = known.get("err") or ("" if known else "no fsspec filesystem is registered for it")
        raise ValueError(f"no installed store handles {scheme!r} URLs: {hint or exc}") from None


def _url_sink(url: str, overwrite: bool, storage_options: dict | None, io_timeout: float | None) -> Sink:
    scheme = url.split("://", 1)[0].lower()
    if scheme == "file":  # a local directory: keep the lock, atomic renames and safe overwrite
        return DirectorySink(url[len("file://") :], overwrite)
    if scheme == "memory":
        from zarr.storage import MemoryStore

        return ZarrStoreSink(MemoryStore(), overwrite, private=True)
    # Object stores: each object is one PUT (atomic); there is no rename and no lock, so one
    # writer per prefix is the caller's responsibility.
    if _through_obstore(url):
        from .object_store import ObjectStoreSink

        return ObjectStoreSink(url, overwrite, storage_options, io_timeout=io_timeout)
    return ZarrStoreSink(resolve_store(url, read_only=False, storage_options=storage_options), overwrite)


def list_shard_keys(store, prefix: str = "") -> list[str]:
    """Keys (relative to ``prefix``) of the shard objects under ``c/`` that exist in a zarr Store,
    skipping hidden temporary files; never walks a declared grid."""
    from ._zarr_sync import sync

    async def collect():
        base = f"{prefix}/c/" if prefix else "c/"
        return [key[len(prefix) + 1 :] if prefix else key async for key in store.list_prefix(base)]

    return [k for k in sync(collect()) if not k.rsplit("/", 1)[-1].startswith(".")]
