"""nvCOMP batched zstd through its low-level C API (ctypes on libnvcomp): the GPU side of the
codecs (:mod:`.codecs`' ``gpu.nvcomp``), compression for the writer's GPU backend and
decompression for the reader's GPU path.  Loading the library needs no CuPy and no GPU.

Why the C API and not ``nvidia.nvcomp``'s Python ``encode()``: the C call takes device arrays
of pointers and sizes and leaves the compressed sizes and statuses on the device, so a batch
is compressed without any host synchronisation.  The output is standard zstd frames (the
low-level API has no container), which every zstd decoder reads.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = [
    "ALGORITHMS",
    "AlignmentRequirements",
    "CompressOpts",
    "DecompressOpts",
    "NvcompError",
    "compress_async",
    "decompress_async",
    "decompress_input_alignment",
    "decompress_temp_bytes",
    "decompress_unavailable_reason",
    "load",
    "max_output_chunk_bytes",
    "temp_bytes",
]

_SUCCESS = 0
ALGORITHMS = ("zstd",)  # the nvCOMP algorithms bound here (a codec's ``gpu.nvcomp``)


class CompressOpts(ctypes.Structure):
    """``nvcompBatchedZstdCompressOpts_t``: 64 reserved bytes, zeroed (nvCOMP 5 and 6)."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


