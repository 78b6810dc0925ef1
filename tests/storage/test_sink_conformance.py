"""Every Sink of the package passes :class:`napari_tileshard.testing.SinkTests`, each read back
through the store behind it (the files, the zarr Store, fsspec's filesystem, boto3 for S3)."""

from __future__ import annotations

import asyncio
import inspect
import os
import textwrap
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from s3_server import KEY, SECRET
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore, MemoryStore

from napari_tileshard.apps.convert import _EpochSink
from napari_tileshard.engine.multi_writer import PrefixedSink
from napari_tileshard.storage.sinks import DirectorySink, Sink, ZarrStoreSink, byte_views, check_key
from napari_tileshard.storage.urls import open_sink
from napari_tileshard.testing import FaultInjectingSink, SinkTests


# -- local directories -------------------------------------------------------------------------
class LocalFiles:
    """read/put/list_keys for a sink whose objects are files under ``directory(sink)``."""

    def directory(self, sink) -> Path:
        return Path(sink.root)

    def stored_key(self, key: str) -> str:
        return key

    def read(self, sink, key):
        path = self.directory(sink) / self.stored_key(key)
        return path.read_bytes() if path.is_file() else None

    def put(self, sink, key, data):
        path = self.directory(sink) / self.stored_key(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def list_keys(self, sink):
        top = self.directory(sink)
        return [
            (Path(folder) / name).relative_to(top).as_posix() for folder, _, names in os.walk(top) for name in names
        ]


class TestDirectorySink(LocalFiles, SinkTests):
    @pytest.fixture
    def sink(self, tmp_path):
        return DirectorySink(tmp_path / "run.zarr")


class TestFaultInjectingSink(LocalFiles, SinkTests):
    """The fault injector without faults is the sink it wraps."""

    @pytest.fixture
    def sink(self, tmp_path):
        return FaultInjectingSink(tmp_path / "run.zarr")


class TestPrefixedSink(LocalFiles, SinkTests):
    """One MultiWriter stream's view into the collection's sink."""

    # A view: the MultiWriter releases or discards the whole collection through the parent; the
    # other streams still write through it, so the view's discard removes nothing.
    discard_removes_writes = False

    @pytest.fixture
    def sink(self, tmp_path):
        return PrefixedSink(DirectorySink(tmp_path / "collection.zarr"), "1")

    def directory(self, sink):
        return Path(sink.parent.root) / sink.prefix

    def test_location_names_the_stream_inside_the_collection(self, sink):
        assert sink.location == f"{sink.parent.location}/1"


EPOCH = 3


class TestEpochSink(LocalFiles, SinkTests):
    """A conversion task's view: shards under their global keys (first shard index + EPOCH)."""

    # The coordinator alone publishes zarr.json, and it holds the store: a task's sink drops the
    # metadata its Writer writes and leaves removal to the coordinator.
    stores_metadata = False
    discard_removes_writes = False

    @pytest.fixture
    def sink(self, tmp_path):
        root = tmp_path / "converted.zarr"
        root.mkdir()
        return _EpochSink(DirectorySink.attach(root), EPOCH)

    def directory(self, sink):
        return Path(sink.location)

    @staticmethod
    def shifted(key, shift):
        prefix, separator, coords = key.rpartition("c/")
        if not separator or (prefix and not prefix.endswith("/")):
            return key  # no shard key: stored as it is (by someone else)
        first, _, rest = coords.partition("/")
        return f"{prefix}c/{int(first) + shift}" + (f"/{rest}" if rest else "")

    def stored_key(self, key):
        return self.shifted(key, EPOCH)

    def list_keys(self, sink):
        return [self.shifted(key, -EPOCH) for key in super().list_keys(sink)]  # as the task's Writer names them

    def test_keys_that_are_no_shard_keys_are_refused(self, sink):
        for key in ["notes.txt", "0/abc/1", "c/x/0", "abc/0"]:
            with pytest.raises(ValueError, match="shard keys"):
                sink.write(key, [b"x"])
        assert super().list_keys(sink) == []

    def test_its_counts_add_up_under_concurrent_writes(self, sink):
        keys = [f"c/{i}/{j}" for i in range(4) for j in range(50)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda key: sink.write(key, [b"ab", b"cde"]), keys))
        assert sink.bytes == 5 * len(keys)
        assert sorted(sink.keys) == sorted(self.stored_key(key) for key in keys)


# -- zarr Stores -------------------------------------------------------------------------------
class ZarrStoreFiles:
    """read/put/list_keys through the zarr Store behind a ZarrStoreSink (its own sync methods)."""

    def read(self, sink, key):
        buffer = sink.store.get_sync(key, prototype=default_buffer_prototype())
        return None if buffer is None else buffer.to_bytes()

    def put(self, sink, key, data):
        sink.store.set_sync(key, default_buffer_prototype().buffer.from_bytes(data))

    def list_keys(self, sink):
        async def collect():
            return [key async for key in sink.store.list()]

        return asyncio.run(collect())


