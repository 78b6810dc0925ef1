"""``LazySelection``: napari's lazy array over a reader, reading only the region finally converted."""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["LazySelection", "SelectionReader"]


class SelectionReader(Protocol):
    """What a :class:`LazySelection` needs of its reader (a
    :class:`~napari_tileshard.reader.shard_reader.ShardReader`)."""

    dtype: np.dtype

    def read(self, selection=...) -> np.ndarray: ...


class LazySelection:
    """A basic selection of a :class:`~napari_tileshard.reader.shard_reader.ShardReader`'s array,
    read only when converted (``np.asarray``): indexing composes (ints, slices with any step,
    Ellipsis) and reads nothing.

    napari's multiscale slicing first crops the displayed region over every row of a level, then
    picks the current row, then converts: with this array-like only that row's chunks are
    planned, read and decoded (a dask array does the same with a task per shard and ~20 ms of
    scheduling per slice).  Index types it cannot compose (arrays, None) read the selection first.
    """

    def __init__(self, reader: SelectionReader, items: tuple):
        self.reader, self.items = reader, items  # per dim of the reader: a range (kept) or an int
        self.shape = tuple(len(item) for item in items if isinstance(item, range))
        self.dtype = reader.dtype
        self.ndim = len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    def __repr__(self):
        return f"LazySelection(shape={self.shape}, dtype={self.dtype}, of {self.reader!r})"

    def __getitem__(self, key):
        keys = key if isinstance(key, tuple) else (key,)
        composable = all(
            k is Ellipsis or isinstance(k, slice) or (isinstance(k, (int, np.integer)) and not isinstance(k, bool))
            for k in keys
        )
        if not composable or sum(k is Ellipsis for k in keys) > 1:
            return np.asarray(self)[key]
        if any(k is Ellipsis for k in keys):
            at = next(i for i, k in enumerate(keys) if k is Ellipsis)
            keys = keys[:at] + (slice(None),) * (self.ndim - len(keys) + 1) + keys[at + 1 :]
        if len(keys) > self.ndim:
            raise IndexError(f"too many indices for an array of {self.ndim} dimensions: {key!r}")
        keys = keys + (slice(None),) * (self.ndim - len(keys))
        composed, next_key = [], iter(keys)
        for item in self.items:
            if isinstance(item, range):
                k = next(next_key)
                composed.append(item[int(k)] if isinstance(k, (int, np.integer)) else item[k])
            else:
                composed.append(item)
        return LazySelection(self.reader, tuple(composed))

    def __array__(self, dtype=None, copy=None):
        selection: list[int | slice] = []
        flip: list[int] = []
        for item in self.items:
            if isinstance(item, int):
                selection.append(item)
            elif len(item) == 0:
                selection.append(slice(0, 0))
            elif item.step > 0:
                selection.append(slice(item.start, item[-1] + 1, item.step))
            else:  # read the same elements in increasing order, then reverse
                selection.append(slice(item[-1], item.start + 1, -item.step))
                flip.append(len([s for s in selection[:-1] if not isinstance(s, int)]))
        out = self.reader.read(tuple(selection))
        if flip:
            out = np.flip(out, axis=tuple(flip))
        return np.asarray(out, dtype=dtype)
