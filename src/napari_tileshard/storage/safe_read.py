"""Reading a store that may be broken or hostile without blocking, exhausting memory or leaving it.

napari offers every path a user drops to the reader, and ``verify`` and the inspector exist to
look at damaged stores, so none of them may trust what a store holds: a ``zarr.json`` can be a
FIFO (an ``open`` that never returns), a symlink to ``/dev/zero`` (a read that never ends), a
gigabyte of JSON, or nesting deep enough to overflow the parser; a shard or the ``c/`` directory
can be a symlink to a file outside the store.  Everything here therefore

* reads only regular files that lie inside the store root (symlinks are resolved and refused
  when they point outside; special files are never opened for reading),
* opens them with ``O_NONBLOCK | O_NOFOLLOW`` one path component at a time, so a file swapped
  for a FIFO or a symlink after the check is refused too,
* reads metadata up to :data:`MAX_METADATA_BYTES` and parses it into a depth-limited JSON value,
* lists local keys with ``os.scandir`` without following symlinks.

Arrays are then built by zarr-python from the checked metadata (it does not read ``zarr.json``
again), over a :class:`SafeLocalStore` whose reads obey the same rules.  Stores that are not
local directories are read with ``Store.get`` and byte ranges, never more than the cap for
metadata.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import os
import stat
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from zarr.storage import LocalStore

try:
    import resource as _resource  # POSIX only
except ImportError:  # Windows
    _resource = None  # type: ignore[assignment]

from ..format.metadata import STATE_KEY
from ..format.shard_spec import grid_refusal
from ._zarr_sync import sync
from .object_store import describe_failure
from .sinks import check_store_path
from .urls import resolve_store

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_METADATA_BYTES",
    "METADATA_NAMES",
    "MAX_KEPT_FILES",
    "MAX_OPEN_DIRECTORIES",
    "MIN_OPEN_DIRECTORIES",
    "Listing",
    "LocalFiles",
    "SafeLocalStore",
    "StoreAccess",
    "StoreObject",
    "UnsafeStoreError",
    "descriptor_limit",
    "list_local_keys",
    "kept_files",
    "open_directories",
    "open_local_file",
    "parse_json",
    "read_local_metadata",
    "recording_state",
    "resolve_inside",
]

#: the largest ``zarr.json`` (or v2 ``.zarray``/``.zattrs``/``.zgroup``) read; real ones are KiB
MAX_METADATA_BYTES = 16 << 20
#: the deepest JSON nesting accepted in metadata (OME-Zarr needs about 6)
MAX_JSON_DEPTH = 100
METADATA_NAMES = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")

#: open directories a store's LocalFiles keeps: a quarter of the process's descriptors, within
#: these bounds (macOS allows 256 by default, many Linux desktops 1024, containers far more)
MIN_OPEN_DIRECTORIES, MAX_OPEN_DIRECTORIES = 16, 4096

#: regular files (shards) all LocalFiles of a process keep open between reads at most: an eighth of
#: the process's descriptors (macOS: 32, a Linux desktop: 128, containers: this cap).  A reader
#: then reads a shard's index and its chunks from one version of the file (a shard replaced in
#: between was read at the old index's offsets), with one system call (``preadv``) per read
#: instead of five (``stat``, ``open``, ``fstat``, ``preadv``, ``close``; on a network file system
#: an open is a round trip).  From tmpfs on 16 cores whole reads ran as fast as before
#: (benchmarks/results/cpu_16core_2026-11-27j/, call 2): the copy out of the page cache, not the
#: opens, is a file read's cost there
MAX_KEPT_FILES = 4096

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)


T = TypeVar("T")


class UnsafeStoreError(ValueError):
    """A store object that is not read: outside the store, not a regular file, too large or not
    parseable.  The message names the path and the reason."""


# -- JSON ---------------------------------------------------------------------------------
def parse_json(data: bytes, where: str):
    """``data`` parsed as JSON, or :class:`UnsafeStoreError` naming ``where`` (also for nesting
    deeper than :data:`MAX_JSON_DEPTH`, which would overflow the stack of later consumers)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise UnsafeStoreError(f"{where}: JSON nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        raise UnsafeStoreError(f"{where}: not valid JSON ({exc})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise UnsafeStoreError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value) -> int:
    # Iterative: a recursive walk would hit the recursion limit on exactly the inputs it checks.
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


