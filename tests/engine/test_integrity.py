"""Data integrity: the store never claims what is not on disk (issue 11, cases 1-4, 6, 9-11).

Faults go through the public seam (:class:`napari_tileshard.testing.FaultInjectingSink`); the
:class:`ClaimChecker` sink checks the rule itself at every ``zarr.json`` the Writer publishes:
every shard that the claimed rows need is already written.
"""

from __future__ import annotations

import errno
import json
import math
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import zarr
from conftest import read_back

from napari_tileshard import Dim, Layout, Writer, WriterError, verify
from napari_tileshard.testing import FaultInjectingSink


class ClaimChecker(FaultInjectingSink):
    """Records every publish that claims rows whose shards are not all written yet."""

    def __init__(self, inner, layouts=None, **faults):
        super().__init__(inner, **faults)
        self.layouts = layouts or {}  # prefix ("" or "0/", "1/", ...) -> Layout
        self.violations: list[str] = []
        self.claims: list[int] = []

    def write(self, key, buffers):
        if key.endswith("zarr.json"):
            meta = json.loads(b"".join(bytes(memoryview(b).cast("B")) for b in buffers))
            prefix = key[: -len("zarr.json")]
            if meta.get("node_type") == "array" and prefix in self.layouts:
                self._check(prefix, meta)
        super().write(key, buffers)

    def _check(self, prefix, meta):
        layout = self.layouts[prefix]
        rows = meta["shape"][0] if layout.unbounded else meta["attributes"]["tileshard"]["rows_written"]
        if prefix == "" or prefix == "0/":
            self.claims.append(rows)
        written = set(self.writes)
        for shard_epoch in range(math.ceil(rows / layout.shard_epoch_rows)):
            for j in range(layout.inner_shard_count):
                key = prefix + layout.shard_key((shard_epoch,) + layout.inner_shard_coords(j))
                if key not in written:
                    self.violations.append(f"{prefix}zarr.json claims {rows} rows but {key} is not written")


def small_layout(**kw):
    # shard epoch = 2 rows, 4 shards per shard epoch
    return Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], kw.get("dtype", "uint16"))


def frames_for(n, shape=(8, 8), seed=0):
    return np.random.default_rng(seed).integers(1, 60000, size=(n, *shape), dtype=np.uint16)


def published(path, level=None):
    meta = json.loads((path / ("zarr.json" if level is None else f"{level}/zarr.json")).read_text())
    return meta["shape"][0], meta["attributes"]["tileshard"]


def feed_until_error(writer, frames, flush_every=0):
    """Append frames one by one (flushing now and then) until the Writer reports its error."""
    error = None
    try:
        for i, frame in enumerate(frames):
            writer.append(frame)
            if flush_every and i % flush_every == flush_every - 1:
                writer.flush()
    except WriterError as exc:
        error = exc
    try:
        writer.close()
    except WriterError as exc:
        error = error or exc
    assert error is not None, "the Writer did not report the storage error"
    return error


# -- case 1: a failed shard write, later epochs succeeding --------------------------------------
@pytest.mark.parametrize("fault", ["enospc", "directory"])
def test_failed_shard_write_stops_publishing_even_when_later_epochs_succeed(tmp_path, backend, fault):
    layout = small_layout()
    path = tmp_path / "gap.zarr"
    fail = {"c/3/0/0": OSError(errno.ENOSPC, "No space left on device")} if fault == "enospc" else {}
    # A delay on epoch 3 lets epochs 4.. finish first, as they did on the full tmpfs (a shared
    # queue and more I/O threads than epoch 3 has shards: idle threads take them at once; once
    # epoch 3 fails, what is still queued is dropped).
    sink = ClaimChecker(path, {"": layout}, fail=fail, delay={"c/3/*": 0.2})
    writer = Writer(sink, layout, backend=backend, batch_bytes=layout.epoch_bytes, io_threads=8, io_dispatch="pull")
    if fault == "directory":  # the shard's name is taken by a non-empty directory: rename fails
        (path / "c" / "3" / "0" / "0").mkdir(parents=True)
        (path / "c" / "3" / "0" / "0" / "user-file").write_text("x")
    frames = frames_for(16)
    feed_until_error(writer, frames)
    assert not sink.violations, sink.violations
    rows, state = published(path)
    assert rows <= 6  # epochs 0-2 at most: never past the failed epoch 3
    assert state == {"rows_written": rows, "state": "failed"}
    np.testing.assert_array_equal(read_back(path), frames[:rows])
    assert any(k.startswith("c/4/") for k in sink.writes) or fault == "directory"
    assert verify(path).ok


