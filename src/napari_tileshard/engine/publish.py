"""The publisher: the only place that decides what a reader of the store may see.

A reader learns what exists from ``zarr.json``: ``shape[0]`` for an unbounded array, and the
``tileshard`` attribute (``rows_written``, ``state``) for every array the Writer writes.  The
Writer hands the publisher each group of shard writes that, once on disk, makes a number of
rows readable (``track``).  Groups are published strictly in the order they were tracked: the
published extent only ever advances over a contiguous prefix of groups whose every write
succeeded.  After the first failed write nothing more is published, whatever completes later,
so a store never claims a row whose shards are not all on disk (``docs/reliability.md``).

Shard writes complete on I/O threads; their completion callbacks advance the prefix, so a
shard epoch is published as soon as its last shard lands, without polling.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future

from ..format.codecs import Codec
from ..format.layout import Layout
from ..format.metadata import COMPLETE, FAILED, METADATA_KEY, RECORDING, STATE_KEY, metadata_bytes
from ..format.pyramid import Pyramid
from ..format.shard_spec import array_metadata
from ..storage.sinks import Sink

__all__ = ["Publisher"]

log = logging.getLogger(__name__)


_NO_ANSWER = re.compile(r"timed? ?out|deadline|error sending request|connection (reset|closed)", re.IGNORECASE)


def _no_answer(exc: BaseException) -> bool:
    """A write that got no answer (a timeout, a connection cut): it may have been stored anyway."""
    return isinstance(exc, TimeoutError) or bool(_NO_ANSWER.search(str(exc)))


#: the rows a zarr.json is first rendered with (:meth:`Publisher.metadata_of`): a number no real
#: recording reaches and no other field of the metadata holds
_ROWS_STAND_IN = 9_182_736_450_918_273


class _Group:
    __slots__ = ("remaining", "rows")

    def __init__(self, writes: int, rows: int):
        self.remaining = writes
        self.rows = rows


class Publisher:
    """Publishes ``zarr.json`` of every pyramid level as shard writes complete, in order.

    ``on_error`` is called once with the first storage error (a failed shard or metadata write).
    """

    def __init__(
        self,
        sink: Sink,
        pyramid: Pyramid,
        codec: Codec | str,
        level: int,
        attributes: dict,
        prefixes: Sequence[str],
        on_error: Callable[[BaseException], None],
        on_publish: Callable[[int], None] | None = None,
    ):
        self._sink = sink
        self._pyramid = pyramid
        self._codec = codec
        self._level = level
        self._attributes = dict(attributes)
        self._prefixes = list(prefixes)
        self._on_error = on_error
        self._on_publish = on_publish
        self._groups: deque[_Group] = deque()
        self._changed = threading.Condition()
        self._publish_lock = threading.Lock()  # one zarr.json writer at a time, in order
        self._texts: dict[tuple[int, str], list[str] | None] = {}  # (level, state) -> zarr.json split at the rows
        self.rows = 0  # rows of level 0 that the store claims now
        self.error: BaseException | None = None
        self.state = RECORDING
        #: when the zarr.json write in progress started (time.monotonic), None between writes
        self.publishing_since: float | None = None

    @property
    def layout(self) -> Layout:
        return self._pyramid.layouts[0]

    # -- what readers see -------------------------------------------------------------
    def begin(self) -> None:
        """The first zarr.json of every level: no rows written yet.  Raises the storage error."""
        self._write_metadata(0, RECORDING)

    def track(self, futures: Sequence[Future], rows: int) -> None:
        """``futures`` (shard writes) make level-0 rows ``[0, rows)`` readable once all succeed
        and every group tracked before them is published."""
        group = _Group(len(futures), rows)
        with self._changed:
            self._groups.append(group)
        if not futures:
            self._advance()
        for future in futures:
            future.add_done_callback(functools.partial(self._write_done, group))

    @property
    def pending(self) -> int:
        """Tracked groups not yet published."""
        with self._changed:
            return len(self._groups)

    def wait(self, max_pending: int = 0, check: Callable[[], None] | None = None, slice_s: float = 0.5) -> None:
        """Block until at most ``max_pending`` tracked groups are unpublished (or a write failed).

        ``check`` is called between slices of ``slice_s`` seconds (outside the lock): the caller's
        liveness check, which may :meth:`fail` the publisher or raise, so no wait is endless."""

        def ready() -> bool:
            return len(self._groups) <= max_pending or self.error is not None

        while True:
            with self._changed:
                if self._changed.wait_for(ready, timeout=slice_s):
                    return
            if check is not None:
                check()

    def fail(self, exc: BaseException) -> None:
        """Stop publishing for good (``exc`` becomes :attr:`error` unless one is set): waits return."""
        with self._changed:
            self._set_error(exc)
            self._changed.notify_all()

    def finish(self, rows: int | None, check: Callable[[], None] | None = None) -> None:
        """End of the recording: after every tracked group, publish state ``complete`` (``rows``:
        the final row count, when the last group already covers them, None)."""
        self.wait(check=check)
        if self.error is not None:
            return
        with self._publish_lock:
            final = self.rows if rows is None else max(self.rows, rows)
            self._write_metadata(final, COMPLETE)

    def mark_failed(self, timeout: float | None = None) -> None:
        """Best effort: say in zarr.json that the recording stopped on an error (same rows).
        Gives up after ``timeout`` seconds waiting for a zarr.json write still in progress."""
        if not self._publish_lock.acquire(timeout=-1 if timeout is None else timeout):
            log.warning(
                "also: %s is not marked as failed: an earlier zarr.json write still waits on the storage "
                "(whichever zarr.json lands, it claims only rows whose shards are stored)",
                self._sink.location,
            )
            return
        try:
            if self.state == FAILED:
                return
            self._write_metadata(self.rows, FAILED)
        except Exception as exc:  # noqa: BLE001 - storage is failing already: the previous zarr.json stays
            if _no_answer(exc):  # the request may have reached the storage: say so, not "could not"
                log.warning(
                    "also: marking %s as failed got no answer in time (%s); the mark may still land, and either "
                    "way zarr.json claims only rows whose shards are stored",
                    self._sink.location,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
            else:
                log.warning("also: could not mark %s as failed: %s", self._sink.location, exc)
        finally:
            self._publish_lock.release()

    # -- internals --------------------------------------------------------------------
    def _write_done(self, group: _Group, future: Future) -> None:
        # A future callback: an exception escaping here would be swallowed by concurrent.futures
        # and the group never published (a wait without end), so every path ends in a decision.
        try:
            exc = future.exception()
        except CancelledError as error:  # counts as a failed write (an interrupt is no answer: it propagates)
            exc = error
        with self._changed:
            group.remaining -= 1
            if exc is not None:  # the first failure ends publishing, even of groups before it
                self._set_error(exc)
                self._changed.notify_all()
                return
            if group.remaining:  # a group with writes to go publishes nothing new: only its last write may
                return
        self._advance()

    def _advance(self) -> None:
        """Publish the longest prefix of fully written groups (nothing once a write failed).

        Groups leave the queue only after their rows are in zarr.json, so ``wait()`` never
        returns before what it waited for is visible to readers."""
        with self._publish_lock:
            with self._changed:
                done, rows = 0, self.rows
                for group in self._groups:
                    if group.remaining or self.error is not None:
                        break
                    done, rows = done + 1, max(rows, group.rows)
            if not done:
                return
            if rows != self.rows:
                self.publishing_since = time.monotonic()
                # Only storage failures stop publishing.  An interrupt (Ctrl-C or SIGTERM raised in a
                # future callback on the main thread, as in convert) is none and must reach the
                # caller: swallowed here, convert heard it only once every epoch was done, and never
                # while a source read hung.  Nothing is popped then: the next advance publishes.
                try:
                    self._write_metadata(rows, RECORDING)
                except Exception as exc:  # noqa: BLE001 - the previous zarr.json stays (atomic replace): stop here
                    with self._changed:
                        self._set_error(exc)
                finally:
                    self.publishing_since = None
            with self._changed:
                for _ in range(done):
                    self._groups.popleft()
                self._changed.notify_all()

    def metadata_of(self, k: int, level_rows: int, state: str) -> bytes:
        """``zarr.json`` of level ``k`` with ``level_rows`` rows written, in ``state``.

        Rendered once per level and state with a stand-in for the rows (they are
        ``rows_written``, and ``shape[0]`` of an unbounded array), then only the number is put
        in: a recording publishes after every shard epoch, over a hundred times a second with
        small shards on many cores, and building and encoding the metadata each time held the
        GIL that the encode threads wait for.  json writes an integer as ``str()`` does, so the
        bytes are ``metadata_bytes``' own; where the stand-in is found elsewhere too (in an
        attribute), every zarr.json is rendered in full."""
        key = (k, state)
        if key not in self._texts:
            split = self._render(k, _ROWS_STAND_IN, state).decode().split(str(_ROWS_STAND_IN))
            places = 2 if self._pyramid.layouts[k].unbounded else 1  # rows_written, and shape[0] if unbounded
            self._texts[key] = split if len(split) == places + 1 else None
        pieces = self._texts[key]
        if pieces is None:
            return self._render(k, level_rows, state)
        return str(level_rows).join(pieces).encode()

    def _render(self, k: int, level_rows: int, state: str) -> bytes:
        layout = self._pyramid.layouts[k]
        shape0 = level_rows if layout.unbounded else layout.shape[0]
        attributes = {**self._attributes, STATE_KEY: {"rows_written": level_rows, "state": state}}
        return metadata_bytes(array_metadata(layout, self._codec, self._level, shape0, attributes))

    def _set_error(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            try:
                self._on_error(exc)
            except Exception:  # noqa: BLE001 - the error is recorded; a failing observer must not hide it
                log.exception("reporting a storage error of %s failed", self._sink.location)

    def _write_metadata(self, rows: int, state: str) -> None:
        pyramid = self._pyramid
        # Coarsest level first, level 0 last: when a write fails part way, level 0 (whose rows
        # :attr:`rows` reports) still holds the previous claim, so the two never disagree.
        levels = list(enumerate(zip(pyramid.layouts, self._prefixes)))
        for k, (_, prefix) in reversed(levels):
            self._sink.write(prefix + METADATA_KEY, [self.metadata_of(k, pyramid.level_rows(k, rows), state)])
        self.rows = rows
        self.state = state
        if self._on_publish is not None:
            self._on_publish(rows)
