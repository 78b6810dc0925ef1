"""GPU backend: the stages as CuPy kernels + nvCOMP, scheduled on CUDA streams.

Codecs whose bitstream nvCOMP cannot produce (``codec.gpu`` is None) are refused at construction.

Per batch of tile epochs (see ``docs/design.md``), all enqueued without a host sync (the stage
of each step in brackets; what it computes lives in ``stages/``, this module only schedules):

    pinned staging --H2D (copy stream)--> input --tile kernel [tile_gpu]--> tile-major pool
      [input --[reduce_gpu]--> level 1 --[reduce_gpu]--> level 2 ... each --[tile_gpu]--> same pool]
      --nvCOMP (one call for every tile of the batch, all levels) [compress_gpu]--> slots + sizes
      --permute sizes by P, exclusive scan, gather [aggregate_gpu]--> packed shard-major bytes
      --D2H offsets + statuses--> host --[split_packed]--> per-shard views

Events are created with blocking sync, so waiting threads sleep instead of spinning a core.
The collector thread then waits for the offsets, copies only the used packed bytes back and
cuts them into per-shard buffers.  Device buffers form a ring of ``slots`` (default 3), so
batch N+1 is uploaded and tiled while batch N compresses and batch N-1 is copied back;
``submit`` blocks when every slot is busy, which is the backpressure towards the producer.
"""

from __future__ import annotations

import functools
import gc
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...format import codecs
from ...gpu import nvcomp
from ...gpu.pinned import PinnedRecycler, gpu_numa_cpus, pin, release_read_staging
from ..collector import pending_shard_epochs
from .base import Backend, MemoryBudget
from .stages.aggregate import aggregate_geometry, aggregate_gpu, aggregate_kernels, split_packed
from .stages.compress import check_gpu_statuses, compress_gpu, gpu_output_stride, gpu_temp_bytes
from .stages.reduce import reduce_gpu, reduce_kernel
from .stages.tile import tile_gpu, tile_kernel

__all__ = ["GpuBackend", "GpuTicket", "nvcomp_temp_estimate", "release_gpu_memory"]

_ALIGN = 16
#: device memory beyond the buffers: CuPy's scan scratch and pool rounding (3 MiB measured on an
#: H100 with 256 MiB batches; tests/engine/test_gpu_memory.py checks CuPy's count against the estimate)
_DEVICE_SLACK = 16 << 20