# -- local files --------------------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _inside(root_real: str, target: str) -> bool:
    return target == root_real or target.startswith(root_real.rstrip(os.sep) + os.sep)


def resolve_inside(root, key: str) -> str:
    """The real path of ``key`` under ``root``; :class:`UnsafeStoreError` if a symlink on the way
    leads outside the store root (or the key itself does, with ``..``)."""
    root_real = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root_real, key))
    if not _inside(root_real, target):
        raise UnsafeStoreError(f"{os.path.join(root, key)}: symlink to outside the store, not read")
    return target


def aliased_chunk(root_real: str, key: str, target: str) -> str | None:
    """The store key of another chunk object of the same array that ``key`` leads to through a
    symlink (``c/1/0/0`` -> ``c/0/0/0``), or None.  Such a shard would show another position's
    data in its place without any check failing (its index and CRC are valid), so readers and
    verify refuse it; a symlink to a file elsewhere in the store (outside the array's ``c/``
    tree, e.g. a deduplicated copy) is read."""
    if target == os.path.normpath(os.path.join(root_real, key)):
        return None  # no symlink on the way
    parts = key.split("/")
    directories = parts[:-1]
    if "c" not in directories:
        return None
    tree = "/".join(directories[: len(directories) - directories[::-1].index("c")])  # up to the last "c"
    tree_real = os.path.realpath(os.path.join(root_real, tree))
    own = os.path.join(os.path.realpath(os.path.join(root_real, *directories)), parts[-1])
    if target != own and _inside(tree_real, target) and target != tree_real:
        return os.path.relpath(target, root_real).replace(os.sep, "/")
    return None


def open_local_file(root, key: str) -> int:
    """A read-only file descriptor of the regular file ``key`` inside the store ``root``.

    Symlinks inside the store are followed; one leading outside, one to another chunk object of
    the same array (:func:`aliased_chunk`), a FIFO, a device or a socket is refused with
    :class:`UnsafeStoreError` without being opened for reading.  A missing key raises
    ``FileNotFoundError``.
    """
    where = os.path.join(root, key)
    target = resolve_inside(root, key)
    alias = aliased_chunk(os.path.realpath(root), key, target)
    if alias is not None:
        raise UnsafeStoreError(f"{where}: symlink to {alias}, another chunk of this array: not read")
    info = os.lstat(target)  # FileNotFoundError for a missing key
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeStoreError(f"{where}: {_kind(info.st_mode)}, not a regular file: not read")
    fd = _open_no_follow(os.path.realpath(root), os.path.relpath(target, os.path.realpath(root)), where)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped since the lstat above
            raise UnsafeStoreError(f"{where}: {_kind(info.st_mode)}, not a regular file: not read")
    except BaseException:
        os.close(fd)
        raise
    return fd


def descriptor_limit() -> int | None:
    """How many files this process may have open (the soft ``RLIMIT_NOFILE``); None where not
    known (Windows)."""
    if _resource is None:
        return None
    soft, _ = _resource.getrlimit(_resource.RLIMIT_NOFILE)
    return None if soft == _resource.RLIM_INFINITY else int(soft)


