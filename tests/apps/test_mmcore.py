"""TileShardSink with a real pymmcore-plus UniMMCore and pure-Python devices (offline, no Micro-Manager).

Every test captures the frames the camera produced through a parallel ``frameReady`` listener and
compares them with what zarr-python (and ome-zarr-py) read back from the store."""

from __future__ import annotations

import itertools
import json
import logging
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

_root_level = logging.getLogger().level
pytest.importorskip("pymmcore_plus", reason="pymmcore-plus is in the test extra: pip install -e .[test]")
logging.getLogger().setLevel(_root_level)  # pymmcore-plus sets the root logger to DEBUG on import
import useq  # noqa: E402
import zarr  # noqa: E402
from threads import threads_left  # noqa: E402

from napari_tileshard import verify  # noqa: E402
from napari_tileshard.apps.mmcore import FRAME_COLUMNS, TileShardSink  # noqa: E402
from napari_tileshard.apps.mmcore.demo import demo_core  # noqa: E402
from napari_tileshard.engine.options import EngineOptions  # noqa: E402
from napari_tileshard.testing import FaultInjectingSink  # noqa: E402

logging.getLogger("pymmcore-plus").setLevel(logging.CRITICAL)  # "no Micro-Manager installation found"

SHAPE = (48, 80)


@pytest.fixture(scope="module")
def core():
    return demo_core(SHAPE, pixel_size_um=0.65)


class Capture:
    """The frames the camera delivered, keyed by (p, g, event index of the other axes), plus the
    summary metadata, received the same way any pymmcore-plus listener receives them."""

    def __init__(self, core):
        self.frames: dict = {}
        self.frames_by_event: dict = {}
        self.order: list = []
        self.meta: dict | None = None
        self.sequence = None
        self._core = core
        # Under Qt signals (a QApplication exists) a plain callable is called through the GUI
        # thread's event loop: take the frames on the MDA thread, as pymmcore-plus's own relay does.
        options = {}
        if hasattr(core.mda.events, "metaObject"):
            from qtpy.QtCore import Qt

            options = {"type": Qt.ConnectionType.DirectConnection}
        core.mda.events.frameReady.connect(self.frame_ready, **options)
        core.mda.events.sequenceStarted.connect(self.sequence_started, **options)

    def sequence_started(self, sequence, meta):
        self.sequence, self.meta = sequence, meta

    def frame_ready(self, img, event, meta):
        key = tuple(sorted(event.index.items()))
        self.frames[key] = np.array(img, copy=True)
        self.frames_by_event[id(event)] = self.frames[key]
        self.order.append((event, meta))

    def close(self):
        self._core.mda.events.frameReady.disconnect(self.frame_ready)
        self._core.mda.events.sequenceStarted.disconnect(self.sequence_started)


@pytest.fixture
def capture(core):
    cap = Capture(core)
    yield cap
    cap.close()


def assert_store_holds(path, frames: dict, axes: tuple[str, ...], series_keys: list[tuple]):
    """Every captured frame sits at its event index in the series of its (p, g)."""
    for key, img in frames.items():
        index = dict(key)
        series = series_keys.index(tuple(index[a] for a in ("p", "g") if a in index))
        level0 = zarr.open_array(f"{path}/{series}/0", mode="r")
        np.testing.assert_array_equal(level0[tuple(index[a] for a in axes[:-2])], img, err_msg=str(index))


