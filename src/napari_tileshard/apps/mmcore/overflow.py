"""Keeping up with the camera: the watch on pymmcore-plus's sequence buffer.

A hardware-sequenced camera fills pymmcore-plus's sequence (circular) buffer at its own pace; the
MDA thread takes frames out and hands them to the sink.  When the sink (or the MDA thread itself)
is slower, the buffer fills until it overflows, which ends the MDA in a bare
``MemoryError: Buffer overflowed``.  :class:`BufferWatch` follows each frame's metadata
(``runner_time_ms``, ``images_remaining_in_buffer``) and says when to stop first (three quarters
full, once the rates are measured) and why: the rate the sink sustained, the rate the camera
delivered, which side was slow and how to raise the buffer (:meth:`BufferWatch.explain`).
"""

from __future__ import annotations

import math
import time
from collections import deque

__all__ = ["FRAMES_TO_JUDGE", "BufferWatch", "SinkFellBehindError", "buffer_stop_level", "describe_rate"]


class SinkFellBehindError(RuntimeError):
    """The camera delivered frames faster than the sink wrote them, until pymmcore-plus's sequence
    buffer was (nearly) full: the MDA was stopped.  What the sink received is written and complete."""


#: frames the sink receives before it may stop the MDA: the camera's and its own rates are
#: measured by then (a buffer that overflows meanwhile is still draining: the stop lands in time)
FRAMES_TO_JUDGE = 8


def buffer_stop_level(capacity: int) -> int:
    """Frames waiting in pymmcore-plus's buffer at which the sink stops the MDA: three quarters of
    its capacity.  The buffer absorbs hiccups; one this full under an unthrottled camera overflows
    within moments, and waiting longer is not safe: the waiting count is seen only as frames are
    taken (a fast camera fills many slots in between), and the slots a buffer really holds can be
    fewer than its size in frames (a 1 MiB buffer of 136 frames overflowed at 121)."""
    return max(1, capacity - capacity // 4)


def describe_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e8 else f"{bytes_per_s / 1e6:.1f} MB/s"


class BufferWatch:
    """Follows the camera's pace and the sequence buffer over one run, from the MDA thread.

    ``frame_bytes`` and ``frame_text`` (``"512x128 uint16"``) describe a frame, ``buffer_mb`` and
    ``buffer_frames`` the buffer (None when the summary metadata does not record it: nothing to
    watch), ``planned_frames`` the frames of the whole run (None: unbounded), for the buffer size
    the message suggests."""

    def __init__(
        self,
        *,
        frame_bytes: int,
        frame_text: str,
        buffer_mb: float | None,
        buffer_frames: int | None,
        planned_frames: int | None,
    ):
        self.frame_bytes = frame_bytes
        self.frame_text = frame_text
        self.buffer_mb = buffer_mb
        self.capacity = buffer_frames
        self.planned_frames = planned_frames
        self.max_waiting = 0  # most frames seen waiting in the buffer
        self.tripped = False  # the stop level was reached (said once)
        self._stop_level = buffer_stop_level(buffer_frames) if buffer_frames and buffer_frames >= 2 else None
        self._first_frame: float | None = None  # perf_counter of the first frame observed
        self._camera_first_ms: float | None = None  # runner_time_ms of the first frame
        self._camera_last_ms = 0.0  # ... and of the latest one
        self._timed = 0  # frames with a runner_time_ms
        self._arrivals_full: deque[bool] = deque(maxlen=16)  # whether the latest frames found the queue full

    def observe(self, meta, *, queue_full: bool, received: int) -> int | None:
        """One frame arrived (``received`` so far, this one included) with this frame metadata,
        finding the sink's queue full or not.  Returns the frames waiting in the buffer when the
        MDA should stop now (once), else None."""
        if self._first_frame is None:
            self._first_frame = time.perf_counter()
        self._arrivals_full.append(queue_full)
        if not isinstance(meta, dict):
            return None
        when = meta.get("runner_time_ms")
        if isinstance(when, (int, float)) and math.isfinite(when):
            if self._camera_first_ms is None:
                self._camera_first_ms = float(when)
            self._camera_last_ms = float(when)
            self._timed += 1
        waiting = meta.get("images_remaining_in_buffer")
        if not isinstance(waiting, int) or isinstance(waiting, bool):
            return None
        if waiting > self.max_waiting:
            self.max_waiting = waiting
        if (
            not self.tripped
            and self._stop_level is not None
            and waiting >= self._stop_level
            and received >= FRAMES_TO_JUDGE  # rates measured, not a start-up burst
        ):
            self.tripped = True
            return waiting
        return None

    def explain(
        self,
        *,
        path: str,
        waiting: int,
        received: int,
        written: int,
        can_stop: bool,
        writing_since: float | None = None,
    ) -> str:
        """Why the run has to stop: the rates (the sink's: the ``written`` frames since
        ``writing_since``, the ``perf_counter`` of the first, else since the first frame arrived;
        the camera's from its timestamps), which side was slow, the buffer, and how to get through
        next time."""
        now = time.perf_counter()
        elapsed = now - self._first_frame if self._first_frame is not None else 0.0
        frame_bytes = self.frame_bytes
        writing = now - writing_since if writing_since is not None else elapsed
        sink_fps = written / writing if writing > 0 else 0.0
        first = self._camera_first_ms
        span_s = (self._camera_last_ms - first) / 1000 if first is not None else 0.0
        camera_fps = (self._timed - 1) / span_s if span_s > 0 else None
        capacity = self.capacity or 0
        camera = (
            f"the camera delivered {describe_rate(camera_fps * frame_bytes)} ({camera_fps:.0f} frames/s)"
            if camera_fps
            else "the camera delivered them faster"
        )
        # Who is slow: a sink that cannot keep up has its queue full when frames arrive; one that
        # keeps up with what it is handed has room, and the MDA thread itself took frames too slowly.
        recent = self._arrivals_full
        full = sum(recent) / len(recent) if recent else 0.0
        bottleneck = (
            f"the sink's queue was full for {full:.0%} of the latest frames: the sink could not keep up"
            if full >= 0.5
            else f"the sink's queue had room for {1 - full:.0%} of the latest frames: the MDA thread itself was slow"
        )
        need = ""
        taken_fps = received / elapsed if elapsed > 0 else 0.0  # frames leaving the buffer
        if camera_fps and taken_fps < camera_fps and self.planned_frames is not None:
            frames = math.ceil(self.planned_frames * (1 - taken_fps / camera_fps))
            need = f" (this run would need about {math.ceil(frames * frame_bytes / 2**20)} MiB)"
        stop = (
            "The MDA is stopped"
            if can_stop
            else "pymmcore-plus ends the MDA when it overflows (MemoryError: Buffer overflowed); give the sink "
            "the core (TileShardSink(..., core=core) or sink.attach(core)) to stop it first"
        )
        return (
            f"{path}: frames left pymmcore-plus's sequence buffer slower than the camera filled it "
            f"({bottleneck}): the sink sustained {describe_rate(sink_fps * frame_bytes)} ({sink_fps:.0f} frames/s "
            f"of {self.frame_text}) while {camera}, and the buffer of {self.buffer_mb:g} MiB ({capacity} frames) "
            f"held {waiting} waiting frames. {stop}; every frame received up to then is written. Raise the "
            f"buffer with core.setCircularBufferMemoryFootprint(MiB){need}, throttle the camera (a longer "
            "exposure or an interval in the time plan), or acquire fewer frames."
        )
