"""Layout math of the design: tiles, shards, epochs, lifted strides, shard permutation.

Pure functions of the layout, no I/O.  Every other module (the NumPy backend, the
CUDA kernels, the shard accumulator, the metadata) takes its geometry from here.

The lift of a batch into tiles lives here once, as numbers: :func:`lifted_strides`
(:class:`LiftedStrides`).  The CPU tile stage evaluates them with NumPy
(:meth:`LiftedStrides.scatter`, through :meth:`Layout.shard_tiles`) and the GPU tile stage
bakes them into its generated CUDA kernel (``backends/stages/tile.py``); both are tested
against :meth:`Layout.tile_pool_reference`, which is written independently (reshape/transpose).

Vocabulary (``sharding-layer.md``), for an array of rank ``D`` with dims ``0..D-1``
(slowest to fastest):

* ``tile_count[d] = ceil(size[d] / tile_size[d])``
* ``shard_count[d] = ceil(tile_count[d] / tiles_per_shard[d])``
* a *tile epoch* is one tile along dim 0: ``tile_size[0]`` rows of ``size[1:]``;
* a *shard epoch* is ``tiles_per_shard[0]`` tile epochs: when it is complete, the
  ``inner_shard_count`` shards that share the same dim-0 shard coordinate are final;
* within a tile epoch, tiles are kept in the *padded shard-major slot order*:
  ``(s_1, ..., s_{D-1}, w_1, ..., w_{D-1})`` raveled against
  ``(shard_count[1:], tiles_per_shard[1:])`` where ``t_d = s_d * tiles_per_shard[d] + w_d``.
  Slots whose tile lies outside the array (edge shards) exist in this order but hold
  no tile; ``slot_mask`` says which slots are real.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from . import codecs

__all__ = [
    "AXIS_KINDS",
    "DEFAULT_FRAME_TILE",
    "DEFAULT_FRAME_TILES_PER_SHARD",
    "DEFAULT_NAMES",
    "DEFAULT_SHARD_BYTES",
    "DEFAULT_SHARD_EPOCH_BYTES",
    "DEFAULT_TILE_BYTES",
    "Dim",
    "Layout",
    "LiftedStrides",
    "MAX_CHUNKS_PER_SHARD",
    "MAX_DIM_SIZE",
    "MAX_FILES_PER_GB",
    "MAX_RANK",
    "MIN_CHUNK_BYTES",
    "SPACE_UNITS",
    "SUPPORTED_DTYPES",
    "TIME_UNITS",
    "TilingWarning",
    "is_valid_name",
    "lifted_strides",
    "normalize_unit",
]

MAX_RANK = 8
SUPPORTED_DTYPES = (
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
)
_MAX_TILES_PER_EPOCH = 1 << 24
#: largest dimension size: tensorstore's largest finite index + 1 (larger arrays it cannot open)
MAX_DIM_SIZE = (1 << 62) - 1
#: chunks in one shard: its index (16 bytes a chunk) is written whole with every shard, so a
#: huge shard grid turns a few small frames into megabytes of index on disk
MAX_CHUNKS_PER_SHARD = 1 << 16
_MAX_EPOCH_BYTES = 1 << 40
AXIS_KINDS = ("time", "channel", "space", "other")
_DEFAULT_KINDS = {
    "t": "time",
    "time": "time",
    "c": "channel",
    "ch": "channel",
    "channel": "channel",
    "z": "space",
    "y": "space",
    "x": "space",
}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")

#: The units OME-Zarr (NGFF 0.4 and 0.5, ``axes`` -> ``unit``) names for a space axis: UDUNITS-2 names.
SPACE_UNITS = (
    "angstrom",
    "attometer",
    "centimeter",
    "decimeter",
    "exameter",
    "femtometer",
    "foot",
    "gigameter",
    "hectometer",
    "inch",
    "kilometer",
    "megameter",
    "meter",
    "micrometer",
    "mile",
    "millimeter",
    "nanometer",
    "parsec",
    "petameter",
    "picometer",
    "terameter",
    "yard",
    "yoctometer",
    "yottameter",
    "zeptometer",
    "zettameter",
)
#: ... and for a time axis.
TIME_UNITS = (
    "attosecond",
    "centisecond",
    "day",
    "decisecond",
    "exasecond",
    "femtosecond",
    "gigasecond",
    "hectosecond",
    "hour",
    "kilosecond",
    "megasecond",
    "microsecond",
    "millisecond",
    "minute",
    "nanosecond",
    "petasecond",
    "picosecond",
    "second",
    "terasecond",
    "yoctosecond",
    "yottasecond",
    "zeptosecond",
    "zettasecond",
)
_SI_PREFIXES = {
    "atto": "a",
    "centi": "c",
    "deci": "d",
    "exa": "E",
    "femto": "f",
    "giga": "G",
    "hecto": "h",
    "kilo": "k",
    "mega": "M",
    "micro": "µ",
    "milli": "m",
    "nano": "n",
    "peta": "P",
    "pico": "p",
    "tera": "T",
    "yocto": "y",
    "yotta": "Y",
    "zepto": "z",
    "zetta": "Z",
    "": "",
}


def _symbols(names, base: str, symbol: str, extra: dict) -> dict:
    """SI symbols (case-sensitive: ``Mm`` is not ``mm``) of the prefixed ``base`` units in
    ``names``, with ``u`` and Greek mu as well as the micro sign, plus ``extra``."""
    table = {}
    for name in names:
        prefix = name[: -len(base)] if name.endswith(base) else None
        if prefix in _SI_PREFIXES:
            table[_SI_PREFIXES[prefix] + symbol] = name
    for micro in ("u", "\u03bc"):
        table[micro + symbol] = "micro" + base
    return {**table, **extra}


_UNIT_SYMBOLS = {
    "space": _symbols(
        SPACE_UNITS,
        "meter",
        "m",
        {"\u00c5": "angstrom", "\u212b": "angstrom", "ft": "foot", "in": "inch", "yd": "yard", "mi": "mile"}
        | {"pc": "parsec"},
    ),
    "time": _symbols(
        TIME_UNITS, "second", "s", {"sec": "second", "min": "minute", "h": "hour", "hr": "hour", "d": "day"}
    ),
}
_UNIT_WORDS = {  # spellings matched without regard to case (after a plural "s" is dropped)
    "space": {"micron": "micrometer", "feet": "foot", "inche": "inch"},
    "time": {"sec": "second", "msec": "millisecond", "usec": "microsecond", "hr": "hour", "min": "minute"},
}
_NO_UNIT = ("pixel", "pixels", "px", "pix", "frame", "frames")


def normalize_unit(unit: str, axis_kind: str) -> str:
    """The OME-Zarr unit name for ``unit`` on an axis of ``axis_kind`` (``"space"``, ``"time"``).

    Accepted: the spec's names (:data:`SPACE_UNITS`, :data:`TIME_UNITS`); the same without regard
    to case, in the plural or with British "-metre" (``Micrometers``, ``micrometre``); SI symbols,
    case-sensitive (``um``, ``µm``, ``μm``, ``nm``, ``mm``, ``Å``, ``s``, ``ms``, ``us``, ``min``,
    ``h``, ...) and ``micron``, ``sec``, ``msec``.  Anything else is a ValueError naming the
    value and the nearest spec name.
    """
    import difflib

    names = SPACE_UNITS if axis_kind == "space" else TIME_UNITS
    other_kind, other_names = ("time", TIME_UNITS) if axis_kind == "space" else ("space", SPACE_UNITS)
    example = "micrometer" if axis_kind == "space" else "second"
    text = unit.strip()
    found = _lookup(text, axis_kind, names)
    if found:
        return found
    other = _lookup(text, other_kind, other_names)
    if other:
        raise ValueError(
            f"unit {unit!r} is a {other_kind} unit ({other!r}), not one of a {axis_kind} axis: use a {axis_kind} "
            f"unit such as {example!r}, or give the dimension kind={other_kind!r}"
        )
    if text.lower() in _NO_UNIT:
        raise ValueError(
            f"unit {unit!r} is not a physical unit: leave the unit out (None) for a {axis_kind} axis "
            "counted in pixels or frames"
        )
    candidates = {**{n: n for n in names}, **_UNIT_SYMBOLS[axis_kind], **_UNIT_WORDS[axis_kind]}
    close = difflib.get_close_matches(text, candidates, n=1, cutoff=0.6) or difflib.get_close_matches(
        text.lower(), candidates, n=1, cutoff=0.6
    )
    symbols = "um, nm, mm" if axis_kind == "space" else "s, ms, us, min, h"
    if close:
        hint = f"did you mean {candidates[close[0]]!r}? (OME-Zarr's names, or a symbol: {symbols})"
    else:
        hint = f"use one of {', '.join(names)} (or a symbol: {symbols})"
    raise ValueError(f"unit {unit!r} is not an OME-Zarr {axis_kind} unit: {hint}")


def _lookup(text: str, axis_kind: str, names) -> str | None:
    if text in names:
        return text
    symbol = _UNIT_SYMBOLS[axis_kind].get(text)
    if symbol:
        return symbol
    word = text.lower().replace("metre", "meter")
    for candidate in (word, word[:-1] if word.endswith("s") else word):
        if candidate in names:
            return candidate
        if candidate in _UNIT_WORDS[axis_kind]:
            return _UNIT_WORDS[axis_kind][candidate]
    return None


def is_valid_name(name) -> bool:
    """A dimension name that is safe as a key and a path component (no separators, no ``..``)."""
    return isinstance(name, str) and bool(_NAME_RE.match(name))


def _shape_text(shape) -> str:
    return "x".join(str(n) for n in shape)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _checked_count(name: str, field: str, value) -> int:
    """``value`` of ``field`` (size, tile_size, tiles_per_shard) of dimension ``name``, checked: the
    one check of these numbers, whether they come from a :class:`Dim`, :meth:`Layout.default_for`
    or an entry point's options (TypeError/ValueError naming the dimension and the value)."""
    if not _is_int(value):
        raise TypeError(f"dimension {name!r}: {field} must be an integer, got {value!r}")
    value = int(value)
    smallest = 0 if field == "size" else 1
    if value < smallest:
        unbounded = " (0 = unbounded)" if field == "size" else ""
        raise ValueError(f"dimension {name!r}: {field} must be >= {smallest}{unbounded}, got {value}")
    if value > MAX_DIM_SIZE:
        raise ValueError(
            f"dimension {name!r}: {field} {value} is larger than {MAX_DIM_SIZE} (2^62 - 1), the largest "
            "that Zarr readers such as tensorstore open"
        )
    return value