def test_tcz_with_positions_matches_camera_and_default_sink(core, capture, tmp_path, backend):
    sequence = useq.MDASequence(
        time_plan={"interval": 0.02, "loops": 2},
        channels=["DAPI", "FITC"],
        z_plan={"range": 2, "step": 1},
        stage_positions=[(0, 0, 0), (50, 20, 0)],
        axis_order="tpcz",
    )
    ours = tmp_path / "run.ome.zarr"
    default = tmp_path / "default.ome.zarr"
    sink = TileShardSink(ours, backend=backend, tile={"y": 32, "x": 32})
    core.mda.run(sequence, output=[str(default), sink])  # one run, both sinks: the same frames
    assert sink.wait_closed(30)

    assert sink.stats.received == 2 * 2 * 2 * 3 == len(capture.frames)
    assert (sink.stats.dropped, sink.stats.missing, sink.stats.skipped) == (0, 0, 0)
    assert sink.axes == ("t", "c", "z", "y", "x")
    assert_store_holds(ours, capture.frames, sink.axes, [(0,), (1,)])

    root = zarr.open_group(ours, mode="r")
    assert root.attrs["ome"]["bioformats2raw.layout"] == 3
    assert zarr.open_group(ours / "OME", mode="r").attrs["ome"]["series"] == ["0", "1"]
    for series in ("0", "1"):
        image = zarr.open_group(ours / series, mode="r").attrs["ome"]
        axes = image["multiscales"][0]["axes"]
        assert [(a["name"], a["type"]) for a in axes] == [
            ("t", "time"),
            ("c", "channel"),
            ("z", "space"),
            ("y", "space"),
            ("x", "space"),
        ]
        scale = image["multiscales"][0]["datasets"][0]["coordinateTransformations"][0]["scale"]
        assert scale == pytest.approx([0.02, 1.0, 1.0, 0.65, 0.65])
        assert [c["label"] for c in image["omero"]["channels"]] == ["DAPI", "FITC"]
        # pymmcore-plus's own sink wrote the same pixels to the same series
        theirs = zarr.open_array(default / series / "0", mode="r")[...]
        np.testing.assert_array_equal(zarr.open_array(ours / series / "0", mode="r")[...], theirs)
        assert verify(ours / series).ok

    table = zarr.open_array(ours / "frame_metadata", mode="r")
    assert table.attrs["columns"] == list(FRAME_COLUMNS) and table.shape == (24, len(FRAME_COLUMNS))
    rows = table[...]
    records = zarr.open_array(ours / "frame_metadata_json", mode="r")[...]
    for (event, meta), row, record in zip(capture.order, rows, records):
        assert row[FRAME_COLUMNS.index("exposure_ms")] == meta["exposure_ms"]
        assert row[FRAME_COLUMNS.index("x_um")] == pytest.approx(event.x_pos)
        assert row[FRAME_COLUMNS.index("z_um")] == pytest.approx(event.z_pos)
        assert json.loads(record)["runner_time_ms"] == pytest.approx(meta["runner_time_ms"])
    assert root.attrs["pymmcore_plus"]["summary_metadata"]["image_infos"][0]["pixel_size_um"] == 0.65

    ome_zarr = pytest.importorskip("ome_zarr.reader", reason="ome-zarr-py is in the test extra")
    from ome_zarr.io import parse_url

    nodes = list(ome_zarr.Reader(parse_url(str(ours / "0")))())
    np.testing.assert_array_equal(np.asarray(nodes[0].data[0]), zarr.open_array(ours / "0" / "0")[...])

    view = sink.get_view()
    assert view.shape == (2, 2, 2, 3, *SHAPE)
    expected = capture.frames[(("c", 0), ("p", 1), ("t", 1), ("z", 2))]
    np.testing.assert_array_equal(np.asarray(view[1, 1, 0, 2]), expected)


def test_grid_positions_become_series_and_run_mda_works(core, capture, tmp_path):
    sequence = useq.MDASequence(
        stage_positions=[(0, 0, 0), (100, 0, 0)],
        grid_plan={"rows": 2, "columns": 1},
        channels=["DAPI"],
        axis_order="pgc",
    )
    out = tmp_path / "grid.ome.zarr"
    sink = TileShardSink(out, backend="cpu", ome=False)
    core.run_mda(sequence, output=sink).join()
    assert sink.wait_closed(30)
    keys = list(itertools.product(range(2), range(2)))
    assert zarr.open_group(out / "OME", mode="r").attrs["ome"]["series"] == ["0", "1", "2", "3"]
    assert sink.axes == ("c", "y", "x") and len(capture.frames) == 4
    for key, img in capture.frames.items():
        index = dict(key)
        series = keys.index((index["p"], index["g"]))
        np.testing.assert_array_equal(zarr.open_array(out / str(series), mode="r")[0], img)


def test_positions_with_grids_of_their_own_keep_every_tile(core, capture, tmp_path):
    """Each position with its own grid plan, of different sizes (the sequence sizes no grid axis):
    every (position, tile) is a series of its own holding its frames; none is lost as late."""
    sequence = useq.MDASequence(
        stage_positions=[
            useq.Position(x=0, y=0, sequence=useq.MDASequence(grid_plan={"rows": 2, "columns": 1})),
            useq.Position(x=100, y=0, sequence=useq.MDASequence(grid_plan={"rows": 1, "columns": 3})),
        ],
        channels=["DAPI", "FITC"],
        axis_order="pgc",
    )
    out = tmp_path / "grids.ome.zarr"
    sink = TileShardSink(out, backend="cpu", ome=False)
    core.mda.run(sequence, output=sink)
    assert sink.wait_closed(30)
    keys = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert zarr.open_group(out / "OME", mode="r").attrs["ome"]["series"] == ["0", "1", "2", "3", "4"]
    assert sink.stats.received == sink.stats.written == len(capture.frames) == 10 and sink.stats.late == 0
    for key, img in capture.frames.items():
        index = dict(key)
        series = keys.index((index["p"], index["g"]))
        np.testing.assert_array_equal(zarr.open_array(out / str(series), mode="r")[index["c"]], img)