class TestMemoryUrlSink(ZarrStoreFiles, SinkTests):
    """``memory://``: a private MemoryStore whose coroutines run on the writing thread."""

    @pytest.fixture
    def sink(self):
        sink = open_sink("memory://")
        assert isinstance(sink, ZarrStoreSink)
        return sink


class TestSharedMemoryStoreSink(ZarrStoreFiles, SinkTests):
    """A caller's MemoryStore: written through zarr's event loop."""

    @pytest.fixture
    def sink(self):
        return ZarrStoreSink(MemoryStore())


class TestLocalStoreSink(LocalFiles, SinkTests):
    """A zarr LocalStore given to ZarrStoreSink itself (open_sink makes it a DirectorySink)."""

    @pytest.fixture
    def sink(self, tmp_path):
        return ZarrStoreSink(LocalStore(tmp_path / "local.zarr"))

    def directory(self, sink):
        return Path(sink.store.root)


class TestFsspecStoreSink(SinkTests):
    """A zarr FsspecStore over fsspec's in-memory filesystem, read through that filesystem."""

    @pytest.fixture
    def sink(self):
        store = FsspecStore.from_url(f"memory://sinktests-{uuid.uuid4().hex}/run.zarr")
        yield ZarrStoreSink(store)
        if store.fs.sync_fs.exists(store.path):
            store.fs.sync_fs.rm(store.path, recursive=True)  # fsspec's memory filesystem is global

    def read(self, sink, key):
        fs, path = sink.store.fs.sync_fs, f"{sink.store.path}/{key}"
        return fs.cat_file(path) if fs.isfile(path) else None

    def put(self, sink, key, data):
        sink.store.fs.sync_fs.pipe_file(f"{sink.store.path}/{key}", data)

    def list_keys(self, sink):
        fs, top = sink.store.fs.sync_fs, sink.store.path
        return [path[len(top) + 1 :] for path in fs.find(top)] if fs.exists(top) else []


# -- object storage ----------------------------------------------------------------------------
class S3Objects:
    """read/put/list_keys with boto3 against the moto server (``self.bucket``, ``self.prefix``)."""

    prefix = "run.zarr"

    def read(self, sink, key):
        client = self.server.client
        try:
            return client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    def put(self, sink, key, data):
        self.server.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def list_keys(self, sink):
        return [key[len(self.prefix) + 1 :] for key in self.server.keys(self.bucket, prefix=f"{self.prefix}/")]


class TestObjectStoreSink(S3Objects, SinkTests):
    """obstore against a real S3 server; the large object goes up as a multipart upload."""

    @pytest.fixture
    def sink(self, s3):
        pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
        from napari_tileshard.storage.object_store import ObjectStoreSink

        self.server, self.bucket = s3, s3.bucket
        sink = ObjectStoreSink(f"s3://{s3.bucket}/{self.prefix}", part_size=5 << 20, io_timeout=30)
        yield sink
        assert not s3.uploads_in_progress(s3.bucket), "a multipart upload was left open"

    def test_the_large_object_went_up_in_parts(self, sink):
        sink.write("c/9/9", [np.zeros(self.large_object_bytes, np.uint8)])
        assert sink.stats["multipart_objects"] == 1
        etag = self.server.client.head_object(Bucket=self.bucket, Key=f"{self.prefix}/c/9/9")["ETag"]
        assert etag.strip('"').endswith("-2")  # 6 MiB in 5 MiB parts


class TestFsspecS3StoreSink(S3Objects, SinkTests):
    """A zarr FsspecStore over s3fs (the route of ``s3://`` URLs where obstore is not installed)."""

    @pytest.fixture
    def sink(self, s3):
        pytest.importorskip("s3fs", reason="s3fs is not installed")
        self.server, self.bucket = s3, s3.bucket
        options = {"endpoint_url": s3.endpoint, "key": KEY, "secret": SECRET}
        return ZarrStoreSink(FsspecStore.from_url(f"s3://{s3.bucket}/{self.prefix}", storage_options=options))


def test_the_fault_injector_refuses_bad_input_before_injecting_a_fault(tmp_path):
    """A refused write is not an attempt: the fault seam sees only writes the real sink could take."""
    release = threading.Event()
    sink = FaultInjectingSink(tmp_path / "run.zarr", hold={"*": release})
    with pytest.raises(ValueError, match="contiguous"):
        sink.write("c/0/0", [np.zeros((4, 4))[:, ::2]])  # would wait on `hold` if it got that far
    assert sink.attempts == []


# -- a third party's sink ----------------------------------------------------------------------
class TapeSink(Sink):
    """A third party's minimal correct sink: temporary file + rename, remembers what it wrote."""

    def __init__(self, root):
        self.root = Path(root)
        self.written = set()

    @property
    def location(self):
        return str(self.root)

    def write(self, key, buffers):
        views = byte_views(check_key(key), buffers)
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as file:
                file.writelines(views)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.written.add(key)

    def discard(self):
        for key in self.written:
            (self.root / key).unlink(missing_ok=True)