@dataclass(frozen=True)
class Dim:
    """One array dimension: its extent, tile extent and how many tiles make a shard.

    ``size=0`` marks the unbounded append dimension (allowed for dim 0 only).  ``kind``,
    ``unit`` and ``scale`` (pixel size, frame interval) describe the axis in OME-Zarr output;
    ``kind=None`` means the default for the name (t time, c channel, z/y/x space).

    ``unit`` on a space or time axis must be one OME-Zarr allows there (UDUNITS-2 names:
    :data:`SPACE_UNITS`, :data:`TIME_UNITS`).  What microscopists type is accepted and stored
    as the spec's name: ``um``/``µm``/``micron`` -> ``micrometer``, ``nm`` -> ``nanometer``,
    ``s``/``sec`` -> ``second``, ``ms`` -> ``millisecond``, ``min``, ``h``; names without regard to
    case, plural or "-metre" (:func:`normalize_unit`).  Anything else (a time unit on a space axis,
    ``pixel``, a typo) is a ValueError naming the value and suggesting the nearest name.  On a
    channel or other axis OME-Zarr prescribes no unit list: any non-empty text is kept as given.
    """

    name: str
    size: int
    tile_size: int
    tiles_per_shard: int = 1
    kind: str | None = None
    unit: str | None = None
    scale: float = 1.0

    def __post_init__(self):
        if not is_valid_name(self.name):
            raise ValueError(
                f"dimension name {self.name!r} is invalid: use a letter or underscore followed by "
                "letters, digits, '_' or '-' (at most 64 characters, no path separators)"
            )
        for field in ("size", "tile_size", "tiles_per_shard"):
            object.__setattr__(self, field, _checked_count(self.name, field, getattr(self, field)))

        if self.kind is not None and self.kind not in AXIS_KINDS:
            raise ValueError(f"dimension {self.name!r}: kind {self.kind!r} is not one of {', '.join(AXIS_KINDS)}")
        if self.unit is not None and (not isinstance(self.unit, str) or not self.unit.strip()):
            raise TypeError(f"dimension {self.name!r}: unit must be a non-empty string, got {self.unit!r}")
        if self.unit is not None and self.axis_kind in ("space", "time"):
            try:
                unit = normalize_unit(self.unit, self.axis_kind)
            except ValueError as exc:
                how = f"kind={self.kind!r}" if self.kind else f"a {self.axis_kind} axis by its name"
                raise ValueError(f"dimension {self.name!r} ({how}): {exc}") from None
            object.__setattr__(self, "unit", unit)
        elif self.unit is not None:
            object.__setattr__(self, "unit", self.unit.strip())
        if (
            not isinstance(self.scale, (int, float, np.integer, np.floating))
            or isinstance(self.scale, bool)
            or not math.isfinite(self.scale)
            or self.scale <= 0
        ):
            raise ValueError(f"dimension {self.name!r}: scale must be a positive finite number, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def unbounded(self) -> bool:
        return self.size == 0

    @property
    def axis_kind(self) -> str:
        """OME-NGFF axis type: ``kind``, or the default for the name."""
        return self.kind or _DEFAULT_KINDS.get(self.name.lower(), "other")


@dataclass(frozen=True)
class LiftedStrides:
    """The lift ``(t_0, n_0, ..., t_{D-1}, n_{D-1})`` of a batch into a tile-major pool, as numbers.

    A batch holds whole tile epochs: shape ``(k * tile_shape[0], *shape[1:])``, row-major.  Its
    element at ``(c_0, ..., c_{D-1})`` is lifted to ``(t_d, n_d) = divmod(c_d, tile_shape[d])``
    and lands at pool element ``sum_d t_d * tile_stride[d] + n_d * element_stride[d]``.  The pool
    holds one tile after the other in row-major tile order ``(t_0, ..., t_{D-1})``, each
    ``tile_elements_stride`` elements apart and row-major inside; elements of a tile that
    overhang the array (``t_d * tile_shape[d] + n_d >= shape[d]``) and the slot padding past
    ``tile_elements`` are the fill value 0.

    Every implementation of the lift takes its numbers from here: :meth:`scatter` (NumPy, the
    CPU tile stage through :meth:`Layout.shard_tiles`) and the GPU tile kernel's generated source
    (``backends/stages/tile.py``), which walks the same map backwards, one thread per pool element.
    """

    #: array extents ``size[d]`` (dim 0: the layout's, 0 when unbounded; a batch is cut at whole tiles)
    shape: tuple[int, ...]
    #: extents of ``n_d``
    tile_shape: tuple[int, ...]
    #: extents of ``t_d`` (dim 0: tiles of the array; a batch has as many as it has tile epochs)
    tile_count: tuple[int, ...]
    #: row-major element strides of a batch: where the element at ``(c_0, ..., c_{D-1})`` is read
    input_stride: tuple[int, ...]
    #: pool strides of ``n_d``
    element_stride: tuple[int, ...]
    #: pool strides of ``t_d`` (dim 0: one tile epoch)
    tile_stride: tuple[int, ...]
    #: elements from one tile to the next in the pool
    tile_elements_stride: int

    @property
    def rank(self) -> int:
        return len(self.tile_shape)

    @property
    def tile_elements(self) -> int:
        return math.prod(self.tile_shape)

    def scatter(self, batch: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The lift evaluated with NumPy: the 1-D tile-major pool of ``batch``.

        ``batch`` has shape ``(k * tile_shape[0], *shape[1:])``; the pool has
        ``k * tile_stride[0]`` elements.  One copy into a view of the pool whose strides are
        exactly ``tile_stride``/``element_stride``; the batch is padded to whole tiles first only
        when a tile overhangs it.  ``out``: a 1-D buffer (any dtype, at least the pool's bytes)
        the pool is written to, so a caller can reuse memory instead of faulting in fresh pages
        for every batch; None: a new array.
        """
        n = self.tile_shape
        if batch.ndim != self.rank or tuple(batch.shape[1:]) != tuple(self.shape[1:]) or batch.shape[0] % n[0]:
            raise ValueError(
                f"a batch of whole tile epochs has shape (k * {n[0]}, *{self.shape[1:]}), got {batch.shape}"
            )
        counts = (batch.shape[0] // n[0],) + self.tile_count[1:]
        whole = tuple(c * k for c, k in zip(counts, n))
        if batch.shape != whole:
            padded = np.zeros(whole, dtype=batch.dtype)
            padded[tuple(slice(0, s) for s in batch.shape)] = batch
            batch = padded
        size = counts[0] * self.tile_stride[0]
        # Slot padding is never a target of the copy below, so only then does the pool need zeros.
        if out is None:
            pool = (np.empty if self.tile_elements_stride == self.tile_elements else np.zeros)(size, dtype=batch.dtype)
        else:
            nbytes = size * batch.itemsize
            if out.ndim != 1 or out.nbytes < nbytes or not out.flags.c_contiguous:
                raise ValueError(f"out must be a contiguous 1-D buffer of at least {nbytes} bytes, got {out.shape}")
            pool = out.view(np.uint8)[:nbytes].view(batch.dtype)
            if self.tile_elements_stride != self.tile_elements:
                pool[...] = 0
        # The pool as (t_0, ..., t_{D-1}, n_0, ..., n_{D-1}) is a plain view (strides tile_stride,
        # element_stride) and the batch lifted to (t_0, n_0, ...) and transposed to that order
        # another: one copy, built without as_strided (~20 us of Python per call, and the CPU
        # backend calls this for every box of tiles it compresses).
        rank = self.rank
        target = pool.reshape(-1, self.tile_elements_stride)[:, : self.tile_elements].reshape(counts + n)
        lifted = batch.reshape([x for pair in zip(counts, n) for x in pair])
        np.copyto(target, lifted.transpose([2 * d for d in range(rank)] + [2 * d + 1 for d in range(rank)]))
        return pool


def lifted_strides(shape, tile_shape, tile_stride: int | None = None) -> LiftedStrides:
    """The lift of batches of an array of ``shape`` cut into tiles of ``tile_shape``.

    ``tile_stride``: elements from one tile to the next in the pool (default: the tile's
    elements).  ``shape[0]`` only sets ``tile_count[0]``: a batch's tile epochs are counted by
    whoever holds the batch.  This is the one definition of the lift's numbers.
    """
    return _lifted_strides(tuple(int(s) for s in shape), tuple(int(n) for n in tile_shape), tile_stride)


@functools.lru_cache(maxsize=1024)
def _lifted_strides(shape: tuple[int, ...], tile_shape: tuple[int, ...], tile_stride: int | None) -> LiftedStrides:
    # Cached: the CPU tile stage asks for the lift of every shard block of every task (a few
    # block shapes per layout), and the numbers are immutable.
    rank = len(tile_shape)
    tile_count = tuple(_ceil_div(s, n) for s, n in zip(shape, tile_shape))
    tile_stride = tile_stride or math.prod(tile_shape)
    input_stride = [1] * rank
    element_stride = [1] * rank
    for d in range(rank - 2, -1, -1):
        input_stride[d] = input_stride[d + 1] * shape[d + 1]
        element_stride[d] = element_stride[d + 1] * tile_shape[d + 1]
    pool_tile_stride = [0] * rank
    step = tile_stride
    for d in range(rank - 1, 0, -1):
        pool_tile_stride[d] = step
        step *= tile_count[d]
    pool_tile_stride[0] = step  # one tile epoch: tiles_per_epoch tiles
    return LiftedStrides(
        shape=shape,
        tile_shape=tile_shape,
        tile_count=tile_count,
        input_stride=tuple(input_stride),
        element_stride=tuple(element_stride),
        tile_stride=tuple(pool_tile_stride),
        tile_elements_stride=tile_stride,
    )


#: the default tiling (:meth:`Layout.default_for`): frame tiles of up to 256 px a side, up to 4
#: of them per shard along each frame dim; along dim 0 as many rows as make a tile of ~256 KiB and
#: a shard of ~16 MiB (both sizes the writers and readers reach their best rates with, see
#: docs/benchmarks.md)
DEFAULT_FRAME_TILE = 256
DEFAULT_FRAME_TILES_PER_SHARD = 4
DEFAULT_TILE_BYTES = 256 << 10
DEFAULT_SHARD_BYTES = 16 << 20
#: the rows of one shard epoch stay in memory until its shards are written: at most this much
DEFAULT_SHARD_EPOCH_BYTES = 64 << 20
#: below this many bytes a chunk costs more than it holds: its 16-byte shard index entry and the
#: codec's frame header weigh on it, it compresses poorly, and every one is a separate codec call
MIN_CHUNK_BYTES = 4 << 10
#: above this many shard files per GB of frames, file systems and object stores slow down (listing,
#: copying, deleting and every request cost per file): the tiling warns
MAX_FILES_PER_GB = 10_000
#: a bounded array of at most this many chunks gets no notes about its costs: whatever its tiling,
#: it is small (test arrays, a few frames)
_FEW_CHUNKS = 1024


class TilingWarning(UserWarning):
    """A tiling that works but costs: a requested tile clamped to its dimension, chunks of a few
    bytes, or thousands of files per GB (:meth:`Layout.tiling_notes` says which, with numbers)."""


#: names of the dims of an array of rank 1 to 5 when none are given: t first from rank 3 (frames
#: appended along it), then the last of c, z, y, x
DEFAULT_NAMES = {1: ("x",), 2: ("y", "x"), 3: ("t", "y", "x"), 4: ("t", "z", "y", "x"), 5: ("t", "c", "z", "y", "x")}


def _checked_dims(dims) -> list[Dim]:
    """``dims`` as a list, refused where they make no layout: not Dims, none or too many, a
    dim after the first unbounded, names that repeat."""
    dims = list(dims)
    if not dims:
        raise ValueError("a layout needs at least one dimension")
    if len(dims) > MAX_RANK:
        raise ValueError(f"a layout has at most {MAX_RANK} dimensions, got {len(dims)}")
    for d, dim in enumerate(dims):
        if not isinstance(dim, Dim):
            raise TypeError(f"dimension {d} must be a Dim, got {type(dim).__name__}")
        if d > 0 and dim.unbounded:
            raise ValueError(
                f"dimension {dim.name!r} (position {d}) has size 0: only the first dimension may be unbounded"
            )
    names = [dim.name for dim in dims]
    if len(set(names)) != len(names):
        raise ValueError(f"dimension names must be unique, got {names}")
    return dims


def _requested(values, what: str, field: str, names: list[str]) -> list[int | None]:
    """The ``field`` values a user asked for, one per dim of ``names`` (None: the default there),
    from a sequence (one per dim) or a mapping of dim names; each checked as :class:`Dim` does."""
    rank = len(names)
    if values is None:
        return [None] * rank
    if isinstance(values, Mapping):
        unknown = [name for name in values if name not in names]
        if unknown:
            raise ValueError(f"{what} names dimensions {unknown} that the array does not have {tuple(names)}")
        values = [values.get(name) for name in names]
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{what} must be one value per dimension or a mapping of dimension names, got {values!r}")
    values = list(values)
    if len(values) != rank:
        raise ValueError(
            f"{what} has {len(values)} values {values} for the {rank} dimensions {tuple(names)}: give one per dimension"
        )
    return [None if value is None else _checked_count(name, field, value) for name, value in zip(names, values)]


class Layout:
    """Tiling and sharding of an array of ``dims`` (slowest first) holding ``dtype``."""

    @classmethod
    def default_for(cls, shape, dtype, names=None, *, tile=None, tiles_per_shard=None) -> Layout:
        """The one tiling of an array of ``shape`` (dim 0 may be 0: unbounded), used by every entry
        point (record, convert, the napari writer, the recorder dock, pymmcore-plus): the default
        where not told one, and the tile sizes and tiles per shard a user asked for where told.

        The frame dims (the last two for rank >= 3, the last one otherwise) get tiles of up to
        256 px and up to 4 tiles per shard; dim 0 (when it is not a frame dim) gets as many rows
        per tile as make a tile of about 256 KiB and as many tiles per shard as make a shard of
        about 16 MiB, while a shard epoch (the rows held in memory until their shards are
        written) stays within about 64 MiB; dims in between (channels, z) tile 1.  ``names``
        default to :data:`DEFAULT_NAMES` (t, z, y, x for rank 4), d0, d1, ... beyond rank 5.

        ``tile`` / ``tiles_per_shard``: what a user asked for, one value per dim (None: the
        default there) or a mapping of dim names to values (dims it leaves out: the default).
        Each value is checked as a :class:`Dim` checks it (an integer >= 1; ValueError/TypeError
        naming the dim and the value).  A tile larger than its bounded dim is clamped to the dim
        (a chunk cannot hold more than the dim; the rest would be padding), with a
        :class:`TilingWarning` naming both; ``tiles_per_shard`` is taken as given.  What the
        tiling costs (:meth:`tiling_notes`) is warned where it is written (:meth:`ArraySpec.of
        <napari_tileshard.format.array_spec.ArraySpec.of>`)."""
        shape = tuple(shape)
        rank = len(shape)
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"a layout has 1 to {MAX_RANK} dimensions, got shape {shape}")
        if names is None:
            names = DEFAULT_NAMES.get(rank) or [f"d{i}" for i in range(rank)]
        names = list(names)
        if len(names) != rank:
            raise ValueError(f"{len(names)} names {names} for the {rank} dimensions of shape {shape}")
        shape = tuple(d.size for d in _checked_dims([Dim(n, s, 1) for n, s in zip(names, shape)]))
        requested_tiles = _requested(tile, "tile", "tile_size", names)
        requested_per_shard = _requested(tiles_per_shard, "tiles_per_shard", "tiles_per_shard", names)
        itemsize = np.dtype(dtype).itemsize
        frame = min(2 if rank >= 3 else 1, rank)
        tiles = [1] * rank
        per_shard = [1] * rank
        for d in range(rank - frame, rank):
            size = shape[d] or DEFAULT_FRAME_TILE
            tiles[d] = max(1, min(DEFAULT_FRAME_TILE, size))
            per_shard[d] = max(1, min(DEFAULT_FRAME_TILES_PER_SHARD, _ceil_div(size, tiles[d])))
        if rank > frame:
            frame_tile = itemsize * int(np.prod(tiles[rank - frame :]))
            rows = max(1, DEFAULT_TILE_BYTES // frame_tile)
            tiles[0] = min(rows, shape[0]) if shape[0] else rows
            shard_rows = max(1, DEFAULT_SHARD_BYTES // (frame_tile * int(np.prod(per_shard[rank - frame :]))))
            row_bytes = itemsize * int(np.prod(shape[1:]))
            shard_rows = max(tiles[0], min(shard_rows, DEFAULT_SHARD_EPOCH_BYTES // row_bytes))
            tiles_along = _ceil_div(shape[0], tiles[0]) if shape[0] else shard_rows
            per_shard[0] = max(1, min(shard_rows // tiles[0], tiles_along))
        dims = [Dim(n, s, t, p) for n, s, t, p in zip(names, shape, tiles, per_shard)]
        for d, dim in enumerate(dims):
            asked, asked_per_shard = requested_tiles[d], requested_per_shard[d]
            if asked is not None and dim.size and asked > dim.size:
                warnings.warn(
                    f"tile {asked} along {dim.name!r} is larger than the dimension ({dim.size}): using {dim.size}",
                    TilingWarning,
                    stacklevel=2,
                )
                asked = dim.size
            dims[d] = replace(
                dim,
                tile_size=dim.tile_size if asked is None else asked,
                tiles_per_shard=dim.tiles_per_shard if asked_per_shard is None else asked_per_shard,
            )
        return cls(dims, dtype)

    def __init__(self, dims, dtype="uint16"):
        dims = _checked_dims(dims)
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype {dtype!r} is not a NumPy dtype") from exc
        if np_dtype.name not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype {dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
        self.dims = tuple(dims)
        self.dtype = np_dtype.newbyteorder("<") if np_dtype.itemsize > 1 else np_dtype
        if self.tile_bytes > 2**31 - 1:
            raise ValueError(
                f"tile shape {self.tile_shape} of {self.dtype.name} is {self.tile_bytes} bytes: too large, "
                "a chunk must stay below 2 GiB"
            )
        if self.chunks_per_shard > MAX_CHUNKS_PER_SHARD:
            raise ValueError(
                f"tiles_per_shard {self.tiles_per_shard} put {self.chunks_per_shard} chunks in a shard "
                f"(at most {MAX_CHUNKS_PER_SHARD}, each shard stores a 16-byte index entry per chunk): "
                "use fewer tiles per shard"
            )
        if self.tiles_per_epoch > _MAX_TILES_PER_EPOCH:
            raise ValueError(
                f"sizes {self.shape[1:]} with tiles {self.tile_shape[1:]} give {self.tiles_per_epoch} tiles "
                f"per tile epoch (at most {_MAX_TILES_PER_EPOCH}): use larger tiles"
            )
        if self.epoch_bytes > _MAX_EPOCH_BYTES:
            raise ValueError(
                f"one tile epoch ({self.tile_shape[0]} x {self.shape[1:]}) would hold {self.epoch_bytes} "
                f"bytes (at most {_MAX_EPOCH_BYTES}): use a smaller tile_size along {self.names[0]!r}"
            )

    # -- basic shapes -----------------------------------------------------------------
    def __repr__(self):
        return f"Layout({list(self.dims)!r}, dtype={self.dtype.name!r})"

    def __eq__(self, other):
        return isinstance(other, Layout) and self.dims == other.dims and self.dtype == other.dtype

    def __hash__(self):
        return hash((self.dims, self.dtype.str))

    @property
    def rank(self) -> int:
        return len(self.dims)

    # Derived numbers are cached: a Layout never changes after __init__ (its dims are frozen), and
    # the Writer's threads ask for them per frame, batch, box of tiles and shard.
    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def unbounded(self) -> bool:
        return self.dims[0].unbounded

    @cached_property
    def shape(self) -> tuple[int, ...]:
        """Declared shape (0 along an unbounded dim 0)."""
        return tuple(d.size for d in self.dims)

    @cached_property
    def tile_shape(self) -> tuple[int, ...]:
        return tuple(d.tile_size for d in self.dims)

    @cached_property
    def tiles_per_shard(self) -> tuple[int, ...]:
        return tuple(d.tiles_per_shard for d in self.dims)

    @cached_property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(d.tile_size * d.tiles_per_shard for d in self.dims)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def frame_shape(self) -> tuple[int, ...]:
        """Shape of one frame: the last two dims (rank >= 3), the last dim (rank 2), a scalar (rank 1)."""
        return self.shape[-2:] if self.rank >= 3 else self.shape[1:]

    @cached_property
    def frame_elements(self) -> int:
        return math.prod(self.frame_shape)

    @cached_property
    def row_elements(self) -> int:
        """Elements of one index along dim 0 (``prod(size[1:])``)."""
        return math.prod(self.shape[1:])

    @property
    def total_elements(self) -> int | None:
        return None if self.unbounded else math.prod(self.shape)

    # -- tiles and shards -----------------------------------------------------------------
    @cached_property
    def tile_count(self) -> tuple[int, ...]:
        """Tiles per dim; dim 0 of an unbounded layout counts 0."""
        return tuple(_ceil_div(d.size, d.tile_size) for d in self.dims)

    @cached_property
    def shard_count(self) -> tuple[int, ...]:
        return tuple(_ceil_div(t, d.tiles_per_shard) for t, d in zip(self.tile_count, self.dims))

    @cached_property
    def tile_elements(self) -> int:
        return math.prod(self.tile_shape)

    @cached_property
    def tile_bytes(self) -> int:
        return self.tile_elements * self.itemsize

    @cached_property
    def tiles_per_epoch(self) -> int:
        """``M`` of the design: real tiles in one tile epoch."""
        return math.prod(self.tile_count[1:])

    @cached_property
    def inner_shard_count(self) -> int:
        """``S_inner``: shards that share one dim-0 shard coordinate."""
        return math.prod(self.shard_count[1:])

    @cached_property
    def tiles_per_shard_inner(self) -> int:
        return math.prod(self.tiles_per_shard[1:])

    @cached_property
    def chunks_per_shard(self) -> int:
        return self.tiles_per_shard[0] * self.tiles_per_shard_inner

    @cached_property
    def slots_per_epoch(self) -> int:
        """Padded shard-major slots per tile epoch (``S_inner * tiles_per_shard_inner``)."""
        return self.inner_shard_count * self.tiles_per_shard_inner

    @property
    def epoch_rows(self) -> int:
        return self.dims[0].tile_size

    @cached_property
    def epoch_elements(self) -> int:
        return self.epoch_rows * self.row_elements

    @cached_property
    def epoch_bytes(self) -> int:
        return self.epoch_elements * self.itemsize

    @property
    def shard_epoch_rows(self) -> int:
        return self.shard_shape[0]

    @property
    def index_bytes(self) -> int:
        """Size of one shard index: ``(offset, nbytes)`` uint64 per chunk plus the CRC32C."""
        return self.chunks_per_shard * 16 + 4

    @property
    def epoch_count(self) -> int | None:
        """Tile epochs of a bounded array."""
        return None if self.unbounded else self.tile_count[0]

    # -- what the tiling costs ------------------------------------------------------------
    @property
    def files_per_gb(self) -> float:
        """Shard files per GB (10^9 bytes) of the array's data: of a whole bounded array, or of
        each shard epoch of an unbounded one (edge shards counted as they are, smaller)."""
        counts, shards = self.shard_count, self.shard_shape
        extents = [size / count if size else shard for size, count, shard in zip(self.shape, counts, shards)]
        return 1e9 / (math.prod(extents) * self.itemsize)

    def tiling_notes(self) -> tuple[str, ...]:
        """What this tiling costs, one sentence with numbers each (empty when nothing stands out):

        * a tile larger than its bounded dimension (its chunks are padding beyond the dim; where
          tile sizes are asked for, :meth:`default_for` clamps them instead);
        * chunks under :data:`MIN_CHUNK_BYTES` (4 KiB);
        * more than :data:`MAX_FILES_PER_GB` (10,000) shard files per GB of data.

        A bounded array of at most 1,024 chunks gets only the first: whatever its tiling, it is
        small.  :meth:`ArraySpec.of <napari_tileshard.format.array_spec.ArraySpec.of>` warns
        each note as a :class:`TilingWarning`."""
        notes = [
            f"tile {dim.tile_size} along {dim.name!r} is larger than the dimension ({dim.size}): its chunks are "
            f"padded to {dim.tile_size}, a tile of {dim.size} holds the same"
            for dim in self.dims
            if dim.size and dim.tile_size > dim.size
        ]
        if not self.unbounded and math.prod(self.tile_count) <= _FEW_CHUNKS:
            return tuple(notes)
        dtype = self.dtype.name
        if self.tile_bytes < MIN_CHUNK_BYTES:
            notes.append(
                f"chunks of {_shape_text(self.tile_shape)} {dtype} are {self.tile_bytes:,} bytes, under "
                f"{MIN_CHUNK_BYTES // 1024} KiB: each costs a 16-byte index entry and a codec frame and compresses "
                "poorly; use larger tiles"
            )
        files_per_gb = self.files_per_gb
        if files_per_gb > MAX_FILES_PER_GB:
            total = "" if self.unbounded else f", {math.prod(self.shard_count):,} files for the whole array"
            notes.append(
                f"shards of {_shape_text(self.shard_shape)} {dtype} make {files_per_gb:,.0f} files per GB of data"
                f"{total} (over {MAX_FILES_PER_GB:,} per GB, file systems and object stores slow down): use more "
                "tiles per shard or larger tiles"
            )
        return tuple(notes)

    def warn_tiling(self, stacklevel: int = 2) -> None:
        """Warn each of :meth:`tiling_notes` as a :class:`TilingWarning`, once per layout object
        (an entry point checks the layout it was given, then its recording thread builds its
        Writer from the same object: the user hears of it once)."""
        if self.__dict__.get("_tiling_warned"):
            return
        self.__dict__["_tiling_warned"] = True
        for note in self.tiling_notes():
            warnings.warn(note, TilingWarning, stacklevel=stacklevel + 1)

    # -- the shard permutation P ------------------------------------------------------------
    @cached_property
    def shard_permutation(self) -> np.ndarray:
        """``P[i]``: padded shard-major slot of the ``i``-th tile (row-major tile order) of an epoch."""
        inner_tiles = self.tile_count[1:]
        if not inner_tiles:
            return np.zeros(1, dtype=np.int64)
        tile_coords = np.unravel_index(np.arange(self.tiles_per_epoch), inner_tiles)
        tps = self.tiles_per_shard[1:]
        shard_coords = [t // n for t, n in zip(tile_coords, tps)]
        within_coords = [t % n for t, n in zip(tile_coords, tps)]
        return np.ravel_multi_index(shard_coords + within_coords, self.shard_count[1:] + tps).astype(np.int64)

    @cached_property
    def slot_mask(self) -> np.ndarray:
        """``(inner_shard_count, tiles_per_shard_inner)`` bool: which padded slots hold a real tile."""
        mask = np.zeros(self.slots_per_epoch, dtype=bool)
        mask[self.shard_permutation] = True
        mask.flags.writeable = False
        return mask.reshape(self.inner_shard_count, self.tiles_per_shard_inner)

    def inner_shard_coords(self, shard: int) -> tuple[int, ...]:
        """Shard coordinates along dims 1.. of inner shard ``shard`` (row-major)."""
        # Plain integer arithmetic: asked for every shard of every shard epoch (and by the CPU
        # backend for every task), where np.unravel_index's overhead showed in profiles.
        counts = self.shard_count[1:]
        if not counts:
            return ()
        rest = operator.index(shard)
        if not 0 <= rest < math.prod(counts):
            raise ValueError(f"inner shard {shard} is out of range for {math.prod(counts)} inner shards")
        coords = []
        for n in reversed(counts):
            rest, c = divmod(rest, n)
            coords.append(c)
        return tuple(reversed(coords))

    def inner_shard_number(self, coords) -> int:
        """Inverse of :meth:`inner_shard_coords`."""
        counts = self.shard_count[1:]
        if not counts:
            return 0
        coords = tuple(operator.index(c) for c in coords)
        if len(coords) != len(counts) or not all(0 <= c < n for c, n in zip(coords, counts)):
            raise ValueError(f"inner shard coordinates {coords} are out of range for {counts} shards")
        number = 0
        for c, n in zip(coords, counts):
            number = number * n + c
        return number

    # -- lifted strides (the one definition of the lift; see LiftedStrides) -----------------
    def lifted_strides(self, tile_stride: int | None = None) -> LiftedStrides:
        """The lift of a batch of this layout's tile epochs into its tile-major pool.

        ``tile_stride``: elements from one tile to the next in the pool (default
        ``tile_elements``; the GPU rounds it up for alignment).  See :class:`LiftedStrides`.
        """
        return lifted_strides(self.shape, self.tile_shape, tile_stride)

    def tile_pool_reference(self, batch: np.ndarray) -> np.ndarray:
        """NumPy reference of lift + transpose for a batch of whole tile epochs.

        ``batch`` has shape ``(k * tile_size[0], *size[1:])``.  Returns the tile-major pool of
        shape ``(k, tiles_per_epoch, *tile_shape)``, edge tiles padded with 0: pad to whole
        tiles, reshape to ``(t_0, n_0, ..., t_{D-1}, n_{D-1})``, transpose to
        ``(t_0, ..., t_{D-1}, n_0, ..., n_{D-1})``.  Written without :class:`LiftedStrides` on
        purpose: both implementations of the lift are tested against it.
        """
        epochs = batch.shape[0] // self.epoch_rows
        padded_shape = (epochs * self.epoch_rows,) + tuple(
            t * n for t, n in zip(self.tile_count[1:], self.tile_shape[1:])
        )
        padded = np.zeros(padded_shape, dtype=batch.dtype)
        padded[tuple(slice(0, n) for n in batch.shape)] = batch
        lifted_shape = [epochs, self.epoch_rows]
        for d in range(1, self.rank):
            lifted_shape += [self.tile_count[d], self.tile_shape[d]]
        axes = [2 * d for d in range(self.rank)] + [2 * d + 1 for d in range(self.rank)]
        pool = padded.reshape(lifted_shape).transpose(axes)
        return np.ascontiguousarray(pool).reshape((epochs, self.tiles_per_epoch) + self.tile_shape)

    # -- whole shards of one epoch (what the CPU backend compresses) ------------------------
    def shard_bounds(self, shard: int, within: slice | tuple[slice, ...] = slice(None)) -> tuple[slice, ...]:
        """Element ranges along dims 1.. of inner shard ``shard`` (clipped to the array).

        ``within`` restricts the shard's tiles: a slice is a range of its tile rows ``w_1``
        (pieces of a shard for parallel work), a tuple of slices a box of ranges of ``w_1``,
        ``w_2``, ... (dims it leaves out are whole; :meth:`shard_boxes`).  Ranges past the array
        are empty.
        """
        coords = self.inner_shard_coords(shard)
        full = self.shard_shape[1:]
        bounds = [slice(c * n, min(size, (c + 1) * n)) for c, n, size in zip(coords, full, self.shape[1:])]
        box: tuple[slice, ...]
        if isinstance(within, slice):  # a range of w_1 (a rank-1 array has no w_1: its one tile row)
            box = (within,) if self.rank > 1 else ()
        else:
            box = tuple(within)
        if len(box) > self.rank - 1:
            raise ValueError(f"a box of {len(box)} tile ranges for {self.rank - 1} dims after the first")
        for d, tiles in enumerate(box, start=1):
            first, stop, step = tiles.indices(self.tiles_per_shard[d])
            if step != 1:
                raise ValueError(f"tile ranges must be contiguous, got {tiles} along dim {d}")
            b = bounds[d - 1]
            start = min(b.stop, b.start + first * self.tile_shape[d])
            bounds[d - 1] = slice(start, max(start, min(b.stop, b.start + stop * self.tile_shape[d])))
        return tuple(bounds)

    def shard_boxes(self, within_1: slice, max_tiles: int) -> list[tuple[slice, ...]]:
        """Boxes of at most ``max_tiles`` tile slots (at least one) that cover the tile rows
        ``within_1`` of a shard, in within-shard row-major order: the tiles of the boxes, one
        after the other, are the tiles of ``within_1`` (:meth:`shard_tiles` of each box).

        A box fixes ``w_1, ..., w_{d-1}`` to one value each, takes a range along ``w_d`` and
        every ``w`` after it, where ``d`` is the first dim whose trailing dims hold at most
        ``max_tiles`` slots.  The CPU backend cuts and compresses one box at a time, so the
        tiles it cut are still in the core's cache when the codec reads them.
        """
        tps = self.tiles_per_shard[1:]
        if not tps:
            return [()]
        first, stop, step = within_1.indices(tps[0])
        if step != 1:
            raise ValueError(f"within_1 must be a contiguous range of tile rows, got {within_1}")
        max_tiles = max(1, max_tiles)
        # d: the first dim (1-based) whose trailing slots (a step along it) fit max_tiles
        d = next(d for d in range(1, len(tps) + 1) if math.prod(tps[d:]) <= max_tiles)
        step_d = max_tiles // math.prod(tps[d:])
        boxes = []
        # every (w_1, ..., w_{d-1}) of the piece, row-major; none to fix when d is 1
        prefixes = [()] if d == 1 else ((w1, *ws) for w1 in range(first, stop) for ws in np.ndindex(*tps[1 : d - 1]))
        for prefix in prefixes:
            lo, hi = (first, stop) if d == 1 else (0, tps[d - 1])
            for a in range(lo, hi, step_d):
                boxes.append(tuple(slice(int(w), int(w) + 1) for w in prefix) + (slice(a, min(hi, a + step_d)),))
        return boxes

    def shard_tiles(
        self,
        epoch_rows: np.ndarray,
        shard: int,
        within: slice | tuple[slice, ...] = slice(None),
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """The tiles that exist in inner shard ``shard`` of one tile epoch, contiguous.

        ``epoch_rows`` has shape ``(tile_size[0], *size[1:])``.  Returns ``(tiles, tile_elements)``
        for the slots where ``slot_mask[shard]`` is True, in within-shard row-major order; edge
        tiles are padded with 0.  This is the lift of the shard's block of the epoch on its own
        (:func:`lifted_strides` of the block's extents): its tile-major pool holds the shard's
        tiles in ``(w_1, ..., w_{D-1})`` order, and in an edge shard the tiles that exist are
        those with every ``w_d`` below the block's tile count along ``d``, the row-major subset
        the mask selects.  ``within`` restricts the tiles to a range of ``w_1`` or a box
        (:meth:`shard_bounds`).  ``out``: a buffer to write them to
        (:meth:`LiftedStrides.scatter`).
        """
        block = epoch_rows[(slice(None),) + self.shard_bounds(shard, within)]
        lift = lifted_strides(block.shape, self.tile_shape)
        return lift.scatter(block, out).reshape(-1, self.tile_elements)

    # -- memory ---------------------------------------------------------------------------
    def compressed_tile_bound(self, codec=None) -> int:
        """Worst-case bytes of one encoded tile with ``codec`` (a name or Codec); None: with any
        registered codec (a bound for memory estimates made before the codec is known)."""
        candidates = codecs.CODECS.values() if codec is None else [codecs.get(codec)]
        return max(c.max_encoded_bytes(self.tile_bytes) for c in candidates)

    def shard_key(self, shard_coords) -> str:
        """Store key of a shard (default chunk key encoding, ``/`` separator)."""
        return "c/" + "/".join(str(int(c)) for c in shard_coords)