def test_skip_and_out_of_order_frames_land_at_their_event_index(core, capture, tmp_path):
    """Driven the way MDARunner drives a SinkProtocol sink: setup, append per frame, skip(frames=)
    for events that produced none; here the frames of each timepoint arrive shuffled and the
    third event is skipped."""
    sequence = useq.MDASequence(
        time_plan={"interval": 0, "loops": 3}, channels=["DAPI", "FITC"], z_plan={"range": 1, "step": 1}
    )
    core.mda.run(sequence)  # only to capture real frames, events and summary metadata
    events = capture.order
    out = tmp_path / "skip.ome.zarr"
    sink = TileShardSink(out, backend="cpu", ome=False)
    sink.setup(sequence, capture.meta)
    skipped = events[2][0]
    sink.append(*_payload(capture, events[0]))
    sink.append(*_payload(capture, events[1]))
    sink.skip(frames=1)
    rest = events[3:]
    random.Random(1).shuffle(rest)
    for event, meta in rest:
        sink.append(*_payload(capture, (event, meta)))
    sink.close()

    data = zarr.open_array(out / "0", mode="r")[...]
    for event, _meta in events:
        index = event.index
        expected = 0 if event is skipped else capture.frames[tuple(sorted(index.items()))]
        np.testing.assert_array_equal(data[index["t"], index["c"], index["z"]], expected)
    fills = zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]["fill_frames"]["0"]
    flat = skipped.index["c"] * 2 + skipped.index["z"]  # t=0, sizes c=2, z=2
    assert fills == {"skipped": [flat], "dropped": [], "missing": []}
    assert sink.stats.skipped == 1 and sink.stats.written == len(events) - 1


def test_frames_beyond_a_gap_at_the_end_of_a_run_are_written_not_filled(tmp_path):
    """A run that ends with a frame missing before frames that did arrive (a lost frame, a run
    cancelled while frames came out of order): the frames that came are written at their place,
    only the gap and the rest of the row read as the fill value (missing)."""
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 2}, z_plan={"range": 3, "step": 1})  # rows of 4
    out = tmp_path / "gap.ome.zarr"
    sink = TileShardSink(out, backend="cpu", ome=False)
    sink.setup(sequence, _meta())
    events = list(sequence)
    frame = np.ones((8, 16), np.uint16)
    for k in (0, 2):  # event 1 never comes; the run ends after event 2
        sink.append(frame * (k + 1), events[k], {})
    sink.close()
    data = zarr.open_array(out / "0", mode="r")[...]
    assert data.shape == (1, 4, 8, 16)
    assert [int(data[0, z, 0, 0]) for z in range(4)] == [1, 0, 3, 0]
    stats = sink.stats
    assert (stats.received, stats.written, stats.missing, stats.late) == (2, 2, 2, 0)
    fills = zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]["fill_frames"]["0"]
    assert fills == {"skipped": [], "dropped": [], "missing": [1, 3]}


def _payload(capture, item):
    event, meta = item
    return capture.frames[tuple(sorted(event.index.items()))], event, meta


def test_unbounded_generator_stopped_after_n_frames(core, capture, tmp_path):
    n = 23
    out = tmp_path / "stream.ome.zarr"
    sink = TileShardSink(out, backend="cpu")

    def stop_after_n(img, event, meta):
        if len(capture.order) >= n:
            core.mda.cancel()

    core.mda.events.frameReady.connect(stop_after_n)
    try:
        events = (useq.MDAEvent(index={"t": i}) for i in itertools.count())
        core.mda.run(events, output=sink)
    finally:
        core.mda.events.frameReady.disconnect(stop_after_n)
    assert sink.wait_closed(30)
    assert len(capture.order) == n and sink.axes == ("t", "y", "x")
    level0 = zarr.open_array(out / "0" / "0", mode="r")
    assert level0.shape == (n, *SHAPE)  # the append dimension grew to the frames received
    for i, (event, _meta) in enumerate(capture.order):
        np.testing.assert_array_equal(level0[i], capture.frames[tuple(sorted(event.index.items()))])
    assert verify(out / "0").ok