class InPlaceSink(TapeSink):
    """Writes in place, piece by piece, and keeps no record: torn objects, nothing discarded."""

    def write(self, key, buffers):
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb", buffering=0) as file:
            for piece in buffers:
                file.write(piece)


def documented_example() -> dict:
    """The example of SinkTests' docstring, run as written (its ``mylab.storage`` is TapeSink here)."""
    code = textwrap.dedent(SinkTests.__doc__.split("::\n", 1)[1].split("\n\n    :meth:", 1)[0])
    assert "from mylab.storage import TapeSink\n" in code
    namespace = {"TapeSink": TapeSink}
    exec(compile(code.replace("from mylab.storage import TapeSink\n", ""), "SinkTests example", "exec"), namespace)
    return namespace


TestDocumentedExample = documented_example()["TestTapeSink"]


@pytest.mark.parametrize(
    "test",
    [
        SinkTests.test_concurrent_writers_and_readers_of_one_key_see_whole_objects,
        SinkTests.test_a_failed_write_leaves_the_previous_object_and_nothing_else,
        SinkTests.test_a_non_contiguous_piece_is_refused_and_leaves_the_previous_object,
        SinkTests.test_a_key_that_is_not_a_relative_path_is_refused,
        SinkTests.test_discard_removes_what_this_sink_wrote_and_is_idempotent,
    ],
    ids=lambda test: test.__name__,
)
def test_the_suite_fails_a_sink_that_breaks_the_promise(tmp_path, test):
    suite = TestDocumentedExample()
    wants_tmp_path = "tmp_path" in inspect.signature(test).parameters
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        test(suite, InPlaceSink(tmp_path / "run.zarr"), **({"tmp_path": tmp_path} if wants_tmp_path else {}))


def _zstd_segments(count: int) -> list:
    """Chunks as the CPU backend hands them to a sink: python-zstandard's BufferSegments."""
    import zstandard

    tiles = np.random.default_rng(3).integers(0, 40, (count, 4096), dtype=np.uint8)
    segments = np.zeros((count, 2), dtype=np.uint64)
    segments[:, 0] = np.arange(count, dtype=np.uint64) * 4096
    segments[:, 1] = 4096
    out = zstandard.ZstdCompressor(level=1).multi_compress_to_buffer(
        zstandard.BufferWithSegments(tiles, segments.tobytes()), threads=1
    )
    return [out[i] for i in range(len(out))]


def test_a_directory_sink_writes_flat_pieces_as_they_are_and_every_byte_of_a_partial_writev(tmp_path, monkeypatch):
    """Chunks that are flat bytes by their type (zstd's segments, bytes) go to writev as they
    are; other pieces are checked first.  Where the OS writes part of a writev (a signal, a full
    pipe of a FUSE mount), the rest is written: here at most 1000 bytes per call."""
    from napari_tileshard.storage.sinks import flat_pieces

    chunks = _zstd_segments(9)
    pieces = [*chunks, b"", b"index"]
    assert flat_pieces("c/0", pieces) == [*chunks, b"index"]  # the same objects, empty ones left out
    mixed = flat_pieces("c/0", [b"ab", np.arange(3, dtype=np.uint16)])  # a NumPy piece: all checked
    assert all(isinstance(view, memoryview) and view.format == "B" for view in mixed)
    with pytest.raises(ValueError, match="not C-contiguous"):
        flat_pieces("c/0", [b"ab", np.zeros((4, 4), np.uint8)[:, ::2]])
    expected = b"".join(bytes(piece) for piece in pieces)
    sink = DirectorySink(tmp_path / "run.zarr")
    sink.write("c/0/0", pieces)
    real_writev = os.writev
    calls = []

    def writev_in_parts(fd, buffers):  # at most 1000 bytes per call, as a slow device may
        calls.append(len(buffers))
        data = b"".join(bytes(b) for b in buffers)[:1000]
        return real_writev(fd, [data])

    monkeypatch.setattr(os, "writev", writev_in_parts)
    sink.write("c/0/1", pieces)
    monkeypatch.undo()
    sink.release()
    assert (tmp_path / "run.zarr/c/0/0").read_bytes() == expected
    assert (tmp_path / "run.zarr/c/0/1").read_bytes() == expected
    assert len(calls) == -(-len(expected) // 1000)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform (a child imports the module afresh)")
def test_temporary_names_differ_between_a_process_and_its_forked_child():
    """Temporary file names are a per-process random part and a count: a forked child (processes
    of one conversion write into one store) draws its own part, so the same count in both
    processes still names two files."""
    from napari_tileshard.storage.overwrite import TEMP_NAME
    from napari_tileshard.storage.sinks import _temporary_token

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next name, then leave at once
        os.write(write, _temporary_token().encode())
        os._exit(0)
    os.close(write)
    mine = _temporary_token()
    os.waitpid(pid, 0)
    theirs = os.read(read, 64).decode()
    os.close(read)
    assert TEMP_NAME.fullmatch(f".c.{mine}.tmp") and TEMP_NAME.fullmatch(f".c.{theirs}.tmp")
    assert mine[:6] != theirs[:6]
