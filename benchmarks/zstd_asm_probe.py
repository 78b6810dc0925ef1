"""How fast one thread decodes our zstd chunks with each libzstd build a reader could call.

python-zstandard (the reader's decoder) builds libzstd without its x86-64 assembly Huffman
decoder (``huf_decompress_amd64.S``: its wheels hold no ``*_asm_loop`` symbol); tensorstore's
build and numcodecs' have it.  This measures what that costs on the machine it runs on, on the
chunks the Writer makes (SyntheticCamera frames, cut into tiles, zstd level 1), one thread:

* ``zstandard``: python-zstandard, one ``decompress`` per chunk (a context reused);
* ``zstandard-batch``: python-zstandard's batch as the reader used it, one call per shard's
  chunks (``multi_decompress_to_buffer``; ``TILESHARD_ZSTD_DECODER=zstandard``);
* ``reader-libzstd``: the reader's decode now, one libzstd multi-frame call per shard's chunks
  straight into a reused buffer (:mod:`napari_tileshard.format.libzstd`: numcodecs' build);
* ``libzstd-asm`` / ``libzstd-c``: the system's libzstd through ctypes, one context reused,
  with its assembly decoder and with it switched off (``ZSTD_d_disableHuffmanAssembly``), the
  same library otherwise (absent where the system has no libzstd.so.1);
* ``numcodecs``: numcodecs' ``zstd.decompress`` into a reused buffer.

GB/s of decoded bytes, best of ``--repeat`` rounds, each decoder once per round in turn.

    python benchmarks/zstd_asm_probe.py --tiles 64k-4m,256k-4m,1m-16m
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from napari_tileshard import SyntheticCamera  # noqa: E402
from napari_tileshard.format import libzstd  # noqa: E402
from napari_tileshard.format.codecs import Zstd  # noqa: E402

#: (frames deep, tile side) per layout name, as bench_read.TILES
TILES = {"64k-4m": (2, 128), "256k-4m": (2, 256), "1m-16m": (8, 256)}
#: chunks per shard per layout (4 MiB / 64 KiB, 4 MiB / 256 KiB, 16 MiB / 1 MiB)
SHARD_CHUNKS = {"64k-4m": 64, "256k-4m": 16, "1m-16m": 16}
#: zstd.h: ZSTD_d_experimentalParam5 (libzstd >= 1.5.4)
ZSTD_D_DISABLE_HUFFMAN_ASSEMBLY = 1004


def chunks_of(tile: tuple[int, int], frames: int) -> tuple[list[bytes], int]:
    """The level-1 zstd chunks of ``frames`` camera frames cut into ``tile`` tiles, and a tile's bytes."""
    depth, side = tile
    camera = SyntheticCamera((2048, 2048), "uint16")
    stack = np.stack([camera.frame(i) for i in range(frames)])
    tiles = stack.reshape(frames // depth, depth, 2048 // side, side, 2048 // side, side).transpose(0, 2, 4, 1, 3, 5)
    tiles = np.ascontiguousarray(tiles).reshape(-1, depth * side * side)
    compressor = zstandard.ZstdCompressor(level=1)
    return [compressor.compress(t.tobytes()) for t in tiles], tiles[0].nbytes


def _system_libzstd():
    name = ctypes.util.find_library("zstd")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.ZSTD_versionNumber.restype = ctypes.c_uint
    lib.ZSTD_createDCtx.restype = ctypes.c_void_p
    lib.ZSTD_decompressDCtx.restype = ctypes.c_size_t
    lib.ZSTD_decompressDCtx.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.ZSTD_DCtx_setParameter.restype = ctypes.c_size_t
    lib.ZSTD_DCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    return lib


def decoders(chunks: list[bytes], nbytes: int, shard_chunks: int) -> dict:
    """One pass over ``chunks`` per decoder; each checks once that every chunk decodes whole."""
    runs = {}
    context = zstandard.ZstdDecompressor()
    runs["zstandard"] = lambda: [context.decompress(c) for c in chunks]
    # the reader's batch: one call per shard's chunks, into a reused buffer
    codec = Zstd(level=1)
    shards = [chunks[i : i + shard_chunks] for i in range(0, len(chunks), shard_chunks)]
    batches = []
    for shard in shards:
        lengths = np.array([len(c) for c in shard], dtype=np.int64)
        batches.append((b"".join(shard), np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths))
    scratch = np.empty((shard_chunks, nbytes), dtype=np.uint8)
    for source, offsets, lengths in batches:
        if codec._decoded_runs(source, offsets, lengths, nbytes) is None:
            raise SystemExit("python-zstandard's batch refused the chunks")

    def reader_batches(decoder: str):
        def run():
            saved = os.environ.get(libzstd.DECODER_SETTING)
            os.environ[libzstd.DECODER_SETTING] = decoder
            try:
                return [codec.decoded_chunks_released(*b, nbytes, scratch) for b in batches]
            finally:
                if saved is None:
                    del os.environ[libzstd.DECODER_SETTING]
                else:
                    os.environ[libzstd.DECODER_SETTING] = saved

        return run

    runs["zstandard-batch"] = reader_batches("zstandard")
    if libzstd.frame_decoder() is not None:
        runs["reader-libzstd"] = reader_batches("auto")
    lib = _system_libzstd()
    if lib is not None:
        out = ctypes.create_string_buffer(nbytes)
        for name, disable in (("libzstd-asm", 0), ("libzstd-c", 1)):
            dctx = lib.ZSTD_createDCtx()
            if lib.ZSTD_isError(lib.ZSTD_DCtx_setParameter(dctx, ZSTD_D_DISABLE_HUFFMAN_ASSEMBLY, disable)):
                continue  # a libzstd before 1.5.4: no switch
            if [lib.ZSTD_decompressDCtx(dctx, out, nbytes, c, len(c)) for c in chunks] != [nbytes] * len(chunks):
                raise SystemExit(f"{name}: a chunk did not decode to {nbytes} bytes")
            runs[name] = lambda d=dctx: [lib.ZSTD_decompressDCtx(d, out, nbytes, c, len(c)) for c in chunks]
    try:
        from numcodecs import zstd as numcodecs_zstd
    except ImportError:
        return runs
    buffer = np.empty(nbytes, dtype=np.uint8)
    runs["numcodecs"] = lambda: [numcodecs_zstd.decompress(c, buffer) for c in chunks]
    return runs


def measure(chunks: list[bytes], nbytes: int, shard_chunks: int, repeat: int) -> dict[str, float]:
    """GB/s per decoder, best of ``repeat`` rounds; every round runs each decoder once, in turn
    (a shared machine's slow moments fall on all of them)."""
    runs = decoders(chunks, nbytes, shard_chunks)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: round(nbytes * len(chunks) / seconds / 1e9, 3) for name, seconds in best.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", default="64k-4m,256k-4m,1m-16m")
    parser.add_argument("--frames", type=int, default=16, help="frames cut into chunks (16 MiB each 8 frames)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"# zstandard {zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION}); one thread; GB/s decoded")
    for name in args.tiles.split(","):
        chunks, nbytes = chunks_of(TILES[name], args.frames)
        rates = measure(chunks, nbytes, SHARD_CHUNKS[name], args.repeat)
        ratio = {
            f"{k}/zstandard-batch": round(v / rates["zstandard-batch"], 3)
            for k, v in rates.items()
            if k in ("reader-libzstd", "libzstd-asm", "libzstd-c", "numcodecs")
        }
        print(name, json.dumps(rates), json.dumps(ratio), flush=True)
    lib = _system_libzstd()
    print(f"# system libzstd: {lib.ZSTD_versionNumber() if lib is not None else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
