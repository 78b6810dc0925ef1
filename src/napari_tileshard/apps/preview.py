"""What the recorder's preview layer shows, without Qt or napari.

During a recording the preview shows only the rows whose shard epochs are complete, as dask
arrays over the store.  They must stay lazy: napari's multiscale slicing crops the displayed dims
over *every* row of a level before picking the current one, so an eager array here would read
the whole recording on each draw (docs/benchmarks.md, "The GUI while recording").

The newest frame of each level is read back on a reader thread (:func:`read_newest`; row 0 too,
once: :func:`read_first`) and stands in for its row (:class:`RecentFrames`), so the GUI thread does
not decode the tiles of the frame it is about to show.

Each of these calls opens the store once: the root's and every level's ``zarr.json`` are read and
checked one time, and the opened arrays are handed to the readers and dask as they are (the
recording grows them, so nothing is kept from one call to the next).
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import zarr

from ..format.pyramid import Pyramid
from ..reader.levels import open_levels, open_root
from ..reader.shard_reader import ShardReader
from ..storage.safe_read import StoreAccess
from .napari_reader import FirstRows, check_displayable, open_lazy, written_rows

__all__ = [
    "MAX_BLOCKS",
    "MAX_FRAME_BLOCKS_PER_DIM",
    "PREVIEW_INTERVAL_S",
    "PreviewReader",
    "RecentFrames",
    "block_shape",
    "complete_rows",
    "contrast_limits",
    "preview_data",
    "read_first",
    "read_newest",
    "shape_of",
    "warm_up_dask_in_background",
]

#: Upper bound on the dask blocks of one preview level.  napari's crop of every row makes each
#: draw cost dask time in proportion to them, on the GUI thread: 13 ms at 4096 blocks, 68 ms at
#: 16384 (2-core machine).  A long recording gets longer blocks along dim 0 rather than more.
MAX_BLOCKS = 1 << 12
#: Upper bound on the blocks along one frame dim, whatever chunk shape the metadata declares.
MAX_FRAME_BLOCKS_PER_DIM = 32


def warm_up_dask_in_background() -> None:
    """Import dask.array and run one tiny compute on a thread of its own, ahead of the first
    preview update.

    The import takes about half a second; dask's first compute also imports ``distributed`` when
    it is installed (to look for a client, whatever the scheduler), another second or more.  On
    the GUI thread, at the first complete shard epoch, these were the longest stalls of a whole
    recording.  A later import on the GUI thread waits for this one to finish, so there is
    nothing to synchronise.  Called when the recorder dock opens, long before Start.
    """
    global _dask_warmed
    if _dask_warmed:
        return
    _dask_warmed = True

    def warm_up():
        import dask.array as da

        da.zeros(1, dtype=np.uint8).compute(scheduler="synchronous")

    threading.Thread(target=warm_up, name="tileshard-warm-up-dask", daemon=True).start()


_dask_warmed = False


def _open(output, ome: bool):
    """``(access, root, levels)``: the store at ``output`` opened once; ``levels`` the OME levels
    (with ``ome``; None without or when the root has none)."""
    access, root = open_root(output)
    return access, root, open_levels(root) if ome else None


def _readable_arrays(output, ome: bool) -> tuple[StoreAccess, list | None]:
    """``(access, arrays)``: the arrays to read back, opened once: the OME levels, or the plain
    array; None when ``output`` is neither (a group holding arrays: read through ``open_lazy``)."""
    access, root, levels = _open(output, ome)
    if levels:
        return access, levels
    return access, [root] if isinstance(root, zarr.Array) else None


def _read_rows(arrays: list, rows_of_level: list) -> list[tuple[int, np.ndarray]]:
    """``(row, frame)`` per level ``k`` for which ``rows_of_level[k](level_rows)`` names a row
    (None: skip), read by :class:`~napari_tileshard.reader.shard_reader.ShardReader` over the opened
    ``arrays[k]`` (coalesced shard reads, decoded on threads; zarr-python under
    ``TILESHARD_READER=zarr``).  A fresh reader per call: a recording rewrites its open shards and
    grows its shape."""
    frames = []
    for array, choose in zip(arrays, rows_of_level):
        with ShardReader(array, backend="cpu") as reader:
            row = choose(reader.shape[0]) if reader.shape else None
            if row is not None and 0 <= row < reader.shape[0]:
                frames.append((row, reader[row]))
    return frames


def read_newest(output, pyramid: Pyramid, rows: int, ome: bool) -> list[tuple[int, np.ndarray]]:
    """``(row, frame)`` of the newest complete row of every level (level 0 first), read from the
    store.  Decodes tiles: call it on the recorder's thread, not the GUI's."""
    if rows <= 0:
        return []
    access, arrays = _readable_arrays(output, ome)
    if arrays is not None:
        choose = [lambda n, k=k: min(pyramid.level_rows(k, rows) if k else rows, n) - 1 for k in range(len(arrays))]
        frames = _read_rows(arrays, choose)
        return frames if frames and frames[0][0] == rows - 1 else []

    array, _ = open_lazy(access)
    return [] if array is None else [(rows - 1, np.asarray(array[rows - 1]))]


def read_first(output, ome: bool) -> list[tuple[int, np.ndarray]]:
    """``(0, frame)``: row 0 of every level (level 0 first), read from the store.

    When the first complete rows replace the placeholder, napari slices the layer at the
    placeholder's row 0 before the slider can move to the newest row; with this frame in memory
    that slice costs no decoding on the GUI thread.  Call it on a reader thread.
    """
    access, arrays = _readable_arrays(output, ome)
    if arrays is not None:
        return _read_rows(arrays, [lambda n: 0 if n > 0 else None] * len(arrays))

    array, _ = open_lazy(access)
    return [] if array is None or array.shape[0] == 0 else [(0, np.asarray(array[0]))]


#: seconds between two reads of the preview reader (what the preview shows at most)
PREVIEW_INTERVAL_S = 0.2


class PreviewReader:
    """Reads the newest complete frame of every level of a recording back from its store, on a
    thread of its own, as shard epochs complete (what the recorder dock's preview shows), at most
    one read per ``min_interval_s``.

    The recording thread only leaves a note (:meth:`note`, O(1)): a read never holds back frames.
    Only the latest note is kept, so when reads are slower than shard epochs complete the reader
    skips to the newest.  With its first read it also brings back row 0 of every level
    (:func:`read_first`).  ``deliver(state, newest, first)`` is called on the reader thread with
    the note's ``state`` and the frames (None when there was nothing to read or the read failed:
    the preview is best effort).  :meth:`finish` drops what is pending and joins the thread.
    """

    def __init__(self, output, pyramid: Pyramid, ome: bool, deliver, min_interval_s: float = PREVIEW_INTERVAL_S):
        self.output, self.pyramid, self.ome = output, pyramid, ome
        self._deliver = deliver
        self.min_interval_s = min_interval_s
        self.reads = 0
        self._pending: tuple | None = None
        self._done = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tileshard-preview-read", daemon=True)

    def start(self) -> PreviewReader:
        self._thread.start()
        return self

    def note(self, state, rows: int) -> None:
        """``rows`` rows are complete now (``state``: what to hand to ``deliver`` with the frames)."""
        with self._wake:
            self._pending = (state, rows)
            self._wake.notify()

    def finish(self) -> None:
        with self._wake:
            self._done = True
            self._pending = None
            self._wake.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        first_read = True
        next_read = 0.0
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._done)
                # At most one read per min_interval_s (the preview shows no more): a read decodes a
                # frame per level, and back to back they took a core and the GIL from the recording.
                self._wake.wait_for(lambda: self._done, timeout=max(0.0, next_read - time.monotonic()))
                pending, self._pending = self._pending, None
                if pending is None or self._done:
                    return
            next_read = time.monotonic() + self.min_interval_s
            self.reads += 1
            state, rows = pending
            first = None
            try:
                newest = read_newest(self.output, self.pyramid, rows, self.ome) or None
                if first_read and newest:
                    first, first_read = read_first(self.output, self.ome) or None, False
            except Exception:  # noqa: BLE001 - the preview is best effort; the recording goes on
                newest = None
            self._deliver(state, newest, first)


class RecentFrames:
    """The frames :func:`read_newest` brought back, the last two per level.

    Two, because replacing the layer's data makes napari re-read the row it shows (the previous
    newest) before the slider follows to the new newest.
    """

    keep = 2

    def __init__(self):
        self._levels: dict[int, dict[int, np.ndarray]] = {}

    def add(self, newest) -> None:
        for k, (row, frame) in enumerate(newest):
            recent = self._levels.setdefault(k, {})
            recent[row] = frame
            self._levels[k] = dict(sorted(recent.items())[-self.keep :])

    def level(self, k: int) -> dict[int, np.ndarray]:
        return self._levels.get(k, {})


def preview_data(
    output, rows: int, pyramid: Pyramid, *, ome: bool, final: bool = False, recent: RecentFrames | None = None
):
    """``(data, dimension names)`` for the preview layer: the first ``rows`` rows of level 0 (and
    the rows of every level they complete, as a list, with ``ome``); every written row once
    ``final``.  ``data`` is None when the store holds no array yet.

    Raises when the store cannot be opened or its frames are too large to display (the caller
    reports it: the preview is best effort).
    """
    access, root, levels = _open(output, ome)
    if levels:
        array, names = levels[0], _dimension_names(levels[0])
    elif isinstance(root, zarr.Array):
        array, names = written_rows(root)[0], _dimension_names(root)
    else:  # a group holding arrays: its first array, as the napari reader shows it
        array, names = open_lazy(access)
    if array is None:
        return None, names
    recent = recent or RecentFrames()
    if levels:
        check_displayable(levels[-1], output)
        return [
            complete_rows(
                level,
                level.shape[0] if final else min(pyramid.level_rows(k, rows), level.shape[0]),
                None if final else recent.level(k),
            )
            for k, level in enumerate(levels)
        ], names
    check_displayable(array, output)
    # Finished and single scale: napari reads one row at a time, which zarr does lazily itself.
    return (array if final else complete_rows(array, min(rows, array.shape[0]), recent.level(0))), names


def _dimension_names(array) -> list[str] | None:
    """The array's dimension names when every dimension has one (Zarr v3), else None."""
    names = array.metadata.dimension_names if array.metadata.zarr_format == 3 else None
    return list(names) if names and all(names) else None


