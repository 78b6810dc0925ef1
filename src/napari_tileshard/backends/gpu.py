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

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import codecs
from . import _nvcomp
from .base import Backend
from .stages.aggregate import (
    aggregate_geometry,
    aggregate_gpu,
    aggregate_kernels,
    split_packed,
)
from .stages.compress import (
    check_gpu_statuses,
    compress_gpu,
    gpu_output_stride,
    gpu_temp_bytes,
)
from .stages.reduce import reduce_gpu, reduce_kernel
from .stages.tile import tile_gpu, tile_kernel

_ALIGN = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pinned(nbytes: int) -> np.ndarray:
    import cupy

    memory = cupy.cuda.alloc_pinned_memory(max(1, nbytes))
    return np.frombuffer(memory, dtype=np.uint8, count=max(1, nbytes))


class _PinnedBlock:
    """Exposes one pinned allocation to NumPy; views of it keep it (not its pool slot) alive."""

    def __init__(self, memory, nbytes: int):
        self.memory = memory
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (memory.ptr, False), "version": 3}


class _PinnedRecycler:
    """Fixed-size pinned host buffers that come back for reuse when their last view is gone.

    The GPU backend copies each batch's packed shards into one of these and the shards keep
    views into it until they are on disk; allocating pinned memory per batch would cost more
    than the copy it saves, and copying out to pageable memory costs a core.
    """

    def __init__(self, nbytes: int):
        import cupy

        self._alloc = cupy.cuda.alloc_pinned_memory
        self.nbytes = max(1, nbytes)
        self._free: list = []
        self._lock = threading.Lock()
        self.allocated = 0

    def reserve(self, count: int) -> None:
        """Allocate up front (pinning memory is slow: do it before recording starts)."""
        while self.allocated < count:
            self._free.append(self._alloc(self.nbytes))
            self.allocated += 1

    def take(self) -> np.ndarray:
        with self._lock:
            memory = self._free.pop() if self._free else None
        if memory is None:
            memory = self._alloc(self.nbytes)
            self.allocated += 1
        block = _PinnedBlock(memory, self.nbytes)
        weakref.finalize(block, self._give_back, memory)
        return np.asarray(block)

    def _give_back(self, memory) -> None:
        with self._lock:
            self._free.append(memory)


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


