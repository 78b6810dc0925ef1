"""Convert existing data into sharded Zarr v3 / OME-Zarr on Dask: one task per shard epoch.

A shard epoch (``layout.shard_epoch_rows`` rows along dim 0) is the unit of work: every shard of
every pyramid level in it is written by exactly one task, so no shard is ever written by two
tasks (what corrupts ``dask.array.to_zarr`` into shards that do not align with its chunks).  A
task reads its rows from the source, runs a :class:`~napari_tileshard.engine.writer.Writer` (the same
backend stages as a live recording, GPU on GPU workers) over a bounded sub-array of those rows,
and writes its shards under their global keys through a :class:`_EpochSink`, which drops the
sub-array's own ``zarr.json``.  The coordinator holds the store (lock, overwrite rules), and a
:class:`~napari_tileshard.engine.publish.Publisher` advances ``zarr.json`` over the contiguous prefix of
finished epochs, exactly as while recording: a reader never sees rows whose shards are missing.
A manifest (``.tileshard-convert.json``), written before the first task, records the source's
identity, the options and the finished epochs: ``resume=True`` refuses another source, reuses the
options and skips the finished epochs.

The clusters convert starts itself run their workers with Dask's profiler off (CPython bug
gh-106883 deadlocks a worker whose profiler samples while tasks start and stop threads, on Python
< 3.11.9) and preload this module (:func:`dask_setup`): a worker process dies with the process that
started it, SIGKILL included, and leaves Ctrl-C to it.  Ctrl-C (``KeyboardInterrupt``) stops a
conversion cleanly: epochs not finished are dropped, the store claims the finished ones, and
:class:`ConvertInterrupted` carries the report.

Pyramid levels are built within each task from its rows, which is exact when dim 0 is not
reduced (``downsample_dims`` must leave it out: a task's rows are one shard epoch).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import glob
import hashlib
import json
import logging
import math
import multiprocessing
import numbers
import os
import signal
import struct
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.backends import gpu_unavailable_reason, resolve_devices
from ..engine.options import EngineOptions, normalize_devices
from ..engine.publish import Publisher
from ..engine.writer import Writer, compression_ratio
from ..format.array_spec import ArraySpec
from ..format.layout import Dim, Layout, TilingWarning
from ..format.metadata import METADATA_KEY, metadata_bytes
from ..format.ome import group_metadata, multiscale_paths
from ..reader.levels import open_root
from ..storage.errors import StoreExistsError
from ..storage.overwrite import CONVERT_MANIFEST_NAME
from ..storage.overwrite import OVERWRITE_HINT as _OVERWRITE_HINT
from ..storage.places import overlap, places_read_by
from ..storage.sinks import DirectorySink, Sink, ZarrStoreSink, byte_views, check_key
from ..storage.urls import open_sink, resolve_store
from .verify import verify as verify_store

__all__ = [
    "ConvertInterrupted",
    "ConvertReport",
    "DEFAULT_OPTIONS",
    "MANIFEST_FORMAT",
    "MANIFEST_KEY",
    "ResumeMismatch",
    "Source",
    "WORKER_CONFIG",
    "convert",
    "dask_setup",
    "default_layout",
    "gpu_cluster",
    "gpu_numbers",
    "local_cluster",
    "open_source",
    "source_identity",
    "warn_if_the_profiler_can_deadlock",
    "worker_options",
    "write_shard_epoch",
]

log = logging.getLogger(__name__)

MANIFEST_KEY = CONVERT_MANIFEST_NAME
#: seconds a conversion waits while its cluster has no worker (convert's ``worker_timeout``)
WORKER_TIMEOUT_S = 60.0
_TIFF_SUFFIXES = (".tif", ".tiff")


# -- sources ----------------------------------------------------------------------------------
@dataclass
class Source:
    """What a task reads from, re-opened in each task (picklable: a path, or the array itself)."""

    kind: str  # "zarr", "tiff", "tiff-folder", "array"
    shape: tuple
    dtype: np.dtype
    location: Any = None  # path/URL, a list of files, or the array-like
    names: tuple | None = None
    chunks: Any = None  # the source's own chunking, as it reports it (identity only)

    def read(self, start: int, stop: int) -> np.ndarray:
        if self.kind == "array":
            block = self.location[start:stop]
            compute = getattr(block, "compute", None)
            return np.ascontiguousarray(compute(scheduler="sync") if compute else block, dtype=self.dtype)
        if self.kind == "tiff-folder":
            import tifffile

            frames = [tifffile.imread(f) for f in self.location[start:stop]]
            for f, frame in zip(self.location[start:stop], frames):
                if frame.shape != self.shape[1:] or frame.dtype != self.dtype:
                    raise ValueError(
                        f"{f}: shape {frame.shape} {frame.dtype}, the folder's first file has "
                        f"{self.shape[1:]} {self.dtype}"
                    )
            return np.ascontiguousarray(np.stack(frames))
        return np.ascontiguousarray(_open_array(self.kind, self.location)[start:stop])


def _open_array(kind: str, location):
    import zarr

    if kind == "tiff":
        import tifffile

        return zarr.open(tifffile.imread(location, aszarr=True), mode="r")
    _, node = open_root(location)  # zarr.json read as carefully as a reader does, then zarr-python
    if isinstance(node, zarr.Group):  # OME-Zarr: its first multiscale level
        try:
            paths = multiscale_paths(dict(node.attrs)) or multiscale_paths({"ome": dict(node.attrs)})  # 0.5, 0.4
        except ValueError as exc:
            raise ValueError(f"{location}: {exc}") from None
        if not paths:
            raise ValueError(f"{location}: a zarr group without OME multiscales; name one of its arrays")
        node = node[paths[0]]
    return node


def open_source(src) -> Source:
    """A :class:`Source` for a zarr v2/v3 array or OME-Zarr (path or URL), a TIFF / OME-TIFF file,
    a folder of TIFF files (one frame each, in name order) or any array-like (NumPy, dask, ...)."""
    if not isinstance(src, (str, os.PathLike)):
        if not hasattr(src, "shape") or not hasattr(src, "dtype"):
            raise TypeError(f"src must be a path, a URL or an array-like, got {type(src).__name__}")
        chunks = getattr(src, "chunksize", None) or getattr(src, "chunks", None)  # dask, zarr, h5py...
        return Source("array", tuple(src.shape), np.dtype(src.dtype), src, chunks=_jsonable(chunks))
    path = str(src)
    if "://" not in path and Path(path).is_dir() and not _is_zarr(Path(path)):
        files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.lower().endswith(_TIFF_SUFFIXES))
        if not files:
            raise ValueError(f"{path} is neither a zarr store nor a folder of TIFF files")
        import tifffile

        first = tifffile.imread(files[0])
        _check_tiff_headers(files, first.shape, first.dtype)
        return Source("tiff-folder", (len(files), *first.shape), first.dtype, files, chunks=[1, *first.shape])
    if path.lower().endswith(_TIFF_SUFFIXES):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist")
        array = _open_array("tiff", path)
        return Source("tiff", tuple(array.shape), np.dtype(array.dtype), path, chunks=_jsonable(array.chunks))
    if "://" not in path and not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist")
    array = _open_array("zarr", path)
    names = getattr(array.metadata, "dimension_names", None)
    chunks = {"chunks": _jsonable(array.chunks), "shards": _jsonable(getattr(array, "shards", None))}
    return Source(
        "zarr", tuple(array.shape), np.dtype(array.dtype), path, tuple(names) if names else None, chunks=chunks
    )


def _check_tiff_headers(files: list[str], shape: tuple, dtype) -> None:
    """Every file of a TIFF folder opens and holds one frame like the first, checked from the
    headers before anything is written (threads: thousands of files): an unreadable or odd file
    is named before the output exists, not found by a task half way through."""
    from concurrent.futures import ThreadPoolExecutor

    import tifffile

    def header(f: str):
        try:
            with tifffile.TiffFile(f) as tif:
                page = tif.pages.first
                return f, tuple(page.shape), np.dtype(page.dtype), None
        except Exception as exc:  # noqa: BLE001 - reported with the file's name below
            return f, None, None, exc

    with ThreadPoolExecutor(8) as pool:
        for f, page_shape, page_dtype, exc in pool.map(header, files):
            if exc is not None:
                raise ValueError(f"{f}: not a readable TIFF file ({type(exc).__name__}: {exc})") from exc
            if page_shape != tuple(shape) or page_dtype != dtype:
                raise ValueError(
                    f"{f}: shape {page_shape} {page_dtype}, the folder's first file has {tuple(shape)} {dtype}"
                )


def _is_zarr(path: Path) -> bool:
    return (path / "zarr.json").is_file() or (path / ".zarray").is_file() or (path / ".zgroup").is_file()


# -- the source's identity (what a resume must find again) ---------------------------------------
#: what each identity field is called in the message that refuses a resume with another source
_IDENTITY_FIELDS = {
    "kind": "kind",
    "location": "location",
    "shape": "shape",
    "dtype": "dtype",
    "chunks": "chunks",
    "metadata": "metadata hash",
    "size": "size",
    "mtime_ns": "modification time",
    "header": "header hash",
    "files": "files",
    "names": "file names hash",
    "stats": "file sizes and modification times hash",
    "sample": "hash of its first and last rows",
}
_SAMPLE_ROWS_BYTES = 16 << 20  # an array-like's sample: its first and last row, at most this much each


def source_identity(source: Source) -> dict:
    """What identifies ``source`` for a resume (JSON): location (absolute path or URL; none for an
    array-like), shape, dtype, chunking and a fingerprint: for zarr a hash of its metadata
    (``zarr.json``, or ``.zarray`` and ``.zattrs``; an OME-Zarr group's and its first level's); for
    a TIFF file its size, modification time and a hash of its header and first IFD; for a TIFF
    folder its file count and hashes of the file names and of their sizes and modification times;
    for an array-like a hash of its first and last rows (it has no location: another array of the
    same shape, dtype, chunks and first and last rows is taken for it)."""
    identity: dict[str, Any] = {
        "kind": source.kind,
        "location": _absolute(source.location) if source.kind in ("zarr", "tiff") else None,
        "shape": list(source.shape),
        "dtype": source.dtype.str,
        "chunks": _jsonable(source.chunks),
    }
    if source.kind == "zarr":
        identity["metadata"] = _zarr_metadata_hash(source.location)
    elif source.kind == "tiff":
        st = os.stat(source.location)
        identity.update(size=st.st_size, mtime_ns=st.st_mtime_ns, header=_tiff_header_hash(source.location))
    elif source.kind == "tiff-folder":
        identity["location"] = _absolute(os.path.dirname(source.location[0]))
        names, stats = hashlib.sha256(), hashlib.sha256()
        for f in source.location:
            st = os.stat(f)
            names.update(os.path.basename(f).encode() + b"\0")
            stats.update(f"{st.st_size} {st.st_mtime_ns}\0".encode())
        identity.update(files=len(source.location), names=names.hexdigest(), stats=stats.hexdigest())
    else:
        sample = hashlib.sha256()
        rows = source.shape[0] if source.shape else 0
        for row in sorted({0, rows - 1}) if rows else ():
            block = source.read(row, row + 1)
            sample.update(np.ascontiguousarray(block).reshape(-1).view(np.uint8)[:_SAMPLE_ROWS_BYTES].tobytes())
        identity["sample"] = sample.hexdigest()
    return identity


def _absolute(location) -> str:
    text = str(location)
    if "://" in text and not text.startswith("file://"):
        return text.rstrip("/")
    return str(Path(text.removeprefix("file://")).expanduser().resolve())


def _jsonable(value):
    """Tuples (of tuples) as lists, numbers as ints: what a JSON round trip gives back."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return str(value)


