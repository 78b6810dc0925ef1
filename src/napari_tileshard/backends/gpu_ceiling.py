"""Hardware ceilings for the benchmark, measured on the same tiles as the writer.

* ``nvcomp-ceiling``: nvCOMP batched zstd of device-resident tiles only (the same tile pool,
  batch size and compress stage, ``stages.compress.compress_gpu``, the GPU backend runs), timed
  with CUDA events.
* ``pcie-h2d``: pinned host-to-device copy of one batch.
"""

from __future__ import annotations

import numpy as np


def measure(camera, frames, layout, level, repeats: int = 5):
    import cupy

    from .gpu import GpuBackend
    from .stages.compress import compress_gpu

    backend = GpuBackend(layout, "zstd", level)
    batch_bytes = backend.preferred_batch_bytes
    staging = backend.allocate_staging(max(layout.epoch_bytes, batch_bytes // layout.epoch_bytes * layout.epoch_bytes))
    frames_per_batch = staging.nbytes // camera.frame_bytes
    view = staging[: frames_per_batch * camera.frame_bytes].reshape(frames_per_batch, -1)
    for i in range(frames_per_batch):
        view[i] = camera.frame(i).reshape(-1).view(np.uint8)
    epochs = staging.nbytes // layout.epoch_bytes
    slot = backend._slots[0]
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

    runtime = cupy.cuda.runtime
    mirror = backend._mirrors[staging.ctypes.data]
    h2d = timed(lambda: runtime.memcpyAsync(mirror.data.ptr, staging.ctypes.data, staging.nbytes,
                                            runtime.memcpyHostToDevice, stream.ptr))
    ticket = backend.submit(staging, epochs)  # tiles the batch into slot 0's pool
    backend.result(ticket)
    chunk_bytes = backend._geometry(epochs)[1]
    compress = timed(lambda: compress_gpu(backend.nvcomp, slot, chunk_bytes, layout.tile_bytes, chunks,
                                          backend._d_temp, backend._temp_size, stream))
    compressed = int(slot.d_sizes[:chunks].sum())
    backend.close()
    nbytes = epochs * layout.epoch_bytes
    return [
        {"engine": "nvcomp-ceiling", "label": f"nvCOMP zstd, {chunks} tiles per call", "seconds": compress,
         "gbps": nbytes / compress / 1e9, "ratio": nbytes / compressed, "bytes_in": nbytes},
        {"engine": "pcie-h2d", "label": "pinned H2D copy", "seconds": h2d, "gbps": staging.nbytes / h2d / 1e9,
         "bytes_in": staging.nbytes},
    ]
