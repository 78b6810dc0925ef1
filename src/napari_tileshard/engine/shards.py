"""Shard assembly: host-side accumulation of compressed tiles into shards.

A shard on disk is the concatenated chunk bytes followed by the index, which
:class:`~napari_tileshard.format.ShardSpec` encodes (the format layer's one definition of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..format import EMPTY as _EMPTY
from ..format.codecs import Raw
from ..format.layout import Layout
from ..format.shard_spec import ShardSpec

__all__ = ["EMPTY", "EncodedEpoch", "Shard", "ShardAccumulator"]

EMPTY = np.uint64(_EMPTY)


@dataclass
class EncodedEpoch:
    """The compressed tiles of one tile epoch, grouped by inner shard.

    ``shard_data[j]`` holds the chunks of inner shard ``j`` back to back in within-shard
    order (a buffer, or a list of buffers); ``chunk_sizes[j, w]`` is the byte count of tile
    ``w`` of shard ``j`` (0 where the slot holds no tile).
    """

    shard_data: list
    chunk_sizes: np.ndarray


@dataclass
class Shard:
    """A shard ready to store: ``buffers`` then ``index`` make the file."""

    coords: tuple[int, ...]
    buffers: list
    index: bytes
    #: bytes of ``buffers`` when the caller knows them (the accumulator does); None: counted
    data_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        data = self.data_bytes
        if data is None:
            data = sum(memoryview(b).nbytes for b in self.buffers)
        return data + len(self.index)


@dataclass
class _ShardEpochState:
    data: list[list]  # per inner shard: buffers
    length: np.ndarray  # per inner shard: bytes so far
    index: np.ndarray  # (inner shards, chunks per shard, 2)

    def copy(self) -> _ShardEpochState:
        return _ShardEpochState([list(d) for d in self.data], self.length.copy(), self.index.copy())


class ShardAccumulator:
    """Collects tile epochs in order and hands out shards once their shard epoch is complete."""

    def __init__(self, layout: Layout):
        self.layout = layout
        # the index format of the writer's shards (the codec plays no part in the index)
        self._encode_index = ShardSpec.from_layout(layout, Raw()).encode_entries
        self._shard_epoch = 0
        self._next_epoch = 0
        self._preserved: dict[tuple[int, ...], bytes] = {}  # flushed files of unopened shard epochs
        self._state = self._fresh_state()

    def _fresh_state(self) -> _ShardEpochState:
        inner = self.layout.inner_shard_count
        index = np.full((inner, self.layout.chunks_per_shard, 2), EMPTY, dtype=np.uint64)
        state = _ShardEpochState([[] for _ in range(inner)], np.zeros(inner, dtype=np.uint64), index)
        for j in range(inner):
            blob = self._preserved.pop((self._shard_epoch,) + self.layout.inner_shard_coords(j), None)
            if blob is not None:
                state.data[j].append(blob)
                state.length[j] = len(blob)
        return state

    @property
    def has_pending(self) -> bool:
        return any(self._state.data)

    def add(self, epoch: int, encoded: EncodedEpoch) -> list[Shard]:
        """Add tile epoch ``epoch`` (epochs arrive in order); returns the shards it completes."""
        if epoch != self._next_epoch:
            raise RuntimeError(f"tile epoch {epoch} arrived, expected {self._next_epoch}")
        self._next_epoch += 1
        _add_to_state(self.layout, self._state, epoch, encoded)
        last_of_shard_epoch = (epoch + 1) % self.layout.tiles_per_shard[0] == 0
        last_of_array = self.layout.epoch_count is not None and epoch + 1 == self.layout.epoch_count
        if last_of_shard_epoch or last_of_array:
            return self._take()
        return []

    def flush(self, provisional: Sequence[EncodedEpoch] = ()) -> list[Shard]:
        """Every open shard as it would be if the stream ended after the ``provisional`` epochs.

        The stream goes on, so these shards are written again later.  A reader may have read
        a flushed shard's index and not yet its chunks when the new version replaces the file;
        so every byte of a flushed shard keeps its offset in every later version of that shard:
        later chunks go after the flushed file (whose provisional chunks and old index stay as
        unreferenced bytes, which the sharding spec allows).  Cost: each flush adds the
        provisional part and the index of every open shard once to its final size.
        """
        clone = ShardAccumulator.__new__(ShardAccumulator)
        clone.layout, clone._shard_epoch, clone._next_epoch = self.layout, self._shard_epoch, self._next_epoch
        clone._encode_index = self._encode_index
        clone._preserved = dict(self._preserved)
        clone._state = self._state.copy()
        shards = []
        for encoded in provisional:
            shards += clone.add(clone._next_epoch, encoded)
        shards += clone.take_pending()
        for shard in shards:
            blob = b"".join(memoryview(b).cast("B") for b in shard.buffers) + shard.index
            if shard.coords[0] == self._shard_epoch:
                j = self.layout.inner_shard_number(shard.coords[1:])
                kept = int(self._state.length[j])  # the open shard's chunks, which stay where they are
                self._state.data[j].append(blob[kept:])
                self._state.length[j] += len(blob) - kept
            else:  # a shard epoch this accumulator has not opened yet: starts with the whole file
                self._preserved[shard.coords] = blob
        return shards

    def take_pending(self) -> list[Shard]:
        """Hand out the open shard epoch as final (end of the recording)."""
        return self._take() if self.has_pending else []

    def _take(self) -> list[Shard]:
        shards = _shards(self.layout, self._shard_epoch, self._state, self._encode_index)
        self._shard_epoch += 1
        self._next_epoch = self._shard_epoch * self.layout.tiles_per_shard[0]
        self._state = self._fresh_state()
        return shards


def _add_to_state(layout: Layout, state: _ShardEpochState, epoch: int, encoded: EncodedEpoch) -> None:
    sizes = np.asarray(encoded.chunk_sizes, dtype=np.uint64)
    mask = layout.slot_mask
    # Offsets of each chunk inside its shard: bytes already in the shard + exclusive scan.
    within_offsets = np.cumsum(sizes, axis=1, dtype=np.uint64) - sizes
    offsets = state.length[:, None] + within_offsets
    first_slot = (epoch % layout.tiles_per_shard[0]) * layout.tiles_per_shard_inner
    slots = slice(first_slot, first_slot + layout.tiles_per_shard_inner)
    state.index[:, slots, 0] = np.where(mask, offsets, EMPTY)
    state.index[:, slots, 1] = np.where(mask, sizes, EMPTY)
    state.length += sizes.sum(axis=1, dtype=np.uint64)
    for shard_buffers, data in zip(state.data, encoded.shard_data):
        if isinstance(data, list):
            shard_buffers.extend(data)
        else:
            shard_buffers.append(data)


def _shards(layout: Layout, shard_epoch: int, state: _ShardEpochState, encode_index) -> list[Shard]:
    shards = []
    for j, buffers in enumerate(state.data):
        if not buffers:
            continue
        coords = (shard_epoch,) + layout.inner_shard_coords(j)
        index = encode_index(state.index[j])
        shards.append(Shard(coords, buffers, index, int(state.length[j])))
    return shards
