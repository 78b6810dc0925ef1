"""Public test hooks: a Sink that injects storage faults, deterministically.

Reliability tests (ours, and anyone building on the Writer) wrap a real sink in
:class:`FaultInjectingSink` and pass it as the Writer's ``store``: faults go through the same
seam as real storage errors, no private attribute is patched.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Callable, Sequence

from .store import Sink, open_sink


class FaultInjectingSink(Sink):
    """Delegates to ``inner`` (a Sink, path or zarr Store) and injects faults by key.

    * ``fail``: ``{pattern: exception}``: a write whose key matches the glob ``pattern`` raises
      the exception instead of writing (e.g. ``{"c/3/*": OSError(errno.ENOSPC, "No space")}``);
    * ``delay``: ``{pattern: seconds}``: such writes sleep first (a slow disk);
    * ``hold``: ``{pattern: threading.Event}``: such writes wait until the event is set;
    * ``before_write``: called with the key before every write (may raise).

    ``writes`` lists the keys written (in completion order), ``attempts`` every key tried.
    """

    def __init__(
        self,
        inner,
        overwrite: bool = False,
        *,
        fail: dict | None = None,
        delay: dict | None = None,
        hold: dict | None = None,
        before_write: Callable[[str], None] | None = None,
    ):
        self.inner = open_sink(inner, overwrite)
        self.fail = dict(fail or {})
        self.delay = dict(delay or {})
        self.hold = dict(hold or {})
        self.before_write = before_write
        self.writes: list[str] = []
        self.attempts: list[str] = []
        self._lock = threading.Lock()

    def __repr__(self):
        return f"FaultInjectingSink({self.inner!r})"

    @property
    def location(self) -> str:
        return self.inner.location

    @property
    def root(self):
        return getattr(self.inner, "root", None)

    @staticmethod
    def _match(patterns: dict, key: str):
        for pattern, value in patterns.items():
            if fnmatch.fnmatchcase(key, pattern):
                return value
        return None

    def write(self, key: str, buffers: Sequence) -> None:
        with self._lock:
            self.attempts.append(key)
        if self.before_write is not None:
            self.before_write(key)
        event = self._match(self.hold, key)
        if event is not None:
            event.wait()
        seconds = self._match(self.delay, key)
        if seconds:
            time.sleep(seconds)
        exc = self._match(self.fail, key)
        if exc is not None:
            raise exc
        self.inner.write(key, buffers)
        with self._lock:
            self.writes.append(key)

    def release(self) -> None:
        self.inner.release()

    def discard(self) -> None:
        self.inner.discard()
