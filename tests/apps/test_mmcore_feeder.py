"""The pymmcore-plus sink's hand-over off the MDA thread (FrameFeeder: bounded queue, block/drop,
failure) and its watch on pymmcore-plus's sequence buffer (BufferWatch), each on its own."""

from __future__ import annotations

import threading
import time

import pytest

from napari_tileshard.apps.mmcore.feeder import FrameFeeder
from napari_tileshard.apps.mmcore.overflow import FRAMES_TO_JUDGE, BufferWatch, buffer_stop_level


class Consumer:
    def __init__(self, fail_on=None):
        self.taken: list = []
        self.advances = 0
        self.finished = 0
        self.release = threading.Event()
        self.release.set()
        self.fail_on = fail_on

    def take(self, item):
        self.release.wait(10)
        if item == self.fail_on:
            raise OSError(f"disk full at {item}")
        self.taken.append(item)

    def advance(self):
        self.advances += 1

    def finish(self):
        self.finished += 1


def _until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def feeder(consumer, capacity=2, policy="block"):
    return FrameFeeder(
        capacity, policy, take=consumer.take, advance=consumer.advance, finish=consumer.finish, label="run.zarr"
    )


def test_items_are_taken_in_order_then_finish_runs_once():
    consumer = Consumer()
    f = feeder(consumer, capacity=4).start()
    for item in range(100):
        assert f.offer(item)
    f.wake()
    f.stop()
    assert consumer.taken == list(range(100))
    assert consumer.advances == 101  # after every item, the wake included
    assert consumer.finished == 1 and f.failure is None


def test_drop_refuses_what_does_not_fit_and_block_waits_for_room():
    consumer = Consumer()
    consumer.release.clear()  # the feeder is stuck in take(0): the queue fills behind it
    f = feeder(consumer, capacity=2, policy="drop").start()
    assert f.offer(0)
    _until(lambda: f.qsize() == 0)  # the feeder holds item 0
    assert f.offer(1) and f.offer(2) and f.full()
    assert not f.offer(3)  # full: refused, not waited for
    consumer.release.set()
    f.stop()
    assert consumer.taken == [0, 1, 2]

    consumer = Consumer()
    consumer.release.clear()
    f = feeder(consumer, capacity=1, policy="block").start()
    f.offer(0)
    _until(lambda: f.qsize() == 0)
    f.offer(1)
    blocked = threading.Thread(target=f.offer, args=(2,))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # waits for room
    consumer.release.set()
    blocked.join(10)
    f.stop()
    assert consumer.taken == [0, 1, 2]


def test_a_failure_is_kept_and_the_queue_still_drains():
    consumer = Consumer(fail_on=3)
    f = feeder(consumer, capacity=2, policy="block").start()
    for item in range(50):  # would block forever on a queue nobody empties
        f.offer(item)
    f.stop()
    assert isinstance(f.failure, OSError) and "disk full at 3" in str(f.failure)
    assert consumer.taken == [0, 1, 2] and consumer.finished == 0


def test_the_feeder_refuses_a_policy_or_capacity_by_value():
    with pytest.raises(ValueError, match="policy 'sometimes' is not one of block, drop"):
        feeder(Consumer(), policy="sometimes")
    with pytest.raises(ValueError, match="capacity must be a positive integer, got 0"):
        feeder(Consumer(), capacity=0)


def _watch(buffer_frames=16, planned=100):
    return BufferWatch(
        frame_bytes=128 * 512 * 2,
        frame_text="512x128 uint16",
        buffer_mb=2,
        buffer_frames=buffer_frames,
        planned_frames=planned,
    )


def test_the_watch_trips_once_at_three_quarters_after_the_first_frames():
    watch = _watch()
    assert buffer_stop_level(16) == 12
    calls = [14] * (FRAMES_TO_JUDGE - 1) + [2, 11, 12, 15, 12]  # a start-up burst is not judged
    tripped = [
        watch.observe({"runner_time_ms": float(k), "images_remaining_in_buffer": w}, queue_full=True, received=k + 1)
        for k, w in enumerate(calls)
    ]
    assert tripped == [None] * (FRAMES_TO_JUDGE + 1) + [12, None, None]
    assert watch.max_waiting == 15 and watch.tripped


def test_the_watch_needs_the_buffer_size_and_ignores_metadata_it_cannot_read():
    watch = _watch(buffer_frames=None)
    for k in range(20):
        assert watch.observe({"images_remaining_in_buffer": 1000}, queue_full=False, received=k + 1) is None
    watch = _watch()
    for k in range(20):
        assert watch.observe(None, queue_full=False, received=k + 1) is None
        assert watch.observe({"images_remaining_in_buffer": True}, queue_full=False, received=k + 1) is None
    assert watch.max_waiting == 0


def test_the_explanation_names_the_rates_the_slow_side_and_the_buffer():
    watch = _watch()
    for k in range(20):  # the camera at 1000 frames/s, the queue full for every frame
        watch.observe({"runner_time_ms": float(k), "images_remaining_in_buffer": 2}, queue_full=True, received=k + 1)
    message = watch.explain(path="run.zarr", waiting=12, received=20, written=10, can_stop=True)
    assert message.startswith("run.zarr: frames left pymmcore-plus's sequence buffer slower")
    assert "the sink's queue was full for 100% of the latest frames: the sink could not keep up" in message
    assert "the camera delivered 0.13 GB/s (1000 frames/s)" in message
    assert "the buffer of 2 MiB (16 frames) held 12 waiting frames. The MDA is stopped" in message
    cannot = watch.explain(path="run.zarr", waiting=12, received=20, written=10, can_stop=False)
    assert "give the sink the core (TileShardSink(..., core=core) or sink.attach(core))" in cannot
