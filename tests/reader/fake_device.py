"""A stand-in for CuPy and nvCOMP that runs the GPU read path's host side on the CPU.

"Device" arrays are NumPy arrays in host memory whose ``.data.ptr`` is their address, so the
path's raw copies (``memcpyAsync`` with pointers) and nvCOMP's pointer tables work as they are;
streams and events do nothing (every operation completes when enqueued); the two kernels run as
NumPy (``untile`` through :func:`~napari_tileshard.reader.gpu.untile_emulated`, the kernel's
arithmetic); nvCOMP's batched zstd decompression reads its pointer and size tables from memory
and decodes each frame with python-zstandard.  What this checks: batching, tables, offsets,
buffer sizes and the output's layout, on every commit; not timing or stream ordering.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import zstandard

from napari_tileshard.gpu.pinned import PinnedPool
from napari_tileshard.reader.gpu import untile_emulated


class DeviceArray(np.ndarray):
    """A NumPy array that answers ``.data.ptr`` as CuPy's arrays do."""

    @property
    def data(self):  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, host) -> None:
        self[...] = host


def _device(array) -> DeviceArray:
    """A copy in "device" memory, as ``cupy.asarray`` of host data makes one."""
    return np.array(array, order="C", copy=True).view(DeviceArray)


class _Stream:
    _next = 1

    def __init__(self, non_blocking: bool = False):
        self.ptr = _Stream._next
        _Stream._next += 1

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Device:
    def synchronize(self) -> None:
        pass


def _memcpy(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    ctypes.memmove(dst, src, size)


def _realign(grid, block, args, stream=None) -> None:
    src, dst, src_offsets, dst_offsets, nbytes = args
    for s, d, n in zip(src_offsets.tolist(), dst_offsets.tolist(), nbytes.tolist()):
        dst[d : d + n] = src[s : s + n]


def _untile(grid, block, args, stream=None) -> None:
    out, pool, slot_table, params, table_offset, row_start, blocks, chunk_of, within, ndim, slot_stride = args
    ndim, width = int(ndim), 6 * int(ndim) + 1
    flat = out.reshape(-1)
    elements = pool[: pool.size - pool.size % out.itemsize].view(out.dtype)
    for a in range(int(blocks)):
        slots = slot_table[int(table_offset[a]) :]
        untile_emulated(
            flat, elements, slots, params[a * width : (a + 1) * width], chunk_of, within, ndim, int(slot_stride)
        )


class _Module:
    def __init__(self, code: str = ""):
        pass

    def get_function(self, name: str):
        assert name.startswith("untile"), name
        return _untile


def _raw_kernel(source: str, name: str):
    assert name == "realign", name
    return _realign


cupy = types.SimpleNamespace(
    uint8=np.uint8,
    int32=np.int32,
    int64=np.int64,
    uint64=np.uint64,
    empty=lambda shape, dtype=np.float64: np.empty(shape, dtype).view(DeviceArray),
    asarray=lambda array, dtype=None: _device(np.asarray(array, dtype=dtype)),
    asnumpy=lambda array: np.array(array).view(np.ndarray),
    RawKernel=_raw_kernel,
    RawModule=_Module,
    cuda=types.SimpleNamespace(
        Stream=_Stream,
        Event=_Event,
        Device=_Device,
        alloc_pinned_memory=bytearray,
        runtime=types.SimpleNamespace(memcpyAsync=_memcpy, memcpyDeviceToHost=2),
    ),
)


def _table(address: int, count: int, ctype):
    return (ctype * count).from_address(address)


def _decompress_async(
    input_ptrs, input_sizes, buffer_sizes, actual_sizes, n, temp_ptr, temp_size, output_ptrs, statuses, stream
) -> None:
    inputs, outputs = _table(input_ptrs, n, ctypes.c_int64), _table(output_ptrs, n, ctypes.c_int64)
    sizes, capacity = _table(input_sizes, n, ctypes.c_int64), _table(buffer_sizes, n, ctypes.c_int64)
    actual, status = _table(actual_sizes, n, ctypes.c_uint64), _table(statuses, n, ctypes.c_int32)
    for i in range(n):
        try:
            decoded = zstandard.ZstdDecompressor().decompress(
                ctypes.string_at(inputs[i], sizes[i]), max_output_size=capacity[i]
            )
        except zstandard.ZstdError:
            status[i], actual[i] = 1, 0
            continue
        ctypes.memmove(outputs[i], decoded, len(decoded))
        status[i], actual[i] = 0, len(decoded)


nvcomp = types.SimpleNamespace(
    decompress_input_alignment=lambda: 8,
    decompress_temp_bytes=lambda n, chunk_bytes, total: 64,
    decompress_async=_decompress_async,
)


def pinned_pool(idle_bytes: int = 1 << 30) -> PinnedPool:
    """A :class:`PinnedPool` over plain host memory (what the stand-in's copies read and write)."""
    return PinnedPool(idle_bytes, allocate=lambda nbytes: np.zeros(nbytes, np.uint8))
