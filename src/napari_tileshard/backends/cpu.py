"""CPU backend: NumPy tiling and zstd on a thread pool.

Work is split into one task per (tile epoch, shard): the task copies the shard's tiles out of
the staging buffer in one NumPy call (the lift/transpose, padding edge tiles with 0) and
compresses them with ``zstandard``, which releases the GIL, so tasks run truly in parallel.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import zstandard

from ..shard import EncodedEpoch
from .base import Backend


class CpuBackend(Backend):
    name = "cpu"
    preferred_batch_bytes = 64 << 20
    _MAX_BATCH_BYTES = 256 << 20

    def __init__(self, layout, codec="zstd", level=1, threads: int | None = None):
        super().__init__(layout, codec, level)
        self.threads = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tileshard-cpu")
        self._local = threading.local()
        self._mask = layout.slot_mask
        # Tasks per (epoch, shard [piece]): a few epochs per batch so every thread has work.
        epochs = -(-2 * self.threads // layout.inner_shard_count)
        self.preferred_batch_bytes = max(self.preferred_batch_bytes,
                                         min(self._MAX_BATCH_BYTES, epochs * layout.epoch_bytes))

    def describe(self) -> str:
        return f"cpu ({self.threads} threads)"

    def _compressor(self):
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=self.level)
        return compressor

    def submit(self, staging, epochs, host_ranges=None):
        layout = self.layout
        batch = staging[: epochs * layout.epoch_bytes].view(layout.dtype)
        batch = batch.reshape((epochs, layout.epoch_rows) + layout.shape[1:])
        # Split shards along w_1 when (epoch, shard) tasks alone would leave threads idle.
        tasks = epochs * layout.inner_shard_count
        tps_1 = layout.tiles_per_shard[1] if layout.rank > 1 else 1
        pieces = max(1, min(tps_1, -(-2 * self.threads // tasks)))
        bounds = np.linspace(0, tps_1, pieces + 1).astype(int)
        return [[[self._pool.submit(self._encode_tiles, batch[e], shard, slice(a, b))
                  for a, b in zip(bounds[:-1], bounds[1:])]
                 for shard in range(layout.inner_shard_count)]
                for e in range(epochs)]

    def _encode_tiles(self, epoch_rows: np.ndarray, shard: int, within_1: slice):
        """Lift/transpose these tiles of one shard (one NumPy copy), then compress each (GIL released)."""
        layout = self.layout
        tiles = layout.shard_tiles(epoch_rows, shard, within_1).view(np.uint8)
        rows = layout.tiles_per_shard[1] if layout.rank > 1 else 1
        piece_mask = self._mask[shard].reshape(rows, -1)[within_1]
        present = np.flatnonzero(piece_mask)  # the slots of `tiles`, in the same order
        sizes = np.zeros(piece_mask.size, dtype=np.uint64)
        if self.codec != "zstd":
            sizes[present] = layout.tile_bytes
            return [tiles], sizes
        compress = self._compressor().compress
        chunks = [compress(tile) for tile in tiles]
        sizes[present] = [len(c) for c in chunks]
        return chunks, sizes

    def result(self, ticket):
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
        futures = [f for per_shard in ticket for pieces in per_shard for f in pieces]
        if block:
            wait(futures)
            return True
        return all(f.done() for f in futures)

    def close(self):
        self._pool.shutdown(wait=True)
