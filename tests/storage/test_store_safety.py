"""Overwrite deletes only a store this recorder wrote, one writer per store, a vanished store is an
error, and a failed setup leaves nothing behind."""

import errno
import json
import logging
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import zarr
from threads import run_switching_often

from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.apps.cli import main
from napari_tileshard.format.metadata import metadata_bytes
from napari_tileshard.format.shard_spec import array_metadata
from napari_tileshard.storage.errors import StoreExistsError, StoreLockedError, StoreVanishedError
from napari_tileshard.storage.overwrite import LOCK_NAME
from napari_tileshard.storage.sinks import DirectorySink, ZarrStoreSink
from napari_tileshard.storage.urls import list_shard_keys
from napari_tileshard.testing import InterruptAt

LAYOUT = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint16")


def record(store, ome=False, frames=3):
    with Writer(store, LAYOUT, backend="cpu", ome=ome) as writer:
        writer.append(np.ones((frames, 8, 8), np.uint16))


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def user_dir(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "thesis.txt").write_text("precious")
    (d / "notes").mkdir()
    (d / "notes" / "a.md").write_text("a")
    return d


# -- 1. overwrite deletes only what is ours ------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [b"", b"garbage", b'{"zarr_format": 2}', "dir", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'],
)
def test_overwrite_refuses_user_files_next_to_a_zarr_json(tmp_path, metadata):
    d = user_dir(tmp_path)
    if metadata == "dir":
        (d / "zarr.json").mkdir()
    else:
        (d / "zarr.json").write_bytes(metadata)
    before = tree(d)
    with pytest.raises(StoreExistsError) as info:
        DirectorySink(d, overwrite=True)
    message = str(info.value)
    assert f"refusing to overwrite {str(d)!r}" in message and "'thesis.txt'" in message and "'notes/'" in message
    assert tree(d) == before and (d / "thesis.txt").read_text() == "precious"


def test_overwrite_resolves_dotdot_before_checking(tmp_path):
    d = user_dir(tmp_path)
    (d / "zarr.json").write_bytes(b"")
    before = tree(d)
    with pytest.raises(StoreExistsError, match="thesis.txt"):
        DirectorySink(f"{d}/new.zarr/..", overwrite=True)
    assert tree(d) == before


def test_overwrite_lists_five_names_then_a_count(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(8):
        (d / f"f{i}").write_text("x")
    with pytest.raises(StoreExistsError, match=r"'f4' and 3 more which this recorder did not write"):
        DirectorySink(d, overwrite=True)


def test_overwrite_removes_an_array_store_file_by_file_and_keeps_the_root(tmp_path):
    path = tmp_path / "a.zarr"
    record(path)
    (path / "c" / ".0.0123456789ab.tmp").write_bytes(b"torn")  # a crashed writer's temporary
    inode = path.stat().st_ino
    sink = DirectorySink(path, overwrite=True)
    assert path.stat().st_ino == inode and tree(path) == [LOCK_NAME]
    sink.release()
    assert tree(path) == []


@pytest.mark.parametrize("extra", ["thesis.txt", "c/readme", "c/0/x.npy", "c/.hidden", "other/"])
def test_overwrite_refuses_an_array_store_with_anything_else_in_it(tmp_path, extra):
    path = tmp_path / "a.zarr"
    record(path)
    target = path / extra.rstrip("/")
    target.mkdir() if extra.endswith("/") else target.write_text("mine")
    before = tree(path)
    with pytest.raises(StoreExistsError, match=repr(extra)):
        DirectorySink(path, overwrite=True)
    assert tree(path) == before and not (path / LOCK_NAME).exists()


def test_overwrite_never_follows_a_symlink(tmp_path):
    outside = user_dir(tmp_path)
    path = tmp_path / "a.zarr"
    record(path)
    (path / "c" / "9").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreExistsError, match="'c/9'"):
        DirectorySink(path, overwrite=True)
    assert (outside / "thesis.txt").read_text() == "precious" and (path / "zarr.json").exists()


