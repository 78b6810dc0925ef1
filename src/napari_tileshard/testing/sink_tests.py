"""The conformance suite every :class:`~napari_tileshard.storage.sinks.Sink` passes, as zarr-python
ships ``zarr.testing.store.StoreTests``: a pytest base class whose subclass says how to make the
sink and how to read the store behind it.

A third party who writes a Sink runs it like this (the class's docstring has the example), and
so does this package for each of its own sinks (``tests/storage/test_sink_conformance.py``).
The suite reads back through the sink's own store (the subclass's :meth:`SinkTests.read`: the
file, a zarr Store's ``get``, boto3 for S3), never through optional methods of the sink, and
writes keys shaped as a zarr array's (``zarr.json``, ``c/0/0``, ``1/c/2/0/1``).

Needs pytest (the ``test`` extra); importing :mod:`napari_tileshard.testing` without it only
leaves ``SinkTests`` out, as ``zarr.testing`` does.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import pytest

from ..storage.sinks import Sink

__all__ = ["SinkTests"]


class SourceFailed(Exception):
    """What :class:`FailingBuffers` raises: a caller's buffers that fail while being read."""


class FailingBuffers(Sequence):
    """A sequence of pieces whose second piece cannot be produced (it raises :class:`SourceFailed`):
    a write that fails part-way through its input."""

    def __init__(self, first: bytes):
        self.first = first

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index):
        if index == 0:
            return self.first
        if isinstance(index, int) and index < len(self):
            raise SourceFailed(f"piece {index} could not be produced")
        raise IndexError(index)


