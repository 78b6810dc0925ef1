"""OME-Zarr 0.5 groups with a pyramid (first, NumPy-side version)."""

import json

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, SyntheticCamera, verify
from napari_tileshard.ome import OmeWriter, level_layouts, reduce2x


def reference(frames, k, method):
    for _ in range(k):
        frames = reduce2x(frames, method)
    return frames


@pytest.mark.parametrize("method", ["mean", "max", "min", "decimate"])
def test_levels_equal_the_numpy_reduction(tmp_path, method):
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 37, 8, 2), Dim("x", 29, 8, 2)], "uint16")
    frames = SyntheticCamera((37, 29), "uint16", seed=3).stack(7)
    path = tmp_path / "ome.zarr"
    with OmeWriter(path, layout, downsample=method, units={"y": "micrometer", "x": "micrometer"},
                   scale={"y": 0.65, "x": 0.65, "t": 0.1}, attributes={"sample": "beads"}) as writer:
        for frame in frames:
            writer.append(frame)
    group = zarr.open_group(path, mode="r")
    meta = json.loads((path / "zarr.json").read_text())
    ome = meta["attributes"]["ome"]
    assert meta["attributes"]["sample"] == "beads" and ome["version"] == "0.5"
    ms = ome["multiscales"][0]
    assert [a["name"] for a in ms["axes"]] == ["t", "y", "x"]
    assert [a["type"] for a in ms["axes"]] == ["time", "space", "space"] and ms["axes"][1]["unit"] == "micrometer"
    assert len(ms["datasets"]) == len(writer.layouts) == 4  # 37x29 -> 19x15 -> 10x8 -> 5x4 (fits one 8x8 tile)
    for k, dataset in enumerate(ms["datasets"]):
        assert dataset["coordinateTransformations"][0]["scale"] == pytest.approx([0.1, 0.65 * 2**k, 0.65 * 2**k])
        level = group[dataset["path"]]
        assert level.metadata.dimension_names == ("t", "y", "x")
        np.testing.assert_array_equal(level[...], reference(frames, k, method))
        assert verify(path / dataset["path"]).ok


def test_mean_rounding_is_documented_half_to_even():
    frames = np.array([[[1, 2], [2, 2]], [[0, 1], [0, 1]]], dtype=np.uint8)  # means 1.75 and 0.5
    np.testing.assert_array_equal(reduce2x(frames, "mean")[:, 0, 0], [2, 0])


def test_bad_options():
    layout = Layout([Dim("t", 0, 2, 1), Dim("y", 8, 4, 1), Dim("x", 8, 4, 1)], "uint8")
    with pytest.raises(ValueError, match="downsample 'median'"):
        OmeWriter("/tmp/never.zarr", layout, downsample="median")
    with pytest.raises(TypeError):
        OmeWriter("/tmp/never2.zarr", layout, attributes={"bad": object()})
    assert len(level_layouts(layout, max_levels=1)) == 1
