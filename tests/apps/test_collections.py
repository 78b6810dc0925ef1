"""Collections (``bioformats2raw.layout``): MultiWriter runs, TileShardSink MDAs and collections written
by others pass verify image by image, open in napari as one image layer per image (per channel), never
as a table, and the inspector lists their images."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, MultiWriter, SyntheticCamera
from napari_tileshard.apps.cli import main
from napari_tileshard.apps.inspect_shards import inspect_array, list_images
from napari_tileshard.apps.napari_reader import napari_get_reader
from napari_tileshard.apps.verify import verify
from napari_tileshard.reader.collection import collection_images


def _layout(frame, dtype="uint16", pixel_um=0.5) -> Layout:
    return Layout(
        [
            Dim("t", 0, 2, 1, unit="second", scale=0.1),
            Dim("y", frame[0], 16, 2, unit="micrometer", scale=pixel_um),
            Dim("x", frame[1], 16, 2, unit="micrometer", scale=pixel_um),
        ],
        dtype,
    )


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    """Two cameras of different frames and dtypes, one collection."""
    path = tmp_path_factory.mktemp("multi") / "run.ome.zarr"
    frames = {
        "left": SyntheticCamera((64, 48), "uint16", seed=1).stack(5),
        "right": SyntheticCamera((40, 32), "uint8", seed=2).stack(3),
    }
    streams = {"left": _layout((64, 48)), "right": _layout((40, 32), "uint8", pixel_um=0.25)}
    with MultiWriter(path, streams, backend="cpu") as writer:
        for name, stack in frames.items():
            writer.append(name, stack)
    return path, frames


@pytest.fixture(scope="module")
def mda(tmp_path_factory):
    """An MDA of two named stage positions × 2 time points × 2 channels, recorded by TileShardSink
    from the offline demo core: images at 0/ and 1/, the frame metadata tables beside them."""
    pytest.importorskip("pymmcore_plus")
    root_level = logging.getLogger().level
    import useq

    from napari_tileshard.apps.mmcore import TileShardSink
    from napari_tileshard.apps.mmcore.demo import demo_core

    logging.getLogger().setLevel(root_level)  # pymmcore-plus sets the root logger to DEBUG on import
    logging.getLogger("pymmcore-plus").setLevel(logging.CRITICAL)
    path = tmp_path_factory.mktemp("mda") / "mda.ome.zarr"
    core = demo_core((32, 40), pixel_size_um=0.65, channels={"DAPI": 10.0, "FITC": 20.0})
    sequence = useq.MDASequence(
        time_plan={"interval": 0, "loops": 2},
        channels=["DAPI", "FITC"],
        stage_positions=[useq.Position(x=0, y=0, name="A1"), useq.Position(x=50, y=20, name="B2")],
        axis_order="tpc",
    )
    sink = TileShardSink(path, backend="cpu")
    core.mda.run(sequence, output=sink)
    assert sink.wait_closed(30)
    return path


def test_a_multiwriter_collection_verifies_image_by_image_on_the_command_line(multi, capsys):
    path, _ = multi
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    head, *lines = out.strip().splitlines()
    assert head.startswith(f"{path}: a collection of 2 images, ") and head.endswith(", 0 problems")
    report = verify(path)
    levels = [len(zarr.open_group(path / k, mode="r").attrs["ome"]["multiscales"][0]["datasets"]) for k in "01"]
    assert [(i.name, i.path, i.levels) for i in report.images] == [("left", "0", levels[0]), ("right", "1", levels[1])]
    assert sum(i.shards for i in report.images) == report.shards > 0
    assert sum(i.chunks for i in report.images) == report.chunks > 0
    assert lines[:2] == [f"  {report.images[0]}", f"  {report.images[1]}"]
    seen = []
    verify(path, progress=lambda done, total: seen.append((done, total)))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # counts up across images and levels
    assert seen[-1] == (report.shards, report.shards)
    assert f"image 'left' (0/): {levels[0]} levels" in lines[0]


def test_a_damaged_shard_is_reported_under_its_image(multi, tmp_path):
    import shutil

    path = tmp_path / "damaged.ome.zarr"
    shutil.copytree(multi[0], path)
    shard = path / "1" / "0" / "c" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF  # inside the first chunk's zstd frame header
    shard.write_bytes(bytes(data))
    report = verify(path)
    assert not report.ok and [p.key for p in report.problems] == ["1/0/c/0/0/0"]
    assert [i.problems for i in report.images] == [0, 1]
    assert main(["verify", str(path)]) == 1


def test_an_mda_collection_verifies_and_leaves_its_tables_out(mda, capsys):
    assert main(["verify", str(mda)]) == 0
    out = capsys.readouterr().out
    report = verify(mda)
    assert [(i.name, i.path) for i in report.images] == [("A1", "0"), ("B2", "1")]  # the positions' names
    assert all(i.shards > 0 and i.problems == 0 for i in report.images)
    assert "not images, not checked: frame_metadata, frame_metadata_json" in out
    assert zarr.open_array(mda / "frame_metadata", mode="r").shape == (8, 8)  # there, and not an image


def test_the_napari_reader_opens_each_stream_as_an_image_layer(multi):
    path, frames = multi
    layers = napari_get_reader(str(path))(str(path))
    assert [kind for _, _, kind in layers] == ["image", "image"]
    (left, left_meta, _), (right, right_meta, _) = layers
    assert [left_meta["name"], right_meta["name"]] == ["left", "right"]
    assert left_meta["axis_labels"] == ["t", "y", "x"] and left_meta["multiscale"]
    assert left_meta["scale"] == pytest.approx([0.1, 0.5, 0.5])
    assert right_meta["scale"] == pytest.approx([0.1, 0.25, 0.25])
    assert right_meta["units"] == ["second", "micrometer", "micrometer"]
    np.testing.assert_array_equal(np.asarray(left[0][4]), frames["left"][4])
    np.testing.assert_array_equal(np.asarray(right[0]), frames["right"])
    assert right_meta["metadata"]["image"] == "right" and right_meta["metadata"]["image_path"] == "1"


def test_the_napari_reader_splits_an_mda_into_channels_and_never_shows_the_table(mda):
    ViewerModel = pytest.importorskip("napari.components", reason="the napari extra is not installed").ViewerModel

    layers = napari_get_reader(str(mda))(str(mda))
    assert len(layers) == 2 and all(kind == "image" for _, _, kind in layers)
    shapes = [(level[0] if meta.get("multiscale") else level).shape for level, meta, _ in layers]
    assert shapes == [(2, 2, 32, 40)] * 2  # t, c, y, x: no 8×8 float table among them
    viewer = ViewerModel()
    for data, meta, _ in layers:
        viewer.add_image(data, **meta)  # what napari does with a reader's layer tuple
    assert [layer.name for layer in viewer.layers] == ["A1: DAPI", "A1: FITC", "B2: DAPI", "B2: FITC"]
    fitc = viewer.layers["B2: FITC"]
    assert tuple(fitc.axis_labels) == ("t", "y", "x")
    assert tuple(fitc.scale) == pytest.approx((1.0, 0.65, 0.65))
    written = zarr.open_array(mda / "1" / "0", mode="r")
    data = fitc.data[0] if fitc.multiscale else fitc.data
    np.testing.assert_array_equal(np.asarray(data[1]), written[1, 1])


def test_the_inspector_lists_the_images_and_inspects_the_one_chosen(multi, mda):
    path, frames = multi
    assert [(i.name, i.path) for i in list_images(path)] == [("left", "0"), ("right", "1")]
    right = inspect_array(path, image="right")
    assert right.shape == frames["right"].shape and right.array_path == "1/0"
    assert inspect_array(path, image="1").shape == right.shape
    assert inspect_array(path).shape == frames["left"].shape  # the first image by default
    with pytest.raises(ValueError, match="no image 'middle'.*'left' \\(0/\\), 'right' \\(1/\\)"):
        inspect_array(path, image="middle")
    assert [(i.name, i.path) for i in list_images(mda)] == [("A1", "0"), ("B2", "1")]
    single = path / "0"  # one image alone: listed as that image, which inspect_array takes by name or ""
    assert [(i.name, i.path) for i in list_images(single)] == [("left", "")]
    assert inspect_array(single, image="left").shape == inspect_array(single, image="").shape == frames["left"].shape
    with pytest.raises(ValueError, match="no image 'right' here; this store is one image, 'left'"):
        inspect_array(single, image="right")


def _foreign_collection(root: Path, *, series_list: bool) -> dict[str, np.ndarray]:
    """A collection as bioformats2raw lays it out, written with zarr-python only: OME-Zarr 0.5
    images of sharded arrays, an ``OME`` group listing them (or none: the images are 0, 1, ...)
    with the OME-XML beside it."""
    data = {}
    zarr.open_group(root, mode="w", zarr_format=3, attributes={"ome": {"version": "0.5", "bioformats2raw.layout": 3}})
    for k, name in enumerate(("cells", None)):
        image = np.arange(2 * 3 * 24 * 20, dtype="uint16").reshape(2, 3, 24, 20) * (k + 1)
        data[str(k)] = image
        axes = [
            {"name": "t", "type": "time"},
            {"name": "c", "type": "channel"},
            {"name": "y", "type": "space", "unit": "micrometer"},
            {"name": "x", "type": "space", "unit": "micrometer"},
        ]
        multiscale = {
            "axes": axes,
            "datasets": [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 1, 0.2, 0.2]}]}],
        }
        if name:
            multiscale["name"] = name
        omero = {
            "channels": [
                {"label": label, "color": color, "window": {"start": 0, "end": 1000, "min": 0, "max": 65535}}
                for label, color in (("DNA", "0000FF"), ("actin", "00FF00"), ("tubulin", "FF0000"))
            ]
        }
        group = zarr.open_group(
            root / str(k),
            mode="w",
            zarr_format=3,
            attributes={"ome": {"version": "0.5", "multiscales": [multiscale], "omero": omero}},
        )
        array = group.create_array(
            "0", shape=image.shape, dtype=image.dtype, chunks=(1, 1, 8, 10), shards=(1, 3, 24, 20)
        )
        array[...] = image
    series = {"ome": {"version": "0.5", "series": ["0", "1"]}} if series_list else {"ome": {"version": "0.5"}}
    zarr.open_group(root / "OME", mode="w", zarr_format=3, attributes=series)
    (root / "OME" / "METADATA.ome.xml").write_text("<OME/>")
    return data


@pytest.mark.parametrize("series_list", [True, False], ids=["series-list", "numbered"])
def test_a_collection_written_by_others_verifies_and_opens(tmp_path, series_list, capsys):
    path = tmp_path / "b2r.ome.zarr"
    data = _foreign_collection(path, series_list=series_list)
    assert main(["verify", str(path)]) == 0
    assert "a collection of 2 images" in capsys.readouterr().out
    images = collection_images(path)
    assert [(i.name, i.path, i.named) for i in images] == [("cells", "0", True), ("series 1", "1", False)]
    layers = napari_get_reader(str(path))(str(path))
    (cells, cells_meta, _), (other, other_meta, _) = layers
    assert cells_meta["name"] == ["cells: DNA", "cells: actin", "cells: tubulin"]
    assert other_meta["name"] == ["b2r series 1: DNA", "b2r series 1: actin", "b2r series 1: tubulin"]
    assert cells_meta["channel_axis"] == 1
    assert cells_meta["axis_labels"] == [["t", "y", "x"]] * 3
    assert cells_meta["scale"] == [pytest.approx([1, 0.2, 0.2])] * 3
    assert cells_meta["contrast_limits"] == [[0, 1000]] * 3
    assert [c["colors"][1][:3] for c in cells_meta["colormap"]] == [[0, 0, 1], [0, 1, 0], [1, 0, 0]]
    level0 = other[0] if other_meta.get("multiscale") else other
    np.testing.assert_array_equal(np.asarray(level0[1]), data["1"][1])


def test_an_image_the_series_list_names_but_the_store_lacks_is_a_problem(tmp_path):
    path = tmp_path / "b2r.ome.zarr"
    _foreign_collection(path, series_list=True)
    series = path / "OME" / "zarr.json"
    meta = json.loads(series.read_text())
    meta["attributes"]["ome"]["series"] = ["0", "1", "2"]
    series.write_text(json.dumps(meta))
    report = verify(path)
    assert [str(p) for p in report.problems] == ["2/zarr.json: image 'series 2': listed, but not in the store"]
    layers = napari_get_reader(str(path))(str(path))
    assert len(layers) == 2  # the images that are there still open


def test_the_inspector_widget_picks_an_image_of_a_collection(make_napari_viewer, qtbot, multi):
    pytest.importorskip("qtpy")
    from napari_tileshard._qt.inspector_widget import InspectorWidget

    path, frames = multi
    widget = InspectorWidget(make_napari_viewer())
    qtbot.addWidget(widget)
    widget.open(str(path))
    picker = widget.image_picker
    assert [picker.itemText(k) for k in range(picker.count())] == ["left (0/)", "right (1/)"]
    assert not picker.isHidden() and widget.inspection.shape == frames["left"].shape
    picker.setCurrentIndex(1)
    assert widget.image == "1" and widget.inspection.shape == frames["right"].shape
    widget.open(str(path / "0"))  # a single image: nothing to pick
    assert picker.isHidden() and widget.image == "" and widget.inspection.shape == frames["left"].shape


@pytest.mark.parametrize("stream_path", [".", "", "../elsewhere", "/abs", "0/../0"])
def test_a_collection_whose_streams_leave_it_is_no_collection_of_images(tmp_path, stream_path):
    """Stream paths that would name the collection itself (an image at "." would open the
    collection again, and again) or leave it are not followed."""
    from napari_tileshard.format.ome import COLLECTION_KEY, stream_paths

    attributes = {
        "ome": {"version": "0.5", "multiscales": [{"axes": [], "datasets": [{"path": "0"}]}]},
        COLLECTION_KEY: {"streams": {"a": stream_path}},
    }
    assert stream_paths(attributes) is None
    path = tmp_path / "loop.ome.zarr"
    zarr.open_group(path, mode="w", zarr_format=3, attributes=attributes)
    assert collection_images(path) is None
