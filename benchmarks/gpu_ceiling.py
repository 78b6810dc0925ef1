"""Hardware ceilings for bench_write.py, measured on the same tiles as the writer.

* ``nvcomp-ceiling``: the GPU backend's compress stage alone (nvCOMP, every tile of one batch in
  one call, the same tile pool, batch size and temporary buffer as a recording), timed with CUDA
  events.
* ``pcie-h2d``: the pinned host-to-device copy of one batch, as ``submit`` uploads it.

Only the GPU backend's public benchmark hooks are used (``upload_async``, ``compress_async``,
``compressed_bytes``), so the numbers follow the backend's real buffers and stages.
"""

from __future__ import annotations

import numpy as np


def measure(camera, frames, layout, level, repeats: int = 5, batch_bytes: int | None = None):
    import cupy

    from napari_tileshard.engine.backends.gpu import GpuBackend

    backend = GpuBackend(layout, "zstd", level, batch_bytes=batch_bytes)
    batch_bytes = backend.preferred_batch_bytes
    staging = backend.allocate_staging(max(layout.epoch_bytes, batch_bytes // layout.epoch_bytes * layout.epoch_bytes))
    frames_per_batch = staging.nbytes // camera.frame_bytes
    view = staging[: frames_per_batch * camera.frame_bytes].reshape(frames_per_batch, -1)
    for i in range(frames_per_batch):
        view[i] = camera.frame(i).reshape(-1).view(np.uint8)
    epochs = staging.nbytes // layout.epoch_bytes
    chunks = epochs * layout.tiles_per_epoch
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    stream = backend.compute_stream

    def timed(launch):
        launch()  # warm up
        times = []
        for _ in range(repeats):
            start.record(stream)
            launch()
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(times))

    try:
        h2d = timed(lambda: backend.upload_async(staging, stream))
        ticket = backend.submit(staging, epochs)  # tiles the batch into the pool compress_async reads
        backend.result(ticket)
        compress = timed(lambda: backend.compress_async(ticket, stream))
        compressed = backend.compressed_bytes(ticket)
    finally:
        backend.close()
    nbytes = epochs * layout.epoch_bytes
    return [
        {
            "engine": "nvcomp-ceiling",
            "label": f"nvCOMP zstd, {chunks} tiles per call",
            "seconds": compress,
            "gbps": nbytes / compress / 1e9,
            "ratio": nbytes / compressed,
            "bytes_in": nbytes,
        },
        {
            "engine": "pcie-h2d",
            "label": "pinned H2D copy",
            "seconds": h2d,
            "gbps": staging.nbytes / h2d / 1e9,
            "bytes_in": staging.nbytes,
        },
    ]
