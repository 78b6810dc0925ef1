"""The writer's lock of a store directory: one writer per store.

``.tileshard.lock`` is created with ``O_EXCL`` and holds the holder's pid, host and start time.
A lock left by a dead process on this host is taken over (serialised by a second file, so two
takers-over never both win); any other lock refuses the writer with :class:`StoreLockedError`
naming the holder.  The lock's identity (device, inode, content) tells the holder whether the
lock it made is still in place.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from .errors import StoreLockedError
from .overwrite import LOCK_NAME, TAKEOVER_NAME, Unreadable, read_capped

__all__ = ["LOCK_NAME", "LockFile"]

log = logging.getLogger(__name__)


class LockFile:
    """The lock file of the store directory ``root`` (``not_writable`` turns an OSError of the
    directory into the error the writer raises)."""

    def __init__(self, root: Path, not_writable: Callable[[OSError], OSError]):
        self.root = root
        self.path = root / LOCK_NAME
        self._location = str(root)
        self._not_writable = not_writable
        self._id: tuple | None = None  # (st_dev, st_ino, content) of the lock file while we hold it

    @property
    def held(self) -> bool:
        return self._id is not None

    def check_holder(self) -> None:
        """Refuse (StoreLockedError) when a live writer holds the lock; a stale or vanished lock
        passes (it is judged again when acquiring)."""
        try:
            self._holder(read_capped(self.path, 1 << 16))
        except (FileNotFoundError, Unreadable):
            pass

    def _holder(self, content: bytes) -> dict:
        """The lock's holder if it is a dead process on this host (stale); else StoreLockedError."""
        try:
            holder = json.loads(content)
            pid, host = holder["pid"], holder["host"]
            if not isinstance(pid, int) or pid <= 0 or not isinstance(host, str):
                raise TypeError
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            raise StoreLockedError(
                f"{self._location!r} is locked by another writer (unreadable lock file); "
                f"if no writer is running, delete {str(self.path)!r}"
            ) from None
        if host == socket.gethostname() and not _alive(pid):
            return holder
        raise StoreLockedError(
            f"{self._location!r} is being written by pid {pid} on host {host} since "
            f"{holder.get('started', '?')}; if that process is gone, delete "
            f"{str(self.path)!r}"
        )

    def acquire(self) -> None:
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
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                pass
            except OSError as exc:
                raise self._not_writable(exc) from exc
            else:
                self._id = self._fill(fd, content, self.path)
                return
            try:
                seen = read_capped(self.path, 1 << 16)
            except FileNotFoundError:
                continue  # released meanwhile
            except Unreadable:
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
        raise StoreLockedError(f"{self._location!r} is locked by other writers; try again")

    def _fill(self, fd: int, content: bytes, path: Path) -> tuple:
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
        mutex = self.root / TAKEOVER_NAME
        try:
            os.close(os.open(mutex, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        except FileExistsError:
            raise StoreLockedError(
                f"another writer is taking over the stale lock of {self._location!r}; if none is, delete {str(mutex)!r}"
            ) from None
        try:
            try:
                if read_capped(self.path, 1 << 16) != seen:
                    return False
            except (FileNotFoundError, Unreadable):
                return False
            tmp = self.root / f"{LOCK_NAME}.{uuid.uuid4().hex[:12]}.tmp"
            lock_id = self._fill(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), content, tmp)
            os.replace(tmp, self.path)
            self._id = lock_id
            log.warning(
                "%s: taking over the lock of pid %s (started %s), which is no longer running",
                self._location,
                holder["pid"],
                holder.get("started", "?"),
            )
            return True
        finally:
            mutex.unlink(missing_ok=True)

    def in_place(self) -> bool:
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return self._id is not None and (st.st_dev, st.st_ino) == self._id[:2]

    def release(self) -> None:
        """Remove the lock if it is still ours (raises the OSError of a failed unlink)."""
        if self._id is None:
            return
        try:
            ours = self.in_place() and read_capped(self.path, 1 << 16) == self._id[2]
        except (OSError, Unreadable):
            ours = False
        self._id = None
        if ours:
            self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, under another user
        return True
    return True
