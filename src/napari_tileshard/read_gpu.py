"""The GPU path of :class:`~napari_tileshard.read.ShardReader`: decode and un-tile on the device.

The plan's blocks (one per shard) are grouped into **batches** of consecutive blocks, up to a
cap of decoded bytes (``TILESHARD_GPU_BATCH_BYTES``, 512 MiB) and of compressed bytes (that
cap and ``max_read_bytes``), so that one nvCOMP call sees thousands of chunks (nvCOMP is fast
only with many chunks per call; one shard is ~64).  Per batch:

1. the prefetch thread reads all its reads into one pinned staging buffer (reused; two of them
   alternate, so the next batch is read while this one is on the device);
2. one H2D of the staging buffer; one kernel moves the chunks to nvCOMP's input alignment;
3. **one** ``nvcompBatchedZstdDecompressAsync`` call decodes every chunk of the batch into its
   slot of the batch's device pool (slot 0 holds the fill value: absent chunks point there);
4. one un-tiling kernel per block writes the block's part of the device output, one thread per
   output element: the inverse of the writer's tile lift, evaluated as a gather from per-dim
   tables (:func:`untile_tables`, the same ``DimPart.chunk_of``/``within`` the CPU path uses).

D2H only when NumPy output is asked.  The batching and the tables are plain NumPy
(:func:`plan_batches`, :func:`block_params`); :func:`untile_emulated` evaluates the kernel's
arithmetic with NumPy so that the CPU test suite checks them.  Only CuPy is imported here, and
only when a GPU reader is made.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import codecs
from .read_plan import Block, Read, ReadPlan

_SLOT_ALIGN = 16  # device pool slots and staged reads: nvCOMP needs 8-byte aligned buffers
#: the most decoded bytes of one batch (its device pool; ``TILESHARD_GPU_BATCH_BYTES``): 512 MiB
#: is 2048 chunks of 256 KiB per nvCOMP call, and a 4 GiB read still pipelines over 8 batches
DEFAULT_BATCH_BYTES = 512 << 20


def batch_bytes_setting() -> int:
    """``TILESHARD_GPU_BATCH_BYTES`` (decoded bytes per nvCOMP call), else 512 MiB."""
    text = os.environ.get("TILESHARD_GPU_BATCH_BYTES")
    if not text:
        return DEFAULT_BATCH_BYTES
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"TILESHARD_GPU_BATCH_BYTES must be a positive number of bytes, got {text!r}")
    return int(text)


REALIGN_SOURCE = r"""
extern "C" __global__ void realign(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                   const long long* __restrict__ src_offsets,
                                   const long long* __restrict__ dst_offsets,
                                   const long long* __restrict__ nbytes) {
  const long long c = blockIdx.x;
  const unsigned char* s = src + src_offsets[c];
  unsigned char* d = dst + dst_offsets[c];
  const long long n = nbytes[c];
  for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}
"""

#: params of one block (int64, ``ndim`` each): out_strides, lo, shape, box_strides,
#: element_strides, dim_offset; then the block's element count
UNTILE_SOURCE = r"""
struct __align__(16) e16 { unsigned long long a, b; };
template <typename T>
__device__ void untile(T* __restrict__ out, const T* __restrict__ pool, const long long* __restrict__ slots,
                       const long long* __restrict__ p, const long long* __restrict__ chunk_of,
                       const long long* __restrict__ within, int ndim, long long slot_stride) {
  const long long* out_strides = p;
  const long long* lo = p + ndim;
  const long long* shape = p + 2 * ndim;
  const long long* box_strides = p + 3 * ndim;
  const long long* element_strides = p + 4 * ndim;
  const long long* dim_offset = p + 5 * ndim;
  const long long count = p[6 * ndim];
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += (long long)gridDim.x * blockDim.x) {
    long long rest = i, out_index = 0, box = 0, inside = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const long long n = shape[d];
      const long long pos = lo[d] + rest % n;
      rest /= n;
      const long long t = dim_offset[d] + pos;
      out_index += pos * out_strides[d];
      box += chunk_of[t] * box_strides[d];
      inside += within[t] * element_strides[d];
    }
    out[out_index] = pool[slots[box] * slot_stride + inside];
  }
}
#define UNTILE(NAME, T) \
extern "C" __global__ void NAME(T* out, const T* pool, const long long* slots, const long long* p, \
                                const long long* chunk_of, const long long* within, int ndim, \
                                long long slot_stride) { \
  untile<T>(out, pool, slots, p, chunk_of, within, ndim, slot_stride); }
