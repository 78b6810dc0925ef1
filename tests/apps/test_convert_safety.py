"""A conversion never destroys its source: every spelling of "the same place" is refused before
anything is touched, whatever overwrite says (CLI exit status 2, the source byte for byte)."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, Writer
from napari_tileshard.apps.cli import main as cli_main

pytest.importorskip("distributed", reason="the convert extra (dask distributed) is not installed")
from napari_tileshard.apps.convert import SameLocationError, convert  # noqa: E402


def frames(shape=(8, 40, 48)):
    return (np.arange(np.prod(shape), dtype=np.uint32) % 4099).astype(np.uint16).reshape(shape)


LAYOUT = Layout([Dim("t", 0, 4, 1), Dim("y", 40, 16, 2), Dim("x", 48, 16, 2)], "uint16")


def record(path):
    with Writer(path, LAYOUT, backend="cpu") as writer:
        writer.append(frames())
    return Path(path) if "://" not in str(path) else path


def snapshot(root) -> dict:
    """Every file under ``root`` (names and contents): what must not change."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def source(tmp_path):
    src = record(tmp_path / "D.zarr")
    os.symlink(src, tmp_path / "link.zarr")
    return src


def spellings(tmp: Path) -> list[str]:
    d = tmp / "D.zarr"
    return [
        str(d),
        f"{d}/",
        f"{tmp}/./D.zarr",
        f"{tmp}/link.zarr/../D.zarr",
        f"file://{d}",
        str(tmp / "link.zarr"),  # a symlink to the source
        str(d / "copy.zarr"),  # inside the source
        str(tmp),  # the source's parent
    ]


