"""The I/O dispatcher: N workers write shards to a :class:`~napari_tileshard.storage.sinks.Sink`.

Shard writes are the unit of work (``../shared/design/adaptive-dispatch.md`` applied to I/O).
A slow disk queue, an overloaded S3 connection or a stalled request makes one worker slower
than the others, and the slowest one sets the pace.  Three modes (``mode=``):

* ``"static"``: round-robin placement into per-worker queues; nothing moves (the baseline).
* ``"pull"``: one shared FIFO; an idle worker takes the next shard (a thread pool).
* ``"adaptive"`` (the default): two planes.

  - *Data plane*: every write is measured (size, duration, errors) into per-worker telemetry
    and a bounded assignment log ``(worker, key, round) -> duration``, the predictor's
    training data.
  - *Predictor*: the time of a shard on a worker, from an online per-worker rate model
    (:class:`RateModel`: exponentially weighted seconds per byte; ``benchmarks/bench_dispatch.py
    --predictors`` measures whether a richer one, :class:`AffineModel`, pays).
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
    flushed shard completed later) is ordered: the new version starts only once every copy of
    the older one has landed, and only the newest version is hedged.
  - *Replacement*: a worker predicted ``retire_factor`` (4) times slower than the median of the
    others is retired (it finishes the write in hand) and a fresh worker (thread, connection)
    takes its queue, so a sick connection costs its share of capacity only until it is found.
  - *Fallback*: while any worker has fewer than ``min_worker_samples`` measurements or the
    telemetry of a round is lost (:meth:`Sink.telemetry_lost`, a fault-injection seam), the
    round is placed statically (round-robin) and the model learns nothing from it.

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

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..storage.errors import StorageTimeoutError, TransientStorageError, WriteCancelledError
from ..storage.sinks import Sink, write_deadline

log = logging.getLogger(__name__)

MODES = ("static", "pull", "adaptive")

_local = threading.local()


def current_worker() -> int | None:
    """The index of the dispatcher worker running the calling thread (None elsewhere): the seam
    through which a test sink (:class:`napari_tileshard.testing.FaultInjectingSink`) makes one
    worker slow."""
    return getattr(_local, "worker", None)


class RateModel:
    """Online per-worker rate model: predicted seconds = nbytes x exponentially weighted seconds
    per byte (a fixed per-write cost folds into the rate; shards of one recording are of
    similar size)."""

    name = "rate"

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.samples = 0
        self._seconds_per_byte = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        rate = seconds / max(nbytes, 1)
        previous = self._seconds_per_byte if self.samples else rate
        self._seconds_per_byte = previous + self.alpha * (rate - previous)
        self.samples += 1

    def predict(self, nbytes: int) -> float:
        return self._seconds_per_byte * max(nbytes, 1)

    def predict_many(self, count: int, nbytes: int, units: int) -> float:
        """The predicted seconds of ``count`` writes of ``nbytes`` in all, ``units`` the sum of
        their ``max(nbytes, 1)``: the sum of :meth:`predict` over them, in O(1)."""
        return self._seconds_per_byte * units


class AffineModel:
    """A richer predictor: seconds = overhead + nbytes / bandwidth, fitted by exponentially
    forgetting least squares (falls back to the rate model while sizes do not vary)."""

    name = "affine"

    def __init__(self, forget: float = 0.9):
        self.forget = forget
        self.samples = 0
        self._sums = [0.0] * 5  # weight, x, y, xx, xy
        self._fallback = RateModel(1 - forget)

    def observe(self, nbytes: int, seconds: float) -> None:
        w, x, y, xx, xy = (s * self.forget for s in self._sums)
        self._sums = [w + 1, x + nbytes, y + seconds, xx + nbytes * nbytes, xy + nbytes * seconds]
        self._fallback.observe(nbytes, seconds)
        self.samples += 1

    def predict(self, nbytes: int) -> float:
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if spread <= 1e-9 * max(xx * w, 1.0):
            return self._fallback.predict(nbytes)
        slope = (w * xy - x * y) / spread
        overhead = (y - slope * x) / w
        if slope <= 0 or overhead < 0:
            return self._fallback.predict(nbytes)
        return overhead + slope * nbytes

    def predict_many(self, count: int, nbytes: int, units: int) -> float:
        """The sum of :meth:`predict` over ``count`` writes of ``nbytes`` in all (``units``: the
        sum of their ``max(nbytes, 1)``), in O(1)."""
        if not count:
            return 0.0
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if spread <= 1e-9 * max(xx * w, 1.0):
            return self._fallback.predict_many(count, nbytes, units)
        slope = (w * xy - x * y) / spread
        overhead = (y - slope * x) / w
        if slope <= 0 or overhead < 0:
            return self._fallback.predict_many(count, nbytes, units)
        return count * overhead + slope * nbytes


PREDICTORS: dict[str, Callable[[], RateModel | AffineModel]] = {"rate": RateModel, "affine": AffineModel}


@dataclass
class WorkerStats:
    """Telemetry of one worker (the data plane)."""

    worker: int
    shards: int = 0  # writes that succeeded (duplicates included)
    bytes: int = 0
    busy_s: float = 0.0
    errors: int = 0
    duplicates: int = 0  # hedged copies this worker wrote
    retired: bool = False  # replaced for being far slower than the others
    latencies: deque = field(default_factory=lambda: deque(maxlen=1024), repr=False)

    def as_dict(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "worker": self.worker,
            "shards": self.shards,
            "bytes": self.bytes,
            "busy_s": round(self.busy_s, 6),
            "errors": self.errors,
            "duplicates": self.duplicates,
            "retired": self.retired,
            "throughput_mbps": round(self.bytes / self.busy_s / 1e6, 3) if self.busy_s else 0.0,
            "p50_s": round(_quantile(lat, 0.5), 6),
            "p95_s": round(_quantile(lat, 0.95), 6),
        }


@dataclass
class DispatchStats:
    mode: str
    workers: list[dict]
    shards: int
    bytes: int
    moves: int
    steals: int
    hedges: int
    hedge_wins: int
    duplicate_bytes: int
    retries: int
    rounds: int
    fallback_rounds: int
    replaced: int  # workers retired and replaced
    latencies_s: list[float] = field(repr=False)  # per shard: first start -> first success
    dropped: int = 0  # queued writes dropped after a failure (they could never be published)
    timeouts: int = 0  # writes failed by the io_timeout watchdog

    @property
    def straggler_gap_s(self) -> float:
        busy = [w["busy_s"] for w in self.workers]
        return max(busy) - min(busy) if busy else 0.0


#: seconds a shut-down dispatcher waits for writes it cut off (an object store's cancelled
#: requests end at once; a write no sink can cut off is abandoned after it)
_CANCEL_GRACE_S = 2.0


def _cancelled(key: str, reason: BaseException) -> WriteCancelledError:
    return WriteCancelledError(f"{key!r} was not written: the recording had already failed ({reason})")


def _quantile(ordered: Sequence[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Task:
    __slots__ = (
        "key",
        "buffers",
        "nbytes",
        "future",
        "seq",
        "round",
        "owner",
        "running",
        "started",
        "hedged",
        "done",
        "queue",
        "stamp",
    )

    def __init__(self, key, buffers, nbytes, seq, round_):
        self.key, self.buffers, self.nbytes = key, buffers, nbytes
        self.future: Future = Future()
        self.seq, self.round = seq, round_
        self.owner: int | None = None
        self.running: dict[int, float] = {}  # worker -> start time of its copy
        self.started: float | None = None
        self.hedged = False
        self.done = False
        self.queue: _WorkerQueue | None = None  # the queue holding it
        self.stamp = 0  # which of its entries in that queue's heaps is live (one per push)


class _WorkerQueue:
    """One worker's queued tasks, oldest (lowest ``seq``) first, without scans or re-sorts.

    Two heaps of entries: by ``seq`` (the order a worker takes them) and by size, largest first
    (what straggler relief moves), plus a front lane for a deferred version released to go first
    in line.  A task taken out of the middle (moved, stolen) is only marked: its entries die
    (``task.queue``/``task.stamp`` no longer match) and are dropped when they reach a heap's top,
    or when dead entries outnumber live ones (the heaps are rebuilt: amortised O(1) per removal).
    Running totals of the tasks' sizes give a worker's predicted queued work in O(1)
    (:meth:`RateModel.predict_many`).  Every operation is O(log queued) at most.
    """

    __slots__ = ("_by_seq", "_by_size", "_front", "_stamps", "count", "bytes", "units")

    def __init__(self):
        self._by_seq: list[tuple[int, int, _Task]] = []  # (seq, stamp, task)
        self._by_size: list[tuple[int, int, int, _Task]] = []  # (-nbytes, seq, stamp, task)
        self._front: deque[tuple[int, _Task]] = deque()  # (stamp, task), first in line
        self._stamps = itertools.count(1)
        self.count = 0  # live tasks
        self.bytes = 0  # their nbytes
        self.units = 0  # their max(nbytes, 1): what the rate model multiplies

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def _live(self, task: _Task, stamp: int) -> bool:
        return task.queue is self and task.stamp == stamp

    def _add(self, task: _Task) -> int:
        assert task.queue is None, "a task is in one queue at a time"
        task.queue, task.stamp = self, next(self._stamps)
        self.count += 1
        self.bytes += task.nbytes
        self.units += max(task.nbytes, 1)
        heapq.heappush(self._by_size, (-task.nbytes, task.seq, task.stamp, task))
        return task.stamp

    def push(self, task: _Task) -> None:
        """Queue ``task`` in ``seq`` order."""
        stamp = self._add(task)
        heapq.heappush(self._by_seq, (task.seq, stamp, task))

    def push_front(self, task: _Task) -> None:
        """Queue ``task`` first in line (before every other queued task)."""
        self._front.appendleft((self._add(task), task))

    def remove(self, task: _Task) -> None:
        """Take ``task`` (queued here) out of the queue."""
        assert task.queue is self
        task.queue = None
        self.count -= 1
        self.bytes -= task.nbytes
        self.units -= max(task.nbytes, 1)
        if len(self._by_seq) + len(self._front) > 2 * self.count + 64:  # mostly dead entries: rebuild
            self._by_seq = [e for e in self._by_seq if self._live(e[2], e[1])]
            heapq.heapify(self._by_seq)
            self._front = deque(e for e in self._front if self._live(e[1], e[0]))
        if len(self._by_size) > 2 * self.count + 64:
            self._by_size = [e for e in self._by_size if self._live(e[3], e[2])]
            heapq.heapify(self._by_size)

    def peek(self) -> _Task | None:
        """The task this queue's worker takes next (None when empty)."""
        front, by_seq = self._front, self._by_seq
        while front and not self._live(front[0][1], front[0][0]):
            front.popleft()
        if front:
            return front[0][1]
        while by_seq and not self._live(by_seq[0][2], by_seq[0][1]):
            heapq.heappop(by_seq)
        return by_seq[0][2] if by_seq else None

    def pop(self) -> _Task | None:
        """Take the next task (None when empty)."""
        task = self.peek()
        if task is not None:
            self.remove(task)
        return task

    def largest(self) -> _Task | None:
        """The largest queued task (the oldest of equal ones), None when empty."""
        by_size = self._by_size
        while by_size and not self._live(by_size[0][3], by_size[0][2]):
            heapq.heappop(by_size)
        return by_size[0][3] if by_size else None

    def take_all(self) -> list[_Task]:
        """Empty the queue: its tasks in the order its worker would have taken them."""
        tasks = []
        while (task := self.pop()) is not None:
            tasks.append(task)
        return tasks


