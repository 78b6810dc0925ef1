"""A shard write in the dispatcher (:class:`Task`) and one worker's queue of them (:class:`WorkerQueue`)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from concurrent.futures import Future

__all__ = ["Task", "WorkerQueue"]


class Task:
    """One shard write: its bytes, its future, and where it is (queued, in flight on which workers)."""

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
        self.queue: WorkerQueue | None = None  # the queue holding it
        self.stamp = 0  # which of its entries in that queue's heaps is live (one per push)


class WorkerQueue:
    """One worker's queued tasks, oldest (lowest ``seq``) first, without scans or re-sorts.

    Two heaps of entries: by ``seq`` (the order a worker takes them) and by size, largest first
    (what straggler relief moves), plus a front lane for a deferred version released to go first
    in line.  A task taken out of the middle (moved, stolen) is only marked: its entries die
    (``task.queue``/``task.stamp`` no longer match) and are dropped when they reach a heap's top,
    or when dead entries outnumber live ones (the heaps are rebuilt: amortised O(1) per removal).
    Running totals of the tasks' sizes give a worker's predicted queued work in O(1)
    (:meth:`.models.RateModel.predict_many`).  Every operation is O(log queued) at most.
    """

    __slots__ = ("_by_seq", "_by_size", "_front", "_stamps", "count", "bytes", "units")

    def __init__(self):
        self._by_seq: list[tuple[int, int, Task]] = []  # (seq, stamp, task)
        self._by_size: list[tuple[int, int, int, Task]] = []  # (-nbytes, seq, stamp, task)
        self._front: deque[tuple[int, Task]] = deque()  # (stamp, task), first in line
        self._stamps = itertools.count(1)
        self.count = 0  # live tasks
        self.bytes = 0  # their nbytes
        self.units = 0  # their max(nbytes, 1): what the rate model multiplies

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def _live(self, task: Task, stamp: int) -> bool:
        return task.queue is self and task.stamp == stamp

    def _add(self, task: Task) -> int:
        assert task.queue is None, "a task is in one queue at a time"
        task.queue, task.stamp = self, next(self._stamps)
        self.count += 1
        self.bytes += task.nbytes
        self.units += max(task.nbytes, 1)
        heapq.heappush(self._by_size, (-task.nbytes, task.seq, task.stamp, task))
        return task.stamp

    def push(self, task: Task) -> None:
        """Queue ``task`` in ``seq`` order."""
        stamp = self._add(task)
        heapq.heappush(self._by_seq, (task.seq, stamp, task))

    def push_front(self, task: Task) -> None:
        """Queue ``task`` first in line (before every other queued task)."""
        self._front.appendleft((self._add(task), task))

    def remove(self, task: Task) -> None:
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

    def peek(self) -> Task | None:
        """The task this queue's worker takes next (None when empty)."""
        front, by_seq = self._front, self._by_seq
        while front and not self._live(front[0][1], front[0][0]):
            front.popleft()
        if front:
            return front[0][1]
        while by_seq and not self._live(by_seq[0][2], by_seq[0][1]):
            heapq.heappop(by_seq)
        return by_seq[0][2] if by_seq else None

    def pop(self) -> Task | None:
        """Take the next task (None when empty)."""
        task = self.peek()
        if task is not None:
            self.remove(task)
        return task

    def largest(self) -> Task | None:
        """The largest queued task (the oldest of equal ones), None when empty."""
        by_size = self._by_size
        while by_size and not self._live(by_size[0][3], by_size[0][2]):
            heapq.heappop(by_size)
        return by_size[0][3] if by_size else None

    def take_all(self) -> list[Task]:
        """Empty the queue: its tasks in the order its worker would have taken them."""
        tasks = []
        while (task := self.pop()) is not None:
            tasks.append(task)
        return tasks