def complete_rows(array, rows: int, recent: dict[int, np.ndarray] | None = None):
    """The first ``rows`` rows of ``array`` (zarr, or a :class:`~napari_tileshard.apps.napari_reader.FirstRows`)
    as a dask array; rows found in ``recent`` come from those frames instead of the store."""
    import dask.array as da

    # Bounding dim 0 before dask sees the shape keeps the graph to the rows that exist, not the
    # declared size of a bounded (or hostile) array.
    view = FirstRows(array, rows)
    blocks = block_shape(array, view.shape)
    recent = {
        row: frame
        for row, frame in (recent or {}).items()
        if 0 <= row < view.rows and frame.shape == view.shape[1:] and frame.dtype == view.dtype
    }
    # Each recent row gets a block of its own, so dask asks the source for exactly that row and
    # _RecentRows can answer from memory.  One from_array over irregular blocks, not a
    # concatenation of pieces: dask builds a concatenation's graph in full on every update,
    # and a from_array only for the blocks a draw reads.
    edges = sorted(set(range(0, view.rows, blocks[0])) | {r + d for r in recent for d in (0, 1)} | {view.rows})
    chunks = (tuple(b - a for a, b in zip(edges, edges[1:])) or (0,),) + blocks[1:]
    source = _RecentRows(view, recent) if recent else view
    return da.from_array(source, chunks=chunks, name=False, meta=np.empty((0,) * view.ndim, view.dtype))


