"""Where each frame of an MDA goes, and in which order the frames reach each series' Writer.

Two pieces, in the spirit of ome-writers' ``FrameRouter`` (acquisition order -> storage index,
kept apart from the backends), with no Writer, queue or pymmcore-plus in them:

* :class:`EventRouter` places an event: its index (``{"p": 1, "t": 2, "c": 0, ...}``) selects a
  series (one image of the collection per stage/grid position, ``p`` and ``g``) and a frame (the
  row-major number over the sequence's other axes in axis order).  A sequence of unknown length
  (a generator) is one series whose frames are numbered by arrival.  ``skip`` says which places
  the next events of the sequence would have filled.
* :class:`ReorderBuffer` hands each series' frames on in frame order: a frame that arrives early
  waits (at most ``window`` of them over all series), a frame announced as absent (skipped,
  dropped) or given up on (the window is full, the run ended) is handed on as a fill frame, with
  its reason kept for the metadata.

The router runs on the MDA thread; the buffer on the thread that feeds the Writers, except
:meth:`ReorderBuffer.mark_absent`, which the MDA thread calls.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FILL_REASONS",
    "SERIES_AXES",
    "EventRouter",
    "ReorderBuffer",
    "sequence_sizes",
    "series_keys",
]

SERIES_AXES = ("p", "g")  # axes that select an image of the collection instead of indexing one
#: why a frame was written as the fill value: announced by ``skip``, dropped by the queue (policy
#: ``drop``), or never received (a cancelled run, a gap the reorder window could not wait for)
FILL_REASONS = ("skipped", "dropped", "missing")


def sequence_sizes(sequence) -> tuple[dict[str, int] | None, tuple[str, ...]]:
    """The sequence's axis sizes and its axis order, or ``(None, ())`` for a sequence of unknown
    length (a generator of events, or a duration-based plan useq cannot size)."""
    axis_order = tuple(getattr(sequence, "axis_order", ()) or ())
    if not axis_order or type(sequence).__name__ == "GeneratorMDASequence":
        return None, ()
    try:
        sizes = dict(sequence.sizes)
    except ZeroDivisionError:  # useq cannot size a duration-based plan with interval 0 ("as fast as possible")
        return None, ()
    return sizes, axis_order


def series_keys(sequence, sizes: Mapping[str, int], axis_order: Sequence[str]) -> tuple[tuple[str, ...], list[tuple]]:
    """The series axes of the sequence (those of ``p``, ``g`` it has) and their values, one key per
    series, in the order they first occur.  Positions with plans of their own (a grid plan per
    position, of any size) are read from the sequence's events, where a grid axis may appear that
    the sequence itself does not size; otherwise every combination in axis order.  Raises
    NotImplementedError for positions whose own plans give their images other axes or sizes than
    the sequence's (ragged images: one layout serves every series)."""
    positions = getattr(sequence, "stage_positions", ()) or ()
    if any(getattr(p, "sequence", None) is not None for p in positions):
        indexes = [event.index for event in sequence]
        present = tuple(a for a in SERIES_AXES if sizes.get(a, 0) > 0 or any(i.get(a, 0) > 0 for i in indexes))
        for index in indexes:
            for axis, value in index.items():
                if axis not in SERIES_AXES and not 0 <= value < max(sizes.get(axis, 0), 1):
                    raise NotImplementedError(
                        f"event index {_plain(index)}: positions whose own plans give their images other axes or "
                        f"sizes than the sequence's ({axis} of {sizes.get(axis, 0)}) are not supported by "
                        "TileShardSink; positions may have grid plans of their own"
                    )
        seen: dict[tuple, None] = {}
        for index in indexes:
            seen.setdefault(tuple(index.get(a, 0) for a in present), None)
        return present, list(seen) if present else [()]
    present = tuple(a for a in SERIES_AXES if sizes.get(a, 0) > 0)
    if not present:
        return (), [()]
    ordered = [a for a in axis_order if a in present]
    keys = [dict(zip(ordered, combo)) for combo in itertools.product(*(range(sizes[a]) for a in ordered))]
    return present, [tuple(k[a] for a in present) for k in keys]


