"""The collector: takes encoded batches in order, assembles shards, writes them, tells the publisher.

It runs one thread.  The caller reserves room (:meth:`Collector.reserve`) *before* a batch
changes any state, then enqueues the backend's ticket with the stream offset the batch ends at;
the thread waits for each ticket in order, feeds every level's :class:`ShardAccumulator`, hands
completed shards to the I/O :class:`~napari_tileshard.dispatch.Dispatcher` (one batch per shard
epoch) and registers them with the
:class:`~napari_tileshard.publish.Publisher` with the rows they make readable (whole rows of the
batches actually taken in, never of bytes merely received).  While too many shard epochs wait
on storage it waits too, and so, through the reserved room, does the producer.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence

from .backends.base import Backend
from .dispatch import Dispatcher, DispatchStats
from .publish import Publisher
from .pyramid import Pyramid
from .shard import EncodedEpoch, Shard, ShardAccumulator
from .store import Sink

_PENDING_BATCHES = 2  # compressed batches that may wait on storage before the collector waits


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
        pipeline_limit: int,
        batch_epochs: int,
        failed: Callable[[], BaseException | None],
        on_error: Callable[[BaseException], None],
        on_shard: Callable[[int], None],
    ):
        self._backend = backend
        self._pyramid = pyramid
        self._sink = sink
        self._prefixes = list(prefixes)
        self._publisher = publisher
        self._failed = failed
        self._on_error = on_error
        self._on_shard = on_shard  # bytes of each shard written (statistics)
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
        self._io = Dispatcher(sink, io_threads, io_dispatch)
        self._thread = threading.Thread(target=self._run, name="tileshard-collector", daemon=True)
        self._thread.start()

    @property
    def rows_collected(self) -> int:
        return self.bytes_collected // self._row_bytes

    # -- the producer's side ------------------------------------------------------------
    def reserve(self, block: bool) -> bool:
        """Reserve room for one batch; False when full and ``block`` is False.  Raises nothing:
        the caller checks for errors (a failure wakes a waiting producer)."""
        with self._room:
            if block:
                self._room.wait_for(lambda: self._in_pipeline < self._pipeline_limit or self._failed() is not None)
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
        self._queue.join()
        self._publisher.wait()

    def flush(self, provisional: list[list[EncodedEpoch]], rows: int) -> None:
        """Write every open shard as if the stream ended after ``provisional`` (per level) and
        publish ``rows``; call after :meth:`drain`, from the producer's thread."""
        shards = [
            (k, shard)
            for k, accumulator in enumerate(self._accumulators)
            for shard in accumulator.flush(provisional[k])
        ]
        self._store(shards, rows)
        self._publisher.wait()

    def finish(self) -> None:
        """Stop the thread; unless failed, write the open shards and publish the end."""
        self._queue.put(None)
        self._thread.join()
        if self._failed() is None:
            self._store(
                [
                    (k, shard)
                    for k, accumulator in enumerate(self._accumulators)
                    for shard in accumulator.take_pending()
                ],
                self.rows_collected,
            )
            self._publisher.finish(self.rows_collected)

    def shutdown(self) -> None:
        """Wait for every shard write (also after a failure)."""
        self._io.shutdown(wait=True)

    def io_stats(self) -> DispatchStats:
        return self._io.stats()

    # -- the collector thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
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
                self._queue.task_done()

    def _collect(self, ticket, first_epoch: int, stream_end: int) -> None:
        levels = self._backend.result(ticket)
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
                self._publisher.wait(self.max_pending_shard_epochs)  # storage backpressure
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
            ]
        )
        for future, (_, shard) in zip(futures, shards, strict=True):  # statistics before publication
            future.add_done_callback(functools.partial(self._written, shard.nbytes))
        self._publisher.track(futures, rows)

    def _written(self, nbytes: int, future) -> None:
        if future.exception() is None:
            self._on_shard(nbytes)
