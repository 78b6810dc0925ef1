"""Compress stage: encode tiles with the codec, one chunk per tile.

What a codec's bitstream is lives in :mod:`napari_tileshard.format.codecs`; here the CPU calls the codec
object (:func:`compress_cpu`) and the GPU calls nvCOMP's batched C API for every tile of a batch at
once, leaving sizes and statuses on the device (:func:`compress_gpu`).
"""

from __future__ import annotations

import numpy as np

from ....gpu import nvcomp

__all__ = ["check_gpu_statuses", "compress_cpu", "compress_gpu", "gpu_output_stride", "gpu_temp_bytes"]


def compress_cpu(codec, tiles: np.ndarray) -> tuple[list, list[int]]:
    """Encode each row of ``tiles`` (uint8, one tile per row): (buffers, encoded size per tile).

    The codecs' encoders release the GIL, so the CPU backend runs this on many threads.
    """
    return codec.encode_tiles(tiles)


def gpu_output_stride(algorithm: str | None, tile_bytes: int, tile_stride_bytes: int, align: int) -> int:
    """Bytes between two compressed slots: nvCOMP's worst case for one tile, rounded to ``align``
    (``algorithm`` None: tiles are stored as they are, in the tile pool itself)."""
    if not algorithm:
        return tile_stride_bytes
    return -(-nvcomp.max_output_chunk_bytes(tile_bytes) // align) * align


def gpu_temp_bytes(algorithm: str | None, chunks: int, tile_bytes: int, stream_ptr: int) -> int:
    """Device scratch nvCOMP needs to compress ``chunks`` tiles in one call."""
    if not algorithm:
        return 0
    return nvcomp.temp_bytes(chunks, tile_bytes, stream_ptr)


def compress_gpu(
    algorithm: str | None, slot, chunk_bytes, tile_bytes: int, chunks: int, temp, temp_size: int, stream
) -> None:
    """Enqueue the compression of the first ``chunks`` tiles of ``slot``'s pool on ``stream``.

    ``chunk_bytes``: device array of each tile's uncompressed bytes.  Writes ``slot.d_sizes`` and
    (nvCOMP) ``slot.d_status`` and the compressed slots; with no algorithm the sizes are the
    uncompressed ones and the pool is the output.
    """
    with stream:
        if algorithm:
            nvcomp.compress_async(
                slot.input_ptrs.data.ptr,
                chunk_bytes.data.ptr,
                tile_bytes,
                chunks,
                temp.data.ptr,
                temp_size,
                slot.output_ptrs.data.ptr,
                slot.d_sizes.data.ptr,
                slot.d_status.data.ptr,
                stream.ptr,
            )
        else:
            slot.d_sizes[:chunks] = chunk_bytes


def check_gpu_statuses(algorithm: str | None, statuses: np.ndarray) -> None:
    """Raise :class:`NvcompError` naming the first tile nvCOMP could not compress (host statuses)."""
    if not algorithm:
        return
    failed = np.flatnonzero(statuses)
    if failed.size:
        raise nvcomp.NvcompError(
            f"nvCOMP could not compress {failed.size} tiles (first: tile {int(failed[0])}, "
            f"status {int(statuses[failed[0]])})"
        )