def _zarr_metadata_hash(location) -> str:
    """A hash of the metadata of the zarr array convert reads (and of its OME-Zarr group)."""
    import zarr

    node = zarr.open(resolve_store(location), mode="r")
    documents = {}
    if isinstance(node, zarr.Group):
        documents["group"] = node.metadata.to_dict()
        node = _open_array("zarr", location)
    documents["array"] = node.metadata.to_dict()
    documents["attributes"] = dict(node.attrs)  # zarr v2: .zattrs
    text = json.dumps(documents, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _tiff_header_hash(path) -> str:
    """A hash of a TIFF file's header and first IFD (its tags and their values or offsets)."""
    import tifffile

    digest = hashlib.sha256()
    with tifffile.TiffFile(path) as tif:
        fh, fmt = tif.filehandle, tif.tiff
        fh.seek(0)
        digest.update(fh.read(16))
        offset = tif.pages.first.offset
        fh.seek(offset)
        (count,) = struct.unpack(fmt.tagnoformat, fh.read(fmt.tagnosize))
        digest.update(f"{offset} {count}".encode())
        digest.update(fh.read(min(count, 1 << 16) * fmt.tagsize + fmt.offsetsize))
    return digest.hexdigest()


def _identity_differences(now: dict, then: dict) -> list[str]:
    differences = []
    for key, label in _IDENTITY_FIELDS.items():
        a, b = now.get(key), then.get(key)
        if a != b:
            differences.append(f"{label} {_show(key, a)} vs {_show(key, b)}")
    return differences


def _show(key: str, value) -> str:
    if value is None:
        return "none"
    if key == "dtype":
        return str(np.dtype(value))
    if key in ("shape", "chunks") and isinstance(value, list):
        return str(tuple(tuple(v) if isinstance(v, list) else v for v in value))
    if key == "mtime_ns":
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value / 1e9)) + f".{value % 10**9:09d}"
    if key in ("metadata", "header", "names", "stats", "sample"):
        return str(value)[:12]
    return str(value)