class _RecentRows:
    """The block source of :func:`complete_rows`: ``view`` (the store), except single rows that
    were read back already.  Only dask indexes it: a tuple of slices per block, or, where dask
    fused a selection into the read, a row number first."""

    def __init__(self, view, recent: dict[int, np.ndarray]):
        self.view, self.recent = view, recent
        self.shape, self.dtype, self.ndim = view.shape, view.dtype, view.ndim

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        rows = key[0] if key else slice(None)
        if isinstance(rows, (int, np.integer)) and int(rows) in self.recent:
            return self.recent[int(rows)][key[1:]]
        if (
            isinstance(rows, slice)
            and rows.step in (None, 1)
            and rows.start is not None
            and rows.stop == rows.start + 1
            and rows.start in self.recent
        ):
            return self.recent[rows.start][key[1:]][None]
        return self.view[key]


def block_shape(array, shape) -> tuple[int, ...]:
    """dask's block over ``array`` when ``shape`` of it is shown.

    Along dim 0 one tile: napari turns dask's task fusion off, so dask reads whole blocks, and a
    tile's rows cost the same decode as the one row napari wants (zarr decodes whole tiles).
    Across the frame one shard: zarr reads only the tiles inside the block, and fewer blocks
    mean a smaller graph per draw.  Both are capped (:data:`MAX_BLOCKS`,
    :data:`MAX_FRAME_BLOCKS_PER_DIM`) so a long recording or odd metadata cannot make each draw
    build millions of tasks.
    """
    base = getattr(array, "array", array)  # a FirstRows view: its zarr array knows the chunks
    inner = tuple(getattr(base, "chunks", None) or shape)
    outer = tuple(getattr(base, "shards", None) or inner)
    if len(inner) != len(shape) or len(outer) != len(shape):
        inner = outer = tuple(shape)
    frame = [max(1, min(n, max(b, -(-n // MAX_FRAME_BLOCKS_PER_DIM)))) for n, b in zip(shape[1:], outer[1:])]
    frame_blocks = math.prod(-(-n // b) for n, b in zip(shape[1:], frame))
    rows = shape[0] if shape else 0
    row_blocks = max(1, MAX_BLOCKS // max(1, frame_blocks))
    first = max(1, min(rows, max(inner[0], -(-rows // row_blocks)))) if shape else 1
    return (first, *frame)


def contrast_limits(frame: np.ndarray) -> tuple[float, float]:
    """Limits that ignore a few hot or dead pixels; never an empty range."""
    low, high = np.percentile(frame, (0.5, 99.95))
    return float(low), float(max(high, low + 1))


def shape_of(data) -> tuple:
    """Shape of a layer's data: of level 0 when it is a multiscale list."""
    return tuple((data[0] if isinstance(data, list) else data).shape)
