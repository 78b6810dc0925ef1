"""CUDA kernels of the GPU backend (CuPy RawKernels), generated per layout.

* ``tile``: the lift/transpose.  One thread per element of the tile-major pool; it unravels
  its pool index into (tile, in-tile) coordinates, evaluates the lifted strides of
  :meth:`Layout.lifted_strides` backwards to find its input element and copies it, or writes
  the fill value where the tile overhangs the array.  Driving the kernel from the output
  means every pool byte is written (edge padding included) without a separate memset.
* ``permute_sizes``: pass 1 of the aggregation: ``sizes[P[i]] = compressed_bytes[i]``.
* ``gather``: pass 3: copy each compressed chunk to its shard-major offset (the exclusive scan
  of pass 2 is ``cupy.cumsum``).
* ``reduce``: one pyramid step.  One thread per element of the reduced level; it visits the
  2 x ... x 2 block of the finer level (offsets from :func:`pyramid.block_offsets`), skipping
  elements outside the array or past the batch's valid rows, and writes the mean/max/min/first
  exactly as :func:`pyramid.reduce2` defines it.

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


_C_TYPES = {"uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int",
            "uint64": "unsigned long long", "int8": "signed char", "int16": "short", "int32": "int",
            "int64": "long long", "float32": "float", "float64": "double",
            "float16": "unsigned short"}  # float16: raw bits, converted with PTX cvt below

_HALF_HELPERS = r"""
__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short float_to_half(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
"""


def reduce_source(source, target, axes, method: str) -> str:
    """CUDA source of one pyramid step from layout ``source`` to ``target`` over ``axes``."""
    from ..pyramid import block_offsets

    dtype = source.dtype.name
    half = dtype == "float16"
    rank = source.rank
    value = (lambda v: f"half_to_float({v})") if half else (lambda v: v)
    lines = [_HALF_HELPERS if half else "", f"typedef {_C_TYPES[dtype]} T;",
             'extern "C" __global__ void reduce(const T* __restrict__ in, T* __restrict__ out,',
             "                                  long long out_elements, long long in_rows) {",
             "  long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
             "  if (o >= out_elements) return;",
             "  long long rest = o;"]
    for d in range(rank - 1, 0, -1):
        lines.append(f"  long long c{d} = rest % {target.shape[d]}LL; rest /= {target.shape[d]}LL;")
    lines.append("  long long c0 = rest;")
    in_stride = [1] * rank
    for d in range(rank - 2, -1, -1):
        in_stride[d] = in_stride[d + 1] * source.shape[d + 1]
    accumulate = {"mean": "sum += (double)({v}); ++count;",
                  "max": "if (!count || {v} > best) best = {v}; ++count;",
                  "min": "if (!count || {v} < best) best = {v}; ++count;",
                  "decimate": "best = {v}; ++count;"}[method]
    lines.append("  double sum = 0.0; int count = 0; " + ("float" if half else "T") + " best = 0;")
    for offset in (block_offsets(rank, axes)[:1] if method == "decimate" else block_offsets(rank, axes)):
        coords = [f"(c{d} * 2 + {offset[d]})" if d in axes else f"c{d}" for d in range(rank)]
        inside = [f"{coords[0]} < in_rows"] + [f"{coords[d]} < {source.shape[d]}LL"
                                               for d in axes if d > 0 and offset[d]]
        index = " + ".join(f"{c} * {in_stride[d]}LL" for d, c in enumerate(coords))
        lines.append(f"  if ({' && '.join(inside)}) {{ {accumulate.format(v=value(f'in[{index}]'))} }}")
    if method == "mean":
        if source.dtype.kind in "iu":
            result = "(T)rint(sum / count)"  # rint: round half to even, like np.rint
        elif half:
            result = "float_to_half((float)(sum / count))"
        else:
            result = "(T)(sum / count)"
    else:
        result = "float_to_half(best)" if half else "best"
    lines += [f"  out[o] = count ? {result} : (T)0;", "}"]
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


@functools.lru_cache(maxsize=32)
def reduce_kernel(source, target, axes: tuple, method: str):
    import cupy

    return cupy.RawKernel(reduce_source(source, target, axes, method), "reduce")


@functools.lru_cache(maxsize=1)
def aggregate_kernels():
    import cupy

    module = cupy.RawModule(code=AGGREGATE_SOURCE)
    return module.get_function("permute_sizes"), module.get_function("gather")
