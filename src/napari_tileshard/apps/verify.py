"""Integrity check of a sharded Zarr v3 array, shard by shard and chunk by chunk.

The store is untrusted (checking broken stores is the point), so memory and I/O follow what is
on disk, never what ``zarr.json`` declares: metadata is read through
:mod:`napari_tileshard.storage.safe_read` (regular files inside the store, size- and depth-capped), the
shard objects that exist are listed without following symlinks (a bogus huge ``shape`` costs
nothing; a symlink out of the store is reported, not read), and each shard is streamed: its index
with one suffix read (in blocks for huge indexes), then each chunk's byte range, one at a time.
The array's metadata and each shard index are checked by the format layer's
:class:`~napari_tileshard.format.ShardSpec`, as the reader checks them, but every problem is
reported, not just the first: the index size and CRC32C, that every chunk lies inside the shard
(without uint64 sums that could wrap), holds a plausible number of bytes for its codec and overlaps
no other; then each chunk decodes, with the codec's own bounded decoder, to exactly one tile
(never more is decoded; for zstd: one standard zstd frame).  The chunks that pass the placement checks are read as
:class:`~napari_tileshard.reader.shard_reader.ShardReader` reads them, in a few coalesced range reads per shard
(:func:`~napari_tileshard.reader.plan.pack_runs`, 16 MiB at most each), and decoded on threads;
``TILESHARD_READER=zarr`` goes back to one read per chunk.

The Writer's record in each array's attributes (``tileshard``: ``rows_written``, ``state``) is
checked too: rows inside the published shape that were never written are a problem.

A collection (``bioformats2raw.layout``: :class:`~napari_tileshard.engine.multi_writer.MultiWriter`,
:class:`~napari_tileshard.apps.mmcore.TileShardSink`, bioformats2raw) is checked image by image,
every level of each (:mod:`napari_tileshard.reader.collection` finds them); the report names each
image with its counts.  Nodes beside the images that are not images (a sink's ``frame_metadata``
table) are named in a note, not checked.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np

from ..format import EMPTY
from ..format.codecs import CodecError
from ..format.shard_spec import ShardIndexError, ShardSpec, UnsupportedArray
from ..reader.collection import CollectionImage, images_of, non_image_nodes
from ..reader.levels import _levels
from ..reader.plan import DEFAULT_GAP_BYTES, pack_runs
from ..reader.settings import reader_setting, workers_setting
from ..storage.safe_read import StoreAccess, UnsafeStoreError, recording_state
from ..storage.sinks import check_store_path
from .units import plural

__all__ = [
    "MAX_DECODED_TILE_BYTES",
    "VERIFY_READ_BYTES",
    "ImageReport",
    "Problem",
    "VerifyReport",
    "missing_store",
    "verify",
]

#: the largest tile verify decompresses to check it (a declared tile beyond it is reported)
MAX_DECODED_TILE_BYTES = 1 << 28
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
class ImageReport:
    """What was checked of one image of a collection (its problems are in the report's list, under
    keys that start with ``path/``)."""

    name: str
    path: str
    levels: int = 0
    shards: int = 0
    chunks: int = 0
    problems: int = 0

    def __str__(self):
        return (
            f"image {self.name!r} ({self.path}/): {plural(self.levels, 'level')}, {plural(self.shards, 'shard')}, "
            f"{plural(self.chunks, 'chunk')}, {plural(self.problems, 'problem')}"
        )


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
    #: a collection's images, each with its counts (empty for an array or a single OME-Zarr image)
    images: list[ImageReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @classmethod
    def problem(cls, error: ShardIndexError) -> Problem:
        """The record of a format-layer index error."""
        return Problem(error.key, error.chunk, error.reason)

    def __str__(self):
        count = len(self.problems)
        what = f"a collection of {plural(len(self.images), 'image')}, " if self.images else ""
        head = (
            f"{self.path}: {what}{plural(self.shards, 'shard')}, {plural(self.chunks, 'chunk')} checked, "
            f"{plural(count, 'problem')}"
        )
        if self.unpublished:
            ignored = plural(len(self.unpublished), "shard")
            head += f" ({ignored} past shape[0] ignored: written after the last published epoch)"
        lines = [head] + [f"  {image}" for image in self.images] + [f"  {p}" for p in self.problems]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def verify(path, progress=None) -> VerifyReport:
    """Check every shard of the array at ``path`` (a path, URL or zarr Store), of every level of an
    OME-Zarr image, or of every level of every image of a collection; ``progress(done, total)``."""
    import zarr

    check_store_path(path)  # an argument error, not a finding: "" would check the current directory
    report = VerifyReport(str(path))
    missing = missing_store(path)
    if missing:
        report.problems.append(Problem("zarr.json", None, missing))
        return report
    try:
        access = StoreAccess(path)
        node = access.open_node("")
        images = images_of(access, node)
        if images is None:
            levels = _levels(access, node)
            if levels is None and not isinstance(node, zarr.Array):
                raise ValueError("a group without OME-Zarr multiscales")
    except Exception as exc:  # noqa: BLE001 - every failure to open is a finding
        report.problems.append(
            Problem("zarr.json", None, f"cannot open as a Zarr v3 array, OME-Zarr image or collection: {exc}")
        )
        return report
    counter = _Progress(report, progress)
    if images is None:
        for array in levels if levels is not None else [node]:
            _verify_array(report, access, array, _label(array), counter.array())
        return report
    if not images:
        report.problems.append(Problem("zarr.json", None, "a collection without images"))
    for image in images:
        _verify_image(report, access, image, counter)
    others = non_image_nodes(access, images)
    if others:
        report.notes.append(f"not images, not checked: {', '.join(others)}")
    return report


def missing_store(path) -> str | None:
    """``"nope.zarr does not exist"`` when ``path`` is a local path (or file:// URL) with nothing
    there, else None (object stores and zarr Stores answer through their ``zarr.json``)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    text = str(os.fspath(path))
    if "://" in text and not text.startswith("file://"):
        return None
    if os.path.lexists(Path(text.removeprefix("file://")).expanduser()):
        return None
    return f"{path} does not exist"


def _label(array) -> str:
    """Where ``array``'s keys sit in the store (``0/`` for level 0 of an image, ``1/0/`` in a
    collection), so the report names keys from the store's root."""
    prefix = array.store_path.path
    return f"{prefix}/" if prefix else ""


class _Progress:
    """Shards done across all arrays checked, so progress keeps counting up from array to array."""

    def __init__(self, report: VerifyReport, progress):
        self.report, self.progress = report, progress

    def array(self):
        """The progress callback of the next array: its shards counted after those checked before it."""
        base = self.report.shards + len(self.report.unpublished)

        def report_progress(done, total) -> None:
            if self.progress:
                self.progress(base + done, base + total)

        return report_progress


def _verify_image(report: VerifyReport, access, image: CollectionImage, counter: _Progress) -> None:
    before = (report.shards, report.chunks, len(report.problems))
    entry = ImageReport(image.name, image.path, levels=len(image.levels or ()))
    if image.levels is None:
        report.problems.append(Problem(f"{image.path}/zarr.json", None, f"image {image.name!r}: {image.error}"))
    for array in image.levels or ():
        _verify_array(report, access, array, _label(array), counter.array())
    entry.shards, entry.chunks = report.shards - before[0], report.chunks - before[1]
    entry.problems = len(report.problems) - before[2]
    report.images.append(entry)


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
    try:
        spec = ShardSpec.from_metadata(meta)
    except UnsupportedArray as exc:
        report.problems.append(Problem("zarr.json", None, f"{exc}: not checked"))
        return
    tile_bytes = spec.chunk_bytes
    decode = spec.codec.checks_content and tile_bytes <= MAX_DECODED_TILE_BYTES
    if spec.codec.checks_content and not decode:
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
    checker = _ShardChecker(report, spec, decode)
    try:
        _check_shards(report, access, base, keys, list(spec.shard_grid), list(spec.shape), checker, progress)
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
    def __init__(self, report, spec: ShardSpec, decode: bool):
        self.report, self.spec = report, spec
        self.codec, self.tile_bytes, self.decode = spec.codec, spec.chunk_bytes, decode

        self.coalesce = reader_setting() != "zarr"
        self.workers = workers_setting()
        self.pool: ThreadPoolExecutor | None = None
        self._scratch = threading.local()  # per decode thread: one tile's buffer

    def check(self, key: str, shard) -> None:
        spec, size = self.spec, shard.size
        truncated = spec.truncated_error(key, size)
        if truncated is not None:
            self.report.problems.append(VerifyReport.problem(truncated))
            return
        found: list[Problem] = []
        at = spec.index_offset(size)
        if spec.chunks <= _INDEX_BLOCK_ENTRIES:  # the usual case: the whole index in one read
            raw = shard.read_suffix(spec.index_nbytes) if spec.index_at_end else shard.read(0, spec.index_nbytes)
            if len(raw) != spec.index_nbytes:
                found.append(Problem(key, None, "shard changed size while it was read"))
            else:
                index, problems = spec.index_problems(key, raw, size)
                found += [VerifyReport.problem(p) for p in problems]
                self.report.chunks += int(np.count_nonzero(_listed(spec, raw[: spec.chunks * 16])))
                if index is not None:
                    self._decode_valid(shard, key, index.offsets, index.nbytes, 0, found)
        else:  # a huge index is streamed, so memory stays bounded whatever the shard declares
            # (chunks are checked block by block: overlaps across blocks are not looked for)
            crc = 0
            for first in range(0, spec.chunks, _INDEX_BLOCK_ENTRIES):
                n = min(_INDEX_BLOCK_ENTRIES, spec.chunks - first)
                body = shard.read(at + first * 16, n * 16)
                if len(body) != n * 16:
                    found.append(Problem(key, None, "shard changed size while it was read"))
                    break
                crc = crc32c.crc32c(body, crc)
                offsets, nbytes = spec.entries(body)
                valid, problems = spec.entry_problems(key, offsets, nbytes, size, first=first)
                found += [VerifyReport.problem(p) for p in problems]
                self.report.chunks += int(np.count_nonzero(_listed(spec, body)))
                self._decode_valid(
                    shard, key, np.where(valid, offsets, 0), np.where(valid, nbytes, 0), first, found, valid
                )
            else:
                mismatch = spec.crc_error(key, crc, shard.read(at + spec.chunks * 16, 4)) if spec.index_crc else None
                if mismatch is not None:
                    found.append(VerifyReport.problem(mismatch))
        found.sort(key=lambda p: -1 if p.chunk is None else p.chunk)  # stable: the index's, then by chunk
        self.report.problems.extend(found)

    def _decode_valid(self, shard, key, offsets, nbytes, first, found, valid=None) -> None:
        """Decode the chunks ``first + i`` that passed the index checks (``nbytes >= 0``, or
        ``valid``) and add what fails."""
        if not self.decode:
            return
        chosen = np.flatnonzero(valid if valid is not None else np.asarray(nbytes) >= 0)
        chunks = [(first + i, int(offsets[i]), int(nbytes[i])) for i in chosen.tolist()]
        if not chunks:
            return
        if self.coalesce:
            self._decode_coalesced(shard, key, chunks, found)
            return
        for chunk, offset, size in chunks:  # TILESHARD_READER=zarr: one read per chunk
            try:  # the codec's decoder never allocates more than one tile
                self.codec.decode_into(shard.read(offset, size), self._tile())
            except CodecError as exc:
                found.append(Problem(key, chunk, str(exc)))

    def _tile(self) -> np.ndarray:
        tile = getattr(self._scratch, "tile", None)
        if tile is None:
            tile = self._scratch.tile = np.empty(self.tile_bytes, dtype=np.uint8)
        return tile

    def _decode_coalesced(self, shard, key: str, chunks: list[tuple[int, int, int]], found) -> None:
        """Decode ``(chunk, offset, nbytes)`` (each inside the shard data, of a plausible size)
        from a few coalesced reads, the decoding on ``workers`` threads, 8 reads in flight."""
        numbers, offsets, sizes = (np.array(column, dtype=np.int64) for column in zip(*chunks))
        runs = pack_runs(offsets, sizes, DEFAULT_GAP_BYTES, VERIFY_READ_BYTES)
        codec = self.codec

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
                    codec.decode_into(piece, self._tile())
                except CodecError as exc:
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


def _listed(spec: ShardSpec, body) -> np.ndarray:
    """Which entries of index entries ``body`` list a chunk (not both halves empty)."""
    offsets, nbytes = spec.entries(body)
    return ~((offsets == np.uint64(EMPTY)) & (nbytes == np.uint64(EMPTY)))
