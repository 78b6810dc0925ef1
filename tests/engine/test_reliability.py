"""Faults: a recording killed mid-way leaves every completed shard epoch readable."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr
from conftest import read_tensorstore

from napari_tileshard import SyntheticCamera, verify


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_sigkill_mid_recording_leaves_completed_epochs(tmp_path):
    out = tmp_path / "killed.zarr"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "napari_tileshard",
            "record",
            str(out),
            "--shape",
            "0,64,48",
            "--tile",
            "4,32,16",
            "--tiles-per-shard",
            "2,1,2",
            "--frames",
            "100000",
            "--fps",
            "400",
            "--backend",
            "cpu",
            "--seed",
            "7",
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until several shard epochs are complete
            time.sleep(0.2)
            try:
                if zarr.open_array(out, mode="r").shape[0] >= 40:
                    break
            except Exception:  # noqa: BLE001 - the store may not exist yet
                pass
        time.sleep(0.37)  # land somewhere inside the next epochs
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    array = zarr.open_array(out, mode="r")
    rows = array.shape[0]
    assert rows >= 40 and rows % 8 == 0  # whole shard epochs (2 tiles x 4 frames) only
    expected = SyntheticCamera((64, 48), "uint16", seed=7).stack(rows)
    np.testing.assert_array_equal(array[:], expected)
    np.testing.assert_array_equal(read_tensorstore(out), expected)
    report = verify(out)
    assert report.ok, str(report)


def test_slow_storage_applies_backpressure_with_bounded_memory(tmp_path):
    """Storage slower than the input: append() waits instead of buffering without bound."""
    from napari_tileshard import Dim, Layout, Writer
    from napari_tileshard.testing import FaultInjectingSink

    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 32, 16, 1), Dim("x", 32, 16, 1)], "uint16")
    backlog = []
    writer = None

    def watch(key):  # tile epochs received but not yet on disk, seen by each shard write
        if writer is not None and key.startswith("c/"):
            backlog.append(writer.stats.frames // 2 - len([k for k in sink.writes if k.startswith("c/")]) // 4)

    sink = FaultInjectingSink(tmp_path / "slow-disk.zarr", delay={"c/*": 0.02}, before_write=watch)
    writer = Writer(sink, layout, backend="cpu", batch_bytes=layout.epoch_bytes, io_threads=1)
    frames = np.arange(40 * 32 * 32, dtype=np.uint16).reshape(40, 32, 32)
    start = time.perf_counter()
    writer.append(frames)  # 20 epochs x 4 shards, each write 20 ms on one I/O thread
    fed = time.perf_counter() - start
    writer.close()
    assert fed > 0.5  # the producer was held back by storage (80 x 20 ms / 1 thread = 1.6 s total)
    # staging (2 buffers + the one filling) + 2 shard epochs waiting on storage + 1 being written
    assert max(backlog) <= 6, backlog
    assert sum(key.startswith("c/") for key in sink.writes) == 80  # 20 shard epochs x 4 shards, each once
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "slow-disk.zarr")[:], frames)


@pytest.fixture
def tiny_filesystem(tmpfs):
    """A real 512 KiB tmpfs."""
    return tmpfs("512k", "tiny")


def test_real_disk_full(tiny_filesystem):
    from napari_tileshard import Dim, Layout, Writer, WriterError

    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 64, 32, 2), Dim("x", 64, 32, 2)], "uint16")
    path = tiny_filesystem / "full.zarr"
    writer = Writer(path, layout, backend="cpu", batch_bytes=layout.epoch_bytes, codec="none")
    frames = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64)
    with pytest.raises(WriterError) as info:
        for i in range(1000):  # 8 KiB per frame uncompressed: the 512 KiB filesystem fills up
            writer.append(frames + i)
            writer.flush()
    assert "No space left on device" in str(info.value) and str(path) in str(info.value)
    start = time.perf_counter()
    with pytest.raises(WriterError):
        writer.close()
    assert time.perf_counter() - start < 5
    array = zarr.open_array(path, mode="r")
    rows = array.shape[0]
    assert rows > 10
    np.testing.assert_array_equal(array[:], np.stack([frames + i for i in range(rows)]))
    assert verify(path).ok


def test_huge_declared_shape_is_refused_without_allocating(tmp_path):
    import json
    import tracemalloc

    from napari_tileshard import Dim, Layout, Writer
    from napari_tileshard.apps.napari_reader import napari_get_reader

    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
    path = tmp_path / "hostile.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(np.ones((2, 8, 8), np.uint16))
    meta = json.loads((path / "zarr.json").read_text())
    meta["shape"] = [10**12, 10**7, 10**7]
    (path / "zarr.json").write_text(json.dumps(meta))
    tracemalloc.start()
    reader = napari_get_reader(str(path))
    with pytest.raises(ValueError, match="too large to display"):
        reader(str(path))
    report = verify(path)  # lists the shards that exist; never walks the declared grid
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 << 20
    assert report.shards == 4 and [p.message for p in report.problems] == [  # the edit claims rows never written
        "rows 2..999999999999 of 1000000000000 were never written (recording state: complete)"
    ]


def _remount_read_only(point) -> None:
    result = subprocess.run(["mount", "-o", "remount,ro", str(point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot remount a tmpfs read-only here: {result.stderr.strip() or result.returncode}")


def test_a_read_only_remount_reports_the_first_failure_not_the_lock(tmpfs, caplog):
    """The disk turns read-only mid-recording: the Writer raises the write that failed first; the
    lock (and the failed-state zarr.json) that can then not be written either are logged as "also"."""
    from napari_tileshard import Dim, Layout, Writer, WriterError

    disk = tmpfs("32m", "ro")
    out = disk / "rec.zarr"
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")
    frames = SyntheticCamera((32, 32), "uint16", seed=3).stack(12)
    writer = Writer(out, layout, backend="cpu", batch_bytes=1)
    writer.append(frames[:6])
    writer.sync()
    _remount_read_only(disk)
    with caplog.at_level("WARNING"):
        try:
            writer.append(frames[6:])  # may already see the failure, or only close will
        except WriterError:
            pass
        with pytest.raises(WriterError) as info:
            writer.close()
    message = str(info.value)
    assert "Read-only file system" in message
    assert ".tileshard.lock" not in message and "/c/" in message  # a shard: the first write that failed
    lock_lines = [r.getMessage() for r in caplog.records if ".tileshard.lock" in r.getMessage()]
    assert lock_lines and all(line.startswith("also: ") for line in lock_lines)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert errors and all(".tileshard.lock" not in r.getMessage() for r in errors)
    array = zarr.open_array(out, mode="r")  # what was published before the remount stays readable
    assert array.shape[0] >= 6
    np.testing.assert_array_equal(array[:6], frames[:6])


def test_record_on_a_disk_remounted_read_only_ends_with_the_first_failure(tmpfs):
    """The reported case: `record` while the disk is remounted read-only; its last line named the
    lock file (whose removal failed last) instead of the write that failed first."""
    disk = tmpfs("64m", "ro")
    out = disk / "rec.zarr"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "napari_tileshard",
            "record",
            str(out),
            "--shape",
            "0,64,64",
            "--tile",
            "1,32,32",
            "--tiles-per-shard",
            "1,2,2",
            "--frames",
            "100000",
            "--fps",
            "200",
            "--backend",
            "cpu",
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            time.sleep(0.2)
            try:
                if zarr.open_array(out, mode="r").shape[0] >= 20:
                    break
            except Exception:  # noqa: BLE001 - the store may not exist yet
                pass
        _remount_read_only(disk)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 1, err  # a runtime failure
    lines = err.strip().splitlines()
    assert lines[-1].startswith("napari-tileshard: error: writing ") and "Read-only file system" in lines[-1]
    assert ".tileshard.lock" not in lines[-1]
    for line in lines:
        if ".tileshard.lock" in line:
            assert line.startswith("also: "), line
