"""The CPU backend's physical limit: libzstd's rate on a recording's tiles.

:func:`zstd_ceiling`: libzstd level-N on the same tiles, one thread (python-zstandard's
``multi_compress_to_buffer``, ``threads=1``, from tiles already contiguous in memory: the codec
alone), times the cores: no writer of this codec can beat it on this machine.  Shared by
``bench_write.py`` (its ceiling column) and ``cpu_stages.py`` (the stage table).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import zstandard


def contiguous_tiles(camera, frames: int, tile) -> np.ndarray:
    """The tiles of ``frames`` frames, one per row of uint8 (frames that fill whole tiles only)."""
    tz, ty, tx = tile
    h, w = camera.shape
    stack = np.stack([f for f in camera.frames(frames // tz * tz)])
    lifted = stack.reshape(-1, tz, h // ty, ty, w // tx, tx).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(lifted).reshape(-1, tz * ty * tx).view(np.uint8)  # one tile a row


def zstd_ceiling(camera, tile, level: int, cores: int | None = None, sample_bytes: int = 256 << 20) -> dict:
    """Single-thread libzstd rate on the tiles of ``camera``'s frames (best of 3), and x cores."""
    cores = cores or os.cpu_count() or 1
    frames = max(tile[0], sample_bytes // camera.frame_bytes)
    tiles = contiguous_tiles(camera, frames, tile)
    count, nbytes = tiles.shape
    segments = np.empty((count, 2), dtype=np.uint64)
    segments[:, 0] = np.arange(count, dtype=np.uint64) * np.uint64(nbytes)
    segments[:, 1] = nbytes
    compressor = zstandard.ZstdCompressor(level=level)
    best = math.inf
    for _ in range(3):
        start = time.thread_time()
        compressor.multi_compress_to_buffer(zstandard.BufferWithSegments(tiles, segments.tobytes()), threads=1)
        best = min(best, time.thread_time() - start)
    per_thread = tiles.nbytes / best / 1e9
    return {"zstd_1thread_gbps": per_thread, "zstd_cpu_s_per_gb": 1 / per_thread, "ceiling_gbps": per_thread * cores}
