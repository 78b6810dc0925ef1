"""Multiscale pyramid: which dims each level halves, the level layouts, and the NumPy reference.

Pure layout math plus the NumPy definition of a reduction step; the backends compute the same
levels from each uploaded batch (the GPU with a generated kernel, the CPU with :func:`reduce2`)
and tests compare both to :meth:`Pyramid.reference`.

Rules:

* level ``k`` halves (ceil) each of ``downsample_dims`` relative to level ``k-1``; by default the
  last two dims (y, x).  A dim already at size 1 stays 1.
* every level keeps level 0's tile shape (clipped to its size) and tiles per shard, so each level
  is tiled and sharded with the same rules and one tile epoch of level 0 maps to exactly one tile
  epoch of every level: a level's shards complete together with level 0's.
* the append dim (dim 0) may be reduced too: its tile size halves with each level, which keeps
  the one-to-one epoch mapping, so it is reduced only while that tile size is even.
* levels stop when the reduced non-append dims fit one tile, or at ``max_levels``.

Reductions over each block of 2 x ... x 2 elements that lie inside the array (edge blocks of
odd sizes, and the last partial block along the append dim, have fewer): ``mean`` (sum in
float64, divided by the count; integers rounded half to even), ``max``, ``min``, ``decimate``
(first element of the block).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from .layout import Layout

DOWNSAMPLE = ("mean", "max", "min", "decimate")


def check_method(method) -> str:
    if method not in DOWNSAMPLE:
        raise ValueError(f"downsample {method!r} is not one of {', '.join(DOWNSAMPLE)}")
    return method


@dataclass(frozen=True)
class Pyramid:
    """Level layouts (level 0 first) and per-level, per-dim reduction factors relative to level 0."""

    layouts: tuple[Layout, ...]
    factors: tuple[tuple[int, ...], ...]
    method: str = "mean"

    @classmethod
    def single(cls, layout: Layout) -> Pyramid:
        """No pyramid: level 0 only."""
        return cls((layout,), ((1,) * layout.rank,))

    @property
    def levels(self) -> int:
        return len(self.layouts)

    @property
    def tiles_per_epoch(self) -> int:
        """Tiles of one tile epoch over all levels (what one batch epoch gives the compressor)."""
        return sum(lay.tiles_per_epoch for lay in self.layouts)

    @property
    def slots_per_epoch(self) -> int:
        """Padded shard-major slots of one tile epoch over all levels."""
        return sum(lay.slots_per_epoch for lay in self.layouts)

    def step_axes(self, k: int) -> tuple[int, ...]:
        """Dims halved going from level ``k-1`` to level ``k``."""
        return tuple(d for d, (a, b) in enumerate(zip(self.factors[k - 1], self.factors[k])) if b != a)

    def level_rows(self, k: int, rows0: int) -> int:
        """Rows along the append dim of level ``k`` when level 0 has ``rows0``."""
        return -(-rows0 // self.factors[k][0])

    def reference(self, array: np.ndarray) -> list[np.ndarray]:
        """Every level of the level-0 ``array`` (rows along dim 0), computed with NumPy."""
        levels = [np.asarray(array)]
        for k in range(1, self.levels):
            levels.append(reduce2(levels[-1], self.step_axes(k), self.method))
        return levels


def plan_pyramid(
    layout: Layout, downsample: str = "mean", downsample_dims=None, max_levels: int | None = None
) -> Pyramid:
    """The levels of ``layout``: see the module docstring for the rules."""
    check_method(downsample)
    if max_levels is not None and (not isinstance(max_levels, int) or isinstance(max_levels, bool) or max_levels < 1):
        raise ValueError(f"max_levels must be a positive integer or None, got {max_levels!r}")
    names = layout.names
    if downsample_dims is None:
        if layout.rank < 3:
            raise ValueError(
                f"a pyramid over the two spatial dims needs at least 3 dims (append dim + y, x); "
                f"the layout has {layout.rank}: pass downsample_dims"
            )
        downsample_dims = names[-2:]
    if isinstance(downsample_dims, str):
        downsample_dims = [downsample_dims]
    axes = []
    for name in downsample_dims:
        if name not in names:
            raise ValueError(f"downsample dim {name!r} is not one of the layout's dims {list(names)}")
        axes.append(names.index(name))
    if not axes:
        raise ValueError("downsample_dims is empty: name at least one dim to reduce")
    if 0 in axes and layout.tile_shape[0] % 2:
        raise ValueError(
            f"reducing the append dim {names[0]!r} needs an even tile size along it (it halves per "
            f"level), got {layout.tile_shape[0]}"
        )
    inner = [d for d in axes if d > 0]
    layouts, factors = [layout], [(1,) * layout.rank]
    while max_levels is None or len(layouts) < max_levels:
        last = layouts[-1]
        if inner and all(last.shape[d] <= last.tile_shape[d] for d in inner):
            break  # the reduced dims fit one tile
        step = [d for d in inner if last.shape[d] > 1]
        if 0 in axes and last.tile_shape[0] % 2 == 0:
            step.insert(0, 0)
        if not step:
            break
        dims = list(last.dims)
        for d in step:
            dim = dims[d]
            if d == 0:
                dims[d] = replace(dim, size=-(-dim.size // 2), tile_size=dim.tile_size // 2)
            else:
                size = -(-dim.size // 2)
                dims[d] = replace(dim, size=size, tile_size=min(dim.tile_size, size))
        layouts.append(Layout(dims, layout.dtype))
        factors.append(tuple(f * (2 if d in step else 1) for d, f in enumerate(factors[-1])))
    return Pyramid(tuple(layouts), tuple(factors), downsample)


def reduce2(array: np.ndarray, axes, method: str, valid_rows: int | None = None) -> np.ndarray:
    """Halve (ceil) ``array`` along ``axes`` with ``method``: the NumPy definition of a level.

    ``valid_rows``: rows along axis 0 that hold data (the rest is padding of a partial epoch and
    is left out of the blocks it shares with real rows; blocks with no valid element are 0).
    Each block offset is visited as a strided view (same order as the GPU kernel, so float sums
    agree bit for bit), accumulated into an array of the reduced shape: no padded copy.
    """
    check_method(method)
    axes = tuple(sorted(axes))
    extent = list(array.shape)
    if valid_rows is not None and 0 in axes:
        extent[0] = max(0, min(valid_rows, array.shape[0]))
    out_shape = tuple(-(-s // 2) if d in axes else s for d, s in enumerate(array.shape))
    views = [
        array[tuple(slice(o, extent[d], 2) if d in axes else slice(None) for d, o in enumerate(offset))]
        for offset in block_offsets(array.ndim, axes)
    ]  # strided views, no copies
    if method == "decimate":
        result = np.zeros(out_shape, dtype=array.dtype)
        result[tuple(slice(0, n) for n in views[0].shape)] = views[0]
        return result
    if method == "mean":
        # Elements per block: a product of per-axis counts (2 inside, 1 at an odd edge, 0 past the extent).
        count = np.ones((1,) * array.ndim, dtype=np.int64)
        for d in axes:
            first = np.arange(out_shape[d]) * 2
            per_axis = (first < extent[d]).astype(np.int64) + (first + 1 < extent[d])
            count = count * per_axis.reshape([-1 if i == d else 1 for i in range(array.ndim)])
        exact = array.dtype.kind in "iu" and array.dtype.itemsize <= 4
        if exact:
            # Integer sums are exact in any order (int32 holds 256 sums of 16-bit values): add pairs
            # axis by axis, which reads memory in order, then divide in integers.
            accumulator = np.int32 if array.dtype.itemsize <= 2 else np.int64
            sums = _pairwise(array, axes, extent, np.add, accumulator)
            return _divide_half_to_even(sums, count, axes, extent).astype(array.dtype)
        sums = np.zeros(out_shape, dtype=np.float64)  # floats: the kernel's order, for identical rounding
        for view in views:
            sums[tuple(slice(0, n) for n in view.shape)] += view
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = sums / np.maximum(count, 1)
        if array.dtype.kind in "iu":
            mean = np.rint(mean)
        return np.where(count > 0, mean, 0).astype(array.dtype)
    return _pairwise(array, axes, extent, np.maximum if method == "max" else np.minimum, array.dtype)


def _pairwise(array: np.ndarray, axes, extent, combine, dtype) -> np.ndarray:
    """Combine element pairs along each reduced axis in turn (for max, min and integer sums, whose
    result does not depend on the order).  Elements past ``extent`` are left out; blocks with none
    inside stay 0."""
    result = array
    for d in axes:

        def along(start, a=result, d=d):
            return a[tuple(slice(start, extent[d], 2) if i == d else slice(None) for i in range(a.ndim))]

        even, odd = along(0), along(1)
        shape = list(result.shape)
        shape[d] = -(-result.shape[d] // 2)
        out = np.zeros(shape, dtype=dtype)
        out[tuple(slice(0, n) for n in even.shape)] = even
        target = out[tuple(slice(0, n) for n in odd.shape)]
        combine(target, odd, out=target)
        result = out
    return result


def _divide_half_to_even(sums: np.ndarray, count: np.ndarray, axes, extent) -> np.ndarray:
    """``rint(sums / count)`` in integer arithmetic, in place.

    Counts are powers of two (products of per-axis 1s and 2s), so with ``count = 2**shift``:
    ``(sums + 2**(shift-1) - 1 + ((sums >> shift) & 1)) >> shift`` rounds half to even (arithmetic
    shifts floor, so negative sums too); blocks of count 0 give 0.  Inside the array every block
    has ``2**len(axes)`` elements (scalar shift); only the slabs at odd edges or past the valid
    rows need the per-block count.
    """
    edges = [(d, extent[d] // 2) for d in axes if extent[d] // 2 < sums.shape[d]]
    edge_sums = [sums[_slab(sums.ndim, d, start)].copy() for d, start in edges]  # before the in-place pass
    shift = len(axes)
    result = sums
    parity = (result >> shift) & 1
    result += (1 << (shift - 1)) - 1
    result += parity
    result >>= shift
    for (d, start), edge in zip(edges, edge_sums):
        result[_slab(sums.ndim, d, start)] = _divide_by_counts(edge, count[_slab(count.ndim, d, start)])
    return result


def _slab(ndim: int, d: int, start: int) -> tuple:
    return tuple(slice(start, None) if i == d else slice(None) for i in range(ndim))


def _divide_by_counts(sums: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The rounding of :func:`_divide_half_to_even` with a per-block (broadcast) count."""
    safe = np.maximum(count, 1)
    shift = np.log2(safe).astype(sums.dtype)
    bias = np.maximum((safe >> 1) - 1, 0).astype(sums.dtype)
    result = sums >> shift
    result &= (shift > 0).astype(sums.dtype)
    result += sums
    result += bias
    result >>= shift
    if (count == 0).any():
        result *= count > 0
    return result


def block_offsets(rank: int, axes) -> list[tuple[int, ...]]:
    """The 2**len(axes) element offsets of one reduction block (first = the decimate pick)."""
    offsets = []
    for bits in itertools.product((0, 1), repeat=len(axes)):
        offset = [0] * rank
        for d, b in zip(axes, bits):
            offset[d] = b
        offsets.append(tuple(offset))
    return offsets


def level_fraction(pyramid: Pyramid) -> float:
    """Bytes of all levels per byte of level 0 (about 4/3 for a y/x pyramid)."""
    return sum(lay.epoch_elements for lay in pyramid.layouts) / pyramid.layouts[0].epoch_elements


__all__ = ["DOWNSAMPLE", "Pyramid", "plan_pyramid", "reduce2", "block_offsets", "level_fraction"]