def test_failed_level_shard_stops_publishing_every_level(tmp_path, backend):
    layout = small_layout()
    path = tmp_path / "gap.ome.zarr"
    writer = Writer(path, layout, backend=backend, ome=True, batch_bytes=layout.epoch_bytes, max_levels=2)
    layouts = {f"{k}/": lay for k, lay in enumerate(writer.pyramid.layouts)}
    writer.close()
    sink = ClaimChecker(
        path,
        layouts,
        overwrite=True,
        fail={"1/c/3/*": OSError(errno.EIO, "Input/output error")},
        delay={"*/c/3/*": 0.2},
    )
    writer = Writer(sink, layout, backend=backend, ome=True, batch_bytes=layout.epoch_bytes, max_levels=2)
    frames = frames_for(16)
    feed_until_error(writer, frames)
    assert not sink.violations, sink.violations
    rows0, _ = published(path, 0)
    rows1, _ = published(path, 1)
    assert rows0 <= 6 and rows1 <= 6
    np.testing.assert_array_equal(zarr.open_array(path / "0", mode="r")[:], frames[:rows0])


# -- case 2: Ctrl-C while append() waits for room -------------------------------------------------
def test_interrupt_while_append_waits_loses_nothing_it_counted(tmp_path):
    layout = small_layout()
    path = tmp_path / "interrupt.zarr"
    gate = threading.Event()
    sink = ClaimChecker(path, {"": layout}, hold={"c/*": gate})
    writer = Writer(sink, layout, backend="cpu", batch_bytes=layout.epoch_bytes, io_threads=1)
    frames = frames_for(200)
    main = threading.get_ident()

    def interrupt():
        while not sink.attempts:  # storage is stuck: the pipeline fills, then append() waits
            time.sleep(0.01)
        time.sleep(0.5)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        writer.append(frames)
    received = writer.stats.frames
    assert 0 < received < 200
    gate.set()
    writer.close()
    assert not sink.violations, sink.violations
    rows, state = published(path)
    assert state["state"] == "complete"
    assert rows == received  # every counted frame is on disk, and nothing else is claimed
    np.testing.assert_array_equal(read_back(path), frames[:rows])


# -- case 3: flush racing a slow shard write -------------------------------------------------------
@pytest.mark.parametrize("trial", range(3))
def test_flush_never_publishes_before_a_slow_shard_lands(tmp_path, backend, trial):
    layout = small_layout()
    path = tmp_path / "race.zarr"
    sink = ClaimChecker(path, {"": layout}, delay={"c/0/0/0": 0.5 + 0.2 * trial})
    frames = frames_for(7, seed=trial)
    with Writer(sink, layout, backend=backend, batch_bytes=layout.epoch_bytes) as writer:
        writer.append(frames[:5])  # shard epoch 0 (slow), shard epoch 1 (fast), a partial one
        writer.flush()  # used to wait for epoch 0 while the collector published epoch 1
        writer.append(frames[5:])
        writer.flush()
    assert not sink.violations, sink.violations
    np.testing.assert_array_equal(read_back(path), frames)


# -- case 4: flush mid-row -------------------------------------------------------------------------
def test_flush_mid_row_publishes_only_whole_rows(tmp_path, backend):
    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 30, 8, 1)], "uint16")
    path = tmp_path / "row.zarr"
    row = np.arange(1, 31, dtype=np.uint16)
    with Writer(path, layout, backend=backend) as writer:
        assert writer.write(row[:10].tobytes()).nbytes == 0
        writer.flush()
        assert published(path)[0] == 0  # 10 of 30 elements: not a row yet
        writer.write(row[10:].tobytes())
        writer.flush()
        assert published(path)[0] == 1
        np.testing.assert_array_equal(read_back(path), row[None])