UNTILE(untile1, unsigned char)
UNTILE(untile2, unsigned short)
UNTILE(untile4, unsigned int)
UNTILE(untile8, unsigned long long)
UNTILE(untile16, e16)
"""


def gpu_read_unavailable_reason(codec) -> str | None:
    """Why the GPU cannot decode chunks of ``codec`` (a ``read.ChunkCodec``) here, or None."""
    if codec.kind not in ("zstd", "none"):
        return f"nvCOMP does not decode {codec.kind!r} chunks (zstd and uncompressed only)"
    if codec.big_endian:
        return "big-endian chunks are decoded on the CPU"
    limit = codecs.get("zstd").gpu.max_chunk_bytes  # type: ignore[union-attr]
    if codec.kind == "zstd" and codec.chunk_bytes > limit:
        return f"chunks of {codec.chunk_bytes} bytes are larger than nvCOMP's zstd limit ({limit} bytes)"
    from .backends import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is None and codec.kind == "zstd":
        try:
            from .backends import _nvcomp

            _nvcomp._decompress_functions()
        except (ImportError, OSError) as exc:
            return str(exc)
    return reason


def slot_elements(chunk_bytes: int, itemsize: int) -> int:
    """Elements from one pool slot to the next (slots start ``_SLOT_ALIGN``-aligned)."""
    return -(-chunk_bytes // _SLOT_ALIGN) * _SLOT_ALIGN // itemsize


# -- host-side batching (plain NumPy) -------------------------------------------------------------
@dataclass
class DeviceBatch:
    """Consecutive blocks of a plan decoded by one nvCOMP call.

    ``read_base[i]``: where read ``reads[i]`` starts in the staging buffer (aligned); per chunk
    of the batch (reads in order, each read's chunks in order): ``chunk_src`` (offset in the
    staging buffer), ``chunk_nbytes``, ``chunk_slot`` (its slot in the pool; slot 0 is the fill
    value), ``chunk_read`` (index into ``reads``).  ``slot_table`` holds, block after block
    (``table_offset[k]`` for ``blocks[k]``), the slot of every box position."""

    blocks: list[int]
    reads: list[Read]
    read_base: np.ndarray
    staging_bytes: int
    chunk_src: np.ndarray
    chunk_nbytes: np.ndarray
    chunk_slot: np.ndarray
    chunk_read: np.ndarray
    slot_table: np.ndarray
    table_offset: list[int]
    slots: int

    @property
    def chunks(self) -> int:
        return len(self.chunk_slot)


def _aligned(n, align: int = _SLOT_ALIGN):
    return -(-n // align) * align


def plan_batches(plan: ReadPlan, chunk_bytes: int, max_compressed: int, max_decoded: int) -> list[DeviceBatch]:
    """Group the plan's blocks (in order, whole blocks) into batches within both caps (a block
    larger than a cap is a batch alone); blocks without reads of ``plan`` (another rank's, or
    wholly absent) still get their fill-value slots."""
    reads_of: list[list[Read]] = [[] for _ in plan.blocks]
    for read in plan.reads:
        reads_of[read.block].append(read)
    batches: list[DeviceBatch] = []
    current: list[int] = []
    compressed = decoded = 0
    for b in range(len(plan.blocks)):
        size = sum(_aligned(r.size) for r in reads_of[b])
        slots = sum(len(r.chunks) for r in reads_of[b]) * _aligned(chunk_bytes)
        if current and (compressed + size > max_compressed or decoded + slots > max_decoded):
            batches.append(_batch(plan, current, reads_of))
            current, compressed, decoded = [], 0, 0
        current.append(b)
        compressed += size
        decoded += slots
    if current:
        batches.append(_batch(plan, current, reads_of))
    return batches


def _batch(plan: ReadPlan, blocks: list[int], reads_of: list[list[Read]]) -> DeviceBatch:
    reads = [r for b in blocks for r in reads_of[b]]
    sizes = np.array([_aligned(r.size) for r in reads], dtype=np.int64)
    read_base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if reads else np.zeros(0, np.int64)
    empty = np.zeros(0, np.int64)
    chunk_src = np.concatenate([base + r.offsets for base, r in zip(read_base, reads)]) if reads else empty
    chunk_nbytes = np.concatenate([r.nbytes for r in reads]).astype(np.int64) if reads else empty
    chunk_read = np.repeat(np.arange(len(reads)), [len(r.chunks) for r in reads]).astype(np.int64)
    tables, table_offset, next_slot, chunk_slot = [], [], 1, []
    position = 0
    for b in blocks:
        table = np.zeros(plan.blocks[b].box_chunks.size, dtype=np.int64)  # 0: the fill slot
        for read in reads_of[b]:
            slots = np.arange(next_slot, next_slot + len(read.chunks), dtype=np.int64)
            table[read.slots] = slots
            chunk_slot.append(slots)
            next_slot += len(read.chunks)
        table_offset.append(position)
        position += table.size
        tables.append(table)
    return DeviceBatch(
        blocks,
        reads,
        read_base,
        int(sizes.sum()),
        chunk_src.astype(np.int64),
        chunk_nbytes,
        np.concatenate(chunk_slot) if chunk_slot else empty,
        chunk_read,
        np.concatenate(tables) if tables else empty,
        table_offset,
        next_slot,
    )


def untile_tables(plan: ReadPlan) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Per output position along each dim (dims concatenated): the box index of its chunk inside
    its block and the element inside the chunk; ``dim_offset[d]`` where dim ``d`` starts."""
    chunk_of, within, dim_offset, at = [], [], [], 0
    for d in range(len(plan.shape)):
        parts = sorted({block.parts[d].lo: block.parts[d] for block in plan.blocks}.values(), key=lambda p: p.lo)
        dim_offset.append(at)
        for part in parts:
            chunk_of.append(part.chunk_of.astype(np.int64))
            within.append(part.within.astype(np.int64))
        at += plan.shape[d]
    empty = np.zeros(0, np.int64)
    return (np.concatenate(chunk_of) if chunk_of else empty, np.concatenate(within) if within else empty, dim_offset)


