"""What the dispatcher's core and its strategy share (:class:`DispatchState`)."""

from __future__ import annotations

from collections.abc import Callable

from .models import PREDICTORS, Predictor
from .queues import Task
from .stats import COUNTERS, WorkerStats

__all__ = ["DispatchState"]


class DispatchState:
    """The workers and the shard writes as both the core and its strategy see them.

    Read and changed only under the dispatcher's lock.  The containers are shared by reference and
    never rebound (a replacement worker is appended), so either side may keep them in attributes.

    * per worker (index = worker number, retired ones included): ``models`` (its predictor),
      ``telemetry`` (:class:`WorkerStats`), ``current`` (its write in hand and when it started);
    * ``active``: the workers that take shards (a retired worker finishes its write in hand);
    * ``in_flight``: tasks with a copy being written (late hedged copies included);
    * ``latest``: key -> ``seq`` of its newest task not yet finished (only that version is hedged);
    * ``counts``: the counters of :class:`DispatchStats` (:data:`COUNTERS`).
    """

    def __init__(self, workers: int, predictor: str, start_worker: Callable[[int], None]):
        self.predictor = predictor
        self.models: list[Predictor] = [PREDICTORS[predictor]() for _ in range(workers)]
        self.telemetry = [WorkerStats(i) for i in range(workers)]
        self.current: list[tuple[Task, float] | None] = [None] * workers
        self.active = list(range(workers))
        self.in_flight: set[Task] = set()
        self.latest: dict[str, int] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._start_worker = start_worker

    def add_worker(self) -> int:
        """A fresh worker's slots (predictor, telemetry, nothing in hand); its number.  Not active
        and not started yet: the caller gives it its place, then :meth:`start_worker`."""
        fresh = len(self.models)
        self.models.append(PREDICTORS[self.predictor]())
        self.telemetry.append(WorkerStats(fresh))
        self.current.append(None)
        return fresh

    def start_worker(self, worker: int) -> None:
        """Start ``worker``'s thread (it waits for the dispatcher's lock, held by the caller)."""
        self._start_worker(worker)
