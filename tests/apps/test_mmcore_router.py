"""The pymmcore-plus sink's router on its own: event index -> (series, frame), ``skip``, and the
reorder buffer (early frames wait, a bounded window, absent frames filled with their reason, rows
completed at the end).  No runner, no core, no Writer: useq sequences (plain data) and lists that
record what would have been written."""

from __future__ import annotations

import itertools
import random
import threading

import numpy as np
import pytest

from napari_tileshard.apps.mmcore.router import FILL_REASONS, EventRouter, ReorderBuffer

useq = pytest.importorskip("useq", reason="useq-schema is in the mmcore extra: pip install -e .[mmcore]")


# -- EventRouter ------------------------------------------------------------------------------
def test_frames_are_row_major_over_the_inner_axes_and_series_follow_the_keys():
    router = EventRouter({"t": 2, "c": 3, "z": 4}, keys=[(0,), (1,)], series_axes=("p",))
    assert (router.series_count, router.frames_per_series, router.frames_per_row) == (2, 24, 12)
    assert router.inner_axes == ("t", "c", "z") and router.bounded
    for p, t, c, z in itertools.product(range(2), range(2), range(3), range(4)):
        expected = int(np.ravel_multi_index((t, c, z), (2, 3, 4)))
        assert router.place({"p": p, "t": t, "c": c, "z": z}) == (p, expected)


def test_an_event_outside_the_sequence_is_refused_naming_its_index():
    router = EventRouter({"t": 2, "c": 2}, keys=[(0,), (1,)], series_axes=("p",))
    with pytest.raises(ValueError, match=r"event index \{'p': 2, 't': 0\} is not part of the sequence"):
        router.place({"p": 2, "t": 0})
    with pytest.raises(ValueError, match=r"event index \{'t': 0, 'c': 2\} is not part of the sequence \(c has 2\)"):
        router.place({"t": 0, "c": 2})
    with pytest.raises(ValueError, match=r"\(t has 2\)"):
        router.place({"t": -1})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"inner_sizes": {"t": 0}}, "axis 't' must have a positive integer size, got 0"),
        ({"inner_sizes": {"t": 2.0}}, "axis 't' must have a positive integer size, got 2.0"),
        ({"inner_sizes": {"t": 2}, "keys": [(0,), (0,)], "series_axes": ("p",)}, r"series keys repeat: \[\(0,\), \(0"),
        ({"inner_sizes": {"t": 2}, "keys": [(0, 1)], "series_axes": ("p",)}, r"series keys \[\(0, 1\)\] do not have"),
        ({"inner_sizes": {"t": 2}, "keys": []}, "at least one series"),
        ({"inner_sizes": None, "keys": [(0,), (1,)], "series_axes": ("p",)}, "unknown length has one series"),
    ],
)
def test_a_router_that_cannot_place_frames_is_refused_by_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EventRouter(**kwargs)


@pytest.mark.parametrize("axis_order", ["tpcz", "ptzc", "pczt"])
def test_every_event_of_a_multi_position_sequence_gets_its_own_place(axis_order):
    sequence = useq.MDASequence(
        time_plan={"interval": 0, "loops": 2},
        channels=["DAPI", "FITC"],
        z_plan={"range": 2, "step": 1},
        stage_positions=[(0, 0, 0), (50, 20, 0)],
        axis_order=axis_order,
    )
    router = EventRouter.from_sequence(sequence)
    inner = tuple(a for a in axis_order if a != "p")
    assert router.inner_axes == inner and router.series_axes == ("p",)
    sizes = tuple(sequence.sizes[a] for a in inner)
    places = [router.place(event.index) for event in sequence]
    assert sorted(places) == [(p, f) for p in range(2) for f in range(12)]  # a bijection
    for event, place in zip(sequence, places):
        expected = int(np.ravel_multi_index(tuple(event.index[a] for a in inner), sizes))
        assert place == (event.index["p"], expected)


def test_grid_positions_are_series_of_their_own():
    sequence = useq.MDASequence(
        stage_positions=[(0, 0, 0), (100, 0, 0)],
        grid_plan={"rows": 2, "columns": 1},
        channels=["DAPI", "FITC"],
        axis_order="pgc",
    )
    router = EventRouter.from_sequence(sequence)
    assert router.series_axes == ("p", "g") and router.keys == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [router.place(e.index) for e in sequence] == [(s, c) for s in range(4) for c in range(2)]