def block_params(plan: ReadPlan, block: Block, chunk_shape, dim_offset: list[int]) -> np.ndarray:
    """The un-tiling kernel's parameters for ``block`` (see ``UNTILE_SOURCE``)."""
    ndim = len(plan.shape)
    out_strides = [int(np.prod(plan.shape[d + 1 :], dtype=np.int64)) for d in range(ndim)]
    box_strides = [int(np.prod(block.box_shape[d + 1 :], dtype=np.int64)) for d in range(ndim)]
    element_strides = [int(np.prod(chunk_shape[d + 1 :], dtype=np.int64)) for d in range(ndim)]
    lo = [p.lo for p in block.parts]
    count = int(np.prod(block.shape, dtype=np.int64))
    return np.array(
        out_strides + lo + list(block.shape) + box_strides + element_strides + list(dim_offset) + [count],
        dtype=np.int64,
    )


def untile_emulated(out_flat, pool, slots, params, chunk_of, within, ndim: int, slot_stride: int) -> None:
    """The un-tiling kernel's arithmetic with NumPy (all elements at once): for checking the
    tables and parameters on machines without a GPU."""
    p = params
    out_strides, lo, shape = p[:ndim], p[ndim : 2 * ndim], p[2 * ndim : 3 * ndim]
    box_strides, element_strides, dim_offset = p[3 * ndim : 4 * ndim], p[4 * ndim : 5 * ndim], p[5 * ndim : 6 * ndim]
    rest = np.arange(int(p[6 * ndim]), dtype=np.int64)
    out_index = np.zeros_like(rest)
    box = np.zeros_like(rest)
    inside = np.zeros_like(rest)
    for d in range(ndim - 1, -1, -1):
        pos = lo[d] + rest % shape[d]
        rest = rest // shape[d]
        t = dim_offset[d] + pos
        out_index += pos * out_strides[d]
        box += chunk_of[t] * box_strides[d]
        inside += within[t] * element_strides[d]
    out_flat[out_index] = pool[slots[box] * slot_stride + inside]