class NvcompError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def load():
    """The libnvcomp shared library, from the ``nvidia-libnvcomp-cu1x`` wheel or the system."""
    lib = None
    try:
        from nvidia import libnvcomp

        lib = libnvcomp.load_library()
    except ImportError:
        pass
    if lib is None:
        for name in ("libnvcomp.so.6", "libnvcomp.so.5", "libnvcomp.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
    if lib is None:
        raise ImportError("libnvcomp not found (install nvidia-libnvcomp-cu12 or nvidia-libnvcomp-cu13)")
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.nvcompBatchedZstdCompressGetMaxOutputChunkSize.argtypes = [ctypes.c_size_t, CompressOpts, size_p]
    lib.nvcompBatchedZstdCompressAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_void_p,
        CompressOpts,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    for fn in (lib.nvcompBatchedZstdCompressGetMaxOutputChunkSize, lib.nvcompBatchedZstdCompressAsync):
        fn.restype = ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != _SUCCESS:
        raise NvcompError(f"{what} failed with nvcompStatus {status}")


def max_output_chunk_bytes(chunk_bytes: int) -> int:
    out = ctypes.c_size_t()
    _check(
        load().nvcompBatchedZstdCompressGetMaxOutputChunkSize(chunk_bytes, CompressOpts(), ctypes.byref(out)),
        "nvcompBatchedZstdCompressGetMaxOutputChunkSize",
    )
    return out.value


def temp_bytes(num_chunks: int, chunk_bytes: int, stream_ptr: int) -> int:
    lib = load()
    out = ctypes.c_size_t()
    size_p = ctypes.POINTER(ctypes.c_size_t)
    if hasattr(lib, "nvcompBatchedZstdCompressGetTempSize"):  # nvCOMP 6
        fn = lib.nvcompBatchedZstdCompressGetTempSize
        fn.argtypes = [ctypes.c_size_t, ctypes.c_size_t, CompressOpts, size_p, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        status = fn(num_chunks, chunk_bytes, CompressOpts(), ctypes.byref(out), num_chunks * chunk_bytes, stream_ptr)
    else:  # nvCOMP 5
        fn = lib.nvcompBatchedZstdCompressGetTempSizeAsync
        fn.argtypes = [ctypes.c_size_t, ctypes.c_size_t, CompressOpts, size_p, ctypes.c_size_t]
        fn.restype = ctypes.c_int
        status = fn(num_chunks, chunk_bytes, CompressOpts(), ctypes.byref(out), num_chunks * chunk_bytes)
    _check(status, "nvcompBatchedZstdCompressGetTempSize")
    return out.value


def compress_async(
    input_ptrs: int,
    input_sizes: int,
    chunk_bytes: int,
    num_chunks: int,
    temp_ptr: int,
    temp_size: int,
    output_ptrs: int,
    output_sizes: int,
    statuses: int,
    stream_ptr: int,
) -> None:
    """Enqueue the batched compression on ``stream_ptr``; all pointers are device addresses."""
    _check(
        load().nvcompBatchedZstdCompressAsync(
            input_ptrs,
            input_sizes,
            chunk_bytes,
            num_chunks,
            temp_ptr,
            temp_size,
            output_ptrs,
            output_sizes,
            CompressOpts(),
            statuses,
            stream_ptr,
        ),
        "nvcompBatchedZstdCompressAsync",
    )


# -- decompression (ShardReader's GPU path) ------------------------------------------------------
class DecompressOpts(ctypes.Structure):
    """``nvcompBatchedZstdDecompressOpts_t`` (nvCOMP 5): the decompression backend (an enum,
    0 = ``NVCOMP_DECOMPRESS_BACKEND_DEFAULT``) and 60 reserved bytes, zeroed."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class AlignmentRequirements(ctypes.Structure):
    """``nvcompAlignmentRequirements_t``: minimum alignments of input, output and temp buffers."""

    _fields_ = [("input", ctypes.c_size_t), ("output", ctypes.c_size_t), ("temp", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def _decompress_functions():
    """(temp size, decompress) bound with nvCOMP 5's signatures (the header ``nvcomp/zstd.h``)."""
    lib = load()
    size_p = ctypes.POINTER(ctypes.c_size_t)
    name = next(
        (
            n
            for n in ("nvcompBatchedZstdDecompressGetTempSizeAsync", "nvcompBatchedZstdDecompressGetTempSize")
            if hasattr(lib, n)
        ),
        None,
    )
    if name is None or not hasattr(lib, "nvcompBatchedZstdDecompressAsync"):
        raise ImportError("this libnvcomp has no batched zstd decompression (nvCOMP 5 or later is needed)")
    temp = getattr(lib, name)
    temp.argtypes = [ctypes.c_size_t, ctypes.c_size_t, DecompressOpts, size_p, ctypes.c_size_t]
    if name == "nvcompBatchedZstdDecompressGetTempSize":  # nvCOMP 6 adds the stream (zstd.h)
        temp.argtypes = [*temp.argtypes, ctypes.c_void_p]
    temp.restype = ctypes.c_int
    decompress = lib.nvcompBatchedZstdDecompressAsync
    decompress.argtypes = [
        ctypes.c_void_p,  # device_compressed_chunk_ptrs
        ctypes.c_void_p,  # device_compressed_chunk_bytes
        ctypes.c_void_p,  # device_uncompressed_buffer_bytes
        ctypes.c_void_p,  # device_uncompressed_chunk_bytes (actual, out)
        ctypes.c_size_t,  # num_chunks
        ctypes.c_void_p,  # device_temp_ptr
        ctypes.c_size_t,  # temp_bytes
        ctypes.c_void_p,  # device_uncompressed_chunk_ptrs
        DecompressOpts,
        ctypes.c_void_p,  # device_statuses
        ctypes.c_void_p,  # stream
    ]
    decompress.restype = ctypes.c_int
    return temp, decompress


def decompress_unavailable_reason(algorithm: str = "zstd") -> str | None:
    """Why nvCOMP cannot decompress ``algorithm`` here (no libnvcomp, or one without batched
    decompression), or None when it can."""
    if algorithm not in ALGORITHMS:
        return f"nvCOMP's {algorithm} is not bound in format/nvcomp.py"
    try:
        _decompress_functions()
    except (ImportError, OSError) as exc:
        return str(exc)
    return None


def decompress_input_alignment() -> int:
    """The input alignment nvCOMP requires of compressed chunks (8 when it cannot be asked)."""
    lib = load()
    fn = getattr(lib, "nvcompBatchedZstdDecompressGetRequiredAlignments", None)
    if fn is None:
        return 8  # nvcompZstdRequiredDecompressionAlignment: the most restrictive of the three
    fn.argtypes = [DecompressOpts, ctypes.POINTER(AlignmentRequirements)]
    fn.restype = ctypes.c_int
    out = AlignmentRequirements()
    _check(fn(DecompressOpts(), ctypes.byref(out)), "nvcompBatchedZstdDecompressGetRequiredAlignments")
    return max(1, int(out.input))


def decompress_temp_bytes(num_chunks: int, max_chunk_bytes: int, total_bytes: int) -> int:
    temp, _ = _decompress_functions()
    out = ctypes.c_size_t()
    stream = [None] if len(temp.argtypes) == 6 else []  # nvCOMP 6: the default stream
    _check(
        temp(num_chunks, max_chunk_bytes, DecompressOpts(), ctypes.byref(out), total_bytes, *stream),
        "nvcompBatchedZstdDecompressGetTempSize",
    )
    return out.value


def decompress_async(
    input_ptrs: int,
    input_sizes: int,
    buffer_sizes: int,
    actual_sizes: int,
    num_chunks: int,
    temp_ptr: int,
    temp_size: int,
    output_ptrs: int,
    statuses: int,
    stream_ptr: int,
) -> None:
    """Enqueue one batched decompression of ``num_chunks`` zstd frames on ``stream_ptr``; all
    pointers are device addresses; per-chunk statuses and decoded sizes stay on the device."""
    _, decompress = _decompress_functions()
    _check(
        decompress(
            input_ptrs,
            input_sizes,
            buffer_sizes,
            actual_sizes,
            num_chunks,
            temp_ptr,
            temp_size,
            output_ptrs,
            DecompressOpts(),
            statuses,
            stream_ptr,
        ),
        "nvcompBatchedZstdDecompressAsync",
    )
