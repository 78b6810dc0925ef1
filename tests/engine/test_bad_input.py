"""Every bad input raises a clear error naming the value; the store stays readable afterwards."""

import numpy as np
import pytest
import zarr
from conftest import read_back

from napari_tileshard import Dim, Layout, Writer, WriterError, verify
from napari_tileshard.testing import FaultInjectingSink


@pytest.fixture
def layout():
    return Layout([Dim("t", 0, 2, 1), Dim("y", 6, 4, 1), Dim("x", 5, 4, 1)], "uint16")


@pytest.fixture
def writer(tmp_path, layout, backend):
    w = Writer(tmp_path / "bad.zarr", layout, backend=backend)
    w.append(np.arange(30, dtype=np.uint16).reshape(6, 5))
    yield w
    w.close()
    np.testing.assert_array_equal(read_back(tmp_path / "bad.zarr"), np.arange(30, dtype=np.uint16).reshape(1, 6, 5))
    assert verify(tmp_path / "bad.zarr").ok


@pytest.mark.parametrize(
    "value, error, message",
    [
        (np.zeros((6, 5), np.float32), TypeError, "dtype <f4 (float32), the layout holds uint16"),
        (np.zeros((6, 5), ">u2"), TypeError, "dtype >u2"),
        (np.zeros((5, 6), np.uint16), ValueError, "shape (5, 6)"),
        (np.zeros((30,), np.uint16), ValueError, "shape (30,)"),
        (np.zeros((6, 10), np.uint16)[:, ::2], ValueError, "non-contiguous"),
        ([[0] * 5] * 6, TypeError, "needs a NumPy or CuPy array, got list"),
        ("frame", TypeError, "got str"),
    ],
)
def test_append_rejects(writer, value, error, message):
    with pytest.raises(error) as info:
        writer.append(value)
    assert message in str(info.value)


def test_write_rejects_non_buffers(writer):
    with pytest.raises(TypeError, match="bytes-like"):
        writer.write(12)
    with pytest.raises(ValueError, match="C-contiguous"):
        writer.write(np.zeros((4, 4), np.uint16)[:, ::2])


def test_append_after_close(tmp_path, layout, backend):
    w = Writer(tmp_path / "c.zarr", layout, backend=backend)
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append(np.zeros((6, 5), np.uint16))
    w.close()  # closing twice is harmless


def test_existing_store_needs_overwrite(tmp_path, layout, backend):
    with Writer(tmp_path / "e.zarr", layout, backend=backend) as w:
        w.append(np.ones((6, 5), np.uint16))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        Writer(tmp_path / "e.zarr", layout, backend=backend)
    np.testing.assert_array_equal(read_back(tmp_path / "e.zarr"), np.ones((1, 6, 5)))  # untouched
    with Writer(tmp_path / "e.zarr", layout, backend=backend, overwrite=True) as w:
        w.append(np.full((6, 5), 7, np.uint16))
    np.testing.assert_array_equal(read_back(tmp_path / "e.zarr"), np.full((1, 6, 5), 7))


def test_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path, layout):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a zarr store"):
        Writer(tmp_path / "docs", layout, backend="cpu", overwrite=True)
    assert (tmp_path / "docs" / "thesis.txt").read_text() == "precious"


def test_unwritable_path(tmp_path, layout):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        Writer(tmp_path / "file", layout, backend="cpu")
    with pytest.raises(OSError):
        Writer(tmp_path / "file" / "sub.zarr", layout, backend="cpu")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"codec": "lz4"}, ValueError, "codec 'lz4'"),
        ({"level": 99}, ValueError, "got 99"),
        ({"level": 1.5}, TypeError, "got 1.5"),
        ({"backend": "tpu"}, ValueError, "backend 'tpu'"),
        ({"staging_buffers": 1}, ValueError, "got 1"),
        ({"batch_bytes": -5}, ValueError, "got -5"),
    ],
)
def test_bad_writer_options(tmp_path, layout, kwargs, error, message):
    with pytest.raises(error) as info:
        Writer(tmp_path / "o.zarr", layout, **kwargs)
    assert message in str(info.value)
    assert not (tmp_path / "o.zarr" / "zarr.json").exists()


def test_layout_must_be_a_layout(tmp_path):
    with pytest.raises(TypeError, match="Layout"):
        Writer(tmp_path / "l.zarr", [Dim("x", 4, 2)])


STORAGE_ERRORS = [(28, "No space left on device"), (13, "Permission denied"), (5, "Input/output error")]


