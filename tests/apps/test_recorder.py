"""The Qt-free recording loop (what the widget's QThread hosts)."""

import time
import warnings

import numpy as np
import pytest
from conftest import read_back

from napari_tileshard import Dim, Layout, SyntheticCamera, verify
from napari_tileshard.apps.recorder import LiveRate, Recorder, RecorderSettings
from napari_tileshard.format.layout import TilingWarning


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


class FakeLayer:
    """What LayerSource reads of a napari image layer: its data and name."""

    def __init__(self, data, name="camera"):
        self.data, self.name = data, name


def test_a_stack_layer_is_recorded_plane_by_plane_once_and_the_recording_ends_by_itself(tmp_path):
    stack = np.random.default_rng(1).integers(0, 4000, (40, 48, 40)).astype(np.uint16)
    settings = RecorderSettings(output=str(tmp_path / "s.zarr"), layout=layout(), source="stack", backend="cpu")
    recorder = Recorder(settings)
    source = recorder.add_layer(FakeLayer(stack, "stack"))
    assert source.is_stack and source.planes == 40
    stats = recorder.start().join(timeout=60)  # no stop(): the last plane ends it
    assert not recorder.is_recording and stats.error is None
    assert stats.frames == stats.rows_complete == 40 and stats.dropped == 0
    assert stats.ended == "all 40 planes of layer 'stack' were recorded"
    np.testing.assert_array_equal(read_back(tmp_path / "s.zarr"), stack)
    assert source.status() == "layer 'stack': 40 of 40 planes"


def test_a_stack_of_more_dims_keeps_its_order_and_ignores_the_drop_policy(tmp_path):
    """A (3, 5, y, x) stack into a (t, z, y, x) layout: planes in C order, none dropped even with
    the drop policy and a one-frame queue (a stack in memory can wait; a camera cannot)."""
    stack = np.arange(3 * 5 * 16 * 8, dtype=np.uint16).reshape(3, 5, 16, 8)
    four = Layout([Dim("t", 0, 1, 1), Dim("z", 5, 1, 1), Dim("y", 16, 16, 1), Dim("x", 8, 8, 1)], "uint16")
    settings = RecorderSettings(
        output=str(tmp_path / "z.zarr"), layout=four, source="s", backend="cpu", policy="drop", queue_frames=1
    )
    recorder = Recorder(settings)
    recorder.add_layer(FakeLayer(stack, "s"))
    stats = recorder.start().join(timeout=60)
    assert stats.frames == 15 and stats.dropped == 0 and stats.rows_complete == 3
    np.testing.assert_array_equal(read_back(tmp_path / "z.zarr"), stack)


def test_a_stack_that_does_not_fit_a_bounded_layout_is_refused_naming_it(tmp_path):
    bounded = Layout([Dim("t", 10, 2, 1), Dim("y", 48, 16, 2), Dim("x", 40, 16, 2)], "uint16")
    recorder = Recorder(RecorderSettings(output=str(tmp_path / "b.zarr"), layout=bounded, backend="cpu"))
    with pytest.raises(ValueError, match="layer 'big' holds 12 planes but the dimensions .* hold 10 frames"):
        recorder.add_layer(FakeLayer(np.zeros((12, 48, 40), np.uint16), "big"))
    with pytest.raises(ValueError, match=r"layer 'odd' has data of shape \(48, 41\); frames of \(48, 40\)"):
        recorder.add_layer(FakeLayer(np.zeros((48, 41), np.uint16), "odd"))


