"""What napari shows when the plugin's reader opens a recording: contrast limits from the data (the
plane napari shows first), so a camera's frames with a few bright beads do not open near black."""

from __future__ import annotations

import numpy as np
import pytest

from napari_tileshard import Dim, Layout, SyntheticCamera, Writer
from napari_tileshard.apps.napari_reader import CONTRAST_PERCENTILES, contrast_limits, read_zarr


def _layout(frame=(256, 192)) -> Layout:
    return Layout([Dim("t", 0, 2, 2), Dim("y", frame[0], 64, 2), Dim("x", frame[1], 64, 2)], "uint16")


@pytest.fixture(scope="module")
def frames():
    return SyntheticCamera((256, 192), "uint16", seed=7).stack(9)


def _window_of(plane) -> list[float]:
    return [float(v) for v in np.percentile(plane, CONTRAST_PERCENTILES)]


def test_a_recording_opens_with_limits_from_the_plane_napari_shows_first(tmp_path, frames):
    with Writer(tmp_path / "rec.zarr", _layout(), backend="cpu") as writer:
        writer.append(frames)
    ((data, meta, kind),) = read_zarr(str(tmp_path / "rec.zarr"))
    middle = frames[(len(frames) - 1) // 2]  # napari starts every slider in its middle
    assert meta["contrast_limits"] == pytest.approx(_window_of(middle))
    low, high = meta["contrast_limits"]
    # The camera's few bright beads saturate; the rest of the frame is not squeezed near black, as
    # it was between the plane's minimum and maximum (what napari picks for lazy data)
    assert (np.median(middle) - low) / (high - low) > 0.15
    assert (np.median(middle) - middle.min()) / (middle.max() - middle.min()) < 0.1


def test_a_pyramid_takes_its_limits_from_a_level_of_moderate_planes(tmp_path, frames, monkeypatch):
    with Writer(tmp_path / "rec.ome.zarr", _layout(), backend="cpu", ome=True) as writer:
        writer.append(frames)
    ((levels, meta, kind),) = read_zarr(str(tmp_path / "rec.ome.zarr"))
    assert meta["multiscale"] and len(levels) == 3
    assert meta["contrast_limits"] == pytest.approx(_window_of(frames[4]))  # level 0's planes are small enough
    import napari_tileshard.apps.napari_reader as reader

    monkeypatch.setattr(reader, "CONTRAST_PLANE_PIXELS", 128 * 96)  # now only level 1's planes are
    ((levels, meta, kind),) = read_zarr(str(tmp_path / "rec.ome.zarr"))
    assert meta["contrast_limits"] == pytest.approx(_window_of(np.asarray(levels[1][4])))


def test_each_channel_of_a_collection_gets_its_own_limits(tmp_path):
    """Channels of very different brightness: one window for all would leave the dim one black."""
    from napari_tileshard.apps.napari_reader import _split_channels

    bright = SyntheticCamera((64, 48), "uint16", seed=1).stack(3).astype(np.float32) * 20
    data = np.stack([bright / 20, bright], axis=1).astype(np.uint16)  # t, c, y, x
    attributes = {
        "ome": {
            "multiscales": [
                {"axes": [{"name": n, "type": k} for n, k in zip("tcyx", ("time", "channel", "space", "space"))]}
            ]
        }
    }
    meta = {"name": "img", "metadata": {}, "contrast_limits": [0, 1]}
    split = _split_channels(data, meta, attributes)
    assert split["channel_axis"] == 1
    assert split["contrast_limits"] == [pytest.approx(_window_of(data[1, c])) for c in range(2)]


def test_no_limits_where_there_is_nothing_to_read():
    assert contrast_limits(np.zeros((0, 4, 4), np.uint16)) is None
    assert contrast_limits(np.full((2, 4, 4), np.nan, np.float32)) is None
    assert contrast_limits(np.full((2, 4, 4), 7, np.uint16)) == [7.0, 8.0]  # a flat plane: a window around it