def test_a_relay_that_ends_without_sequence_finished_still_closes_the_run(core, capture, tmp_path, caplog):
    """pymmcore-plus's relay thread (how ``output=`` handlers get their signals) stops on the same
    signal that queues ``sequenceFinished``, the stop first, and can end without delivering it
    (seen in CI, 3 runs in 2,000 in a tight loop).  Forced here: the relay is stopped and the
    signal never sent.  The sink closes the run itself: every frame stored, the metadata
    written, its feeder thread gone, and it says why."""
    from pymmcore_plus.mda import mda_listeners_connected
    from pymmcore_plus.mda.events import MDASignaler

    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 5})
    core.mda.run(sequence)  # only to capture real frames, events and summary metadata
    out = tmp_path / "relay.ome.zarr"
    sink = TileShardSink(out, backend="cpu", ome=False)
    signals = MDASignaler()
    before = set(threading.enumerate())
    with mda_listeners_connected(sink, mda_events=signals) as relay:
        signals.sequenceStarted.emit(sequence, capture.meta)
        for item in capture.order:
            signals.frameReady.emit(*_payload(capture, item))
        relay.stop()  # the state the race leaves: stopped, sequenceFinished never queued
    assert sink.wait_closed(30) and not sink.recording
    data = zarr.open_array(out / "0", mode="r")[...]
    assert data.shape == (5, *SHAPE)
    for event, _meta in capture.order:
        np.testing.assert_array_equal(data[event.index["t"]], capture.frames[tuple(sorted(event.index.items()))])
    assert zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]["state"] == "complete"
    assert threads_left(before, "tileshard-mda") == []
    assert any("ended without sequenceFinished" in r.getMessage() for r in caplog.records)


def test_a_run_closed_normally_leaves_no_watcher_behind(core, capture, tmp_path):
    before = set(threading.enumerate())
    sink = TileShardSink(tmp_path / "n.ome.zarr", backend="cpu", ome=False)
    core.mda.run(useq.MDASequence(time_plan={"interval": 0, "loops": 3}), output=sink)
    assert sink.wait_closed(30)
    assert threads_left(before, "tileshard-mda") == []
    assert sink.stats.written == 3


def test_drop_policy_under_slow_storage_counts_every_drop(core, capture, tmp_path):
    """A camera faster than the storage: the frames that did not fit in the queue are counted
    and read as the fill value; every accepted frame is exact; the store verifies."""
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 120})
    out = tmp_path / "drop.ome.zarr"
    # The shard writes wait until the camera's last frame was handed over, and each tile holds one
    # frame: the Writer takes a few frames (its bounded pipeline), then its feeder waits and the
    # queue overflows however fast or loaded the machine.  (With the default tiling a tile epoch
    # holds 34 of these small frames: the Writer took all 120 before waiting, and a 2-core CI box
    # whose MDA thread ran slower than the feeder dropped none.)
    released = threading.Event()
    sink = TileShardSink(
        out,
        ome=False,
        policy="drop",
        queue_frames=2,
        tile={"t": 1},
        tiles_per_shard={"t": 1},
        options=EngineOptions(backend="cpu", batch_bytes=1, io_threads=1),
        store_for=lambda location: FaultInjectingSink(location, hold={"c/*": released}),
    )
    seen = []

    def release_after_the_last_frame(*_):
        seen.append(1)
        if len(seen) == 120:
            released.set()

    detach = sink.attach(core.mda.events)  # synchronously on the MDA thread: drops happen at the camera's pace
    core.mda.events.frameReady.connect(release_after_the_last_frame)
    try:
        core.mda.run(sequence)
    finally:
        released.set()
        core.mda.events.frameReady.disconnect(release_after_the_last_frame)
        detach()
    stats = sink.stats
    assert stats.received == 120 == len(capture.frames)
    # the held storage made the queue overflow: the Writer's pipeline and the queue took a few
    assert stats.dropped > 100, stats
    assert stats.written + stats.dropped == stats.received
    rows = zarr.open_array(out / "frame_metadata", mode="r")[...]
    stored = rows[:, FRAME_COLUMNS.index("stored")]
    dropped = sorted(int(f) for f in rows[stored == 0, FRAME_COLUMNS.index("frame")])
    assert len(dropped) == stats.dropped
    fills = zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]["fill_frames"]["0"]
    assert fills["dropped"] == dropped
    data = zarr.open_array(out / "0", mode="r")[...]
    for t in range(120):
        expected = 0 if t in dropped else capture.frames[(("t", t),)]
        np.testing.assert_array_equal(data[t], expected)
    assert verify(out / "0").ok