def test_a_live_layer_records_one_frame_per_change(tmp_path):
    """An assignment records its frame; a refresh records only a change (napari also emits
    set_data within an assignment and on redraws that change nothing)."""
    layer = FakeLayer(np.zeros((48, 40), np.uint16))
    settings = RecorderSettings(output=str(tmp_path / "l.zarr"), layout=layout(), source="camera", backend="cpu")
    recorder = Recorder(settings)
    source = recorder.add_layer(layer)
    assert not source.is_stack
    recorder.start()
    source.refreshed()  # a redraw of the frame shown at Start: not a frame
    frames = [np.full((48, 40), i + 1, np.uint16) for i in range(5)]
    for frame in frames:
        layer.data = frame
        source.refreshed()  # napari's order within an assignment: set_data, then data
        source.assigned()
    layer.data = frames[-1].copy()  # a new image of the same values: a new frame
    source.assigned()
    layer.data[3, 4] = 77  # a live-view plugin writing into the layer's buffer, then refresh()
    source.refreshed()
    source.refreshed()  # a redraw without a change
    recorder.stop()
    stats = recorder.join(timeout=30)
    assert stats.frames == source.recorded == 7
    expected = np.stack([*frames, frames[-1], layer.data])
    np.testing.assert_array_equal(read_back(tmp_path / "l.zarr"), expected)


def test_a_live_layer_that_does_not_change_says_the_recording_waits_for_it(tmp_path):
    from napari_tileshard.apps.recorder import WAIT_HINT_S

    layer = FakeLayer(np.zeros((48, 40), np.uint16))
    recorder = Recorder(RecorderSettings(output=str(tmp_path / "w.zarr"), layout=layout(), backend="cpu"))
    source = recorder.add_layer(layer)
    recorder.start()
    started = source.started_at
    assert recorder.hint(now=started + WAIT_HINT_S / 2) is None
    hint = recorder.hint(now=started + WAIT_HINT_S + 2)
    assert hint.startswith(f"waiting for layer 'camera' to change (nothing for {WAIT_HINT_S + 2:.0f} s)")
    assert "refresh()" in hint
    recorder.stop()
    recorder.join(timeout=30)


def test_a_recording_that_received_nothing_leaves_no_store(tmp_path):
    from napari_tileshard.apps.recorder import recent_recordings

    out = tmp_path / "nothing.zarr"
    recorder = Recorder(RecorderSettings(output=str(out), layout=layout(), source="camera", backend="cpu"))
    recorder.add_layer(FakeLayer(np.zeros((48, 40), np.uint16)))
    recorder.start()
    deadline = time.monotonic() + 30
    while recorder.writer is None and time.monotonic() < deadline:  # made on the recording thread
        time.sleep(0.01)
    assert out.exists()  # the store is made at Start (the lock is held from then)
    recorder.stop()
    stats = recorder.join(timeout=30)
    assert stats.frames == 0 and stats.discarded and stats.error is None
    assert not out.exists()
    assert str(out) not in list(recent_recordings)


def test_an_empty_collection_of_several_streams_leaves_nothing_either(tmp_path):
    out = tmp_path / "two.zarr"
    streams = {"left": layout(), "right": layout((16, 16))}
    settings = RecorderSettings(output=str(out), layout=layout(), streams=streams, source="left", backend="cpu")
    recorder = Recorder(settings)
    recorder.add_layer(FakeLayer(np.zeros((48, 40), np.uint16), "left"), "left")
    recorder.add_layer(FakeLayer(np.zeros((16, 16), np.uint16), "right"), "right")
    recorder.start()
    recorder.stop()
    assert recorder.join(timeout=30).discarded and not out.exists()


def test_the_session_remembers_its_recordings_most_recent_first(tmp_path):
    from napari_tileshard.apps.recorder import recent_recordings

    outputs = [tmp_path / f"r{i}.zarr" for i in range(2)]
    for out in outputs:
        recorder = Recorder(RecorderSettings(output=str(out), layout=layout(), fps=None, backend="cpu"))
        recorder.start(synthetic_frames=3).join(timeout=60)
        assert recorder.stats.ended == "the synthetic camera's 3 frames were recorded"
    assert list(recent_recordings)[:2] == [str(outputs[1]), str(outputs[0])]


