"""The Qt-free recording loop (what the widget's QThread hosts)."""

import numpy as np
import pytest
from conftest import read_back

from napari_tileshard import Dim, Layout, SyntheticCamera, verify
from napari_tileshard.apps.recorder import Recorder, RecorderSettings


def layout(size=(48, 40)):
    return Layout([Dim("t", 0, 4, 2), Dim("y", size[0], 16, 2), Dim("x", size[1], 16, 2)], "uint16")


def test_synthetic_recording_is_frame_exact(tmp_path):
    settings = RecorderSettings(
        output=str(tmp_path / "r.zarr"), layout=layout(), fps=None, backend="cpu", seed=3, batch_bytes=1
    )
    progress = []
    recorder = Recorder(settings, on_progress=lambda s: progress.append(s.rows_complete))
    stats = recorder.start(synthetic_frames=37).join(timeout=60)
    assert stats.error is None and not recorder.is_recording
    assert stats.frames == 37 and stats.dropped == 0
    np.testing.assert_array_equal(read_back(tmp_path / "r.zarr"), SyntheticCamera((48, 40), "uint16", seed=3).stack(37))
    assert progress == sorted(progress) and progress[-1] == 37 and len(progress) > 1  # grew by shard epochs
    assert verify(tmp_path / "r.zarr").ok


def test_pushed_frames_block_policy_loses_nothing(tmp_path):
    settings = RecorderSettings(
        output=str(tmp_path / "p.zarr"),
        layout=layout(),
        source="camera layer",
        backend="cpu",
        queue_frames=2,
        policy="block",
    )
    recorder = Recorder(settings).start()
    frames = [np.full((48, 40), i, np.uint16) for i in range(30)]
    assert all(recorder.push(f) for f in frames)
    recorder.stop()
    stats = recorder.join(timeout=30)
    assert stats.frames == 30 and stats.dropped == 0
    np.testing.assert_array_equal(read_back(tmp_path / "p.zarr"), np.stack(frames))


def test_drop_policy_counts_exactly(tmp_path):
    settings = RecorderSettings(
        output=str(tmp_path / "d.zarr"),
        layout=layout(),
        source="camera layer",
        backend="cpu",
        queue_frames=1,
        policy="drop",
    )
    recorder = Recorder(settings)  # not started: nothing drains the queue
    accepted = [recorder.push(np.zeros((48, 40), np.uint16)) for _ in range(5)]
    assert accepted == [True, False, False, False, False]
    assert recorder.stats.dropped == 4
    recorder.start()
    recorder.stop()
    stats = recorder.join(timeout=30)
    assert stats.frames == 1 and read_back(tmp_path / "d.zarr").shape == (1, 48, 40)


def test_error_in_writer_ends_with_a_readable_store(tmp_path):
    settings = RecorderSettings(output=str(tmp_path / "e.zarr"), layout=layout(), source="camera layer", backend="cpu")
    recorder = Recorder(settings).start()
    for i in range(8):
        recorder.push(np.full((48, 40), i, np.uint16))
    recorder.push(np.zeros((10, 10), np.uint16))  # wrong frame shape: the writer raises
    stats = recorder.join(timeout=30)
    assert "ValueError" in stats.error and "frame shape" in stats.error
    out = read_back(tmp_path / "e.zarr")
    np.testing.assert_array_equal(out, np.stack([np.full((48, 40), i, np.uint16) for i in range(8)]))


def test_settings_are_validated(tmp_path):
    (tmp_path / "exists.zarr").mkdir()
    (tmp_path / "exists.zarr" / "zarr.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already exists"):
        Recorder(RecorderSettings(output=str(tmp_path / "exists.zarr"), layout=layout()))
    with pytest.raises(ValueError, match="policy 'lossy'"):
        Recorder(RecorderSettings(output=str(tmp_path / "x.zarr"), layout=layout(), policy="lossy"))
    with pytest.raises(TypeError, match="Layout"):
        Recorder(RecorderSettings(output=str(tmp_path / "x.zarr")))


def test_drop_policy_counts_every_dropped_frame_under_slow_storage(tmp_path, monkeypatch):
    """Storage slower than the camera: the store holds exactly the accepted frames, in order, and
    accepted + dropped equals what the source offered."""
    import time

    from napari_tileshard.storage.sinks import DirectorySink

    real_write = DirectorySink.write

    def slow_write(self, key, buffers):
        time.sleep(0.03)
        return real_write(self, key, buffers)

    monkeypatch.setattr(DirectorySink, "write", slow_write)
    out = tmp_path / "slow.zarr"
    settings = RecorderSettings(
        output=str(out),
        layout=layout((32, 32)),
        source="camera layer",
        backend="cpu",
        policy="drop",
        queue_frames=4,
        batch_bytes=1,
    )
    recorder = Recorder(settings).start()
    offered = 300
    accepted = []
    for i in range(offered):
        frame = np.full((32, 32), i, np.uint16)
        if recorder.push(frame):
            accepted.append(i)
    recorder.stop()
    stats = recorder.join(timeout=120)
    assert stats.error is None
    assert stats.dropped > 0  # the slow storage did make the queue overflow
    assert len(accepted) + stats.dropped == offered and stats.frames == len(accepted)
    np.testing.assert_array_equal(read_back(out)[:, 0, 0], accepted)
    assert verify(out).ok
