"""The decode threads' pool (reader/tasks.py): calls without a Future, and with one."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pytest

from napari_tileshard.reader.tasks import TaskPool, pin_to


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name + "_")]


def test_posted_calls_run_on_the_pool_threads_and_submit_gives_a_future():
    pool = TaskPool(3, "tasks-a")
    assert _threads("tasks-a") == []  # started by the first task, not before
    ran: list[tuple[int, str]] = []
    done = threading.Event()
    for i in range(50):
        pool.post(lambda i: ran.append((i, threading.current_thread().name)), i)
    pool.post(done.set)
    assert done.wait(5)
    assert sorted(i for i, _ in ran) == list(range(50))
    assert {name for _, name in ran} <= {t.name for t in _threads("tasks-a")} and len(_threads("tasks-a")) == 3
    assert pool.submit(pow, 2, 10).result(5) == 1024
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    pool.shutdown()
    assert _threads("tasks-a") == []


def test_a_failing_posted_call_is_logged_and_the_thread_goes_on(caplog):
    pool = TaskPool(1, "tasks-b")
    with caplog.at_level(logging.ERROR, logger="napari_tileshard.reader.tasks"):
        pool.post(lambda: 1 / 0)
        assert pool.submit(lambda: "after").result(5) == "after"
    assert "a task of tasks-b_0 failed" in caplog.text and "ZeroDivisionError" in caplog.text
    pool.shutdown()


def test_shutdown_runs_what_was_queued_cancelled_futures_do_not_run_and_later_tasks_are_refused():
    pool = TaskPool(1, "tasks-c")
    gate, ran = threading.Event(), []
    pool.post(gate.wait, 5)
    queued = [pool.submit(ran.append, i) for i in range(3)]
    assert queued[1].cancel()
    gate.set()
    pool.shutdown()
    assert ran == [0, 2] and queued[0].done() and queued[1].cancelled()
    with pytest.raises(RuntimeError, match="tasks-c: cannot run tasks after shutdown"):
        pool.post(print)
    with pytest.raises(ValueError, match="got 0"):
        TaskPool(0, "none")


def test_a_pool_no_one_refers_to_stops_its_threads():
    pool = TaskPool(2, "tasks-d")
    assert pool.submit(int, "7").result(5) == 7
    assert len(_threads("tasks-d")) == 2
    del pool
    gc.collect()
    deadline = time.monotonic() + 5
    while _threads("tasks-d") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads("tasks-d") == []


needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's (os.sched_setaffinity)"
)


@needs_affinity
def test_a_pool_given_cpus_runs_a_thread_on_each_and_the_others_anywhere():
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:2]
    pool = TaskPool(len(cpus) + 1, "tasks-e", cpus)
    seen = [pool.submit(lambda: (threading.current_thread().name, os.sched_getaffinity(0))) for _ in range(30)]
    by_thread = dict(future.result(5) for future in seen)
    masks = {t.name: os.sched_getaffinity(t.native_id) for t in _threads("tasks-e")}  # all started by the first task
    assert masks == {f"tasks-e_{i}": {cpu} for i, cpu in enumerate(cpus)} | {f"tasks-e_{len(cpus)}": set(allowed)}
    assert all(mask == masks[name] for name, mask in by_thread.items())  # as each thread saw itself
    assert os.sched_getaffinity(0) == set(allowed)  # the process, and the caller, are left as they were
    pool.shutdown()


@needs_affinity
def test_a_cpu_the_process_may_not_use_leaves_the_thread_unpinned_and_working(monkeypatch):
    allowed = os.sched_getaffinity(0)
    assert not pin_to(max(allowed) + 4096)  # no such CPU: refused, and said so
    pool = TaskPool(1, "tasks-f", [max(allowed) + 4096])
    assert pool.submit(os.sched_getaffinity, 0).result(5) == allowed
    pool.shutdown()
    monkeypatch.delattr(os, "sched_setaffinity")  # macOS, Windows
    assert not pin_to(min(allowed))
    pool = TaskPool(2, "tasks-g", [min(allowed)])
    assert pool.submit(pow, 3, 2).result(5) == 9
    pool.shutdown()