class GpuBackend(Backend):
    name = "gpu"
    accepts_device_arrays = True
    #: overrides the batch size heuristic (tests set it small so each Writer stays cheap)
    default_batch_bytes: int | None = None

    def __init__(
        self,
        layout,
        codec="zstd",
        level=1,
        *,
        slots: int = 3,
        batch_bytes: int | None = None,
        pyramid=None,
        threads: int | None = None,
    ):
        # ``threads`` is the CPU backend's option, taken here so that one set of Writer options
        # works with either backend; the GPU runs no encode threads of its own.
        refusal = codecs.gpu_support(codec)  # before CuPy: the refusal does not depend on the machine
        if refusal:
            raise ValueError(refusal)
        support = codecs.get(codec).gpu
        assert support is not None  # gpu_support() refuses exactly the codecs without it
        if support.nvcomp not in (None, *_nvcomp.ALGORITHMS):  # else _nvcomp would write zstd under its name
            raise ValueError(f"nvCOMP's {support.nvcomp} is not bound in backends/_nvcomp.py")
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
        self.device = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        self.device_name = props["name"].decode()
        self.preferred_batch_bytes = batch_bytes or self.default_batch_bytes or self.default_batch_bytes_for(layout)
        self.preferred_staging_buffers = 3
        self._slot_count = slots
        self._slots: list[_Slot] = []
        self._mirrors: dict = {}  # pinned staging address -> device input buffer
        self._device_sources: list = []
        self._free_slots = threading.Semaphore(slots)
        self._next = 0
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.d2h_stream = cupy.cuda.Stream(non_blocking=True)
        self.tile_stride_bytes = _round_up(layout.tile_bytes, _ALIGN)
        self.output_stride = gpu_output_stride(self.nvcomp, layout.tile_bytes, self.tile_stride_bytes, _ALIGN)

    def describe(self) -> str:
        return f"gpu ({self.device_name}, nvCOMP {self.nvcomp})" if self.nvcomp else f"gpu ({self.device_name})"

    # -- sizing ------------------------------------------------------------------------
    @staticmethod
    def default_batch_bytes_for(layout) -> int:
        """0.5-1 GiB: nvCOMP's throughput grows with the number of tiles per call (docs/design.md)."""
        return max(512 << 20, min(1 << 30, 1024 * layout.tile_bytes))

    @staticmethod
    def estimate(
        layout,
        batch_bytes: int,
        staging_buffers: int = 3,
        slots: int = 3,
        output_stride=None,
        temp_bytes: int = 0,
        layouts=None,
    ) -> dict[str, int]:
        """Host and device bytes for a batching, without touching the GPU (the widget shows it).

        ``layouts``: every pyramid level (level 0 first) when the batch carries a pyramid.
        """
        layouts = layouts or (layout,)
        epochs = max(1, batch_bytes // layout.epoch_bytes)
        chunks = epochs * sum(lay.tiles_per_epoch for lay in layouts)
        entries = epochs * sum(lay.slots_per_epoch for lay in layouts)
        tile_stride = _round_up(layout.tile_bytes, _ALIGN)
        output_stride = output_stride or _round_up(layout.compressed_tile_bound() + 64, _ALIGN)
        per_slot = chunks * tile_stride + 2 * chunks * output_stride + chunks * 44 + entries * 16
        # Staging, plus the pinned packed-output buffers reserved for batches in flight.
        host = staging_buffers * epochs * layout.epoch_bytes + (slots + 2) * chunks * output_stride
        mirrors = max(staging_buffers, 1) * epochs * layout.epoch_bytes  # device copy of each staging buffer
        levels = epochs * sum(lay.epoch_bytes for lay in layouts[1:])  # reduced levels of the batch
        geometry = chunks * 16  # shard-major positions and chunk sizes
        return {"host": host, "device": slots * per_slot + mirrors + levels + geometry + temp_bytes}

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
        )

    def _temp_bytes(self, chunks: int) -> int:
        return gpu_temp_bytes(self.nvcomp, chunks, self.layout.tile_bytes, self.compute_stream.ptr)

    def allocate_staging(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer plus its device mirror (the batch's input on the GPU).

        Host bytes are copied into the pinned buffer and uploaded at submit; CuPy frames are
        copied device-to-device straight into the mirror (write_device), skipping the host.
        """
        if not self._slots:
            self._allocate(nbytes)
        staging = _pinned(nbytes)
        self._mirrors[staging.ctypes.data] = self._cupy.empty(nbytes, dtype=self._cupy.uint8)
        return staging

    def write_device(self, staging, offset: int, data) -> None:
        """Enqueue a device-to-device copy of ``data`` (1-D uint8 CuPy array) into the mirror."""
        cupy = self._cupy
        produced = cupy.cuda.Event(block=True, disable_timing=True)
        produced.record(cupy.cuda.get_current_stream())  # after whatever wrote the frame
        self.copy_stream.wait_event(produced)
        mirror = self._mirrors[staging.ctypes.data]
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

    def _allocate(self, batch_bytes: int) -> None:
        """Device ring, checked against free device memory before anything is allocated."""
        cupy = self._cupy
        layout = self.layout
        levels = self.pyramid.layouts
        epochs = batch_bytes // layout.epoch_bytes
        chunks = epochs * self.pyramid.tiles_per_epoch
        entries = epochs * self.pyramid.slots_per_epoch
        estimate = self.memory_estimate(batch_bytes, self.preferred_staging_buffers)["device"]
        free, total = cupy.cuda.runtime.memGetInfo()
        if estimate > 0.9 * free:
            raise MemoryError(
                f"the GPU backend needs about {estimate / 2**30:.2f} GiB of device memory for this layout "
                f"(batches of {epochs} tile epochs, {self._slot_count} in flight) but {self.device_name} has "
                f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB; use smaller batch_bytes or tiles"
            )
        self._temp_size = self._temp_bytes(chunks)
        self._d_temp = cupy.empty(max(1, self._temp_size), dtype=cupy.uint8)
        self._geometries: dict = {}
        self._geometry(epochs)
        # Reduced levels of the batch being tiled (one set: the compute stream runs batches in order).
        self._d_levels = [None] + [cupy.empty(epochs * lay.epoch_bytes, dtype=cupy.uint8) for lay in levels[1:]]
        for _ in range(self._slot_count):
            d_pool = cupy.empty(chunks * self.tile_stride_bytes, dtype=cupy.uint8)
            d_compressed = cupy.empty(chunks * self.output_stride, dtype=cupy.uint8) if self.nvcomp else d_pool
            index = cupy.arange(chunks, dtype=cupy.uint64)
            self._slots.append(
                _Slot(
                    d_pool=d_pool,
                    d_compressed=d_compressed,
                    d_sizes=cupy.empty(chunks, dtype=cupy.uint64),
                    d_status=cupy.zeros(chunks, dtype=cupy.int32),
                    d_permuted=cupy.zeros(entries, dtype=cupy.uint64),
                    d_offsets=cupy.zeros(entries + 1, dtype=cupy.uint64),
                    d_packed=cupy.empty(chunks * self.output_stride, dtype=cupy.uint8),
                    input_ptrs=cupy.uint64(d_pool.data.ptr) + index * cupy.uint64(self.tile_stride_bytes),
                    output_ptrs=cupy.uint64(d_compressed.data.ptr) + index * cupy.uint64(self.output_stride),
                    h_offsets=_pinned((entries + 1) * 8).view(np.uint64),
                    h_status=_pinned(chunks * 4).view(np.int32),
                    ready=cupy.cuda.Event(block=True, disable_timing=True),
                    copied=cupy.cuda.Event(block=True, disable_timing=True),
                )
            )
        self._packed = _PinnedRecycler(chunks * self.output_stride)
        self._packed.reserve(self._slot_count + 2)  # in flight: slots + batches waiting on storage
        self.device.synchronize()  # allocations and fills above ran on the default stream
        # Every level's tiles use level 0's (largest) tile stride, so one pointer ramp serves the pool.
        self._tiles = [tile_kernel(lay, self.tile_stride_bytes // layout.itemsize) for lay in levels]
        self._reduces = [None] + [
            reduce_kernel(levels[k - 1], levels[k], self.pyramid.step_axes(k), self.pyramid.method)
            for k in range(1, len(levels))
        ]
        self._aggregate = aggregate_kernels()

    def _geometry(self, epochs: int):
        """:func:`~.stages.aggregate.aggregate_geometry` of a batch of ``epochs``, cached per batch size."""
        if epochs not in self._geometries:
            self._geometries[epochs] = aggregate_geometry(self.pyramid, epochs, self.compute_stream)
        return self._geometries[epochs]

    # -- pipeline ----------------------------------------------------------------------
    def submit(self, staging, epochs, host_ranges=None, rows=None) -> GpuTicket:
        cupy = self._cupy
        layout = self.layout
        runtime = cupy.cuda.runtime
        self._free_slots.acquire()
        slot = self._slots[self._next % self._slot_count]
        self._next += 1
        nbytes = epochs * layout.epoch_bytes
        chunks = epochs * self.pyramid.tiles_per_epoch
        entries = epochs * self.pyramid.slots_per_epoch
        positions, chunk_bytes = self._geometry(epochs)
        mirror = self._mirrors[staging.ctypes.data]
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
                target = self._d_levels[k]
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
        compress_gpu(self.nvcomp, slot, chunk_bytes, layout.tile_bytes, chunks, self._d_temp, self._temp_size, stream)
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
            packed = self._packed.take()
            runtime.memcpyAsync(
                packed.ctypes.data, slot.d_packed.data.ptr, total, runtime.memcpyDeviceToHost, self.d2h_stream.ptr
            )
            slot.copied.record(self.d2h_stream)
            slot.copied.synchronize()
            return split_packed(self.pyramid, ticket.epochs, offsets, packed)
        finally:
            self._free_slots.release()

    @staticmethod
    def wait_ready(slot) -> None:
        """Wait until a batch's device work is done: the one place CUDA errors of a batch surface,
        and the hook reliability tests use to inject one."""
        slot.ready.synchronize()

    # -- benchmark hooks (benchmarks/gpu_ceiling.py): one stage alone, on the backend's own buffers --
    def upload_async(self, staging, stream=None) -> None:
        """Enqueue the pinned host-to-device copy of ``staging`` into its device mirror, as ``submit``
        uploads it, on ``stream`` (default: the copy stream)."""
        runtime = self._cupy.cuda.runtime
        stream = stream or self.copy_stream
        mirror = self._mirrors[staging.ctypes.data]
        runtime.memcpyAsync(
            mirror.data.ptr, staging.ctypes.data, staging.nbytes, runtime.memcpyHostToDevice, stream.ptr
        )

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
            self._d_temp,
            self._temp_size,
            stream or self.compute_stream,
        )

    def compressed_bytes(self, ticket: GpuTicket) -> int:
        """Compressed bytes of every tile of ``ticket``'s batch (synchronises with the device)."""
        return int(ticket.slot.d_sizes[: ticket.epochs * self.pyramid.tiles_per_epoch].sum())

    def staging_free(self, ticket: GpuTicket, block=True):
        if block:
            ticket.consumed.synchronize()
            return True
        return ticket.consumed.done

    def close(self):
        for stream in (self.copy_stream, self.compute_stream, self.d2h_stream):
            stream.synchronize()
        self._slots.clear()
        self._mirrors.clear()
        self._device_sources.clear()
        self._cupy.get_default_memory_pool().free_all_blocks()
