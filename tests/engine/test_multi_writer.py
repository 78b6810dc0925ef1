"""Several streams at once into one OME-Zarr collection (issue 19: several cameras)."""

import json
import threading

import numpy as np
import pytest
import zarr

from napari_tileshard import Dim, Layout, MultiWriter, SyntheticCamera, verify
from napari_tileshard.engine.backends import gpu_unavailable_reason
from napari_tileshard.engine.multi_writer import collection_streams
from napari_tileshard.storage.overwrite import overwrite_refusal

LEFT = Layout([Dim("t", 0, 4, 2), Dim("y", 48, 16, 2), Dim("x", 40, 16, 2)], "uint16")
RIGHT = Layout([Dim("t", 0, 2, 1), Dim("y", 24, 8, 2), Dim("x", 32, 16, 1)], "uint8")


def frames_of(layout, n, seed):
    return SyntheticCamera(layout.frame_shape, layout.dtype, seed=seed).stack(n)


def record(path, backend="cpu", devices=None, **options):
    """Two cameras, each appending from its own thread, in uneven bursts."""
    data = {"left": frames_of(LEFT, 21, 1), "right": frames_of(RIGHT, 13, 2)}
    with MultiWriter(path, {"left": LEFT, "right": RIGHT}, backend=backend, devices=devices, **options) as multi:

        def camera(name):
            frames = data[name]
            for start in range(0, len(frames), 3):
                multi.append(name, frames[start : start + 3])

        threads = [threading.Thread(target=camera, args=(name,)) for name in data]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return multi, data


def test_two_streams_from_two_threads_read_back_as_one_collection(tmp_path):
    path = tmp_path / "run.ome.zarr"
    multi, data = record(path)
    assert collection_streams(path) == {"left": "0", "right": "1"}
    root = zarr.open_group(path, mode="r")
    assert root.attrs["ome"]["bioformats2raw.layout"] == 3
    assert zarr.open_group(path / "OME", mode="r").attrs["ome"]["series"] == ["0", "1"]
    for name, key in (("left", "0"), ("right", "1")):
        image = zarr.open_group(path / key, mode="r")
        assert image.attrs["ome"]["multiscales"][0]["name"] == name
        np.testing.assert_array_equal(image["0"][:], data[name])
        assert verify(path / key / "0").ok
        assert multi.stats[name].frames == len(data[name])
    assert multi["left"].layout is LEFT


def test_ome_zarr_py_opens_every_stream_of_the_collection(tmp_path):
    pytest.importorskip("ome_zarr")
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader

    path = tmp_path / "run.ome.zarr"
    _, data = record(path)
    for key, name in (("0", "left"), ("1", "right")):
        nodes = list(Reader(parse_url(str(path / key)))())
        np.testing.assert_array_equal(np.asarray(nodes[0].data[0]), data[name])


def test_plain_arrays_without_ome(tmp_path):
    path = tmp_path / "run.zarr"
    _, data = record(path, ome=False)
    meta = json.loads((path / "zarr.json").read_text())
    assert "ome" not in meta["attributes"] and not (path / "OME").exists()
    np.testing.assert_array_equal(zarr.open_array(path / "1", mode="r")[:], data["right"])


def test_overwrite_replaces_our_collection_and_refuses_one_with_foreign_files(tmp_path):
    path = tmp_path / "run.ome.zarr"
    record(path)
    assert overwrite_refusal(path) is None
    with pytest.raises(FileExistsError):
        MultiWriter(path, {"left": LEFT}, backend="cpu")
    _, data = record(path, overwrite=True)
    np.testing.assert_array_equal(zarr.open_array(path / "1" / "0", mode="r")[:], data["right"])
    (path / "1" / "notes.txt").write_text("mine")
    refusal = overwrite_refusal(path)
    assert refusal and "notes.txt" in refusal
    with pytest.raises(FileExistsError, match="notes.txt"):
        MultiWriter(path, {"left": LEFT}, backend="cpu", overwrite=True)
    assert (path / "1" / "notes.txt").read_text() == "mine"


def test_a_stream_that_cannot_be_set_up_leaves_nothing_behind(tmp_path):
    path = tmp_path / "run.ome.zarr"
    # the second stream's shard epoch (16 frames of 8 GiB) cannot be held in memory: refused
    # after the first stream's Writer created its image, which must go again
    huge = Layout([Dim("t", 0, 4, 4), Dim("y", 65536, 4096, 1), Dim("x", 65536, 4096, 1)], "uint16")
    with pytest.raises(ValueError, match="shard epoch"):
        MultiWriter(path, {"left": LEFT, "huge": huge}, backend="cpu")
    assert not path.exists()


