"""Record pymmcore-plus multi-dimensional acquisitions (MDAs) into sharded OME-Zarr.

:class:`TileShardSink` implements pymmcore-plus's ``SinkProtocol`` (``setup``, ``append``,
``skip``, ``close``, ``get_view``) and its frame-handler protocol (``sequenceStarted``,
``frameReady``, ``sequenceFinished``), so it works as::

    core.mda.run(sequence, output=TileShardSink("run.ome.zarr"))   # pymmcore-plus 0.18 takes
    core.run_mda(sequence, output=TileShardSink("run.ome.zarr"))   # output objects as handlers

and, attached straight to ``core.mda.events`` (:meth:`TileShardSink.attach`, what the recorder
dock does through :class:`MDARecorder`), for every MDA whoever starts it (napari-micromanager, a
script).

Layout (the same as pymmcore-plus's default ome-writers sink, so its readers read ours):
the store is a ``bioformats2raw.layout`` collection whose series ``0``, ``1``, ... are one
OME-Zarr image each, one per stage position (and grid position): positions may differ in their
grid shapes and are often visited in an interleaved order (``tpcz``), and OME-NGFF 0.5 allows
no position axis beside t, c, z.  Each image's dimensions are the sequence's other axes in its
axis order, then y and x from the camera (ROI and binning included), with the pixel size, the
z step and the time interval as scales and the channel names in ``omero``.

Frames are placed by their event index, not by arrival: each series keeps the next frame its
Writer needs; frames that arrive early wait (at most ``reorder_frames`` of them), frames that
never come (``skip``, dropped, cancelled) are written as the fill value and listed in the root
group's ``tileshard_mmcore`` attributes.  Per-frame metadata (everything pymmcore-plus records:
times, stage position, exposure, properties) goes into the ``frame_metadata`` (numbers) and
``frame_metadata_json`` (the full record) arrays beside the series.  Each image's first axis
grows as its rows complete, so a run that stops early keeps exactly the rows it acquired.

A camera faster than the sink fills pymmcore-plus's sequence buffer (``images_remaining_in_buffer``
in each frame's metadata, its size in the summary metadata): before it overflows (which ends the
MDA in ``MemoryError: Buffer overflowed``) the sink stops the MDA, when it knows the core
(``core=``, ``attach(core)``), and says why: the rate the sink sustained, the rate the camera
delivered and how to raise the buffer (:class:`SinkFellBehindError`).

The modules, one concern each (the sink composes them):

* :mod:`.router`: event index -> (series, frame), ``skip``, and the reorder buffer that hands
  each series' frames on in frame order with fill frames for the absent ones;
* :mod:`.feeder`: the bounded queue off the MDA thread (``block``/``drop``) and its thread;
* :mod:`.overflow`: the watch on pymmcore-plus's sequence buffer, :class:`SinkFellBehindError`;
* :mod:`.metadata`: the camera, OME axes/units/scales, ``omero``, the frame table, the collection;
* :mod:`.sink`: :class:`TileShardSink`; :mod:`.mda_recorder`: :class:`MDARecorder`;
* :mod:`.demo`: an offline ``UniMMCore`` with pure-Python devices (imports pymmcore-plus).

Importing this package does not import pymmcore-plus: the sink only reads the objects it is handed.
"""

from .mda_recorder import MMCORE_SOURCE, MDARecorder, mmcore_available
from .metadata import FRAME_COLUMNS
from .overflow import SinkFellBehindError
from .sink import SinkStats, TileShardSink

__all__ = [
    "FRAME_COLUMNS",
    "MDARecorder",
    "MMCORE_SOURCE",
    "SinkFellBehindError",
    "SinkStats",
    "TileShardSink",
    "mmcore_available",
]
