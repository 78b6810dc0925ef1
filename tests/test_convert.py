"""napari_tileshard.convert: existing data into sharded Zarr v3 / OME-Zarr on a Dask cluster."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import read_tensorstore

from napari_tileshard import Dim, Layout, Writer, WriterError
from napari_tileshard.cli import main as cli_main

distributed = pytest.importorskip("distributed", reason="the convert extra (dask distributed) is not installed")
tifffile = pytest.importorskip("tifffile", reason="the convert extra (tifffile) is not installed")

from napari_tileshard.convert import MANIFEST_KEY, convert  # noqa: E402


@pytest.fixture(scope="module")
def client():
    """Two workers, as on the 2-core CI machine (threads: a process cluster is tested by the CLI)."""
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
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
    assert array.metadata.dimension_names == ("z", "y", "x")


class FailingRows:
    """An array-like source whose rows from ``fail_from`` on cannot be read (a dying input)."""

    def __init__(self, array, fail_from):
        self.array, self.fail_from = array, fail_from
        self.shape, self.dtype = array.shape, array.dtype

    def __getitem__(self, rows):
        if rows.stop > self.fail_from:
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
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        distributed.Client(cluster) as process_client,
    ):
        report = convert(
            KillsItsWorker(a, 17, marker), tmp_path / "out.zarr", layout_for(a), client=process_client, backend="cpu"
        )
    assert marker.exists()  # a worker did die
    assert report.verified.ok
    assert len(report.keys) == len(set(report.keys))  # no shard written by two tasks
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
    with pytest.raises(ValueError, match=r"layout is \(37, 70, 90\) uint16 but the source is \(9, 40, 50\)"):
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
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
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
    from napari_tileshard.backends import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU backend not usable here: {reason}")
    a = data()
    report = convert(a, tmp_path / "out.zarr", layout_for(a), client=client, backend="gpu", ome=True)
    assert report.verified.ok and all(b.startswith("gpu") for b in report.backends)
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr" / "0")[...], a)


def test_gpu_workers_each_see_only_their_gpu():
    """gpus=: one worker process per GPU, each with CUDA_VISIBLE_DEVICES set before CUDA starts
    (checked here without a GPU: the environment the workers run with)."""
    from distributed import Client

    from napari_tileshard.convert import gpu_cluster

    with gpu_cluster([1, 0], threads_per_gpu=2) as cluster, Client(cluster) as gpu_client:
        seen = gpu_client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert sorted(seen.values()) == ["0", "1"]
        assert [info["nthreads"] for info in gpu_client.scheduler_info()["workers"].values()] == [2, 2]


def test_gpus_without_a_usable_gpu_is_one_clear_error_before_anything(tmp_path):
    from napari_tileshard.backends import gpu_unavailable_reason

    source = tmp_path / "in.zarr"
    zarr.create_array(source, shape=(4, 8), chunks=(2, 8), dtype="uint16", zarr_format=2)[:] = 1
    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is usable here: this checks the error on machines without one")
    with pytest.raises(RuntimeError, match="gpus='all' was requested but the GPU backend is not usable"):
        convert(source, tmp_path / "out.zarr", gpus="all")
    with pytest.raises(ValueError, match="with client= the cluster is yours"):
        convert(source, tmp_path / "out.zarr", gpus=1, client=object())
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