def test_bad_options_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="policy 'sometimes'"):
        TileShardSink(tmp_path / "x", policy="sometimes")
    with pytest.raises(ValueError, match="queue_frames"):
        TileShardSink(tmp_path / "x", queue_frames=0)
    sink = TileShardSink(tmp_path / "x", tile={"q": 4})
    with pytest.raises(ValueError, match=r"\['q'\]"):
        sink.setup(useq.MDASequence(time_plan={"interval": 0, "loops": 2}), _meta())
    with pytest.raises(ValueError, match="image_infos"):
        TileShardSink(tmp_path / "y").setup(useq.MDASequence(), {})


def test_existing_foreign_store_is_not_overwritten(tmp_path):
    from napari_tileshard import StoreExistsError

    zarr.open_group(tmp_path / "theirs.zarr", mode="w")
    thesis = tmp_path / "mythesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("precious")
    for path in (tmp_path / "theirs.zarr", thesis):
        for overwrite in (False, True):
            with pytest.raises(StoreExistsError, match="not a TileShardSink recording: choose another") as info:
                TileShardSink(path, overwrite=overwrite).setup(useq.MDASequence(), _meta())
            assert "overwrite=True" not in str(info.value)  # not suggested: it would be refused too
    assert sorted(p.name for p in thesis.iterdir()) == ["thesis.tex"]


# What the README's Micro-Manager snippet does (a smaller sequence): run twice, the store exists.
_README_SNIPPET = """
import useq
from napari_tileshard import TileShardSink
from napari_tileshard.apps.mmcore.demo import demo_core

core = demo_core((48, 80))
sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 3}, channels=["DAPI", "FITC"])
sink = TileShardSink("mda.ome.zarr", backend="cpu", policy="block")
core.mda.run(sequence, output=sink)
print(sink.stats)
"""


def test_running_the_readme_snippet_twice_fails_the_second_run_in_one_line(tmp_path):
    """The second run must not look like success (a 64-line dump of the signal library's
    EmitLoopError, stats without an error, exit status 0): it fails before the MDA starts, with
    one line naming the store and the fix, and a non-zero exit status."""
    import subprocess
    import sys

    script = tmp_path / "snippet.py"
    script.write_text(_README_SNIPPET)
    first = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "written=6" in first.stdout and "error=None" in first.stdout
    second = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    assert "EmitLoopError" not in second.stderr and "SinkStats(" not in second.stdout
    last = second.stderr.strip().splitlines()[-1]
    assert last == (
        "napari_tileshard.storage.errors.StoreExistsError: mda.ome.zarr already exists; pass overwrite=True to "
        "replace it (or choose another path)"
    ), second.stderr
    assert second.stderr.count("Traceback") == 1
    assert (tmp_path / "mda.ome.zarr" / "0").is_dir()  # the first recording is untouched


@pytest.mark.parametrize("attached", [False, True], ids=["output=sink", "attach(core)"])
def test_a_sink_that_cannot_open_its_store_fails_the_run_visibly(core, tmp_path, capfd, caplog, attached):
    """A store that appeared after the sink was made (another run wrote it): the run fails in
    one log line naming the store and the fix, ``stats.error`` says the same, nothing is dumped,
    no frame is taken, and with the core known (``attach(core)``) the MDA is stopped."""
    out = tmp_path / "run.ome.zarr"
    late = TileShardSink(out, backend="cpu", ome=False)
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 40})
    first = TileShardSink(out, backend="cpu")
    core.mda.run(useq.MDASequence(time_plan={"interval": 0, "loops": 2}), output=first)
    assert first.wait_closed(30)
    capfd.readouterr()
    seen = []
    core.mda.events.frameReady.connect(seen.append)
    try:
        if attached:
            detach = late.attach(core)
            try:
                core.mda.run(sequence)
            finally:
                detach()
        else:
            core.mda.run(sequence, output=late)
    finally:
        core.mda.events.frameReady.disconnect(seen.append)
    expected = f"{out} already exists; pass overwrite=True to replace it (or choose another path)"
    assert late.stats.error == expected and late.stats.written == 0 and not late.recording
    dumped = capfd.readouterr().err
    assert "EmitLoopError" not in dumped and "Traceback" not in dumped, dumped
    said = [r.getMessage() for r in caplog.records if r.name.startswith("napari_tileshard") and r.levelname == "ERROR"]
    assert said == [expected + ("; the MDA is stopped" if attached else "")]
    if attached:  # stopped before its first frame: pymmcore-plus cancels at the next event
        assert len(seen) <= 1, len(seen)
    assert zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]["state"] == "complete"  # the other run's


