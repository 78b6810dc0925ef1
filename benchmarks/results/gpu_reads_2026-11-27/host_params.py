"""Host time of the GPU read path's per-block un-tiling parameters for a whole-array read, with
whichever ``block_params`` the source tree on ``PYTHONPATH`` has (the code before: one call per
block, plus ``batch_rows``; now: every block in one call).  NumPy only, no GPU needed.

    PYTHONPATH=<src> python benchmarks/results/gpu_reads_2026-11-27/host_params.py 64k-4m.zarr 1m-16m.zarr
"""

import inspect
import sys
import time

from napari_tileshard import ShardReader
from napari_tileshard.reader import gpu

for path in sys.argv[1:]:
    reader = ShardReader(path, backend="cpu")
    plan = reader.plan(...)
    _, _, dim_offset = gpu.untile_tables(plan)
    per_block = "block" in inspect.signature(gpu.block_params).parameters
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        if per_block:  # the code before: what _decode_and_place called per batch, for every block
            for block in plan.blocks:
                gpu.block_params(plan, block, reader.chunk_shape, dim_offset)
            for batch in gpu.plan_batches(plan, reader.chunk_bytes, 1 << 62, 1 << 62):
                gpu.batch_rows(plan, batch)
        else:
            gpu.block_params(plan, reader.chunk_shape, dim_offset)
        best = min(best, time.perf_counter() - started)
    kind = "one call per block" if per_block else "all blocks in one call"
    print(f"{path}: {len(plan.blocks)} blocks, {kind}: {best * 1e3:.1f} ms (best of 5)")
