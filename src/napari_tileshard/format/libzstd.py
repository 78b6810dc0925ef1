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
from collections.abc import Iterable

__all__ = ["DECODER_SETTING", "FrameDecoder", "frame_decoder"]

#: the environment variable that picks the batch zstd decoder: ``auto`` (default: libzstd where
#: found) or ``zstandard`` (python-zstandard's batch call)
DECODER_SETTING = "TILESHARD_ZSTD_DECODER"


class FrameDecoder:
    """One loaded libzstd: :meth:`decode_frames` with a decompression context per thread."""

    def __init__(self, library: ctypes.CDLL, origin: str, holding_gil: ctypes.PyDLL | None = None):
        self.origin = origin  # where the library was found (for messages and benchmarks)
        self.path: str | None = getattr(library, "_name", None)  # its file, where ctypes loaded one
        self.version = int(library.ZSTD_versionNumber())
        self._decompress = library.ZSTD_decompressDCtx
        self._create, self._free = library.ZSTD_createDCtx, library.ZSTD_freeDCtx
        # Calls of a few instructions keep the GIL (the same library loaded as a PyDLL): a ctypes
        # call through a CDLL gives the GIL up and takes it back, and each taking back waits its
        # turn among the other decode threads.
        quick = holding_gil or library
        self._is_error = quick.ZSTD_isError
        self._local = threading.local()
        # the streaming calls of decode_prefix (stream, reset, set a parameter); None: a build
        # without them decodes whole frames only
        self._streaming = None
        if all(hasattr(library, name) for name in _STREAMING):
            self._streaming = (library.ZSTD_decompressStream, quick.ZSTD_DCtx_reset, library.ZSTD_DCtx_setParameter)
        #: whether :meth:`decode_prefix` works with this build (it decodes into the caller's
        #: buffer with ZSTD_d_stableOutBuffer, an experimental parameter of libzstd >= 1.4.4)
        self.decodes_prefixes = self._prefix_context() is not None

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

    def decode_prefix(
        self, src_address: int, block_ends: Iterable[int], dest_address: int, dest_bytes: int, need: int
    ) -> int:
        """Decode the first ``need`` bytes (at least) of the zstd frame at ``src_address`` into
        ``dest_address``, whose ``dest_bytes`` hold all of its content, and stop: libzstd is given
        the frame up to each of ``block_ends`` in turn (offsets from ``src_address`` where its
        blocks end, ascending) until that many bytes are out, and decodes each block given
        straight into the buffer.  The bytes decoded (whole blocks: ``need`` or more), or -1
        where libzstd refused or the ends ran out first.  One call of libzstd per end (one,
        mostly), each without the GIL."""
        context = self._prefix_context()
        if context is None or self._streaming is None:
            return -1
        stream, reset, _ = self._streaming
        source, target = context.source, context.target
        target.dst, target.size, target.pos = dest_address, dest_bytes, 0
        source.src, source.pos = src_address, 0
        try:
            for end in block_ends:
                source.size = end
                if self._is_error(stream(context.handle, context.target_ref, context.source_ref)):
                    return -1
                if target.pos >= need:
                    return int(target.pos)
            return -1
        finally:
            reset(context.handle, _RESET_SESSION_ONLY)  # the next frame starts afresh

    def _prefix_context(self) -> _StreamContext | None:
        """This thread's streaming context for :meth:`decode_prefix` (None: the build lacks it)."""
        context = getattr(self._local, "stream", None)
        if context is None:
            if self._streaming is None:
                return None
            context = _StreamContext(self._create, self._free)
            if self._is_error(self._streaming[2](context.handle, _D_STABLE_OUT_BUFFER, 1)):
                return None
            self._local.stream = context
        return context


class _Context:
    """A ZSTD_DCtx, freed with this object (a thread's, dropped when the thread ends)."""

    def __init__(self, create, free):
        self.handle, self._free = create(), free
        if not self.handle:
            raise MemoryError("libzstd could not allocate a decompression context")

    def __del__(self):
        self._free(self.handle)


class _InBuffer(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


class _OutBuffer(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


class _StreamContext(_Context):
    """A ZSTD_DCtx for streaming, with its ZSTD_inBuffer and ZSTD_outBuffer (reused)."""

    def __init__(self, create, free):
        super().__init__(create, free)
        self.source, self.target = _InBuffer(), _OutBuffer()
        self.source_ref, self.target_ref = ctypes.byref(self.source), ctypes.byref(self.target)


#: zstd.h: ZSTD_d_stableOutBuffer (ZSTD_d_experimentalParam2): the output buffer is the same at
#: every call and holds the whole frame, so libzstd decodes into it, not into a buffer of its own
_D_STABLE_OUT_BUFFER = 1001
#: libzstd's streaming calls FrameDecoder.decode_prefix needs
_STREAMING = ("ZSTD_decompressStream", "ZSTD_DCtx_reset", "ZSTD_DCtx_setParameter")
#: zstd.h: ZSTD_reset_session_only
_RESET_SESSION_ONLY = 1


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
            library, holding_gil = ctypes.CDLL(path), ctypes.PyDLL(path)
            _declare(library)
            _declare(holding_gil)
        except (OSError, AttributeError):  # not loadable, or no exported libzstd API
            continue
        if library.ZSTD_versionNumber() >= 10400:  # 1.4: ZSTD_decompressDCtx's multi-frame contract
            return FrameDecoder(library, origin, holding_gil)
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
    try:  # the streaming calls (FrameDecoder.decode_prefix), where the build exports them
        library.ZSTD_decompressStream.restype = size
        library.ZSTD_decompressStream.argtypes = [pointer, ctypes.POINTER(_OutBuffer), ctypes.POINTER(_InBuffer)]
        library.ZSTD_DCtx_reset.restype = size
        library.ZSTD_DCtx_reset.argtypes = [pointer, ctypes.c_int]
        library.ZSTD_DCtx_setParameter.restype = size
        library.ZSTD_DCtx_setParameter.argtypes = [pointer, ctypes.c_int, ctypes.c_int]
    except AttributeError:
        pass