def test_importing_the_package_does_not_import_pymmcore_plus():
    import subprocess
    import sys

    code = "import sys, napari_tileshard, napari_tileshard.apps.mmcore; print('pymmcore_plus' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _meta():
    return {"image_infos": [{"width": 16, "height": 8, "dtype": "uint16", "pixel_size_um": 1.0}]}


@pytest.mark.qt
def test_recorder_dock_records_the_mda_runs_of_a_core(make_napari_viewer, qtbot, tmp_path):
    """The dock's "Micro-Manager (pymmcore-plus)" source: every MDA run while recording goes into a
    store of its own, written on the MDA thread; Stop ends it; each result is added as a layer."""
    pytest.importorskip("napari")
    from napari_tileshard._qt.recorder_widget import RecorderWidget
    from napari_tileshard.apps.mmcore import MMCORE_SOURCE
    from napari_tileshard.apps.recorder import RecorderSettings

    viewer = make_napari_viewer()
    widget = RecorderWidget(viewer)
    viewer.window.add_dock_widget(widget, name="Tile/Shard Recorder")
    core = demo_core(SHAPE)  # created with the QApplication running: Qt signals, as in napari-micromanager
    assert type(core.mda.events).__name__ == "QMDASignaler"  # the sink connects to them DirectConnection
    widget.mmcore = core
    assert MMCORE_SOURCE in widget.form.source.choices
    out = tmp_path / "mm.ome.zarr"
    settings = widget.settings
    widget.settings = RecorderSettings(
        output=str(out), layout=settings.layout, source=MMCORE_SOURCE, backend="cpu", ome=True
    )
    cap = Capture(core)
    widget.start()
    assert widget.is_recording
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 3}, channels=["DAPI", "FITC"])
    for _ in range(2):
        core.run_mda(sequence, block=True)
        qtbot.waitUntil(lambda: len([n for n in viewer.layers if n.name.startswith("mda:")]) == len(cap.order) // 6)
    widget.stop()
    assert not widget.is_recording
    second = tmp_path / "mm-002.ome.zarr"
    for path, frames in ((out, cap.order[:6]), (second, cap.order[6:])):
        data = zarr.open_array(path / "0" / "0", mode="r")
        assert data.shape == (3, 2, *SHAPE)
        for event, _meta in frames:
            index = event.index
            np.testing.assert_array_equal(data[index["t"], index["c"]], cap.frames_by_event[id(event)])
    cap.close()
    widget.close()


def test_example_records_offline_and_the_plugin_reader_opens_it(tmp_path):
    import runpy

    from napari_tileshard.apps.napari_reader import napari_get_reader

    out = tmp_path / "example.ome.zarr"
    example = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "mda_python_camera.py"))
    example["main"]([str(out), "--no-viewer", "--frame", "64", "64", "--timepoints", "2", "--backend", "cpu"])
    level0 = zarr.open_array(out / "0" / "0", mode="r")
    assert level0.shape == (2, 2, 9, 64, 64) and level0[...].any()
    layers = napari_get_reader(str(out / "0"))(str(out / "0"))
    assert np.asarray(layers[0][0][0][1, 1, 8]).tolist() == level0[1, 1, 8].tolist()


def test_append_outside_a_run_is_refused(tmp_path):
    sink = TileShardSink(tmp_path / "z.ome.zarr", backend="cpu", ome=False)
    event = useq.MDAEvent(index={"t": 0})
    frame = np.zeros((8, 16), np.uint16)
    with pytest.raises(RuntimeError, match="before setup"):
        sink.append(frame, event, {})
    sink.setup(useq.MDASequence(time_plan={"interval": 0, "loops": 1}), _meta())
    assert sink.append(frame + 7, event, {})
    sink.close()
    with pytest.raises(RuntimeError, match="after close"):
        sink.append(frame, event, {})
    assert zarr.open_array(tmp_path / "z.ome.zarr" / "0", mode="r")[0, 0, 0] == 7


def _assert_stopped_run_is_complete(out, sink, capture):
    """What the sink received before the stop is written where its event index says, the rest of
    the sequence is absent (not claimed), the store verifies and the frame table matches."""
    received = sink.stats.received
    assert 0 < received == sink.stats.written == len(capture.frames)
    level0 = zarr.open_array(out / "0", mode="r")
    assert level0.shape == (received, *SHAPE)  # the rows acquired; none claimed that never came
    for t in range(received):
        np.testing.assert_array_equal(level0[t], capture.frames[(("t", t),)])
    report = verify(out / "0")
    assert report.ok, str(report)
    rows = zarr.open_array(out / "frame_metadata", mode="r")[...]
    assert rows.shape == (received, len(FRAME_COLUMNS))
    assert sorted(rows[:, FRAME_COLUMNS.index("frame")].astype(int)) == list(range(received))
    assert (rows[:, FRAME_COLUMNS.index("stored")] == 1).all()
    assert len(zarr.open_array(out / "frame_metadata_json", mode="r")[...]) == received
    attrs = zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]
    assert attrs["state"] == "stopped" and attrs["stopped"] == sink.stats.error
    assert attrs["fill_frames"]["0"] == {"skipped": [], "dropped": [], "missing": []}
    assert attrs["stats"]["received"] == received