def default_layout(source: Source, tile=None, tiles_per_shard=None, names=None) -> Layout:
    """The package's one tiling of the source (:meth:`Layout.default_for`, dims named after the
    source's where it names them), with ``tile`` / ``tiles_per_shard`` (one value per dim) where
    given: checked, and tiles larger than their dim clamped with a TilingWarning, as everywhere."""
    return Layout.default_for(
        source.shape, source.dtype, names or source.names, tile=tile, tiles_per_shard=tiles_per_shard
    )


# -- tasks -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _TaskSpec:
    """What a task needs besides its rows (picklable): where, what (the array) and how (the engine)."""

    dst: str
    storage_options: dict | None
    array: ArraySpec
    options: EngineOptions

    @property
    def layout(self) -> Layout:
        return self.array.layout


class _EpochSink(Sink):
    """The store seen by one task's Writer: its shards go under their global keys (shard epoch
    ``epoch`` along dim 0), its own ``zarr.json`` files are dropped (the coordinator publishes).

    Keys are a Writer's: ``zarr.json`` (dropped) and shard keys ``[<path>/]c/<i>/...`` (``i``
    shifted by ``epoch``); any other key is a ValueError.  ``release``/``discard``/``cancel`` are
    no-ops: the coordinator holds the store and decides what stays."""

    def __init__(self, target: Sink, epoch: int):
        self._target = target
        self._epoch = epoch
        self.keys: list[str] = []
        self.bytes = 0
        self._written: dict[str, int] = {}  # bytes of each key, counted once however often it was written
        self._count_lock = threading.Lock()  # the Writer's I/O threads write at once

    def __repr__(self):
        return f"_EpochSink({self._target!r}, epoch={self._epoch})"

    @property
    def location(self) -> str:
        return self._target.location

    def global_key(self, key: str) -> str:
        """Where shard ``key`` of this task's sub-array lies in the whole array."""
        prefix, separator, coords = check_key(key).rpartition("c/")
        first, _, rest = coords.partition("/")
        if not separator or (prefix and not prefix.endswith("/")) or not first.isdigit():
            raise ValueError(f"a conversion task writes zarr.json and shard keys ('[path/]c/<i>/...'), got {key!r}")
        return f"{prefix}c/{int(first) + self._epoch}" + (f"/{rest}" if rest else "")

    def write(self, key: str, buffers) -> None:
        if check_key(key).rsplit("/", 1)[-1] == METADATA_KEY:
            return
        views = byte_views(key, buffers)  # refused under the name the Writer gave
        key = self.global_key(key)
        self._target.write(key, views)
        nbytes = sum(view.nbytes for view in views)
        with self._count_lock:  # a hedged write (a second copy of a slow one) is the same shard
            if key not in self._written:
                self.keys.append(key)
            self.bytes += nbytes - self._written.get(key, 0)
            self._written[key] = nbytes


def _attach(dst: str, storage_options) -> Sink:
    """A writer into a store the coordinator holds (its lock, its overwrite decision)."""
    if "://" in dst and not dst.startswith("file://"):
        return ZarrStoreSink.attach(resolve_store(dst, read_only=False, storage_options=storage_options))
    return DirectorySink.attach(dst.removeprefix("file://"))


def write_shard_epoch(source: Source, epoch: int, spec: _TaskSpec) -> dict:
    """One task: rows of shard epoch ``epoch`` from ``source`` into the shards of ``spec.dst``."""
    layout = spec.layout
    rows = layout.shard_epoch_rows
    start, stop = epoch * rows, min((epoch + 1) * rows, layout.shape[0])
    t0 = time.perf_counter()
    block = source.read(start, stop)
    if block.shape != (stop - start, *layout.shape[1:]) or block.dtype != layout.dtype:
        raise ValueError(
            f"rows {start}:{stop} of the source read as {block.shape} {block.dtype}, "
            f"expected {(stop - start, *layout.shape[1:])} {layout.dtype}"
        )
    read_s = time.perf_counter() - t0
    # A GPU worker runs several tasks at once so that their reads (decompression of the source,
    # mostly GIL-free) overlap, but one Writer at a time has its GPU: it then gets the whole
    # device and the buffers kept warm for the next task (one set per GPU) are never contended.
    with _GPU_WRITER_LOCK if spec.options.backend == "gpu" else contextlib.nullcontext():
        wait_s = time.perf_counter() - t0 - read_s
        return _encode_epoch(block, epoch, spec, start, stop, t0, read_s, wait_s)


#: serialises the GPU part of tasks within one worker process (see write_shard_epoch)
_GPU_WRITER_LOCK = threading.Lock()


def _encode_epoch(block, epoch, spec, start, stop, t0, read_s, wait_s) -> dict:
    layout = spec.layout
    sub = Layout([replace(layout.dims[0], size=stop - start), *layout.dims[1:]], layout.dtype)
    sink = _EpochSink(_attach(spec.dst, spec.storage_options), epoch)
    with Writer(sink, spec.array.with_layout(sub), spec.options) as writer:
        writer.append(block)
    return {
        "epoch": epoch,
        "bytes_in": block.nbytes,
        "bytes_out": sink.bytes,
        "pyramid_bytes_out": writer.stats.pyramid_bytes_out,
        "keys": sink.keys,
        "read_s": read_s,
        "wait_s": wait_s,
        "seconds": time.perf_counter() - t0,
        "backend": writer.stats.backend,
    }


