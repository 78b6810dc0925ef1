"""libzstd's own frame decoder through ctypes: many zstd frames in one call, without the GIL.

The reader decodes the chunks of a shard that lie back to back with one call of libzstd's
``ZSTD_decompressDCtx``, which decodes a run of concatenated frames into one buffer, frame after
frame (each frame's declared size checked by libzstd), so the chunks land straight in the
caller's rows.  python-zstandard (the writer's codec, and the chunk-by-chunk decode that names a
bad chunk) has no such call into a given buffer, and its wheels build libzstd as one
amalgamated C file, which leaves out libzstd's x86-64 assembly Huffman decoder
(facebook/zstd#2789); on camera tiles at level 1, mostly Huffman-coded literals, that decoder is
what a decode spends its time in (``benchmarks/zstd_asm_probe.py``).

Which libzstd: the one inside numcodecs' zstd extension (numcodecs is zarr-python's own
dependency; its build exports libzstd's API and holds the assembly decoder), else the system's
(``ctypes.util.find_library``).  Where neither is found (Windows: extensions export no C API) or
``TILESHARD_ZSTD_DECODER=zstandard`` is set, :func:`frame_decoder` is None and callers keep
python-zstandard.  ctypes releases the GIL for each call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading

__all__ = ["DECODER_SETTING", "FrameDecoder", "frame_decoder"]

#: the environment variable that picks the batch zstd decoder: ``auto`` (default: libzstd where
#: found) or ``zstandard`` (python-zstandard's batch call)
DECODER_SETTING = "TILESHARD_ZSTD_DECODER"


class FrameDecoder:
    """One loaded libzstd: :meth:`decode_frames` with a decompression context per thread."""

    def __init__(self, library: ctypes.CDLL, origin: str):
        self.origin = origin  # where the library was found (for messages and benchmarks)
        self.version = int(library.ZSTD_versionNumber())
        self._decompress = library.ZSTD_decompressDCtx
        self._is_error = library.ZSTD_isError
        self._create, self._free = library.ZSTD_createDCtx, library.ZSTD_freeDCtx
        self._local = threading.local()

    def decode_frames(self, src_address: int, src_bytes: int, dest_address: int, dest_bytes: int) -> int:
        """Decode the concatenated zstd frames at ``src_address`` into ``dest_bytes`` at
        ``dest_address`` (never more); the bytes decoded, or -1 where libzstd refused (a damaged
        frame, a frame whose declared size its blocks do not fill, too little room).  The
        caller keeps both buffers alive for the call."""
        context = getattr(self._local, "context", None)
        if context is None:
            context = self._local.context = _Context(self._create, self._free)
        written = self._decompress(context.handle, dest_address, dest_bytes, src_address, src_bytes)
        return -1 if self._is_error(written) else int(written)


class _Context:
    """A ZSTD_DCtx, freed with this object (a thread's, dropped when the thread ends)."""

    def __init__(self, create, free):
        self.handle, self._free = create(), free
        if not self.handle:
            raise MemoryError("libzstd could not allocate a decompression context")

    def __del__(self):
        self._free(self.handle)


def frame_decoder() -> FrameDecoder | None:
    """The libzstd decoder to use, or None (python-zstandard then decodes): per
    :data:`DECODER_SETTING`, read at each call (a batch's, not a chunk's)."""
    value = os.environ.get(DECODER_SETTING, "auto").strip().lower() or "auto"
    if value == "zstandard":
        return None
    if value != "auto":
        raise ValueError(f"{DECODER_SETTING} must be 'auto' or 'zstandard', got {value!r}")
    return _loaded()


@functools.cache
def _loaded() -> FrameDecoder | None:
    for origin, path in _candidates():
        try:
            library = ctypes.CDLL(path)
            _declare(library)
        except (OSError, AttributeError):  # not loadable, or no exported libzstd API
            continue
        if library.ZSTD_versionNumber() >= 10400:  # 1.4: ZSTD_decompressDCtx's multi-frame contract
            return FrameDecoder(library, origin)
    return None


def _candidates() -> list[tuple[str, str]]:
    found = []
    try:
        from numcodecs import zstd as numcodecs_zstd

        found.append(("numcodecs", numcodecs_zstd.__file__))
    except ImportError:  # numcodecs built without zstd
        pass
    system = ctypes.util.find_library("zstd")
    if system:
        found.append(("system", system))
    return found


def _declare(library: ctypes.CDLL) -> None:
    size, pointer = ctypes.c_size_t, ctypes.c_void_p
    library.ZSTD_versionNumber.restype = ctypes.c_uint
    library.ZSTD_versionNumber.argtypes = []
    library.ZSTD_createDCtx.restype = pointer
    library.ZSTD_createDCtx.argtypes = []
    library.ZSTD_freeDCtx.restype = size
    library.ZSTD_freeDCtx.argtypes = [pointer]
    library.ZSTD_decompressDCtx.restype = size
    library.ZSTD_decompressDCtx.argtypes = [pointer, pointer, size, pointer, size]
    library.ZSTD_isError.restype = ctypes.c_uint
    library.ZSTD_isError.argtypes = [size]