def _assert_explains_the_rates_and_the_buffer(message: str, buffer_mb: int):
    import re

    rate = r"\d+\.\d+ [MG]B/s"
    assert re.search(rf"the sink sustained {rate} \(\d+ frames/s of 80x48 uint16\)", message), message
    assert re.search(rf"the camera delivered {rate} \(\d+ frames/s\)", message), message
    assert f"the buffer of {buffer_mb} MiB" in message
    assert "core.setCircularBufferMemoryFootprint(MiB)" in message and "throttle the camera" in message


@pytest.fixture
def small_buffer(core):
    """pymmcore-plus's sequence buffer cut to 1 MiB (136 frames of 48x80 uint16): an unthrottled
    Python camera fills it within a fraction of a second on this box."""
    before = core.getCircularBufferMemoryFootprint()
    core.setCircularBufferMemoryFootprint(1)
    yield 1
    core.setCircularBufferMemoryFootprint(before)


def _slow_sink(out, **options):
    return TileShardSink(
        out,
        ome=False,
        queue_frames=4,
        tiles_per_shard={"t": 1},
        options=EngineOptions(backend="cpu", batch_bytes=1),
        store_for=lambda location: FaultInjectingSink(location, delay={"c/*": 0.01}),  # < 100 frames/s
        **options,
    )


def test_a_camera_faster_than_the_sink_stops_the_mda_with_rates_and_the_buffer_setting(
    core, capture, small_buffer, tmp_path, caplog
):
    """An unthrottled camera, hardware-sequenced, into a sink that writes slower: instead of
    pymmcore-plus's bare "MemoryError: Buffer overflowed" the sink stops the MDA before the buffer
    overflows and says why (which side was slow: with this Python camera and small frames it is
    often the MDA thread itself, see the metadata-driven test for both verdicts); what it received
    is complete and verifies."""
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 3000})
    out = tmp_path / "fast.ome.zarr"
    sink = _slow_sink(out)
    detach = sink.attach(core)  # the core: the sink may stop its MDA
    try:
        with caplog.at_level(logging.ERROR, logger="napari_tileshard.apps.mmcore"):
            core.mda.run(sequence)  # stopped, not a MemoryError
    finally:
        detach()
    message = sink.stats.error
    assert message and "The MDA is stopped" in message
    assert "the sink could not keep up" in message or "the MDA thread itself was slow" in message
    _assert_explains_the_rates_and_the_buffer(message, small_buffer)
    assert any(r.getMessage() == message for r in caplog.records)  # said once, when it happened
    assert sink.stats.received < 3000 and sink.stats.max_camera_buffer <= 136
    _assert_stopped_run_is_complete(out, sink, capture)


def test_without_the_core_the_overflow_still_comes_with_the_explanation(core, capture, small_buffer, tmp_path, caplog):
    """Attached to the events alone the sink cannot stop the MDA: pymmcore-plus's MemoryError ends
    it, but the log says why first, and the store is as complete and consistent."""
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 3000})
    out = tmp_path / "overflow.ome.zarr"
    sink = _slow_sink(out)
    detach = sink.attach(core.mda.events)
    try:
        with caplog.at_level(logging.ERROR, logger="napari_tileshard.apps.mmcore"):
            with pytest.raises(MemoryError, match="Buffer overflowed"):
                core.mda.run(sequence)
    finally:
        detach()
    message = sink.stats.error
    assert message and "give the sink the core" in message
    _assert_explains_the_rates_and_the_buffer(message, small_buffer)
    assert any(r.getMessage() == message for r in caplog.records)
    _assert_stopped_run_is_complete(out, sink, capture)


class _Runner:
    def __init__(self):
        self.cancelled = 0

    def cancel(self):
        self.cancelled += 1


class _Core:
    """What the sink asks of a core: its MDA runner's cancel()."""

    def __init__(self):
        self.mda = _Runner()


