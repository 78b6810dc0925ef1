"""Integrity check of a sharded Zarr v3 array, shard by shard and chunk by chunk.

Reads the metadata with zarr-python, lists the shard objects that exist (it never walks a
declared grid, so a bogus huge ``shape`` costs nothing), and for each shard checks the index
size and CRC32C, that every chunk lies inside the shard, is one standard zstd frame (when the
codec is zstd) and decodes to exactly one tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import zstandard

from .shard import EMPTY, decode_index
from .store import list_shard_keys


@dataclass(frozen=True)
class Problem:
    key: str
    chunk: int | None
    message: str

    def __str__(self):
        where = self.key if self.chunk is None else f"{self.key} chunk {self.chunk}"
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    shards: int = 0
    chunks: int = 0
    problems: list[Problem] = field(default_factory=list)
    #: shards past shape[0]: written but not (yet) published, e.g. after a crash; readers ignore them
    unpublished: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self):
        head = f"{self.path}: {self.shards} shards, {self.chunks} chunks checked, {len(self.problems)} problems"
        if self.unpublished:
            head += f" ({len(self.unpublished)} shards past shape[0] ignored: written after the last published epoch)"
        return "\n".join([head] + [f"  {p}" for p in self.problems])


def verify(path, progress=None) -> VerifyReport:
    """Check every shard of the array at ``path`` (a path or zarr Store), or of every level of an
    OME-Zarr group; ``progress(done, total)``."""
    import zarr

    from .ome import open_levels

    report = VerifyReport(str(path))
    try:
        levels = open_levels(path)
        arrays = ([(f"{k}/", level) for k, level in enumerate(levels)] if levels is not None
                  else [("", zarr.open_array(path, mode="r"))])
    except Exception as exc:  # noqa: BLE001 - every failure to open is a finding
        report.problems.append(Problem("zarr.json", None, f"cannot open as a Zarr v3 array or OME-Zarr group: {exc}"))
        return report
    done_before = 0  # shards of earlier levels, so progress keeps counting up across levels
    for label, array in arrays:
        def level_progress(done, total, base=done_before):
            if progress:
                progress(base + done, base + total)

        _verify_array(report, array, label, level_progress)
        done_before = report.shards + len(report.unpublished)
    return report


def _verify_array(report: VerifyReport, array, label: str, progress) -> None:
    """Add the findings for one array; keys are reported as ``label`` + key (``1/c/0/0/0``)."""
    problems_before = len(report.problems)
    unpublished_before = len(report.unpublished)
    _check_array(report, array, progress)
    for i in range(problems_before, len(report.problems)):
        problem = report.problems[i]
        report.problems[i] = Problem(label + problem.key, problem.chunk, problem.message)
    report.unpublished[unpublished_before:] = [label + k for k in report.unpublished[unpublished_before:]]


def _check_array(report: VerifyReport, array, progress) -> None:
    meta = array.metadata.to_dict()
    sharding = [c for c in meta["codecs"] if c["name"] == "sharding_indexed"]
    if not sharding:
        report.problems.append(Problem("zarr.json", None, "array is not sharded (no sharding_indexed codec)"))
        return
    config = sharding[0]["configuration"]
    inner = [c["name"] for c in config["codecs"]]
    if config.get("index_location", "end") != "end" or [c["name"] for c in config["index_codecs"]] != [
        "bytes", "crc32c"] or inner not in (["bytes"], ["bytes", "zstd"]):
        report.problems.append(Problem("zarr.json", None, f"unsupported sharding configuration {config}"))
        return
    shape = meta["shape"]
    shard_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
    chunk_shape = config["chunk_shape"]
    itemsize = np.dtype(array.dtype).itemsize
    tile_bytes = math.prod(chunk_shape) * itemsize
    chunks_per_shard = math.prod(s // c for s, c in zip(shard_shape, chunk_shape))
    grid = [math.ceil(s / n) for s, n in zip(shape, shard_shape)]
    zstd = "zstd" in inner
    store = array.store_path.store
    prefix = array.store_path.path
    keys = sorted(list_shard_keys(store, prefix))
    decompressor = zstandard.ZstdDecompressor()
    for done, key in enumerate(keys):
        if progress:
            progress(done, len(keys))
        coords = key.split("/")[1:]
        if len(coords) != len(shape) or not all(c.isdigit() for c in coords):
            report.problems.append(Problem(key, None, "not a shard key of this array"))
            continue
        if any(int(c) >= g for c, g in zip(coords[1:], grid[1:])):
            report.problems.append(Problem(key, None, f"shard lies outside the array shape {shape}"))
            continue
        if int(coords[0]) >= grid[0]:
            report.unpublished.append(key)
            continue
        data = _read(store, prefix, key)
        report.shards += 1
        _check_shard(report, key, data, chunks_per_shard, tile_bytes, zstd, decompressor)
    if progress:
        progress(len(keys), len(keys))


def _check_shard(report, key, data, chunks_per_shard, tile_bytes, zstd, decompressor):
    index_bytes = chunks_per_shard * 16 + 4
    if data is None or len(data) < index_bytes:
        size = 0 if data is None else len(data)
        report.problems.append(Problem(key, None, f"shard of {size} bytes is shorter than its index "
                                                  f"({index_bytes} bytes): truncated"))
        return
    index, crc_ok = decode_index(data[-index_bytes:], chunks_per_shard)
    if not crc_ok:
        report.problems.append(Problem(key, None, "index CRC32C mismatch"))
    data_end = len(data) - index_bytes
    for chunk, (offset, nbytes) in enumerate(index):
        if offset == EMPTY and nbytes == EMPTY:
            continue
        report.chunks += 1
        if offset == EMPTY or nbytes == EMPTY or offset + nbytes > data_end:
            report.problems.append(Problem(key, chunk, f"chunk (offset {int(offset)}, {int(nbytes)} bytes) "
                                                       f"lies outside the shard data ({data_end} bytes)"))
            continue
        chunk_bytes = data[int(offset): int(offset + nbytes)]
        if not zstd:
            if nbytes != tile_bytes:
                report.problems.append(Problem(key, chunk, f"holds {int(nbytes)} bytes, a tile is {tile_bytes}"))
            continue
        try:
            stream = decompressor.decompressobj()
            decoded = stream.decompress(chunk_bytes)
            trailing = len(stream.unused_data)
        except zstandard.ZstdError as exc:
            report.problems.append(Problem(key, chunk, f"zstd decode failed: {exc}"))
            continue
        if trailing:
            report.problems.append(Problem(key, chunk, f"{trailing} bytes follow the first zstd frame"))
        if len(decoded) != tile_bytes:
            report.problems.append(Problem(key, chunk, f"decodes to {len(decoded)} bytes, a tile is {tile_bytes}"))


def _read(store, prefix: str, key: str) -> bytes | None:
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    full = f"{prefix}/{key}" if prefix else key
    buffer = sync(store.get(full, default_buffer_prototype()))
    return None if buffer is None else buffer.to_bytes()