# -- case 6: bounded arrays record what is written -------------------------------------------------
def test_bounded_array_records_rows_written_while_recording(tmp_path, backend):
    layout = Layout([Dim("z", 10, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
    path = tmp_path / "bounded.zarr"
    frames = frames_for(10)
    writer = Writer(path, layout, backend=backend)
    assert published(path) == (10, {"rows_written": 0, "state": "recording"})
    writer.append(frames[:5])
    writer.flush()
    # A crash now leaves exactly this: the declared shape, and how much of it was written.
    assert published(path) == (10, {"rows_written": 5, "state": "recording"})
    writer.append(frames[5:])
    writer.close()
    assert published(path) == (10, {"rows_written": 10, "state": "complete"})
    np.testing.assert_array_equal(read_back(path), frames)


# -- case 9: a polling reader while the writer flushes ----------------------------------------------
@pytest.mark.parametrize("reader", ["zarr", "tensorstore"])
def test_polling_reader_never_fails_while_the_writer_flushes(tmp_path, reader):
    """A flushed partial shard is rewritten later; a reader that located chunks in the old
    version must still read them (every flushed byte keeps its offset)."""
    layout = Layout([Dim("t", 0, 2, 8), Dim("y", 32, 16, 2), Dim("x", 32, 16, 2)], "uint16")
    path = tmp_path / "poll.zarr"
    frames = np.random.default_rng(9).integers(0, 65535, size=(96, 32, 32), dtype=np.uint16)
    errors, polls, stop = [], [0], threading.Event()

    def read_once():
        if reader == "zarr":
            array = zarr.open_array(path, mode="r")
            return array[:]
        ts = pytest.importorskip("tensorstore")
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
        return ts.open(spec, read=True).result().read().result()

    def poll():
        while not stop.is_set():
            try:
                data = read_once()
                np.testing.assert_array_equal(data, frames[: data.shape[0]])
                if polls[0] % 5 == 0:  # our own verify must not fail on a shard being replaced either
                    report = verify(path)
                    assert report.ok, str(report)
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                errors.append(f"{type(exc).__name__}: {exc}")
            polls[0] += 1

    with Writer(path, layout, backend="cpu", batch_bytes=layout.epoch_bytes) as writer:
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            for i in range(96):
                writer.append(frames[i])
                writer.flush()
                time.sleep(0.01)  # give the reader time to interleave with every rewrite
        finally:
            stop.set()
            poller.join()
    assert polls[0] > 20
    assert not errors, errors[:3]
    np.testing.assert_array_equal(read_back(path), frames)
    assert verify(path).ok


def test_flushed_shards_keep_their_bytes_in_later_versions(tmp_path, backend):
    """The mechanism behind case 9, checked directly on the files."""
    layout = Layout([Dim("t", 0, 2, 4), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
    path = tmp_path / "stable.zarr"
    frames = frames_for(8)
    versions = []
    with Writer(path, layout, backend=backend) as writer:
        for i in range(8):
            writer.append(frames[i])
            writer.flush()
            versions.append((path / "c/0/0/0").read_bytes())
    final = (path / "c/0/0/0").read_bytes()
    for old in versions:
        assert final[: len(old)] == old
    np.testing.assert_array_equal(read_back(path), frames)


# -- case 10: a store that does not fit at all ----------------------------------------------------
@pytest.mark.parametrize("ome", [False, True])
def test_metadata_that_does_not_fit_at_start_leaves_nothing_behind(tmp_path, ome):
    layout = small_layout()
    path = tmp_path / "nofit.zarr"
    sink = FaultInjectingSink(path, fail={"*zarr.json": OSError(errno.ENOSPC, "No space left on device")})
    with pytest.raises(OSError) as info:
        Writer(sink, layout, backend="cpu", ome=ome)
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device" in str(info.value) and str(path) in str(info.value)
    assert not path.exists()


@pytest.fixture
def full_filesystem(tmpfs):
    """A real 256 KiB tmpfs, filled to the last byte."""
    mount_point = tmpfs("256k", "full")
    try:
        with open(mount_point / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass
    return mount_point


def test_real_full_disk_at_start_gives_the_storage_error(full_filesystem):
    path = full_filesystem / "rec.zarr"
    with pytest.raises(OSError) as info:
        Writer(path, small_layout(), backend="cpu")
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert not path.exists()


# -- case 11: options validated before the first byte ---------------------------------------------
@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: Layout([Dim("t", 0, 1, 2**30), Dim("x", 8, 8, 1)]), ValueError, "chunks in a shard"),
        (
            lambda: Layout([Dim("t", 0, 1, 1), Dim("y", 8, 1, 2**11), Dim("x", 8, 1, 2**11)]),
            ValueError,
            "4194304 chunks in a shard",
        ),
        (lambda: Dim("x", 2**63, 1), ValueError, "size 9223372036854775808 is larger than"),
    ],
)
def test_layouts_beyond_the_limits_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize(
    "option, value, error, message",
    [
        ("attributes", {"x": float("nan")}, ValueError, "without NaN"),
        ("attributes", {"tileshard": 1}, ValueError, "may not contain 'tileshard'"),
        ("io_threads", 0, ValueError, "io_threads must be a positive integer, got 0"),
        ("threads", -1, ValueError, "threads must be a positive integer, got -1"),
        ("batch_bytes", 0, ValueError, "batch_bytes must be a positive integer, got 0"),
        ("staging_buffers", 1, ValueError, "staging_buffers must be an integer >= 2"),
        ("overwrite", "yes", TypeError, "overwrite must be True or False"),
    ],
)
def test_bad_options_are_refused_before_the_store_is_touched(tmp_path, option, value, error, message):
    path = tmp_path / "opt.zarr"
    with pytest.raises(error, match=message):
        Writer(path, small_layout(), backend="cpu", **{option: value})
    assert not path.exists()


def test_shard_epoch_larger_than_memory_is_refused(tmp_path):
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    depth = 65536
    layout = Layout([Dim("t", 0, 1, depth), Dim("x", 2**20, 2**20, 1)], "uint8")
    if depth * 2**20 <= memory // 2:
        pytest.skip("this machine has more than 128 GiB of memory")
    with pytest.raises(ValueError, match="tiles_per_shard along 't'"):
        Writer(tmp_path / "big.zarr", layout, backend="cpu")
    assert not (tmp_path / "big.zarr").exists()


def test_masked_arrays_are_refused_by_name(tmp_path):
    with Writer(tmp_path / "m.zarr", small_layout(), backend="cpu") as writer:
        with pytest.raises(TypeError, match="masked array"):
            writer.append(np.ma.masked_array(np.zeros((8, 8), np.uint16)))


# -- case 5: the store directory deleted mid-recording ---------------------------------------------
def test_deleted_store_stops_the_recording_and_is_not_recreated(tmp_path, backend):
    import shutil

    layout = small_layout()
    path = tmp_path / "gone.zarr"
    frames = frames_for(40)
    writer = Writer(path, layout, backend=backend, batch_bytes=layout.epoch_bytes)
    writer.append(frames[:4])
    writer.flush()
    shutil.rmtree(path)
    error = feed_until_error(writer, frames[4:])
    assert "deleted or moved" in str(error) and str(path) in str(error)
    assert not path.exists()  # never silently recreated with rows of zeros


# -- case 8: two writers, one store --------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_two_writers_created_at_the_same_instant_never_both_win(tmp_path, overwrite):
    from napari_tileshard.storage.errors import StoreExistsError

    layout = small_layout()
    for trial in range(30):
        path = tmp_path / f"both{trial}.zarr"
        barrier, results = threading.Barrier(2), []

        def create(value, barrier=barrier, path=path, results=results):  # bound now, not late
            barrier.wait()
            try:
                writer = Writer(path, layout, backend="cpu", overwrite=overwrite)
            except StoreExistsError as exc:
                results.append(("refused", str(exc)))
                return
            opened = time.monotonic()
            writer.append(np.full((2, 8, 8), value, np.uint16))
            writer.close()
            results.append(("won", value, opened, time.monotonic()))

        threads = [threading.Thread(target=create, args=(v,)) for v in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = sorted((r for r in results if r[0] == "won"), key=lambda r: r[2])
        if not overwrite:
            assert len(winners) == 1, (trial, results)
        else:  # a second writer may replace the store, but only after the first has closed it
            assert winners and all(a[3] <= b[2] for a, b in zip(winners, winners[1:])), (trial, results)
        data = read_back(path)
        assert data.shape == (2, 8, 8) and (data == winners[-1][1]).all()  # one writer's rows only


def test_record_overwrite_while_another_record_runs_is_refused(tmp_path):
    import sys

    path = tmp_path / "busy.zarr"
    record = [
        sys.executable,
        "-m",
        "napari_tileshard",
        "record",
        str(path),
        "--shape",
        "0,64,64",
        "--tile",
        "2,32,32",
        "--tiles-per-shard",
        "1,1,1",
        "--backend",
        "cpu",
        "--no-progress",
    ]
    first = subprocess.Popen(record + ["--frames", "100000", "--fps", "200"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (path / "c").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run(record + ["--frames", "10", "--overwrite"], capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert f"pid {first.pid}" in second.stderr, second.stderr
        assert first.poll() is None  # the first recording is untouched and still going
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=30)
    report = verify(path)
    assert report.ok or all("were never written" not in p.message for p in report.problems), str(report)
    rows = zarr.open_array(path, mode="r").shape[0]
    assert rows > 0


# -- loops of trials (the issue asks for >= 30 where timing decides) -----------------------------
@pytest.fixture
def tiny_tmpfs(tmpfs):
    return tmpfs("1m", "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("ome", [False, True])
def test_real_disk_full_never_claims_a_missing_shard_in_30_trials(tiny_tmpfs, ome):
    """A real 1 MiB tmpfs filled up 30 times (random data, several I/O threads, flushes or not):
    every row the store claims is exact, every shard it needs exists."""
    import shutil

    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 64, 32, 1), Dim("x", 64, 32, 1)], "uint16")
    for trial in range(30):
        path = tiny_tmpfs / f"t{trial}.zarr"
        rng = np.random.default_rng(trial)
        frames = rng.integers(0, 65535, size=(400, 64, 64), dtype=np.uint16)
        writer = Writer(
            path,
            layout,
            backend="cpu",
            batch_bytes=layout.epoch_bytes * int(rng.integers(1, 4)),
            io_threads=int(rng.integers(1, 5)),
            ome=ome,
            max_levels=2,
        )
        feed_until_error(writer, frames, flush_every=int(rng.integers(0, 3)) * 7)
        array = zarr.open_array(path / "0" if ome else path, mode="r")
        rows = array.shape[0]
        np.testing.assert_array_equal(array[:], frames[:rows])
        report = verify(path)
        assert not [p for p in report.problems if "state" not in p.message], (trial, str(report))
        shutil.rmtree(path)


@pytest.mark.slow
def test_flush_race_with_slow_shards_in_30_trials(tmp_path):
    layout = small_layout()
    for trial in range(30):
        path = tmp_path / f"race{trial}.zarr"
        slow = f"c/{trial % 3}/{trial % 2}/{(trial // 2) % 2}"
        sink = ClaimChecker(path, {"": layout}, delay={slow: 0.1})
        frames = frames_for(9, seed=trial)
        with Writer(sink, layout, backend="cpu", batch_bytes=layout.epoch_bytes, io_threads=3) as writer:
            for start in range(0, 9, 3):
                writer.append(frames[start : start + 3])
                writer.flush()
        assert not sink.violations, (trial, sink.violations)
        np.testing.assert_array_equal(read_back(path), frames)
