"""The I/O dispatcher: N workers write shards to a :class:`~napari_tileshard.storage.sinks.Sink`.

Shard writes are the unit of work (``../shared/design/adaptive-dispatch.md`` applied to I/O).
A slow disk queue, an overloaded S3 connection or a stalled request makes one worker slower
than the others, and the slowest one sets the pace.  Three modes (``mode=``), each a strategy
(:mod:`.strategies`) of one core (:mod:`.core`):

* ``"static"`` (:class:`~.strategies.StaticPlacement`): round-robin placement into per-worker
  queues; nothing moves (the baseline).
* ``"pull"`` (:class:`~.strategies.SharedQueue`): one shared FIFO; an idle worker takes the next
  shard (a thread pool).
* ``"adaptive"`` (:class:`~.strategies.AdaptivePlanner`, the default): two planes.

  - *Data plane* (the core): every write is measured (size, duration, errors) into per-worker
    telemetry and a bounded assignment log ``(worker, key, round) -> duration``, the predictor's
    training data.
  - *Predictor* (:mod:`.models`): the time of a shard on a worker, from an online per-worker rate
    model (:class:`RateModel`: exponentially weighted seconds per byte;
    ``benchmarks/bench_dispatch.py --predictors`` measures whether a richer one,
    :class:`AffineModel`, pays).
  - *Planner*, between batches (a batch is the shards of one shard epoch, handed over by
    :meth:`Dispatcher.submit`): new shards go to the worker predicted to finish them first
    (largest first), then greedy straggler relief moves queued shards off the worker predicted
    to finish last onto the one predicted to finish first, only while that one does not become
    the new straggler (at most ``max_moves`` per batch).  Shards in flight are never touched.
  - An idle worker takes a queued shard of another worker only if it is predicted to finish it
    earlier than its owner would (so a slow worker never takes work it would hold up).
  - *Hedging*: once warmed up (``warmup_samples`` writes), a shard in flight for longer than the
    ``hedge_quantile`` of recent write times (scaled by size) is written again by an idle
    worker; the first copy to land resolves it.  Duplicates are paid from a token bucket that
    earns ``hedge_fraction`` (5 %) of every submitted byte, so duplicate bytes never exceed that
    share.  Writes are idempotent: the same key and the same bytes; a local sink writes a
    temporary file and renames it, an object store PUT is atomic, so whichever copy lands last
    replaces identical bytes with identical bytes.  A key written again with other bytes (a
    flushed shard completed later) is ordered (by the core, in every mode): the new version
    starts only once every copy of the older one has landed, and only the newest version is hedged.
  - *Replacement*: a worker predicted ``retire_factor`` (4) times slower than the median of the
    others is retired (it finishes the write in hand) and a fresh worker (thread, connection)
    takes its queue, so a sick connection costs its share of capacity only until it is found.
  - *Fallback*: while any worker has fewer than ``min_worker_samples`` measurements or the
    telemetry of a round is lost, the round is placed statically (round-robin) and the model
    learns nothing from it.

Lost telemetry is a fault of the dispatcher's own measurements, not of storage, so its seam is
the dispatcher's: ``Dispatcher(telemetry_lost=...)`` (``Writer(io_telemetry_lost=...)``), a
callable ``round_index -> bool`` (batches are numbered from 1).  None (the default) loses
nothing.  :meth:`napari_tileshard.testing.FaultInjectingSink.telemetry_lost` is the seeded one
(``StorageFaults(telemetry_loss=...)``); tests and ``benchmarks/bench_dispatch.py`` pass it
explicitly.  Only the adaptive planner consults it (the other modes use no telemetry).

Errors: a :class:`TransientStorageError` (e.g. S3 "503 SlowDown" after the client's own
retries) is retried by the same worker after an exponential backoff, up to ``max_retries``;
any other error fails the shard's future (the Writer stops, the Publisher claims nothing more).

Liveness (``docs/reliability.md``): a write that fails for good ends the batch of work, not just
its shard (``fail_fast``): nothing queued after it could ever be published, so every queued
write is dropped at once (its future fails with :class:`WriteCancelledError`) and the sink is asked
to cut off the writes in flight (:meth:`Sink.cancel`: an object store cancels its requests).  A
watchdog thread fails any write in flight for longer than ``io_timeout`` (+ 1 s per MB) with
:class:`StorageTimeoutError` (a frozen endpoint, a hung mount) the same way, and
:meth:`Dispatcher.shutdown` waits at most ``timeout``: a write that a sink cannot cut off is
abandoned on its (daemon) thread and named, never waited for forever.
"""

from .core import MODES, Dispatcher, current_worker
from .models import PREDICTORS, AffineModel, RateModel
from .stats import DispatchStats, WorkerStats
from .strategies import STRATEGIES, AdaptivePlanner, PlannerOptions, SharedQueue, StaticPlacement, Strategy

__all__ = [
    "MODES",
    "PREDICTORS",
    "STRATEGIES",
    "AdaptivePlanner",
    "AffineModel",
    "DispatchStats",
    "Dispatcher",
    "PlannerOptions",
    "RateModel",
    "SharedQueue",
    "StaticPlacement",
    "Strategy",
    "WorkerStats",
    "current_worker",
]
