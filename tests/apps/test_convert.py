"""napari_tileshard.apps.convert: existing data into sharded Zarr v3 / OME-Zarr on a Dask cluster."""

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import read_tensorstore

from napari_tileshard import Dim, Layout, Writer, WriterError
from napari_tileshard.apps.cli import main as cli_main
from napari_tileshard.format.layout import TilingWarning

distributed = pytest.importorskip("distributed", reason="the convert extra (dask distributed) is not installed")
tifffile = pytest.importorskip("tifffile", reason="the convert extra (tifffile) is not installed")

from napari_tileshard.apps.convert import MANIFEST_KEY, ConvertReport, ResumeMismatch, convert  # noqa: E402


@pytest.fixture(scope="module")
def client():
    """Two workers, as on the 2-core CI machine (threads: a process cluster is tested by the CLI),
    with Dask's profiler off as convert's own clusters have it: on Python < 3.11.9 it can deadlock
    the whole test process (CPython gh-106883, see tests/apps/test_convert_processes.py)."""
    import dask

    with dask.config.set({"distributed.worker.profile.enabled": False}):  # read when the workers start
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        yield client


def data(shape=(37, 70, 90), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 50, shape) + np.arange(shape[-1])).astype(np.uint16)


def layout_for(a):
    return Layout([Dim("t", a.shape[0], 4, 2), Dim("y", a.shape[1], 32, 2), Dim("x", a.shape[2], 32, 2)], "uint16")


def shard_files(root):
    root = Path(root)
    return {
        str(f.relative_to(root)): f.read_bytes()
        for f in root.rglob("*")
        if f.is_file() and f.name != "zarr.json" and not f.name.startswith(".")
    }


@pytest.mark.parametrize("ome", [False, True], ids=["array", "ome"])
def test_a_zarr_v2_array_converts_to_the_shards_a_recording_writes(tmp_path, client, ome):
    a = data()
    source = zarr.create_array(tmp_path / "v2.zarr", shape=a.shape, chunks=(5, 32, 32), dtype=a.dtype, zarr_format=2)
    source[...] = a
    report = convert(tmp_path / "v2.zarr", tmp_path / "out.zarr", layout_for(a), client=client, backend="cpu", ome=ome)
    assert report.verified.ok
    assert len(report.keys) == len(set(report.keys)) == report.shards  # no shard written twice
    with Writer(tmp_path / "ref.zarr", layout_for(a), backend="cpu", ome=ome) as writer:
        writer.append(a)
    assert shard_files(tmp_path / "out.zarr") == shard_files(tmp_path / "ref.zarr")  # every level, byte for byte
    level0 = tmp_path / "out.zarr" / ("0" if ome else "")
    np.testing.assert_array_equal(zarr.open_array(level0)[...], a)
    np.testing.assert_array_equal(read_tensorstore(level0), a)
    assert zarr.open_array(level0).attrs["tileshard"] == {"rows_written": 37, "state": "complete"}
    assert not (tmp_path / "out.zarr" / ".tileshard.lock").exists()


def test_unsharded_v3_tiff_folder_and_ome_tiff_inputs(tmp_path, client):
    a = data((9, 40, 50), seed=1)
    v3 = zarr.create_array(tmp_path / "v3.zarr", shape=a.shape, chunks=(1, 40, 50), dtype=a.dtype)
    v3[...] = a
    (tmp_path / "frames").mkdir()
    for i, frame in enumerate(a):
        tifffile.imwrite(tmp_path / "frames" / f"frame_{i:03d}.tif", frame)
    tifffile.imwrite(tmp_path / "stack.ome.tif", a, ome=True, metadata={"axes": "ZYX"})
    for src in ("v3.zarr", "frames", "stack.ome.tif"):
        out = tmp_path / f"{src}.out.zarr"
        report = convert(tmp_path / src, out, layout_for(a), client=client, backend="cpu")
        assert report.verified.ok, src
        np.testing.assert_array_equal(zarr.open_array(out)[...], a, err_msg=src)