def fail_writes(writer, sink, failing_keys, errno_, message, frame) -> Exception:
    """Make ``sink`` (the Writer's FaultInjectingSink) raise ``OSError(errno_)`` for keys matching
    the glob ``failing_keys``, then feed ``frame`` and flush until the Writer reports it; returns
    the reported exception."""
    sink.fail[failing_keys] = OSError(errno_, message)
    with pytest.raises(WriterError) as info:
        for _ in range(50):
            writer.append(frame)
            writer.flush()
    assert message in str(info.value) and str(writer.location) in str(info.value)
    return info.value


@pytest.mark.parametrize("errno_, message", STORAGE_ERRORS)
def test_storage_error_stops_the_writer_and_keeps_what_was_written(tmp_path, backend, errno_, message):
    layout = Layout([Dim("t", 0, 1, 1), Dim("x", 4, 4, 1)], "uint8")
    path = tmp_path / "fail.zarr"
    sink = FaultInjectingSink(path)
    writer = Writer(sink, layout, backend=backend, batch_bytes=1)
    writer.append(np.arange(8, dtype=np.uint8).reshape(2, 4))
    writer.flush()
    fail_writes(writer, sink, "c/*", errno_, message, np.zeros((1, 4), np.uint8))
    with pytest.raises(WriterError, match=message):
        writer.close()
    out = zarr.open_array(path, mode="r")
    assert out.shape[0] >= 2
    np.testing.assert_array_equal(out[:2], np.arange(8).reshape(2, 4))
    assert verify(path).ok


@pytest.mark.parametrize("errno_, message", STORAGE_ERRORS)
def test_metadata_write_error_keeps_the_last_published_shape(tmp_path, backend, errno_, message):
    """Publishing zarr.json fails: one clear error, close() returns promptly, and the store still
    claims only what it holds (the previous zarr.json stays: it is replaced atomically)."""
    import time

    layout = Layout([Dim("t", 0, 2, 1), Dim("x", 8, 4, 1)], "uint16")
    path = tmp_path / "meta-fail.zarr"
    sink = FaultInjectingSink(path)
    writer = Writer(sink, layout, backend=backend, batch_bytes=1)
    first = np.arange(4 * 8, dtype=np.uint16).reshape(4, 8)
    writer.append(first)
    writer.flush()
    fail_writes(writer, sink, "*zarr.json", errno_, message, np.ones((2, 8), np.uint16))
    with pytest.raises(WriterError, match=message):
        writer.append(np.ones((2, 8), np.uint16))  # stopped: no more frames accepted
    start = time.perf_counter()
    with pytest.raises(WriterError, match=message):
        writer.close()
    assert time.perf_counter() - start < 5
    out = zarr.open_array(path, mode="r")
    assert out.shape == (4, 8)  # the last published shape; later shards are unpublished, not claimed
    np.testing.assert_array_equal(out[:], first)
    report = verify(path)
    assert report.ok, str(report)
    assert not list(path.glob("**/.*.tmp"))  # no temporary file left behind


EMPTY_PATHS = ["", "   ", "\t\n", "file://", "file://  "]


@pytest.mark.parametrize("path", EMPTY_PATHS)
def test_an_empty_store_path_is_refused_everywhere_and_nothing_lands_in_the_current_directory(
    tmp_path, monkeypatch, layout, path
):
    """'' (or whitespace) used to mean the current directory: a recording into the working directory."""
    from napari_tileshard import ShardReader
    from napari_tileshard.engine.multi_writer import MultiWriter
    from napari_tileshard.storage.sinks import DirectorySink
    from napari_tileshard.storage.urls import open_sink, resolve_store

    monkeypatch.chdir(tmp_path)
    calls = [
        lambda: Writer(path, layout, backend="cpu"),
        lambda: open_sink(path),
        lambda: DirectorySink(path),
        lambda: resolve_store(path),
        lambda: MultiWriter(path, {"a": layout}, backend="cpu"),
        lambda: FaultInjectingSink(path),
        lambda: ShardReader(path),
        lambda: verify(path),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="the store path .* is empty") as info:
            call()
        assert repr(path) in str(info.value)  # the value, as given
    assert list(tmp_path.iterdir()) == []  # no lock file, no zarr.json in the working directory


def test_an_empty_path_for_the_mmcore_sink_is_refused(tmp_path, monkeypatch):
    from napari_tileshard.apps.mmcore import MDARecorder, TileShardSink

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="the store path '' is empty"):
        TileShardSink("")  # its series would have gone to /0, /1, ...
    with pytest.raises(ValueError, match="the store path ' ' is empty"):
        MDARecorder(object(), " ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [["record", ""], ["record", "  "], ["verify", ""], ["convert", "", "x.zarr"]],
    ids=["record", "record-blank", "verify", "convert"],
)
def test_the_command_line_refuses_an_empty_store_path(tmp_path, monkeypatch, capsys, argv):
    from napari_tileshard.apps.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "is empty" in err and repr(argv[1]) in err
    assert list(tmp_path.iterdir()) == []
