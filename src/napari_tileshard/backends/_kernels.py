"""CUDA kernels of the GPU backend (CuPy RawKernels), generated per layout.

* ``tile``: the lift/transpose.  One thread per element of the tile-major pool; it unravels
  its pool index into (tile, in-tile) coordinates, evaluates the lifted strides of
  :meth:`Layout.lifted_strides` backwards to find its input element and copies it, or writes
  the fill value where the tile overhangs the array.  Driving the kernel from the output
  means every pool byte is written (edge padding included) without a separate memset.
* ``permute_sizes``: pass 1 of the aggregation: ``sizes[P[i]] = compressed_bytes[i]``.
* ``gather``: pass 3: copy each compressed chunk to its shard-major offset (the exclusive scan
  of pass 2 is ``cupy.cumsum``).

Sizes are baked in as constants so the divisions compile to multiplications.
"""

from __future__ import annotations

import functools

_ELEMENT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def tile_source(layout, tile_stride: int) -> str:
    strides = layout.lifted_strides(tile_stride)
    rank = layout.rank
    lines = [
        f"typedef {_ELEMENT_TYPES[layout.itemsize]} T;",
        'extern "C" __global__ void tile(const T* __restrict__ input, T* __restrict__ pool, long long pool_elements) {',
        "  long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "  if (o >= pool_elements) return;",
        f"  long long tile = o / {tile_stride}LL;",
        f"  long long within = o - tile * {tile_stride}LL;",
        f"  if (within >= {layout.tile_elements}LL) {{ pool[o] = 0; return; }}",
        "  long long in = 0; bool outside = false; long long c, n, t;",
    ]
    # Row-major input strides of a batch (k * tile_size[0], size[1:]).
    input_stride = [1] * rank
    for d in range(rank - 2, -1, -1):
        input_stride[d] = input_stride[d + 1] * layout.shape[d + 1]
    for d in range(rank - 1, -1, -1):  # fastest dim first
        n_d = layout.tile_shape[d]
        lines.append(f"  n = within % {n_d}LL; within /= {n_d}LL;")
        if d > 0:
            lines.append(f"  t = tile % {layout.tile_count[d]}LL; tile /= {layout.tile_count[d]}LL;")
            lines.append(f"  c = t * {n_d}LL + n; outside |= c >= {layout.shape[d]}LL;")
        else:
            lines.append(f"  c = tile * {n_d}LL + n;")  # tile is now the epoch index within the batch
        lines.append(f"  in += c * {input_stride[d]}LL;")
    lines += ["  pool[o] = outside ? (T)0 : input[in];", "}"]
    del strides  # the strides above are the same numbers, unrolled (see Layout.lifted_strides)
    return "\n".join(lines)


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


@functools.lru_cache(maxsize=32)
def tile_kernel(layout, tile_stride: int):
    import cupy

    return cupy.RawKernel(tile_source(layout, tile_stride), "tile")


@functools.lru_cache(maxsize=1)
def aggregate_kernels():
    import cupy

    module = cupy.RawModule(code=AGGREGATE_SOURCE)
    return module.get_function("permute_sizes"), module.get_function("gather")