def test_default_layout_and_dims_from_an_array_like(tmp_path, client):
    a = data((3, 300, 270), seed=2)
    convert(a, tmp_path / "out.zarr", client=client, backend="cpu")
    array = zarr.open_array(tmp_path / "out.zarr")
    np.testing.assert_array_equal(array[...], a)
    assert array.metadata.dimension_names == ("t", "y", "x")  # the default names of a rank-3 array


class FailingRows:
    """An array-like source whose rows from ``fail_from`` on cannot be read by a task (a dying
    input); the single rows convert samples for the source's identity stay readable."""

    def __init__(self, array, fail_from):
        self.array, self.fail_from = array, fail_from
        self.shape, self.dtype = array.shape, array.dtype

    def __getitem__(self, rows):
        if rows.stop > self.fail_from and rows.stop - rows.start > 1:
            time.sleep(0.3)  # the epochs before it finish first (their order on the workers is not fixed)
            raise OSError(f"input unreadable from row {self.fail_from}")
        return self.array[rows]


class KillsItsWorker:
    """An array-like source whose first read of row ``at`` kills the worker process reading it
    (a node lost mid-conversion); the marker file makes the retry on another worker succeed."""

    def __init__(self, array, at, marker):
        self.array, self.at, self.marker = array, at, str(marker)
        self.shape, self.dtype = array.shape, array.dtype

    def __getitem__(self, rows):
        if rows.start <= self.at < rows.stop and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)  # no exception, no cleanup: the process is gone
        return self.array[rows]


def test_a_worker_process_killed_mid_task_is_retried_and_the_result_verifies(tmp_path):
    a = data(seed=5)
    marker = tmp_path / "killed"
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        distributed.Client(cluster) as process_client,
    ):
        report = convert(
            KillsItsWorker(a, 17, marker), tmp_path / "out.zarr", layout_for(a), client=process_client, backend="cpu"
        )
    assert marker.exists()  # a worker did die
    assert report.verified.ok
    assert len(report.keys) == len(set(report.keys))  # no shard written by two tasks
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr")[...], a)


def test_convert_on_its_own_cluster_inside_another_clients_block_waits_on_its_own_loop(tmp_path, client):
    """``with Client(...)`` makes that client the current one, and Dask's ``as_completed`` tracks
    futures on the current client's loop unless told otherwise: convert's futures, which belong to
    its own client, were fetched through another loop (on a loaded 2-core box that corrupted a
    connection pool and hung the conversion for good).  Here the other client's loop is blocked
    while convert runs: convert must not need it."""
    a = data((16, 32, 32), seed=4)
    released, gave_up = threading.Event(), threading.Event()

    def block_the_loop():
        if not released.wait(30):
            gave_up.set()

    with client.as_current():
        client.loop.add_callback(block_the_loop)  # the current client's loop, blocked until released
        try:
            report = convert(a, tmp_path / "out.zarr", layout_for(a), backend="cpu", local_workers=1)
        finally:
            released.set()
    assert not gave_up.is_set(), "convert finished only once the other client's loop ran again"
    assert report.verified.ok
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr")[...], a)


def test_an_interrupted_conversion_claims_only_finished_epochs_and_resumes(tmp_path, client):
    a = data()
    out = tmp_path / "out.zarr"
    with pytest.raises(OSError, match="input unreadable from row 32"):
        convert(FailingRows(a, 32), out, layout_for(a), client=client, backend="cpu", retries=0)
    claimed = zarr.open_array(out).attrs["tileshard"]
    assert claimed["rows_written"] <= 32 and claimed["state"] == "failed"
    epochs_done = json.loads((out / MANIFEST_KEY).read_text())["epochs_done"]
    assert epochs_done and 4 not in epochs_done
    # what the store claims is covered by finished epochs
    assert claimed["rows_written"] <= 8 * len(epochs_done)
    done_before = {p: p.stat().st_ino for e in epochs_done for p in (out / "c" / str(e)).rglob("*") if p.is_file()}
    report = convert(a, out, layout_for(a), client=client, backend="cpu", resume=True)
    assert report.verified.ok and report.epochs_skipped == len(epochs_done)
    np.testing.assert_array_equal(zarr.open_array(out)[...], a)
    assert {p: p.stat().st_ino for p in done_before} == done_before  # finished shards were not rewritten


