"""What differs per dispatch mode: one strategy object each, chosen by ``Dispatcher(mode=...)``.

* :class:`StaticPlacement` (``"static"``): round-robin into per-worker queues; nothing moves.
* :class:`SharedQueue` (``"pull"``): one shared FIFO; an idle worker takes the next shard.
* :class:`AdaptivePlanner` (``"adaptive"``): per-worker queues placed by predicted finish time,
  straggler relief, gated steals, hedged copies, retirement of a far slower worker, and the static
  fallback while the predictors are cold or the telemetry of a round is lost.

A strategy decides only *where* a write goes and *what* an idle worker takes next.  Everything
else (threads, futures, retries, the order of versions of one key, fail-fast abort, the I/O
watchdog, shutdown, telemetry) is the core's (:mod:`.core`), which calls a strategy only under its
lock, so a strategy never locks.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .queues import Task, WorkerQueue
from .state import DispatchState
from .stats import quantile

__all__ = ["STRATEGIES", "AdaptivePlanner", "PlannerOptions", "SharedQueue", "StaticPlacement", "Strategy"]


@dataclass(frozen=True)
class PlannerOptions:
    """The adaptive planner's settings (``Dispatcher`` keywords of the same names; the static and
    pull strategies have none)."""

    hedge_fraction: float = 0.05  # duplicate bytes earned per submitted byte (the token bucket)
    hedge_quantile: float = 0.95  # of recent write times: past it, a write in flight is hedged
    warmup_samples: int = 16  # first-copy writes measured before hedging or retiring starts
    min_worker_samples: int = 2  # measurements of every active worker before batches are planned
    max_moves: int = 64  # straggler-relief moves per batch
    retire_factor: float = 4.0  # this many times slower than the median of the others: retired
    max_replacements: int = 0  # workers retired and replaced at most
    #: the fault-injection seam: whether the measurements of batch ``round_index`` are lost
    telemetry_lost: Callable[[int], bool] | None = None


class Strategy(ABC):
    """Where a submitted batch goes and what an idle worker takes next (called under the core's lock)."""

    #: the measurements of the latest batch are lost: the predictors learn nothing until the next one
    round_lost = False
    #: idle workers are woken whenever a write starts (hedging deadlines are timed from starts)
    wakes_idle_on_start = False

    def __init__(self, state: DispatchState, options: PlannerOptions):
        self.state = state

    @abstractmethod
    def place(self, tasks: list[Task], round_index: int) -> None:
        """Queue the batch ``tasks`` (batch number ``round_index``, from 1)."""

    @abstractmethod
    def next(self, worker: int, now: float) -> tuple[Task | None, bool, float | None]:
        """(task, is a hedged duplicate, seconds until a hedge may be due) for the idle ``worker``;
        the task is no longer queued."""

    @abstractmethod
    def requeue_first(self, task: Task) -> None:
        """Queue ``task`` (a deferred version whose older copies all landed) first in line."""

    @abstractmethod
    def take_all(self) -> list[Task]:
        """Empty every queue (the dispatcher aborts): the tasks, in the order they would have gone."""

    @abstractmethod
    def queued(self) -> int:
        """Tasks queued."""

    def queued_for(self, worker: int) -> int:
        """Tasks queued for ``worker`` alone (a retired worker ends once it has none)."""
        return 0

    def learned(self, worker: int, nbytes: int) -> None:
        """``worker``'s predictor just learnt from a write of ``nbytes``."""

    def landed(self, seconds: float, nbytes: int) -> None:
        """The first copy of a shard of ``nbytes`` landed after ``seconds`` (not a hedged copy)."""


class SharedQueue(Strategy):
    """``"pull"``: one shared FIFO; an idle worker takes the next shard (a thread pool)."""

    def __init__(self, state: DispatchState, options: PlannerOptions):
        super().__init__(state, options)
        self._fifo: deque[Task] = deque()

    def place(self, tasks: list[Task], round_index: int) -> None:
        self._fifo.extend(tasks)

    def next(self, worker: int, now: float) -> tuple[Task | None, bool, float | None]:
        return (self._fifo.popleft() if self._fifo else None), False, None

    def requeue_first(self, task: Task) -> None:
        self._fifo.appendleft(task)

    def take_all(self) -> list[Task]:
        tasks = list(self._fifo)
        self._fifo.clear()
        return tasks

    def queued(self) -> int:
        return len(self._fifo)


class StaticPlacement(Strategy):
    """``"static"``: round-robin placement into per-worker queues; nothing moves (the baseline)."""

    def __init__(self, state: DispatchState, options: PlannerOptions):
        super().__init__(state, options)
        self.queues = [WorkerQueue() for _ in state.models]  # one per worker, retired ones included
        self._rr = 0

    def place(self, tasks: list[Task], round_index: int) -> None:
        self._round_robin(tasks)

    def _round_robin(self, tasks: list[Task]) -> None:
        active = self.state.active
        for task in tasks:
            self._place(task, active[self._rr % len(active)])
            self._rr += 1

    def _place(self, task: Task, worker: int) -> None:
        task.owner = worker
        self.queues[worker].push(task)

    def next(self, worker: int, now: float) -> tuple[Task | None, bool, float | None]:
        queue = self.queues[worker]
        return (queue.pop() if queue else None), False, None

    def requeue_first(self, task: Task) -> None:
        active = self.state.active
        owner = task.owner if task.owner in active else active[0]
        task.owner = owner
        self.queues[owner].push_front(task)

    def take_all(self) -> list[Task]:
        return [task for queue in self.queues for task in queue.take_all()]

    def queued(self) -> int:
        return sum(len(queue) for queue in self.queues)

    def queued_for(self, worker: int) -> int:
        return len(self.queues[worker])


class AdaptivePlanner(StaticPlacement):
    """``"adaptive"``: placement by predicted finish time, relief, steals, hedges and retirement.

    Placed statically (round-robin, :class:`StaticPlacement`) while any active worker has fewer
    than ``min_worker_samples`` measurements or the round's telemetry is lost; otherwise each
    batch is planned (:meth:`_plan`).  An idle worker with an empty queue steals, then hedges.
    """

    wakes_idle_on_start = True

    def __init__(self, state: DispatchState, options: PlannerOptions):
        super().__init__(state, options)
        self.options = options
        self.tokens = 0.0  # bytes of hedged copies that may still be written (the token bucket)
        self._recent: deque[tuple[float, int]] = deque(maxlen=256)  # (seconds, nbytes) of recent first copies
        self._deadline_cache: tuple[float, int] | None = None

    def place(self, tasks: list[Task], round_index: int) -> None:
        for task in tasks:
            self.tokens += self.options.hedge_fraction * task.nbytes
        lost = self.options.telemetry_lost
        self.round_lost = bool(lost(round_index)) if lost is not None else False
        if self._warm():
            self._plan(tasks)
        else:
            self.state.counts["fallback_rounds"] += 1
            self._round_robin(tasks)

    def _warm(self) -> bool:
        models, least = self.state.models, self.options.min_worker_samples
        return not self.round_lost and all(models[i].samples >= least for i in self.state.active)

    def _busy_until(self, worker: int, now: float) -> float:
        """Predicted time at which ``worker`` is through its write in hand (``now`` when idle)."""
        current = self.state.current[worker]
        if current is None:
            return now
        task, started = current
        expected = started + self.state.models[worker].predict(task.nbytes)
        # Overran its prediction (a stall): expect it to take as long again.
        return max(now, expected if expected > now else 2 * now - started)

    def _queued_work(self, worker: int) -> float:
        """Predicted seconds of ``worker``'s queue: O(1), from the queue's running totals."""
        queue = self.queues[worker]
        return self.state.models[worker].predict_many(queue.count, queue.bytes, queue.units)

    def _finish_times(self, now: float) -> list[float]:
        """Predicted time at which each worker is through its in-flight write and its queue
        (O(workers), whatever the backlog)."""
        return [self._busy_until(i, now) + self._queued_work(i) for i in range(len(self.queues))]

    def _plan(self, tasks: list[Task]) -> None:
        """New shards largest first onto the worker predicted to finish them first, then greedy
        straggler relief over everything queued (shards in flight are never touched)."""
        models, active, counts = self.state.models, self.state.active, self.state.counts
        now = time.perf_counter()
        finish = self._finish_times(now)
        for task in sorted(tasks, key=lambda t: -t.nbytes):  # largest first onto the earliest finish
            worker = min(active, key=lambda i: finish[i] + models[i].predict(task.nbytes))
            finish[worker] += models[worker].predict(task.nbytes)
            self._place(task, worker)
        for _ in range(self.options.max_moves):
            slowest = max(active, key=finish.__getitem__)
            fastest = min(active, key=finish.__getitem__)
            queue = self.queues[slowest]
            if slowest == fastest or not queue:
                break
            moved = queue.largest()
            assert moved is not None
            landed = finish[fastest] + models[fastest].predict(moved.nbytes)
            if landed >= finish[slowest]:  # the fastest would become the new straggler
                break
            queue.remove(moved)
            finish[slowest] -= models[slowest].predict(moved.nbytes)
            finish[fastest] = landed
            self._place(moved, fastest)  # in seq order: oldest first, as a pull queue would write them
            counts["moves"] += 1

    def next(self, worker: int, now: float) -> tuple[Task | None, bool, float | None]:
        if self.queues[worker]:
            return self.queues[worker].pop(), False, None
        stolen = self._steal(worker, now)
        if stolen is not None:
            return stolen, False, None
        return self._hedge(worker, now)

    def _steal(self, worker: int, now: float) -> Task | None:
        """The oldest queued shard of another worker, if ``worker`` is predicted to land it
        earlier than its owner would (any, while the predictors are cold)."""
        candidates = [task for i, q in enumerate(self.queues) if i != worker and (task := q.peek()) is not None]
        if not candidates:
            return None
        models = self.state.models
        gated = self._warm()
        for task in sorted(candidates, key=lambda t: t.seq):
            owner = task.owner
            assert owner is not None
            if gated:
                mine = now + models[worker].predict(task.nbytes)
                # The owner would start it after its current write.
                theirs = self._busy_until(owner, now) + models[owner].predict(task.nbytes)
                if mine >= theirs:
                    continue
            self.queues[owner].remove(task)
            task.owner = worker
            self.state.counts["steals"] += 1
            return task
        return None

    def _deadline(self, nbytes: int) -> float | None:
        """The hedging deadline of a shard of ``nbytes``: the ``hedge_quantile`` of recent write
        times (larger shards' times scaled to the median size), scaled up for larger shards."""
        if len(self._recent) < self.options.warmup_samples:
            return None
        if self._deadline_cache is None:
            sizes = sorted(n for _, n in self._recent)
            median = sizes[len(sizes) // 2] or 1
            seconds = sorted(s * median / n if n > median else s for s, n in self._recent)
            self._deadline_cache = (quantile(seconds, self.options.hedge_quantile), median)
        q, median = self._deadline_cache
        return q * max(1.0, nbytes / median)

    def _hedge(self, worker: int, now: float) -> tuple[Task | None, bool, float | None]:
        """The write in flight longest past its deadline, as a duplicate for ``worker`` (paid from
        the token bucket), or the seconds until one may be due."""
        state = self.state
        models, latest = state.models, state.latest
        best, best_over, wait = None, 0.0, None
        for task in state.in_flight:
            if task.done or task.hedged or worker in task.running or task.started is None:
                continue
            if latest.get(task.key) != task.seq:  # a newer version of the key was submitted
                continue
            deadline = self._deadline(task.nbytes)
            if deadline is None:
                return None, False, None
            over = now - task.started - deadline
            if over < 0:
                wait = -over if wait is None else min(wait, -over)
                continue
            if self.tokens < task.nbytes:
                continue
            if models[worker].samples and not self.round_lost:
                # Only a worker predicted to land it first helps: the copy in flight is expected
                # to take as long again as it has so far (it overran its deadline).
                (owner,) = task.running
                owner_end = max(task.running[owner] + models[owner].predict(task.nbytes), 2 * now - task.started)
                mine = now + models[worker].predict(task.nbytes)
                if mine >= owner_end:
                    retry = max(mine - owner_end, 1e-3)  # the owner's estimate grows as it overruns
                    wait = retry if wait is None else min(wait, retry)
                    continue
            if over > best_over or best is None:
                best, best_over = task, over
        if best is None:
            return None, False, wait
        self.tokens -= best.nbytes
        best.hedged = True
        state.counts["hedges"] += 1
        state.counts["duplicate_bytes"] += best.nbytes
        return best, True, None

    def landed(self, seconds: float, nbytes: int) -> None:
        self._recent.append((seconds, nbytes))
        self._deadline_cache = None

    def learned(self, worker: int, nbytes: int) -> None:
        """Replace ``worker`` if it is predicted ``retire_factor`` times slower than the median of
        the others by a fresh one (a new thread, i.e. a new connection): its queue moves to the newcomer."""
        state, options = self.state, self.options
        models, active, counts = state.models, state.active, state.counts
        if (
            worker not in active
            or counts["replaced"] >= options.max_replacements
            or len(self._recent) < options.warmup_samples
        ):
            return
        others = sorted(models[i].predict(nbytes) for i in active if i != worker and models[i].samples)
        latencies = state.telemetry[worker].latencies  # the last few, without copying all 1024
        recent = list(itertools.islice(reversed(latencies), options.min_worker_samples))
        if (
            not others
            or len(recent) < options.min_worker_samples
            or models[worker].predict(nbytes) < options.retire_factor * others[len(others) // 2]
            or min(recent) < options.retire_factor * others[len(others) // 2]  # one unlucky write is not enough
        ):
            return
        fresh = state.add_worker()
        self.queues.append(WorkerQueue())
        active[active.index(worker)] = fresh
        state.telemetry[worker].retired = True
        queued = self.queues[worker].take_all()
        for task in queued:
            self._place(task, fresh)
        counts["moves"] += len(queued)
        counts["replaced"] += 1
        state.start_worker(fresh)


#: the strategy of each ``mode`` (the order is that of :data:`MODES`)
STRATEGIES: dict[str, type[Strategy]] = {"static": StaticPlacement, "pull": SharedQueue, "adaptive": AdaptivePlanner}
