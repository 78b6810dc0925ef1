"""CPU backend: NumPy tiling and zstd on a thread pool.

Work is split into tasks of whole tiles (one slice of one shard of one tile epoch); each task
copies its tiles out of the staging buffer (the lift/transpose, padding edge tiles with 0) and
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

    def __init__(self, layout, codec="zstd", level=1, threads: int | None = None):
        super().__init__(layout, codec, level)
        self.threads = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tileshard-cpu")
        self._local = threading.local()
        self._mask = layout.slot_mask
        self._regions = [
            [layout.tile_region(shard, within) for within in range(layout.tiles_per_shard_inner)]
            for shard in range(layout.inner_shard_count)
        ]

    def describe(self) -> str:
        return f"cpu ({self.threads} threads)"

    def _compressor(self):
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=self.level)
        return compressor

    def submit(self, staging, epochs):
        layout = self.layout
        batch = staging[: epochs * layout.epoch_bytes].view(layout.dtype)
        batch = batch.reshape((epochs, layout.epoch_rows) + layout.shape[1:])
        tiles_per_shard = layout.tiles_per_shard_inner
        # Enough tasks to keep every thread busy, never less than one tile each.
        pieces = max(1, min(tiles_per_shard, -(-4 * self.threads // (epochs * layout.inner_shard_count))))
        bounds = np.linspace(0, tiles_per_shard, pieces + 1).astype(int)
        futures = [
            [
                [self._pool.submit(self._encode_tiles, batch[e], shard, bounds[p], bounds[p + 1])
                 for p in range(pieces)]
                for shard in range(layout.inner_shard_count)
            ]
            for e in range(epochs)
        ]
        return futures

    def _encode_tiles(self, epoch_rows: np.ndarray, shard: int, start: int, stop: int):
        layout = self.layout
        compress = self._compressor().compress if self.codec == "zstd" else bytes
        chunks = []
        sizes = np.zeros(stop - start, dtype=np.uint64)
        for within in range(start, stop):
            if not self._mask[shard, within]:
                continue
            region = (slice(None),) + self._regions[shard][within]
            source = epoch_rows[region]
            if source.shape == layout.tile_shape:
                tile = np.ascontiguousarray(source)
            else:  # edge tile: pad with the fill value
                tile = np.zeros(layout.tile_shape, dtype=layout.dtype)
                tile[tuple(slice(0, n) for n in source.shape)] = source
            chunk = compress(memoryview(tile).cast("B"))
            chunks.append(chunk)
            sizes[within - start] = len(chunk)
        return chunks, sizes

    def result(self, ticket):
        epochs = []
        for per_shard in ticket:
            data, sizes = [], []
            for pieces in per_shard:
                results = [f.result() for f in pieces]
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
