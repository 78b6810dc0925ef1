"""The hand-over between the MDA thread and the thread that feeds the Writers.

The MDA thread must never wait on storage: :meth:`FrameFeeder.offer` puts a frame on a bounded
queue and returns; one feeder thread takes the frames off in arrival order and hands each to
``take`` (the sink places it, in frame order, into its series' Writer), then calls ``advance``
after every item (frames that became next go in, also after a :meth:`~FrameFeeder.wake`).  When
``capacity`` frames already wait, the policy decides: ``block`` (the MDA thread waits) or ``drop``
(the frame is refused; the caller accounts for it).  An error on the feeder thread is kept in
:attr:`~FrameFeeder.failure`; the thread then keeps draining the queue so that the MDA thread
never blocks on a queue nobody empties.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..recorder import POLICIES

__all__ = ["FrameFeeder"]

log = logging.getLogger(__name__)

_STOP = object()
_WAKE = object()


class FrameFeeder:
    """A bounded queue of frames (``capacity``, policy ``block`` or ``drop``) and the thread that
    empties it: ``prepare()`` first (arming the Writers while the first frames queue), then
    ``take(item)`` for each item offered, ``advance()`` after every item, ``finish()`` once
    :meth:`stop` was called and everything before it was taken.  ``label`` (the store) starts the
    log line of a failure."""

    def __init__(
        self,
        capacity: int,
        policy: str,
        *,
        take: Callable[[Any], None],
        advance: Callable[[], None],
        finish: Callable[[], None],
        prepare: Callable[[], None] | None = None,
        label: str = "",
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"the queue's capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self.policy = policy
        self.label = label
        self.failure: BaseException | None = None  # what ended the feeder thread, if anything did
        self._take = take
        self._advance = advance
        self._finish = finish
        self._prepare = prepare
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        # bound once: offer() runs on the MDA thread for every frame
        self._put = self._queue.put if policy == "block" else self._queue.put_nowait
        self.full = self._queue.full
        self.qsize = self._queue.qsize
        self._thread = threading.Thread(target=self._run, name="tileshard-mda-sink", daemon=True)

    def start(self) -> FrameFeeder:
        self._thread.start()
        return self

    def offer(self, item) -> bool:
        """Queue one item (never None).  Under ``block`` waits while the queue is full; under
        ``drop`` returns False instead of waiting (the item is not queued)."""
        try:
            self._put(item)
        except queue.Full:
            return False
        return True

    def wake(self) -> None:
        """Have the feeder thread call ``advance`` (frames that became next without arriving: skipped)."""
        self._queue.put(_WAKE)

    def stop(self) -> None:
        """Let the feeder take everything queued, call ``finish`` and end; returns when it has."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        get, take, advance = self._queue.get, self._take, self._advance
        try:
            if self._prepare is not None:  # frames queue meanwhile
                self._prepare()
            while True:
                item = get()
                if item is _STOP:
                    break
                if item is not _WAKE:
                    take(item)
                advance()
            self._finish()
        except BaseException as exc:  # reported by the owner (the next append, close)
            self.failure = exc
            log.error("%s: recording failed: %s: %s", self.label, type(exc).__name__, exc)
            log.debug("the failure in detail", exc_info=True)
            while True:  # keep the MDA thread from blocking on a full queue
                if get() is _STOP:
                    break