@pytest.mark.parametrize(
    "store_delay_s, verdict",
    [
        (0.03, "the sink's queue was full for 100% of the latest frames: the sink could not keep up"),
        (0.0, "the sink's queue had room for 100% of the latest frames: the MDA thread itself was slow"),
    ],
    ids=["slow-sink", "slow-mda-thread"],
)
def test_the_stop_decision_and_message_from_the_frame_metadata_alone(tmp_path, store_delay_s, verdict):
    """Driven as a SinkProtocol sink with pymmcore-plus's metadata (a 2 MiB buffer of 16 frames of
    128x512 uint16; the camera at 1000 frames/s): the MDA is stopped once 12 frames wait (three
    quarters of the buffer), once; the message says whether the sink (its queue full) or the MDA
    thread was slow; close() raises it; the store holds every frame received and verifies."""
    from napari_tileshard.apps.mmcore import SinkFellBehindError

    meta = {
        "image_infos": [{"width": 512, "height": 128, "dtype": "uint16", "pixel_size_um": 1.0}],
        "system_info": {"sequence_buffer_size_mb": 2},
    }
    core = _Core()
    out = tmp_path / "meta.ome.zarr"
    sink = TileShardSink(
        out,
        ome=False,
        core=core,
        queue_frames=1,
        tile={"t": 1},  # one frame a batch: the queue's state follows each frame
        tiles_per_shard={"t": 1},
        options=EngineOptions(backend="cpu", batch_bytes=1, io_threads=1),
        store_for=lambda location: FaultInjectingSink(location, delay={"c/*": store_delay_s}),
    )
    sink.setup(useq.MDASequence(time_plan={"interval": 0, "loops": 100}), meta)
    frame = np.ones((128, 512), np.uint16)
    # a start-up burst (14) is not judged; later the buffer fills: 12 of 16 waiting stops the MDA
    waiting_counts = [14] + [2] * 24 + [8, 11, 12, 10, 14]
    stop_at = waiting_counts.index(12, 1)
    for t, waiting in enumerate(waiting_counts):
        while not store_delay_s and sink.stats.written < t:  # the sink keeps up: the MDA thread is slow
            time.sleep(0.001)
        frame_meta = {"runner_time_ms": t * 1.0, "images_remaining_in_buffer": waiting, "hardware_triggered": True}
        sink.append(frame * t, useq.MDAEvent(index={"t": t}), frame_meta)
        assert core.mda.cancelled == (1 if t >= stop_at else 0)
    with pytest.raises(SinkFellBehindError) as info:
        sink.close()
    message = str(info.value)
    assert message == sink.stats.error
    assert verdict in message
    assert "the camera delivered 0.13 GB/s (1000 frames/s)" in message and "frames/s of 512x128 uint16" in message
    assert "the buffer of 2 MiB (16 frames) held 12 waiting frames. The MDA is stopped" in message
    level0 = zarr.open_array(out / "0", mode="r")
    assert level0.shape == (len(waiting_counts), 128, 512)
    np.testing.assert_array_equal(level0[-1], frame * (len(waiting_counts) - 1))
    assert verify(out / "0").ok
    assert zarr.open_group(out, mode="r").attrs["tileshard_mmcore"]["state"] == "stopped"


# -- the tiling: checked once, the same way as every entry point's -------------------------------------
def test_impossible_tile_sizes_are_refused_when_the_sink_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"^dimension 'y': tile_size must be >= 1, got 0$"):
        TileShardSink(tmp_path / "x", tile={"y": 0})
    with pytest.raises(ValueError, match=r"^dimension 't': tiles_per_shard must be >= 1, got -2$"):
        TileShardSink(tmp_path / "x", tiles_per_shard={"t": -2})
    with pytest.raises(TypeError, match=r"^dimension 'x': tile_size must be an integer, got 2.5$"):
        TileShardSink(tmp_path / "x", tile={"x": 2.5})


def test_a_tile_larger_than_the_camera_frame_is_clamped_with_a_warning(tmp_path):
    from napari_tileshard.format.layout import TilingWarning

    sink = TileShardSink(tmp_path / "run.ome.zarr", backend="cpu", tile={"t": 2, "y": 4096, "x": 16})
    with pytest.warns(TilingWarning) as caught:
        sink.setup(useq.MDASequence(time_plan={"interval": 0, "loops": 2}), _meta())
    sink.close()  # the Writers arm on the sink's own thread; closed, the store says what they wrote
    assert str(caught[0].message) == "tile 4096 along 'y' is larger than the dimension (8): using 8"
    image = zarr.open_group(tmp_path / "run.ome.zarr" / "0")
    level0 = image[image.attrs["ome"]["multiscales"][0]["datasets"][0]["path"]]
    assert level0.metadata.codecs[0].chunk_shape == (2, 8, 16)  # the camera's 16x8 frame