def test_a_stack_lays_out_the_table_so_its_planes_keep_their_arrangement():
    from napari_tileshard.apps.recorder_form import layout_from_rows, rows_for_layer

    table = [["t", "0", "32", "1", "1.0", ""], ["y", "1024", "256", "4", "1.0", ""], ["x", "1024", "256", "4", "1", ""]]
    # a live camera (one frame): only the frame dims follow it
    live = rows_for_layer(table, (300, 400))
    assert [r[:4] for r in live] == [["t", "0", "32", "1"], ["y", "300", "256", "2"], ["x", "400", "256", "2"]]
    # a (t, z, y, x) stack: a z row of its size is added (named after the layer's axis label)
    stack = rows_for_layer(table, (7, 5, 300, 400), labels=("time", "z", "y", "x"))
    assert [r[:4] for r in stack] == [
        ["t", "0", "32", "1"],
        ["z", "5", "1", "1"],
        ["y", "300", "256", "2"],
        ["x", "400", "256", "2"],
    ]
    assert layout_from_rows(stack, "uint16").shape == (0, 5, 300, 400)
    # napari's default labels ("-4", ...) are no names: the row gets a free one
    unnamed = rows_for_layer([["z", *r[1:]] if r[0] == "t" else r for r in table], (2, 3, 64, 64), ("-4", "-3"))
    assert [r[0] for r in unnamed] == ["z", "c", "y", "x"]
    # a table with more dims than the stack is left as it is (planes fill it in order)
    assert rows_for_layer(stack, (20, 300, 400)) == stack


# -- the tiling: checked once, the same way as every entry point's -------------------------------------
def test_settings_warn_with_numbers_about_a_tiling_that_explodes(tmp_path):
    tiny = Layout([Dim("t", 0, 1, 1), Dim("y", 512, 1, 2), Dim("x", 512, 1, 2)], "uint16")
    settings = RecorderSettings(output=str(tmp_path / "t6.zarr"), layout=tiny, backend="cpu")
    with pytest.warns(TilingWarning) as caught:
        settings.validate()
    assert [str(w.message) for w in caught] == [
        "chunks of 1x1x1 uint16 are 2 bytes, under 4 KiB: each costs a 16-byte index entry and a codec frame "
        "and compresses poorly; use larger tiles",
        "shards of 1x2x2 uint16 make 125,000,000 files per GB of data (over 10,000 per GB, file systems and "
        "object stores slow down): use more tiles per shard or larger tiles",
    ]
    assert caught[0].filename.endswith("recorder.py")  # not from deep inside the format layer
    with warnings.catch_warnings():
        warnings.simplefilter("error", TilingWarning)
        settings.validate()  # told once per layout: a Recorder's own check and its thread stay quiet
        default = Layout.default_for((0, 48, 40), "uint16")
        RecorderSettings(output=str(tmp_path / "ok.zarr"), layout=default, backend="cpu").validate()


def test_the_docks_table_is_checked_and_clamped_as_the_command_line_is():
    from napari_tileshard.apps.cli import build_layout
    from napari_tileshard.apps.recorder_form import layout_from_rows, with_tiling_notes

    rows = [["t", "0", "2", "1", "1.0", ""], ["y", "512", "1000", "1", "0.5", "um"], ["x", "512", "1000", "1", "", ""]]
    table, notes = with_tiling_notes(lambda: layout_from_rows(rows, "uint16"))
    assert notes == [
        "tile 1000 along 'y' is larger than the dimension (512): using 512",
        "tile 1000 along 'x' is larger than the dimension (512): using 512",
    ]
    cli, cli_notes = with_tiling_notes(lambda: build_layout([0, 512, 512], [2, 1000, 1000], [1, 1, 1], "uint16"))
    assert table.tile_shape == cli.tile_shape == (2, 512, 512) and cli_notes == notes
    assert (table.dims[1].unit, table.dims[1].scale) == ("micrometer", 0.5)  # the row's axis kept
    with pytest.raises(ValueError, match=r"^dimension 'y': tile_size must be >= 1, got -5$"):
        layout_from_rows([rows[0], ["y", "512", "-5", "1", "", ""], rows[2]], "uint16")