# -- the coordinator ---------------------------------------------------------------------------
@dataclass
class ConvertReport:
    destination: str
    shards: int = 0
    epochs: int = 0
    epochs_skipped: int = 0  # already done (resume)
    epochs_written: int = 0  # finished by this run
    bytes_in: int = 0
    bytes_out: int = 0  # every shard written, pyramid levels included
    pyramid_bytes_out: int = 0  # of those, the shards of pyramid levels 1, 2, ... (OME-Zarr)
    seconds: float = 0.0
    backends: set = field(default_factory=set)
    read_seconds: float = 0.0  # summed over tasks: reading the source
    task_seconds: float = 0.0  # summed over tasks: read + wait for the GPU + encode + write
    keys: list = field(default_factory=list)  # every shard key written by a task, in task order
    verified: Any = None  # VerifyReport when verify=True
    rows: int = 0  # rows along dim 0 of the source
    rows_claimed: int = 0  # rows the store's zarr.json claims (a contiguous prefix of finished epochs)
    interrupted: bool = False  # stopped by Ctrl-C / KeyboardInterrupt (see ConvertInterrupted)

    @property
    def epochs_done(self) -> int:
        return self.epochs_skipped + self.epochs_written

    @property
    def gbps(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def compression_ratio(self) -> float:
        """Bytes read over the full-resolution bytes written by this run (pyramid levels are in
        :attr:`pyramid_bytes_out`, left out so the ratio means the same with and without them);
        NaN when it wrote nothing (a resume of a finished conversion)."""
        return compression_ratio(self.bytes_in, self.bytes_out, self.pyramid_bytes_out)


class ConvertInterrupted(KeyboardInterrupt):
    """A conversion stopped by Ctrl-C (or an exception derived from KeyboardInterrupt, such as the
    command line's SIGTERM): what was finished is in the store and its manifest, ``report`` says
    how far it got and ``resume=True`` continues it.  ``signum``: the signal (SIGINT by default,
    or the ``signum`` attribute of the KeyboardInterrupt that stopped it)."""

    def __init__(self, report: ConvertReport, signum: int, started: bool):
        super().__init__(f"conversion into {report.destination} interrupted")
        self.report = report
        self.signum = signum
        self.started = started  # the destination and its manifest exist: resume=True continues


class ResumeMismatch(ValueError):
    """``resume=True`` with an option that differs from the one the conversion started with."""

    def __init__(self, option: str, given, used):
        super().__init__(f"{option}={given!r}, but this conversion used {used!r}")
        self.option, self.given, self.used = option, given, used


#: options a conversion is started with; None in convert()'s signature means: these (a new
#: conversion) or the ones the manifest records (resume=True)
DEFAULT_OPTIONS: dict[str, Any] = {
    "codec": "zstd",
    "level": 1,
    "backend": "auto",
    "ome": False,
    "downsample": "mean",
    "downsample_dims": None,
    "max_levels": None,
    "attributes": None,
}
#: options a resume may change: they decide where the work runs, not what the store holds
_EXECUTION_OPTIONS = ("backend",)
_START_OVER = "to start over, convert with overwrite=True (--overwrite on the command line) instead of resuming"
MANIFEST_FORMAT = 2


def convert(
    src,
    dst,
    layout: Layout | None = None,
    *,
    tile=None,
    tiles_per_shard=None,
    codec: str | None = None,
    level: int | None = None,
    backend: str | None = None,
    ome: bool | None = None,
    downsample: str | None = None,
    downsample_dims=None,
    max_levels: int | None = None,
    attributes: dict | None = None,
    client=None,
    local_workers: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    verify: bool = True,
    retries: int = 2,
    storage_options: dict | None = None,
    progress=None,
    devices=None,
    announce=None,
    worker_timeout: float = WORKER_TIMEOUT_S,
) -> ConvertReport:
    """Convert ``src`` (see :func:`open_source`) into ``dst`` with ``layout`` (default:
    :func:`default_layout` from ``tile``/``tiles_per_shard``) on a Dask ``client`` (default: a
    ``LocalCluster`` of ``local_workers`` processes, see :func:`local_cluster`).

    Options left None take the defaults of :data:`DEFAULT_OPTIONS` (codec zstd level 1, backend
    auto, no OME pyramid, mean downsampling).  ``resume=True`` continues a conversion into ``dst``
    that stopped: it refuses a source other than the one recorded in the manifest (naming what
    differs, see :func:`source_identity`), reuses the recorded layout and options where they are
    None here and refuses one that differs (:class:`ResumeMismatch`; ``backend`` may change), and
    skips the shard epochs the manifest lists as finished.

    ``progress``: a callable ``(epochs done, epochs)``, first called when the tasks are submitted
    (work starts), then after each finished epoch.  ``devices`` (``"all"``, a count or GPU numbers;
    no ``client``): a local cluster of one worker per GPU (:func:`gpu_cluster`) whose tasks use the
    GPU backend.  ``announce``: called with the Dask dashboard's address once the cluster is up.
    ``local_workers`` (at least 1) and ``retries`` (0 or more: how often Dask reruns a failed
    epoch's task) are checked before anything is opened.  ``worker_timeout``: seconds the
    conversion waits while its cluster has no worker (none started, or all gone) before it stops
    with an error saying so.

    Ctrl-C (any ``KeyboardInterrupt``) stops the conversion cleanly and raises
    :class:`ConvertInterrupted`: queued and running epochs are dropped (Dask cannot stop a task
    already running on a cluster of yours: it still writes its epoch's shards, which nothing
    claims and a resume rewrites), the store claims only finished epochs, the manifest lists them.

    Returns a :class:`ConvertReport` (verified with :func:`~napari_tileshard.apps.verify` unless
    ``verify=False``)."""
    started = False
    report = ConvertReport(str(dst))
    start = time.perf_counter()
    _refuse_a_worker_bootstrap()
    try:
        check_run_options(client, local_workers, retries, worker_timeout)
        source = open_source(src)
        refuse_writing_into_the_source(src, dst)
        identity = source_identity(source)
        return _convert(
            source,
            identity,
            str(dst),
            layout,
            dict(tile=tile, tiles_per_shard=tiles_per_shard),
            dict(
                codec=codec,
                level=level,
                backend=backend,
                ome=ome,
                downsample=downsample,
                downsample_dims=downsample_dims,
                max_levels=max_levels,
                attributes=attributes,
            ),
            report,
            start,
            client=client,
            local_workers=local_workers,
            overwrite=overwrite,
            resume=resume,
            verify=verify,
            retries=retries,
            storage_options=storage_options,
            progress=progress,
            devices=devices,
            announce=announce,
            worker_timeout=worker_timeout,
        )
    except _Stopped as stop:
        started = stop.started
        exc = stop.cause
    except KeyboardInterrupt as interrupt:  # before the destination was opened
        exc = interrupt
    report.interrupted = True
    report.seconds = report.seconds or time.perf_counter() - start
    raise ConvertInterrupted(report, int(getattr(exc, "signum", signal.SIGINT)), started) from None


def check_run_options(client, local_workers, retries, worker_timeout: float) -> None:
    """ValueError naming the first option that cannot run: a local cluster needs at least one
    worker (``LocalCluster(n_workers=-1)`` starts none, and the conversion would wait for good),
    retries cannot be negative, a deadline must be positive."""
    if local_workers is not None:
        if isinstance(local_workers, bool) or not isinstance(local_workers, numbers.Integral) or local_workers < 1:
            raise ValueError(f"local_workers must be a positive number of worker processes, got {local_workers!r}")
        if client is not None:
            raise ValueError("local_workers= starts a local cluster; with client= the cluster is yours")
    if isinstance(retries, bool) or not isinstance(retries, numbers.Integral) or retries < 0:
        raise ValueError(f"retries must be 0 or more (reruns of a failed task), got {retries!r}")
    if isinstance(worker_timeout, bool) or not isinstance(worker_timeout, (int, float)) or not worker_timeout > 0:
        raise ValueError(f"worker_timeout must be a positive number of seconds, got {worker_timeout!r}")


class ClusterStartError(RuntimeError):
    """The local cluster convert starts did not come up (nothing was converted)."""


def _cluster_start_failure(exc: BaseException) -> str:
    """One line for a local cluster that did not start; where the program is a script, what the
    usual cause is: its worker processes import the script again (multiprocessing's spawn), which
    calls convert() again unless the call is under ``if __name__ == "__main__":``."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) if getattr(main, "__spec__", None) is None else None
    cause = str(exc).splitlines()[0] if str(exc) else ""
    text = f"the local Dask cluster did not start ({type(exc).__name__}: {cause})"
    if script:
        text += (
            f"; in a script such as {os.path.basename(script)}, call convert() under "
            "'if __name__ == \"__main__\":' (each worker process imports the script again); nothing was written"
        )
    return text


def _refuse_a_worker_bootstrap() -> None:
    """In a process that multiprocessing is still starting (a Dask worker importing the user's
    script again, spawn's re-import of ``__main__``), convert() must not run: it would start
    clusters of its own and touch the destination.  Exits that process at once and quietly; the
    conversion that started it reports the cause (:func:`_cluster_start_failure`).  The flag read
    is the one multiprocessing's own check of this mistake reads."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise SystemExit(1)


class _WorkerWatch:
    """Cancels the conversion's futures when its cluster has had no worker for ``timeout`` seconds
    (a scheduler nobody started workers for, or every worker gone): Dask would wait for one for
    good.  Checks once a second on its own thread; :attr:`reason` says why it cancelled."""

    def __init__(self, client, futures, timeout: float):
        self.client, self.futures, self.timeout = client, list(futures), timeout
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tileshard-convert-workers", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        since = time.monotonic()
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            try:
                workers = len(self.client.nthreads())
            except Exception:  # noqa: BLE001 - the client closing: the conversion ends anyway
                return
            if workers:
                since = time.monotonic()
            elif time.monotonic() - since >= self.timeout:
                address = getattr(self.client.scheduler, "address", "the scheduler")
                self.reason = (
                    f"no Dask worker was connected to {address} for {self.timeout:g} s: start workers for it "
                    "(dask worker ADDRESS), or let convert start a local cluster (without client= or --scheduler)"
                )
                with contextlib.suppress(Exception):
                    self.client.cancel(self.futures, reason="no workers", msg=self.reason)
                return

    def stop(self) -> None:
        self._stop.set()


class SameLocationError(ValueError):
    """The destination of a conversion is its source, or inside it, or contains it."""


def refuse_writing_into_the_source(src, dst) -> None:
    """Raise :class:`SameLocationError` when ``dst`` is where ``src`` is read from (the same path,
    URL or prefix in any spelling, a symlink to it, a parent or a child of it; see
    :func:`~napari_tileshard.storage.places.overlap`), whatever ``overwrite`` says: converting a
    store into itself would replace the data it is reading."""
    for place in places_read_by(src):
        how = overlap(place, dst)
        if how:
            raise SameLocationError(
                f"the destination {str(dst)!r} {how} ({place}): a conversion never writes where it reads; "
                "choose a destination outside the source"
            )


def _task_failure(epoch: int, future, result) -> BaseException | None:
    """The exception of a shard epoch's task from what ``as_completed(with_results=True,
    raise_errors=False)`` gave instead of its result (Dask's ``(type, exception, traceback)``, or
    the ``CancelledError`` itself); None when the worker died before the result came and Dask has
    the future pending again: it recomputes the task."""
    exc = result[1] if isinstance(result, tuple) and len(result) == 3 else result
    if isinstance(exc, BaseException):
        return exc
    if future.status in ("pending", "lost", "processing"):
        return None
    return RuntimeError(f"the task of shard epoch {epoch} gave no result ({result!r})")


class _Stopped(Exception):
    """Internal: a KeyboardInterrupt after the cleanup it needed (carries the interrupt)."""

    def __init__(self, cause: KeyboardInterrupt, started: bool):
        super().__init__()
        self.cause, self.started = cause, started


def _convert(
    source: Source,
    identity: dict,
    dst: str,
    layout: Layout | None,
    shape_options: dict,
    given: dict,
    report: ConvertReport,
    start: float,
    *,
    client,
    local_workers,
    overwrite,
    resume,
    verify,
    retries,
    storage_options,
    progress,
    devices,
    announce,
    worker_timeout,
) -> ConvertReport:
    from distributed import Client, as_completed

    if resume and overwrite:
        raise ValueError(
            "resume=True (--resume on the command line) continues an earlier conversion; it cannot be combined "
            "with overwrite=True (--overwrite on the command line), which starts over"
        )
    if devices is not None:
        if client is not None:
            raise ValueError("devices= starts a local cluster of GPU workers; with client= the cluster is yours")
        if given["backend"] == "cpu":
            raise ValueError("devices= runs the tasks on GPUs: it needs backend='gpu' or 'auto' (got 'cpu')")
    sink: Sink | None = None
    done: set[int] = set()
    try:
        if resume:
            sink = _open_for_resume(dst, storage_options)
            manifest = _read_manifest(sink)
            _check_source(manifest, identity)
            options, layout = _resolve_for_resume(manifest, given, layout, shape_options, source)
            done = {int(e) for e in manifest.get("epochs_done", [])}
        else:
            options = {k: DEFAULT_OPTIONS[k] if v is None else v for k, v in given.items()}
            if not overwrite:
                _refuse_a_stopped_conversion(dst, storage_options)
        layout = layout or default_layout(source, shape_options["tile"], shape_options["tiles_per_shard"])
        gpu_list = None
        if devices is not None:
            gpu_list = gpu_numbers(devices)  # checked before the destination is touched
            options["backend"] = "gpu"
        spec, pyramid, prefixes = _plan(source, layout, dst, storage_options, options)
        if sink is None:
            sink = open_sink(dst, overwrite, storage_options)
    except BaseException:
        if sink is not None:
            sink.release()
        raise
    epochs = math.ceil(layout.shape[0] / layout.shard_epoch_rows)
    report.epochs, report.epochs_skipped, report.rows = epochs, len(done), layout.shape[0]
    manifest = {
        "format": MANIFEST_FORMAT,
        "source": identity,
        "options": {"layout": _layout_dict(layout), **_jsonable(options)},
        "epochs": epochs,
    }
    errors: list[BaseException] = []
    publisher = Publisher(
        sink,
        pyramid,
        spec.array.codec,
        spec.array.level,
        {} if spec.array.ome else dict(spec.array.attributes),
        prefixes,
        on_error=errors.append,
    )
    own_cluster = None
    futures: dict = {}
    completed = None
    interrupted: KeyboardInterrupt | None = None
    restore_signals: Any = None

    results: dict[int, dict] = {}  # by epoch, in the order they finished

    def finished_epoch(e: int, result: dict) -> None:
        # The manifest and zarr.json writes of an epoch are one step for Ctrl-C/SIGTERM: landing
        # inside them, an interrupt left a temporary file behind or a report claiming fewer rows
        # than the zarr.json just written; it takes effect once the step is done.
        with _interrupts_deferred(children=False):
            results[e] = result
            _write_manifest(sink, manifest, done | {e})
            done.add(e)  # counted (in the report too) once the manifest says so
            finished[e].set_result(None)  # the publisher's callback writes zarr.json here

    def count() -> None:
        """The report of the epochs this run finished (consistent even when Ctrl-C struck anywhere)."""
        written = [results[e] for e in results if e in done]
        report.epochs_written = len(written)
        report.shards = sum(len(r["keys"]) for r in written)
        report.keys = [key for r in written for key in r["keys"]]
        report.bytes_in = sum(r["bytes_in"] for r in written)
        report.bytes_out = sum(r["bytes_out"] for r in written)
        report.pyramid_bytes_out = sum(r.get("pyramid_bytes_out", 0) for r in written)
        report.backends = {r["backend"] for r in written}
        report.read_seconds = sum(r["read_s"] for r in written)
        report.task_seconds = sum(r["seconds"] for r in written)

    finished: dict[int, Future] = {e: Future() for e in range(epochs)}
    watch: _WorkerWatch | None = None
    try:
        with _interrupts_deferred(children=False):  # the store's first metadata, whole
            _write_manifest(sink, manifest, done)  # before anything else: a conversion stopped from now on resumes
            publisher.begin()
            if spec.array.ome:
                group = group_metadata(pyramid, Path(dst.rstrip("/")).stem, dict(spec.array.attributes))
                sink.write(METADATA_KEY, [metadata_bytes(group)])
            for e in range(epochs):  # in order: the publisher advances over the prefix of finished epochs
                rows = min((e + 1) * layout.shard_epoch_rows, layout.shape[0])
                publisher.track([finished[e]], rows)
            for e in done:
                finished[e].set_result(None)
        todo = [e for e in range(epochs) if e not in done]
        if todo:
            if client is None:
                # Ctrl-C waits until the cluster is up (then lands here, with own_cluster set, and
                # stops it cleanly); the worker processes are born ignoring it.
                with _interrupts_deferred():
                    try:
                        if gpu_list is not None:
                            own_cluster = gpu_cluster(gpu_list)
                        else:
                            own_cluster = local_cluster(local_workers or max(1, min(4, (os.cpu_count() or 1) // 2)))
                    except Exception as start_failure:
                        log.info("the local cluster did not start", exc_info=True)  # Dask's own traceback: -v
                        raise ClusterStartError(_cluster_start_failure(start_failure)) from None
                    client = Client(own_cluster)
            else:
                warn_if_the_profiler_can_deadlock(client)
            if announce is not None:
                announce(client.dashboard_link)
            log.info(
                "converting %s into %s: %d shard epochs on %s (dashboard %s)",
                identity["location"] or "an array",
                dst,
                len(todo),
                client,
                client.dashboard_link,
            )
            futures = {
                client.submit(
                    write_shard_epoch, source, e, spec, key=f"tileshard-epoch-{e}-{id(spec)}", retries=retries
                ): e
                for e in todo
            }
            if progress is not None:
                progress(len(done), epochs)
            watch = _WorkerWatch(client, futures, worker_timeout)
            # Results come with the futures (fetched on Dask's thread, no round trip here each), on
            # the loop of the client the futures belong to: left to itself, as_completed tracks them
            # on the *current* client's loop, another one when convert runs inside `with Client(...)`
            # of a different cluster: two loops then share this client's connections, which under
            # load broke Dask's connection pool and left the conversion waiting for good.
            completed = as_completed(futures, with_results=True, raise_errors=False, loop=client.loop)
            for future, result in completed:
                e = futures[future]
                # Judged by what came back, not by the future's status now: a worker lost after its
                # task finished sends the future back to pending (to be recomputed) though its result,
                # the epoch's shards written, is here.
                if not isinstance(result, dict):
                    exc = _task_failure(e, future, result)
                    if exc is None:
                        completed.add(future)  # Dask recomputes it: wait for that result
                        continue
                    if watch.reason is not None:
                        exc = RuntimeError(watch.reason)
                    finished[e].set_exception(exc)  # the first failure stops publishing
                    client.cancel(list(futures))  # queued epochs stay unwritten; the manifest says which are done
                    raise exc
                finished_epoch(e, result)
                if progress is not None:
                    progress(len(done), epochs)
        with _interrupts_deferred(children=False):
            publisher.finish(layout.shape[0])
        if errors:
            raise errors[0]
    except KeyboardInterrupt as exc:
        # Stop cleanly; a second Ctrl-C (or SIGTERM) must not cut the cleanup short.
        restore_signals = _ignore_interrupts()
        interrupted = exc
        if completed is not None:  # epochs whose results are here already are kept, the others dropped
            with contextlib.suppress(Exception):
                for future, result in completed.next_batch(block=False):
                    if future.status == "finished" and futures[future] not in done:
                        finished_epoch(futures[future], result)
        if futures and client is not None:
            with contextlib.suppress(Exception):
                client.cancel(list(futures))
    except ClusterStartError:
        if not resume:  # nothing was converted: the store this run began goes again
            sink.discard()
        else:
            publisher.mark_failed()
        raise
    except BaseException:
        publisher.mark_failed()
        raise
    finally:
        if watch is not None:
            watch.stop()
        if restore_signals is None:
            restore_signals = _ignore_interrupts()
        try:
            report.seconds = time.perf_counter() - start
            report.rows_claimed = publisher.rows
            count()
            if own_cluster is not None:
                # Our futures released first: a scheduler whose workers leave with results a client
                # still holds warns that they are lost (and complains, CRITICAL with a traceback, when
                # that client is gone already).
                with contextlib.suppress(Exception):
                    client.cancel(list(futures))
                with contextlib.suppress(Exception):
                    client.close()
                own_cluster.close()
            sink.release()  # only after our workers are gone: nothing of ours writes into dst any more
        finally:
            restore_signals()
    if interrupted is not None:
        raise _Stopped(interrupted, True)
    if verify:
        try:
            report.verified = verify_store(
                dst if "://" not in dst else resolve_store(dst, storage_options=storage_options)
            )
        except KeyboardInterrupt as exc:
            raise _Stopped(exc, True) from None
        if not report.verified.ok:
            raise RuntimeError(f"the converted store {dst} does not verify: {report.verified.problems[:3]}")
    return report


def _plan(source: Source, layout: Layout, dst: str, storage_options, options: dict):
    """The task spec, pyramid and level prefixes (validates the layout against the source)."""
    if tuple(layout.shape) != tuple(source.shape):
        raise ValueError(f"the layout's shape is {layout.shape} but the source's is {source.shape}")
    if layout.dtype != source.dtype:
        same_values = layout.dtype == source.dtype.newbyteorder("<")
        raise ValueError(
            f"the source's dtype {source.dtype.str!r} is big-endian; the store is little-endian "
            f"{layout.dtype.str!r}: convert the source to little-endian first (e.g. array.astype({layout.dtype.str!r}))"
            if same_values
            else f"the layout's dtype is {layout.dtype.name} but the source's is {source.dtype.name}"
        )
    downsample_dims = _tuple(options["downsample_dims"])
    if options["ome"] and downsample_dims and layout.names[0] in downsample_dims:
        raise ValueError(
            f"convert builds each shard epoch's pyramid in its own task: downsample_dims may not include "
            f"{layout.names[0]!r} (dim 0)"
        )
    array = ArraySpec.of(
        layout,
        options["codec"],
        int(options["level"]),
        ome=bool(options["ome"]),
        downsample=options["downsample"],
        downsample_dims=downsample_dims,
        max_levels=options["max_levels"],
        attributes=options["attributes"],
    )
    pyramid = array.pyramid
    prefixes = [f"{k}/" for k in range(pyramid.levels)] if array.ome else [""]
    spec = _TaskSpec(dst, storage_options, array, EngineOptions(backend=options["backend"]))
    return spec, pyramid, prefixes


@contextlib.contextmanager
def _interrupts_deferred(children: bool = True):
    """Ctrl-C and SIGTERM deferred to the end of the block (main thread: their handlers record them,
    then run).  ``children``: also SIGINT blocked in this thread and in the threads it starts
    meanwhile, so in the processes those start (a signal mask survives fork and exec): they are
    born ignoring a Ctrl-C for the whole process group (dask_setup then ignores it for good)."""
    pending: list[int] = []
    handlers: dict = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            handlers[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
    previous_mask = None
    if children and hasattr(signal, "pthread_sigmask"):
        # The resource tracker first: when started later (by Dask's first multiprocessing queue), it
        # unblocks SIGINT and SIGTERM in the thread that starts it.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)  # a blocked Ctrl-C lands now: recorded
        for s, handler in handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if pending:
            handler = handlers.get(pending[0])
            if callable(handler):
                handler(pending[0], None)  # e.g. KeyboardInterrupt
            elif handler == signal.SIG_DFL:
                signal.raise_signal(pending[0])


def _ignore_interrupts():
    """Ignore SIGINT and SIGTERM (main thread only); returns what restores the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    return restore


# -- clusters ----------------------------------------------------------------------------------
#: Dask configuration of the workers of the clusters convert starts: CPython gh-106883 (fixed in
#: 3.11.9) deadlocks a process for good when ``sys._current_frames()`` (the profiler, every 10 ms)
#: meets a garbage collection whose callback releases the GIL (distributed's GC diagnosis) while a
#: thread starts or ends (each task's Writer starts and stops several).
WORKER_CONFIG = {"distributed.worker.profile.enabled": False}
_GH_106883_FIXED = (3, 11, 9)


def worker_options() -> dict:
    """Keyword arguments for the Nanny of each worker of a cluster convert starts: the
    :data:`WORKER_CONFIG` (set in the worker process after its own configuration is read, so it
    reaches it) and this module as a preload (:func:`dask_setup`)."""
    import dask

    preload = dask.config.get("distributed.worker.preload", default=None) or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    # The workers log as this process does (the command line quiets Dask unless -v): dask_setup
    # sets their level from this.
    level = logging.getLogger("distributed").getEffectiveLevel()
    with dask.config.set({**WORKER_CONFIG, _LOG_LEVEL_KEY: level}):
        config = copy.deepcopy(dask.config.config)  # the Nanny merges only the top level of what it is given
    return {"config": config, "preload": [*preload, __name__] if __name__ not in preload else preload}


_LOG_LEVEL_KEY = "napari-tileshard.worker-log-level"


def local_cluster(n_workers: int, **kwargs):
    """The ``LocalCluster`` convert starts: ``n_workers`` single-threaded worker processes with
    :func:`worker_options`."""
    import dask
    from distributed import LocalCluster

    options = dict(n_workers=n_workers, threads_per_worker=1, dashboard_address=":0")
    options.update(kwargs)
    with dask.config.set(WORKER_CONFIG):
        return LocalCluster(**options, **worker_options())


def dask_setup(worker) -> None:
    """Preloaded into each worker process of the clusters convert starts (never into a cluster of
    yours): the process gets SIGKILL when the thread that started it ends (``PR_SET_PDEATHSIG``,
    Linux), so a convert killed by any signal, SIGKILL included, leaves no worker behind, even a
    worker stuck with the GIL held; and it ignores SIGINT, so Ctrl-C in a terminal (sent to the
    whole process group) reaches only convert, which stops the workers itself.

    The thread that started a worker process is its Nanny's process-watching thread
    (``distributed.process.AsyncProcess``), which lives as long as the worker process does.  A
    worker running in convert's own process (a cluster of threads) is left alone."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent.pid:  # the parent died before the signal was armed: nobody sends it
        os.kill(os.getpid(), signal.SIGKILL)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if hasattr(signal, "pthread_sigmask"):  # born with it blocked (see convert): ignored from now on
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import dask

    level = dask.config.get(_LOG_LEVEL_KEY, default=None)
    if isinstance(level, int) and level > logging.getLogger("distributed").getEffectiveLevel():
        logging.getLogger("distributed").setLevel(level)


_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2


def _death_signal() -> int:
    """The parent-death signal of this process (0: none; Linux only, else -1)."""
    if not sys.platform.startswith("linux"):
        return -1
    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def _worker_state(dask_worker=None) -> dict:
    """What a worker reports about itself (run there through ``client.run``)."""
    import dask

    return {
        "python": list(sys.version_info[:3]),
        "profiler": bool(dask_worker is not None and "profile" in dask_worker.periodic_callbacks),
        "profile_config": dask.config.get("distributed.worker.profile.enabled"),
        "death_signal": _death_signal(),
        "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        "pid": os.getpid(),
    }


def warn_if_the_profiler_can_deadlock(client) -> bool:
    """Log one warning when a worker of ``client`` (a cluster convert did not start) runs Python
    < 3.11.9 with Dask's profiler on (CPython gh-106883); True when it did."""
    try:
        states = client.run(_worker_state)
    except Exception as exc:  # noqa: BLE001 - a check only: workers without this package, ...
        log.debug("could not ask the workers for their Python version and profiler: %s", exc)
        return False
    affected = [s for s in states.values() if s["profiler"] and tuple(s["python"]) < _GH_106883_FIXED]
    if not affected:
        return False
    versions = ", ".join(sorted({".".join(map(str, s["python"])) for s in affected}))
    log.warning(
        "%d of the %d Dask workers run Python %s with Dask's profiler on: CPython bug gh-106883 (fixed in "
        "3.11.9) can deadlock such a worker for good while tasks start and stop threads, as convert's do; "
        "start the workers with the Dask setting distributed.worker.profile.enabled: False "
        "(DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False) or on Python >= 3.11.9",
        len(affected),
        len(states),
        versions,
    )
    return True


def gpu_numbers(devices) -> list[int]:
    """``"all"``, a count or GPU numbers -> the GPU numbers (ValueError naming the value,
    RuntimeError when no GPU is usable here): the one check of ``devices``
    (:func:`~napari_tileshard.engine.options.normalize_devices`) plus the GPUs present."""
    reason = gpu_unavailable_reason()
    if reason:
        raise RuntimeError(f"devices={devices!r} was requested but the GPU backend is not usable: {reason}")
    return resolve_devices(normalize_devices(devices))


def gpu_cluster(devices: list[int], threads_per_gpu: int | None = None):
    """A local Dask cluster with one worker process per GPU, each seeing only its GPU
    (``CUDA_VISIBLE_DEVICES``, set before CUDA starts in that process) and running one task at a
    time on the GPU: a task's Writer has the whole GPU, while ``threads_per_gpu`` tasks (default:
    the cores per GPU, at most 8) read their rows concurrently.  dask-cuda's ``LocalCUDACluster`` does the same and is
    used when installed; it is not a dependency because it pulls numba and pandas (and RAPIDS
    pins) for what is a worker environment variable here.  Its workers run with
    :func:`worker_options`, as those of :func:`local_cluster`."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        LocalCUDACluster = None
    threads = threads_per_gpu or max(1, min(8, (os.cpu_count() or 1) // len(devices)))
    with dask.config.set(WORKER_CONFIG):
        if LocalCUDACluster is not None:
            return LocalCUDACluster(
                CUDA_VISIBLE_DEVICES=",".join(map(str, devices)),
                threads_per_worker=threads,
                dashboard_address=":0",
                **worker_options(),
            )
        workers = {
            f"gpu-{k}-{d}": {
                "cls": Nanny,
                "options": {"nthreads": threads, "env": {"CUDA_VISIBLE_DEVICES": str(d)}, **worker_options()},
            }
            for k, d in enumerate(devices)
        }
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
        return SpecCluster(workers=workers, scheduler=scheduler, name="tileshard-gpus")


def _tuple(value):
    return tuple(value) if value is not None else None


# -- the manifest ------------------------------------------------------------------------------
def _is_url(dst: str) -> bool:
    return "://" in dst and not dst.startswith("file://")


def _open_for_resume(dst: str, storage_options) -> Sink:
    """The destination of a conversion to resume, locked (a dead convert's lock is taken over)."""
    if _is_url(dst):
        return ZarrStoreSink.attach(resolve_store(dst, read_only=False, storage_options=storage_options))
    root = Path(dst.removeprefix("file://")).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"{dst} {'is not a directory' if root.exists() else 'does not exist'}: nothing to resume; "
            "convert without resume=True (--resume) to start a conversion"
        )
    return DirectorySink(root, keep_existing=True)


def _peek_manifest(dst: str, storage_options) -> dict | None:
    """The manifest at ``dst`` if there is one that parses (read without the lock: for messages)."""
    try:
        if _is_url(dst):
            data = ZarrStoreSink.attach(resolve_store(dst, read_only=True, storage_options=storage_options)).read(
                MANIFEST_KEY
            )
        else:
            path = Path(dst.removeprefix("file://")).expanduser() / MANIFEST_KEY
            data = path.read_bytes() if path.is_file() and path.stat().st_size < (64 << 20) else None
        return json.loads(data) if data else None
    except Exception:  # noqa: BLE001 - no readable manifest: the store's own rules decide
        return None


def _refuse_a_stopped_conversion(dst: str, storage_options) -> None:
    """A destination that holds a conversion (stopped or finished): say what to do with it."""
    manifest = _peek_manifest(dst, storage_options)
    if not isinstance(manifest, dict):
        return
    done, epochs = len(manifest.get("epochs_done") or []), manifest.get("epochs")
    if epochs is not None and done >= epochs:
        raise StoreExistsError(
            f"output {dst!r} holds a finished conversion ({epochs} shard epochs); {_OVERWRITE_HINT} to replace it"
        )
    what = f"a conversion that stopped after {done}" + (f" of {epochs}" if epochs else "") + " shard epochs"
    raise StoreExistsError(
        f"output {dst!r} holds {what}: continue it with resume=True (--resume on the command line), "
        f"or {_OVERWRITE_HINT} to start over"
    )


def _read_manifest(sink: Sink) -> dict:
    data = sink.read(MANIFEST_KEY) if hasattr(sink, "read") else None
    if data is None:
        raise FileNotFoundError(
            f"{sink.location} has no {MANIFEST_KEY}: nothing to resume (convert was stopped before it began "
            f"there, or did not write it); {_START_OVER}"
        )
    try:
        manifest = json.loads(data)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ValueError(f"{sink.location}/{MANIFEST_KEY} is not a readable manifest ({exc}); {_START_OVER}") from None
    if "format" not in manifest and "identity" in manifest:  # written before the source was recorded
        manifest = {"source": None, "options": manifest["identity"], "epochs_done": manifest.get("epochs_done", [])}
    elif manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("options"), dict):
        raise ValueError(
            f"{sink.location}/{MANIFEST_KEY} has format {manifest.get('format')!r}, this version reads "
            f"{MANIFEST_FORMAT}; {_START_OVER}"
        )
    return manifest


def _check_source(manifest: dict, identity: dict) -> None:
    recorded = manifest.get("source")
    if recorded is None:
        log.warning("this conversion was started by an older version, which did not record its source: not checked")
        return
    differences = _identity_differences(identity, recorded)
    if differences:
        raise ValueError(
            "the source differs from the one this conversion started from: "
            + "; ".join(differences)
            + f" (now vs then); resume with that source, or {_START_OVER}"
        )


def _resolve_for_resume(manifest: dict, given: dict, layout: Layout | None, shape_options: dict, source: Source):
    """The options and layout a resume runs with: those given where they agree with the recorded
    ones (ResumeMismatch where not; ``backend`` may change), the recorded ones elsewhere."""
    recorded = manifest["options"]
    options = {}
    for key, default in DEFAULT_OPTIONS.items():
        used = recorded.get(key, default)
        value = given.get(key)
        if value is None:
            options[key] = used
        elif key in _EXECUTION_OPTIONS or _jsonable(value) == used:
            options[key] = value
        else:
            raise ResumeMismatch(key, value, used)
    saved = recorded.get("layout")
    if not isinstance(saved, dict):
        raise ValueError(f"the manifest records no layout; {_START_OVER}")
    recorded_layout = Layout([Dim(**d) for d in saved["dims"]], np.dtype(saved["dtype"]))
    if layout is not None and _layout_dict(layout) != saved:
        raise ResumeMismatch("layout", layout, recorded_layout)
    for key, attribute in (("tile", "tile_size"), ("tiles_per_shard", "tiles_per_shard")):
        value = shape_options[key]
        used = [d[attribute] for d in saved["dims"]]
        if value is None:
            continue
        with warnings.catch_warnings():  # a clamp was noted when the conversion started
            warnings.simplefilter("ignore", TilingWarning)
            asked = default_layout(source, **{key: value})  # checked and clamped as when it started
        values = [getattr(d, attribute) for d in asked.dims]
        if values != used:
            raise ResumeMismatch(key, list(value), used)
    return options, recorded_layout


def _layout_dict(layout: Layout) -> dict:
    return _jsonable({"dims": [asdict(d) for d in layout.dims], "dtype": layout.dtype.str})


def _write_manifest(sink: Sink, manifest: dict, done: set[int]) -> None:
    sink.write(MANIFEST_KEY, [json.dumps({**manifest, "epochs_done": sorted(done)}).encode()])