def test_positions_with_grid_plans_of_their_own_make_a_series_per_tile():
    """Grids of different sizes per position: the sequence itself sizes no grid axis (g is 0 in
    ``sizes``), the events carry it; every (p, g) is a series of its own, none shares its frames."""
    sequence = useq.MDASequence(
        stage_positions=[
            useq.Position(x=0, y=0, sequence=useq.MDASequence(grid_plan={"rows": 2, "columns": 1})),
            useq.Position(x=100, y=0, sequence=useq.MDASequence(grid_plan={"rows": 1, "columns": 3})),
        ],
        channels=["DAPI", "FITC"],
        axis_order="pgc",
    )
    assert sequence.sizes.get("g", 0) == 0
    router = EventRouter.from_sequence(sequence)
    assert router.series_axes == ("p", "g") and router.keys == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    places = [router.place(e.index) for e in sequence]  # a position's grid runs inside its channels
    assert places == [(router.keys.index((e.index["p"], e.index["g"])), e.index["c"]) for e in sequence]
    assert sorted(places) == [(s, c) for s in range(5) for c in range(2)]


def test_positions_whose_own_plans_change_the_image_axes_are_refused_at_setup():
    """A z stack at one position only would make images of different shapes (ragged), which one
    layout for every series cannot hold: refused before the MDA starts, naming the event."""
    sequence = useq.MDASequence(
        stage_positions=[
            useq.Position(x=0, y=0, sequence=useq.MDASequence(z_plan={"range": 2, "step": 1})),
            useq.Position(x=10, y=0),
        ],
        time_plan={"interval": 0, "loops": 2},
        axis_order="tpz",
    )
    with pytest.raises(NotImplementedError, match=r"event index \{'t': 0, 'p': 0, 'z': 1\}.*\(z of 0\)"):
        EventRouter.from_sequence(sequence)


def test_a_sequence_of_unknown_length_numbers_frames_by_arrival():
    for sequence in (
        (useq.MDAEvent(index={"t": i}) for i in itertools.count()),  # a generator of events
        useq.MDASequence(time_plan={"interval": 0, "duration": 5}),  # useq cannot size it
    ):
        router = EventRouter.from_sequence(sequence)
        assert not router.bounded and router.inner_axes == ("t",) and router.frames_per_series is None
        assert router.series_count == 1 and router.frames_per_row == 1
        assert [router.place({"t": 99}) for _ in range(3)] == [(0, 0), (0, 1), (0, 2)]
        assert router.skip(2) == [(0, 3), (0, 4)]
        assert router.place({}) == (0, 5)


def test_skip_names_the_next_events_in_the_sequences_order_not_frame_order():
    """Positions interleaved (tpc): the event after (t0, p0, c1) is (t0, p1, c0), frame 0 of series 1."""
    sequence = useq.MDASequence(
        time_plan={"interval": 0, "loops": 2},
        channels=["DAPI", "FITC"],
        stage_positions=[(0, 0, 0), (10, 0, 0)],
        axis_order="tpc",
    )
    events = list(sequence)
    router = EventRouter.from_sequence(sequence)
    router.place(events[0].index)
    router.place(events[1].index)
    assert router.skip(1) == [(1, 0)]  # events[2]
    assert router.place(events[3].index) == (1, 1)
    assert router.skip(2) == [(0, 2), (0, 3)]  # events[4], events[5]
    assert router.place(events[7].index) == (1, 3)  # events[6] never came, nor was it skipped
    assert router.skip(5) == []  # past the end: nothing left to skip


def test_skip_first_then_frames_out_of_order_keep_the_position_in_the_sequence():
    sequence = useq.MDASequence(time_plan={"interval": 0, "loops": 6})
    router = EventRouter.from_sequence(sequence)
    assert router.skip(1) == [(0, 0)]
    router.place({"t": 3})  # arrived early: the sequence is at t=4 now
    router.place({"t": 1})  # a straggler does not move it back
    assert router.skip(1) == [(0, 4)]
    with pytest.raises(ValueError, match="frames to skip must be a non-negative integer, got -1"):
        router.skip(-1)