def test_bad_arguments_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="at least one stream"):
        MultiWriter(tmp_path / "a", {}, backend="cpu")
    with pytest.raises(ValueError, match="non-empty"):
        MultiWriter(tmp_path / "a", {"": LEFT}, backend="cpu")
    with pytest.raises(TypeError, match="'left'"):
        MultiWriter(tmp_path / "a", {"left": "not a layout"}, backend="cpu")
    with pytest.raises(ValueError, match="devices=\\[0\\]"):
        MultiWriter(tmp_path / "a", {"left": LEFT}, backend="cpu", devices=[0])
    with pytest.raises(KeyError, match="'middle'"):
        with MultiWriter(tmp_path / "b", {"left": LEFT}, backend="cpu") as multi:
            multi.append("middle", frames_of(LEFT, 1, 0))
    assert not (tmp_path / "a").exists()


def test_a_failing_stream_does_not_stop_the_others_from_being_finished(tmp_path):
    path = tmp_path / "run.ome.zarr"
    multi = MultiWriter(path, {"left": LEFT, "right": RIGHT}, backend="cpu")
    multi.append("left", frames_of(LEFT, 8, 1))
    with pytest.raises(ValueError, match="shape"):
        multi.append("right", np.zeros((1, 3, 3), np.uint8))  # refused, the stream stays usable
    multi.append("right", frames_of(RIGHT, 2, 2))
    multi.close()
    assert zarr.open_array(path / "0" / "0", mode="r").shape[0] == 8
    assert zarr.open_array(path / "1" / "0", mode="r").shape[0] == 2
    assert multi.closed
    with pytest.raises(ValueError, match="closed"):
        multi.append("left", frames_of(LEFT, 1, 1))


@pytest.mark.gpu
def test_streams_on_their_own_gpus_read_back_equal(tmp_path):
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"GPU backend not usable here: {reason}")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    devices = [0, 1] if count > 1 else [0, 0]
    path = tmp_path / "run.ome.zarr"
    MultiWriter.warm_up({"left": LEFT, "right": RIGHT}, backend="gpu", devices=devices)
    multi, data = record(path, backend="gpu", devices=devices)
    for name, key, device in (("left", "0", devices[0]), ("right", "1", devices[1])):
        described = multi.stats[name].backend  # "device N" is named for every GPU but the first
        assert described.startswith("gpu") and (f"device {device}" in described) == (device > 0)
        np.testing.assert_array_equal(zarr.open_array(path / key / "0", mode="r")[:], data[name])


def test_a_zarr_store_as_the_root_holds_every_stream_under_its_path():
    store = zarr.storage.MemoryStore()
    data = frames_of(RIGHT, 5, 3)
    with MultiWriter(store, {"a": LEFT, "b": RIGHT}, backend="cpu") as multi:
        multi.append("b", data)
    assert zarr.open_group(store, mode="r").attrs["tileshard_collection"]["streams"] == {"a": "0", "b": "1"}
    np.testing.assert_array_equal(zarr.open_array(store, path="1/0", mode="r")[:], data)
    assert zarr.open_array(store, path="0/0", mode="r").shape[0] == 0


def test_the_recorder_records_several_streams_headless(tmp_path):
    from napari_tileshard.apps.recorder import Recorder, RecorderSettings

    settings = RecorderSettings(
        output=str(tmp_path / "rec.zarr"), layout=LEFT, streams={"l": LEFT, "r": RIGHT}, backend="cpu", source="l"
    )
    recorder = Recorder(settings).start()
    left, right = frames_of(LEFT, 6, 1), frames_of(RIGHT, 3, 2)
    for frame in left:
        assert recorder.push(frame, "l")
    for frame in right:
        assert recorder.push(frame, "r")
    with pytest.raises(ValueError, match="stream 'x' is not one of 'l', 'r'"):
        recorder.push(left[0], "x")
    recorder.stop()
    stats = recorder.join(timeout=30)
    assert stats.error is None and stats.stream_frames == {"l": 6, "r": 3}
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "rec.zarr" / "1", mode="r")[:], right)
    assert settings.preview_settings().output == str(tmp_path / "rec.zarr" / "0")