def _pattern(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


#: pieces of every kind a caller may pass, and the bytes they stand for
_ARRAY = np.arange(24, dtype=np.uint16).reshape(4, 6)
_FLOATS = np.linspace(0, 1, 7, dtype=np.float32)
BUFFER_KINDS: dict[str, tuple[Callable[[], list], bytes]] = {
    "bytes": (lambda: [b"tile-shard"], b"tile-shard"),
    "bytearray": (lambda: [bytearray(b"abc"), bytearray(b"def")], b"abcdef"),
    "memoryview": (lambda: [memoryview(b"0123456789")[2:7]], b"23456"),
    "uint8-array": (lambda: [np.arange(5, dtype=np.uint8)], bytes(range(5))),
    "uint16-array-2d": (lambda: [_ARRAY], _ARRAY.tobytes()),
    "float32-array": (lambda: [_FLOATS], _FLOATS.tobytes()),
    "big-endian-array": (lambda: [np.arange(3, dtype=">u4")], np.arange(3, dtype=">u4").tobytes()),
    "contiguous-rows-of-an-array": (lambda: [_ARRAY[1:3]], _ARRAY[1:3].tobytes()),
    "read-only-array": (lambda: [np.frombuffer(b"ro-data", np.uint8)], b"ro-data"),
    "mixed-with-empty-pieces": (
        lambda: [b"", b"head", bytearray(), np.arange(2, dtype=np.int16), memoryview(b""), b"tail", np.empty(0)],
        b"head" + np.arange(2, dtype=np.int16).tobytes() + b"tail",
    ),
}

#: pieces that are not C-contiguous: refused (ValueError), never copied in some order
NON_CONTIGUOUS: dict[str, Callable[[], Any]] = {
    "strided-columns": lambda: _ARRAY[:, ::2],
    "fortran-order": lambda: np.asfortranarray(_ARRAY),
    "strided-memoryview": lambda: memoryview(b"abcdefgh")[::2],
}

#: pieces that are no bytes-like object (TypeError)
NOT_BYTES: dict[str, Any] = {"str": "text", "None": None, "int": 3, "list-of-ints": [1, 2, 3]}

#: keys no sink accepts (ValueError): a local sink would write outside its store.  (An absolute
#: key is tried too, inside the test's own tmp_path: a sink that took it writes nowhere else.)
BAD_KEYS = ["", "c/0/", "c//0", "../c/0", "c/../../0", "c/./0", "."]


class SinkTests:
    """Conformance tests for a :class:`~napari_tileshard.storage.sinks.Sink`: subclass it (name the
    subclass ``Test...``), give a ``sink`` fixture (a fresh sink over an empty store) and
    :meth:`read` (the object under a key, read from the store behind the sink)::

        import pytest
        from napari_tileshard.testing import SinkTests
        from mylab.storage import TapeSink


        class TestTapeSink(SinkTests):
            @pytest.fixture
            def sink(self, tmp_path):
                return TapeSink(tmp_path / "run.zarr")

            def read(self, sink, key):
                path = sink.root / key
                return path.read_bytes() if path.is_file() else None

    :meth:`put` (an object someone else put in the store) and :meth:`list_keys` (every object
    the store holds: temporary objects left behind show up there) are optional: the tests that
    need them skip without.  An expectation that is unsound for a kind of sink is a class
    attribute its subclass switches off, with the reason in a comment.
    """

    #: the sink stores ``zarr.json`` objects.  False: it accepts and drops them (a conversion
    #: task's sink, whose coordinator alone publishes metadata); the suite then checks they are
    #: dropped.
    stores_metadata: ClassVar[bool] = True
    #: ``discard()`` removes the objects this sink wrote.  False: the sink is a view into a store
    #: another sink owns (``PrefixedSink``, a conversion task's sink), and removing is the owner's
    #: job; the suite then checks ``discard()`` removes nothing.
    discard_removes_writes: ClassVar[bool] = True
    #: size of the large object test: above an object store's smallest part size (5 MiB), so an
    #: object store sink configured with it goes through a multipart upload.
    large_object_bytes: ClassVar[int] = 6 << 20
    #: threads and keys per thread of the concurrent tests
    threads: ClassVar[int] = 8
    keys_per_thread: ClassVar[int] = 8

    # -- what a subclass provides ---------------------------------------------------------------
    @pytest.fixture
    def sink(self) -> Sink:
        """A fresh sink over an empty store (override it)."""
        raise NotImplementedError(f"{type(self).__name__} must define a 'sink' fixture")

    def read(self, sink: Sink, key: str) -> bytes | None:
        """The bytes of object ``key`` (the key given to ``sink.write``) as the store behind the
        sink holds them, None when it holds none; read without the sink's own methods."""
        raise NotImplementedError(f"{type(self).__name__} must define read(sink, key)")

    def put(self, sink: Sink, key: str, data: bytes) -> None:
        """Put an object under ``key`` into the store behind ``sink`` without the sink (someone
        else's object).  Optional."""
        pytest.skip(f"{type(self).__name__} defines no put(sink, key, data)")

    def list_keys(self, sink: Sink) -> list[str]:
        """Every object the store behind ``sink`` holds under its location (hidden and temporary
        ones included), named as ``sink.write`` names them (relative to the location).  Optional."""
        pytest.skip(f"{type(self).__name__} defines no list_keys(sink)")

    # -- helpers ---------------------------------------------------------------------------------
    def _listing(self, sink: Sink) -> set[str] | None:
        try:
            return set(self.list_keys(sink))
        except pytest.skip.Exception:
            return None

    def _expected_metadata(self, data: bytes) -> bytes | None:
        return data if self.stores_metadata else None

    # -- the object model ------------------------------------------------------------------------
    def test_is_a_sink_with_a_location(self, sink):
        assert isinstance(sink, Sink)
        location = sink.location
        assert isinstance(location, str) and location.strip(), f"location must name the store, got {location!r}"
        sink.write("c/0/0", [b"x"])
        assert sink.location == location, "the location changed when an object was written"

    def test_write_then_read_back(self, sink):
        data = _pattern(4096, 1)
        sink.write("c/0/0/0", [data])
        assert self.read(sink, "c/0/0/0") == data

    def test_pieces_of_every_kind_are_concatenated(self, sink):
        keys = {kind: f"c/1/{index}" for index, kind in enumerate(BUFFER_KINDS)}
        for kind, (make, _) in BUFFER_KINDS.items():
            sink.write(keys[kind], make())
        read = {kind: self.read(sink, key) for kind, key in keys.items()}
        wrong = {kind: data for kind, data in read.items() if data != BUFFER_KINDS[kind][1]}
        assert not wrong, f"pieces read back wrong: {wrong}"

    def test_empty_pieces_make_an_empty_object(self, sink):
        cases = {"c/0/1": [], "c/0/2": [b""], "c/0/3": (b"", np.empty(0, np.uint16), bytearray(), memoryview(b""))}
        for key, pieces in cases.items():
            sink.write(key, pieces)
        assert {key: self.read(sink, key) for key in cases} == dict.fromkeys(cases, b"")

    def test_a_large_object_from_many_pieces(self, sink):
        data = _pattern(self.large_object_bytes, 2)
        # Uneven pieces, more than an iovec (writev) takes at once.
        cuts = np.unique(np.random.default_rng(3).integers(0, len(data), 1500))
        pieces = [memoryview(data)[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        sink.write("c/2/0", pieces)
        assert self.read(sink, "c/2/0") == data

    def test_writing_a_key_again_replaces_the_object(self, sink):
        sink.write("c/0/0", [_pattern(10_000, 4)])
        sink.write("c/0/0", [b"short"])  # shorter: nothing of the old object may remain
        assert self.read(sink, "c/0/0") == b"short"

    def test_nested_keys(self, sink):
        objects = {
            "c/0/0/0": b"a",
            "c/0/0/1": b"b",
            "0/c/1/2/3": b"c",
            "labels/cells/0/c/0/0": b"d",
            "3/c/0/0/0/0/0/0": b"e",
        }
        for key, data in objects.items():
            sink.write(key, [data])
        assert {key: self.read(sink, key) for key in objects} == objects

    def test_metadata_objects(self, sink):
        sink.write("zarr.json", [b'{"zarr_format": 3, "node_type": "group"}'])
        sink.write("0/zarr.json", [b'{"zarr_format": 3}'])
        assert self.read(sink, "zarr.json") == self._expected_metadata(b'{"zarr_format": 3, "node_type": "group"}')
        assert self.read(sink, "0/zarr.json") == self._expected_metadata(b'{"zarr_format": 3}')

    def test_the_caller_may_reuse_its_pieces_once_write_returns(self, sink):
        pieces: dict[str, Any] = {"c/0/0": bytearray(b"frame-one"), "c/0/1": np.arange(8, dtype=np.uint8)}
        for key, piece in pieces.items():
            before = bytes(piece)
            sink.write(key, [piece])  # one piece: a sink that keeps a reference would see the change
            memoryview(piece).cast("B")[:] = bytes(len(before))
            assert self.read(sink, key) == before, f"object {key!r} changed when the caller reused its buffer"

    # -- refused input: a clear error naming the key, and the store as it was ----------------------
    def test_a_non_contiguous_piece_is_refused_and_leaves_the_previous_object(self, sink):
        sink.write("c/0/0", [b"previous"])
        for kind, make in NON_CONTIGUOUS.items():
            with pytest.raises(ValueError, match="contiguous") as refused:
                sink.write("c/0/0", [b"head", make()])
            assert "c/0/0" in str(refused.value), f"{kind}: the error does not name the key: {refused.value}"
        assert self.read(sink, "c/0/0") == b"previous"

    def test_a_piece_that_is_not_bytes_like_is_refused(self, sink):
        for kind, piece in NOT_BYTES.items():
            with pytest.raises(TypeError) as refused:
                sink.write("c/0/3", [b"head", piece])
            assert "c/0/3" in str(refused.value), f"{kind}: the error does not name the key: {refused.value}"
        assert self.read(sink, "c/0/3") is None

    def test_one_buffer_in_place_of_the_sequence_is_refused(self, sink):
        for single in [b"abc", bytearray(b"abc"), np.ones((2, 3), np.uint8)]:
            with pytest.raises(TypeError, match="sequence") as refused:
                sink.write("c/0/4", single)
            assert "c/0/4" in str(refused.value), f"the error does not name the key: {refused.value}"
        assert self.read(sink, "c/0/4") is None

    def test_a_key_that_is_not_a_relative_path_is_refused(self, sink, tmp_path):
        before = self._listing(sink)
        for key in [*BAD_KEYS, f"{tmp_path.as_posix()}/escaped/c/0"]:
            with pytest.raises(ValueError, match=re.escape(repr(key))):
                sink.write(key, [b"escaped?"])
        wrong_types: list[Any] = [None, b"c/0", 7, ("c", "0")]
        for wrong_type in wrong_types:
            with pytest.raises(TypeError):
                sink.write(wrong_type, [b"x"])
        if before is not None:
            assert self._listing(sink) == before

    # -- atomicity ---------------------------------------------------------------------------------
    def test_a_failed_write_leaves_the_previous_object_and_nothing_else(self, sink):
        sink.write("c/0/0", [b"previous"])
        before = self._listing(sink)
        with pytest.raises(SourceFailed):
            sink.write("c/0/0", FailingBuffers(b"torn"))
        with pytest.raises(SourceFailed):
            sink.write("c/0/5", FailingBuffers(b"torn"))
        assert self.read(sink, "c/0/0") == b"previous"
        assert self.read(sink, "c/0/5") is None
        if before is not None:
            assert self._listing(sink) == before, "a failed write left an object behind"

    def test_concurrent_writers_and_readers_of_one_key_see_whole_objects(self, sink):
        key = "c/7/0"
        # Distinct sizes and contents: a torn object matches none of them.
        payloads = [bytes([fill]) * (48_000 + 7919 * fill) for fill in range(1, 9)]
        whole = set(payloads)
        writers_done = threading.Event()
        start = threading.Barrier(6)  # the readers are reading before the first write starts

        def write(first: int) -> None:
            start.wait()
            for k in range(len(payloads)):
                payload = payloads[(first + k) % len(payloads)]
                third = len(payload) // 3
                sink.write(key, [payload[:third], payload[third : 2 * third], payload[2 * third :]])

        def read() -> list[bytes]:
            start.wait()
            torn = []
            while not writers_done.is_set():
                data = self.read(sink, key)
                if data is not None and data not in whole:
                    torn.append(data)
            return torn

        with ThreadPoolExecutor(6) as pool:
            readers = [pool.submit(read) for _ in range(2)]
            try:
                for writer in [pool.submit(write, first) for first in range(4)]:
                    writer.result()
            finally:
                writers_done.set()
            torn = [data for reader in readers for data in reader.result()]
        assert not torn, f"{len(torn)} reads saw a torn object (sizes {sorted({len(d) for d in torn})[:5]})"
        assert self.read(sink, key) in whole

    def test_many_keys_written_concurrently_from_threads(self, sink):
        before = self._listing(sink)
        rng = np.random.default_rng(5)
        objects = {
            f"{thread}/c/{index}/0/1": _pattern(int(rng.integers(0, 20_000)), thread * 1000 + index)
            for thread in range(self.threads)
            for index in range(self.keys_per_thread)
        }
        keys = list(objects)

        def write(thread: int) -> None:
            for key in keys[thread :: self.threads]:  # the threads create sibling paths at once
                data = objects[key]
                sink.write(key, [data[: len(data) // 2], data[len(data) // 2 :]])

        with ThreadPoolExecutor(self.threads) as pool:
            for done in [pool.submit(write, thread) for thread in range(self.threads)]:
                done.result()
        wrong = [key for key in keys if self.read(sink, key) != objects[key]]
        assert not wrong, f"{len(wrong)} of {len(keys)} objects read back wrong, e.g. {wrong[:3]}"
        after = self._listing(sink)
        if before is not None and after is not None:
            assert after - before == set(keys), "concurrent writes left other objects behind"

    # -- the life cycle ----------------------------------------------------------------------------
    def test_release_keeps_the_objects_and_is_idempotent(self, sink):
        sink.write("c/0/0", [b"kept"])
        sink.write("zarr.json", [b"{}"])
        sink.release()
        sink.release()
        assert self.read(sink, "c/0/0") == b"kept"
        assert self.read(sink, "zarr.json") == self._expected_metadata(b"{}")

    def test_discard_removes_what_this_sink_wrote_and_is_idempotent(self, sink):
        before = self._listing(sink)
        written = {"c/0/0": b"a", "1/c/0/0": b"b", "labels/0/c/1/1": b"c"}
        for key, data in written.items():
            sink.write(key, [data])
        sink.discard()
        sink.discard()
        after = {key: self.read(sink, key) for key in written}
        if self.discard_removes_writes:
            assert after == dict.fromkeys(written), "discard() left objects this sink wrote"
            listing = self._listing(sink)
            if listing is not None and before is not None:
                assert listing <= before, f"discard() left {sorted(listing - before)}"
        else:
            assert after == written, "a sink that leaves removal to its owner removed objects"

    def test_discard_leaves_someone_elses_objects(self, sink):
        sink.write("c/0/0", [b"ours"])
        # Beside ours, in a directory (prefix) this sink made, and at the top.
        self.put(sink, "c/0/theirs", b"theirs")
        self.put(sink, "notes.txt", b"their notes")
        sink.discard()
        assert self.read(sink, "c/0/theirs") == b"theirs"
        assert self.read(sink, "notes.txt") == b"their notes"
        assert self.read(sink, "c/0/0") == (None if self.discard_removes_writes else b"ours")

    def test_cancel_never_raises_and_later_writes_still_work(self, sink):
        sink.write("c/0/0", [b"before"])
        sink.cancel()
        sink.cancel()
        sink.write("c/0/1", [b"after"])  # a late shard write, then zarr.json marked failed
        sink.write("zarr.json", [b'{"attributes": {"failed": true}}'])
        assert self.read(sink, "c/0/0") == b"before"
        assert self.read(sink, "c/0/1") == b"after"
        assert self.read(sink, "zarr.json") == self._expected_metadata(b'{"attributes": {"failed": true}}')
        sink.release()
        assert self.read(sink, "c/0/1") == b"after"