def _plain(index: Mapping[str, int]) -> dict[str, int]:
    """An event index as it reads in a message: useq's axis enums as their letters."""
    return {getattr(axis, "value", axis): value for axis, value in index.items()}


class EventRouter:
    """Places the events of one MDA: event index -> (series, frame).

    ``inner_sizes`` are the sizes of the axes that index within an image (t, c, z, ... in the
    sequence's axis order, series axes left out), ``None`` for a sequence of unknown length: one
    series, axis ``t``, frames numbered as they arrive.  ``keys`` are the values of the series
    axes ``series_axes`` that make each series (series ``i`` is ``keys[i]``); ``events`` yields the
    sequence's event indexes in order (what :meth:`skip` needs to know which events come next).
    :meth:`from_sequence` reads all of them from a ``useq.MDASequence``.

    Used from one thread (the MDA thread): ``place`` and ``skip`` share the position in the sequence.
    """

    def __init__(
        self,
        inner_sizes: Mapping[str, int] | None,
        keys: Sequence[tuple[int, ...]] = ((),),
        series_axes: Sequence[str] = (),
        events: Callable[[], Iterable[Mapping[str, int]]] | None = None,
    ):
        self.bounded = inner_sizes is not None
        sizes = dict(inner_sizes) if inner_sizes is not None else {"t": 0}
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < (1 if self.bounded else 0):
                raise ValueError(f"axis {name!r} must have a positive integer size, got {size!r}")
        self.series_axes = tuple(series_axes)
        keys = [tuple(k) for k in keys]
        if not keys:
            raise ValueError("an MDA has at least one series; got no series keys")
        if len(set(keys)) != len(keys):
            raise ValueError(f"series keys repeat: {keys}")
        bad = [k for k in keys if len(k) != len(self.series_axes)]
        if bad:
            raise ValueError(f"series keys {bad} do not have one value per series axis {self.series_axes}")
        if not self.bounded and len(keys) != 1:
            raise ValueError(f"a sequence of unknown length has one series, got keys {keys}")
        self.inner_sizes = sizes
        self.inner_axes = tuple(sizes)
        self.keys = keys
        self._series_of = {key: i for i, key in enumerate(keys)}
        counts = list(sizes.values())
        self._strides = tuple(math.prod(counts[i + 1 :]) for i in range(len(counts)))
        self._axis_strides = tuple(zip(self.inner_axes, self._strides))
        self._axis_bounds = tuple(zip(self.inner_axes, self._strides, counts))
        self._events = events
        self._arrivals = 0  # unbounded: frames numbered by arrival
        self._order: list[tuple[int, int]] | None = None  # (series, frame) in the sequence's event order
        self._order_position: dict[tuple[int, int], int] = {}
        self._cursor = 0  # position in _order after the last event placed or skipped
        self._last_placed: tuple[int, int] | None = None

    @classmethod
    def from_sequence(cls, sequence) -> EventRouter:
        """The router of a ``useq.MDASequence`` (or a generator of events: unknown length)."""
        sizes, axis_order = sequence_sizes(sequence)
        if sizes is None:
            return cls(None)
        inner = {a: sizes[a] for a in axis_order if a not in SERIES_AXES and sizes.get(a, 0) > 0}
        present, keys = series_keys(sequence, sizes, axis_order)
        return cls(inner, keys, present, events=lambda: (event.index for event in sequence))

    @property
    def series_count(self) -> int:
        return len(self.keys)

    @property
    def frames_per_series(self) -> int | None:
        """Frames in each series; None when the sequence's length is unknown."""
        return math.prod(self.inner_sizes.values()) if self.bounded else None

    @property
    def frames_per_row(self) -> int:
        """Frames in one step of the first axis (the unit in which a series' array grows)."""
        return self._strides[0] if self._strides else 1

    def place(self, index: Mapping[str, int]) -> tuple[int, int]:
        """(series, frame) of the event with this index.  Raises ValueError for an index that is
        not part of the sequence."""
        if not self.bounded:
            frame = self._arrivals
            self._arrivals += 1
            return 0, frame
        try:
            series = self._series_of[tuple([index.get(a, 0) for a in self.series_axes])]
        except KeyError:
            raise ValueError(f"event index {_plain(index)} is not part of the sequence") from None
        frame = 0
        for axis, stride, size in self._axis_bounds:
            value = index.get(axis, 0)
            if not 0 <= value < size:  # a frame beyond its series would grow the image past the sequence
                raise ValueError(f"event index {_plain(index)} is not part of the sequence ({axis} has {size})")
            frame += value * stride
        place = (series, frame)
        self._last_placed = place
        if self._order is not None:
            position = self._order_position.get(place)
            if position is not None:
                self._cursor = max(self._cursor, position + 1)
        return place

    def skip(self, frames: int = 1) -> list[tuple[int, int]]:
        """The places of the next ``frames`` events of the sequence, which produced no image (after
        the last event placed or skipped; fewer at the sequence's end)."""
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
            raise ValueError(f"frames to skip must be a non-negative integer, got {frames!r}")
        if not self.bounded:
            places = [(0, self._arrivals + k) for k in range(frames)]
            self._arrivals += frames
            return places
        order = self._event_order()
        places = order[self._cursor : self._cursor + frames]
        self._cursor += frames
        return places

    def _event_order(self) -> list[tuple[int, int]]:
        """(series, frame) of every event in the order the sequence yields them, built on the first
        ``skip``: only a skip needs to know which events come next."""
        if self._order is None:
            events = self._events() if self._events is not None else ()
            order = [self._place_quietly(index) for index in events]
            self._order = order
            self._order_position = {place: k for k, place in enumerate(order)}
            if self._last_placed is not None:
                self._cursor = self._order_position.get(self._last_placed, -1) + 1
        return self._order

    def _place_quietly(self, index: Mapping[str, int]) -> tuple[int, int]:
        """The place of an event of the sequence itself, leaving the position in it alone."""
        key = tuple(index.get(a, 0) for a in self.series_axes)
        return self._series_of[key], sum(index.get(a, 0) * s for a, s in self._axis_strides)