def test_overwrite_refuses_a_fifo_or_an_oversized_zarr_json(tmp_path):
    fifo = tmp_path / "fifo.zarr"
    fifo.mkdir()
    os.mkfifo(fifo / "zarr.json")  # opening it for reading would block forever
    with pytest.raises(StoreExistsError, match="zarr.json is not a regular file"):
        DirectorySink(fifo, overwrite=True)
    big = tmp_path / "big.zarr"
    big.mkdir()
    with open(big / "zarr.json", "wb") as f:
        f.truncate((16 << 20) + 1)
    with pytest.raises(StoreExistsError, match="larger than 16 MiB"):
        DirectorySink(big, overwrite=True)
    assert (big / "zarr.json").stat().st_size == (16 << 20) + 1


def test_overwrite_removes_an_ome_group_but_not_other_members(tmp_path):
    path = tmp_path / "ome.zarr"
    record(path, ome=True)
    DirectorySink(path, overwrite=True).release()
    assert tree(path) == []
    record(path, ome=True)
    (path / "labels").mkdir()
    (path / "0" / "notes.txt").write_text("mine")
    with pytest.raises(StoreExistsError) as info:
        DirectorySink(path, overwrite=True)
    assert "'0/notes.txt'" in str(info.value) and "'labels/'" in str(info.value)
    assert (path / "0" / "notes.txt").exists() and (path / "zarr.json").exists()


def test_a_non_empty_directory_needs_overwrite(tmp_path):
    path = tmp_path / "a.zarr"
    record(path)
    with pytest.raises(StoreExistsError, match=r"use overwrite=True \(--overwrite on the command line\)"):
        DirectorySink(path)


def test_zarr_store_overwrite_deletes_only_recognised_keys():
    from zarr.storage import MemoryStore

    store = MemoryStore()
    record(store, ome=True)
    with pytest.raises(StoreExistsError, match="overwrite=True"):
        ZarrStoreSink(store)
    ZarrStoreSink(store, overwrite=True)
    assert not store._store_dict
    record(store)
    store._store_dict["thesis.txt"] = store._store_dict["zarr.json"]
    with pytest.raises(StoreExistsError, match="'thesis.txt'"):
        ZarrStoreSink(store, overwrite=True)
    assert "thesis.txt" in store._store_dict and "zarr.json" in store._store_dict
    fresh = MemoryStore()
    sink = ZarrStoreSink(fresh)
    sink.write("zarr.json", [b"{}"])
    sink.discard()
    assert not fresh._store_dict


