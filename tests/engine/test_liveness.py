"""Liveness: a recording never waits without end.  After a storage failure nothing queued is
written and close() returns within its bound; a frozen store is noticed within ``io_timeout``;
Ctrl-C during close says what it waits for and a second abandons; a stress run of many short
Writers under injected faults has no call that waits for more than a few seconds."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, Writer, WriterError, verify
from napari_tileshard.engine.dispatch import Dispatcher
from napari_tileshard.storage.errors import StorageTimeoutError, WriteCancelledError
from napari_tileshard.storage.sinks import DirectorySink
from napari_tileshard.testing import FaultInjectingSink

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")  # one frame pair a shard epoch


def frames(count: int) -> np.ndarray:
    return np.arange(count * 32 * 32, dtype=np.uint16).reshape(count, 32, 32)


def rows_claimed(path) -> int:
    return json.loads((Path(path) / "zarr.json").read_text())["attributes"]["tileshard"]["rows_written"]


def run_bounded(fn, seconds: float):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it has not returned in time."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return outcome, time.monotonic() - start


def test_a_frozen_store_stops_the_recording_within_io_timeout_and_close_is_bounded(tmp_path):
    path = tmp_path / "frozen.zarr"
    sink = FaultInjectingSink(path, freeze={"c/2/*": True})  # the third shard epoch never answers
    writer = Writer(sink, LAYOUT, backend="cpu", io_timeout=1.0, io_threads=2)
    data = frames(40)

    def record():
        try:
            for i in range(0, len(data), 2):
                writer.append(data[i : i + 2])
                time.sleep(0.01)
        finally:
            writer.close()

    outcome, seconds = run_bounded(record, 15)
    assert isinstance(outcome.get("error"), WriterError), outcome
    assert isinstance(outcome["error"].__cause__, StorageTimeoutError)
    assert "io_timeout=1 s" in str(outcome["error"])
    assert seconds < 8
    assert writer.stats.io_timeouts == 1
    # The store claims exactly the shard epochs before the frozen one, and says it failed.
    assert rows_claimed(path) == 4
    assert json.loads((path / "zarr.json").read_text())["attributes"]["tileshard"]["state"] == "failed"
    assert verify(path).ok
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:], data[:4])


def test_after_a_failed_shard_write_nothing_queued_is_written(tmp_path):
    path = tmp_path / "full.zarr"
    started: list[tuple[float, str]] = []
    failed_at: list[float] = []

    def before_write(key: str) -> None:
        started.append((time.monotonic(), key))
        if key.startswith("c/3/"):
            failed_at.append(time.monotonic())

    sink = FaultInjectingSink(
        path,
        before_write=before_write,
        delay={"c/*": 0.03},  # a slow disk: the queue of shard writes grows behind one I/O thread
        fail={"c/3/*": OSError(errno.ENOSPC, "No space left on device (injected)")},
    )
    writer = Writer(sink, LAYOUT, backend="cpu", io_threads=1, io_dispatch="pull")
    with pytest.raises(WriterError, match="No space left"):
        for i in range(0, 60, 2):
            writer.append(frames(60)[i : i + 2])
        writer.close()
    writer.close()
    assert failed_at, "the injected failure did not happen"
    # Writes already running when it failed may end; none may start after it (zarr.json aside).
    shards_after = [key for t, key in started if t > failed_at[0] + 0.02 and key.startswith("c/")]
    assert shards_after == [], f"shard writes started after the failure: {shards_after[:5]}"
    assert writer.stats.dropped_writes > 0
    assert rows_claimed(path) == 6 and verify(path).ok


def test_a_write_nothing_can_cut_off_is_abandoned_and_close_still_returns(tmp_path, caplog):
    path = tmp_path / "hung.zarr"
    stuck = threading.Event()  # a hung mount: the write neither fails nor can be cancelled
    sink = FaultInjectingSink(path, hold={"c/1/*": stuck})
    writer = Writer(sink, LAYOUT, backend="cpu", io_timeout=0.5)
    try:
        outcome, seconds = run_bounded(lambda: (writer.append(frames(8)), writer.close()), 10)
        assert isinstance(outcome.get("error"), WriterError) and isinstance(
            outcome["error"].__cause__, StorageTimeoutError
        ), outcome
        assert seconds < 6
        assert "abandoned" in caplog.text and "c/1/" in caplog.text
        assert rows_claimed(path) == 2  # only the first shard epoch is on disk and claimed
    finally:
        stuck.set()


def test_the_dispatcher_drops_queued_writes_on_abort_and_times_out_frozen_ones(tmp_path):
    sink = FaultInjectingSink(DirectorySink(tmp_path / "d"), freeze={"frozen": True}, delay={"slow*": 0.2})
    io = Dispatcher(sink, workers=1, mode="pull", io_timeout=0.5)
    futures = io.submit([("frozen", [b"x"]), ("slow1", [b"y"]), ("slow2", [b"z"])])
    with pytest.raises(StorageTimeoutError, match="'frozen'.*io_timeout=0.5 s"):
        futures[0].result(timeout=5)
    for future in futures[1:]:  # queued behind the frozen write: dropped, never written
        with pytest.raises(WriteCancelledError, match="already failed"):
            future.result(timeout=5)
    assert sink.writes == []
    later = io.submit([("after", [b"w"])])  # nothing starts once it failed
    with pytest.raises(WriteCancelledError):
        later[0].result(timeout=1)
    assert io.shutdown(timeout=2) == []  # the frozen write was cut off: no thread abandoned
    assert io.stats().dropped == 2 and io.stats().timeouts == 1


CTRL_C_DURING_CLOSE = """
import logging, os, signal, sys, threading, time
import numpy as np
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.testing import FaultInjectingSink
stuck = threading.Event()
sink = FaultInjectingSink(sys.argv[1], hold={"c/1/*": stuck})
layout = Layout([Dim("t", 0, 2, 1), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")
writer = Writer(sink, layout, backend="cpu", io_timeout=None)  # no deadline: only Ctrl-C ends the wait
writer.append(np.zeros((6, 32, 32), np.uint16))
def interrupt():
    for _ in range(2):
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
start = time.monotonic()
try:
    writer.close()
except Exception as exc:
    print("RAISED", type(exc).__name__, exc, flush=True)
print("CLOSED_AFTER", round(time.monotonic() - start, 2), "ROWS", writer.stats.rows_complete, flush=True)
"""


def test_ctrl_c_during_close_says_what_it_waits_for_and_a_second_abandons(tmp_path):
    path = tmp_path / "ctrl-c.zarr"
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_DURING_CLOSE, str(path)], capture_output=True, text=True, timeout=60
    )
    assert "waiting for" in result.stderr and "Press Ctrl-C again to abandon" in result.stderr, result.stderr
    assert "shard writes queued" in result.stderr or "in flight" in result.stderr
    assert "RAISED WriterError" in result.stdout and "abandoned by a second interrupt" in result.stdout, result.stdout
    closed_after = float(result.stdout.split("CLOSED_AFTER ")[1].split()[0])
    assert closed_after < 5
    assert rows_claimed(path) == 2 and verify(path).ok  # only what is on disk is claimed


@pytest.mark.slow
def test_stress_many_short_writers_and_conversions_under_faults_never_wait_long():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "stress_liveness.py"),
            "--iterations",
            "60",
            "--conversions",
            "10",
            "--max-wait",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 60 and summary["conversions"] == 10 and summary["calls"] > 200
    assert summary["worst_wait_s"] < 5
    assert set(summary["outcomes"]) - {"ok"}, "no fault hit any recording: the stress tested nothing"
