"""The I/O dispatcher of shard writes under seeded storage faults (engine/dispatch/, testing.StorageFaults).

Faults go through the public seam (``FaultInjectingSink(faults=StorageFaults(...))``); service
times are simulated in milliseconds so the whole file runs in a few seconds."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from napari_tileshard import Dim, Layout, Writer, WriterError, verify
from napari_tileshard.engine.dispatch import PREDICTORS, Dispatcher, RateModel
from napari_tileshard.storage.errors import TransientStorageError
from napari_tileshard.testing import FaultInjectingSink, SlowDownError, StorageFaults

SERVICE = {"service_s": 0.003, "seed": 7}


def payloads(count: int, nbytes: int = 4096) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(count)
    return [(f"c/{i}/0", rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()) for i in range(count)]


def dispatch_all(sink, items, mode="adaptive", workers=4, batch=8, **options):
    dispatcher = Dispatcher(sink, workers, mode, telemetry_lost=sink.telemetry_lost, **options)
    futures = []
    for start in range(0, len(items), batch):
        futures += dispatcher.submit([(key, [data[:100], data[100:]]) for key, data in items[start : start + batch]])
        if len(futures) > 3 * batch:  # the collector's backpressure: a few batches ahead of storage
            for future in futures[: -2 * batch]:
                future.result()
    for future in futures:
        future.result()
    dispatcher.shutdown()
    sink.release()
    return dispatcher


def stored_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_hedged_duplicates_never_corrupt_and_the_budget_holds(tmp_path):
    items = payloads(160)
    # A third of the writes stall and every write slower than the median is worth a copy:
    # far more than the 5 % budget would want.
    sink = FaultInjectingSink(tmp_path / "s", faults=StorageFaults(**SERVICE, stall_every=3, stall_s=0.05))
    dispatcher = dispatch_all(sink, items, hedge_quantile=0.5)
    stats = dispatcher.stats()
    assert stats.hedges > 0  # stalls were hedged
    assert stats.duplicate_bytes == stats.hedges * 4096
    assert stats.duplicate_bytes <= 0.05 * stats.bytes  # the token bucket
    late = [entry for entry in dispatcher.assignment_log if "late" in entry[5]]
    assert late  # both copies of some shard landed: the second replaced identical bytes
    assert stored_files(tmp_path / "s") == dict(items)  # no temporary file left, every object exact
    assert stats.shards == len(items) and sorted(set(sink.writes)) == sorted(dict(items))


@pytest.mark.parametrize(
    "fault",
    [
        {"slow_worker": 1, "slow_factor": 10.0},
        {"stall_every": 10, "stall_s": 0.03},
        {"slowdown_rate": 0.2},
        {"telemetry_loss": 0.5, "slow_worker": 0, "slow_factor": 5.0},
    ],
    ids=["slow10x", "stalls", "slowdown503", "telemetry_loss"],
)
@pytest.mark.parametrize("mode", ["adaptive", "pull", "static"])
def test_nothing_lost_under_each_fault(tmp_path, fault, mode):
    items = payloads(48)
    sink = FaultInjectingSink(tmp_path / "s", faults=StorageFaults(**SERVICE, **fault))
    stats = dispatch_all(sink, items, mode).stats()
    assert stored_files(tmp_path / "s") == dict(items)
    assert stats.shards == len(items)
    assert sum(sink.injected.values()) > 0  # the fault did happen
    if "slowdown_rate" in fault:
        # Every refusal is an error in the telemetry; each was retried unless another copy had landed.
        assert sum(w["errors"] for w in stats.workers) == sink.injected["slowdown"] >= stats.retries > 0


def test_a_twice_slower_worker_receives_fewer_shards(tmp_path):
    items = payloads(200)
    # 10 ms writes: the simulated service time, not a loaded 2-core box's scheduling, decides
    faults = StorageFaults(service_s=0.01, seed=3, slow_worker=0, slow_factor=2.0)
    adaptive = dispatch_all(FaultInjectingSink(tmp_path / "a", faults=faults), items).stats()
    static = dispatch_all(FaultInjectingSink(tmp_path / "s", faults=faults), items, "static").stats()
    shards = [w["shards"] for w in adaptive.workers]
    assert shards[0] < 0.75 * min(shards[1:]), shards  # ideal: half of each other worker's share
    assert [w["shards"] for w in static.workers] == [50] * 4  # round-robin ignores the slow worker
    assert adaptive.straggler_gap_s < static.straggler_gap_s


def test_telemetry_loss_falls_back_to_static_assignment_and_learns_nothing(tmp_path):
    items = payloads(64)
    lost = StorageFaults(**SERVICE, telemetry_loss=1.0)
    dispatcher = dispatch_all(FaultInjectingSink(tmp_path / "lost", faults=lost), items)
    stats = dispatcher.stats()
    assert stats.fallback_rounds == stats.rounds == 8
    assert stats.moves == 0 and dispatcher.model_samples == [0, 0, 0, 0]
    placed = {}  # static placement: shard i of the recording went to worker i % 4 unless stolen
    for worker, key, *_ in dispatcher.assignment_log:
        placed[key] = worker
    assert stored_files(tmp_path / "lost") == dict(items)

    healthy = dispatch_all(FaultInjectingSink(tmp_path / "ok", faults=StorageFaults(**SERVICE)), items)
    assert healthy.stats().fallback_rounds < healthy.stats().rounds  # warmed up, then planned
    assert min(healthy.model_samples) >= 2 and healthy.predict(0, 4096) > 0


def test_adaptive_relieves_a_slow_worker_and_hedges_its_shards(tmp_path):
    items = payloads(160)
    faults = StorageFaults(service_s=0.003, seed=5, slow_worker=2, slow_factor=10.0)
    stats = dispatch_all(FaultInjectingSink(tmp_path / "s", faults=faults), items).stats()
    shards = [w["shards"] for w in stats.workers]
    assert shards[2] < 0.5 * min(shards[:2] + shards[3:4]), shards  # ideal: a tenth of another's share
    assert stats.replaced == 1 and stats.workers[2]["retired"]  # found, retired, replaced by worker 4
    assert stats.workers[4]["shards"] > 0 and stats.steals + stats.moves > 0
    assert stored_files(tmp_path / "s") == dict(items)
    # (The tail latency against the pull queue is measured by benchmarks/bench_dispatch.py.)


def test_retries_exhausted_fail_the_shard_with_the_storage_error(tmp_path):
    sink = FaultInjectingSink(tmp_path / "s", faults=StorageFaults(slowdown_rate=1.0))
    dispatcher = Dispatcher(sink, 2, max_retries=2, retry_backoff_s=0.001)
    (future,) = dispatcher.submit([("c/0", [b"abc"])])
    with pytest.raises(SlowDownError, match="SlowDown"):
        future.result()
    assert isinstance(future.exception(), TransientStorageError)
    dispatcher.shutdown()
    assert dispatcher.stats().retries == 2 and sink.writes == []


def test_bad_dispatch_options_are_named():
    with pytest.raises(ValueError, match="'fastest'"):
        Dispatcher(FaultInjectingSink.__new__(FaultInjectingSink), 2, "fastest")
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        Dispatcher(FaultInjectingSink.__new__(FaultInjectingSink), 0)
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
    with pytest.raises(ValueError, match="io_dispatch must be one of static, pull, adaptive, got 'x'"):
        Writer("unused.zarr", layout, io_dispatch="x")


LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 64, 16, 2), Dim("x", 64, 16, 2)], "uint16")
FRAMES = np.random.default_rng(2).integers(0, 4000, (40, 64, 64), dtype=np.uint16)


def record(store, **options) -> Writer:
    with Writer(store, LAYOUT, backend="cpu", batch_bytes=LAYOUT.epoch_bytes, **options) as writer:
        for frame in FRAMES:
            writer.append(frame)
    return writer


@pytest.mark.parametrize(
    "fault",
    [{"slow_worker": 0, "slow_factor": 10.0}, {"stall_every": 4, "stall_s": 0.03}, {"slowdown_rate": 0.2}],
    ids=["slow10x", "stalls", "slowdown503"],
)
def test_writer_output_under_faults_is_identical_to_the_fault_free_run(tmp_path, fault):
    clean = record(tmp_path / "clean.zarr", io_threads=3)
    sink = FaultInjectingSink(tmp_path / "faulty.zarr", faults=StorageFaults(**SERVICE, **fault))
    faulty = record(sink, io_threads=3)
    assert stored_files(tmp_path / "faulty.zarr") == stored_files(tmp_path / "clean.zarr")
    assert verify(tmp_path / "faulty.zarr").ok
    stats = faulty.stats
    assert stats.io_dispatch == "adaptive" and len(stats.io_workers) == 3 + stats.replaced_workers
    # Each shard landed once, plus the hedged copies that landed too.
    assert stats.shards_written <= sum(w["shards"] for w in stats.io_workers) <= stats.shards_written + stats.hedges
    assert stats.shards_written == clean.stats.shards_written == 20 * 4
    assert stats.duplicate_bytes <= 0.05 * stats.bytes_out + 1
    if "slowdown_rate" in fault:
        assert stats.retries > 0


def test_writer_fails_cleanly_when_storage_keeps_refusing(tmp_path):
    sink = FaultInjectingSink(tmp_path / "x.zarr", faults=StorageFaults(slowdown_rate=1.0))
    with pytest.raises(WriterError, match="SlowDown"):
        record(sink, io_threads=2)


def test_telemetry_is_lost_only_where_the_seam_is_handed_to_the_writer(tmp_path):
    """Lost telemetry is the dispatcher's fault, not the storage's: a FaultInjectingSink loses it
    through ``Writer(io_telemetry_lost=sink.telemetry_lost)``, and the recording is unchanged."""
    record(tmp_path / "clean.zarr", io_threads=3)
    lost = StorageFaults(**SERVICE, telemetry_loss=1.0)
    sink = FaultInjectingSink(tmp_path / "lost.zarr", faults=lost)
    stats = record(sink, io_threads=3, io_telemetry_lost=sink.telemetry_lost).stats
    assert stats.fallback_rounds == sink.injected["telemetry_loss"] >= 20  # every shard epoch's batch
    assert stats.moves == 0 and stats.replaced_workers == 0
    assert stored_files(tmp_path / "lost.zarr") == stored_files(tmp_path / "clean.zarr")

    # Not handed over: the sink's faults are storage faults only, and the planner warms up.
    sink = FaultInjectingSink(tmp_path / "kept.zarr", faults=lost)
    stats = record(sink, io_threads=3).stats
    assert sink.injected["telemetry_loss"] == 0 and stats.fallback_rounds < 20
    assert stored_files(tmp_path / "kept.zarr") == stored_files(tmp_path / "clean.zarr")


def test_a_telemetry_seam_that_is_not_callable_is_named_before_the_store_is_touched(tmp_path):
    with pytest.raises(TypeError, match="telemetry_lost must be a callable .* got 0.3"):
        Dispatcher(FaultInjectingSink.__new__(FaultInjectingSink), 2, telemetry_lost=0.3)
    with pytest.raises(TypeError, match="io_telemetry_lost must be a callable .* got 'yes'"):
        Writer(tmp_path / "w.zarr", LAYOUT, backend="cpu", io_telemetry_lost="yes")
    assert not (tmp_path / "w.zarr").exists()


def _seed_where_only_the_first_attempt_stalls() -> int:
    return next(
        seed
        for seed in range(1000)
        if StorageFaults(seed=seed).draw("stall", "hot/k", 0) * 2 < 1
        and all(StorageFaults(seed=seed).draw("stall", "hot/k", n) * 2 >= 1 for n in (1, 2, 3))
    )


def test_a_late_hedged_copy_never_lands_over_a_newer_version_of_its_key(tmp_path):
    """A flushed shard is rewritten later under the same key with more data: a hedged copy of the
    old version still in flight must not land after the new one."""
    faults = StorageFaults(seed=_seed_where_only_the_first_attempt_stalls(), keys="hot/*", stall_every=2, stall_s=0.4)
    sink = FaultInjectingSink(tmp_path / "s", faults=faults)
    dispatcher = Dispatcher(sink, 3, hedge_quantile=0.5, hedge_fraction=0.5)  # tokens to spare
    for start in range(0, 64, 8):  # warm up the deadline and the token bucket
        for future in dispatcher.submit([(f"c/{i}", [bytes(4096)]) for i in range(start, start + 8)]):
            future.result()
    old, new = b"1" * 4096, b"2" * 4096
    (first,) = dispatcher.submit([("hot/k", [old])])
    first.result(timeout=0.3)  # resolved by the hedged copy while the first copy is stalled
    assert "hot/k" in [key for _, key, *_, kind in dispatcher.assignment_log if kind == "duplicate"]
    (second,) = dispatcher.submit([("hot/k", [new])])
    second.result()
    dispatcher.shutdown()
    sink.release()
    assert (tmp_path / "s" / "hot" / "k").read_bytes() == new


def test_a_submission_costs_the_planner_the_same_whatever_the_backlog(tmp_path, monkeypatch):
    """The planner's predictions per batch do not grow with the shards already queued (a slow disk
    or many small shards): counted through a predictor registered in ``PREDICTORS``."""
    calls = [0]

    class CountingModel(RateModel):
        def predict(self, nbytes):
            calls[0] += 1
            return super().predict(nbytes)

        def predict_many(self, count, nbytes, units):
            calls[0] += 1
            return super().predict_many(count, nbytes, units)

    monkeypatch.setitem(PREDICTORS, "counting", CountingModel)
    release = threading.Event()
    sink = FaultInjectingSink(tmp_path / "s", hold={"c/held/*": release})
    dispatcher = Dispatcher(sink, 4, predictor="counting")
    warm = 0
    while min(dispatcher.model_samples) < 2:  # every worker measured: batches are planned, not round-robin
        assert warm < 400, dispatcher.model_samples
        for future in dispatcher.submit([(f"c/warm/{warm + i}", [bytes(4096)]) for i in range(4)]):
            future.result()
        warm += 4
    futures, per_submit = [], {}
    for backlog in (0, 2000):
        while len(futures) < backlog:  # every worker holds one write; the rest stays queued
            futures += dispatcher.submit([(f"c/held/{len(futures) + i}", [bytes(4096)]) for i in range(4)])
        fallback, before = dispatcher.stats().fallback_rounds, calls[0]
        for _ in range(10):
            futures += dispatcher.submit([(f"c/held/{len(futures) + i}", [bytes(4096)]) for i in range(4)])
        assert dispatcher.stats().fallback_rounds == fallback  # the planner placed them
        per_submit[backlog] = (calls[0] - before) / 10
    release.set()
    for future in futures:
        future.result()
    dispatcher.shutdown()
    sink.release()
    # Bounded by the batch, the workers and max_moves (64); it used to sum over every queued shard.
    assert per_submit[2000] < 500, per_submit
    assert len(stored_files(tmp_path / "s")) == warm + len(futures)


def test_sizes_the_caller_knows_are_the_bytes_counted(tmp_path):
    # the collector passes each shard's size (it knows it: taken as given, not counted again);
    # without sizes each buffer is counted
    pieces = {"c/0": [b"ab", np.arange(5, dtype=np.uint16)], "c/1": [bytearray(7)]}
    counted = []
    for run, sizes in enumerate((None, [12, 7], [100, 1])):
        dispatcher = Dispatcher(FaultInjectingSink(tmp_path / f"s{run}"), 2)
        for future in dispatcher.submit(list(pieces.items()), sizes):
            future.result()
        dispatcher.shutdown()
        counted.append(dispatcher.stats().bytes)
    assert counted == [19, 19, 101]