def test_warnings_other_than_the_tilings_pass_on_from_the_docks_check():
    from napari_tileshard.apps.recorder_form import with_tiling_notes

    def check():
        warnings.warn("something else", DeprecationWarning, stacklevel=1)
        return 7

    with pytest.warns(DeprecationWarning, match="something else"):
        assert with_tiling_notes(check) == (7, [])


def test_a_layer_read_from_the_output_is_refused_before_anything_is_deleted(tmp_path):
    """A store opened in napari and recorded into itself with overwrite: the Writer deleted its
    shards while the layer was still reading them."""
    import hashlib
    import os

    from napari_tileshard import Writer
    from napari_tileshard.apps.napari_reader import napari_get_reader

    stack = np.random.default_rng(2).integers(0, 4000, (8, 48, 40)).astype(np.uint16)
    store = tmp_path / "D.zarr"
    with Writer(store, layout(), backend="cpu") as writer:
        writer.append(stack)
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()}
    data, meta, _ = napari_get_reader(str(store))(str(store))[0]
    opened = FakeLayer(data, "D")
    os.symlink(store, tmp_path / "link.zarr")
    for output in (store, f"{store}/", tmp_path / "link.zarr", store / "inside.zarr"):
        settings = RecorderSettings(output=str(output), layout=layout(), backend="cpu", overwrite=True)
        with pytest.raises(ValueError, match=r"layer 'D' is read from .*D.zarr, and the output .* that store"):
            Recorder(settings).add_layer(opened)
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in store.rglob("*") if p.is_file()} == before
    settings = RecorderSettings(output=str(tmp_path / "copy.zarr"), layout=layout(), backend="cpu")
    recorder = Recorder(settings)
    recorder.add_layer(opened)  # another output: recorded
    assert recorder.start().join(timeout=60).error is None
    np.testing.assert_array_equal(read_back(tmp_path / "copy.zarr"), stack)


def test_the_camera_starts_once_the_writer_is_armed_and_the_clock_with_its_first_frame(tmp_path, monkeypatch):
    """Arming the Writer (here slowed to 0.6 s by its first metadata write) and rendering the
    camera's frames happen before the first frame: a fast camera with a 2-frame queue drops
    nothing at the start, and the recording's clock runs from its first frame."""
    from napari_tileshard.storage.sinks import DirectorySink

    real_write = DirectorySink.write
    slowed = []

    def slow_first_write(self, key, buffers):
        if not slowed:
            slowed.append(key)
            time.sleep(0.6)
        return real_write(self, key, buffers)

    monkeypatch.setattr(DirectorySink, "write", slow_first_write)
    settings = RecorderSettings(
        output=str(tmp_path / "armed.zarr"), layout=layout(), fps=100.0, policy="drop", queue_frames=2, backend="cpu"
    )
    started = time.perf_counter()
    stats = Recorder(settings).start(synthetic_frames=30).join(timeout=60)
    wall = time.perf_counter() - started
    assert slowed and stats.error is None
    assert stats.frames == 30 and stats.dropped == 0
    assert stats.arm_s >= 0.6 and stats.elapsed_s <= wall - 0.6
    np.testing.assert_array_equal(read_back(tmp_path / "armed.zarr"), SyntheticCamera((48, 40), "uint16").stack(30))


def test_the_live_rate_follows_the_last_second():
    """What the dock shows while recording is the rate of the last second, not the average since
    the start (a camera that slowed down shows its new rate within a second)."""
    rate = LiveRate(window_s=1.0, every_s=0.05)
    frames = 0
    result = None
    for step in range(1, 81):  # 4 s in steps of 50 ms: 100 frames/s for 2 s, then 20 frames/s
        frames += 5 if step <= 40 else 1
        result = rate.sample(step * 0.05 + 1e-9 * step, frames, frames * 1000) or result
    assert result is not None
    fps, bytes_per_s = result
    assert fps == pytest.approx(20, rel=0.1) and bytes_per_s == pytest.approx(20_000, rel=0.1)
    assert frames / 4 == 60  # the average since the start would say