def open_directories(limit: int | None) -> int:
    """How many directories :class:`LocalFiles` keeps open under a limit of ``limit`` open files
    (None: 256).  A read that cycles through more directories than kept opens each again: with
    256, a 2 GiB recording of 4 MiB shards (386 directories) did so for every other shard."""
    if limit is None:
        return 256
    return max(MIN_OPEN_DIRECTORIES, min(MAX_OPEN_DIRECTORIES, limit // 4))


def kept_files(limit: int | None) -> int:
    """How many regular files all :class:`LocalFiles` of the process keep open under a limit of
    ``limit`` open files (None: 32)."""
    if limit is None:
        return 32
    return max(0, min(MAX_KEPT_FILES, limit // 8))


class _KeptFiles:
    """The process's count of regular files kept open by every :class:`LocalFiles` (at most
    ``limit``): a store's reader keeps what another's may need."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        """One more file kept, if the count stays within the limit."""
        with self._lock:
            if self.count >= self.limit:
                return False
            self.count += 1
            return True

    def give(self, count: int) -> None:
        with self._lock:
            self.count -= count


_KEPT_FILES = _KeptFiles(kept_files(descriptor_limit()))


class LocalFiles:
    """:func:`open_local_file` for many keys of one store, with the same refusals, at a few
    system calls per file: the directories holding the keys are opened once (checked as
    :func:`open_local_file` checks a file, kept open, at most ``max_dirs``: by default
    :func:`open_directories` of the process's limit), and a key is
    ``lstat``-ed and opened relative to its directory with ``O_NOFOLLOW``.  A key that is not a
    plain regular file there (a symlink, which may lead inside the store, or a special file) and
    any key on a platform without ``dir_fd`` go through :func:`open_local_file`.

    A reader opens every shard once per read: ``open_local_file`` resolves the whole path
    (``realpath``: an ``lstat`` per component) and opens each component, ~40 system calls for
    ``c/t/y/x``, which cost ~60 us per shard on the 2-core box.  Thread-safe: the directory
    table changes under a lock, and a directory dropped from it while opens relative to it may
    be in flight is closed once every open that began before the drop has ended.  An open of a
    directory in the table takes no lock: it draws a ticket and notes it as its thread's, then
    looks the directory up (each one step under the GIL); a directory is dropped with the next
    ticket, so an open with a later ticket cannot have found it.  (16 reading threads queued on
    the lock when each open took it twice: 8 % of their time, each wake-up waiting for the GIL.)

    :meth:`use` keeps the regular files it opens open for the next use (at most ``max_files`` of
    this store, and :func:`kept_files` over the whole process; the oldest closed first), where
    files are opened relative to directories (not Windows, where an open file cannot be replaced).
    A file kept is the version that was opened: a shard replaced since is read as it was, as the
    index a reader read from it, until :meth:`close` (a reader's ``refresh``)."""

    def __init__(self, root, max_dirs: int | None = None, max_files: int | None = None):
        self.root = root
        self.max_dirs = open_directories(descriptor_limit()) if max_dirs is None else max_dirs
        self._kept = _KEPT_FILES if max_files is None else _KeptFiles(max_files)
        self._dirs: dict[str, int] = {}  # insertion order: the oldest is closed first
        self._files: dict[str, int] = {}  # regular files kept open by use(), the oldest first
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self._in_flight: dict[int, int] = {}  # thread -> the ticket of its open in flight
        self._dropped: list[tuple[int, int]] = []  # (ticket at the drop, directory) not closed yet
        self._fast = os.open in os.supports_dir_fd and os.stat in os.supports_dir_fd and bool(_O_NOFOLLOW)
        # a LocalFiles dropped unclosed closes its directories: each reader a script made and
        # let go held ~200 open (of 4 MiB shards), and a 1024-descriptor limit ran out at the sixth
        weakref.finalize(self, _close_descriptors, self._dirs, self._files, self._kept)

    def use(self, key: str, work: Callable[[int], T]) -> T:
        """``work(fd)`` with a read-only descriptor of the regular file ``key`` (as :meth:`open`
        gives it, with the same refusals), which stays open for the next use of ``key`` where it
        can be kept (see the class); ``work`` must not close it."""
        if not self._fast:
            fd = self.open(key)
            try:
                return work(fd)
            finally:
                os.close(fd)
        me = threading.get_ident()
        self._in_flight[me] = next(self._tickets)  # before the look-up: what it finds stays open
        try:
            kept = self._files.get(key)
            fd, owned = (kept, False) if kept is not None else self._keep_file(key, self._open_in_flight(key))
            try:
                return work(fd)
            finally:
                if owned:
                    os.close(fd)
        finally:
            self._leave(me)

    def _keep_file(self, key: str, fd: int) -> tuple[int, bool]:
        """Keep ``fd`` as file ``key``'s, dropping this store's oldest when the count of files
        kept (``max_files``, else the process's) is spent; where another thread kept ``key``
        meanwhile, its descriptor (``fd`` closed).  Returns the descriptor and whether it is the
        caller's to close (not kept)."""
        with self._lock:
            kept = self._files.get(key)
            if kept is not None:
                os.close(fd)
                return kept, False
            if len(self._dropped) >= min(self.max_dirs, max(1, self._kept.limit)):
                return fd, True  # descriptors stay bounded (see _keep)
            if not self._kept.take():  # the count spent (each file kept holds one of it)
                if not self._files:
                    return fd, True
                # this store's oldest goes, and its share of the count passes to ``fd``
                self._dropped.append((next(self._tickets), self._files.pop(next(iter(self._files)))))
            self._close_dropped()
            self._files[key] = fd
            return fd, False

    def open(self, key: str) -> int:
        """A read-only descriptor of the regular file ``key`` (as :func:`open_local_file`)."""
        if not self._fast:
            return open_local_file(self.root, key)
        me = threading.get_ident()
        self._in_flight[me] = next(self._tickets)  # before the look-up: what it finds stays open
        try:
            return self._open_in_flight(key)
        finally:
            self._leave(me)

    def _open_in_flight(self, key: str) -> int:
        """:meth:`open` for a thread whose ticket is in flight (the directories it finds stay open)."""
        parent, _, name = key.rpartition("/")
        if name in ("", ".", "..") or ".." in parent.split("/") or os.sep != "/":
            return open_local_file(self.root, key)
        flags = os.O_RDONLY | _O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC
        directory, private = self._directory(parent)
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)  # FileNotFoundError: missing
            if not stat.S_ISREG(info.st_mode):
                fd = -1
            else:
                try:
                    fd = os.open(name, flags, dir_fd=directory)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENXIO):
                        raise
                    fd = -1  # swapped for a symlink or a special file since the lstat
        finally:
            if private:
                os.close(directory)
        if fd < 0:
            return open_local_file(self.root, key)  # follows a symlink inside, refuses the rest
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafeStoreError(f"{os.path.join(self.root, key)}: not a regular file: not read")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _leave(self, me: int) -> None:
        """This thread's open is no longer in flight: close what was dropped before every open
        still in flight began."""
        del self._in_flight[me]
        dropped = self._dropped  # replaced, never emptied in place: a look without the lock
        if dropped:
            oldest = self._oldest_in_flight()
            if oldest is None or dropped[0][0] < oldest:
                with self._lock:
                    self._close_dropped()

    def _oldest_in_flight(self) -> int | None:
        """The ticket of the oldest open in flight; None when there is none."""
        return min(list(self._in_flight.values()), default=None)

    def _directory(self, parent: str) -> tuple[int, bool]:
        """The descriptor of directory ``parent`` (the store root for "") and whether it is the
        caller's to close (not kept: see :meth:`_keep`).  Its system calls run without the lock
        (by a thread whose open is in flight, so what it finds in the table stays open)."""
        fd = self._dirs.get(parent)
        if fd is not None:
            return fd, False
        where = os.path.join(self.root, parent)
        above, _, name = parent.rpartition("/")
        if parent and name not in ("", ".", ".."):
            # a plain directory (not a symlink) inside the one above: opened relative to it
            outer, private = self._directory(above)
            try:
                info = os.stat(name, dir_fd=outer, follow_symlinks=False)  # FileNotFoundError: missing
                fd = -1
                if stat.S_ISDIR(info.st_mode):
                    try:
                        fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=outer)
                    except OSError as exc:
                        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                            raise
            finally:
                if private:
                    os.close(outer)
            if fd >= 0:
                return self._keep(parent, fd)
        target = resolve_inside(self.root, parent) if parent else os.path.realpath(self.root)
        if not stat.S_ISDIR(os.lstat(target).st_mode):  # FileNotFoundError for a missing directory
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", where)
        root_real = os.path.realpath(self.root)
        relative = os.path.relpath(target, root_real)
        if relative == ".":
            fd = os.open(root_real, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        else:
            fd = _open_no_follow(root_real, relative, where)
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", where)
        return self._keep(parent, fd)

    def _keep(self, parent: str, fd: int) -> tuple[int, bool]:
        """Hold ``fd`` as directory ``parent``'s, dropping the oldest beyond ``max_dirs``; where
        another thread kept that directory meanwhile, its descriptor (``fd`` closed).  With
        ``max_dirs`` dropped ones still waiting for opens in flight, ``fd`` is not kept but
        handed back as the caller's to close: the descriptors stay bounded however long an open
        takes (a thread descheduled in the middle of one)."""
        with self._lock:
            kept = self._dirs.get(parent)
            if kept is not None:
                os.close(fd)
                return kept, False
            if len(self._dropped) >= self.max_dirs:
                return fd, True
            while len(self._dirs) >= self.max_dirs:
                dropped = self._dirs.pop(next(iter(self._dirs)))
                self._dropped.append((next(self._tickets), dropped))  # the ticket drawn after the pop
            self._close_dropped()
            self._dirs[parent] = fd
            return fd, False

    def _close_dropped(self) -> None:
        """Close the directories dropped before every open in flight began (lock held)."""
        oldest = self._oldest_in_flight()
        waiting = []
        for ticket, fd in self._dropped:
            if oldest is None or ticket < oldest:
                os.close(fd)
            else:
                waiting.append((ticket, fd))
        self._dropped = waiting

    def close(self) -> None:
        """Close the directories and the files kept (a later :meth:`open` or :meth:`use` opens
        them again; one in flight still finishes with its descriptors, closed after it)."""
        with self._lock:
            ticket = next(self._tickets)
            self._dropped += [(ticket, fd) for fd in [*self._dirs.values(), *self._files.values()]]
            self._kept.give(len(self._files))
            self._dirs.clear()
            self._files.clear()
            self._close_dropped()


def _close_descriptors(directories: dict[str, int], files: dict[str, int], kept: _KeptFiles) -> None:
    """Close the directories and files a collected :class:`LocalFiles` still held (nothing can
    use them any more: no one refers to it)."""
    kept.give(len(files))
    for fd in [*directories.values(), *files.values()]:
        try:
            os.close(fd)
        except OSError:
            pass
    directories.clear()
    files.clear()


def _open_no_follow(root_real: str, relative: str, where: str) -> int:
    """Open ``root_real/relative`` (already free of symlinks) refusing any symlink that appears
    on the way since it was resolved: each component is opened relative to its parent with
    ``O_NOFOLLOW``, the last one with ``O_NONBLOCK`` so that a FIFO swapped in cannot block."""
    flags = os.O_RDONLY | _O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC | _O_BINARY
    try:
        if os.open not in os.supports_dir_fd or not _O_NOFOLLOW:  # e.g. Windows: best effort
            return os.open(os.path.join(root_real, relative), flags)
        parts = [p for p in relative.split(os.sep) if p not in ("", ".")]
        fd = os.open(root_real, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        try:
            for part in parts[:-1]:
                child = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = child
            return os.open(parts[-1], flags, dir_fd=fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            raise UnsafeStoreError(f"{where}: changed into a symlink or special file while opened: not read") from None
        raise


def _pread_all(fd: int, start: int, length: int) -> bytes:
    parts, done = [], 0
    while done < length:
        piece = os.pread(fd, min(length - done, 1 << 26), start + done)
        if not piece:
            break  # the file is shorter than asked (truncated meanwhile): return what is there
        parts.append(piece)
        done += len(piece)
    return b"".join(parts)


def read_local_metadata(root, key: str = "zarr.json"):
    """The JSON value of the metadata object ``key`` in the local store ``root``, read safely
    (regular file inside the store, at most :data:`MAX_METADATA_BYTES`)."""
    where = os.path.join(root, key)
    fd = open_local_file(root, key)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_METADATA_BYTES:
            raise UnsafeStoreError(
                f"{where}: {size} bytes, larger than the {MAX_METADATA_BYTES >> 20} MiB accepted for metadata: not read"
            )
        # The size just stat'ed, plus one byte to notice growth: a read buffer of the cap itself
        # would cost 16 MiB for every small zarr.json.
        data = _pread_all(fd, 0, size + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_METADATA_BYTES:  # grew since fstat
        raise UnsafeStoreError(f"{where}: larger than the {MAX_METADATA_BYTES >> 20} MiB accepted for metadata")
    return parse_json(data, where)


@dataclass
class Listing:
    """Keys of the regular files found, and entries not read with the reason."""

    keys: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)


def list_local_keys(root, prefix: str) -> Listing:
    """Keys (relative to ``root``, ``/``-separated) of the regular files under ``root/prefix``,
    walked without following symlinks: a symlink that resolves outside the store, a symlinked
    directory and special files are listed in ``refused`` and never read.  Hidden names (the
    Writer's temporary files) are skipped."""
    listing = Listing()
    root_real = os.path.realpath(root)
    prefix = prefix.strip("/")
    try:
        # A symlink anywhere on the way to the prefix (e.g. ``c`` itself) may lead outside.
        start = resolve_inside(root_real, prefix)
    except UnsafeStoreError:
        listing.refused.append((prefix, "symlink to outside the store, not read"))
        return listing
    try:
        info = os.stat(start)
    except FileNotFoundError:
        return listing
    if not stat.S_ISDIR(info.st_mode):
        listing.refused.append((prefix, f"{_kind(info.st_mode)} where a directory was expected, not read"))
        return listing
    pending = [(prefix, start)]
    while pending:
        rel_dir, real_dir = pending.pop()
        try:
            with os.scandir(real_dir) as scan:
                entries = list(scan)
        except OSError as exc:
            listing.refused.append((rel_dir, f"cannot list: {exc.strerror}"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                if entry.is_symlink():
                    _classify_symlink(root_real, key, entry.path, listing)
                elif entry.is_dir(follow_symlinks=False):
                    pending.append((key, entry.path))
                elif entry.is_file(follow_symlinks=False):
                    listing.keys.append(key)
                else:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    listing.refused.append((key, f"{_kind(mode)}, not a regular file: not read"))
            except OSError as exc:
                listing.refused.append((key, f"cannot stat: {exc.strerror}"))
    return listing


def _classify_symlink(root_real: str, key: str, path: str, listing: Listing) -> None:
    target = os.path.realpath(path)
    if not _inside(root_real, target):
        listing.refused.append((key, "symlink to outside the store, not read"))
        return
    try:
        mode = os.stat(target).st_mode
    except OSError:
        listing.refused.append((key, "dangling symlink, not read"))
        return
    if stat.S_ISREG(mode):
        alias = aliased_chunk(root_real, key, target)
        if alias is not None:
            listing.refused.append((key, f"symlink to {alias}, another chunk of this array: not read"))
        else:
            listing.keys.append(key)  # a file elsewhere in the same store: harmless
    elif stat.S_ISDIR(mode):
        listing.refused.append((key, "symlink to a directory, not followed"))
    else:
        listing.refused.append((key, f"symlink to {_kind(mode)}, not read"))


# -- zarr Store over a local directory ------------------------------------------------------
class SafeLocalStore(LocalStore):
    """A read-only zarr ``LocalStore`` whose reads obey the rules above: regular files inside
    the root only (never blocking on a FIFO, never reading a device or a file outside), and
    metadata objects of at most :data:`MAX_METADATA_BYTES`."""

    def __init__(self, root):
        super().__init__(root, read_only=True)

    async def get(self, key, prototype=None, byte_range=None):
        from zarr.buffer import default_buffer_prototype

        if prototype is None:
            prototype = default_buffer_prototype()
        if not self._is_open:
            await self._open()
        data = await asyncio.to_thread(self._read, key, byte_range)
        return None if data is None else prototype.buffer.from_bytes(data)

    async def get_partial_values(self, prototype, key_ranges):
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def getsize(self, key: str) -> int:
        fd = await asyncio.to_thread(open_local_file, self.root, key)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _read(self, key: str, byte_range) -> bytes | None:
        try:
            fd = open_local_file(self.root, key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size = os.fstat(fd).st_size
            start, stop = _byte_range(byte_range, size)
            if byte_range is None and key.rsplit("/", 1)[-1] in METADATA_NAMES and size > MAX_METADATA_BYTES:
                raise UnsafeStoreError(
                    f"{self.root / key}: {size} bytes, larger than the "
                    f"{MAX_METADATA_BYTES >> 20} MiB accepted for metadata: not read"
                )
            return _pread_all(fd, start, stop - start)
        finally:
            os.close(fd)


def _byte_range(byte_range, size: int) -> tuple[int, int]:
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        return min(byte_range.start, size), min(max(byte_range.end, byte_range.start), size)
    if isinstance(byte_range, OffsetByteRequest):
        return min(byte_range.offset, size), size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"unexpected byte range {byte_range!r}")


# -- any store --------------------------------------------------------------------------------
class StoreObject:
    """One object of a store, opened for ranged reads: ``size``, ``read(start, length)`` and
    ``read_suffix(length)``.  Local files are read through one descriptor, so a file replaced
    meanwhile (the Writer renames new shard versions into place) is read consistently."""

    #: bytes fetched at once from a store that is not a local file: one request per chunk would
    #: make a remote verify slow, and this bounds the memory a read-ahead may take
    READ_AHEAD = 8 << 20

    def __init__(self, size: int, fd: int | None = None, store=None, key: str | None = None):
        self.size, self._fd, self._store, self._key = size, fd, store, key
        self._window_start, self._window = 0, b""

    def read(self, start: int, length: int) -> bytes:
        if self._fd is not None:
            return _pread_all(self._fd, start, length)
        offset = start - self._window_start
        if not (0 <= offset and offset + length <= len(self._window)):
            from zarr.abc.store import RangeByteRequest

            stop = max(start + length, min(self.size, start + self.READ_AHEAD))
            self._window_start, self._window = start, self._get(RangeByteRequest(start, stop))
            offset = 0
        return self._window[offset : offset + length]

    def read_suffix(self, length: int) -> bytes:
        if self._fd is not None:
            return _pread_all(self._fd, max(0, self.size - length), min(length, self.size))
        from zarr.abc.store import SuffixByteRequest

        return self._get(SuffixByteRequest(length))

    def _get(self, byte_range) -> bytes:
        from zarr.buffer import default_buffer_prototype

        buffer = sync(self._store.get(self._key, default_buffer_prototype(), byte_range=byte_range))
        return b"" if buffer is None else buffer.to_bytes()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StoreAccess:
    """Read-only, checked access to a store given as a local path or a zarr ``Store``.

    ``root`` is the local directory (for a path or a ``LocalStore``), else None; ``store`` is the
    zarr Store that arrays opened by :meth:`open_node` read their chunks from (a
    :class:`SafeLocalStore` for a path).
    """

    def __init__(self, location):
        from zarr.abc.store import Store

        self.location = str(location)
        self.root: Path | None = None
        self._own_fds = False  # a path: objects are read through checked descriptors
        if isinstance(location, StoreAccess):
            self.__dict__.update(location.__dict__)
        elif isinstance(location, Store):
            self.store = location
            if isinstance(location, LocalStore):
                self.root = Path(location.root)
                if isinstance(location, SafeLocalStore):  # ours (e.g. a node opened through a StoreAccess)
                    self.location, self._own_fds = str(self.root), True
        elif isinstance(location, (str, os.PathLike)):
            check_store_path(location)  # "" would read the current directory
            text: Any = os.fspath(location)
            if isinstance(text, str) and "://" in text:
                text = resolve_store(text, read_only=True)  # a file:// URL becomes its path
            if not isinstance(text, (str, bytes)):
                self.store = text
            else:
                self.root = Path(os.fsdecode(text)).expanduser().absolute()
                self.store = SafeLocalStore(self.root)
                self._own_fds = True
        else:
            raise TypeError(f"expected a path or a zarr Store, got {type(location).__name__}")

    # -- metadata -------------------------------------------------------------------
    def read_metadata(self, key: str):
        """The parsed JSON of metadata object ``key``; FileNotFoundError if it is missing,
        :class:`UnsafeStoreError` if it cannot be read or parsed safely."""
        if self.root is not None:
            if not self._own_fds:  # a LocalStore given by the caller: check, then read through it
                os.close(open_local_file(self.root, key))
            else:
                return read_local_metadata(self.root, key)
        from zarr.abc.store import RangeByteRequest
        from zarr.buffer import default_buffer_prototype

        where = f"{self.location}/{key}"
        # One byte past the cap tells "too large" apart from "exactly the cap" without reading more.
        try:
            buffer = sync(
                self.store.get(key, default_buffer_prototype(), byte_range=RangeByteRequest(0, MAX_METADATA_BYTES + 1))
            )
        except FileNotFoundError:
            raise
        except Exception as exc:  # the client's own text may be a 40-line debug dump: one sentence
            raise OSError(self._failure("reading", exc)) from exc
        if buffer is None:
            raise FileNotFoundError(f"{where}: not found")
        if len(buffer) > MAX_METADATA_BYTES:
            raise UnsafeStoreError(f"{where}: larger than the {MAX_METADATA_BYTES >> 20} MiB accepted for metadata")
        return parse_json(buffer.to_bytes(), where)

    def open_node(self, path: str = ""):
        """The zarr-python ``Array`` or ``Group`` at ``path``, built from metadata read by
        :meth:`read_metadata` (zarr-python does not read ``zarr.json`` itself).  A Zarr v2 node
        (no ``zarr.json``) is opened by zarr-python over the same checked store."""
        import zarr
        from zarr.storage import StorePath

        path = path.strip("/")
        key = f"{path}/zarr.json" if path else "zarr.json"
        store_path = StorePath(self.store, path)
        try:
            meta = self.read_metadata(key)
        except FileNotFoundError:
            for v2 in (".zarray", ".zgroup"):
                v2_key = f"{path}/{v2}" if path else v2
                try:
                    self.read_metadata(v2_key)  # the same checks before zarr-python reads it
                except FileNotFoundError:
                    continue
                return zarr.open(store_path, mode="r", zarr_format=2)
            raise FileNotFoundError(self._missing(key)) from None
        if not isinstance(meta, dict) or meta.get("zarr_format") != 3:
            raise UnsafeStoreError(f"{self.location}/{key}: not Zarr v3 metadata")
        node_type = meta.get("node_type")
        where = f"{self.location}/{key}"
        if node_type == "array":
            refusal = grid_refusal(meta)
            if refusal:
                raise UnsafeStoreError(f"{where}: {refusal}: not read")
            try:  # meta was checked above; zarr's typed-dict overloads cannot know that
                return zarr.Array(zarr.AsyncArray(metadata=cast(Any, meta), store_path=store_path))
            except Exception as exc:  # noqa: BLE001 - untrusted metadata: any failure is one message
                raise UnsafeStoreError(f"{where}: zarr-python cannot open it ({type(exc).__name__}: {exc})") from exc
        if node_type == "group":
            try:
                return zarr.Group(zarr.AsyncGroup.from_dict(store_path, meta))
            except Exception as exc:  # noqa: BLE001
                raise UnsafeStoreError(f"{where}: zarr-python cannot open it ({type(exc).__name__}: {exc})") from exc
        raise UnsafeStoreError(f"{self.location}/{key}: node_type {node_type!r} is neither array nor group")

    def _failure(self, action: str, exc: BaseException) -> str:
        if "://" in self.location:
            return describe_failure(self.location, action, exc)
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{action} {self.location!r} failed: {type(exc).__name__}: {first}"

    def _missing(self, key: str) -> str:
        """Why there is no ``key``: for a store URL, whether the bucket exists and the prefix holds
        anything at all (one listing), so that a typo in the bucket is not 'no zarr.json'."""
        if self.root is not None or "://" not in self.location:
            return f"{self.location}: no zarr.json at {key!r}"

        async def first_key():
            async for found in self.store.list_prefix(""):
                return found
            return None

        try:
            found = sync(first_key())
        except Exception as exc:  # noqa: BLE001 - the reason the listing failed is the message
            return self._failure("reading", exc)
        if found is None:
            return f"{self.location}: nothing is stored there (no zarr.json and no other object under this prefix)"
        return f"{self.location}: no zarr.json at {key!r}"

    # -- objects ------------------------------------------------------------------------
    def list_keys(self, prefix: str) -> Listing:
        """Keys under ``prefix`` (relative to the store), without following symlinks for a
        local store; hidden names are skipped."""
        if self.root is not None:
            return list_local_keys(self.root, prefix)

        async def collect():
            return [key async for key in self.store.list_prefix(prefix.rstrip("/") + "/")]

        return Listing([k for k in sync(collect()) if not k.rsplit("/", 1)[-1].startswith(".")])

    def list_children(self, path: str = "") -> list[str]:
        """Names of the direct sub-directories (local) or child prefixes (other stores)."""
        if self.root is None:

            async def collect():
                return [name async for name in self.store.list_dir(path)]

            return sorted(n for n in sync(collect()) if n not in METADATA_NAMES and not n.startswith("."))
        base = os.path.join(os.path.realpath(self.root), *[p for p in path.split("/") if p])
        try:
            with os.scandir(base) as entries:
                return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))
        except OSError:
            return []

    def open_object(self, key: str) -> StoreObject:
        """``key`` opened for ranged reads (a context manager).  Local: a checked descriptor
        (:func:`open_local_file`); a caller's ``LocalStore`` is checked the same way and then
        read through its own ``get``; other stores: ``getsize`` and ranged ``get``."""
        if self.root is not None:
            fd = open_local_file(self.root, key)
            size = os.fstat(fd).st_size
            if self._own_fds:
                return StoreObject(size, fd=fd)
            os.close(fd)
            return StoreObject(size, store=self.store, key=key)

        return StoreObject(sync(self.store.getsize(key)), store=self.store, key=key)


def recording_state(attributes) -> tuple[int, str] | None:
    """``(rows_written, state)`` from the Writer's record in an array's attributes, None when the
    array has none (written by another tool).  ValueError when the record is malformed."""
    if not isinstance(attributes, dict) or STATE_KEY not in attributes:
        return None
    record = attributes[STATE_KEY]
    rows = record.get("rows_written") if isinstance(record, dict) else None
    state = record.get("state") if isinstance(record, dict) else None
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0 or not isinstance(state, str):
        raise ValueError(f"attribute {STATE_KEY!r} is malformed: {str(record)[:200]}")
    return rows, state
