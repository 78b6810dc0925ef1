"""Shard assembly: host-side accumulation of compressed tiles into shards and index encoding.

A shard on disk is the concatenated chunk bytes followed by the index: one
``(offset, nbytes)`` uint64 little-endian pair per chunk in row-major chunk order
(``2^64-1`` twice for a chunk that does not exist), then the CRC32C of those pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import crc32c
import numpy as np

from .layout import Layout

EMPTY = np.uint64(2**64 - 1)


def encode_index(index: np.ndarray) -> bytes:
    """Serialize an ``(chunks, 2)`` uint64 index and append its CRC32C."""
    raw = np.ascontiguousarray(index, dtype="<u8").tobytes()
    return raw + crc32c.crc32c(raw).to_bytes(4, "little")


def decode_index(tail: bytes, chunks: int) -> tuple[np.ndarray, bool]:
    """Parse the ``chunks * 16 + 4`` index bytes at the end of a shard; returns (index, crc_ok)."""
    raw, stored = tail[: chunks * 16], tail[chunks * 16 : chunks * 16 + 4]
    index = np.frombuffer(raw, dtype="<u8").reshape(chunks, 2)
    return index, crc32c.crc32c(raw) == int.from_bytes(stored, "little")


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

    @property
    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers) + len(self.index)


@dataclass
class _ShardEpochState:
    data: list[list] = field(default_factory=list)  # per inner shard: buffers
    length: np.ndarray | None = None  # per inner shard: bytes so far
    index: np.ndarray | None = None  # (inner shards, chunks per shard, 2)

    def copy(self) -> "_ShardEpochState":
        return _ShardEpochState([list(d) for d in self.data], self.length.copy(), self.index.copy())


class ShardAccumulator:
    """Collects tile epochs in order and hands out shards once their shard epoch is complete."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._shard_epoch = 0
        self._next_epoch = 0
        self._state = self._fresh_state()

    def _fresh_state(self) -> _ShardEpochState:
        inner = self.layout.inner_shard_count
        index = np.full((inner, self.layout.chunks_per_shard, 2), EMPTY, dtype=np.uint64)
        return _ShardEpochState([[] for _ in range(inner)], np.zeros(inner, dtype=np.uint64), index)

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

    def pending(self, provisional: list[EncodedEpoch] = ()) -> list[Shard]:
        """Every shard as it would be if the stream ended now, after the ``provisional`` epochs.

        Nothing is consumed: later epochs keep filling the same shards (``flush()``).
        """
        clone = ShardAccumulator.__new__(ShardAccumulator)
        clone.layout, clone._shard_epoch, clone._next_epoch = self.layout, self._shard_epoch, self._next_epoch
        clone._state = self._state.copy()
        shards = []
        for encoded in provisional:
            shards += clone.add(clone._next_epoch, encoded)
        return shards + clone.take_pending()

    def take_pending(self) -> list[Shard]:
        """Hand out the open shard epoch as final (end of the recording)."""
        return self._take() if self.has_pending else []

    def _take(self) -> list[Shard]:
        shards = _shards(self.layout, self._shard_epoch, self._state)
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


def _shards(layout: Layout, shard_epoch: int, state: _ShardEpochState) -> list[Shard]:
    shards = []
    for j, buffers in enumerate(state.data):
        if not buffers:
            continue
        coords = (shard_epoch,) + layout.inner_shard_coords(j)
        shards.append(Shard(coords, buffers, encode_index(state.index[j])))
    return shards