def test_bad_inputs_are_named(tmp_path, client):
    a = data((9, 40, 50))
    with pytest.raises(ValueError, match=r"layout's shape is \(37, 70, 90\) but the source's is \(9, 40, 50\)"):
        convert(a, tmp_path / "x.zarr", layout_for(data()), client=client)
    (tmp_path / "frames").mkdir()
    tifffile.imwrite(tmp_path / "frames" / "a.tif", a[0])
    tifffile.imwrite(tmp_path / "frames" / "b.tif", a[0, :20])
    with pytest.raises(ValueError, match=r"b.tif: shape \(20, 50\)"):
        convert(tmp_path / "frames", tmp_path / "y.zarr", client=client, backend="cpu", verify=False)
    (tmp_path / "frames" / "b.tif").write_bytes(b"II*\x00 not a tiff at all")  # a truncated/corrupt file
    with pytest.raises(Exception, match="b.tif"):
        convert(tmp_path / "frames", tmp_path / "y2.zarr", client=client, backend="cpu", verify=False)
    assert not (tmp_path / "y2.zarr").exists()
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        (tmp_path / "empty.zarr").mkdir()
        convert(a, tmp_path / "empty.zarr", layout_for(a), client=client, resume=True)
    with pytest.raises(ValueError, match="may not include 't'"):
        convert(a, tmp_path / "z.zarr", layout_for(a), client=client, ome=True, downsample_dims=("t", "y", "x"))
    with pytest.raises(FileNotFoundError, match="missing.zarr does not exist"):
        convert(tmp_path / "missing.zarr", tmp_path / "w.zarr", client=client)


