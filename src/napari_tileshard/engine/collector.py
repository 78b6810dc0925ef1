"""The collector: takes encoded batches in order, assembles shards, writes them, tells the publisher.

It runs one thread.  The caller reserves room (:meth:`Collector.reserve`) *before* a batch
changes any state, then enqueues the backend's ticket with the stream offset the batch ends at;
the thread waits for each ticket in order, feeds every level's :class:`ShardAccumulator`, hands
completed shards to the I/O :class:`~napari_tileshard.engine.dispatch.Dispatcher` (one batch per shard
epoch) and registers them with the
:class:`~napari_tileshard.engine.publish.Publisher` with the rows they make readable (whole rows of the
batches actually taken in, never of bytes merely received).  While too many shard epochs wait
on storage it waits too, and so, through the reserved room, does the producer.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence

from ..format.pyramid import Pyramid
from ..storage.sinks import Sink
from .backends.base import Backend
from .dispatch import Dispatcher, DispatchStats
from .errors import PipelineStalledError
from .publish import Publisher
from .shards import EncodedEpoch, Shard, ShardAccumulator

__all__ = ["BACKEND_STALL_S", "Collector", "in_flight_bytes", "pending_shard_epochs"]

_PENDING_BATCHES = 2  # compressed batches that may wait on storage before the collector waits
#: waits are sliced so that every slice checks the stage it waits on is alive (and Ctrl-C lands)
_WAIT_SLICE_S = 0.5
#: a backend that has not returned one batch for this long is stuck (a zstd level-22 batch of
#: 256 MiB takes ~60 s on two cores; a GPU batch well under a second)
BACKEND_STALL_S = 300.0
#: the publisher waiting on shard epochs while nothing is queued, in flight or being published
#: for this long has lost work: a bug, reported instead of waited on forever
_LOST_WORK_S = 2.0


def pending_shard_epochs(layout, batch_epochs: int) -> int:
    """Shard epochs that may wait on storage before the collector (and so the producer) waits."""
    return max(2, _PENDING_BATCHES * -(-batch_epochs // layout.tiles_per_shard[0]))


def in_flight_bytes(pyramid: Pyramid, codec, batch_epochs: int) -> int:
    """Worst case of compressed shard bytes held: the open shard epoch plus those waiting on storage."""
    layout = pyramid.layouts[0]
    shard_epoch = layout.tiles_per_shard[0] * sum(
        lay.tiles_per_epoch * lay.compressed_tile_bound(codec) for lay in pyramid.layouts
    )
    return (1 + pending_shard_epochs(layout, batch_epochs)) * shard_epoch


class Collector:
    def __init__(
        self,
        backend: Backend,
        pyramid: Pyramid,
        sink: Sink,
        prefixes: Sequence[str],
        publisher: Publisher,
        *,
        io_threads: int,
        io_dispatch: str = "adaptive",
        io_timeout: float | None = None,
        io_telemetry_lost: Callable[[int], bool] | None = None,
        pipeline_limit: int,
        batch_epochs: int,
        failed: Callable[[], BaseException | None],
        on_error: Callable[[BaseException], None],
        on_shard: Callable[[int, int], None],
    ):
        self._backend = backend
        self._pyramid = pyramid
        self._sink = sink
        self._prefixes = list(prefixes)
        self._publisher = publisher
        self._failed = failed
        self._on_error = on_error
        self._on_shard = on_shard  # (pyramid level, bytes) of each shard written: statistics
        layout = pyramid.layouts[0]
        self._row_bytes = layout.row_elements * layout.itemsize
        self._accumulators = [ShardAccumulator(lay) for lay in pyramid.layouts]
        self.max_pending_shard_epochs = pending_shard_epochs(layout, batch_epochs)
        self._pipeline_limit = pipeline_limit
        self._in_pipeline = 0
        self._room = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._epochs_enqueued = 0
        self.bytes_collected = 0  # stream bytes of every batch taken in
        self.io_timeout = io_timeout
        # What the collector thread is doing and since when: the producer's waits check it.
        self._stage, self._stage_since = "idle", time.monotonic()
        self._lost_since: float | None = None
        self._io = Dispatcher(sink, io_threads, io_dispatch, io_timeout=io_timeout, telemetry_lost=io_telemetry_lost)
        self._done = threading.Event()  # the thread's work is over (its teardown may lag)
        self._thread = threading.Thread(target=self._run, name="tileshard-collector", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        """The collector thread's work is over (it ended or was never needed)."""
        return self._done.is_set()

    @property
    def rows_collected(self) -> int:
        return self.bytes_collected // self._row_bytes

    # -- the producer's side ------------------------------------------------------------
    def reserve(self, block: bool) -> bool:
        """Reserve room for one batch; False when full and ``block`` is False.  Raises nothing
        but :class:`PipelineStalledError` (a stage stuck past its deadline): the caller checks
        for errors (a failure wakes a waiting producer)."""
        if block:
            self._wait_room(lambda: self._in_pipeline < self._pipeline_limit or self._failed() is not None)
        with self._room:
            if self._failed() is not None or self._in_pipeline >= self._pipeline_limit:
                return False
            self._in_pipeline += 1
            return True

    def enqueue(self, ticket, epochs: int, stream_end: int) -> None:
        """The batch of ``ticket`` (``epochs`` tile epochs) ends at stream byte ``stream_end``."""
        self._queue.put((ticket, self._epochs_enqueued, stream_end))
        self._epochs_enqueued += epochs

    def wake(self) -> None:
        with self._room:
            self._room.notify_all()

    def drain(self) -> None:
        """Wait until every enqueued batch is processed and its shards are written and published."""
        self._wait_room(lambda: self._in_pipeline == 0 or self._failed() is not None)
        self._publisher.wait(check=self.check_storage)

    def flush(self, provisional: list[list[EncodedEpoch]], rows: int) -> None:
        """Write every open shard as if the stream ended after ``provisional`` (per level) and
        publish ``rows``; call after :meth:`drain`, from the producer's thread."""
        shards = [
            (k, shard)
            for k, accumulator in enumerate(self._accumulators)
            for shard in accumulator.flush(provisional[k])
        ]
        self._store(shards, rows)
        self._publisher.wait(check=self.check_storage)

    def finish(self) -> None:
        """Stop the thread; unless failed, write the open shards and publish the end."""
        self._queue.put(None)
        # The thread's work, not its teardown: a thread's exit can stall on the interpreter's
        # thread-list lock (CPython gh-106883 on < 3.11.9, with a profiler calling
        # sys._current_frames()); its work is all we need.
        self._wait_room(self._done.is_set)
        self._thread.join(_WAIT_SLICE_S)
        if self._failed() is None:
            self._store(
                [
                    (k, shard)
                    for k, accumulator in enumerate(self._accumulators)
                    for shard in accumulator.take_pending()
                ],
                self.rows_collected,
            )
            self._publisher.finish(self.rows_collected, check=self.check_storage)

    def abort(self, reason: BaseException) -> None:
        """The recording failed: drop the shard writes still queued and cut off those in flight
        (nothing after a failure is ever published)."""
        self._io.abort(reason)

    def shutdown(self, timeout: float | None = None) -> list[str]:
        """Wait for the shard writes (also after a failure), at most ``timeout`` seconds: then
        the rest is cut off or abandoned; returns the keys of writes abandoned in flight."""
        return self._io.shutdown(wait=True, timeout=timeout)

    def describe(self) -> str:
        """Where the pipeline is, for messages (Ctrl-C during close, stalls)."""
        with self._room:
            batches = self._in_pipeline
        return (
            f"{batches} batches in the pipeline; collector: {self._stage}; storage: {self._io.describe()}; "
            f"{self._publisher.pending} shard epochs unpublished, {self._publisher.rows} rows published"
        )

    # -- liveness ---------------------------------------------------------------------------
    def _wait_room(self, ready: Callable[[], bool]) -> None:
        """Wait (on the producer's thread) until ``ready()``, checking every slice that the
        collector thread is alive and not stuck."""
        while True:
            with self._room:
                if self._room.wait_for(ready, timeout=_WAIT_SLICE_S):
                    return
            self._check_collector()

    def _check_collector(self) -> None:
        if self._failed() is not None:
            return  # the caller's predicate sees it (a failure wakes this wait too)
        if not self._thread.is_alive() and not self._done.is_set():
            raise PipelineStalledError("the collector thread ended without finishing its work (see the log)")
        stage, since = self._stage, self._stage_since
        if stage.startswith("encoding") and time.monotonic() - since > BACKEND_STALL_S:
            raise PipelineStalledError(
                f"the {self._backend.name} backend has not returned a batch for {time.monotonic() - since:.0f} s "
                f"(collector: {stage})"
            )
        self.check_storage()

    def check_storage(self) -> None:
        """Raise instead of waiting forever on storage: the dispatcher failed (its queued writes
        were dropped: the publisher stops), or the publisher waits on shard epochs while nothing
        is queued, in flight or being published (lost work)."""
        publisher = self._publisher
        failure = self._io.failure
        if failure is not None:
            publisher.fail(failure)
            return
        since = publisher.publishing_since
        if since is not None and self.io_timeout is not None and time.monotonic() - since > self.io_timeout:
            publisher.fail(
                PipelineStalledError(
                    f"writing zarr.json to {self._sink.location} has not returned for "
                    f"{time.monotonic() - since:.0f} s (io_timeout={self.io_timeout:g} s)"
                )
            )
            return
        if publisher.pending and since is None and self._io.idle():
            now = time.monotonic()
            if self._lost_since is None:
                self._lost_since = now
            elif now - self._lost_since > _LOST_WORK_S:
                publisher.fail(
                    PipelineStalledError(
                        f"the publisher waits for {publisher.pending} shard epochs of {self._sink.location} "
                        "but no shard write is queued, in flight or being published: work was lost (a bug; "
                        "the store claims only what is on disk)"
                    )
                )
        else:
            self._lost_since = None

    def io_stats(self) -> DispatchStats:
        return self._io.stats()

    # -- the collector thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._set_stage("idle")
                item = self._queue.get()
                try:
                    if item is None:
                        return
                    if self._failed() is None:  # else drain without work so producers never block
                        self._collect(*item)
                except BaseException as exc:  # noqa: BLE001 - reported to the Writer
                    self._on_error(exc)
                finally:
                    if item is not None:
                        with self._room:
                            self._in_pipeline -= 1
                            self._room.notify_all()
        finally:
            self._set_stage("finished")
            self._done.set()
            with self._room:
                self._room.notify_all()

    def _set_stage(self, stage: str) -> None:
        self._stage, self._stage_since = stage, time.monotonic()

    def _collect(self, ticket, first_epoch: int, stream_end: int) -> None:
        self._set_stage(f"encoding the batch from tile epoch {first_epoch}")
        levels = self._backend.result(ticket)
        self._set_stage(f"assembling the shards of tile epochs from {first_epoch}")
        rows_received = stream_end // self._row_bytes  # whole rows only: a partial row is never claimed
        shard_epoch_rows = self._pyramid.layouts[0].shard_epoch_rows
        for offset in range(len(levels[0])):
            # Level k's tile epoch e lies in level 0's: their shard epochs complete together.
            shards = [
                (k, shard)
                for k, accumulator in enumerate(self._accumulators)
                for shard in accumulator.add(first_epoch + offset, levels[k][offset])
            ]
            if shards:
                shard_epoch = shards[0][1].coords[0]
                self._store(shards, min((shard_epoch + 1) * shard_epoch_rows, rows_received))
                self._set_stage(f"waiting for storage to take shard epoch {shard_epoch}")
                self._publisher.wait(self.max_pending_shard_epochs, check=self.check_storage)  # backpressure
        self.bytes_collected = stream_end

    def _store(self, shards: list[tuple[int, Shard]], rows: int) -> None:
        """Write ``shards`` (level, shard) as one dispatcher batch; level-0 rows ``[0, rows)`` are
        published once they and everything before them are stored."""
        if not shards:
            return
        futures = self._io.submit(
            [
                (self._prefixes[k] + self._pyramid.layouts[k].shard_key(shard.coords), shard.buffers + [shard.index])
                for k, shard in shards
            ],
            [shard.nbytes for _, shard in shards],  # known: not counted again chunk by chunk
        )
        for future, (level, shard) in zip(futures, shards, strict=True):  # statistics before publication
            future.add_done_callback(functools.partial(self._written, level, shard.nbytes))
        self._publisher.track(futures, rows)

    def _written(self, level: int, nbytes: int, future) -> None:
        if future.exception() is None:
            self._on_shard(level, nbytes)