@pytest.mark.parametrize("which", range(8))
def test_cli_convert_into_its_own_source_is_refused_and_the_source_is_untouched(source, tmp_path, capsys, which):
    dst = spellings(tmp_path)[which]
    before = snapshot(source)
    code = cli_main(["convert", str(source), dst, "--overwrite", "--local", "1", "--backend", "cpu"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "a conversion never writes where it reads" in err and "Traceback" not in err
    assert snapshot(source) == before
    np.testing.assert_array_equal(zarr.open_array(source)[...], frames())
    assert not (source / "copy.zarr").exists()


@pytest.mark.parametrize("resume", [False, True], ids=["overwrite", "resume"])
def test_api_convert_into_its_own_source_is_refused(source, tmp_path, resume):
    before = snapshot(source)
    options = {"resume": True} if resume else {"overwrite": True}
    with pytest.raises(SameLocationError, match="is the source"):
        convert(source, tmp_path / "link.zarr", local_workers=1, backend="cpu", **options)
    assert snapshot(source) == before


def test_an_array_read_from_the_destination_is_refused(source, tmp_path):
    """A zarr array, or a dask array built on one, reads from its store: writing there is refused too."""
    import dask.array as da

    before = snapshot(source)
    with pytest.raises(SameLocationError, match="is the source"):
        convert(zarr.open_array(source), source, overwrite=True, local_workers=1, backend="cpu")
    with pytest.raises(SameLocationError, match="contains the source"):
        convert(da.from_zarr(zarr.open_array(source)) + 1, tmp_path, overwrite=True, local_workers=1)
    assert snapshot(source) == before


def test_a_source_inside_the_destination_folder_of_tiffs_is_refused(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    (tmp_path / "frames").mkdir()
    for i, frame in enumerate(frames()):
        tifffile.imwrite(tmp_path / "frames" / f"f{i}.tif", frame)
    with pytest.raises(SameLocationError, match="is inside the source"):
        convert(tmp_path / "frames", tmp_path / "frames" / "out.zarr", local_workers=1)
    assert sorted(os.listdir(tmp_path / "frames")) == [f"f{i}.tif" for i in range(8)]


def test_a_conversion_beside_its_source_still_works(source, tmp_path):
    """The refusal is exact: a sibling whose name starts with the source's is another place."""
    report = convert(source, f"{source}2", local_workers=1, backend="cpu")
    assert report.verified.ok
    np.testing.assert_array_equal(zarr.open_array(f"{source}2")[...], frames())


@pytest.mark.parametrize(
    "dst", ["s3://{b}/D.zarr", "s3://{b}/D.zarr/", "s3://{b}//D.zarr", "s3://{b}/D.zarr/copy", "s3://{b}"]
)
def test_s3_convert_into_its_own_prefix_is_refused(s3, tmp_path, dst, capsys):
    """The same bucket and prefix in any spelling (and a parent or child prefix) is refused."""
    local = record(tmp_path / "D.zarr")
    src = f"s3://{s3.bucket}/D.zarr"
    record(src)
    keys = s3.keys(s3.bucket)
    code = cli_main(["convert", src, dst.format(b=s3.bucket), "--overwrite", "--local", "1", "--backend", "cpu"])
    assert code == 2, capsys.readouterr().err
    assert s3.keys(s3.bucket) == keys
    np.testing.assert_array_equal(zarr.open_array(local)[...], frames())


# -- options that cannot run are refused at once; no wait for workers lasts for good ------------


@pytest.mark.parametrize("flags", [["--local", "-1"], ["--local", "0"], ["--retries", "-1"], ["--worker-timeout", "0"]])
def test_cli_refuses_options_that_cannot_run_before_anything(source, tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as stop:
        cli_main(["convert", str(source), str(tmp_path / "out.zarr"), *flags])
    assert stop.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err
    assert not (tmp_path / "out.zarr").exists()


@pytest.mark.parametrize(
    "options, named",
    [
        ({"local_workers": -2}, "local_workers must be a positive number of worker processes, got -2"),
        ({"local_workers": 0}, "got 0"),
        ({"local_workers": True}, "got True"),
        ({"local_workers": 1.5}, "got 1.5"),
        ({"retries": -1}, "retries must be 0 or more"),
        ({"retries": 0.5}, "got 0.5"),
        ({"worker_timeout": 0}, "worker_timeout must be a positive number of seconds, got 0"),
    ],
)
def test_api_refuses_options_that_cannot_run_before_anything(source, tmp_path, options, named):
    with pytest.raises(ValueError, match=named):
        convert(source, tmp_path / "out.zarr", **options)
    assert not (tmp_path / "out.zarr").exists()


@pytest.fixture
def workerless():
    """A scheduler nobody started a worker for."""
    import distributed

    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            yield client


def test_a_cluster_without_workers_is_an_error_within_the_deadline(source, tmp_path, workerless):
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no Dask worker was connected to .* for 1 s: start workers"):
        convert(source, tmp_path / "out.zarr", client=workerless, worker_timeout=1)
    assert time.monotonic() - start < 15
    # The destination claims nothing; a resume on a cluster with workers finishes it.
    assert zarr.open_array(tmp_path / "out.zarr").attrs["tileshard"]["rows_written"] == 0
    report = convert(source, tmp_path / "out.zarr", resume=True, local_workers=1)
    assert report.verified.ok
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "out.zarr")[...], frames())


def test_cli_scheduler_without_workers_is_one_line_and_exit_1(source, tmp_path, workerless, capsys):
    argv = ["convert", str(source), str(tmp_path / "out.zarr"), "--scheduler", workerless.scheduler.address]
    code = cli_main([*argv, "--worker-timeout", "1"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "no Dask worker was connected" in err and "Traceback" not in err


# -- interrupts landing while convert publishes -------------------------------------------------
#: where the coordinator writes the manifest and zarr.json (its main thread)
PUBLISHING = {"finished_epoch", "_write_manifest", "_advance", "_write_metadata", "_write", "_writev_all", "begin"}


def level0_rows(root: Path, ome: bool) -> int:
    """The rows level 0's zarr.json claims (0 without one)."""
    path = root / ("0/zarr.json" if ome else "zarr.json")
    if not path.exists():
        return 0
    return json.loads(path.read_text())["attributes"]["tileshard"]["rows_written"]


def temporary_files(root: Path, coordinator: bool = False) -> list[str]:
    """Temporary files under ``root``; ``coordinator``: only those of convert's own writes (the
    manifest and zarr.json: a task running when convert stopped may still be writing its shards)."""
    names = (".zarr.json.", ".tileshard-convert.json.") if coordinator else (".",)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp") if p.name.startswith(names))


def idle(client, timeout: float = 20.0) -> None:
    """Wait until no task runs on ``client``'s cluster (tasks of a stopped conversion finish)."""
    import time

    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture(scope="module")
def threads():
    import dask
    import distributed

    with dask.config.set({"distributed.worker.profile.enabled": False}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        yield client


@pytest.mark.parametrize("ome", [False, True], ids=["array", "ome"])
def test_an_interrupt_anywhere_while_publishing_leaves_a_store_and_summary_that_agree(tmp_path, threads, ome):
    """Ctrl-C landing inside a manifest or zarr.json write used to leave a 0-byte temporary file,
    and 4 of 18 interrupted converts reported fewer rows than the zarr.json just written.  Every
    9th place of the publishing steps of a 3-epoch conversion gets a Ctrl-C (scripts/
    stress_convert_interrupts.py tries every place)."""
    from napari_tileshard.apps.convert import ConvertInterrupted
    from napari_tileshard.testing import InterruptAt

    a = frames((12, 40, 48))
    layout = Layout([Dim("t", 12, 2, 2), Dim("y", 40, 16, 2), Dim("x", 48, 16, 2)], "uint16")
    places, k, runs = None, 1, 0
    while places is None or k <= places:
        out = tmp_path / f"out{k}.zarr"
        injector = InterruptAt(k, PUBLISHING)
        try:
            with injector:
                convert(a, out, layout, client=threads, backend="cpu", ome=ome, verify=False)
        except ConvertInterrupted as stop:
            runs += 1
            assert temporary_files(out, coordinator=True) == [], f"place {k}"
            if stop.started:
                assert stop.report.rows_claimed == level0_rows(out, ome), f"place {k}"
            idle(threads)
            report = convert(a, out, resume=True, client=threads)
            assert report.verified.ok and temporary_files(out) == []
            np.testing.assert_array_equal(zarr.open_array(out / ("0" if ome else ""))[...], a)
        else:
            places = injector.seen  # the run went past every place: how many there are
        k += 9
    assert runs >= 8, f"{runs} interrupted runs of {places} places"


def test_cli_resume_with_overwrite_is_refused_in_the_command_lines_words(source, tmp_path, capsys):
    code = cli_main(["convert", str(source), str(tmp_path / "out.zarr"), "--resume", "--overwrite"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (
        "napari-tileshard: error: --resume continues an earlier conversion; it cannot be combined with "
        "--overwrite, which starts over"
    )
    assert not (tmp_path / "out.zarr").exists()


def test_the_compression_ratio_of_a_conversion_is_the_full_resolution_arrays(tmp_path, capsys):
    """It counted the pyramid's bytes too: the same data gave another ratio with --ome."""
    source = tmp_path / "in.zarr"
    a = (np.arange(4 * 128 * 128) % 977).astype(np.uint16).reshape(4, 128, 128)
    zarr.create_array(source, shape=a.shape, chunks=(1, 128, 128), dtype=a.dtype)[...] = a
    ratios = {}
    for ome in (False, True):
        report = convert(source, tmp_path / f"out{ome}.zarr", local_workers=1, backend="cpu", ome=ome, tile=(1, 32, 32))
        assert (report.pyramid_bytes_out > 0) == ome
        ratios[ome] = report.compression_ratio
    assert ratios[True] == pytest.approx(ratios[False])
    argv = ["convert", str(source), str(tmp_path / "cli.zarr"), "--local", "1", "--ome", "--tile", "1,32,32"]
    code = cli_main(argv)
    out = capsys.readouterr().out
    assert code == 0 and "(full resolution)" in out and "of pyramid levels)" in out, out
