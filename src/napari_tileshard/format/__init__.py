"""The format layer: what a sharded Zarr v3 array is on disk, with nothing of ours above it.

* :mod:`.codecs`: one small frozen class per chunk codec, both directions (CPU encode, bounded
  ``decode_into``), both devices (``gpu``: what nvCOMP does for it), ``to_dict``/``from_dict``,
  one registry;
* :mod:`.shard_spec`: :class:`ShardSpec`, one sharded array from/to ``zarr.json``, its shard
  index (encode, decode, validate) and its keys;
* :mod:`.layout`, :mod:`.array_spec`, :mod:`.metadata`, :mod:`.ome`, :mod:`.pyramid`: the tiling,
  what a Writer writes, and the JSON of arrays and OME groups (nvCOMP's C API, the GPU side of the
  codecs, lives in :mod:`napari_tileshard.gpu.nvcomp`);
* :mod:`.huffman_zstd`: standard zstd frames of Huffman-only blocks, the NumPy reference of a GPU
  encoder (not used by the writer yet).

Used by the writer, the reader, verify and the inspector; imports no module of ours above it.
"""

from .codecs import (
    CODECS,
    REGISTRY,
    Blosc,
    BloscLz4,
    Codec,
    CodecError,
    GpuSupport,
    Gzip,
    Opaque,
    Raw,
    Zstd,
    from_zarr_codecs,
    get,
    gpu_decode_support,
    gpu_support,
    names,
)
from .shard_spec import (
    EMPTY,
    ChunkDecodeError,
    ShardIndex,
    ShardIndexError,
    ShardReadError,
    ShardSpec,
    UnsupportedArray,
    array_metadata,
)

__all__ = [
    "CODECS",
    "REGISTRY",
    "Blosc",
    "BloscLz4",
    "Codec",
    "CodecError",
    "GpuSupport",
    "Gzip",
    "Opaque",
    "Raw",
    "Zstd",
    "from_zarr_codecs",
    "get",
    "gpu_decode_support",
    "gpu_support",
    "names",
    "EMPTY",
    "ChunkDecodeError",
    "ShardIndex",
    "ShardIndexError",
    "ShardReadError",
    "ShardSpec",
    "UnsupportedArray",
    "array_metadata",
]
