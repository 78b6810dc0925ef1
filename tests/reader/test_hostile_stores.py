"""Hostile and broken stores: verify, the napari reader and the inspector never block, never
allocate what a store merely declares, never read outside the store, and say what they found.

Calls that would hang or eat memory on an unprotected reader run in a child process with an
address-space limit and a per-call deadline, so a regression fails the test instead of the
machine.
"""

import json
import os
import subprocess
import sys
import textwrap

import crc32c
import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer, verify
from napari_tileshard.apps.inspect_shards import EMPTY_CHUNK, inspect_array
from napari_tileshard.apps.napari_reader import FirstRows, napari_get_reader, open_lazy

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs, /dev/zero and symlinks are POSIX")


def write_store(path, codec="zstd", frames=8, layout=None, data=None):
    layout = layout or Layout([Dim("t", 0, 2, 2), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
    if data is None:
        data = SyntheticCamera(layout.shape[1:], "uint16", seed=3).stack(frames)
    with Writer(path, layout, backend="cpu", codec=codec) as writer:
        writer.append(data)
    return path


def edit_metadata(path, change):
    meta = json.loads((path / "zarr.json").read_text())
    change(meta)
    (path / "zarr.json").write_text(json.dumps(meta))


def read_index(shard, chunks):
    raw = shard.read_bytes()
    return raw, np.frombuffer(raw[-(chunks * 16 + 4) : -4], "<u8").reshape(chunks, 2).copy()


def write_index(shard, raw, index):
    body = np.ascontiguousarray(index, "<u8").tobytes()
    shard.write_bytes(raw[: len(raw) - len(body) - 4] + body + crc32c.crc32c(body).to_bytes(4, "little"))


# -- a child process with a memory ceiling and a deadline per call -------------------------------
_CHILD = textwrap.dedent("""
    import json, os, resource, sys, threading, time, tracemalloc
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from napari_tileshard import verify
    from napari_tileshard.apps.napari_reader import napari_get_reader
    from napari_tileshard.apps.inspect_shards import inspect_array

    def summary(name, value):
        if name == "verify":
            return {"ok": value.ok, "text": str(value), "shards": value.shards, "chunks": value.chunks}
        if name == "inspect_array":
            return {"shards": len(value.shards), "map": list(value.chunk_bytes.shape), "notes": value.notes}
        return repr(value)

    def probe(name, call):
        out = {}
        def run():
            tracemalloc.start()
            try:
                out["result"] = summary(name, call())
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            out["peak"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        start = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(float(sys.argv[3]))
        return {"finished": not thread.is_alive(), "seconds": time.monotonic() - start, **out}

    path = sys.argv[1]
    calls = {"verify": lambda: verify(path), "napari_get_reader": lambda: napari_get_reader(path),
             "inspect_array": lambda: inspect_array(path)}
    results = {}
    for name in sys.argv[4].split(","):
        results[name] = probe(name, calls[name])
        if not results[name]["finished"]:
            break  # a blocked call keeps its thread: later calls would only measure that
    print(json.dumps(results), flush=True)
    os._exit(0)
""")


def probe(path, calls=("verify", "napari_get_reader", "inspect_array"), deadline_s=5.0, memory=3 << 30):
    """Run each call on ``path`` in a child limited to ``memory`` bytes of address space; per
    call: finished (within ``deadline_s``), seconds, result or error, tracemalloc peak."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(memory), str(deadline_s), ",".join(calls)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"child failed (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(lines[-1])


# -- 12: zarr.json that is a FIFO, a symlink to /dev/zero, huge, or nested too deeply ---------------
HOSTILE_METADATA = {
    "fifo": "FIFO",
    "dev_zero": "symlink to outside the store",
    "deep_json": "nested too deeply",
    "sparse_1GiB": "larger than the 16 MiB",
}


def make_hostile_metadata(path, kind):
    meta = path / "zarr.json"
    meta.unlink()
    if kind == "fifo":
        os.mkfifo(meta)
    elif kind == "dev_zero":
        meta.symlink_to("/dev/zero")
    elif kind == "deep_json":
        meta.write_text("[" * 100_000)
    else:  # a regular file that claims 1 GiB (sparse: no disk used)
        with open(meta, "wb") as f:
            f.write(b'{"zarr_format": 3, "node_type": "array", "attributes": {"pad": "')
            f.truncate(1 << 30)


@posix_only
@pytest.mark.parametrize("kind", list(HOSTILE_METADATA))
def test_hostile_zarr_json_neither_blocks_nor_allocates(tmp_path, kind):
    path = write_store(tmp_path / f"{kind}.zarr")
    make_hostile_metadata(path, kind)
    results = probe(path)
    for name, result in results.items():
        assert result["finished"] and result["seconds"] < 5, f"{name} did not return: {result}"
        assert result["peak"] < 64 << 20, f"{name} allocated {result['peak']} bytes"
    reader = results["napari_get_reader"]
    assert reader.get("error") is None and reader["result"] == "None"  # napari tries other readers
    report = results["verify"]["result"]
    assert not report["ok"] and "zarr.json" in report["text"] and HOSTILE_METADATA[kind] in report["text"]
    inspected = results["inspect_array"]
    assert inspected["error"].startswith("UnsafeStoreError") and HOSTILE_METADATA[kind] in inspected["error"]
    assert str(path) in inspected["error"]  # the message names the file


@posix_only
def test_hostile_level_metadata_of_an_ome_group(tmp_path):
    """A multiscale level's zarr.json is read as carefully as the group's."""
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 16, 4, 2), Dim("x", 16, 4, 2)], "uint16")
    path = tmp_path / "ome.zarr"
    with Writer(path, layout, backend="cpu", ome=True) as writer:
        writer.append(SyntheticCamera((16, 16), "uint16", seed=1).stack(4))
    (path / "1" / "zarr.json").unlink()
    os.mkfifo(path / "1" / "zarr.json")
    results = probe(path, calls=("verify", "inspect_array"))
    assert all(r["finished"] for r in results.values()), results
    assert "FIFO" in results["verify"]["result"]["text"]
    assert "FIFO" in results["inspect_array"]["error"]
    reader = napari_get_reader(str(path))  # the group's own zarr.json is fine
    with pytest.raises(ValueError, match="FIFO"):
        reader(str(path))


# -- 13: a chunk offset that wraps around 2^64; implausible chunk sizes -----------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_offset_wrapping_around_2_64_is_a_problem(tmp_path):
    path = write_store(tmp_path / "wrap.zarr", codec="none")
    shard = path / "c/0/0/0"
    raw, index = read_index(shard, 2)
    index[1, 0] = 2**64 - 8  # + 64 bytes wraps to 56: inside the data in uint64 arithmetic
    write_index(shard, raw, index)
    with pytest.raises(Exception):  # noqa: B017 - the premise: zarr-python cannot read it
        zarr.open_array(path, mode="r")[2:4]
    report = verify(path)
    assert [(p.key, p.chunk) for p in report.problems] == [("c/0/0/0", 1)], str(report)
    assert "lies outside the shard data" in report.problems[0].message
    assert str(2**64 - 8) in report.problems[0].message


def test_raw_chunk_of_the_wrong_size_and_oversized_zstd_chunk(tmp_path):
    raw_store = write_store(tmp_path / "raw.zarr", codec="none")
    shard = raw_store / "c/1/0/0"
    raw, index = read_index(shard, 2)
    index[0, 1] -= 2  # a raw chunk must hold exactly one tile
    write_index(shard, raw, index)
    problems = verify(raw_store).problems
    assert [(p.key, p.chunk) for p in problems] == [("c/1/0/0", 0)] and "a tile is 64" in problems[0].message

    noise = np.random.default_rng(0).integers(0, 65535, (8, 8, 8), dtype=np.uint16)  # incompressible
    zstd_store = write_store(tmp_path / "zstd.zarr", data=noise)
    shard = zstd_store / "c/0/0/0"
    raw, index = read_index(shard, 2)
    data_end = len(raw) - (2 * 16 + 4)
    index[0] = (0, data_end)  # both chunks as one: more than zstd can make of one 64-byte tile
    write_index(shard, raw, index)
    problems = verify(zstd_store).problems
    assert [(p.key, p.chunk) for p in problems] == [("c/0/0/0", 0)]
    assert "more than zstd makes of one tile of 64 bytes" in problems[0].message


def test_zstd_frame_declaring_a_huge_size_is_not_decoded(tmp_path):
    import zstandard

    path = write_store(tmp_path / "bomb.zarr")
    shard = path / "c/0/0/0"
    raw, index = read_index(shard, 2)
    # a frame that really decodes to 64 MiB (of zeros) but takes a few KiB
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))
    head = raw[: len(raw) - (2 * 16 + 4)]
    index[1] = (len(head), len(bomb))
    write_index(shard, head + bomb + bytes(2 * 16 + 4), index)
    import tracemalloc

    tracemalloc.start()
    report = verify(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [(p.key, p.chunk) for p in report.problems] == [("c/0/0/0", 1)]
    assert peak < 16 << 20


# -- 14: memory follows what is on disk, not what is declared --------------------------------------
@posix_only
def test_sparse_1GiB_shard_is_verified_chunk_by_chunk(tmp_path):
    path = write_store(tmp_path / "sparse.zarr")
    shard = path / "c/0/0/0"
    raw = shard.read_bytes()
    index_bytes = 2 * 16 + 4
    with open(shard, "wb") as f:  # chunks at the start, a 1 GiB hole, the (unchanged) index at the end
        f.write(raw[:-index_bytes])
        f.truncate((1 << 30) - index_bytes)
        f.seek(0, os.SEEK_END)
        f.write(raw[-index_bytes:])
    assert shard.stat().st_size == 1 << 30
    result = probe(path, calls=("verify", "inspect_array"), deadline_s=60)
    report = result["verify"]
    assert report["finished"] and report["result"]["ok"], report
    assert report["result"]["chunks"] == 16 and report["peak"] < 100 << 20, report["peak"]
    assert result["inspect_array"]["peak"] < 100 << 20


def test_store_objects_are_read_by_range_never_whole(tmp_path):
    """A zarr Store (not a local path): index by one suffix read, chunks by ranges (read ahead
    in bounded windows), never a whole-shard get; a corrupted chunk is still found."""
    from zarr.abc.store import SuffixByteRequest
    from zarr.buffer import default_buffer_prototype
    from zarr.core.sync import sync
    from zarr.storage import MemoryStore

    gets = []

    class RecordingStore(MemoryStore):
        async def get(self, key, prototype=None, byte_range=None):
            gets.append((key, byte_range))
            return await super().get(key, prototype, byte_range)

        async def getsize(self, key):  # as remote stores do (the base class would get() it whole)
            return len(self._store_dict[key])

    store = RecordingStore()
    write_store(store)
    key = "c/0/0/0"
    raw = bytearray(sync(store.get(key, default_buffer_prototype())).to_bytes())
    index = np.frombuffer(bytes(raw[-36:-4]), "<u8").reshape(2, 2)
    raw[int(index[1, 0]) + 5] ^= 0xFF  # as in test_verify_cli: the frame header and data of chunk 1
    raw[int(index[1, 0]) + int(index[1, 1]) // 2] ^= 0xFF
    sync(store.set(key, default_buffer_prototype().buffer.from_bytes(bytes(raw))))
    gets.clear()
    report = verify(store)
    assert [(p.key, p.chunk) for p in report.problems] == [(key, 1)] and report.shards == 8
    shard_gets = [(k, r) for k, r in gets if k.startswith("c/")]
    assert shard_gets and all(r is not None for _, r in shard_gets)  # never a whole object
    assert sum(isinstance(r, SuffixByteRequest) for _, r in shard_gets) == 8  # one index read per shard


@pytest.mark.parametrize("dim", [0, 1])
def test_inspector_map_is_sized_by_the_shards_that_exist(tmp_path, dim):
    path = write_store(tmp_path / "huge.zarr")

    def huge(meta):
        meta["shape"][dim] = 2**31

    edit_metadata(path, huge)
    result = probe(path, calls=("inspect_array", "verify"))
    inspected = result["inspect_array"]
    assert inspected["finished"] and inspected.get("error") is None, inspected
    assert inspected["peak"] < 16 << 20
    assert inspected["result"]["shards"] == 8 and inspected["result"]["map"] == [4, 2, 2]
    assert result["verify"]["peak"] < 16 << 20


def test_inspector_map_above_its_cap_is_cut_and_says_so(tmp_path, monkeypatch):
    from napari_tileshard.apps import inspect_shards

    path = write_store(tmp_path / "cap.zarr")
    monkeypatch.setattr(inspect_shards, "MAX_MAP_CHUNKS", 8)  # the map would be 4 x 2 x 2 = 16
    result = inspect_array(path)
    assert result.chunk_bytes.shape == (2, 2, 2) and len(result.shards) == 8
    assert result.covered_shape == (4, 8, 8) and result.shape == (8, 8, 8)
    assert any("MAX_MAP_CHUNKS" in note for note in result.notes)
    monkeypatch.setattr(inspect_shards, "MAX_MAP_CHUNKS", 2)  # not even one chunk row fits
    with pytest.raises(ValueError, match="MAX_MAP_CHUNKS = 2"):
        inspect_array(path)


# -- 15: symlinks out of the store are reported, never read ------------------------------------------
@posix_only
def test_shard_symlinked_outside_is_reported_not_read(tmp_path):
    path = write_store(tmp_path / "s.zarr")
    outside = tmp_path / "elsewhere.bin"
    shard = path / "c/0/0/0"
    outside.write_bytes(shard.read_bytes())  # a perfectly valid shard, but not this store's
    shard.unlink()
    shard.symlink_to(outside)
    report = verify(path)
    assert [(p.key, p.chunk, p.message) for p in report.problems] == [
        ("c/0/0/0", None, "symlink to outside the store, not read")
    ]
    assert report.shards == 7
    result = inspect_array(path)
    assert "c/0/0/0" not in [s.key for s in result.shards] and len(result.shards) == 7
    assert any("c/0/0/0" in n and "outside the store" in n for n in result.notes)
    assert (result.chunk_bytes[0:2, 0, 0] == EMPTY_CHUNK).all()


@posix_only
def test_chunk_directory_symlinked_outside_is_reported_not_read(tmp_path):
    path = write_store(tmp_path / "d.zarr")
    (path / "c").rename(tmp_path / "outside-c")
    (path / "c").symlink_to(tmp_path / "outside-c")
    report = verify(path)
    assert [(p.key, p.message) for p in report.problems] == [("c", "symlink to outside the store, not read")]
    assert report.shards == 0
    result = inspect_array(path)
    assert result.shards == [] and any("outside the store" in n for n in result.notes)


@posix_only
def test_special_files_and_inside_symlinks_among_shards(tmp_path):
    path = write_store(tmp_path / "f.zarr")
    os.mkfifo(path / "c/0/0/7")  # not a key of this array's grid, and a FIFO
    shard = path / "c/1/0/0"
    (path / "copy").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(path / "copy")  # a symlink that stays inside the store is read
    report = verify(path)
    assert [(p.key, p.message) for p in report.problems] == [("c/0/0/7", "a FIFO, not a regular file: not read")]
    assert report.shards == 8


@posix_only
def test_reader_store_does_not_follow_symlinks_out(tmp_path):
    """napari reads chunks through the reader's store: a shard symlinked outside is an error,
    not someone else's data on screen."""
    path = write_store(tmp_path / "r.zarr")
    outside = tmp_path / "other.bin"
    shard = path / "c/0/0/0"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    array, _ = open_lazy(path)
    with pytest.raises(ValueError, match="outside the store"):
        np.asarray(array[0])
    np.testing.assert_array_equal(array[4], SyntheticCamera((8, 8), "uint16", seed=3).stack(8)[4])


@posix_only
def test_shard_reader_opens_shards_as_safely_as_open_local_file(tmp_path):
    """ShardReader opens shards relative to the store's directories (LocalFiles): a shard or a
    directory symlinked outside the store and a FIFO are refused, a symlink inside is followed,
    a missing shard is fill value; the same after the directories are held open.  A reader that
    read the shards before they were swapped reads the versions it opened (checked then, and kept
    open), as the indexes it cached, until ``refresh``."""
    from napari_tileshard import ShardReader
    from napari_tileshard.storage.safe_read import UnsafeStoreError

    data = SyntheticCamera((8, 8), "uint16", seed=3).stack(16)
    path = write_store(tmp_path / "r.zarr", frames=16)  # shards c/0 .. c/3 of 4 frames each
    reader = ShardReader(path, backend="cpu")
    np.testing.assert_array_equal(reader[...], data)  # every directory opened and held
    (path / "c/1/0/0").rename(path / "inside.bin")
    (path / "c/1/0/0").symlink_to(path / "inside.bin")  # inside the store: followed
    (tmp_path / "other.bin").write_bytes((path / "c/2/0/0").read_bytes())
    (path / "c/2/0/0").unlink()
    (path / "c/2/0/0").symlink_to(tmp_path / "other.bin")  # outside: refused
    (path / "c/3/0/0").unlink()
    os.mkfifo(path / "c/3/0/0")  # a FIFO: refused, never opened for reading
    (path / "c/0/0/0").unlink()  # missing: fill value
    np.testing.assert_array_equal(reader[8:16], data[8:16])  # the files it opened and kept: never the FIFO
    for fresh in (False, True):  # the directories held open since the first read, then a new reader
        reader = ShardReader(path, backend="cpu") if fresh else reader
        reader.refresh()
        np.testing.assert_array_equal(reader[4:8], data[4:8])
        with pytest.raises(UnsafeStoreError, match="outside the store"):
            reader[9]
        with pytest.raises(UnsafeStoreError, match="FIFO"):
            reader[13]
    missing = reader[0:4]
    assert (missing[:, 0:4, 0:4] == 0).all()  # shard c/0/0/0: the top-left 4 x 4 of frames 0..3
    np.testing.assert_array_equal(missing[:, 4:], data[0:4, 4:])
    (path / "c/2").rename(tmp_path / "outside-c2")
    (path / "c/2").symlink_to(tmp_path / "outside-c2", target_is_directory=True)  # a directory outside
    with pytest.raises(UnsafeStoreError, match="outside the store"):
        ShardReader(path, backend="cpu")[9]


@posix_only
def test_a_shard_replaced_after_its_index_was_read_is_read_as_the_version_indexed(tmp_path):
    """A shard replaced (written anew and renamed over, as a recording rewrites one) after a
    reader read its index: its chunks are read from the version whose index the reader holds
    (the descriptor it opened then), not from the new file at the old file's offsets (a failed
    decode or another shard's bytes); after ``refresh`` the new version."""
    from napari_tileshard import ShardReader

    old = SyntheticCamera((8, 8), "uint16", seed=3).stack(8)
    new = SyntheticCamera((8, 8), "uint16", seed=9).stack(8) // 7  # other bytes, other chunk sizes
    path = write_store(tmp_path / "r.zarr", data=old)
    other = write_store(tmp_path / "other.zarr", data=new)
    reader = ShardReader(path, backend="cpu")
    np.testing.assert_array_equal(reader[...], old)
    for shard in sorted(p.relative_to(other) for p in (other / "c").rglob("*") if p.is_file()):
        os.replace(other / shard, path / shard)
    np.testing.assert_array_equal(reader[...], old)
    reader.refresh()
    np.testing.assert_array_equal(reader[...], new)


# -- 6 (reader side): the Writer's record of the rows written ------------------------------------
def recorded(path, rows, state):
    def change(meta):
        meta["attributes"]["tileshard"] = {"rows_written": rows, "state": state}

    edit_metadata(path, change)


def test_bounded_array_with_unwritten_rows(tmp_path):
    layout = Layout([Dim("z", 10, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")
    frames = SyntheticCamera((8, 8), "uint16", seed=4).stack(10)
    path = write_store(tmp_path / "bounded.zarr", layout=layout, data=frames)
    recorded(path, 4, "failed")  # as after a crash: the shape is the declared size from the start
    report = verify(path)
    assert [(p.key, p.message) for p in report.problems] == [
        ("zarr.json", "rows 4..9 of 10 were never written (recording state: failed)")
    ]
    [(data, meta, kind)] = napari_get_reader(str(path))(str(path))
    assert data.shape == (4, 8, 8) and kind == "image"
    assert "rows 4..9 were never written" in meta["metadata"]["unwritten_rows"]
    np.testing.assert_array_equal(np.asarray(data), frames[:4])
    np.testing.assert_array_equal(data[-1], frames[3])
    with pytest.raises(IndexError):
        data[4]
    array, names = open_lazy(path)
    assert array.shape == (4, 8, 8) and names == ["z", "y", "x"]
    recorded(path, 10, "complete")
    assert verify(path).ok
    [(data, meta, _)] = napari_get_reader(str(path))(str(path))
    assert data.shape == (10, 8, 8) and "unwritten_rows" not in meta["metadata"]


def test_recording_state_is_a_note_not_a_problem(tmp_path):
    path = write_store(tmp_path / "live.zarr", frames=4)
    recorded(path, 4, "recording")  # unbounded: shape[0] is what was written
    report = verify(path)
    assert report.ok and any("recording state 'recording'" in n for n in report.notes)
    assert "note: zarr.json: recording state 'recording'" in str(report)


def test_arrays_without_the_record_and_malformed_records(tmp_path):
    path = write_store(tmp_path / "other.zarr")
    edit_metadata(path, lambda meta: meta["attributes"].pop("tileshard", None))
    report = verify(path)
    assert report.ok and not report.notes
    assert napari_get_reader(str(path))(str(path))[0][0].shape == (8, 8, 8)
    recorded(path, "many", "recording")
    assert [p.key for p in verify(path).problems] == ["zarr.json"]
    assert napari_get_reader(str(path))(str(path))[0][0].shape == (8, 8, 8)  # shown as it is


def test_ome_levels_show_only_their_written_rows(tmp_path):
    layout = Layout([Dim("t", 8, 2, 1), Dim("y", 16, 4, 2), Dim("x", 16, 4, 2)], "uint16")
    path = tmp_path / "ome.zarr"
    frames = SyntheticCamera((16, 16), "uint16", seed=2).stack(8)
    with Writer(path, layout, backend="cpu", ome=True, downsample_dims=("y", "x")) as writer:
        writer.append(frames)
    levels = [str(k) for k in range(writer.pyramid.levels)]
    for level in levels:
        recorded(path / level, 6, "failed")
    report = verify(path)
    assert {p.key for p in report.problems} == {f"{k}/zarr.json" for k in levels}
    [(levels, meta, _)] = napari_get_reader(str(path))(str(path))
    assert [lv.shape[0] for lv in levels] == [6] * len(levels) and meta["multiscale"]
    assert "level 0: showing rows 0..5 of 8" in meta["metadata"]["unwritten_rows"]
    np.testing.assert_array_equal(np.asarray(levels[0]), frames[:6])


def test_first_rows_indexing():
    base = np.arange(10 * 3).reshape(10, 3)
    view = FirstRows(zarr.array(base), 4)
    assert view.shape == (4, 3) and len(view) == 4 and view.size == 12
    np.testing.assert_array_equal(np.asarray(view), base[:4])
    np.testing.assert_array_equal(view[1:], base[1:4])
    np.testing.assert_array_equal(view[-1], base[3])
    np.testing.assert_array_equal(view[::-1], base[:4][::-1])
    np.testing.assert_array_equal(view[..., 2], base[:4, 2])
    np.testing.assert_array_equal(view[[0, -1]], base[[0, 3]])
    for bad in (4, -5, [4]):
        with pytest.raises(IndexError):
            view[bad]


# -- grids that zarr-python divides by, level paths that leave the group, aliased shards ------------
def _set_inner(value):
    def change(meta):
        meta["codecs"][0]["configuration"]["chunk_shape"][1] = value

    return change


def _set_outer(value):
    def change(meta):
        meta["chunk_grid"]["configuration"]["chunk_shape"][1] = value

    return change


@pytest.mark.parametrize(
    "change, named",
    [
        (_set_inner(0), "the sharding codec's chunk shape [2, 0, 4]"),
        (_set_inner(-4), "the sharding codec's chunk shape [2, -4, 4]"),
        (_set_outer(0), "the chunk grid's chunk shape [4, 0, 4]"),
        (_set_outer(2.5), "the chunk grid's chunk shape [4, 2.5, 4]"),
    ],
)
def test_a_grid_of_zeros_is_a_clear_error_in_every_reader(tmp_path, change, named):
    """An inner chunk shape of 0 raised ZeroDivisionError from zarr-python at open; a shard grid
    of 0 opened and raised it at the first read."""
    path = write_store(tmp_path / "g.zarr")
    edit_metadata(path, change)
    from napari_tileshard import ShardReader

    message = f"{path}/zarr.json: {named} is not a list of integers >= 1: not read"
    for read in (
        lambda: ShardReader(path)[...],
        lambda: np.asarray(napari_get_reader(str(path))(str(path))[0][0][0]),
        lambda: inspect_array(path),
    ):
        with pytest.raises(ValueError) as caught:
            read()
        assert str(caught.value) == message
    report = verify(path)
    assert not report.ok and named in str(report)


def test_an_ome_level_path_leaving_the_group_is_named(tmp_path):
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 16, 4, 2), Dim("x", 16, 4, 2)], "uint16")
    path = tmp_path / "ome.zarr"
    with Writer(path, layout, backend="cpu", ome=True) as writer:
        writer.append(SyntheticCamera((16, 16), "uint16", seed=1).stack(4))
    edit_metadata(path, lambda meta: meta["attributes"]["ome"]["multiscales"][0]["datasets"][0].update(path="../x"))
    from napari_tileshard import ShardReader

    said = "OME-Zarr multiscale dataset path '../x' is not inside the group"
    readers = (lambda: ShardReader(path), lambda: napari_get_reader(str(path))(str(path)), lambda: inspect_array(path))
    for read in readers:
        with pytest.raises(ValueError, match=said):  # was: "a group without OME-Zarr multiscales"
            read()
    assert said in str(verify(path))


@posix_only
def test_a_shard_symlinked_to_another_shard_of_the_array_is_refused(tmp_path):
    """Its index and CRC are valid, so nothing else would tell that the data shown at c/1/0/0 are
    those of c/0/0/0 (zarr-python and tensorstore read it): our readers and verify refuse it."""
    from napari_tileshard import ShardReader

    path = write_store(tmp_path / "a.zarr")
    (path / "c/1/0/0").unlink()
    (path / "c/1/0/0").symlink_to(path / "c/0/0/0")
    plain = zarr.open_array(path)[...]  # what a plain reader shows: shard (1, 0, 0) is shard (0, 0, 0) again
    np.testing.assert_array_equal(plain[4:, :4, :4], plain[:4, :4, :4])
    report = verify(path)
    assert [(p.key, p.message) for p in report.problems] == [
        ("c/1/0/0", "symlink to c/0/0/0, another chunk of this array: not read")
    ]
    with pytest.raises(ValueError, match="c/1/0/0: symlink to c/0/0/0, another chunk of this array"):
        ShardReader(path)[...]
    array, _ = open_lazy(path)
    with pytest.raises(ValueError, match="another chunk of this array"):
        np.asarray(array[4])
    np.testing.assert_array_equal(array[0], SyntheticCamera((8, 8), "uint16", seed=3).stack(8)[0])
