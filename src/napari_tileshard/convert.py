"""Convert existing data into sharded Zarr v3 / OME-Zarr on Dask: one task per shard epoch.

A shard epoch (``layout.shard_epoch_rows`` rows along dim 0) is the unit of work: every shard of
every pyramid level in it is written by exactly one task, so no shard is ever written by two
tasks (what corrupts ``dask.array.to_zarr`` into shards that do not align with its chunks).  A
task reads its rows from the source, runs a :class:`~napari_tileshard.writer.Writer` (the same
backend stages as a live recording, GPU on GPU workers) over a bounded sub-array of those rows,
and writes its shards under their global keys through a :class:`_EpochSink`, which drops the
sub-array's own ``zarr.json``.  The coordinator holds the store (lock, overwrite rules), and a
:class:`~napari_tileshard.publish.Publisher` advances ``zarr.json`` over the contiguous prefix of
finished epochs, exactly as while recording: a reader never sees rows whose shards are missing.
A manifest (``.tileshard-convert.json``) lists finished epochs so ``resume=True`` skips them.

Pyramid levels are built within each task from its rows, which is exact when dim 0 is not
reduced (``downsample_dims`` must leave it out: a task's rows are one shard epoch).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .layout import Dim, Layout
from .ome import group_metadata
from .publish import Publisher
from .pyramid import Pyramid, plan_pyramid
from .store import (
    CONVERT_MANIFEST_NAME,
    METADATA_KEY,
    DirectorySink,
    Sink,
    ZarrStoreSink,
    metadata_bytes,
    open_sink,
    resolve_store,
)

log = logging.getLogger(__name__)

MANIFEST_KEY = CONVERT_MANIFEST_NAME
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
    node = zarr.open(resolve_store(location), mode="r")
    if isinstance(node, zarr.Group):  # OME-Zarr: its first multiscale level
        from .ome import multiscale_paths

        paths = multiscale_paths(dict(node.attrs)) or multiscale_paths({"ome": dict(node.attrs)})  # 0.5, 0.4
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
        return Source("array", tuple(src.shape), np.dtype(src.dtype), src)
    path = str(src)
    if "://" not in path and Path(path).is_dir() and not _is_zarr(Path(path)):
        files = sorted(f for f in glob.glob(os.path.join(path, "*")) if f.lower().endswith(_TIFF_SUFFIXES))
        if not files:
            raise ValueError(f"{path} is neither a zarr store nor a folder of TIFF files")
        import tifffile

        first = tifffile.imread(files[0])
        _check_tiff_headers(files, first.shape, first.dtype)
        return Source("tiff-folder", (len(files), *first.shape), first.dtype, files)
    if path.lower().endswith(_TIFF_SUFFIXES):
        if not Path(path).is_file():
            raise FileNotFoundError(f"no such TIFF file: {path}")
        array = _open_array("tiff", path)
        return Source("tiff", tuple(array.shape), np.dtype(array.dtype), path)
    if "://" not in path and not Path(path).exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    array = _open_array("zarr", path)
    names = getattr(array.metadata, "dimension_names", None)
    return Source("zarr", tuple(array.shape), np.dtype(array.dtype), path, tuple(names) if names else None)


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


def default_layout(source: Source, tile=None, tiles_per_shard=None, names=None) -> Layout:
    """Tiles of 256x256 pixels (1 along other dims, 8 along dim 0 of rank >= 3) and shards of 4x4
    tiles in the last two dims, unless ``tile`` / ``tiles_per_shard`` say otherwise."""
    rank = len(source.shape)
    names = names or source.names or ("t", "c", "z", "y", "x")[-rank:] if rank <= 5 else [f"d{i}" for i in range(rank)]
    if tile is None:
        tile = [1] * rank
        tile[-min(2, rank) :] = [256] * min(2, rank)
        if rank >= 3:
            tile[0] = 8
    if tiles_per_shard is None:
        tiles_per_shard = [1] * rank
        tiles_per_shard[-min(2, rank) :] = [4] * min(2, rank)
    for what, values in (("tile", tile), ("tiles_per_shard", tiles_per_shard)):
        if len(values) != rank:
            raise ValueError(f"{what} has {len(values)} values, the source has {rank} dimensions {source.shape}")
    dims = [
        Dim(str(n), int(s), max(1, min(int(t), int(s))), int(p))
        for n, s, t, p in zip(names, source.shape, tile, tiles_per_shard)
    ]
    return Layout(dims, source.dtype)


# -- tasks -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _TaskSpec:
    """What a task needs besides its rows (picklable)."""

    dst: str
    storage_options: dict | None
    layout: Layout
    codec: str
    level: int
    backend: str
    ome: bool
    downsample: str
    downsample_dims: tuple | None
    max_levels: int | None


class _EpochSink(Sink):
    """The store seen by one task's Writer: its shards go under their global keys (shard epoch
    ``epoch`` along dim 0), its own ``zarr.json`` files are dropped (the coordinator publishes)."""

    def __init__(self, target: Sink, epoch: int):
        self._target = target
        self._epoch = epoch
        self.keys: list[str] = []
        self.bytes = 0

    @property
    def location(self) -> str:
        return self._target.location

    def write(self, key: str, buffers) -> None:
        if key.rsplit("/", 1)[-1] == METADATA_KEY:
            return
        prefix, _, coords = key.rpartition("c/")
        first, _, rest = coords.partition("/")
        key = f"{prefix}c/{int(first) + self._epoch}" + (f"/{rest}" if rest else "")
        self._target.write(key, buffers)
        self.keys.append(key)
        self.bytes += sum(memoryview(b).nbytes for b in buffers)


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
    with _GPU_WRITER_LOCK if spec.backend == "gpu" else contextlib.nullcontext():
        wait_s = time.perf_counter() - t0 - read_s
        return _encode_epoch(block, epoch, spec, start, stop, t0, read_s, wait_s)


#: serialises the GPU part of tasks within one worker process (see write_shard_epoch)
_GPU_WRITER_LOCK = threading.Lock()


def _encode_epoch(block, epoch, spec, start, stop, t0, read_s, wait_s) -> dict:
    from .writer import Writer

    layout = spec.layout
    sub = Layout([replace(layout.dims[0], size=stop - start), *layout.dims[1:]], layout.dtype)
    sink = _EpochSink(_attach(spec.dst, spec.storage_options), epoch)
    options = dict(codec=spec.codec, level=spec.level, backend=spec.backend)
    if spec.ome:
        options.update(
            ome=True, downsample=spec.downsample, downsample_dims=spec.downsample_dims, max_levels=spec.max_levels
        )
    with Writer(sink, sub, **options) as writer:
        writer.append(block)
    return {
        "epoch": epoch,
        "bytes_in": block.nbytes,
        "bytes_out": sink.bytes,
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
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    backends: set = field(default_factory=set)
    read_seconds: float = 0.0  # summed over tasks: reading the source
    task_seconds: float = 0.0  # summed over tasks: read + wait for the GPU + encode + write
    keys: list = field(default_factory=list)  # every shard key written by a task, in task order
    verified: Any = None  # VerifyReport when verify=True

    @property
    def gbps(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else float("nan")


def convert(
    src,
    dst,
    layout: Layout | None = None,
    *,
    tile=None,
    tiles_per_shard=None,
    codec: str = "zstd",
    level: int = 1,
    backend: str = "auto",
    ome: bool = False,
    downsample: str = "mean",
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
    gpus=None,
    announce=None,
) -> ConvertReport:
    """Convert ``src`` (see :func:`open_source`) into ``dst`` with ``layout`` (default:
    :func:`default_layout` from ``tile``/``tiles_per_shard``) on a Dask ``client`` (default: a
    ``LocalCluster`` of ``local_workers`` processes).  ``resume=True`` continues a conversion
    into ``dst`` that stopped, skipping the shard epochs its manifest lists.  ``progress``: a
    callable ``(epochs done, epochs)``.  ``gpus`` (``"all"``, a count or GPU numbers; no
    ``client``): a local cluster of one single-threaded worker per GPU (:func:`gpu_cluster`)
    whose tasks use the GPU backend.  ``announce``: called with the Dask dashboard's address once
    the cluster is up.  Returns a :class:`ConvertReport` (verified with
    :func:`~napari_tileshard.verify` unless ``verify=False``)."""
    from distributed import Client, LocalCluster, as_completed

    source = open_source(src)
    layout = layout or default_layout(source, tile, tiles_per_shard)
    if tuple(layout.shape) != tuple(source.shape) or layout.dtype != source.dtype:
        raise ValueError(
            f"the layout is {layout.shape} {layout.dtype.name} but the source is {source.shape} {source.dtype.name}"
        )
    if ome and downsample_dims and layout.names[0] in downsample_dims:
        raise ValueError(
            f"convert builds each shard epoch's pyramid in its own task: downsample_dims may not include "
            f"{layout.names[0]!r} (dim 0)"
        )
    if resume and overwrite:
        raise ValueError("resume=True continues an earlier conversion; it cannot be combined with overwrite=True")
    gpu_list = None
    if gpus is not None:
        if client is not None:
            raise ValueError("gpus= starts a local cluster of GPU workers; with client= the cluster is yours")
        if backend == "cpu":
            raise ValueError("gpus= runs the tasks on GPUs: it needs backend='gpu' or 'auto' (got 'cpu')")
        gpu_list = gpu_numbers(gpus)  # checked before the destination is touched
        backend = "gpu"
    dst = str(dst)
    pyramid = plan_pyramid(layout, downsample, downsample_dims, max_levels) if ome else Pyramid.single(layout)
    prefixes = [f"{k}/" for k in range(pyramid.levels)] if ome else [""]
    epochs = math.ceil(layout.shape[0] / layout.shard_epoch_rows)
    spec = _TaskSpec(
        dst, storage_options, layout, codec, level, backend, ome, downsample, _tuple(downsample_dims), max_levels
    )
    sink = _open_destination(dst, overwrite, resume, storage_options)
    done = _read_manifest(sink, spec) if resume else set()
    report = ConvertReport(dst, epochs=epochs, epochs_skipped=len(done))
    errors: list[BaseException] = []
    publisher = Publisher(
        sink, pyramid, codec, level, {} if ome else (attributes or {}), prefixes, on_error=errors.append
    )
    own_cluster = None
    start = time.perf_counter()
    try:
        publisher.begin()
        if ome:
            group = group_metadata(pyramid, Path(dst.rstrip("/")).stem, attributes)
            sink.write(METADATA_KEY, [metadata_bytes(group)])
        if client is None and gpu_list is not None:
            own_cluster = gpu_cluster(gpu_list)
            client = Client(own_cluster)
        elif client is None:
            own_cluster = LocalCluster(
                n_workers=local_workers or max(1, min(4, (os.cpu_count() or 1) // 2)),
                threads_per_worker=1,
                dashboard_address=":0",
            )
            client = Client(own_cluster)
        if announce is not None:
            announce(client.dashboard_link)
        log.info(
            "converting %s into %s: %d shard epochs on %s (dashboard %s)",
            src,
            dst,
            epochs,
            client,
            client.dashboard_link,
        )
        finished: dict[int, Future] = {e: Future() for e in range(epochs)}
        for e in range(epochs):  # in order: the publisher advances over the prefix of finished epochs
            rows = min((e + 1) * layout.shard_epoch_rows, layout.shape[0])
            publisher.track([finished[e]], rows)
        for e in done:
            finished[e].set_result(None)
        todo = [e for e in range(epochs) if e not in done]
        futures = {
            client.submit(write_shard_epoch, source, e, spec, key=f"tileshard-epoch-{e}-{id(spec)}", retries=retries): e
            for e in todo
        }
        completed = len(done)
        for future in as_completed(futures):
            e = futures[future]
            try:
                result = future.result()
            except BaseException as exc:  # noqa: BLE001 - the first failure stops publishing
                finished[e].set_exception(exc)
                client.cancel(list(futures))  # queued epochs stay unwritten; the manifest says which are done
                raise
            done.add(e)
            _write_manifest(sink, spec, done)
            finished[e].set_result(None)
            report.shards += len(result["keys"])
            report.keys += result["keys"]
            report.bytes_in += result["bytes_in"]
            report.bytes_out += result["bytes_out"]
            report.backends.add(result["backend"])
            report.read_seconds += result["read_s"]
            report.task_seconds += result["seconds"]
            completed += 1
            if progress is not None:
                progress(completed, epochs)
        publisher.finish(layout.shape[0])
        if errors:
            raise errors[0]
    except BaseException:
        publisher.mark_failed()
        raise
    finally:
        report.seconds = time.perf_counter() - start
        if own_cluster is not None:
            client.close()
            own_cluster.close()
        sink.release()
    if verify:
        from .verify import verify as verify_store

        report.verified = verify_store(dst if "://" not in dst else resolve_store(dst, storage_options=storage_options))
        if not report.verified.ok:
            raise RuntimeError(f"the converted store {dst} does not verify: {report.verified.problems[:3]}")
    return report


def gpu_numbers(gpus) -> list[int]:
    """``"all"``, a count or a list of GPU numbers -> the GPU numbers (ValueError naming the value,
    RuntimeError when no GPU is usable here)."""
    from .backends import gpu_unavailable_reason, resolve_devices

    reason = gpu_unavailable_reason()
    if reason:
        raise RuntimeError(f"gpus={gpus!r} was requested but the GPU backend is not usable: {reason}")
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        if gpus < 1:
            raise ValueError(f"gpus must be 'all', a positive count or GPU numbers, got {gpus!r}")
        gpus = list(range(gpus))
    return resolve_devices(gpus)


def gpu_cluster(devices: list[int], threads_per_gpu: int | None = None):
    """A local Dask cluster with one worker process per GPU, each seeing only its GPU
    (``CUDA_VISIBLE_DEVICES``, set before CUDA starts in that process) and running one task at a
    time on the GPU: a task's Writer has the whole GPU, while ``threads_per_gpu`` tasks (default:
    the cores per GPU, at most 8) read their rows concurrently.  dask-cuda's ``LocalCUDACluster`` does the same and is
    used when installed; it is not a dependency because it pulls numba and pandas (and RAPIDS
    pins) for what is a worker environment variable here."""
    from distributed import Nanny, Scheduler, SpecCluster

    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        LocalCUDACluster = None
    threads = threads_per_gpu or max(1, min(8, (os.cpu_count() or 1) // len(devices)))
    if LocalCUDACluster is not None:
        return LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=",".join(map(str, devices)), threads_per_worker=threads, dashboard_address=":0"
        )
    workers = {
        f"gpu-{k}-{d}": {"cls": Nanny, "options": {"nthreads": threads, "env": {"CUDA_VISIBLE_DEVICES": str(d)}}}
        for k, d in enumerate(devices)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    return SpecCluster(workers=workers, scheduler=scheduler, name="tileshard-gpus")


def _tuple(value):
    return tuple(value) if value is not None else None


def _open_destination(dst: str, overwrite: bool, resume: bool, storage_options) -> Sink:
    if not resume:
        return open_sink(dst, overwrite, storage_options)
    if "://" in dst and not dst.startswith("file://"):
        return ZarrStoreSink.attach(resolve_store(dst, read_only=False, storage_options=storage_options))
    return DirectorySink(dst.removeprefix("file://"), keep_existing=True)


def _manifest_identity(spec: _TaskSpec) -> dict:
    return {
        "layout": {"dims": [asdict(d) for d in spec.layout.dims], "dtype": spec.layout.dtype.str},
        "codec": spec.codec,
        "level": spec.level,
        "ome": spec.ome,
        "downsample": spec.downsample,
        "downsample_dims": spec.downsample_dims,
        "max_levels": spec.max_levels,
    }


def _read_manifest(sink: Sink, spec: _TaskSpec) -> set[int]:
    data = sink.read(MANIFEST_KEY) if hasattr(sink, "read") else None
    if data is None:
        raise FileNotFoundError(f"{sink.location} has no {MANIFEST_KEY}: nothing to resume")
    manifest = json.loads(data)
    if manifest.get("identity") != json.loads(json.dumps(_manifest_identity(spec))):
        raise ValueError(f"{sink.location} was converted with other options: {manifest.get('identity')}")
    return {int(e) for e in manifest.get("epochs_done", [])}


def _write_manifest(sink: Sink, spec: _TaskSpec, done: set[int]) -> None:
    manifest = {"identity": _manifest_identity(spec), "epochs_done": sorted(done)}
    sink.write(MANIFEST_KEY, [json.dumps(manifest).encode()])
