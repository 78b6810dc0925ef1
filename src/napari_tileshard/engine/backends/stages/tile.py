"""Tile stage: lift/transpose whole tile epochs into tiles, edge tiles padded with 0.

The lift's numbers live in :func:`napari_tileshard.format.layout.lifted_strides` and nowhere else:

* CPU: :func:`tile_cpu` is :meth:`Layout.shard_tiles`, which evaluates the lifted strides of one
  shard's block with NumPy (:meth:`LiftedStrides.scatter`, one strided copy).
* GPU: :func:`tile_source` generates a CUDA kernel from :meth:`Layout.lifted_strides` with its
  extents and strides baked in as constants (so the divisions compile to multiplications);
  :func:`tile_gpu` launches it.

Both are tested against :meth:`Layout.tile_pool_reference` (``tests/format/test_layout.py``,
``tests/engine/test_gpu.py``), and ``tests/engine/test_stages.py`` pins the generated source.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["BLOCK", "tile_cpu", "tile_gpu", "tile_kernel", "tile_source"]

#: CUDA type moving one element (the tile kernel copies bits, so only the size matters)
_ELEMENT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
BLOCK = 256


def tile_cpu(
    layout,
    epoch_rows: np.ndarray,
    shard: int,
    within: slice | tuple[slice, ...] = slice(None),
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The tiles that exist in inner shard ``shard`` of one tile epoch (``within``: a range of its
    tile rows ``w_1``, or a box of :meth:`Layout.shard_boxes`), one tile per row of uint8, in
    within-shard row-major order; written to ``out`` (a reusable 1-D buffer large enough) when given."""
    return layout.shard_tiles(epoch_rows, shard, within, out).view(np.uint8)


def tile_source(layout, tile_stride: int) -> str:
    """CUDA source of the tile kernel of ``layout`` with tiles ``tile_stride`` elements apart.

    One thread per element of the tile-major pool: it unravels its pool index into (tile,
    in-tile) coordinates by the lift's extents (the pool is row-major in them, which is what
    ``element_stride``/``tile_stride`` say), rebuilds the batch coordinate ``t_d * n_d + n_d``
    and reads it through ``input_stride``, or writes the fill value where the tile overhangs the
    array.  Driving the kernel from the output means every pool element is written (edge
    padding and slot padding included) without a separate memset.
    """
    lift = layout.lifted_strides(tile_stride)
    rank = lift.rank
    stride = lift.tile_elements_stride
    lines = [
        f"typedef {_ELEMENT_TYPES[layout.itemsize]} T;",
        'extern "C" __global__ void tile(const T* __restrict__ input, T* __restrict__ pool, long long pool_elements) {',
        "  long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "  if (o >= pool_elements) return;",
        f"  long long tile = o / {stride}LL;",
        f"  long long within = o - tile * {stride}LL;",
        f"  if (within >= {lift.tile_elements}LL) {{ pool[o] = 0; return; }}",
        "  long long in = 0; bool outside = false; long long c, n, t;",
    ]
    for d in range(rank - 1, -1, -1):  # fastest dim first
        n_d = lift.tile_shape[d]
        lines.append(f"  n = within % {n_d}LL; within /= {n_d}LL;")
        if d > 0:
            lines.append(f"  t = tile % {lift.tile_count[d]}LL; tile /= {lift.tile_count[d]}LL;")
            lines.append(f"  c = t * {n_d}LL + n; outside |= c >= {lift.shape[d]}LL;")
        else:
            lines.append(f"  c = tile * {n_d}LL + n;")  # tile is now the epoch index within the batch
        lines.append(f"  in += c * {lift.input_stride[d]}LL;")
    lines += ["  pool[o] = outside ? (T)0 : input[in];", "}"]
    return "\n".join(lines)


@functools.lru_cache(maxsize=32)
def tile_kernel(layout, tile_stride: int):
    """The compiled tile kernel (CuPy ``RawKernel``), cached per layout and stride."""
    import cupy

    return cupy.RawKernel(tile_source(layout, tile_stride), "tile")


def tile_gpu(kernel, source, pool, pool_elements: int, stream) -> None:
    """Enqueue ``kernel`` on ``stream``: ``pool_elements`` pool elements from the batch ``source``."""
    kernel((-(-pool_elements // BLOCK),), (BLOCK,), (source, pool, np.int64(pool_elements)), stream=stream)