# -- the device path ----------------------------------------------------------------------------------
class GpuReadPath:
    """Reads a plan on the device for one :class:`~napari_tileshard.read.ShardReader`."""

    def __init__(self, reader):
        import cupy

        from .backends import _nvcomp

        self.reader, self.cupy, self.nvcomp = reader, cupy, _nvcomp
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.codec = reader.codec
        self.itemsize = reader.dtype.itemsize
        if self.itemsize not in (1, 2, 4, 8, 16):
            raise ValueError(f"{reader.location}: no device un-tiling for items of {self.itemsize} bytes")
        self.slot_stride = slot_elements(reader.chunk_bytes, self.itemsize)
        self.align = _nvcomp.decompress_input_alignment() if self.codec.kind == "zstd" else 1
        self._realign = cupy.RawKernel(REALIGN_SOURCE, "realign")
        self._untile = cupy.RawModule(code=UNTILE_SOURCE).get_function(f"untile{self.itemsize}")
        self._io = ThreadPoolExecutor(4, thread_name_prefix="tileshard-gpu-read")
        self._free_pinned: list[np.ndarray] = []
        self._pinned_lock = threading.Lock()  # the prefetch thread takes buffers, this one returns them
        self._device: dict[str, object] = {}  # reused device buffers by role, grown when too small
        fill = np.full(reader.chunk_elements, reader.fill_value, dtype=reader.dtype).view(np.uint8)
        self._fill = cupy.asarray(fill)

    def close(self) -> None:
        self._io.shutdown()
        self._free_pinned.clear()
        self._device.clear()

    def batches(self, plan: ReadPlan) -> list[DeviceBatch]:
        reader = self.reader
        decoded = batch_bytes_setting()
        return plan_batches(plan, reader.chunk_bytes, min(reader.max_read_bytes, decoded), decoded)

    # -- host side (prefetch thread) ----------------------------------------------------
    def _fetch(self, batch: DeviceBatch) -> np.ndarray:
        """All reads of ``batch`` in one pinned buffer (recycled once its H2D is done)."""
        size = max(batch.staging_bytes, 1)
        with self._pinned_lock:
            # by position, not list.remove(): that compares NumPy arrays element by element
            found = next((i for i, b in enumerate(self._free_pinned) if b.size >= size), None)
            buffer = self._free_pinned.pop(found) if found is not None else None
        if buffer is None:
            memory = self.cupy.cuda.alloc_pinned_memory(size)
            buffer = np.frombuffer(memory, np.uint8, size)
        reader = self.reader
        started = time.perf_counter()

        def fetch(read: Read, base: int) -> None:
            reader._objects.read_into(read.key, read.start, buffer[base : base + read.size])

        list(self._io.map(fetch, batch.reads, batch.read_base.tolist()))  # a batch has many reads
        reader.stats.read_seconds += time.perf_counter() - started
        reader.stats.requests += len(batch.reads)
        reader.stats.bytes_read += sum(read.size for read in batch.reads)
        return buffer

    def _recycle(self, host: np.ndarray) -> None:
        with self._pinned_lock:
            self._free_pinned.append(host)
            while len(self._free_pinned) > max(2, self.reader.prefetch + 1):
                self._free_pinned.pop(0)  # keep a bounded number of pinned buffers

    def _buffer(self, role: str, nbytes: int):
        """A reused device buffer of at least ``nbytes`` (first ``nbytes`` returned)."""
        buffer = self._device.get(role)
        if buffer is None or buffer.size < nbytes:  # type: ignore[attr-defined]
            self._device.pop(role, None)
            buffer = self._device[role] = self.cupy.empty(max(nbytes, 1), dtype=self.cupy.uint8)
        return buffer[: max(nbytes, 1)]  # type: ignore[index]

    # -- device side ----------------------------------------------------------------------------
    def read(self, plan: ReadPlan, device: bool):
        cupy, reader = self.cupy, self.reader
        with self.stream:
            out = cupy.empty(plan.shape, dtype=reader.dtype)
            if out.size:
                chunk_of, within, dim_offset = untile_tables(plan)
                tables = (cupy.asarray(chunk_of), cupy.asarray(within))
                for batch, host in reader._fetched(self.batches(plan), self._fetch):
                    started = time.perf_counter()
                    pool = self._decode(batch, host)
                    self._place(plan, batch, pool, out, tables, dim_offset)
                    reader.stats.decode_seconds += time.perf_counter() - started
            self.stream.synchronize()
        out = out.reshape(plan.out_shape)
        return out if device else cupy.asnumpy(out, stream=self.stream)

    def stage(self, batch: DeviceBatch, host: np.ndarray):
        """One H2D of the batch's staging buffer, then its chunks at nvCOMP's input alignment:
        (device bytes, per-chunk offsets in them)."""
        raw = self._buffer("raw", batch.staging_bytes)
        if batch.staging_bytes:
            raw[: batch.staging_bytes].set(host[: batch.staging_bytes], stream=self.stream)
        if self.align > 1 and np.any(batch.chunk_src % self.align):
            aligned = _aligned(batch.chunk_nbytes, self.align)
            starts = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64)
            packed = self._buffer("packed", int(aligned.sum()))
            self._copy_chunks(raw, batch.chunk_src, packed, starts, batch.chunk_nbytes)
            return packed, starts
        return raw, batch.chunk_src

    def _decode(self, batch: DeviceBatch, host: np.ndarray):
        """Stage the batch and decode all its chunks into the pool by one nvCOMP call; the
        pinned buffer is recycled once the H2D is done.  Returns the pool (bytes)."""
        cupy, n, chunk_bytes = self.cupy, batch.chunks, self.reader.chunk_bytes
        slot_bytes = self.slot_stride * self.itemsize
        pool = self._buffer("pool", batch.slots * slot_bytes)
        pool[:chunk_bytes] = self._fill  # slot 0: the fill value
        staged, starts = self.stage(batch, host)
        dst = batch.chunk_slot * slot_bytes
        if self.codec.kind == "none":  # the chunks are the decoded data: copy them into their slots
            self._copy_chunks(staged, starts, pool, dst, batch.chunk_nbytes)
        elif n:
            self.decompress(staged, starts, batch.chunk_nbytes, pool, dst)
            self.reader.stats.device_decode_calls += 1
            self.stream.synchronize()  # statuses are on self.stream; one sync per batch
            status, decoded = cupy.asnumpy(self._statuses[:n]), cupy.asnumpy(self._actual[:n])
            bad = np.flatnonzero((status != 0) | (decoded != chunk_bytes))
            if bad.size:
                from .read import ChunkDecodeError

                i = int(bad[0])
                read = batch.reads[int(batch.chunk_read[i])]
                number = int(read.chunks[i - int(np.searchsorted(batch.chunk_read, batch.chunk_read[i]))])
                raise ChunkDecodeError(
                    read.key,
                    number,
                    f"nvCOMP zstd decode failed (status {int(status[i])}, {int(decoded[i])} bytes decoded, "
                    f"expected {chunk_bytes})",
                )
        self.stream.synchronize()  # the H2D from ``host`` is done: it may be refilled
        self._recycle(host)
        self.reader.stats.chunks_decoded += n
        self.reader.stats.bytes_decoded += n * chunk_bytes
        return pool

    def decompress(self, staged, starts: np.ndarray, nbytes: np.ndarray, pool, dst: np.ndarray) -> None:
        """Enqueue one batched nvCOMP decompression: chunk ``i`` from ``staged[starts[i]:]``
        (``nbytes[i]`` bytes) into ``pool[dst[i]:]``; statuses and sizes stay on the device."""
        cupy, n, chunk_bytes = self.cupy, len(nbytes), self.reader.chunk_bytes
        pointers = np.concatenate(
            [np.uint64(staged.data.ptr) + starts.astype(np.uint64), np.uint64(pool.data.ptr) + dst.astype(np.uint64)]
        )
        sizes = np.concatenate([nbytes.astype(np.uint64), np.full(n, chunk_bytes, np.uint64)])
        device_pointers = cupy.asarray(pointers)
        device_sizes = cupy.asarray(sizes)
        self._actual = cupy.empty(n, dtype=cupy.uint64)
        self._statuses = cupy.empty(n, dtype=cupy.int32)
        temp_size = self.nvcomp.decompress_temp_bytes(n, chunk_bytes, n * chunk_bytes)
        temp = self._buffer("temp", temp_size)
        self.nvcomp.decompress_async(
            device_pointers.data.ptr,
            device_sizes.data.ptr,
            device_sizes.data.ptr + 8 * n,
            self._actual.data.ptr,
            n,
            temp.data.ptr,
            temp_size,
            device_pointers.data.ptr + 8 * n,
            self._statuses.data.ptr,
            self.stream.ptr,
        )
        self._in_flight = (device_pointers, device_sizes)  # alive until the next call (stream order)

    def _place(self, plan: ReadPlan, batch: DeviceBatch, pool, out, tables, dim_offset) -> None:
        """One un-tiling kernel per block of the batch into ``out``."""
        cupy, ndim = self.cupy, len(plan.shape)
        slot_table = cupy.asarray(batch.slot_table)
        params = cupy.asarray(
            np.concatenate(
                [block_params(plan, plan.blocks[b], self.reader.chunk_shape, dim_offset) for b in batch.blocks]
            )
        )
        width = 6 * ndim + 1
        for k, b in enumerate(batch.blocks):
            count = int(np.prod(plan.blocks[b].shape, dtype=np.int64))
            if not count:
                continue
            grid = min(-(-count // 256), 65535 * 16)
            args = (
                out,
                pool,
                slot_table[batch.table_offset[k] :],
                params[k * width : (k + 1) * width],
                tables[0],
                tables[1],
                np.int32(ndim),
                np.int64(self.slot_stride),
            )
            self._untile((grid,), (256,), args, stream=self.stream)

    def time_decompress(self, batch: DeviceBatch, repeat: int = 5) -> float:
        """Best seconds of the nvCOMP call alone on ``batch``'s chunks already on the device (the
        ceiling of this path; for benchmarks)."""
        host = self._fetch(batch)
        with self.stream:
            staged, starts = self.stage(batch, host)
            slot_bytes = self.slot_stride * self.itemsize
            pool = self._buffer("pool", batch.slots * slot_bytes)
            best = float("inf")
            for _ in range(repeat + 1):  # the first call warms up (temp buffer, kernels)
                self.stream.synchronize()
                started = time.perf_counter()
                self.decompress(staged, starts, batch.chunk_nbytes, pool, batch.chunk_slot * slot_bytes)
                self.stream.synchronize()
                best = min(best, time.perf_counter() - started)
        self._recycle(host)
        return best

    def _copy_chunks(self, src, src_offsets, dst, dst_offsets, nbytes) -> None:
        """One kernel: chunk ``i``'s ``nbytes[i]`` bytes from ``src_offsets[i]`` to ``dst_offsets[i]``."""
        cupy = self.cupy
        n = len(nbytes)
        if not n:
            return
        args = (
            src,
            dst,
            cupy.asarray(src_offsets, dtype=cupy.int64),
            cupy.asarray(dst_offsets, dtype=cupy.int64),
            cupy.asarray(nbytes, dtype=cupy.int64),
        )
        self._realign((n,), (256,), args, stream=self.stream)
