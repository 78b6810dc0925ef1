"""CPU backend: NumPy tiling and compression on a thread pool.

Work is split into one task per (tile epoch, shard): the task copies the shard's tiles out of
the staging buffer in one NumPy call (the lift/transpose, padding edge tiles with 0) and
compresses them with the codec's CPU encoder (``zstandard``, Blosc), which releases the GIL, so
tasks run truly in parallel.
Pyramid levels are reduced from the batch with :func:`~napari_tileshard.pyramid.reduce2` (on a
reducer thread, while level 0 compresses) and encoded the same way.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from ..pyramid import reduce2
from ..shard import EncodedEpoch
from .base import Backend


class CpuBackend(Backend):
    name = "cpu"
    preferred_batch_bytes = 64 << 20
    _MAX_BATCH_BYTES = 256 << 20

    def __init__(self, layout, codec="zstd", level=1, threads: int | None = None, pyramid=None):
        super().__init__(layout, codec, level, pyramid)
        self.threads = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tileshard-cpu")
        # Reductions run on their own thread: an encode task never waits on a reduction queued
        # behind it in the same pool.
        self._reducer = ThreadPoolExecutor(1, thread_name_prefix="tileshard-reduce") if self.pyramid.levels > 1 else None
        # Tasks per (epoch, shard [piece]): a few epochs per batch so every thread has work.
        epochs = -(-2 * self.threads // layout.inner_shard_count)
        self.preferred_batch_bytes = max(self.preferred_batch_bytes,
                                         min(self._MAX_BATCH_BYTES, epochs * layout.epoch_bytes))

    def describe(self) -> str:
        return f"cpu ({self.threads} threads)"

    def submit(self, staging, epochs, host_ranges=None, rows=None):
        layout = self.layout
        batch = staging[: epochs * layout.epoch_bytes].view(layout.dtype)
        batch = batch.reshape((epochs * layout.epoch_rows,) + layout.shape[1:])
        ticket = [self._submit_level(layout, batch, epochs)]
        if self.pyramid.levels > 1:
            # Level k comes from level k-1: one chain on the reducer thread, each level's encode
            # tasks queued when it is ready.  The staging buffer stays busy until the chain ran.
            ticket.append(self._reducer.submit(self._reduce_levels, batch, epochs, rows))
        return ticket

    def _reduce_levels(self, batch, epochs, rows):
        """Reduce the batch epoch by epoch (bounded temporaries), then queue each level's tasks."""
        pyramid = self.pyramid
        epoch_rows = self.layout.epoch_rows
        rows = batch.shape[0] if rows is None else rows
        per_level = [[] for _ in range(pyramid.levels - 1)]
        for e in range(epochs):
            piece = batch[e * epoch_rows:(e + 1) * epoch_rows]
            valid = min(epoch_rows, rows - e * epoch_rows)  # epochs share no reduction block
            for k in range(1, pyramid.levels):
                piece = reduce2(piece, pyramid.step_axes(k), pyramid.method,
                                valid_rows=pyramid.level_rows(k - 1, valid))
                per_level[k - 1].append(piece)
        return [self._submit_level(pyramid.layouts[k], np.concatenate(per_level[k - 1]), epochs)
                for k in range(1, pyramid.levels)]

    def _submit_level(self, layout, batch, epochs):
        batch = batch.reshape((epochs, layout.epoch_rows) + layout.shape[1:])
        # Split shards along w_1 when (epoch, shard) tasks alone would leave threads idle.
        tasks = epochs * layout.inner_shard_count
        tps_1 = layout.tiles_per_shard[1] if layout.rank > 1 else 1
        pieces = max(1, min(tps_1, -(-2 * self.threads // tasks)))
        bounds = np.linspace(0, tps_1, pieces + 1).astype(int)
        return [[[self._pool.submit(self._encode_tiles, layout, batch[e], shard, slice(a, b))
                  for a, b in zip(bounds[:-1], bounds[1:])]
                 for shard in range(layout.inner_shard_count)]
                for e in range(epochs)]

    def _encode_tiles(self, layout, epoch_rows: np.ndarray, shard: int, within_1: slice):
        """Lift/transpose these tiles of one shard (one NumPy copy), then compress each (GIL released)."""
        tiles = layout.shard_tiles(epoch_rows, shard, within_1).view(np.uint8)
        rows = layout.tiles_per_shard[1] if layout.rank > 1 else 1
        piece_mask = layout.slot_mask[shard].reshape(rows, -1)[within_1]
        present = np.flatnonzero(piece_mask)  # the slots of `tiles`, in the same order
        sizes = np.zeros(piece_mask.size, dtype=np.uint64)
        chunks, sizes[present] = self.codec.encode_tiles(tiles)
        return chunks, sizes

    def result(self, ticket):
        levels = ticket[:1]
        if len(ticket) > 1:
            levels += ticket[1].result()
        return [self._level_result(level) for level in levels]

    @staticmethod
    def _level_result(ticket):
        epochs = []
        for per_shard in ticket:
            data, sizes = [], []
            for pieces in per_shard:
                results = [future.result() for future in pieces]
                data.append([chunk for chunks, _ in results for chunk in chunks])
                sizes.append(np.concatenate([s for _, s in results]))
            epochs.append(EncodedEpoch(data, np.stack(sizes)))
        return epochs

    def staging_free(self, ticket, block=True):
        # Level 0's encode tasks and the reduction chain read the staging buffer.
        futures = [f for per_shard in ticket[0] for pieces in per_shard for f in pieces] + ticket[1:]
        if block:
            wait(futures)
            return True
        return all(f.done() for f in futures)

    def close(self):
        if self._reducer is not None:
            self._reducer.shutdown(wait=True)
        self._pool.shutdown(wait=True)
