"""The figures a user reads: sizes in units that fit them, counts in words, and a compression ratio
that means the same with and without an OME pyramid."""

from __future__ import annotations

import re

import pytest
import zarr

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.apps.cli import main
from napari_tileshard.apps.units import data_size, duration, memory_size, plural


def stored_bytes(path, level: str = "") -> int:
    """Bytes of every shard object of an array (``level``: an OME level's folder) on disk."""
    chunks = (path / level / "c") if level else (path / "c")
    return sum(p.stat().st_size for p in chunks.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (8192, "8.19 kB"),
        (4 << 20, "4.19 MB"),
        (42_000_000, "42.0 MB"),
        (268_435_456, "268 MB"),
        (999_999_999, "1.00 GB"),  # rounds into the next unit, never "1000 MB"
        (1 << 30, "1.07 GB"),
        (5e12, "5.00 TB"),
    ],
)
def test_data_sizes_pick_the_unit_that_keeps_three_figures(nbytes, text):
    assert data_size(nbytes) == text


def test_memory_sizes_are_binary_and_counts_are_words():
    sizes = [memory_size(n) for n in (512, 256 << 10, 16 << 20, 8 << 30)]
    assert sizes == ["512 B", "256.0 KiB", "16.0 MiB", "8.0 GiB"]
    assert [plural(n, "shard") for n in (0, 1, 2)] == ["0 shards", "1 shard", "2 shards"]
    assert plural(3, "index", "indexes") == "3 indexes"


def test_the_writer_reports_the_full_resolution_ratio_and_the_pyramid_bytes_apart(tmp_path):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 128, 32, 2), Dim("x", 128, 32, 2)], "uint16")
    frames = SyntheticCamera((128, 128), "uint16", seed=4).stack(8)
    with Writer(tmp_path / "plain.zarr", layout, backend="cpu") as plain:
        plain.append(frames)
    with Writer(tmp_path / "pyramid.ome.zarr", layout, backend="cpu", ome=True) as ome:
        ome.append(frames)
    levels = sorted(p.name for p in (tmp_path / "pyramid.ome.zarr").iterdir() if p.is_dir())
    assert len(levels) == ome.pyramid.levels > 1
    level0 = stored_bytes(tmp_path / "pyramid.ome.zarr", "0")
    coarser = sum(stored_bytes(tmp_path / "pyramid.ome.zarr", level) for level in levels[1:])
    stats = ome.stats
    assert stats.bytes_out == level0 + coarser and stats.pyramid_bytes_out == coarser > 0
    assert stats.full_resolution_bytes_out == level0 == stored_bytes(tmp_path / "plain.zarr")  # the same shards
    assert stats.compression_ratio == pytest.approx(frames.nbytes / level0)
    assert stats.compression_ratio == pytest.approx(plain.stats.compression_ratio)  # a pyramid changes nothing
    assert plain.stats.pyramid_bytes_out == 0


#: 4 frames of 128² in one shard
ONE_SHARD = ["--shape", "0,128,128", "--tile", "4,128,128", "--tiles-per-shard", "1,1,1"]


def _record(tmp_path, capsys, name, *options) -> str:
    out = tmp_path / name
    common = ["--frames", "4", "--backend", "cpu", "--no-progress", "--seed", "3"]
    assert main(["record", str(out), *common, *options]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_the_record_summary_reads_in_units_that_fit_and_counts_in_words(tmp_path, capsys):
    line = _record(tmp_path, capsys, "small.zarr", *ONE_SHARD)
    # 4 frames of 128² uint16 = 131 kB: no "(0.00 GB)"; one shard: not "1 shards"
    assert line.startswith(f"recorded 4 frames (131 kB) to {tmp_path / 'small.zarr'} in ")
    assert re.search(r": \d[\d.]* [kMG]?B/s, compression ratio \d+\.\d\d, 1 shard \(\d[\d.]* kB\), backend cpu", line)
    assert "0.00" not in line and "1 shards" not in line


def test_the_record_summary_gives_the_same_ratio_with_a_pyramid_and_its_bytes_apart(tmp_path, capsys):
    tiling = ["--shape", "0,256,256", "--tile", "2,64,64"]  # levels of 256², 128² and 64²
    plain = _record(tmp_path, capsys, "plain.zarr", *tiling)
    ome = _record(tmp_path, capsys, "ome.zarr", *tiling, "--ome")
    ratio = re.compile(r"compression ratio (\d+\.\d\d)")
    assert ratio.search(plain).group(1) == ratio.search(ome).group(1)  # was 1.77 against 1.41 (pyramid counted)
    assert "(full resolution)" in ome and "(full resolution)" not in plain
    levels = len(zarr.open_group(tmp_path / "ome.zarr", mode="r").attrs["ome"]["multiscales"][0]["datasets"])
    assert levels == 3
    assert re.search(rf"shards \(\d[\d.]* [kM]B \+ \d[\d.]* [kM]B of pyramid levels 1-{levels - 1}\)", ome)
    assert ome.endswith(f", {levels} pyramid levels")


def test_verify_counts_in_words(tmp_path, capsys):
    _record(tmp_path, capsys, "one.zarr", *ONE_SHARD)
    assert main(["verify", str(tmp_path / "one.zarr")]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("one.zarr: 1 shard, 1 chunk checked, 0 problems")


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.0012, "1.20 ms"),
        (0.0047, "4.70 ms"),
        (0.0347, "34.7 ms"),
        (0.347, "347 ms"),
        (1.0, "1.00 s"),
        (12.345, "12.35 s"),
    ],
)
def test_durations_never_read_zero(seconds, text):
    """A fast recording's summary said 'in 0.00 s'."""
    assert duration(seconds) == text