def _gap_before_waiting(lane: _Lane) -> int:
    """Frames missing before the earliest frame waiting in this lane."""
    return min(lane.pending) - lane.next_frame


@dataclass
class _Lane:
    """One series' frames on their way to its Writer."""

    series: int
    total: int | None  # frames in the series; None = unbounded
    next_frame: int = 0  # the frame its Writer needs next
    pending: dict[int, Any] = field(default_factory=dict)  # frames that arrived early
    absent: dict[int, str] = field(default_factory=dict)  # frame -> reason: skipped / dropped
    fill_reasons: dict[int, str] = field(default_factory=dict)  # frames handed on as fill, and why


class ReorderBuffer:
    """Hands each series' frames on in frame order, whatever order they arrive in.

    ``frames_per_series`` holds each series' length (None: unbounded).  ``deliver(series, image)``
    receives the next frame of a series, ``fill(series, frame, reason)`` a frame that is written as
    the fill value instead (``reason`` one of :data:`FILL_REASONS`).  At most ``window`` frames wait
    over all series: one more and the oldest gap is given up on, filled as ``missing`` (the series
    whose earliest waiting frame is nearest the frame it needs: frames come roughly in order, so the
    shortest gap is the one left behind longest).  :meth:`finish`
    ends the run: waiting frames go in after their gaps are filled, and each series is completed to
    the end of its last row (``frames_per_row`` frames) so that every frame received is in a
    complete row.
    """

    def __init__(
        self,
        frames_per_series: Sequence[int | None],
        *,
        window: int,
        frames_per_row: int,
        deliver: Callable[[int, Any], None],
        fill: Callable[[int, int, str], None],
    ):
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"the reorder window must be a positive integer, got {window!r}")
        if not isinstance(frames_per_row, int) or isinstance(frames_per_row, bool) or frames_per_row < 1:
            raise ValueError(f"frames_per_row must be a positive integer, got {frames_per_row!r}")
        self.window = window
        self.frames_per_row = frames_per_row
        self._lanes = [_Lane(series, total) for series, total in enumerate(frames_per_series)]
        self._deliver = deliver
        self._fill = fill
        self._lock = threading.Lock()  # absent frames are marked on the MDA thread

    def next_frame(self, series: int) -> int:
        """The frame the series' Writer needs next (how many it has been handed)."""
        return self._lanes[series].next_frame

    @property
    def waiting(self) -> int:
        """Frames that arrived early and wait for the frames before them."""
        return sum(len(lane.pending) for lane in self._lanes)

    def fill_frames(self, series: int) -> dict[str, list[int]]:
        """The frames of the series handed on as fill, by reason (every reason listed)."""
        reasons = self._lanes[series].fill_reasons
        return {reason: sorted(f for f, r in reasons.items() if r == reason) for reason in FILL_REASONS}

    def mark_absent(self, series: int, frame: int, reason: str) -> None:
        """This frame will not come (``skipped``, ``dropped``): it is filled when its turn comes.
        Safe to call from another thread than the one handing frames on."""
        with self._lock:
            self._lanes[series].absent[frame] = reason

    def take(self, series: int, frame: int, image) -> bool:
        """One frame arrived.  False when it came too late (its place was filled already, or the
        same frame is waiting): it is discarded."""
        lane = self._lanes[series]
        if frame < 0 or (lane.total is not None and frame >= lane.total):
            raise ValueError(f"frame {frame} is outside series {series} of {lane.total} frames")
        if frame < lane.next_frame or frame in lane.pending:
            return False
        lane.pending[frame] = image
        if self.waiting > self.window:  # the oldest gap will not be filled in time: fill it now
            oldest = min((lane for lane in self._lanes if lane.pending), key=_gap_before_waiting)
            self._fill_until(oldest, min(oldest.pending), "missing")
        return True

    def advance(self) -> None:
        """Hand on every frame that can go now: the next ones that arrived or are known absent."""
        for lane in self._lanes:
            self._advance(lane)

    def finish(self) -> None:
        """The run ended: frames still waiting go in after the gaps before them are filled
        (``missing``), and each series is completed to the end of its last row."""
        row = self.frames_per_row
        for lane in self._lanes:
            self._advance(lane)
            with self._lock:
                last = max([*lane.pending, *lane.absent, lane.next_frame - 1], default=-1)
            end = (last // row + 1) * row if last >= 0 else 0
            if lane.total is not None:
                end = min(end, lane.total)
            self._fill_until(lane, end, "missing")

    def _advance(self, lane: _Lane) -> None:
        while True:
            frame = lane.next_frame
            if lane.total is not None and frame >= lane.total:
                return
            image = lane.pending.pop(frame, None)
            if image is not None:
                self._deliver(lane.series, image)
            else:
                with self._lock:
                    reason = lane.absent.pop(frame, None)
                if reason is None:
                    return
                self._fill_frame(lane, reason)
            lane.next_frame += 1

    def _fill_until(self, lane: _Lane, stop: int, reason: str) -> None:
        """Hand on every frame before ``stop``: the ones that arrived, fill for the others."""
        while lane.next_frame < stop:
            if lane.next_frame in lane.pending:  # arrived after all (at the end: beyond an earlier gap)
                self._advance(lane)
                continue
            with self._lock:
                why = lane.absent.pop(lane.next_frame, reason)
            self._fill_frame(lane, why)
            lane.next_frame += 1
        self._advance(lane)

    def _fill_frame(self, lane: _Lane, reason: str) -> None:
        self._fill(lane.series, lane.next_frame, reason)
        lane.fill_reasons[lane.next_frame] = reason