class Dispatcher:
    """Writes shards to ``sink`` on ``workers`` threads; :meth:`submit` returns one Future each."""

    def __init__(
        self,
        sink: Sink,
        workers: int = 4,
        mode: str = "adaptive",
        *,
        predictor: str = "rate",
        hedge_fraction: float = 0.05,
        hedge_quantile: float = 0.95,
        warmup_samples: int = 16,
        min_worker_samples: int = 2,
        max_moves: int = 64,
        max_retries: int = 4,
        retry_backoff_s: float = 0.02,
        retire_factor: float = 4.0,
        max_replacements: int | None = None,
        log_size: int = 100_000,
        name: str = "tileshard-io",
        io_timeout: float | None = None,
        fail_fast: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {', '.join(PREDICTORS)}, got {predictor!r}")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        if not 0 <= hedge_fraction <= 1:
            raise ValueError(f"hedge_fraction must be within [0, 1], got {hedge_fraction!r}")
        if io_timeout is not None and not (isinstance(io_timeout, (int, float)) and 0 < io_timeout < math.inf):
            raise ValueError(f"io_timeout must be a positive number of seconds or None, got {io_timeout!r}")
        self.io_timeout = None if io_timeout is None else float(io_timeout)
        self.fail_fast = fail_fast
        self._failure: BaseException | None = None  # set by abort(): nothing more starts
        self.sink, self.mode, self.n = sink, mode, workers
        self.hedge_fraction, self.hedge_quantile = hedge_fraction, hedge_quantile
        self.warmup_samples, self.min_worker_samples = warmup_samples, min_worker_samples
        self.max_moves, self.max_retries, self.retry_backoff_s = max_moves, max_retries, retry_backoff_s
        self.retire_factor = retire_factor
        self.max_replacements = workers if max_replacements is None else max_replacements
        self._predictor, self._name = predictor, name
        self._models = [PREDICTORS[predictor]() for _ in range(workers)]
        self._telemetry = [WorkerStats(i) for i in range(workers)]
        self._active = list(range(workers))  # workers that take shards; a retired one finishes its write
        self.assignment_log: deque = deque(maxlen=log_size)  # (worker, key, round, nbytes, seconds, kind)
        self._recent: deque = deque(maxlen=256)  # (seconds, nbytes) of recent first copies
        self._deadline_cache: tuple[float, int] | None = None
        self._queues: list[_WorkerQueue] = [_WorkerQueue() for _ in range(workers)]
        self._current: list[tuple[_Task, float] | None] = [None] * workers  # each worker's write in hand
        self._shared: deque[_Task] = deque()
        self._in_flight: set[_Task] = set()
        # Versions of one key (a flushed shard rewritten later) are written in order: a task waits
        # while an older version's copy is still being written, and only the newest is hedged.
        self._writing: dict[str, int] = {}  # key -> copies being written
        self._deferred: dict[str, deque[_Task]] = {}
        self._latest: dict[str, int] = {}  # key -> seq of its newest task not yet finished
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._rr = 0
        self._round = 0
        self._round_lost = False
        self._closing = False
        self._idle = 0  # workers waiting for work
        self._tokens = 0.0
        self._counts = dict.fromkeys(("shards", "bytes", "moves", "steals", "hedges", "hedge_wins", "retries"), 0)
        self._counts.update(duplicate_bytes=0, fallback_rounds=0, replaced=0, dropped=0, timeouts=0)
        self._latencies: list[float] = []
        self._threads: list[threading.Thread] = []
        for i in range(workers):
            self._start_worker(i)
        self._watchdog: threading.Thread | None = None
        if self.io_timeout is not None:
            self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
            self._watchdog.start()

    def _start_worker(self, worker: int) -> None:
        thread = threading.Thread(target=self._work, args=(worker,), name=f"{self._name}-{worker}", daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- the control plane --------------------------------------------------------------------
    def submit(self, writes: Sequence[tuple[str, Sequence]]) -> list[Future]:
        """Queue one batch of ``(key, buffers)`` writes; between batches the planner runs."""
        tasks = []
        with self._cond:
            if self._closing:
                raise RuntimeError("the dispatcher is shut down")
            if self._failure is not None:
                failure = self._failure
                tasks = [_Task(key, (), 0, next(self._seq), self._round) for key, _ in writes]
                for task in tasks:
                    task.done = True
                    task.future.set_exception(_cancelled(task.key, failure))
                return [task.future for task in tasks]
            self._round += 1
            for key, buffers in writes:
                nbytes = sum(memoryview(b).nbytes for b in buffers)
                tasks.append(_Task(key, buffers, nbytes, next(self._seq), self._round))
                self._latest[key] = tasks[-1].seq
                self._tokens += self.hedge_fraction * nbytes
                self._counts["bytes"] += nbytes
            if self.mode == "pull":
                self._shared.extend(tasks)
            elif self.mode == "static" or not self._warm():
                if self.mode == "adaptive":
                    self._counts["fallback_rounds"] += 1
                for task in tasks:
                    self._place(task, self._active[self._rr % len(self._active)])
                    self._rr += 1
            else:
                self._plan(tasks)
            self._cond.notify_all()
        return [task.future for task in tasks]

    def _warm(self) -> bool:
        self._round_lost = self.sink.telemetry_lost(self._round)
        return self._warm_now()

    def _place(self, task: _Task, worker: int) -> None:
        task.owner = worker
        self._queues[worker].push(task)

    def _busy_until(self, worker: int, now: float) -> float:
        """Predicted time at which ``worker`` is through its write in hand (``now`` when idle)."""
        current = self._current[worker]
        if current is None:
            return now
        task, started = current
        expected = started + self._models[worker].predict(task.nbytes)
        # Overran its prediction (a stall): expect it to take as long again.
        return max(now, expected if expected > now else 2 * now - started)

    def _queued_work(self, worker: int) -> float:
        """Predicted seconds of ``worker``'s queue: O(1), from the queue's running totals."""
        queue = self._queues[worker]
        return self._models[worker].predict_many(queue.count, queue.bytes, queue.units)

    def _finish_times(self, now: float) -> list[float]:
        """Predicted time at which each worker is through its in-flight write and its queue
        (O(workers), whatever the backlog)."""
        return [self._busy_until(i, now) + self._queued_work(i) for i in range(len(self._queues))]

    def _plan(self, tasks: list[_Task]) -> None:
        now = time.perf_counter()
        finish = self._finish_times(now)
        for task in sorted(tasks, key=lambda t: -t.nbytes):  # largest first onto the earliest finish
            worker = min(self._active, key=lambda i: finish[i] + self._models[i].predict(task.nbytes))
            finish[worker] += self._models[worker].predict(task.nbytes)
            self._place(task, worker)
        for _ in range(self.max_moves):  # greedy straggler relief over everything still queued
            slowest = max(self._active, key=finish.__getitem__)
            fastest = min(self._active, key=finish.__getitem__)
            queue = self._queues[slowest]
            if slowest == fastest or not queue:
                break
            moved = queue.largest()
            assert moved is not None
            landed = finish[fastest] + self._models[fastest].predict(moved.nbytes)
            if landed >= finish[slowest]:  # the fastest would become the new straggler
                break
            queue.remove(moved)
            finish[slowest] -= self._models[slowest].predict(moved.nbytes)
            finish[fastest] = landed
            self._place(moved, fastest)  # in seq order: oldest first, as a pull queue would write them
            self._counts["moves"] += 1

    # -- the data plane -----------------------------------------------------------------------
    def _next(self, worker: int, now: float) -> tuple[_Task | None, bool, float | None]:
        """(task, is_duplicate, seconds until a hedge may be due) for an idle ``worker``."""
        if self._failure is not None:
            return None, False, None
        if self.mode == "pull":
            return (self._shared.popleft() if self._shared else None), False, None
        if self._queues[worker]:
            return self._queues[worker].pop(), False, None
        if self.mode == "static":
            return None, False, None
        stolen = self._steal(worker, now)
        if stolen is not None:
            return stolen, False, None
        return self._hedge(worker, now)

    def _steal(self, worker: int, now: float) -> _Task | None:
        candidates = [task for i, q in enumerate(self._queues) if i != worker and (task := q.peek()) is not None]
        if not candidates:
            return None
        gated = self._warm_now()
        for task in sorted(candidates, key=lambda t: t.seq):
            owner = task.owner
            assert owner is not None
            if gated:
                mine = now + self._models[worker].predict(task.nbytes)
                # The owner would start it after its current write.
                theirs = self._busy_until(owner, now) + self._models[owner].predict(task.nbytes)
                if mine >= theirs:
                    continue
            self._queues[owner].remove(task)
            task.owner = worker
            self._counts["steals"] += 1
            return task
        return None

    def _warm_now(self) -> bool:
        return not self._round_lost and all(self._models[i].samples >= self.min_worker_samples for i in self._active)

    def _deadline(self, nbytes: int) -> float | None:
        """The hedging deadline of a shard of ``nbytes``: the ``hedge_quantile`` of recent write
        times (larger shards' times scaled to the median size), scaled up for larger shards."""
        if len(self._recent) < self.warmup_samples:
            return None
        if self._deadline_cache is None:
            sizes = sorted(n for _, n in self._recent)
            median = sizes[len(sizes) // 2] or 1
            seconds = sorted(s * median / n if n > median else s for s, n in self._recent)
            self._deadline_cache = (_quantile(seconds, self.hedge_quantile), median)
        quantile, median = self._deadline_cache
        return quantile * max(1.0, nbytes / median)

    def _hedge(self, worker: int, now: float) -> tuple[_Task | None, bool, float | None]:
        best, best_over, wait = None, 0.0, None
        for task in self._in_flight:
            if task.done or task.hedged or worker in task.running or task.started is None:
                continue
            if self._latest.get(task.key) != task.seq:  # a newer version of the key was submitted
                continue
            deadline = self._deadline(task.nbytes)
            if deadline is None:
                return None, False, None
            over = now - task.started - deadline
            if over < 0:
                wait = -over if wait is None else min(wait, -over)
                continue
            if self._tokens < task.nbytes:
                continue
            if self._models[worker].samples and not self._round_lost:
                # Only a worker predicted to land it first helps: the copy in flight is expected
                # to take as long again as it has so far (it overran its deadline).
                (owner,) = task.running
                owner_end = max(task.running[owner] + self._models[owner].predict(task.nbytes), 2 * now - task.started)
                mine = now + self._models[worker].predict(task.nbytes)
                if mine >= owner_end:
                    retry = max(mine - owner_end, 1e-3)  # the owner's estimate grows as it overruns
                    wait = retry if wait is None else min(wait, retry)
                    continue
            if over > best_over or best is None:
                best, best_over = task, over
        if best is None:
            return None, False, wait
        self._tokens -= best.nbytes
        best.hedged = True
        self._counts["hedges"] += 1
        self._counts["duplicate_bytes"] += best.nbytes
        return best, True, None

    def _work(self, worker: int) -> None:
        _local.worker = worker
        while True:
            with self._cond:
                while True:
                    if worker not in self._active and not self._queues[worker] and self.mode == "adaptive":
                        return  # retired: its replacement carries on
                    now = time.perf_counter()
                    task, duplicate, wait = self._next(worker, now)
                    if task is not None and not duplicate and self._writing.get(task.key):
                        self._deferred.setdefault(task.key, deque()).append(task)  # after the older copy
                        continue
                    if task is not None:
                        break
                    if self._closing and not self._startable():
                        return
                    self._idle += 1
                    self._cond.wait(wait if wait is not None else 0.5)
                    self._idle -= 1
                start = time.perf_counter()
                task.running[worker] = start
                self._current[worker] = (task, start)
                self._writing[task.key] = self._writing.get(task.key, 0) + 1
                if self._idle and self.mode == "adaptive":
                    self._cond.notify_all()  # idle workers time their hedging deadline from this start
                if task.started is None:
                    task.started = start
                self._in_flight.add(task)
                round_ = self._round
            error = self._write(worker, task)
            self._finished(worker, task, duplicate, error, start, round_)

    def _queued(self) -> int:
        return len(self._shared) + sum(len(q) for q in self._queues) + sum(len(d) for d in self._deferred.values())

    def _startable(self) -> bool:
        """Whether an idle worker may still get something to write: queued work, or (unless the
        dispatcher failed) a write in flight that it may hedge."""
        return bool(self._queued() or (self._in_flight and self._failure is None))

    def _write(self, worker: int, task: _Task) -> BaseException | None:
        for attempt in range(self.max_retries + 1):
            try:
                self.sink.write(task.key, task.buffers)
                return None
            except TransientStorageError as exc:
                with self._cond:
                    self._telemetry[worker].errors += 1
                    if task.done:  # another copy landed meanwhile: this one gives up
                        return exc
                    if attempt == self.max_retries:
                        return exc
                    self._counts["retries"] += 1
                time.sleep(self.retry_backoff_s * 2**attempt)
            except BaseException as exc:  # noqa: BLE001 - handed to the shard's future
                with self._cond:
                    self._telemetry[worker].errors += 1
                return exc
        return None  # unreachable

    def _finished(self, worker, task: _Task, duplicate: bool, error, start: float, round_: int) -> None:
        end = time.perf_counter()
        seconds = end - start
        resolve = None
        with self._cond:
            del task.running[worker]
            self._current[worker] = None
            self._writing[task.key] -= 1
            if not self._writing[task.key]:
                del self._writing[task.key]
                self._release_deferred(task.key)
            stats = self._telemetry[worker]
            stats.busy_s += seconds
            kind = "duplicate" if duplicate else "write"
            if error is None:
                stats.shards += 1
                stats.bytes += task.nbytes
                stats.duplicates += duplicate
                stats.latencies.append(seconds)
                if not self._round_lost:
                    self._models[worker].observe(task.nbytes, seconds)
                    self._maybe_retire(worker, task.nbytes)
                if not task.done:
                    task.done = True
                    resolve = "result"
                    self._counts["shards"] += 1
                    self._counts["hedge_wins"] += duplicate
                    assert task.started is not None
                    self._latencies.append(end - task.started)
                    if not duplicate:
                        self._recent.append((seconds, task.nbytes))
                        self._deadline_cache = None
                else:
                    kind += " (late)"
            else:
                kind += " (failed)"
                if not task.done and not task.running:  # no other copy may still land
                    task.done = True
                    resolve = "error"
            self.assignment_log.append((worker, task.key, round_, task.nbytes, seconds, kind))
            if not task.running and task.done:
                if self._latest.get(task.key) == task.seq:
                    del self._latest[task.key]
            if not task.running:
                self._in_flight.discard(task)
                task.buffers = ()  # the last copy is done: the shard's memory may go
            self._cond.notify_all()
        if resolve == "result":
            task.future.set_result(None)
        elif resolve == "error":
            task.future.set_exception(error)
            if self.fail_fast:
                self.abort(error)

    @property
    def model_samples(self) -> list[int]:
        """Measurements each worker's predictor has learnt from (none from a lost round)."""
        with self._cond:
            return [model.samples for model in self._models]

    def predict(self, worker: int, nbytes: int) -> float:
        """The predicted seconds of writing ``nbytes`` on ``worker`` (0 while it has no sample)."""
        with self._cond:
            return self._models[worker].predict(nbytes)

    def _release_deferred(self, key: str) -> None:
        """The last copy of ``key`` landed: its next version may go, first in line."""
        waiting = self._deferred.pop(key, None)
        if not waiting:
            return
        task = waiting.popleft()
        if waiting:
            self._deferred[key] = waiting
        if self.mode == "pull":
            self._shared.appendleft(task)
        else:
            owner = task.owner if task.owner in self._active else self._active[0]
            task.owner = owner
            self._queues[owner].push_front(task)

    def _maybe_retire(self, worker: int, nbytes: int) -> None:
        """Replace a worker predicted ``retire_factor`` times slower than the median of the others
        by a fresh one (a new thread, i.e. a new connection): its queue moves to the newcomer."""
        if (
            self.mode != "adaptive"
            or worker not in self._active
            or self._counts["replaced"] >= self.max_replacements
            or len(self._recent) < self.warmup_samples
        ):
            return
        others = sorted(
            self._models[i].predict(nbytes) for i in self._active if i != worker and self._models[i].samples
        )
        latencies = self._telemetry[worker].latencies  # the last few, without copying all 1024
        recent = list(itertools.islice(reversed(latencies), self.min_worker_samples))
        if (
            not others
            or len(recent) < self.min_worker_samples
            or self._models[worker].predict(nbytes) < self.retire_factor * others[len(others) // 2]
            or min(recent) < self.retire_factor * others[len(others) // 2]  # one unlucky write is not enough
        ):
            return
        fresh = len(self._models)
        self._models.append(PREDICTORS[self._predictor]())
        self._telemetry.append(WorkerStats(fresh))
        self._queues.append(_WorkerQueue())
        self._current.append(None)
        self._active[self._active.index(worker)] = fresh
        self._telemetry[worker].retired = True
        queued = self._queues[worker].take_all()
        for task in queued:
            self._place(task, fresh)
        self._counts["moves"] += len(queued)
        self._counts["replaced"] += 1
        self._start_worker(fresh)

    # -- liveness -----------------------------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the dispatcher (None while it works)."""
        return self._failure

    def abort(self, reason: BaseException) -> None:
        """Stop writing: every queued write is dropped (its future fails with
        :class:`WriteCancelledError` naming ``reason``), nothing more starts, and the sink is asked
        to cut off the writes in flight (:meth:`Sink.cancel`).  Idempotent: the first reason stays."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = reason
            dropped = list(self._shared) + [task for queue in self._queues for task in queue.take_all()]
            dropped += [task for waiting in self._deferred.values() for task in waiting]
            self._shared.clear()
            self._deferred.clear()
            for task in dropped:
                task.done = True
                task.buffers = ()
                if self._latest.get(task.key) == task.seq:
                    del self._latest[task.key]
            self._counts["dropped"] += len(dropped)
            in_flight = sum(1 for task in self._in_flight if task.running)
            self._cond.notify_all()
        if dropped or in_flight:
            log.info(
                "%s: storage failed (%s): %d queued shard writes dropped, %d in flight cut off",
                self.sink.location,
                reason,
                len(dropped),
                in_flight,
            )
        for task in dropped:
            task.future.set_exception(_cancelled(task.key, reason))
        try:
            self.sink.cancel()
        except Exception as exc:  # noqa: BLE001 - best effort: the first error is what matters
            log.warning("%s: cancelling the writes in flight failed: %s", self.sink.location, exc)

    def describe(self) -> str:
        """What the dispatcher holds now, for messages about a stalled pipeline."""
        with self._cond:
            queued = self._queued()
            now = time.perf_counter()
            running = [(now - min(task.running.values()), task.key) for task in self._in_flight if task.running]
        text = f"{queued} shard writes queued, {len(running)} in flight"
        if running:
            age, key = max(running)
            text += f" (the oldest, {key!r}, for {age:.1f} s)"
        return text

    def idle(self) -> bool:
        """Nothing queued and nothing in flight (late hedged copies aside)."""
        with self._cond:
            return not self._queued() and not any(not task.done for task in self._in_flight)

    def _watch(self) -> None:
        """The I/O deadline: a write in flight for longer than ``io_timeout`` fails its shard with
        :class:`StorageTimeoutError` and stops the dispatcher (a stuck copy is left on its thread)."""
        assert self.io_timeout is not None
        interval = min(0.5, self.io_timeout / 4)
        while True:
            with self._cond:
                if self._closing and (self._failure is not None or not self._in_flight and not self._queued()):
                    return
                self._cond.wait(interval)
                now = time.perf_counter()
                late = [
                    task
                    for task in self._in_flight
                    if not task.done
                    and task.running
                    and now - min(task.running.values()) > write_deadline(self.io_timeout, task.nbytes)
                ]
                for task in late:
                    task.done = True
                    self._counts["timeouts"] += 1
            if not late:
                continue
            errors = []
            for task in late:
                where = (f"worker {w}" for w in task.running)
                deadline = write_deadline(self.io_timeout, task.nbytes)
                error = StorageTimeoutError(
                    f"writing {task.key!r} ({task.nbytes} bytes) to {self.sink.location} got no answer within "
                    f"{deadline:.3g} s (io_timeout={self.io_timeout:g} s + 1 s per MB; {', '.join(where)}): "
                    "the storage is frozen or unreachable"
                )
                errors.append(error)
                task.future.set_exception(error)
            self.abort(errors[0])

    # -- life cycle ---------------------------------------------------------------------------
    def shutdown(self, wait: bool = True, timeout: float | None = None) -> list[str]:
        """Write everything queued (hedged copies in flight finish too), then stop the workers.

        With ``timeout`` (seconds) it waits at most that long: then it aborts (drops what is
        queued, cuts off what the sink can cancel), waits briefly for the cut-off writes and
        abandons whatever is still stuck on its daemon thread.  Returns the keys of the writes
        abandoned in flight (empty when every worker ended)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if not wait:
            return []
        if not self._join(timeout):
            self.abort(WriteCancelledError(f"shut down with writes still running after {timeout:g} s"))
            self._join(_CANCEL_GRACE_S)
        if self._watchdog is not None:
            self._watchdog.join(_CANCEL_GRACE_S)
        with self._cond:
            return sorted({task.key for task in self._in_flight if task.running})

    def _join(self, timeout: float | None) -> bool:
        """Join every worker (a replacement may start while draining); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        joined = 0
        while joined < len(self._threads):
            thread = self._threads[joined]
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                return False
            joined += 1
        return True

    def stats(self) -> DispatchStats:
        with self._cond:
            counts = dict(self._counts)
            return DispatchStats(
                mode=self.mode,
                workers=[w.as_dict() for w in self._telemetry],
                shards=counts["shards"],
                bytes=counts["bytes"],
                moves=counts["moves"],
                steals=counts["steals"],
                hedges=counts["hedges"],
                hedge_wins=counts["hedge_wins"],
                duplicate_bytes=counts["duplicate_bytes"],
                retries=counts["retries"],
                rounds=self._round,
                fallback_rounds=counts["fallback_rounds"],
                replaced=counts["replaced"],
                latencies_s=list(self._latencies),
                dropped=counts["dropped"],
                timeouts=counts["timeouts"],
            )