# -- 2. one writer per store ---------------------------------------------------------------


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("existing", ["none", "store", "stale lock"])
def test_racing_writers_exactly_one_wins(tmp_path, existing):
    pid = dead_pid()
    for trial in range(30):
        path = tmp_path / f"race{trial}.zarr"
        if existing == "store":
            record(path)
        elif existing == "stale lock":
            write_lock(path, pid=pid)
        barrier = threading.Barrier(2)
        results = [None, None]

        def open_(i, barrier=barrier, path=path, results=results):  # bound now, not late
            barrier.wait()
            try:
                results[i] = DirectorySink(path, overwrite=existing != "none")
            except StoreExistsError as exc:
                results[i] = exc

        threads = [threading.Thread(target=open_, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [r for r in results if isinstance(r, DirectorySink)]
        assert len(winners) == 1 and sum(isinstance(r, StoreExistsError) for r in results) == 1, results
        assert tree(path) == [LOCK_NAME]  # the loser deleted nothing the winner holds
        assert json.loads((path / LOCK_NAME).read_text())["pid"] == os.getpid()
        winners[0].release()


def write_lock(path, **fields):
    path.mkdir(exist_ok=True)
    (path / LOCK_NAME).write_text(
        json.dumps(
            {"host": socket.gethostname(), "started": "2026-01-01T00:00:00", "tool": "napari-tileshard", **fields}
        )
    )


def test_a_live_lock_is_refused_and_nothing_is_touched(tmp_path):
    path = tmp_path / "a.zarr"
    record(path)
    write_lock(path, pid=os.getpid())
    before = tree(path)
    for overwrite in (False, True):
        with pytest.raises(StoreLockedError, match=f"being written by pid {os.getpid()} on host"):
            DirectorySink(path, overwrite=overwrite)
    assert tree(path) == before


def test_a_lock_from_another_host_is_refused(tmp_path):
    path = tmp_path / "h.zarr"
    write_lock(path, pid=999999999, host="elsewhere")
    with pytest.raises(StoreLockedError, match=r"pid 999999999 on host elsewhere since 2026-01-01.*delete"):
        DirectorySink(path, overwrite=True)


def test_a_stale_lock_is_taken_over(tmp_path, caplog):
    pid = dead_pid()
    path = tmp_path / "s.zarr"
    write_lock(path, pid=pid)
    with caplog.at_level(logging.WARNING, logger="napari_tileshard.storage.sinks"):
        sink = DirectorySink(path, overwrite=True)
    assert str(pid) in caplog.text
    assert json.loads((path / LOCK_NAME).read_text())["pid"] == os.getpid()
    sink.release()
    assert not (path / LOCK_NAME).exists()


def test_release_removes_only_our_own_lock(tmp_path):
    path = tmp_path / "r.zarr"
    sink = DirectorySink(path)
    lock = json.loads((path / LOCK_NAME).read_text())
    assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname() and lock["tool"] == "napari-tileshard"
    sink.release()
    sink.release()
    assert not (path / LOCK_NAME).exists()
    other = DirectorySink(path)
    sink.release()  # a stale sink must not drop the new holder's lock
    assert (path / LOCK_NAME).exists()
    other.release()


def test_readers_ignore_the_lock(tmp_path):
    path = tmp_path / "l.zarr"
    sink = DirectorySink(path)
    sink.write("zarr.json", [metadata_bytes(array_metadata(LAYOUT, "none", 0, 0))])
    assert zarr.open_array(path, mode="r").shape == (0, 8, 8)
    assert list_shard_keys(zarr.storage.LocalStore(path)) == []
    sink.release()


# -- 3. a vanished store is an error -------------------------------------------------------


@pytest.mark.parametrize("recreate", [False, True])
def test_a_deleted_store_directory_is_not_recreated(tmp_path, recreate):
    path = tmp_path / "v.zarr"
    sink = DirectorySink(path)
    sink.write("c/0/0/0", [b"shard"])
    for p in sorted(path.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    path.rmdir()
    if recreate:
        path.mkdir()
    with pytest.raises(StoreVanishedError) as info:
        sink.write("c/1/0/0", [b"shard"])
    assert info.value.errno == errno.ENOENT and isinstance(info.value, OSError)
    assert str(info.value).startswith(f"the store directory {str(path)!r} was deleted or moved during the recording")
    assert path.exists() == recreate and (not recreate or tree(path) == [])


# -- 4. a failed setup leaves nothing behind -----------------------------------------------


def test_discard_removes_what_the_sink_made(tmp_path):
    path = tmp_path / "new" / "d.zarr"
    sink = DirectorySink(path)
    sink.write("zarr.json", [b"{}"])
    sink.write("0/c/0/0", [b"shard"])
    sink.discard()
    sink.discard()
    assert not (tmp_path / "new").exists()

    existing = tmp_path / "empty"
    existing.mkdir()
    sink = DirectorySink(existing)
    sink.write("c/0/0", [b"shard"])
    sink.discard()
    assert existing.is_dir() and tree(existing) == []


# -- 6. the command line -------------------------------------------------------------------


def cli_record(path, *extra):
    return main(
        [
            "record",
            str(path),
            "--shape",
            "0,8,8",
            "--tile",
            "2,4,4",
            "--tiles-per-shard",
            "1,1,1",
            "--frames",
            "2",
            "--backend",
            "cpu",
            "--no-progress",
            *extra,
        ]
    )


def test_cli_overwrite_refuses_user_files(tmp_path, capsys):
    d = user_dir(tmp_path)
    (d / "zarr.json").write_bytes(b"")
    before = tree(d)
    assert cli_record(d, "--overwrite") == 2
    # (the deliberately tiny tiling's notes come first, as `napari-tileshard: warning:` lines)
    errors = [line for line in capsys.readouterr().err.splitlines() if "warning:" not in line]
    assert len(errors) == 1 and errors[0].startswith("napari-tileshard: error: refusing to overwrite")
    assert "'thesis.txt'" in errors[0]
    assert cli_record(f"{d}/new.zarr/..", "--overwrite") == 2
    assert "'thesis.txt'" in capsys.readouterr().err
    assert tree(d) == before and (d / "thesis.txt").read_text() == "precious"


def test_cli_names_the_flag(tmp_path, capsys):
    path = tmp_path / "a.zarr"
    assert cli_record(path) == 0
    capsys.readouterr()
    assert cli_record(path) == 2
    err = capsys.readouterr().err
    assert "use --overwrite" in err and "overwrite=True" not in err
    assert cli_record(path, "--overwrite") == 0


def test_an_interrupt_anywhere_in_a_write_leaves_no_temporary_file(tmp_path):
    """The temporary file used to be created before the try that removes it: Ctrl-C landing just
    after it was created left a 0-byte `.zarr.json.*.tmp` behind (seen in interrupted converts)."""
    sink = DirectorySink(tmp_path / "s.zarr")
    sink.write("zarr.json", [b"old"])
    landed = 0
    for k in range(1, 300):
        try:
            with InterruptAt(k, {"_write", "_writev_all"}):
                sink.write("zarr.json", [b"new-", b"metadata"])
        except KeyboardInterrupt:
            pass
        else:
            break  # k is past the last place: every one was tried
        landed += 1
        names = sorted(os.listdir(tmp_path / "s.zarr"))
        assert names == [".tileshard.lock", "zarr.json"], f"interrupt at line event {k}: {names}"
        assert (tmp_path / "s.zarr" / "zarr.json").read_bytes() in (b"old", b"new-metadata")
        (tmp_path / "s.zarr" / "zarr.json").write_bytes(b"old")
    assert landed > 5
    sink.release()


def test_resuming_a_store_removes_only_our_stale_temporary_files(tmp_path):
    """A worker killed mid-write (SIGKILL: no cleanup possible) leaves its temporary file; the
    next sink that continues the store removes it, and nothing else."""
    root = tmp_path / "s.zarr"
    sink = DirectorySink(root)
    sink.write("c/0/0", [b"shard"])
    sink.release()
    stale = [root / ".zarr.json.0123456789ab.tmp", root / "c" / "0" / ".1.deadbeef0123.tmp"]
    kept = [root / "c" / "0" / ".notes.tmp", root / "c" / "0" / "x.0123456789ab.tmp"]
    for path in stale + kept:
        path.write_bytes(b"")
    DirectorySink(root, keep_existing=True).release()
    assert [p.exists() for p in stale] == [False, False]
    assert [p.exists() for p in kept] == [True, True]
    assert (root / "c" / "0" / "0").read_bytes() == b"shard"


@pytest.mark.skipif(os.open not in os.supports_dir_fd, reason="opens relative to a directory need dir_fd")
def test_local_files_open_from_many_threads_while_directories_are_dropped(tmp_path):
    """LocalFiles keeps at most max_dirs directories open; with one, every open drops the
    directory another thread may be opening relative to: each file still opens and reads right,
    the descriptors stay bounded while the threads keep opening (some open is nearly always in
    flight: the interpreter switching threads every microsecond), and no directory descriptor is
    left open once the table is closed."""
    from napari_tileshard.storage.safe_read import LocalFiles

    keys = [f"c/{i}/{j}" for i in range(12) for j in range(3)]
    for key in keys:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(key.encode())
    files = LocalFiles(tmp_path, max_dirs=1)
    counting = os.path.isdir("/proc/self/fd")
    before = len(os.listdir("/proc/self/fd")) if counting else 0
    wrong: list[str] = []
    errors: list[BaseException] = []
    most_open = [before]

    def read_all(offset: int) -> None:
        try:
            for _ in range(40):
                for key in keys[offset:] + keys[:offset]:
                    fd = files.open(key)
                    try:
                        if os.pread(fd, 64, 0) != key.encode():
                            wrong.append(key)
                    finally:
                        os.close(fd)
                if counting:
                    most_open[0] = max(most_open[0], len(os.listdir("/proc/self/fd")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_switching_often(read_all, [(k * 5,) for k in range(8)])
    assert errors == [] and wrong == []
    # bounded: per thread a file, a directory of its own and its parent's; the table's one and
    # as many dropped ones waiting (the old rule, close only once no open at all is in flight,
    # let dropped directories pile up past a thousand here)
    assert most_open[0] - before <= 8 * 3 + 2 + 8
    files.close()
    if counting:
        assert len(os.listdir("/proc/self/fd")) <= before


@pytest.mark.skipif(os.open not in os.supports_dir_fd, reason="opens relative to a directory need dir_fd")
def test_local_files_close_a_dropped_directory_once_no_open_uses_it(tmp_path):
    """One thread opening files of ever new directories, one directory kept: each dropped
    directory is closed at once (no open is in flight), so the descriptors do not grow."""
    from napari_tileshard.storage.safe_read import LocalFiles

    keys = [f"c/{i}/0" for i in range(40)]
    for key in keys:
        (tmp_path / key).parent.mkdir(parents=True)
        (tmp_path / key).write_bytes(key.encode())
    files = LocalFiles(tmp_path, max_dirs=1)
    counts = []
    for key in keys:
        os.close(files.open(key))
        counts.append(len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0)
    assert max(counts) == min(counts)
    files.close()


def test_local_files_keep_a_quarter_of_the_descriptor_limit_open():
    """The directories kept open follow the process's limit on open files (macOS allows 256 by
    default: 64), within bounds; 256 where the limit is not known."""
    from napari_tileshard.storage.safe_read import (
        MAX_OPEN_DIRECTORIES,
        MIN_OPEN_DIRECTORIES,
        LocalFiles,
        descriptor_limit,
        open_directories,
    )

    assert open_directories(256) == 64 and open_directories(1024) == 256
    assert open_directories(20) == MIN_OPEN_DIRECTORIES and open_directories(10**7) == MAX_OPEN_DIRECTORIES
    assert open_directories(None) == 256
    assert LocalFiles(".").max_dirs == open_directories(descriptor_limit())
    assert LocalFiles(".", max_dirs=3).max_dirs == 3
    if os.name == "posix":
        import resource

        assert descriptor_limit() in (resource.getrlimit(resource.RLIMIT_NOFILE)[0], None)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc/self/fd (Linux)")
def test_local_files_dropped_without_close_close_their_directories(tmp_path):
    from napari_tileshard.storage.safe_read import LocalFiles

    for d in range(20):
        (tmp_path / "c" / str(d)).mkdir(parents=True)
        (tmp_path / "c" / str(d) / "0").write_bytes(b"x")
    before = len(os.listdir("/proc/self/fd"))
    files = LocalFiles(tmp_path)
    for d in range(20):
        os.close(files.open(f"c/{d}/0"))
    assert len(os.listdir("/proc/self/fd")) - before >= 20  # the directories held open
    del files  # no close(): a reader a script let go
    assert len(os.listdir("/proc/self/fd")) == before


def _store_descriptors(root) -> int:
    """How many descriptors of this process lead to regular files under ``root`` (Linux)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(str(root) + os.sep) and os.path.isfile(target.removesuffix(" (deleted)")):
            count += 1
        elif target.startswith(str(root) + os.sep) and target.endswith(" (deleted)"):
            count += 1
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc/self/fd (Linux)")
def test_local_files_use_keeps_the_file_it_opened_until_closed(tmp_path):
    """``use`` keeps a file open for its next use: the same descriptor again, the version it
    opened even after the path was replaced (as a reader's cached index), the new one after
    ``close``, and nothing of the store left open then."""
    from napari_tileshard.storage.safe_read import LocalFiles

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "0").write_bytes(b"first")
    files = LocalFiles(tmp_path, max_files=4)
    seen = []

    def read(fd):
        seen.append(fd)
        return os.pread(fd, 64, 0)

    assert files.use("c/0", read) == b"first"
    (tmp_path / "c" / "new").write_bytes(b"second")
    os.replace(tmp_path / "c" / "new", tmp_path / "c" / "0")  # as a shard rewritten atomically
    assert files.use("c/0", read) == b"first" and seen[0] == seen[1]
    assert _store_descriptors(tmp_path) == 1
    files.close()
    assert _store_descriptors(tmp_path) == 0
    assert files.use("c/0", read) == b"second"
    del files  # dropped without close: the file kept goes with it
    assert _store_descriptors(tmp_path) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc/self/fd (Linux)")
def test_local_files_keep_at_most_max_files_and_refuse_what_open_refuses(tmp_path):
    """At most ``max_files`` files stay open (the oldest closed first); a symlink outside the
    store and a FIFO are refused by ``use`` as by ``open``, and a missing file is
    FileNotFoundError."""
    from napari_tileshard.storage.safe_read import LocalFiles, UnsafeStoreError

    (tmp_path / "store" / "c").mkdir(parents=True)
    root = tmp_path / "store"
    for i in range(6):
        (root / "c" / str(i)).write_bytes(str(i).encode())
    (tmp_path / "outside").write_bytes(b"secret")
    (root / "c" / "out").symlink_to(tmp_path / "outside")
    os.mkfifo(root / "c" / "fifo")
    files = LocalFiles(root, max_files=2)

    def read(fd):
        return os.pread(fd, 64, 0)

    assert [files.use(f"c/{i}", read) for i in range(6)] == [str(i).encode() for i in range(6)]
    assert _store_descriptors(root) == 2
    with pytest.raises(UnsafeStoreError, match="outside the store"):
        files.use("c/out", read)
    with pytest.raises(UnsafeStoreError, match="FIFO"):
        files.use("c/fifo", read)
    with pytest.raises(FileNotFoundError):
        files.use("c/none", read)
    assert _store_descriptors(root) == 2
    files.close()
    assert _store_descriptors(root) == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc/self/fd (Linux)")
def test_local_files_use_from_many_threads_while_files_are_dropped(tmp_path):
    """Threads using more files than are kept: every use reads its own file's bytes (a file
    dropped from the table while another thread reads it is closed only after that read: a
    descriptor number reused meanwhile would read another file), and the descriptors stay
    bounded."""
    from napari_tileshard.storage.safe_read import LocalFiles

    keys = [f"c/{i}/{j}" for i in range(4) for j in range(4)]
    for key in keys:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(key.encode() * 100)
    files = LocalFiles(tmp_path, max_files=3)
    wrong: list[str] = []
    errors: list[BaseException] = []
    most_open = [0]

    def read_all(offset: int) -> None:
        try:
            for _ in range(30):
                for key in keys[offset:] + keys[:offset]:
                    if files.use(key, lambda fd: os.pread(fd, 1000, 0)) != key.encode() * 100:
                        wrong.append(key)
                most_open[0] = max(most_open[0], _store_descriptors(tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_switching_often(read_all, [(k * 3,) for k in range(8)])
    assert errors == [] and wrong == []
    assert most_open[0] <= 3 + 8 + 8  # kept, one opened by each thread, dropped ones waiting
    files.close()
    assert _store_descriptors(tmp_path) == 0


def test_local_files_keep_an_eighth_of_the_descriptor_limit_in_files():
    """The files all LocalFiles of a process keep open follow its limit on open files (macOS
    allows 256 by default: 32), at most MAX_KEPT_FILES; 32 where the limit is not known."""
    from napari_tileshard.storage.safe_read import MAX_KEPT_FILES, kept_files

    assert kept_files(256) == 32 and kept_files(1024) == 128 and kept_files(7) == 0
    assert kept_files(10**7) == MAX_KEPT_FILES and kept_files(None) == 32


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd") or os.open not in os.supports_dir_fd,
    reason="counts descriptors through /proc/self/fd (Linux); files are kept where opened relative to a directory",
)
def test_all_local_files_of_a_process_keep_an_eighth_of_its_limit_together(tmp_path):
    """Under a 256-file limit (macOS's default) the LocalFiles of three stores keep 32 files open
    in all, not 32 each: the first keeps its newest 32, the others, finding none left, read each
    file through a descriptor of its own (and every read is right)."""
    for store in ("a", "b", "c"):
        for i in range(40):
            (tmp_path / store / "c" / str(i)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / store / "c" / str(i)).write_bytes(f"{store}{i}".encode())
    child = f"""
import os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
from napari_tileshard.storage.safe_read import LocalFiles
root = {str(tmp_path)!r}
def kept():
    return sum(os.readlink(f"/proc/self/fd/{{n}}").startswith(root + "/") and
               os.path.isfile(os.readlink(f"/proc/self/fd/{{n}}")) for n in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{{n}}"))
stores = [LocalFiles(os.path.join(root, s)) for s in "abc"]
for store, name in zip(stores, "abc"):
    for i in range(40):
        assert store.use(f"c/{{i}}", lambda fd: os.pread(fd, 16, 0)) == f"{{name}}{{i}}".encode()
print(kept())
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == 32