# -- ReorderBuffer ----------------------------------------------------------------------------
class Recorder:
    """What the buffer hands on, in order: ("frame", series, image) or ("fill", series, frame, reason)."""

    def __init__(self):
        self.log: list[tuple] = []

    def deliver(self, series, image):
        self.log.append(("frame", series, image))

    def fill(self, series, frame, reason):
        self.log.append(("fill", series, frame, reason))


def buffer(totals=(None,), *, window=8, frames_per_row=1):
    out = Recorder()
    reorder = ReorderBuffer(
        list(totals), window=window, frames_per_row=frames_per_row, deliver=out.deliver, fill=out.fill
    )
    return reorder, out


def test_early_frames_wait_for_the_frames_before_them():
    reorder, out = buffer()
    for frame in (2, 0, 3, 1):
        assert reorder.take(0, frame, f"img{frame}")
        reorder.advance()
    assert out.log == [("frame", 0, f"img{f}") for f in range(4)]
    assert reorder.next_frame(0) == 4 and reorder.waiting == 0


def test_a_frame_too_late_or_twice_is_refused():
    reorder, out = buffer()
    assert reorder.take(0, 1, "a")
    assert not reorder.take(0, 1, "again")  # already waiting
    assert reorder.take(0, 0, "b")
    reorder.advance()
    assert not reorder.take(0, 0, "late")  # its place is filled
    assert out.log == [("frame", 0, "b"), ("frame", 0, "a")]


def test_a_full_window_gives_up_on_the_oldest_gap_as_missing():
    reorder, out = buffer(window=2)
    for frame in (1, 2):
        reorder.take(0, frame, frame)
        reorder.advance()
    assert out.log == [] and reorder.waiting == 2
    reorder.take(0, 3, 3)  # a third frame waiting: frame 0 will not come in time
    assert out.log == [("fill", 0, 0, "missing"), ("frame", 0, 1), ("frame", 0, 2), ("frame", 0, 3)]
    assert not reorder.take(0, 0, 0)  # and if it comes after all, it is too late
    assert reorder.fill_frames(0) == {"skipped": [], "dropped": [], "missing": [0]}


def test_the_window_spans_all_series_and_fills_the_series_left_behind_longest():
    reorder, out = buffer((None, None), window=2)
    reorder.take(0, 3, "s0f3")  # series 0 waits for 0..2
    reorder.take(1, 1, "s1f1")  # series 1 waits for 0 only: the older gap
    reorder.take(1, 2, "s1f2")
    assert out.log == [("fill", 1, 0, "missing"), ("frame", 1, "s1f1"), ("frame", 1, "s1f2")]
    assert reorder.next_frame(0) == 0 and reorder.waiting == 1


def test_absent_frames_are_filled_with_their_reason_when_their_turn_comes():
    reorder, out = buffer()
    reorder.mark_absent(0, 1, "skipped")
    reorder.mark_absent(0, 3, "dropped")
    for frame in (0, 2, 4):
        reorder.take(0, frame, frame)
        reorder.advance()
    assert out.log == [
        ("frame", 0, 0),
        ("fill", 0, 1, "skipped"),
        ("frame", 0, 2),
        ("fill", 0, 3, "dropped"),
        ("frame", 0, 4),
    ]
    assert reorder.fill_frames(0) == {"skipped": [1], "dropped": [3], "missing": []}
    assert tuple(reorder.fill_frames(0)) == FILL_REASONS


def test_finish_fills_the_gaps_and_completes_the_last_row():
    reorder, out = buffer((None,), frames_per_row=4)
    reorder.take(0, 0, 0)
    reorder.take(0, 2, 2)  # frame 1 never comes; the run ends after frame 2
    reorder.advance()
    reorder.finish()
    assert out.log == [("frame", 0, 0), ("fill", 0, 1, "missing"), ("frame", 0, 2), ("fill", 0, 3, "missing")]
    assert reorder.next_frame(0) == 4


def test_finish_stops_at_the_series_end_and_claims_nothing_for_a_series_that_got_nothing():
    reorder, out = buffer((6, 6), frames_per_row=4)
    for frame in range(5):
        reorder.take(0, frame, frame)
    reorder.advance()
    reorder.finish()
    assert [entry[:3] for entry in out.log[5:]] == [("fill", 0, 5)]  # row 2 holds frames 4, 5 only
    assert reorder.next_frame(0) == 6 and reorder.next_frame(1) == 0  # series 1 claims no row