def test_cli_convert_on_a_local_process_cluster(tmp_path, capsys):
    a = data((16, 64, 64), seed=3)
    source = zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(4, 64, 64), dtype=a.dtype)
    source[...] = a
    code = cli_main(
        ["convert", str(tmp_path / "in.zarr"), str(tmp_path / "out.zarr"), "--tile", "4,32,32",
         "--tiles-per-shard", "2,2,2", "--backend", "cpu", "--local", "1", "--ome"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "converted into" in capsys.readouterr().out
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr" / "0")[...], a)
    assert os.path.isdir(tmp_path / "out.zarr" / "1")


@pytest.mark.gpu
def test_gpu_tasks_convert_with_the_gpu_backend(tmp_path, client):
    from napari_tileshard.engine.backends import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU backend not usable here: {reason}")
    a = data()
    report = convert(a, tmp_path / "out.zarr", layout_for(a), client=client, backend="gpu", ome=True)
    assert report.verified.ok and all(b.startswith("gpu") for b in report.backends)
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr" / "0")[...], a)


def test_gpu_workers_each_see_only_their_gpu():
    """devices=: one worker process per GPU, each with CUDA_VISIBLE_DEVICES set before CUDA starts
    (checked here without a GPU: the environment the workers run with)."""
    from distributed import Client

    from napari_tileshard.apps.convert import gpu_cluster

    with gpu_cluster([1, 0], threads_per_gpu=2) as cluster, Client(cluster) as gpu_client:
        seen = gpu_client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert sorted(seen.values()) == ["0", "1"]
        assert [info["nthreads"] for info in gpu_client.scheduler_info()["workers"].values()] == [2, 2]
        assert_convert_workers(gpu_client)


def assert_convert_workers(client):
    """The workers of a cluster convert starts: profiler off (CPython gh-106883), SIGKILL when
    convert dies (PR_SET_PDEATHSIG), Ctrl-C left to convert."""
    import signal

    from napari_tileshard.apps.convert import _worker_state

    states = client.run(_worker_state)
    assert states
    for state in states.values():
        assert state["profile_config"] is False and state["profiler"] is False, state
        assert state["sigint_ignored"], state
        if sys.platform.startswith("linux"):
            assert state["death_signal"] == signal.SIGKILL, state
        assert state["pid"] != os.getpid()


def test_the_local_cluster_convert_starts_runs_its_workers_with_the_profiler_off():
    from napari_tileshard.apps.convert import local_cluster

    with local_cluster(1) as cluster, distributed.Client(cluster) as own_client:
        assert_convert_workers(own_client)
        # a worker the nanny restarts (a new process) gets the same
        own_client.restart()
        assert_convert_workers(own_client)


def test_gpus_without_a_usable_gpu_is_one_clear_error_before_anything(tmp_path):
    from napari_tileshard.engine.backends import gpu_unavailable_reason

    source = tmp_path / "in.zarr"
    zarr.create_array(source, shape=(4, 8), chunks=(2, 8), dtype="uint16", zarr_format=2)[:] = 1
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is usable here: this checks the error on machines without one")
    with pytest.raises(RuntimeError, match="devices=.all. was requested but the GPU backend is not usable"):
        convert(source, tmp_path / "out.zarr", devices="all")
    with pytest.raises(ValueError, match="with client= the cluster is yours"):
        convert(source, tmp_path / "out.zarr", devices=1, client=object())
    assert not (tmp_path / "out.zarr").exists()


def test_a_full_disk_is_a_clear_error_and_the_store_claims_only_written_rows(tmpfs, client):
    disk = tmpfs("200k")  # room for the metadata and a few shards, not for 37 rows of 70 x 90
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**16, (37, 70, 90), dtype=np.uint16)  # incompressible
    out = disk / "out.zarr"
    with pytest.raises((OSError, WriterError), match="No space left on device"):
        convert(a, out, layout_for(a), client=client, backend="cpu", retries=0)
    claimed = zarr.open_array(out).attrs["tileshard"]["rows_written"]
    assert claimed < 37
    np.testing.assert_array_equal(zarr.open_array(out)[:claimed], a[:claimed])  # what it claims is there


# -- the profiler on a cluster of yours (CPython gh-106883) -----------------------------------------
@pytest.mark.skipif(sys.version_info >= (3, 11, 9), reason="CPython gh-106883 is fixed in 3.11.9")
def test_a_cluster_of_yours_with_the_profiler_on_gets_one_warning(tmp_path, caplog, client):
    import dask

    a = data((8, 40, 50))
    with dask.config.set({"distributed.worker.profile.enabled": True}):  # Dask's default
        cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0")
    with (
        cluster,
        distributed.Client(cluster) as profiled,
        caplog.at_level("WARNING", logger="napari_tileshard.apps.convert"),
    ):
        convert(a, tmp_path / "a.zarr", layout_for(a), client=profiled, backend="cpu")
    warnings = [r.getMessage() for r in caplog.records if "gh-106883" in r.getMessage()]
    assert len(warnings) == 1
    assert "distributed.worker.profile.enabled: False" in warnings[0] and "3.11.9" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="napari_tileshard.apps.convert"):  # the fixture's workers: profiler off
        convert(a, tmp_path / "b.zarr", layout_for(a), client=client, backend="cpu")
    assert not [r for r in caplog.records if "gh-106883" in r.getMessage()]


# -- resume: the same source, the same options ---------------------------------------------------------
def stopped_conversion(tmp_path, client, a, **options) -> Path:
    """``a`` converted into out.zarr until row 24 (the epochs after it fail): a conversion to resume."""
    out = tmp_path / "out.zarr"
    with pytest.raises(OSError, match="input unreadable"):
        convert(FailingRows(a, 24), out, client=client, retries=0, **options)
    assert json.loads((out / MANIFEST_KEY).read_text())["epochs_done"]
    return out


