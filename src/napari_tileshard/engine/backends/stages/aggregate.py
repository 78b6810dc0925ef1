"""Aggregate stage: group a batch's compressed tiles by shard.

Tiles are placed in the *padded shard-major slot order* of :mod:`napari_tileshard.format.layout`
(``Layout.shard_permutation`` ``P``, ``Layout.slot_mask``): a slot with no tile (edge shards)
has size 0, so every shard's chunks are contiguous and its sizes are one row of
:class:`~napari_tileshard.engine.shards.EncodedEpoch`'s ``chunk_sizes``.

* CPU: each task already holds one shard's tiles in slot order; :func:`slot_sizes` puts their
  sizes into the shard's padded slots and :func:`aggregate_cpu` joins a shard's pieces.
* GPU: the design's three passes over the whole batch (every pyramid level): permute the sizes
  by ``P`` (``permute_sizes``), exclusive scan (``cupy.cumsum``), gather every chunk to its
  shard-major offset (``gather``) - :func:`aggregate_gpu`; the host then cuts the packed bytes
  into shards by the offsets (:func:`split_packed`).
"""

from __future__ import annotations

import functools

import numpy as np

from ...shards import EncodedEpoch
from .tile import BLOCK

__all__ = [
    "AGGREGATE_SOURCE",
    "aggregate_cpu",
    "aggregate_geometry",
    "aggregate_gpu",
    "aggregate_kernels",
    "slot_sizes",
    "split_packed",
]

AGGREGATE_SOURCE = r"""
extern "C" __global__ void permute_sizes(const unsigned long long* __restrict__ sizes,
                                         const long long* __restrict__ positions,
                                         unsigned long long* __restrict__ permuted, long long chunks) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < chunks) permuted[positions[i]] = sizes[i];
}

// One block per chunk: copy compressed bytes from its max-size slot to its packed offset.
extern "C" __global__ void gather(const unsigned char* __restrict__ compressed, long long slot_bytes,
                                  const unsigned long long* __restrict__ sizes,
                                  const long long* __restrict__ positions,
                                  const unsigned long long* __restrict__ offsets,
                                  unsigned char* __restrict__ packed) {
  long long chunk = blockIdx.x;
  const unsigned char* src = compressed + chunk * slot_bytes;
  unsigned char* dst = packed + offsets[positions[chunk]];
  unsigned long long size = sizes[chunk];
  // 16-byte loads from the (aligned) source, byte stores to the unaligned destination.
  unsigned long long whole = size / 16;
  const uint4* src16 = reinterpret_cast<const uint4*>(src);
  for (unsigned long long k = threadIdx.x; k < whole; k += blockDim.x) {
    uint4 v = src16[k];
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
    unsigned char* d = dst + k * 16;
    #pragma unroll
    for (int j = 0; j < 16; ++j) d[j] = b[j];
  }
  for (unsigned long long k = whole * 16 + threadIdx.x; k < size; k += blockDim.x) dst[k] = src[k];
}
"""
_GATHER_THREADS = 128


# -- CPU -------------------------------------------------------------------------------------
def slot_sizes(layout, shard: int, within_1: slice, sizes) -> np.ndarray:
    """``sizes`` of the tiles of a piece of inner shard ``shard`` (as :func:`.tile.tile_cpu` cut
    it), placed in the piece's padded slots (0 where the slot holds no tile)."""
    rows = layout.tiles_per_shard[1] if layout.rank > 1 else 1
    piece_mask = layout.slot_mask[shard].reshape(rows, -1)[within_1]
    padded = np.zeros(piece_mask.size, dtype=np.uint64)
    padded[np.flatnonzero(piece_mask)] = sizes  # the slots of the piece's tiles, in the same order
    return padded


def aggregate_cpu(results) -> list[EncodedEpoch]:
    """One level's epochs from ``results[epoch][shard][piece] = (chunks, padded sizes)``."""
    epochs = []
    for per_shard in results:
        data, sizes = [], []
        for pieces in per_shard:
            if len(pieces) == 1:  # the common case (small epochs): no copies, np.stack copies once
                chunks, padded = pieces[0]
                data.append(list(chunks))
                sizes.append(padded)
            else:
                data.append([chunk for chunks, _ in pieces for chunk in chunks])
                sizes.append(np.concatenate([s for _, s in pieces]))
        epochs.append(EncodedEpoch(data, np.stack(sizes)))
    return epochs


# -- GPU -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def aggregate_kernels():
    """The compiled ``permute_sizes`` and ``gather`` kernels."""
    import cupy

    module = cupy.RawModule(code=AGGREGATE_SOURCE)
    return module.get_function("permute_sizes"), module.get_function("gather")


def aggregate_geometry(pyramid, epochs: int, stream):
    """(shard-major position, uncompressed bytes) of every tile of a batch of ``epochs``, all levels.

    Level k's tiles follow level k-1's in the pool; its position is its level's entry base +
    e * slots_per_epoch + P[i] (pass 1's map).  Built on ``stream``.
    """
    import cupy

    # Built with NumPy and uploaded once: cupy.arange's first call imports cupyx (0.4 s of arming).
    positions, chunk_bytes, base = [], [], 0
    for lay in pyramid.layouts:
        perm = np.asarray(lay.shard_permutation, dtype=np.int64)
        positions.append(
            (base + np.arange(epochs, dtype=np.int64)[:, None] * lay.slots_per_epoch + perm[None, :]).reshape(-1)
        )
        chunk_bytes.append(np.full(epochs * lay.tiles_per_epoch, lay.tile_bytes, dtype=np.uint64))
        base += epochs * lay.slots_per_epoch
    with stream:
        return cupy.asarray(np.concatenate(positions)), cupy.asarray(np.concatenate(chunk_bytes))


def aggregate_gpu(kernels, slot, positions, chunks: int, entries: int, output_stride: int, stream) -> None:
    """Enqueue the three passes on ``stream``: ``slot.d_sizes``/``d_compressed`` to
    ``slot.d_offsets`` (``entries + 1``, exclusive scan) and ``slot.d_packed``."""
    import cupy

    permute, gather = kernels
    with stream:
        slot.d_permuted[:entries] = 0
        permute((-(-chunks // BLOCK),), (BLOCK,), (slot.d_sizes, positions, slot.d_permuted, np.int64(chunks)))
        cupy.cumsum(slot.d_permuted[:entries], out=slot.d_offsets[1 : entries + 1])
        gather(
            (chunks,),
            (_GATHER_THREADS,),
            (slot.d_compressed, np.int64(output_stride), slot.d_sizes, positions, slot.d_offsets, slot.d_packed),
        )


def split_packed(pyramid, epochs: int, offsets: np.ndarray, packed: np.ndarray) -> list[list[EncodedEpoch]]:
    """Per level, the epochs of a batch as views into ``packed`` (host), cut at ``offsets``
    (``epochs * pyramid.slots_per_epoch + 1`` shard-major slot offsets)."""
    levels, base = [], 0
    for lay in pyramid.layouts:
        per_epoch = lay.slots_per_epoch
        level_offsets = offsets[base : base + epochs * per_epoch + 1]
        shard_starts = np.arange(0, per_epoch + 1, lay.tiles_per_shard_inner)
        sizes = np.diff(level_offsets).reshape(epochs, lay.inner_shard_count, lay.tiles_per_shard_inner)
        encoded = []
        for e in range(epochs):
            bounds = level_offsets[e * per_epoch + shard_starts]
            data = [packed[int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:])]
            encoded.append(EncodedEpoch(data, sizes[e]))
        levels.append(encoded)
        base += epochs * per_epoch
    return levels