def test_a_bounded_series_hands_on_nothing_past_its_end():
    reorder, out = buffer((2,))
    reorder.mark_absent(0, 2, "skipped")  # beyond the end: never filled
    for frame in (0, 1):
        reorder.take(0, frame, frame)
    reorder.advance()
    reorder.finish()
    assert out.log == [("frame", 0, 0), ("frame", 0, 1)]


def test_absent_frames_marked_from_another_thread_are_each_handed_on_once_in_order():
    """The MDA thread marks dropped frames while the feeder takes the others: every frame is
    handed on exactly once, in frame order, each drop filled as dropped."""
    n = 4000
    reorder, out = buffer((n,), window=n)
    dropped = set(random.Random(0).sample(range(n), n // 3))
    marking = threading.Thread(target=lambda: [reorder.mark_absent(0, f, "dropped") for f in sorted(dropped)])
    marking.start()
    for frame in range(n):
        if frame not in dropped:
            reorder.take(0, frame, frame)
            reorder.advance()
    marking.join()
    reorder.finish()
    handed = [entry[2] if entry[0] == "frame" else entry[2] for entry in out.log]
    assert handed == list(range(n))
    assert {entry[2] for entry in out.log if entry[0] == "fill"} == dropped
    assert reorder.fill_frames(0)["dropped"] == sorted(dropped) and reorder.fill_frames(0)["missing"] == []


def test_router_and_buffer_place_a_shuffled_interleaved_run_with_a_skip():
    """Both pieces driven as the sink drives them: frames of a tpcz run with two positions arrive
    shuffled within each timepoint, one event is skipped; every series ends up in frame order with
    the skipped frame filled."""
    sequence = useq.MDASequence(
        time_plan={"interval": 0, "loops": 3},
        channels=["DAPI", "FITC"],
        z_plan={"range": 1, "step": 1},
        stage_positions=[(0, 0, 0), (50, 0, 0)],
        axis_order="tpcz",
    )
    router = EventRouter.from_sequence(sequence)
    stacks = [np.full(router.frames_per_series, -1) for _ in range(router.series_count)]
    written = [0] * router.series_count

    def deliver(series, value):
        stacks[series][written[series]] = value
        written[series] += 1

    def fill(series, frame, reason):
        assert frame == written[series]
        stacks[series][frame] = 0
        written[series] += 1

    reorder = ReorderBuffer(
        [router.frames_per_series] * router.series_count,
        window=16,
        frames_per_row=router.frames_per_row,
        deliver=deliver,
        fill=fill,
    )
    events = list(sequence)
    skipped = events[5]
    value = {id(e): k + 1 for k, e in enumerate(events)}
    for t in range(3):
        batch = [e for e in events if e.index["t"] == t]
        if t == 0:  # the first five in order, then the sixth produced no image
            for event in batch[:5]:
                reorder.take(*router.place(event.index), value[id(event)])
                reorder.advance()
            for place in router.skip(1):
                reorder.mark_absent(*place, "skipped")
            batch = batch[6:]
        random.Random(t).shuffle(batch)
        for event in batch:
            reorder.take(*router.place(event.index), value[id(event)])
            reorder.advance()
    reorder.finish()
    inner = router.inner_axes
    sizes = tuple(router.inner_sizes.values())
    for event in events:
        frame = int(np.ravel_multi_index(tuple(event.index[a] for a in inner), sizes))
        expected = 0 if event is skipped else value[id(event)]
        assert stacks[event.index["p"]][frame] == expected
    skipped_frame = int(np.ravel_multi_index(tuple(skipped.index[a] for a in inner), sizes))
    assert reorder.fill_frames(skipped.index["p"]) == {"skipped": [skipped_frame], "dropped": [], "missing": []}


def test_the_buffer_refuses_a_frame_outside_its_series():
    reorder, _ = buffer((4,))
    with pytest.raises(ValueError, match="frame 4 is outside series 0 of 4 frames"):
        reorder.take(0, 4, "x")
    with pytest.raises(ValueError, match="frame -1 is outside series 0"):
        reorder.take(0, -1, "x")


def test_the_buffer_refuses_a_window_or_row_it_cannot_work_with():
    with pytest.raises(ValueError, match="reorder window must be a positive integer, got 0"):
        buffer(window=0)
    with pytest.raises(ValueError, match="frames_per_row must be a positive integer, got 0"):
        buffer(frames_per_row=0)
