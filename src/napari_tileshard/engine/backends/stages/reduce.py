"""Reduce stage: the pyramid levels of a batch, each from the one before.

The reduction is defined once, in :func:`napari_tileshard.format.pyramid.reduce2` (rules in
``pyramid.py``); the CPU runs it (:func:`reduce_cpu`), the GPU runs a generated kernel that
visits each block in the same order (:func:`reduce_source`), so float means agree bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np

from ....format.pyramid import block_offsets, reduce2
from .tile import BLOCK

__all__ = ["reduce_cpu", "reduce_gpu", "reduce_kernel", "reduce_source"]

_C_TYPES = {
    "uint8": "unsigned char",
    "uint16": "unsigned short",
    "uint32": "unsigned int",
    "uint64": "unsigned long long",
    "int8": "signed char",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "float32": "float",
    "float64": "double",
    "float16": "unsigned short",
}  # float16: raw bits, converted with PTX cvt below

_HALF_HELPERS = r"""
__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short float_to_half(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
"""


def reduce_cpu(pyramid, batch: np.ndarray, epochs: int, rows: int | None = None) -> list[np.ndarray]:
    """Levels 1.. of ``batch`` (``epochs`` whole tile epochs of level 0), each a batch of its level.

    Epoch by epoch, which bounds the temporaries and keeps a reduction block inside one epoch
    (epochs share none); ``rows``: rows of level 0 that hold data (None: all).
    """
    epoch_rows = pyramid.layouts[0].epoch_rows
    rows = batch.shape[0] if rows is None else rows
    per_level: list[list[np.ndarray]] = [[] for _ in range(pyramid.levels - 1)]
    for e in range(epochs):
        piece = batch[e * epoch_rows : (e + 1) * epoch_rows]
        valid = min(epoch_rows, rows - e * epoch_rows)
        for k in range(1, pyramid.levels):
            piece = reduce2(piece, pyramid.step_axes(k), pyramid.method, valid_rows=pyramid.level_rows(k - 1, valid))
            per_level[k - 1].append(piece)
    return [np.concatenate(pieces) for pieces in per_level]


def reduce_source(source, target, axes, method: str) -> str:
    """CUDA source of one pyramid step from layout ``source`` to ``target`` over ``axes``.

    One thread per element of the reduced level; it visits the 2 x ... x 2 block of the finer
    level in :func:`pyramid.block_offsets` order, skipping elements outside the array or past the
    batch's valid rows, and writes the mean/max/min/first exactly as :func:`pyramid.reduce2`
    defines it.  Input elements are addressed with the batch strides of
    :meth:`Layout.lifted_strides` (the same numbers the tile kernel reads with).
    """
    dtype = source.dtype.name
    half = dtype == "float16"
    rank = source.rank
    value = (lambda v: f"half_to_float({v})") if half else (lambda v: v)
    lines = [
        _HALF_HELPERS if half else "",
        f"typedef {_C_TYPES[dtype]} T;",
        'extern "C" __global__ void reduce(const T* __restrict__ in, T* __restrict__ out,',
        "                                  long long out_elements, long long in_rows) {",
        "  long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "  if (o >= out_elements) return;",
        "  long long rest = o;",
    ]
    for d in range(rank - 1, 0, -1):
        lines.append(f"  long long c{d} = rest % {target.shape[d]}LL; rest /= {target.shape[d]}LL;")
    lines.append("  long long c0 = rest;")
    in_stride = source.lifted_strides().input_stride
    accumulate = {
        "mean": "sum += (double)({v}); ++count;",
        "max": "if (!count || {v} > best) best = {v}; ++count;",
        "min": "if (!count || {v} < best) best = {v}; ++count;",
        "decimate": "best = {v}; ++count;",
    }[method]
    lines.append("  double sum = 0.0; int count = 0; " + ("float" if half else "T") + " best = 0;")
    for offset in block_offsets(rank, axes)[:1] if method == "decimate" else block_offsets(rank, axes):
        coords = [f"(c{d} * 2 + {offset[d]})" if d in axes else f"c{d}" for d in range(rank)]
        inside = [f"{coords[0]} < in_rows"] + [
            f"{coords[d]} < {source.shape[d]}LL" for d in axes if d > 0 and offset[d]
        ]
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


@functools.lru_cache(maxsize=32)
def reduce_kernel(source, target, axes: tuple, method: str):
    """The compiled reduce kernel (CuPy ``RawKernel``) of one step, cached."""
    import cupy

    return cupy.RawKernel(reduce_source(source, target, axes, method), "reduce")


def reduce_gpu(kernel, source, target, elements: int, in_rows: int, stream) -> None:
    """Enqueue ``kernel`` on ``stream``: ``elements`` elements of the next level into ``target``;
    ``in_rows``: rows of ``source`` that hold data."""
    kernel((-(-elements // BLOCK),), (BLOCK,), (source, target, np.int64(elements), np.int64(in_rows)), stream=stream)
