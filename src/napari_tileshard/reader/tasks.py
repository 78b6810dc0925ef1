"""The CPU read path's decode threads: tasks handed over with no Future of their own.

A whole-array read on 16 cores is bound by the GIL (its threads held it ~0.7 of the read's time,
py-spy ``--gil``), and ``ThreadPoolExecutor.submit`` was an eighth of that: per task a Future, a
work item, two locks to submit, a semaphore to decide whether to start a thread, and on the worker
a lock to mark it running, one to set its result and one to count itself idle, each a point where
the GIL may change hands (~15 us of Python per task on the 2-core VM against ~1.6 for a queue's put
and get).  A block's task reports its own end (``_BlockTask.done``), so :meth:`TaskPool.post` only
queues the call; :meth:`TaskPool.submit` is the executor's for the callers that want a Future.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from queue import SimpleQueue

__all__ = ["TaskPool", "pin_to"]

log = logging.getLogger(__name__)


class TaskPool:
    """``threads`` daemon threads (started at the first task) running queued calls in order.

    :meth:`shutdown` lets the calls queued before it run, then stops the threads; a pool
    dropped without it stops them when it is collected.  Calls posted after it raise
    RuntimeError, as ``ThreadPoolExecutor`` does.  ``cpus``: thread ``i`` runs on CPU
    ``cpus[i]`` alone (:func:`pin_to`); the threads beyond them where the scheduler puts them
    (so that one may take a CPU whose thread waits, e.g. for the disk)."""

    def __init__(self, threads: int, name: str, cpus: Sequence[int] = ()):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        self.threads, self.name = threads, name
        self.cpus = tuple(cpus)
        self._queue: SimpleQueue = SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        weakref.finalize(self, _stop, self._queue, self._workers)

    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on a pool thread; what it raises is its own to report."""
        if self._closed:
            raise RuntimeError(f"{self.name}: cannot run tasks after shutdown")
        if not self._workers:
            self._start()
        self._queue.put((fn, args))

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on a pool thread: its Future (cancelled: not run)."""
        future: Future = Future()
        self.post(_run, future, fn, args)
        return future

    def _start(self) -> None:
        with self._lock:
            if self._workers or self._closed:
                return
            for i in range(self.threads):
                cpu = self.cpus[i] if i < len(self.cpus) else None
                worker = threading.Thread(target=_work, args=(self._queue, cpu), name=f"{self.name}_{i}", daemon=True)
                worker.start()
                self._workers.append(worker)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        _stop(self._queue, self._workers)
        if wait:
            for worker in self._workers:
                if worker is not threading.current_thread():
                    worker.join()


def pin_to(cpu: int) -> bool:
    """Run the calling thread on ``cpu`` alone; whether it could (not where the platform has no
    ``os.sched_setaffinity``, macOS and Windows, or the CPU is not the process's to use)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, {cpu})  # pid 0: the calling thread, not the whole process
    except OSError:
        return False
    return True


def _work(queue: SimpleQueue, cpu: int | None = None) -> None:
    """A pool thread: calls until the stop sentinel (None).  It holds the queue, not the pool,
    so that a pool no one refers to is collected and stops its threads."""
    if cpu is not None:
        pin_to(cpu)
    while True:
        item = queue.get()
        if item is None:
            return
        fn, args = item
        del item
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - a task reports its own failures; this one did not
            log.exception("a task of %s failed", threading.current_thread().name)
        del fn, args  # nothing of a finished task kept alive while waiting for the next one


def _run(future: Future, fn, args) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the Future
        future.set_exception(exc)
    else:
        future.set_result(result)


def _stop(queue: SimpleQueue, workers: list[threading.Thread]) -> None:
    for _ in workers:
        queue.put(None)
