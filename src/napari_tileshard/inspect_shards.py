"""Qt-free core of the shard inspector: what a sharded Zarr v3 array holds, from its indexes only.

For each shard object it reads the object's size and one suffix range (the index at the end,
``chunks * 16 + 4`` bytes) — never the chunk data — so a store of many shards opens quickly.
The result is a per-chunk map of compressed bytes on the chunk (tile) grid, with -1 for empty
chunks (index ``2^64-1``), and a table of shards with their index CRC status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .shard import EMPTY, decode_index

EMPTY_CHUNK = -1


@dataclass
class ShardInfo:
    key: str
    coords: tuple[int, ...]
    file_bytes: int
    chunks_present: int
    chunks_possible: int
    compressed_bytes: int
    mean_ratio: float
    crc_ok: bool


@dataclass
class Inspection:
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunk_bytes: np.ndarray  # on the chunk grid: compressed bytes, EMPTY_CHUNK where empty or absent
    uncompressed_chunk_bytes: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    bytes_read: int = 0

    @property
    def chunk_ratio(self) -> np.ndarray:
        """Compression ratio per chunk (NaN where empty)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.chunk_bytes > 0, self.uncompressed_chunk_bytes / self.chunk_bytes, np.nan)


def inspect_array(path) -> Inspection:
    """Read every shard index of the sharded array at ``path`` (a path or zarr Store; level 0 of an
    OME-Zarr group)."""
    from zarr.abc.store import SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    from .ome import open_level0
    from .store import list_shard_keys

    array = open_level0(path)
    meta = array.metadata.to_dict()
    sharding = [c for c in meta.get("codecs", []) if c["name"] == "sharding_indexed"]
    if not sharding:
        return _inspect_unsharded(array, meta)
    config = sharding[0]["configuration"]
    if config.get("index_location", "end") != "end":
        raise ValueError(f"{path}: index_location {config['index_location']!r} is not supported yet")
    shape = tuple(meta["shape"])
    shard_shape = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    chunk_shape = tuple(config["chunk_shape"])
    per_shard = tuple(s // c for s, c in zip(shard_shape, chunk_shape))
    chunks = math.prod(per_shard)
    index_bytes = chunks * 16 + 4
    grid = tuple(math.ceil(s / c) for s, c in zip(shape, chunk_shape))
    result = Inspection(shape, shard_shape, chunk_shape, np.full(grid, EMPTY_CHUNK, dtype=np.int64),
                        math.prod(chunk_shape) * np.dtype(array.dtype).itemsize)
    store, prefix = array.store_path.store, array.store_path.path
    prototype = default_buffer_prototype()
    for key in sorted(list_shard_keys(store, prefix)):
        parts = key.split("/")[1:]
        if len(parts) != len(shape) or not all(p.isdigit() for p in parts):
            continue
        coords = tuple(int(p) for p in parts)
        full_key = f"{prefix}/{key}" if prefix else key
        size = sync(store.getsize(full_key))
        if size < index_bytes:
            result.shards.append(ShardInfo(key, coords, size, 0, chunks, 0, float("nan"), False))
            continue
        tail = sync(store.get(full_key, prototype, byte_range=SuffixByteRequest(index_bytes))).to_bytes()
        result.bytes_read += len(tail)
        index, crc_ok = decode_index(tail, chunks)
        nbytes = index[:, 1].astype(np.int64)
        present = ~((index[:, 0] == EMPTY) & (index[:, 1] == EMPTY))
        nbytes = np.where(present, nbytes, EMPTY_CHUNK).reshape(per_shard)
        # Place the shard's chunks on the chunk grid, clipped to the array's extent.
        start = [c * p for c, p in zip(coords, per_shard)]
        region = tuple(slice(s, min(g, s + p)) for s, g, p in zip(start, grid, per_shard))
        if all(r.stop > r.start for r in region):
            result.chunk_bytes[region] = nbytes[tuple(slice(0, r.stop - r.start) for r in region)]
        stored = int(nbytes[nbytes > 0].sum())
        count = int(present.sum())
        ratio = count * result.uncompressed_chunk_bytes / stored if stored else float("nan")
        result.shards.append(ShardInfo(key, coords, size, count, chunks, stored, ratio, bool(crc_ok)))
    return result


def _inspect_unsharded(array, meta) -> Inspection:
    """Unsharded (or Zarr v2) arrays: the chunk grid and each chunk object's size, no data read."""
    from zarr.core.sync import sync

    shape = tuple(array.shape)
    chunk_shape = tuple(array.chunks)
    grid = tuple(math.ceil(s / c) for s, c in zip(shape, chunk_shape))
    result = Inspection(shape, chunk_shape, chunk_shape, np.full(grid, EMPTY_CHUNK, dtype=np.int64),
                        math.prod(chunk_shape) * np.dtype(array.dtype).itemsize)
    store, prefix = array.store_path.store, array.store_path.path
    separator = "/"
    encoding = meta.get("chunk_key_encoding", {})
    if isinstance(encoding, dict):
        separator = encoding.get("configuration", {}).get("separator", "/")

    async def keys():
        base = f"{prefix}/" if prefix else ""
        return [k[len(base):] async for k in store.list_prefix(base)]

    for key in sync(keys()):
        name = key[2:] if key.startswith("c" + separator) else key
        parts = name.split(separator)
        if len(parts) != len(shape) or not all(p.isdigit() for p in parts):
            continue
        coords = tuple(int(p) for p in parts)
        if any(c >= g for c, g in zip(coords, grid)):
            continue
        size = sync(store.getsize(f"{prefix}/{key}" if prefix else key))
        result.chunk_bytes[coords] = size
        result.shards.append(ShardInfo(key, coords, size, 1, 1, size,
                                       result.uncompressed_chunk_bytes / size if size else float("nan"), True))
    return result
