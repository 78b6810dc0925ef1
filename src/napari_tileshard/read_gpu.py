"""The GPU path of :class:`~napari_tileshard.read.ShardReader`: decode and un-tile on the device.

Per read of the plan: the bytes are fetched into a pinned host buffer (on the prefetch thread),
copied to the device in one H2D, moved to nvCOMP's input alignment by one kernel when needed, and
all chunks of the read are decompressed by **one** ``nvcompBatchedZstdDecompressAsync`` call into
their slots of the block's device pool (a block is the part of the output one shard fills; slot =
the chunk's position in the block's box of chunks).  Then :func:`untile_gather` places the pool
into the output: the inverse of the writer's tile lift (``layout.lifted_strides``: element
``(t_d, n_d)`` of tile ``t`` lies at ``t * tile_stride + sum_d n_d * element_stride_d``), evaluated
as a gather driven by the output, one thread per output element, like the writer's tile kernel.
Uncompressed arrays need no decoder: the realigned slots are the pool.

Only CuPy is imported here, and only when a GPU reader is made.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from . import codecs
from .read_plan import Block, ReadPlan

_SLOT_ALIGN = 16  # device pool slots: nvCOMP needs 8-byte aligned outputs; 16 suits vector loads

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


def untile_gather(xp, pool, block: Block, chunk_shape, slot_of_box, slot_stride: int):
    """The block's output (shape ``block.shape``) gathered from ``pool`` (1-D, ``dtype`` of the
    array): the chunk at box position ``p`` lies at ``slot_of_box[p] * slot_stride``, row-major
    inside.  One index per output element, from the same per-dim tables the CPU path uses
    (``DimPart.chunk_of``/``within``); ``xp`` is NumPy or CuPy (the same code on both)."""
    rank = len(chunk_shape)
    element_stride = [int(np.prod(chunk_shape[d + 1 :], dtype=np.int64)) for d in range(rank)]
    box_shape = block.box_shape
    box_stride = [int(np.prod(box_shape[d + 1 :], dtype=np.int64)) for d in range(rank)]

    def along(d, values):
        return xp.asarray(values, dtype=xp.int64).reshape([-1 if e == d else 1 for e in range(rank)])

    box_position = sum(along(d, part.chunk_of * box_stride[d]) for d, part in enumerate(block.parts))
    within = sum(along(d, part.within * element_stride[d]) for d, part in enumerate(block.parts))
    flat = xp.asarray(slot_of_box, dtype=xp.int64)[box_position] * slot_stride + within
    return pool[flat]


class GpuReadPath:
    """Reads a plan on the device for one :class:`~napari_tileshard.read.ShardReader`."""

    def __init__(self, reader):
        import cupy

        from .backends import _nvcomp

        self.reader, self.cupy, self.nvcomp = reader, cupy, _nvcomp
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.codec = reader.codec
        self.itemsize = reader.dtype.itemsize
        self.slot_stride = slot_elements(reader.chunk_bytes, self.itemsize)
        self.align = _nvcomp.decompress_input_alignment() if self.codec.kind == "zstd" else self.itemsize
        self._realign = cupy.RawKernel(REALIGN_SOURCE, "realign")
        self._free_pinned: list = []
        self._pinned_lock = threading.Lock()  # the prefetch thread takes buffers, this one returns them

    # -- host side (prefetch thread) ----------------------------------------------------
    def _fetch(self, read):
        """The read's bytes in a pinned buffer (recycled once its H2D is done)."""
        size = max(read.size, 1)
        with self._pinned_lock:
            # by position, not list.remove(): that compares NumPy arrays element by element
            found = next((i for i, b in enumerate(self._free_pinned) if b.size >= size), None)
            buffer = self._free_pinned.pop(found) if found is not None else None
        if buffer is None:
            memory = self.cupy.cuda.alloc_pinned_memory(size)
            buffer = np.frombuffer(memory, np.uint8, size)
        reader = self.reader
        started = time.perf_counter()
        reader._objects.read_into(read.key, read.start, buffer[: read.size])
        reader.stats.read_seconds += time.perf_counter() - started
        reader.stats.requests += 1
        reader.stats.bytes_read += read.size
        return buffer

    # -- device side ----------------------------------------------------------------------------
    def read(self, plan: ReadPlan, device: bool):
        cupy, reader = self.cupy, self.reader
        dtype = reader.dtype
        with self.stream:
            out = cupy.empty(plan.shape, dtype=dtype)
            reads_of = [0] * len(plan.blocks)
            for r in plan.reads:
                reads_of[r.block] += 1
            fetched = reader._fetched(plan.reads, self._fetch)
            for b, block in enumerate(plan.blocks):
                count = block.box_chunks.size
                pool = cupy.empty((count + 1) * self.slot_stride, dtype=dtype)
                pool[count * self.slot_stride :] = reader.fill_value.item()  # the fill slot (a Python scalar)
                slot_of_box = np.arange(count, dtype=np.int64)
                slot_of_box[block.missing] = count
                for _ in range(reads_of[b]):
                    read, host = next(fetched)
                    positions = read.slots.astype(np.int64)
                    started = time.perf_counter()
                    self._decode(read, host, pool, positions)
                    self.stream.synchronize()  # the H2D from ``host`` is done: it may be refilled
                    reader.stats.decode_seconds += time.perf_counter() - started
                    with self._pinned_lock:
                        self._free_pinned.append(host)
                out[block.region] = untile_gather(cupy, pool, block, reader.chunk_shape, slot_of_box, self.slot_stride)
            self.stream.synchronize()
        out = out.reshape(plan.out_shape)
        return out if device else cupy.asnumpy(out)

    def _decode(self, read, host, pool, positions) -> None:
        """One H2D of the read, one realign kernel, one batched decompression into the pool."""
        cupy, n = self.cupy, len(read.chunks)
        raw = cupy.empty(max(read.size, 1), dtype=cupy.uint8)
        raw[: read.size].set(host[: read.size], stream=self.stream)
        nbytes = read.nbytes.astype(np.int64)
        if self.codec.kind == "none":  # the chunks are the decoded data: copy them into their slots
            dst = positions * self.slot_stride * self.itemsize
            self._copy_chunks(raw, read.offsets.astype(np.int64), pool.view(cupy.uint8), dst, nbytes)
        else:
            aligned = -(-nbytes // self.align) * self.align
            starts = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64)
            if self.align > 1 and np.any(read.offsets % self.align):
                packed = cupy.empty(max(int(aligned.sum()), 1), dtype=cupy.uint8)
                self._copy_chunks(raw, read.offsets.astype(np.int64), packed, starts, nbytes)
            else:
                packed, starts = raw, read.offsets.astype(np.int64)
            chunk_bytes = self.reader.chunk_bytes
            in_ptrs = cupy.asarray(np.uint64(packed.data.ptr) + starts.astype(np.uint64))
            in_sizes = cupy.asarray(nbytes.astype(np.uint64))
            out_sizes = cupy.full(n, chunk_bytes, dtype=cupy.uint64)
            actual = cupy.zeros(n, dtype=cupy.uint64)
            out_ptrs = cupy.asarray(
                np.uint64(pool.data.ptr) + (positions * self.slot_stride * self.itemsize).astype(np.uint64)
            )
            statuses = cupy.zeros(n, dtype=cupy.int32)
            temp_size = self.nvcomp.decompress_temp_bytes(n, chunk_bytes, n * chunk_bytes)
            temp = cupy.empty(max(temp_size, 1), dtype=cupy.uint8)
            self.nvcomp.decompress_async(
                in_ptrs.data.ptr,
                in_sizes.data.ptr,
                out_sizes.data.ptr,
                actual.data.ptr,
                n,
                temp.data.ptr,
                temp_size,
                out_ptrs.data.ptr,
                statuses.data.ptr,
                self.stream.ptr,
            )
            self.stream.synchronize()  # the results are on self.stream, not the default stream
            status, decoded = cupy.asnumpy(statuses), cupy.asnumpy(actual)  # one sync per read
            bad = np.flatnonzero((status != 0) | (decoded != chunk_bytes))
            if bad.size:
                from .read import ChunkDecodeError

                i = int(bad[0])
                raise ChunkDecodeError(
                    read.key,
                    int(read.chunks[i]),
                    f"nvCOMP zstd decode failed (status {int(status[i])}, {int(decoded[i])} bytes decoded, "
                    f"expected {chunk_bytes})",
                )
        self.reader.stats.chunks_decoded += n
        self.reader.stats.bytes_decoded += n * self.reader.chunk_bytes

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
