"""Integrity check of a sharded Zarr v3 array, shard by shard and chunk by chunk.

The store is untrusted (checking broken stores is the point), so memory and I/O follow what is
on disk, never what ``zarr.json`` declares: metadata is read through
:mod:`napari_tileshard.safe_read` (regular files inside the store, size- and depth-capped), the
shard objects that exist are listed without following symlinks (a bogus huge ``shape`` costs
nothing; a symlink out of the store is reported, not read), and each shard is streamed: its index
with one suffix read (in blocks for huge indexes), then each chunk's byte range, one at a time.
For each shard it checks the index size and CRC32C, that every chunk lies inside the shard
(offsets as Python integers: a uint64 sum would wrap), holds a plausible number of bytes for its
codec, and decodes, with the codec's own decoder, to exactly one tile (never more is decoded; for
zstd: one standard zstd frame).  The chunks that pass the placement checks are read as
:class:`~napari_tileshard.read.ShardReader` reads them, in a few coalesced range reads per shard
(:func:`~napari_tileshard.read_plan.pack_runs`, 16 MiB at most each), and decoded on threads;
``TILESHARD_READER=zarr`` goes back to one read per chunk.

The Writer's record in each array's attributes (``tileshard``: ``rows_written``, ``state``) is
checked too: rows inside the published shape that were never written are a problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np

from . import codecs
from .safe_read import StoreAccess, UnsafeStoreError, recording_state
from .store import check_store_path

#: the largest tile verify decompresses to check it (a declared tile beyond it is reported)
MAX_DECODED_TILE_BYTES = 1 << 28
_EMPTY = 2**64 - 1
_INDEX_BLOCK_ENTRIES = 1 << 16  # index entries read at a time: 1 MiB
#: the most bytes of one coalesced read of the decode check (and of reads in flight: 8 of them)
VERIFY_READ_BYTES = 16 << 20


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
    #: information that is not a problem, e.g. a recording still in progress
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self):
        count = len(self.problems)
        head = f"{self.path}: {self.shards} shards, {self.chunks} chunks checked, {count} problem{'s' * (count != 1)}"
        if self.unpublished:
            head += f" ({len(self.unpublished)} shards past shape[0] ignored: written after the last published epoch)"
        return "\n".join([head] + [f"  {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes])


def verify(path, progress=None) -> VerifyReport:
    """Check every shard of the array at ``path`` (a path or zarr Store), or of every level of an
    OME-Zarr group; ``progress(done, total)``."""
    import zarr

    from .ome import _levels

    check_store_path(path)  # an argument error, not a finding: "" would check the current directory
    report = VerifyReport(str(path))
    try:
        access = StoreAccess(path)
        node = access.open_node("")
        levels = _levels(access, node)
        if levels is None and not isinstance(node, zarr.Array):
            raise ValueError("a group without OME-Zarr multiscales")
        arrays = [(f"{k}/", level) for k, level in enumerate(levels)] if levels is not None else [("", node)]
    except Exception as exc:  # noqa: BLE001 - every failure to open is a finding
        report.problems.append(Problem("zarr.json", None, f"cannot open as a Zarr v3 array or OME-Zarr group: {exc}"))
        return report
    done_before = 0  # shards of earlier levels, so progress keeps counting up across levels
    for label, array in arrays:

        def level_progress(done, total, base=done_before):
            if progress:
                progress(base + done, base + total)

        _verify_array(report, access, array, label, level_progress)
        done_before = report.shards + len(report.unpublished)
    return report


def _verify_array(report: VerifyReport, access, array, label: str, progress) -> None:
    """Add the findings for one array; keys are reported as ``label`` + key (``1/c/0/0/0``)."""
    problems_before = len(report.problems)
    unpublished_before = len(report.unpublished)
    _check_array(report, access, array, label, progress)
    for i in range(problems_before, len(report.problems)):
        problem = report.problems[i]
        report.problems[i] = Problem(label + problem.key, problem.chunk, problem.message)
    report.unpublished[unpublished_before:] = [label + k for k in report.unpublished[unpublished_before:]]


def _check_recording_state(report: VerifyReport, meta: dict, label: str) -> None:
    try:
        record = recording_state(meta.get("attributes"))
    except ValueError as exc:
        report.problems.append(Problem("zarr.json", None, str(exc)))
        return
    if record is None:  # written by another tool: nothing to compare
        return
    rows, state = record
    shape0 = meta["shape"][0] if meta.get("shape") else 0
    if rows < shape0:
        report.problems.append(
            Problem(
                "zarr.json",
                None,
                f"rows {rows}..{shape0 - 1} of {shape0} were never written (recording state: {state})",
            )
        )
    elif state != "complete":
        report.notes.append(
            f"{label}zarr.json: recording state {state!r}, {rows} rows written "
            "(a recording in progress, or one that stopped before it finished)"
        )


def _check_array(report: VerifyReport, access: StoreAccess, array, label: str, progress) -> None:
    meta = array.metadata.to_dict()
    _check_recording_state(report, meta, label)
    sharding = [c for c in meta.get("codecs", []) if c.get("name") == "sharding_indexed"]
    if not sharding:
        report.problems.append(Problem("zarr.json", None, "array is not sharded (no sharding_indexed codec)"))
        return
    config = sharding[0]["configuration"]
    codec = codecs.from_zarr_codecs(list(config["codecs"]), array.dtype)
    if (
        config.get("index_location", "end") != "end"
        or [c["name"] for c in config["index_codecs"]] != ["bytes", "crc32c"]
        or codec is None
    ):
        report.problems.append(Problem("zarr.json", None, f"unsupported sharding configuration {config}"))
        return
    shape = meta["shape"]
    shard_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
    chunk_shape = config["chunk_shape"]
    tile_bytes = math.prod(chunk_shape) * np.dtype(array.dtype).itemsize
    chunks_per_shard = math.prod(s // c for s, c in zip(shard_shape, chunk_shape))
    grid = [math.ceil(s / n) for s, n in zip(shape, shard_shape)]
    decode = codec.checks_content and tile_bytes <= MAX_DECODED_TILE_BYTES
    if codec.checks_content and not decode:
        report.problems.append(
            Problem(
                "zarr.json",
                None,
                f"tiles of {tile_bytes} bytes are larger than verify "
                f"decodes ({MAX_DECODED_TILE_BYTES} bytes): chunks "
                "checked for placement and size only",
            )
        )
    prefix = array.store_path.path
    base = f"{prefix}/" if prefix else ""
    listing = access.list_keys(base + "c")
    for key, reason in listing.refused:
        report.problems.append(Problem(key[len(base) :], None, reason))
    keys = sorted(k[len(base) :] for k in listing.keys)
    checker = _ShardChecker(report, chunks_per_shard, tile_bytes, codec, decode)
    try:
        _check_shards(report, access, base, keys, grid, shape, checker, progress)
    finally:
        checker.close()


def _check_shards(report, access, base, keys, grid, shape, checker, progress) -> None:
    for done, key in enumerate(keys):
        if progress:
            progress(done, len(keys))
        coords = key.split("/")[1:]
        if coords and coords[0].isdigit() and int(coords[0]) >= grid[0]:
            # past shape[0]: not published, so readers never look there (whatever it holds)
            report.unpublished.append(key)
            continue
        if len(coords) != len(shape) or not all(c.isdigit() for c in coords):
            report.problems.append(Problem(key, None, "not a shard key of this array"))
            continue
        if any(int(c) >= g for c, g in zip(coords[1:], grid[1:])):
            report.problems.append(Problem(key, None, f"shard lies outside the array shape {shape}"))
            continue
        try:
            with access.open_object(base + key) as shard:
                report.shards += 1
                checker.check(key, shard)
        except FileNotFoundError:
            continue  # removed since it was listed
        except UnsafeStoreError as exc:
            report.problems.append(Problem(key, None, str(exc)))
        except OSError as exc:
            report.problems.append(Problem(key, None, f"read error: {exc}"))
    if progress:
        progress(len(keys), len(keys))


class _ShardChecker:
    def __init__(self, report, chunks_per_shard, tile_bytes, codec, decode):
        self.report = report
        self.chunks = chunks_per_shard
        self.index_bytes = chunks_per_shard * 16 + 4
        self.tile_bytes = tile_bytes
        self.codec, self.decode = codec, decode
        self.min_chunk = codec.min_encoded_bytes(tile_bytes)
        self.max_chunk = codec.max_encoded_bytes(tile_bytes)
        from .read import reader_setting, workers_setting

        self.coalesce = reader_setting() != "zarr"
        self.workers = workers_setting()
        self.pool: ThreadPoolExecutor | None = None

    def check(self, key: str, shard) -> None:
        report, size = self.report, shard.size
        if size < self.index_bytes:
            report.problems.append(
                Problem(
                    key, None, f"shard of {size} bytes is shorter than its index ({self.index_bytes} bytes): truncated"
                )
            )
            return
        data_end = size - self.index_bytes
        found: list[Problem] = []
        crc = 0
        if self.chunks <= _INDEX_BLOCK_ENTRIES:  # the usual case: the whole index in one suffix read
            tail = shard.read_suffix(self.index_bytes)
            blocks: Iterable[tuple[int, int, Any]] = [(0, self.chunks, tail[:-4])]
            stored_crc = tail[-4:]
        else:  # a huge index is streamed, so memory stays bounded whatever the shard declares
            blocks = (
                (first, n, shard.read(data_end + first * 16, n * 16))
                for first in range(0, self.chunks, _INDEX_BLOCK_ENTRIES)
                for n in [min(_INDEX_BLOCK_ENTRIES, self.chunks - first)]
            )
            stored_crc = None
        for first, n, raw in blocks:
            if len(raw) != n * 16:
                found.append(Problem(key, None, "shard changed size while it was read"))
                break
            crc = crc32c.crc32c(raw, crc)
            to_decode: list[tuple[int, int, int]] = []
            # tolist(): Python ints, so offset + nbytes cannot wrap around 2^64
            for i, (offset, nbytes) in enumerate(np.frombuffer(raw, "<u8").reshape(-1, 2).tolist()):
                if self._check_chunk(shard, key, first + i, offset, nbytes, data_end, found):
                    to_decode.append((first + i, offset, nbytes))
            if to_decode:
                self._decode_coalesced(shard, key, to_decode, found)
                found.sort(key=lambda p: -1 if p.chunk is None else p.chunk)  # stable: chunk order
        if stored_crc is None:
            stored_crc = shard.read(size - 4, 4)
        if crc != int.from_bytes(stored_crc, "little"):
            found.insert(0, Problem(key, None, "index CRC32C mismatch"))
        report.problems.extend(found)

    def _check_chunk(self, shard, key, chunk, offset, nbytes, data_end, found) -> bool:
        """Check one index entry; True: it is to be decoded (by :meth:`_decode_coalesced`)."""
        if offset == _EMPTY and nbytes == _EMPTY:
            return False
        self.report.chunks += 1
        if offset == _EMPTY or nbytes == _EMPTY or offset + nbytes > data_end:
            found.append(
                Problem(
                    key,
                    chunk,
                    f"chunk (offset {offset}, {nbytes} bytes) lies outside the shard data ({data_end} bytes)",
                )
            )
        elif self.min_chunk == self.max_chunk != nbytes:
            found.append(Problem(key, chunk, f"holds {nbytes} bytes, a tile is {self.tile_bytes}"))
        elif nbytes > self.max_chunk:
            found.append(
                Problem(
                    key,
                    chunk,
                    f"holds {nbytes} bytes, more than {self.codec.name} makes of one tile "
                    f"of {self.tile_bytes} bytes (at most {self.max_chunk})",
                )
            )
        elif nbytes < self.min_chunk:
            found.append(
                Problem(
                    key,
                    chunk,
                    f"holds {nbytes} bytes, fewer than {self.codec.name} makes of one tile (at least {self.min_chunk})",
                )
            )
        elif self.decode and self.coalesce:
            return True  # placed plausibly: decoded with its neighbours by _decode_coalesced
        elif self.decode:
            try:  # the codec's decoder never allocates more than one tile
                self.codec.decode(shard.read(offset, nbytes), self.tile_bytes)
            except codecs.CodecError as exc:
                found.append(Problem(key, chunk, str(exc)))
        return False

    def _decode_coalesced(self, shard, key: str, chunks: list[tuple[int, int, int]], found) -> None:
        """Decode ``(chunk, offset, nbytes)`` (each inside the shard data, of a plausible size)
        from a few coalesced reads, the decoding on ``workers`` threads, 8 reads in flight."""
        from .read_plan import DEFAULT_GAP_BYTES, pack_runs

        numbers, offsets, sizes = (np.array(column, dtype=np.int64) for column in zip(*chunks))
        runs = pack_runs(offsets, sizes, DEFAULT_GAP_BYTES, VERIFY_READ_BYTES)
        codec, tile_bytes = self.codec, self.tile_bytes

        def decode_run(start: int, data: bytes, positions: np.ndarray) -> list[Problem]:
            problems = []
            view = memoryview(data)
            for p in positions.tolist():
                begin = int(offsets[p]) - start
                piece = view[begin : begin + int(sizes[p])]
                if len(piece) != sizes[p]:
                    problems.append(Problem(key, int(numbers[p]), "shard changed size while it was read"))
                    continue
                try:  # the codec's decoder never allocates more than one tile
                    codec.decode(piece, tile_bytes)
                except codecs.CodecError as exc:
                    problems.append(Problem(key, int(numbers[p]), str(exc)))
            return problems

        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tileshard-verify")
        pending = []
        for start, _, positions in runs:
            stop = int((offsets[positions] + sizes[positions]).max())  # overlapping chunks may end later
            pending.append(self.pool.submit(decode_run, start, shard.read(start, stop - start), positions))
            if len(pending) >= 8:
                found.extend(pending.pop(0).result())
        for future in pending:
            found.extend(future.result())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None