def _on_device(method):
    """Run a GpuBackend method with its GPU current (CuPy's current device is per thread, and the
    collector and caller threads share backends of several GPUs)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.device:
            return method(self, *args, **kwargs)

    return wrapper


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def nvcomp_temp_estimate(chunks: int, tile_bytes: int) -> int:
    """nvCOMP 6's zstd compression scratch, for estimates made without nvCOMP: a fixed 1.05 GiB
    plus 1.67x the tiles (fitted to nvcompBatchedZstdCompressGetTempSize on an H100 for 1-4096
    tiles of 64 KiB-4 MiB, within +2 %; the backend itself asks nvCOMP)."""
    return 1_126_191_263 + int(1.67 * chunks * tile_bytes)


#: partial batches (flush, close, a slow stream) need the geometry of fewer tile epochs: all of
#: them are built at arming when they take at most this much, so nothing is allocated mid-recording
_PARTIAL_GEOMETRY_BYTES = 8 << 20


def _geometry_bytes(layouts, epochs: int) -> int:
    per_epoch = 16 * sum(lay.tiles_per_epoch for lay in layouts)
    every = per_epoch * epochs * (epochs + 1) // 2
    return every if every <= _PARTIAL_GEOMETRY_BYTES else per_epoch * epochs


@dataclass
class _Slot:
    d_pool: Any
    d_compressed: Any
    d_sizes: Any
    d_status: Any
    d_permuted: Any
    d_offsets: Any
    d_packed: Any
    input_ptrs: Any
    output_ptrs: Any
    h_offsets: np.ndarray
    h_status: np.ndarray
    ready: Any  # event: offsets and statuses are on the host
    copied: Any  # event: the packed bytes are on the host


@dataclass
class GpuTicket:
    """What :meth:`GpuBackend.submit` returns."""

    slot: _Slot
    epochs: int
    consumed: Any  # event: the tile kernel has read the staging buffer's device mirror


@dataclass
class _Resources:
    """Everything a GpuBackend allocates for one batching: kept for the next recording (see
    :func:`release_gpu_memory`), because allocating it is most of the time arming takes."""

    key: tuple
    slots: list[_Slot]
    staging: list[np.ndarray]  # pinned staging buffers
    mirrors: dict  # pinned staging address -> its device input buffer
    packed: PinnedRecycler
    temp: Any
    temp_size: int
    levels: list  # device buffers of the reduced levels of the batch being tiled
    geometries: dict = field(default_factory=dict)  # batch epochs -> aggregate_geometry

    def nbytes(self) -> dict[str, int]:
        """Bytes held: pinned host and device memory."""
        device = sum(a.nbytes for slot in self.slots for a in vars(slot).values() if hasattr(a, "data")) + sum(
            m.nbytes for m in self.mirrors.values()
        )
        device += (self.temp.nbytes if self.temp is not None else 0) + sum(
            a.nbytes for a in self.levels if a is not None
        )
        device += sum(a.nbytes + b.nbytes for a, b in self.geometries.values())
        host = sum(b.nbytes for b in self.staging) + self.packed.allocated * self.packed.nbytes
        host += sum(slot.h_offsets.nbytes + slot.h_status.nbytes for slot in self.slots)
        return {"host": host, "device": device}

    def drop(self) -> None:
        """Let go of every buffer, also where a finished backend (or a ticket of it not yet
        collected) still refers to these resources: released memory must be free at once."""
        for slot in self.slots:
            for name in vars(slot):
                setattr(slot, name, None)
        self.slots, self.staging, self.mirrors, self.levels = [], [], {}, []
        self.temp, self.geometries = None, {}


#: the resources of the last GpuBackend closed in good health, for the next one with the same key
_warm: dict[tuple, _Resources] = {}
_warm_lock = threading.Lock()


def release_gpu_memory(device: int | None = None) -> dict[str, int]:
    """Give back the buffers kept for the next recording (of ``device``; None: every GPU, and
    the GPU readers' idle pinned staging too) and CuPy's cached blocks.

    Returns the bytes released (host: pinned, device).  A Writer that is recording is not affected.
    """
    with _warm_lock:
        keys = [key for key in _warm if device is None or key[0] == device]
        resources = [_warm.pop(key) for key in keys]
    released = {"host": release_read_staging() if device is None else 0, "device": 0}
    for r in resources:
        for kind, n in r.nbytes().items():
            released[kind] += n
        r.drop()
    del resources
    import cupy

    gc.collect()  # a finished Writer caught in a reference cycle may still hold tickets into its slots
    for d in sorted({key[0] for key in keys} | ({device} if device is not None else set())):
        with cupy.cuda.Device(d):
            cupy.get_default_memory_pool().free_all_blocks()
    if device is None:
        cupy.get_default_memory_pool().free_all_blocks()
    return released


def _geometry_key(pyramid) -> tuple:
    """What the kept buffers depend on: every level's shape, tiling and dtype, not the dims' names,
    units or scales (a pymmcore-plus run's time interval must not cost a new set of buffers)."""
    layouts = tuple((lay.shape, lay.tile_shape, lay.tiles_per_shard, lay.dtype.str) for lay in pyramid.layouts)
    return (layouts, pyramid.factors, pyramid.method)


def _take_warm(key: tuple) -> _Resources | None:
    """The kept resources if they fit ``key``; anything else kept on that GPU is released (a new layout)."""
    with _warm_lock:
        resources = _warm.pop(key, None)
        stale = any(k[0] == key[0] for k in _warm)
    if stale:
        release_gpu_memory(key[0])
    return resources


def _keep_warm(resources: _Resources) -> None:
    """Keep one batching per GPU: the newest."""
    device = resources.key[0]
    with _warm_lock:
        stale = any(k[0] == device for k in _warm)
    if stale:
        release_gpu_memory(device)
    with _warm_lock:
        _warm[resources.key] = resources


class GpuBackend(Backend):
    name = "gpu"
    accepts_device_arrays = True
    preferred_staging_buffers = 2  # each has a device mirror: refilled once the tile kernel has read it
    estimate_holds_shards = True  # shards are views into the pinned output buffers it counts
    #: overrides the batch size heuristic (tests set it small so each Writer stays cheap)
    default_batch_bytes: int | None = None
    #: device slots (batches between upload and copy-back); benchmarks/footprint_sweep.py --slots.  Two
    #: keep nvCOMP busy: 3 measured +3 % for 50 % more slot memory (benchmarks/results/notebook-2026-11.md)
    default_slots = 2
    #: defaults of the memory budget (``Writer(max_device_bytes=, max_host_bytes=)``): at most this
    #: much device memory and this fraction of what is free, at most this much pinned host memory
    #: and this fraction of the machine's RAM (docs/benchmarks.md has the throughput they give)
    DEFAULT_MAX_DEVICE_BYTES = 4 << 30
    DEFAULT_DEVICE_FRACTION = 0.25
    DEFAULT_MAX_HOST_BYTES = 2 << 30
    DEFAULT_HOST_FRACTION = 0.125
    #: ... and on a machine that has room (a GPU with at least LARGE_DEVICE_FREE free, at least
    #: LARGE_HOST_RAM of RAM) the larger bounds below: nvCOMP's rate grows with the tiles of a
    #: call, and 1 MiB tiles need 1 GiB calls (~11 GiB device, 7 GiB pinned) to come near its best,
    #: which the 4 GiB / 2 GiB of a small GPU cap at 256 MiB (docs/benchmarks.md, footprint).
    LARGE_DEVICE_FREE = 24 << 30
    LARGE_MAX_DEVICE_BYTES = 16 << 30
    LARGE_DEVICE_FRACTION = 0.5
    LARGE_HOST_RAM = 64 << 30
    LARGE_MAX_HOST_BYTES = 8 << 30

    def __init__(
        self,
        layout,
        codec="zstd",
        level=1,
        *,
        slots: int | None = None,
        batch_bytes: int | None = None,
        pyramid=None,
        threads: int | None = None,
        device: int | None = None,
    ):
        # ``threads`` is the CPU backend's option, taken here so that one set of Writer options
        # works with either backend; the GPU runs no encode threads of its own.
        codec = codecs.get(codec)
        refusal = codecs.gpu_support(codec)  # before CuPy: the refusal does not depend on the machine
        if refusal:
            raise ValueError(refusal)
        support = codec.gpu
        assert support is not None  # gpu_support() refuses exactly the codecs without it
        if support.nvcomp not in (None, *nvcomp.ALGORITHMS):  # else nvcomp.py would write zstd under its name
            raise ValueError(f"nvCOMP's {support.nvcomp} is not bound in format/nvcomp.py")
        import cupy

        super().__init__(layout, codec, level, pyramid)
        #: nvCOMP's algorithm for this codec; None: tiles are stored as they are
        self.nvcomp = support.nvcomp
        if layout.tile_bytes > support.max_chunk_bytes:
            raise ValueError(
                f"tile of {layout.tile_bytes} bytes exceeds nvCOMP {self.nvcomp}'s "
                f"{support.max_chunk_bytes >> 20} MiB chunk limit; use smaller tiles or backend='cpu'"
            )
        if self.nvcomp and not support.levels and level != 1:
            warnings.warn(
                f"nvCOMP's {self.nvcomp} has no compression level: level={level} is recorded in the "
                "metadata but the GPU compresses at its own fixed setting (use backend='cpu' for other "
                "levels)",
                UserWarning,
                stacklevel=4,
            )
        self._cupy = cupy
        self.device = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        self.device_name = props["name"].decode()
        #: the CPUs of this GPU's NUMA node: pinned buffers are placed in its memory (None: one node)
        self.numa_cpus = gpu_numa_cpus(self.device.id)
        self.preferred_batch_bytes = batch_bytes or self.default_batch_bytes or self.default_batch_bytes_for(layout)
        slots = slots or self.default_slots
        self._slot_count = slots
        self.batches_in_flight = slots
        self._resources: _Resources | None = None
        self._healthy = True  # no device error seen: the resources may serve the next recording
        self._device_sources: list = []
        self._free_slots = threading.Semaphore(slots)
        self._next = 0
        with self.device:
            self.copy_stream = cupy.cuda.Stream(non_blocking=True)
            self.compute_stream = cupy.cuda.Stream(non_blocking=True)
            self.d2h_stream = cupy.cuda.Stream(non_blocking=True)
        self.tile_stride_bytes = _round_up(layout.tile_bytes, _ALIGN)
        self.output_stride = gpu_output_stride(self.nvcomp, layout.tile_bytes, self.tile_stride_bytes, _ALIGN)

    def describe(self) -> str:
        where = f"{self.device_name}, device {self.device.id}" if self.device.id else self.device_name
        return f"gpu ({where}, nvCOMP {self.nvcomp})" if self.nvcomp else f"gpu ({where})"

    # -- sizing ------------------------------------------------------------------------
    @staticmethod
    def default_batch_bytes_for(layout) -> int:
        """0.5-1 GiB: nvCOMP's throughput grows with the number of tiles per call (docs/design.md);
        the memory budget usually caps it lower (:meth:`default_budget`)."""
        return max(512 << 20, min(1 << 30, 1024 * layout.tile_bytes))

    @classmethod
    def budget_for(cls, device_free: int | None, physical_memory: int | None) -> MemoryBudget:
        """The default budget on a machine with ``device_free`` bytes free on the GPU and
        ``physical_memory`` bytes of RAM (None: unknown, taken as small)."""
        # A large budget needs both a large GPU and a large host: an 8-16 GB GPU keeps its 4 GiB /
        # 2 GiB whatever the RAM, as the pinned buffers only serve the device's batches.
        large = (device_free or 0) >= cls.LARGE_DEVICE_FREE and (physical_memory or 0) >= cls.LARGE_HOST_RAM
        if large:
            device = min(cls.LARGE_MAX_DEVICE_BYTES, int(cls.LARGE_DEVICE_FRACTION * (device_free or 0)))
            host = cls.LARGE_MAX_HOST_BYTES
        else:
            device, host = cls.DEFAULT_MAX_DEVICE_BYTES, cls.DEFAULT_MAX_HOST_BYTES
            if device_free is not None:
                device = min(device, int(cls.DEFAULT_DEVICE_FRACTION * device_free))
        if physical_memory is not None:
            host = min(host, int(cls.DEFAULT_HOST_FRACTION * physical_memory))
        return MemoryBudget(host=host, device=device)

    @_on_device
    def default_budget(self, physical_memory: int | None = None) -> MemoryBudget:
        free, _ = self._cupy.cuda.runtime.memGetInfo()
        with _warm_lock:  # what we keep for the next recording is ours to reuse
            free += sum(r.nbytes()["device"] for k, r in _warm.items() if k[0] == self.device.id)
        pool = self._cupy.get_default_memory_pool()
        if pool.get_limit():  # a pool limit is a smaller device (as _check_free_memory counts it)
            free = min(free, pool.get_limit() - pool.used_bytes())
        return self.budget_for(free, physical_memory)

    @staticmethod
    def packed_buffers(layout, batch_epochs: int, slots: int) -> int:
        """Pinned packed-output buffers a recording needs: shards keep views into them until they
        are written, so the open shard epoch and the shard epochs waiting on storage (the
        collector's limit) hold theirs, plus the batch being copied back."""
        held_epochs = (pending_shard_epochs(layout, batch_epochs) + 1) * layout.tiles_per_shard[0]
        return max(3, -(-held_epochs // batch_epochs) + 2)

    @staticmethod
    def estimate(
        layout,
        batch_bytes: int,
        staging_buffers: int = 2,
        slots: int = 2,
        output_stride=None,
        temp_bytes: int | None = None,
        layouts=None,
        nvcomp: str | None = "zstd",
    ) -> dict[str, int]:
        """Pinned host and device bytes for a batching, without touching the GPU (the widget shows it).

        ``layouts``: every pyramid level (level 0 first) when the batch carries a pyramid.
        ``temp_bytes``: nvCOMP's scratch as nvCOMP states it (None: :func:`nvcomp_temp_estimate`).
        """
        layouts = layouts or (layout,)
        epochs = max(1, batch_bytes // layout.epoch_bytes)
        chunks = epochs * sum(lay.tiles_per_epoch for lay in layouts)
        entries = epochs * sum(lay.slots_per_epoch for lay in layouts)
        tile_stride = _round_up(layout.tile_bytes, _ALIGN)
        output_stride = output_stride or _round_up(layout.compressed_tile_bound() + 64, _ALIGN)
        per_slot = chunks * tile_stride + 2 * chunks * output_stride + chunks * 44 + entries * 16
        packed = GpuBackend.packed_buffers(layout, epochs, slots) * chunks * output_stride
        host = staging_buffers * epochs * layout.epoch_bytes + packed + slots * (entries * 8 + chunks * 4 + 8)
        mirrors = max(staging_buffers, 1) * epochs * layout.epoch_bytes  # device copy of each staging buffer
        levels = epochs * sum(lay.epoch_bytes for lay in layouts[1:])  # reduced levels of the batch
        geometry = _geometry_bytes(layouts, epochs)  # shard-major positions and chunk sizes
        if temp_bytes is None:
            temp_bytes = nvcomp_temp_estimate(chunks, layout.tile_bytes) if nvcomp else 0
        device = slots * per_slot + mirrors + levels + geometry + temp_bytes + _DEVICE_SLACK
        return {"host": host, "device": device}

    @_on_device
    def memory_estimate(self, batch_bytes: int, staging_buffers: int) -> dict[str, int]:
        epochs = max(1, batch_bytes // self.layout.epoch_bytes)
        return self.estimate(
            self.layout,
            batch_bytes,
            staging_buffers,
            self._slot_count,
            self.output_stride,
            self._temp_bytes(epochs * self.pyramid.tiles_per_epoch),
            self.pyramid.layouts,
            self.nvcomp,
        )

    def memory_held(self) -> dict[str, int]:
        return self._resources.nbytes() if self._resources else {"host": 0, "device": 0}

    def _temp_bytes(self, chunks: int) -> int:
        return gpu_temp_bytes(self.nvcomp, chunks, self.layout.tile_bytes, self.compute_stream.ptr)

    @_on_device
    def allocate_staging(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer plus its device mirror (the batch's input on the GPU).

        Host bytes are copied into the pinned buffer and uploaded at submit; CuPy frames are
        copied device-to-device straight into the mirror (write_device), skipping the host.
        Buffers kept from the previous recording of the same batching are handed out first.
        """
        if self._resources is None:
            self._allocate(nbytes)
        resources = self._resources
        assert resources is not None
        in_use = getattr(self, "_staging_handed_out", 0)
        self._staging_handed_out = in_use + 1
        if in_use < len(resources.staging):
            return resources.staging[in_use]
        staging = pin(nbytes, self.numa_cpus)
        resources.mirrors[staging.ctypes.data] = self._cupy.empty(nbytes, dtype=self._cupy.uint8)
        resources.staging.append(staging)
        return staging

    @_on_device
    def write_device(self, staging, offset: int, data) -> None:
        """Enqueue a device-to-device copy of ``data`` (1-D uint8 CuPy array) into the mirror."""
        cupy = self._cupy
        produced = cupy.cuda.Event(block=True, disable_timing=True)
        produced.record(cupy.cuda.get_current_stream())  # after whatever wrote the frame
        self.copy_stream.wait_event(produced)
        mirror = self._mirror(staging)
        cupy.cuda.runtime.memcpyAsync(
            mirror.data.ptr + offset,
            data.data.ptr,
            data.nbytes,
            cupy.cuda.runtime.memcpyDeviceToDevice,
            self.copy_stream.ptr,
        )
        copied = cupy.cuda.Event(block=True, disable_timing=True)
        copied.record(self.copy_stream)
        # Keep the source alive until the copy ran: CuPy's pool could otherwise hand it out again.
        self._device_sources = [(e, a) for e, a in self._device_sources if not e.done] + [(copied, data)]

    def _mirror(self, staging):
        assert self._resources is not None
        return self._resources.mirrors[staging.ctypes.data]

    def _check_free_memory(self, estimate: int, epochs: int) -> None:
        cupy = self._cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        free += pool.free_bytes()  # cached by CuPy: ours to reuse
        limit = pool.get_limit()
        if limit:  # a pool limit (cupy.get_default_memory_pool().set_limit) is a smaller device
            free = min(free, limit - pool.used_bytes())
        free = max(0, free)
        if estimate > 0.95 * free:
            raise MemoryError(
                f"the GPU backend needs about {estimate / 2**30:.2f} GiB of device memory for this layout "
                f"(batches of {epochs} tile epochs, {self._slot_count} in flight) but {self.device_name} has "
                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"
                f"{f' (pool limit {limit / 2**30:.2f} GiB)' if limit else ''}; "
                "use a smaller max_device_bytes, batch_bytes or tiles"
            )

    def _allocate(self, batch_bytes: int) -> None:
        """Device ring and pinned buffers, checked against free device memory before anything is
        allocated, or the ones kept from the previous recording of the same batching."""
        layout = self.layout
        levels = self.pyramid.layouts
        epochs = batch_bytes // layout.epoch_bytes
        key = (self.device.id, _geometry_key(self.pyramid), self.nvcomp, epochs, self._slot_count)
        resources = _take_warm(key)
        if resources is None:
            self._check_free_memory(self.memory_estimate(batch_bytes, self.preferred_staging_buffers)["device"], epochs)
            resources = self._allocate_new(key, epochs)
        self._resources = resources
        # Every level's tiles use level 0's (largest) tile stride, so one pointer ramp serves the pool.
        # Compiled once per process (lru_cache) and kept on disk by CuPy ($CUPY_CACHE_DIR,
        # default ~/.cupy/kernel_cache), so a fresh process loads them instead of compiling.
        self._tiles = [tile_kernel(lay, self.tile_stride_bytes // layout.itemsize) for lay in levels]
        self._reduces = [None] + [
            reduce_kernel(levels[k - 1], levels[k], self.pyramid.step_axes(k), self.pyramid.method)
            for k in range(1, len(levels))
        ]
        self._aggregate = aggregate_kernels()
        every = _geometry_bytes(levels, epochs) > 16 * epochs * self.pyramid.tiles_per_epoch
        for partial in range(1, epochs + 1) if every else (epochs,):
            self._geometry(partial)

    def _allocate_new(self, key: tuple, epochs: int) -> _Resources:
        cupy = self._cupy
        levels = self.pyramid.layouts
        chunks = epochs * self.pyramid.tiles_per_epoch
        entries = epochs * self.pyramid.slots_per_epoch
        temp_size = self._temp_bytes(chunks)
        slots = []
        index = np.arange(chunks, dtype=np.uint64)  # NumPy: cupy.arange's first call imports cupyx (0.4 s)
        for _ in range(self._slot_count):
            d_pool = cupy.empty(chunks * self.tile_stride_bytes, dtype=cupy.uint8)
            d_compressed = cupy.empty(chunks * self.output_stride, dtype=cupy.uint8) if self.nvcomp else d_pool
            slots.append(
                _Slot(
                    d_pool=d_pool,
                    d_compressed=d_compressed,
                    d_sizes=cupy.empty(chunks, dtype=cupy.uint64),
                    d_status=cupy.zeros(chunks, dtype=cupy.int32),
                    d_permuted=cupy.zeros(entries, dtype=cupy.uint64),
                    d_offsets=cupy.zeros(entries + 1, dtype=cupy.uint64),
                    d_packed=cupy.empty(chunks * self.output_stride, dtype=cupy.uint8),
                    input_ptrs=cupy.asarray(index * np.uint64(self.tile_stride_bytes) + np.uint64(d_pool.data.ptr)),
                    output_ptrs=cupy.asarray(index * np.uint64(self.output_stride) + np.uint64(d_compressed.data.ptr)),
                    h_offsets=pin((entries + 1) * 8, self.numa_cpus).view(np.uint64),
                    h_status=pin(chunks * 4, self.numa_cpus).view(np.int32),
                    ready=cupy.cuda.Event(block=True, disable_timing=True),
                    copied=cupy.cuda.Event(block=True, disable_timing=True),
                )
            )
        packed = PinnedRecycler(
            chunks * self.output_stride, self.packed_buffers(self.layout, epochs, self._slot_count), self.numa_cpus
        )
        # Packed buffers are first needed when the first batch comes back: pin them while it fills.
        threading.Thread(target=packed.reserve, args=(packed.limit,), name="tileshard-pin", daemon=True).start()
        resources = _Resources(
            key=key,
            slots=slots,
            staging=[],
            mirrors={},
            packed=packed,
            temp=cupy.empty(max(1, temp_size), dtype=cupy.uint8),
            temp_size=temp_size,
            # Reduced levels of the batch being tiled (one set: the compute stream runs batches in order).
            levels=[None] + [cupy.empty(epochs * lay.epoch_bytes, dtype=cupy.uint8) for lay in levels[1:]],
        )
        self.device.synchronize()  # allocations and fills above ran on the default stream
        return resources

    def _geometry(self, epochs: int):
        """:func:`~.stages.aggregate.aggregate_geometry` of a batch of ``epochs``, cached per batch size."""
        geometries = self._resources.geometries  # type: ignore[union-attr]
        if epochs not in geometries:
            geometries[epochs] = aggregate_geometry(self.pyramid, epochs, self.compute_stream)
        return geometries[epochs]

    # -- pipeline ----------------------------------------------------------------------
    @_on_device
    def submit(self, staging, epochs, host_ranges=None, rows=None) -> GpuTicket:
        cupy = self._cupy
        layout = self.layout
        runtime = cupy.cuda.runtime
        self._free_slots.acquire()
        resources = self._resources
        assert resources is not None
        slot = resources.slots[self._next % self._slot_count]
        self._next += 1
        nbytes = epochs * layout.epoch_bytes
        chunks = epochs * self.pyramid.tiles_per_epoch
        entries = epochs * self.pyramid.slots_per_epoch
        positions, chunk_bytes = self._geometry(epochs)
        mirror = resources.mirrors[staging.ctypes.data]
        for start, stop in host_ranges if host_ranges is not None else [(0, nbytes)]:
            stop = min(stop, nbytes)
            if stop > start:  # only what came from the host (device frames are already there)
                runtime.memcpyAsync(
                    mirror.data.ptr + start,
                    staging.ctypes.data + start,
                    stop - start,
                    runtime.memcpyHostToDevice,
                    self.copy_stream.ptr,
                )
        uploaded = cupy.cuda.Event(block=True, disable_timing=True)
        uploaded.record(self.copy_stream)
        stream = self.compute_stream
        stream.wait_event(uploaded)
        rows = epochs * layout.epoch_rows if rows is None else rows
        source, first_chunk = mirror, 0
        for k, lay in enumerate(self.pyramid.layouts):
            if k:  # level k from level k-1, on the device: no second upload
                target = resources.levels[k]
                reduce_gpu(
                    self._reduces[k],
                    source,
                    target,
                    epochs * lay.epoch_elements,
                    self.pyramid.level_rows(k - 1, rows),
                    stream,
                )
                source = target
            level_chunks = epochs * lay.tiles_per_epoch
            pool_elements = level_chunks * self.tile_stride_bytes // layout.itemsize
            pool = slot.d_pool[first_chunk * self.tile_stride_bytes :]
            tile_gpu(self._tiles[k], source, pool, pool_elements, stream)
            first_chunk += level_chunks
        # The staging buffer and its mirror may be refilled once the kernels have read them.
        consumed = cupy.cuda.Event(block=True, disable_timing=True)
        consumed.record(stream)
        compress_gpu(
            self.nvcomp, slot, chunk_bytes, layout.tile_bytes, chunks, resources.temp, resources.temp_size, stream
        )
        aggregate_gpu(self._aggregate, slot, positions, chunks, entries, self.output_stride, stream)
        runtime.memcpyAsync(
            slot.h_offsets.ctypes.data,
            slot.d_offsets.data.ptr,
            (entries + 1) * 8,
            runtime.memcpyDeviceToHost,
            stream.ptr,
        )
        runtime.memcpyAsync(
            slot.h_status.ctypes.data, slot.d_status.data.ptr, chunks * 4, runtime.memcpyDeviceToHost, stream.ptr
        )
        slot.ready.record(stream)
        return GpuTicket(slot, epochs, consumed)

    @_on_device
    def result(self, ticket: GpuTicket):
        cupy = self._cupy
        runtime = cupy.cuda.runtime
        slot = ticket.slot
        try:
            self.wait_ready(slot)
            chunks = ticket.epochs * self.pyramid.tiles_per_epoch
            entries = ticket.epochs * self.pyramid.slots_per_epoch
            check_gpu_statuses(self.nvcomp, slot.h_status[:chunks])
            offsets = slot.h_offsets[: entries + 1].copy()
            total = int(offsets[-1])
            # The shards keep views into this pinned buffer until they are on disk, then it is
            # recycled: no copy out, and no device slot held while shards wait for storage.
            packed = self._resources.packed.take()  # type: ignore[union-attr]
            runtime.memcpyAsync(
                packed.ctypes.data, slot.d_packed.data.ptr, total, runtime.memcpyDeviceToHost, self.d2h_stream.ptr
            )
            slot.copied.record(self.d2h_stream)
            slot.copied.synchronize()
            return split_packed(self.pyramid, ticket.epochs, offsets, packed)
        except BaseException:
            self._healthy = False  # the device may be in any state: nothing of it is kept for later
            raise
        finally:
            self._free_slots.release()

    @staticmethod
    def wait_ready(slot) -> None:
        """Wait until a batch's device work is done: the one place CUDA errors of a batch surface,
        and the hook reliability tests use to inject one."""
        slot.ready.synchronize()

    # -- benchmark hooks (benchmarks/gpu_ceiling.py): one stage alone, on the backend's own buffers --
    @_on_device
    def upload_async(self, staging, stream=None) -> None:
        """Enqueue the pinned host-to-device copy of ``staging`` into its device mirror, as ``submit``
        uploads it, on ``stream`` (default: the copy stream)."""
        runtime = self._cupy.cuda.runtime
        stream = stream or self.copy_stream
        mirror = self._mirror(staging)
        runtime.memcpyAsync(
            mirror.data.ptr, staging.ctypes.data, staging.nbytes, runtime.memcpyHostToDevice, stream.ptr
        )

    @_on_device
    def compress_async(self, ticket: GpuTicket, stream=None) -> None:
        """Enqueue the compress stage again over the tiles of ``ticket``'s batch (after ``result``,
        before the next ``submit`` reuses its slot), on ``stream`` (default: the compute stream)."""
        chunks = ticket.epochs * self.pyramid.tiles_per_epoch
        _, chunk_bytes = self._geometry(ticket.epochs)
        compress_gpu(
            self.nvcomp,
            ticket.slot,
            chunk_bytes,
            self.layout.tile_bytes,
            chunks,
            self._resources.temp,  # type: ignore[union-attr]
            self._resources.temp_size,  # type: ignore[union-attr]
            stream or self.compute_stream,
        )

    @_on_device
    def compressed_bytes(self, ticket: GpuTicket) -> int:
        """Compressed bytes of every tile of ``ticket``'s batch (synchronises with the device)."""
        return int(ticket.slot.d_sizes[: ticket.epochs * self.pyramid.tiles_per_epoch].sum())

    @_on_device
    def staging_free(self, ticket: GpuTicket, block=True):
        if block:
            ticket.consumed.synchronize()
            return True
        return ticket.consumed.done

    @_on_device
    def close(self):
        """Wait for the streams; the buffers stay allocated for the next recording of the same
        batching (:func:`release_gpu_memory` gives them back), unless a device error was seen."""
        try:
            for stream in (self.copy_stream, self.compute_stream, self.d2h_stream):
                stream.synchronize()
        except BaseException:
            self._healthy = False
            raise
        finally:
            resources, self._resources = self._resources, None
            self._device_sources.clear()
            if resources is not None and self._healthy:
                _keep_warm(resources)
            else:
                del resources
                self._cupy.get_default_memory_pool().free_all_blocks()