def test_resume_reuses_the_options_the_conversion_started_with(tmp_path, client):
    a = data()
    options = dict(tile=[4, 32, 32], tiles_per_shard=[2, 2, 2], codec="zstd", level=5, backend="cpu", ome=True)
    out = stopped_conversion(tmp_path, client, a, downsample="max", **options)
    manifest = json.loads((out / MANIFEST_KEY).read_text())
    assert manifest["source"]["kind"] == "array" and manifest["source"]["shape"] == [37, 70, 90]
    assert manifest["options"]["level"] == 5 and manifest["options"]["downsample"] == "max"
    report = convert(a, out, client=client, resume=True)  # nothing given: all reused
    assert report.verified.ok and report.epochs_skipped
    with Writer(tmp_path / "ref.zarr", layout_for(a), backend="cpu", ome=True, level=5, downsample="max") as writer:
        writer.append(a)
    assert shard_files(out) == shard_files(tmp_path / "ref.zarr")  # the same layout, codec level and pyramid


def test_resume_with_a_conflicting_option_names_it(tmp_path, client):
    a = data()
    out = stopped_conversion(tmp_path, client, a, layout=layout_for(a), backend="cpu")
    with pytest.raises(ResumeMismatch, match=r"^level=3, but this conversion used 1$"):
        convert(a, out, client=client, resume=True, level=3)
    with pytest.raises(ResumeMismatch, match=r"tile=\[8, 32, 32\], but this conversion used \[4, 32, 32\]"):
        convert(a, out, client=client, resume=True, tile=[8, 32, 32])
    with pytest.raises(ResumeMismatch, match="^ome=True, but this conversion used False$"):
        convert(a, out, client=client, resume=True, ome=True)
    # what agrees is accepted; the backend may change (it decides where tasks run, not what they write)
    report = convert(a, out, client=client, resume=True, level=1, codec="zstd", tile=[4, 32, 32], backend="auto")
    assert report.verified.ok
    np.testing.assert_array_equal(zarr.open_array(out)[...], a)


