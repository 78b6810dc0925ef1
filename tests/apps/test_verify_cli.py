"""verify() and the command line."""

import subprocess
import sys

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer, verify
from napari_tileshard.apps.cli import main


@pytest.fixture
def store(tmp_path):
    layout = Layout([Dim("t", 0, 2, 2), Dim("y", 16, 8, 2), Dim("x", 16, 8, 1)], "uint16")
    path = tmp_path / "v.zarr"
    with Writer(path, layout, backend="cpu") as writer:
        writer.append(SyntheticCamera((16, 16), "uint16", seed=2).stack(8))
    return path


def test_clean_store_verifies(store):
    report = verify(store)
    assert report.ok, str(report)
    assert report.shards == 4 and report.chunks == 16


def test_truncated_shard(store):
    shard = store / "c/1/0/1"
    shard.write_bytes(shard.read_bytes()[:30])
    report = verify(store)
    assert [(p.key, p.chunk) for p in report.problems] == [("c/1/0/1", None)]
    assert "truncated" in report.problems[0].message


def test_flipped_index_byte_is_a_crc_mismatch(store):
    shard = store / "c/0/0/0"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    problems = verify(store).problems
    assert any(p.key == "c/0/0/0" and "CRC32C" in p.message for p in problems)


def test_flipped_chunk_byte_names_the_chunk(store):
    shard = store / "c/0/0/1"
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-(4 * 16 + 4) : -4]), "<u8").reshape(4, 2)
    offset, nbytes = index[2]
    raw[int(offset) + 5] ^= 0xFF  # inside the zstd frame header/data of chunk 2
    raw[int(offset) + int(nbytes) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    problems = verify(store).problems
    assert problems and all(p.key == "c/0/0/1" and p.chunk == 2 for p in problems)


def test_verify_cli_exit_codes(store, capsys):
    assert main(["verify", str(store)]) == 0
    (store / "c/1/0/0").write_bytes(b"garbage")
    assert main(["verify", str(store)]) == 1
    assert "c/1/0/0" in capsys.readouterr().out


def test_verify_not_a_store(tmp_path):
    report = verify(tmp_path / "missing.zarr")
    assert not report.ok and report.problems[0].key == "zarr.json"


def test_record_cli(tmp_path):
    out = tmp_path / "demo.zarr"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "napari_tileshard",
            "record",
            str(out),
            "--shape",
            "0,96,80",
            "--tile",
            "4,32,32",
            "--tiles-per-shard",
            "2,2,2",
            "--frames",
            "21",
            "--backend",
            "cpu",
            "--level",
            "3",
            "--seed",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "recorded 21 frames" in result.stdout and "B/s, compression ratio" in result.stdout
    assert str(out) in result.stdout
    array = zarr.open_array(out)
    assert array.shape == (21, 96, 80)
    assert array.metadata.dimension_names == ("t", "y", "x")
    np.testing.assert_array_equal(array[:], SyntheticCamera((96, 80), "uint16", seed=5).stack(21))
    again = subprocess.run(
        [sys.executable, "-m", "napari_tileshard", "record", str(out), "--frames", "1", "--backend", "cpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 2 and "overwrite" in again.stderr
    assert main(["verify", str(out)]) == 0


def test_record_cli_rejects_mismatched_lists(tmp_path, capsys):
    assert main(["record", str(tmp_path / "x.zarr"), "--shape", "0,8,8", "--tile", "2,4"]) == 2
    assert "--tile has 2" in capsys.readouterr().err


def test_record_cli_ome_pyramid_with_units(tmp_path, capsys):
    out = tmp_path / "ome.zarr"
    assert (
        main(
            [
                "record",
                str(out),
                "--shape",
                "0,96,80",
                "--tile",
                "2,32,32",
                "--tiles-per-shard",
                "1,2,2",
                "--frames",
                "5",
                "--backend",
                "cpu",
                "--ome",
                "--downsample",
                "min",
                "--no-progress",
                "--scale",
                "t=0.5,y=0.65,x=0.65",
                "--unit",
                "t=second,y=micrometer,x=micrometer",
            ]
        )
        == 0
    )
    assert "3 pyramid levels" in capsys.readouterr().out  # 96x80 -> 48x40 -> 24x20 fits one 32x32 tile
    multiscale = zarr.open_group(out, mode="r").attrs["ome"]["multiscales"][0]
    assert [a.get("unit") for a in multiscale["axes"]] == ["second", "micrometer", "micrometer"]
    assert multiscale["datasets"][1]["coordinateTransformations"][0]["scale"] == [0.5, 1.3, 1.3]
    frames = SyntheticCamera((96, 80), "uint16", seed=0).stack(5)
    np.testing.assert_array_equal(zarr.open_array(out / "2")[:], frames.reshape(5, 24, 4, 20, 4).min(axis=(2, 4)))
    assert main(["verify", str(out)]) == 0
    assert main(["record", str(tmp_path / "bad.zarr"), "--scale", "q=1", "--no-progress"]) == 2
    assert "'q', which is not one of the dims" in capsys.readouterr().err


def test_record_cli_units_take_symbols_and_refuse_unknown_ones(tmp_path, capsys):
    small = ["--shape", "0,32,32", "--tile", "1,32,32", "--tiles-per-shard", "1,1,1", "--frames", "2"]
    out = tmp_path / "u.zarr"
    args = ["--backend", "cpu", "--ome", "--no-progress", "--scale", "t=0.1,y=0.65,x=0.65"]
    assert main(["record", str(out), *small, *args, "--unit", "t=ms,y=um,x=µm"]) == 0
    multiscale = zarr.open_group(out, mode="r").attrs["ome"]["multiscales"][0]
    assert [a.get("unit") for a in multiscale["axes"]] == ["millisecond", "micrometer", "micrometer"]
    capsys.readouterr()
    bad = tmp_path / "bad.zarr"
    assert main(["record", str(bad), *small, *args, "--unit", "t=second,y=mircons"]) == 2
    err = capsys.readouterr().err
    assert "napari-tileshard: error: dimension 'y'" in err and "'mircons'" in err and "'micrometer'" in err
    assert not bad.exists()
