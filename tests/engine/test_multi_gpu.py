"""One stream over several GPUs (``Writer(devices=...)``): same bytes as one GPU."""

import hashlib

import numpy as np
import pytest
from conftest import read_back

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.engine.backends import gpu_unavailable_reason


def layout(frames=0):
    return Layout([Dim("t", frames, 4, 2), Dim("y", 200, 64, 2), Dim("x", 300, 64, 2)], "uint16")


def digest(path):
    h = hashlib.sha256()
    # shards only: an OME group's zarr.json names its store, which differs between the two
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json" and p.name[0] != "."):
        h.update(file.relative_to(path).as_posix().encode() + file.read_bytes())
    return h.hexdigest()


def test_devices_need_the_gpu_backend(tmp_path):
    with pytest.raises(ValueError, match=r"devices=\[0, 1\] selects GPUs: it needs backend='gpu' \(got 'cpu'\)"):
        Writer(tmp_path / "x.zarr", layout(), backend="cpu", devices=[0, 1])
    assert not (tmp_path / "x.zarr").exists()


@pytest.fixture
def gpus():
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU backend not usable here: {reason}")
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def record(path, frames, **options):
    # small batches: several per recording, so batches really alternate between the pipelines
    with Writer(path, layout(), backend="gpu", batch_bytes=1 << 20, **options) as writer:
        writer.append(frames)
    return writer


@pytest.mark.gpu
@pytest.mark.parametrize("ome", [False, True], ids=["array", "ome"])
def test_two_pipelines_write_the_bytes_of_one(tmp_path, gpus, ome):
    """devices=[0, 0]: two GPU pipelines on one GPU (the 2-GPU case where only one is present)."""
    frames = SyntheticCamera((200, 300), "uint16", seed=8).stack(45)
    one = record(tmp_path / "one.zarr", frames, ome=ome)
    two = record(tmp_path / "two.zarr", frames, ome=ome, devices=[0, 0])
    assert two.stats.backend.startswith("gpu x2")
    assert digest(tmp_path / "one.zarr") == digest(tmp_path / "two.zarr")
    np.testing.assert_array_equal(read_back(tmp_path / "two.zarr" / ("0" if ome else "")), frames)
    assert one.stats.shards_written == two.stats.shards_written


@pytest.mark.gpu
def test_two_gpus_write_the_bytes_of_one(tmp_path, gpus):
    if gpus < 2:
        pytest.skip(f"needs two GPUs, this machine has {gpus}")
    frames = SyntheticCamera((200, 300), "uint16", seed=9).stack(45)
    record(tmp_path / "one.zarr", frames)
    both = record(tmp_path / "both.zarr", frames, devices=[0, 1])
    assert "device 1" in both.stats.backend
    assert digest(tmp_path / "one.zarr") == digest(tmp_path / "both.zarr")


@pytest.mark.gpu
def test_unknown_gpu_numbers_are_named(tmp_path, gpus):
    with pytest.raises(ValueError, match=rf"devices=\[{gpus}\]: GPU numbers must be integers in 0..{gpus - 1}"):
        Writer(tmp_path / "x.zarr", layout(), backend="gpu", devices=[gpus])
    with pytest.raises(ValueError, match="devices must be 'all', a positive count or GPU numbers"):
        Writer(tmp_path / "x.zarr", layout(), backend="gpu", devices="first")
    assert not (tmp_path / "x.zarr").exists()