def test_cli_resume_conflict_is_one_line_naming_the_flag(tmp_path, client, capsys):
    a = data((16, 32, 32))
    source = zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(4, 32, 32), dtype=a.dtype)
    source[...] = a
    out = tmp_path / "out.zarr"
    convert(tmp_path / "in.zarr", out, client=client, backend="cpu", tile=[4, 32, 32], verify=False)
    capsys.readouterr()
    assert cli_main(["convert", str(tmp_path / "in.zarr"), str(out), "--resume", "--level", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("napari-tileshard: error: --level 3, but this conversion used 1")
    assert cli_main(["convert", str(tmp_path / "in.zarr"), str(out), "--resume", "--tile", "8,32,32"]) == 2
    assert "--tile 8,32,32, but this conversion used 4,32,32" in capsys.readouterr().err


def test_resume_refuses_another_zarr_source_naming_what_differs(tmp_path, client):
    a = data((24, 32, 32))
    src, out = tmp_path / "in.zarr", tmp_path / "out.zarr"
    zarr.create_array(src, shape=a.shape, chunks=(4, 32, 32), dtype=a.dtype)[...] = a
    convert(src, out, layout_for(a), client=client, backend="cpu", verify=False)
    assert convert(src, out, client=client, resume=True).epochs_written == 0  # the same source: fine
    zarr.create_array(src, shape=(16, 32, 32), chunks=(4, 32, 32), dtype=a.dtype, overwrite=True)[...] = a[:16]
    with pytest.raises(ValueError, match=r"the source differs from the one this conversion started from: shape "
                       r"\(16, 32, 32\) vs \(24, 32, 32\)"):  # fmt: skip
        convert(src, out, client=client, resume=True)
    # the same shape, dtype and chunks, other metadata
    zarr.create_array(src, shape=a.shape, chunks=(4, 32, 32), dtype=a.dtype, overwrite=True)[...] = a
    zarr.open_array(src).attrs["note"] = "another array"
    with pytest.raises(ValueError, match=r"differs .*: metadata hash \w+ vs \w+ \(now vs then\)"):
        convert(src, out, client=client, resume=True)
    # the same array at another path
    zarr.create_array(src, shape=a.shape, chunks=(4, 32, 32), dtype=a.dtype, overwrite=True)[...] = a
    assert convert(src, out, client=client, resume=True).epochs_written == 0
    src.rename(tmp_path / "moved.zarr")
    with pytest.raises(ValueError, match=r"started from: location \S+moved.zarr vs \S+in.zarr \(now vs then\)"):
        convert(tmp_path / "moved.zarr", out, client=client, resume=True)
    assert not (out / ".tileshard.lock").exists()  # a refused resume leaves the store unlocked


def test_resume_refuses_another_tiff_folder_tiff_file_or_array(tmp_path, client):
    a = data((9, 40, 50), seed=1)
    (tmp_path / "frames").mkdir()
    for i, frame in enumerate(a):
        tifffile.imwrite(tmp_path / "frames" / f"frame_{i:03d}.tif", frame)
    tifffile.imwrite(tmp_path / "stack.tif", a)
    for src in ("frames", "stack.tif"):
        convert(tmp_path / src, tmp_path / f"{src}.zarr", layout_for(a), client=client, backend="cpu", verify=False)
    tifffile.imwrite(tmp_path / "frames" / "frame_004.tif", a[0])  # same size, new contents and time
    with pytest.raises(ValueError, match="file sizes and modification times hash"):
        convert(tmp_path / "frames", tmp_path / "frames.zarr", client=client, resume=True)
    tifffile.imwrite(tmp_path / "frames" / "frame_009.tif", a[0])
    with pytest.raises(ValueError, match=r"shape \(10, 40, 50\) vs \(9, 40, 50\).*files 10 vs 9"):
        convert(tmp_path / "frames", tmp_path / "frames.zarr", client=client, resume=True)
    tifffile.imwrite(tmp_path / "stack.tif", a[::-1], description="another stack")
    with pytest.raises(ValueError, match="header hash"):
        convert(tmp_path / "stack.tif", tmp_path / "stack.tif.zarr", client=client, resume=True)
    # an array-like: no location; its shape, dtype, chunks and first and last rows identify it
    out = stopped_conversion(tmp_path, client, data(), layout=layout_for(data()), backend="cpu")
    other = data()
    other[-1] += 1
    with pytest.raises(ValueError, match="hash of its first and last rows"):
        convert(other, out, client=client, resume=True)
    assert convert(data(), out, client=client, resume=True).verified.ok


# -- what a stopped conversion leaves, and what each command says about it ----------------------------
def test_messages_about_a_stopped_conversion_say_what_to_do(tmp_path, client, capsys):
    a = data()
    src = str(tmp_path / "in.zarr")
    zarr.create_array(src, shape=a.shape, chunks=(8, 70, 90), dtype=a.dtype)[...] = a
    out = stopped_conversion(tmp_path, client, a, layout=layout_for(a), backend="cpu")
    with pytest.raises(FileExistsError, match=r"stopped after \d+ of 5 shard epochs: continue it with resume=True"):
        convert(a, out, client=client)
    assert cli_main(["convert", src, str(out)]) == 2
    assert "continue it with --resume, or use --overwrite to start over" in capsys.readouterr().err
    assert convert(a, out, client=client, resume=True).verified.ok
    with pytest.raises(FileExistsError, match="holds a finished conversion .*use overwrite=True"):
        convert(a, out, client=client)
    # a destination without a manifest (not made by convert, or a convert killed before writing it)
    (tmp_path / "empty.zarr").mkdir()
    assert cli_main(["convert", src, str(tmp_path / "empty.zarr"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "run it with --overwrite instead of --resume" in err
    assert cli_main(["convert", src, str(tmp_path / "missing.zarr"), "--resume"]) == 2
    assert "does not exist: nothing to resume; run it without --resume" in capsys.readouterr().err
    assert not (tmp_path / "missing.zarr").exists()


def test_a_manifest_with_no_epoch_done_resumes(tmp_path, client):
    a = data()
    out = tmp_path / "out.zarr"
    with pytest.raises(OSError, match="input unreadable"):
        convert(FailingRows(a, 0), out, layout_for(a), client=client, backend="cpu", retries=0)
    assert json.loads((out / MANIFEST_KEY).read_text())["epochs_done"] == []
    report = convert(a, out, client=client, resume=True)
    assert report.verified.ok and report.epochs_skipped == 0 and report.epochs_written == 5


# -- the command line's output and exit status ---------------------------------------------------------
def test_cli_output_of_a_conversion_and_of_resuming_a_finished_one(tmp_path, capsys, client):
    a = data((16, 32, 32), seed=3)
    zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(4, 32, 32), dtype=a.dtype)[...] = a
    args = ["convert", str(tmp_path / "in.zarr"), str(tmp_path / "out.zarr"), "--tile", "4,32,32", "--backend", "cpu"]
    code = run_cli_on(client, args)
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0].startswith(f"converted into {tmp_path / 'out.zarr'}: ")
    assert out[1].endswith("0 problems")  # the verify line on its own line
    assert run_cli_on(client, [*args[:3], "--resume"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"nothing left to convert in {tmp_path / 'out.zarr'}: all 4 shard epochs were done"
    assert "nan" not in out[0] and out[1].endswith("0 problems")


def run_cli_on(client, argv):
    """``cli_main(argv)`` with its conversion on ``client``'s cluster (threads: fast), through the
    command line's own ``--scheduler``."""
    return cli_main([*argv, "--scheduler", client.scheduler.address])


def test_cli_missing_source_is_a_usage_error_without_a_progress_bar(tmp_path, capsys):
    code = cli_main(["convert", str(tmp_path / "missing.zarr"), str(tmp_path / "out.zarr"), "--local", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"napari-tileshard: error: {tmp_path / 'missing.zarr'} does not exist"
    assert not (tmp_path / "out.zarr").exists()


def test_cli_storage_failure_exits_1(tmpfs, tmp_path, capsys, client):
    disk = tmpfs("200k")
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**16, (37, 70, 90), dtype=np.uint16)  # incompressible: the disk fills up
    zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(8, 70, 90), dtype=a.dtype)[...] = a
    args = ["convert", str(tmp_path / "in.zarr"), str(disk / "out.zarr"), "--tile", "4,32,32", "--backend", "cpu"]
    code = run_cli_on(client, args)
    err = capsys.readouterr().err
    assert code == 1 and "No space left on device" in err and "Traceback" not in err


def test_report_of_a_resume_with_nothing_left():
    report = ConvertReport("x", epochs=3, epochs_skipped=3)
    assert report.epochs_done == 3 and np.isnan(report.compression_ratio)


def test_a_manifest_of_the_previous_format_still_resumes(tmp_path, client, caplog):
    """Written before the source and options were recorded: its options (then called identity)
    are reused and the source is not checked, with a warning."""
    a = data()
    out = stopped_conversion(tmp_path, client, a, layout=layout_for(a), backend="cpu", level=3)
    manifest = json.loads((out / MANIFEST_KEY).read_text())
    options = {k: v for k, v in manifest["options"].items() if k not in ("backend", "attributes")}
    (out / MANIFEST_KEY).write_text(json.dumps({"identity": options, "epochs_done": manifest["epochs_done"]}))
    with caplog.at_level("WARNING", logger="napari_tileshard.apps.convert"):
        report = convert(a, out, client=client, resume=True)
    assert report.verified.ok and report.epochs_skipped == len(manifest["epochs_done"])
    assert "did not record its source" in caplog.text
    assert json.loads((out / "zarr.json").read_text())["codecs"][0]["configuration"]["codecs"][1]["configuration"][
        "level"
    ] == 3  # fmt: skip


# -- the tiling: checked once, the same way as everywhere ----------------------------------------------
def test_an_impossible_tile_is_refused_naming_it_before_anything_is_written(tmp_path, client, capsys):
    a = data((4, 64, 64))
    with pytest.raises(ValueError, match=r"^dimension 't': tile_size must be >= 1, got -1$"):
        convert(a, tmp_path / "api.zarr", tile=(-1, 4, 4), client=client, backend="cpu")
    with pytest.raises(ValueError, match=r"^dimension 'y': tiles_per_shard must be >= 1, got 0$"):
        convert(a, tmp_path / "api.zarr", tiles_per_shard=(1, 0, 1), client=client, backend="cpu")
    assert not (tmp_path / "api.zarr").exists()
    zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(1, 64, 64), dtype=a.dtype)[...] = a
    code = run_cli_on(client, ["convert", str(tmp_path / "in.zarr"), str(tmp_path / "cli.zarr"), "--tile", "0,-5,32"])
    assert code == 2  # a usage error, as record's
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "napari-tileshard: error: dimension 't': tile_size must be >= 1, got 0"  # after "dashboard:"
    assert len(err) == 2 and "Traceback" not in err[0]
    assert not (tmp_path / "cli.zarr").exists()


def test_a_tile_larger_than_the_frame_is_clamped_with_a_note(tmp_path, client, capsys):
    a = data((4, 40, 50))
    with pytest.warns(TilingWarning, match=r"^tile 1000 along 'y' is larger than the dimension \(40\): using 40$"):
        convert(a, tmp_path / "api.zarr", tile=(2, 1000, 32), client=client, backend="cpu")
    assert zarr.open_array(tmp_path / "api.zarr").metadata.codecs[0].chunk_shape == (2, 40, 32)
    zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(1, 40, 50), dtype=a.dtype)[...] = a
    args = ["convert", str(tmp_path / "in.zarr"), str(tmp_path / "cli.zarr"), "--tile", "2,1000,1000"]
    args += ["--backend", "cpu"]
    assert run_cli_on(client, args) == 0
    err = capsys.readouterr().err
    assert "napari-tileshard: warning: tile 1000 along 'y' is larger than the dimension (40): using 40\n" in err
    assert "napari-tileshard: warning: tile 1000 along 'x' is larger than the dimension (50): using 50\n" in err
    assert zarr.open_array(tmp_path / "cli.zarr").metadata.codecs[0].chunk_shape == (2, 40, 50)
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "cli.zarr")[...], a)


def test_the_shards_reported_are_the_shards_on_disk_and_tiny_ones_are_noted(tmp_path, client, capsys):
    """--tile 1,1,32 once reported 518 shards for 512 on disk: a hedged write (a second copy of a
    slow one) was counted as another shard."""
    a = data((8, 64, 256))
    zarr.create_array(tmp_path / "in.zarr", shape=a.shape, chunks=(1, 64, 256), dtype=a.dtype)[...] = a
    args = ["convert", str(tmp_path / "in.zarr"), str(tmp_path / "out.zarr"), "--tile", "1,1,32", "--backend", "cpu"]
    assert run_cli_on(client, args) == 0
    captured = capsys.readouterr()
    on_disk = len(shard_files(tmp_path / "out.zarr"))
    assert on_disk == 8 * 64 * 8
    assert f", {on_disk} shards" in captured.out.splitlines()[0]
    assert "napari-tileshard: warning: chunks of 1x1x32 uint16 are 64 bytes, under 4 KiB" in captured.err
    assert "files per GB of data, 4,096 files for the whole array (over 10,000 per GB" in captured.err


def test_a_shard_written_twice_by_a_hedged_write_counts_once(tmp_path):
    from napari_tileshard.apps.convert import _EpochSink
    from napari_tileshard.storage.sinks import DirectorySink

    (tmp_path / "out.zarr").mkdir()
    sink = _EpochSink(DirectorySink.attach(tmp_path / "out.zarr"), epoch=3)
    sink.write("c/0/0", [b"abcd"])
    sink.write("c/0/0", [b"abcd"])  # the dispatcher's second copy of a slow write
    sink.write("c/0/1", [b"xy"])
    assert sink.keys == ["c/3/0", "c/3/1"] and sink.bytes == 6
    assert (tmp_path / "out.zarr" / "c" / "3" / "0").read_bytes() == b"abcd"


def test_a_big_endian_source_is_refused_saying_so(tmp_path, client):
    a = data((4, 8, 8)).astype(">u2")
    with pytest.raises(ValueError, match=r"dtype '>u2' is big-endian; the store is little-endian '<u2'"):
        convert(a, tmp_path / "be.zarr", client=client, backend="cpu")
    assert not (tmp_path / "be.zarr").exists()
