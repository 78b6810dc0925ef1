"""The dispatcher's core: workers, tasks, futures, retries, version order, liveness, telemetry.

:class:`Dispatcher` runs the worker threads and owns everything the three modes share: a
:class:`~.queues.Task` and its future per write, retries of
:class:`~napari_tileshard.storage.errors.TransientStorageError`, the order of versions of one key,
fail-fast :meth:`~Dispatcher.abort`, the ``io_timeout`` watchdog, :meth:`~Dispatcher.shutdown`,
the per-worker telemetry and predictors (the data plane).  Where a batch goes and what an idle
worker takes next is its strategy's (:mod:`.strategies`, chosen by ``mode``).  The package's
docstring (:mod:`napari_tileshard.engine.dispatch`) describes the modes and the guarantees.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ...storage.errors import StorageTimeoutError, TransientStorageError, WriteCancelledError
from ...storage.sinks import Sink, write_deadline
from .models import PREDICTORS
from .queues import Task
from .state import DispatchState
from .stats import DispatchStats
from .strategies import STRATEGIES, PlannerOptions

__all__ = ["MODES", "Dispatcher", "current_worker"]

log = logging.getLogger(__name__)

#: the dispatch modes, each a strategy of :data:`~.strategies.STRATEGIES`
MODES = tuple(STRATEGIES)

_local = threading.local()

#: seconds a shut-down dispatcher waits for writes it cut off (an object store's cancelled
#: requests end at once; a write no sink can cut off is abandoned after it)
_CANCEL_GRACE_S = 2.0


def current_worker() -> int | None:
    """The index of the dispatcher worker running the calling thread (None elsewhere): the seam
    through which a test sink (:class:`napari_tileshard.testing.FaultInjectingSink`) makes one
    worker slow."""
    return getattr(_local, "worker", None)


def _cancelled(key: str, reason: BaseException) -> WriteCancelledError:
    return WriteCancelledError(f"{key!r} was not written: the recording had already failed ({reason})")


class Dispatcher:
    """Writes shards to ``sink`` on ``workers`` threads; :meth:`submit` returns one Future each.

    ``mode`` picks the strategy (``"static"``, ``"pull"``, ``"adaptive"``); the keywords from
    ``hedge_fraction`` to ``max_replacements`` and ``telemetry_lost`` are the adaptive planner's
    (:class:`~.strategies.PlannerOptions`).  ``telemetry_lost(round_index) -> bool`` is the
    fault-injection seam of lost telemetry (e.g.
    :meth:`napari_tileshard.testing.FaultInjectingSink.telemetry_lost`): a batch for which it
    returns True is placed statically and its writes teach the predictors nothing.
    """

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
        telemetry_lost: Callable[[int], bool] | None = None,
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
        if telemetry_lost is not None and not callable(telemetry_lost):
            raise TypeError(f"telemetry_lost must be a callable (round_index -> bool) or None, got {telemetry_lost!r}")
        self.io_timeout = None if io_timeout is None else float(io_timeout)
        self.fail_fast = fail_fast
        self._failure: BaseException | None = None  # set by abort(): nothing more starts
        self.sink, self.mode, self.n = sink, mode, workers
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.options = PlannerOptions(
            hedge_fraction=hedge_fraction,
            hedge_quantile=hedge_quantile,
            warmup_samples=warmup_samples,
            min_worker_samples=min_worker_samples,
            max_moves=max_moves,
            retire_factor=retire_factor,
            max_replacements=workers if max_replacements is None else max_replacements,
            telemetry_lost=telemetry_lost,
        )
        self._name = name
        state = DispatchState(workers, predictor, self._start_worker)
        self._strategy = STRATEGIES[mode](state, self.options)
        # The state's containers are never rebound: the core keeps them at hand.
        self._models, self._telemetry, self._current = state.models, state.telemetry, state.current
        self._active, self._in_flight = state.active, state.in_flight
        self._latest, self._counts = state.latest, state.counts
        self.assignment_log: deque = deque(maxlen=log_size)  # (worker, key, round, nbytes, seconds, kind)
        # Versions of one key (a flushed shard rewritten later) are written in order: a task waits
        # while an older version's copy is still being written, and only the newest is hedged.
        self._writing: dict[str, int] = {}  # key -> copies being written
        self._deferred: dict[str, deque[Task]] = {}
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The watchdog waits on its own condition over the same lock: woken only when it may have
        # to stop (closing, a failure, the last write in flight done while closing), not by every
        # queued, started or finished write as the workers are (2-3 wake-ups per shard for nothing).
        self._watchdog_wake = threading.Condition(lock)
        self._seq = itertools.count()
        self._round = 0
        self._closing = False
        self._idle = 0  # workers waiting for work
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
    def submit(self, writes: Sequence[tuple[str, Sequence]], sizes: Sequence[int] | None = None) -> list[Future]:
        """Queue one batch of ``(key, buffers)`` writes; the strategy places it.  ``sizes``: the
        bytes of each write where the caller knows them (else counted here, a buffer at a time)."""
        tasks = []
        with self._cond:
            if self._closing:
                raise RuntimeError("the dispatcher is shut down")
            if self._failure is not None:
                failure = self._failure
                tasks = [Task(key, (), 0, next(self._seq), self._round) for key, _ in writes]
                for task in tasks:
                    task.done = True
                    task.future.set_exception(_cancelled(task.key, failure))
                return [task.future for task in tasks]
            self._round += 1
            for i, (key, buffers) in enumerate(writes):
                nbytes = sum(memoryview(b).nbytes for b in buffers) if sizes is None else sizes[i]
                tasks.append(Task(key, buffers, nbytes, next(self._seq), self._round))
                self._latest[key] = tasks[-1].seq
                self._counts["bytes"] += nbytes
            self._strategy.place(tasks, self._round)
            self._cond.notify_all()
        return [task.future for task in tasks]

    # -- the data plane -----------------------------------------------------------------------
    def _work(self, worker: int) -> None:
        _local.worker = worker
        strategy = self._strategy
        while True:
            with self._cond:
                while True:
                    if worker not in self._active and not strategy.queued_for(worker):
                        return  # retired: its replacement carries on
                    now = time.perf_counter()
                    if self._failure is None:
                        task, duplicate, wait = strategy.next(worker, now)
                    else:  # aborted: nothing more starts
                        task, duplicate, wait = None, False, None
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
                if self._idle and strategy.wakes_idle_on_start:
                    self._cond.notify_all()  # idle workers time their hedging deadline from this start
                if task.started is None:
                    task.started = start
                self._in_flight.add(task)
                round_ = self._round
            error = self._write(worker, task)
            self._finished(worker, task, duplicate, error, start, round_)

    def _queued(self) -> int:
        return self._strategy.queued() + sum(len(d) for d in self._deferred.values())

    def _startable(self) -> bool:
        """Whether an idle worker may still get something to write: queued work, or (unless the
        dispatcher failed) a write in flight that it may hedge."""
        return bool(self._queued() or (self._in_flight and self._failure is None))

    def _write(self, worker: int, task: Task) -> BaseException | None:
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

    def _finished(self, worker, task: Task, duplicate: bool, error, start: float, round_: int) -> None:
        end = time.perf_counter()
        seconds = end - start
        resolve = None
        strategy = self._strategy
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
                if not strategy.round_lost:
                    self._models[worker].observe(task.nbytes, seconds)
                    strategy.learned(worker, task.nbytes)
                if not task.done:
                    task.done = True
                    resolve = "result"
                    self._counts["shards"] += 1
                    self._counts["hedge_wins"] += duplicate
                    assert task.started is not None
                    self._latencies.append(end - task.started)
                    if not duplicate:
                        strategy.landed(seconds, task.nbytes)
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
            if self._closing:
                self._watchdog_wake.notify_all()
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
        self._strategy.requeue_first(task)

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
            dropped = self._strategy.take_all()
            dropped += [task for waiting in self._deferred.values() for task in waiting]
            self._deferred.clear()
            for task in dropped:
                task.done = True
                task.buffers = ()
                if self._latest.get(task.key) == task.seq:
                    del self._latest[task.key]
            self._counts["dropped"] += len(dropped)
            in_flight = sum(1 for task in self._in_flight if task.running)
            self._cond.notify_all()
            self._watchdog_wake.notify_all()
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
                self._watchdog_wake.wait(interval)
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
            self._watchdog_wake.notify_all()
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
