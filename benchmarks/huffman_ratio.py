"""Ratio and CPU speed of the Huffman-only zstd reference encoder on camera tiles.

    PYTHONPATH=$PWD/src python benchmarks/huffman_ratio.py --frames 8 --out benchmarks/results/huffman_zstd_2core

On ``--frames`` 2048² uint16 ``SyntheticCamera`` frames cut into tiles of 2 × 256² (256 KiB, each
tile one zstd frame), for each block size (128 KiB first, the format's maximum):

* ratio of ``format.huffman_zstd.encode_frame`` (headers included), of zstd level 1
  (python-zstandard, one frame per tile), of the order-0 entropy bound (each block's byte
  entropy, no headers) and of the Huffman payload bound (each block's optimal <= 11-bit code
  lengths times its counts, no headers: what integer code lengths cost before any table);
* block types written (compressed / raw / RLE);
* one-thread CPU rates: the reference encoder, zstd -1, and libzstd decoding each kind of frame.

``--image PATH`` measures a recording from a file instead (TIFF or ``.npy``, 2D or a stack of
2D frames, any integer dtype), cut into tiles of up to 2 × 256² (edge tiles smaller), e.g. the
fluorescence microscopy image stardist ships as test data (``stardist/data/images/img2d.tif``,
512² uint16 nuclei from the 2018 Data Science Bowl).  zstd level 3 is measured beside level 1: the
matching that level adds on top of the entropy stage.

Prints a table and, with ``--out``, writes it there (``huffman_ratio.txt``, ``huffman_ratio.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from zstd_ceiling import contiguous_tiles  # noqa: E402

from napari_tileshard import SyntheticCamera  # noqa: E402
from napari_tileshard.format.huffman_zstd import code_lengths, encode_frame  # noqa: E402

TILE = (2, 256, 256)


def image_tiles(path: Path, tile=TILE) -> tuple[list[np.ndarray], str, int]:
    """The tiles of the recording in ``path`` (one row of uint8 each, edge tiles smaller) and what it is."""
    if path.suffix == ".npy":
        data = np.load(path)
    else:
        import tifffile

        data = tifffile.imread(path)
    frames = data.reshape(-1, *data.shape[-2:])
    tz, ty, tx = tile
    tiles = [
        np.ascontiguousarray(frames[t : t + tz, y : y + ty, x : x + tx]).reshape(-1).view(np.uint8)
        for t in range(0, frames.shape[0], tz)
        for y in range(0, frames.shape[1], ty)
        for x in range(0, frames.shape[2], tx)
    ]
    described = f"{path.name}: {data.shape} {data.dtype}, tiles of up to {tz}×{ty}×{tx}, {len(tiles)} tiles"
    return tiles, described, data.dtype.itemsize


def runs_estimate(tile: np.ndarray, itemsize: int, block_size: int = 131072, sequence_bits: int = 18) -> float:
    """Bytes a block format of Huffman literals plus run matches would take (an estimate, no such
    encoder exists): every run of >= 4 bytes of equal pixels becomes its first pixel as a literal
    and one match at offset ``itemsize`` (zstd's sequences, ``sequence_bits`` each with the
    predefined FSE tables: literal length, match length and offset codes), the other bytes
    Huffman-coded per block (+40 bytes of table, +3 of block header).  What the cheapest matching
    stage, the one a GPU does without a search, would add."""
    total = 0.0
    for start in range(0, tile.size, block_size):
        block = tile[start : start + block_size]
        pixels = block.view(f"u{itemsize}") if block.size % itemsize == 0 else block
        edges = np.flatnonzero(np.diff(pixels.astype(np.int64)) != 0) + 1
        run_starts = np.concatenate([[0], edges])
        run_lengths = np.diff(np.concatenate([run_starts, [pixels.size]]))
        long = run_lengths * pixels.itemsize >= 4
        literal = np.ones(pixels.size, bool)
        for first, length in zip(run_starts[long].tolist(), run_lengths[long].tolist()):
            literal[first + 1 : first + length] = False
        literals = pixels[literal].view(np.uint8)
        counts = np.bincount(literals, minlength=256)
        if (counts > 0).sum() > 1:
            total += float((counts * code_lengths(counts)).sum()) / 8 + 40
        else:
            total += 1
        total += int(long.sum()) * sequence_bits / 8 + 3
    return total


def block_bounds(tiles, block_size: int) -> tuple[float, float]:
    """Bytes of the order-0 entropy bound and of the Huffman payload, summed over every block."""
    entropy_bits = huffman_bits = 0.0
    for tile in tiles:
        for start in range(0, tile.size, block_size):
            counts = np.bincount(tile[start : start + block_size], minlength=256)
            present = counts[counts > 0]
            entropy_bits += float(-(present * np.log2(present / present.sum())).sum())
            if present.size > 1:
                huffman_bits += float((counts * code_lengths(counts)).sum())
    return entropy_bits / 8, huffman_bits / 8


def block_types(frame: bytes) -> list[int]:
    """The Block_Type of each block of one single-segment frame (RFC 8878 3.1.1.2)."""
    pos = 5 + [1, 2, 4, 8][frame[4] >> 6]
    kinds = []
    while True:
        header = int.from_bytes(frame[pos : pos + 3], "little")
        kind, size = (header >> 1) & 3, header >> 3
        kinds.append(kind)
        pos += 3 + (1 if kind == 1 else size)
        if header & 1:
            return kinds


def timed(function, items, repeats: int = 1) -> tuple[list, float]:
    """``function`` over ``items`` on this thread: results and the CPU seconds they took (the
    best of ``repeats`` passes: the machine is shared)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        results = [function(item) for item in items]
        best = min(best, time.thread_time() - start)
    return results, best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=8, help="2048² uint16 frames (even: tiles are 2 deep)")
    parser.add_argument("--block-sizes", default="131072,65536,32768", help="comma-separated, bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", type=Path, help="a recording (TIFF or .npy) instead of the synthetic camera")
    parser.add_argument("--out", type=Path, help="folder for huffman_ratio.txt and .json")
    args = parser.parse_args(argv)

    itemsize = 2  # the synthetic camera's uint16
    if args.image:
        tiles, data, itemsize = image_tiles(args.image)
    else:
        camera = SyntheticCamera((2048, 2048), "uint16", seed=args.seed)
        tiles = list(contiguous_tiles(camera, args.frames, TILE))
        data = (
            f"{args.frames} SyntheticCamera 2048² uint16 frames (seed {args.seed}), tiles 2×256² = 256 KiB, "
            f"{len(tiles)} tiles, one zstd frame each"
        )
    total = sum(t.nbytes for t in tiles)
    decompressor = zstandard.ZstdDecompressor()
    zstd1 = zstandard.ZstdCompressor(level=1)
    zstd_frames, zstd_seconds = timed(lambda t: zstd1.compress(t.tobytes()), tiles, repeats=3)
    _, zstd_decode_seconds = timed(decompressor.decompress, zstd_frames, repeats=5)
    zstd3 = zstandard.ZstdCompressor(level=3)
    zstd3_bytes = sum(len(zstd3.compress(t.tobytes())) for t in tiles)
    runs_bytes = sum(runs_estimate(t, itemsize) for t in tiles)

    rows = []
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        frames, seconds = timed(lambda t, b=block_size: encode_frame(t, block_size=b), tiles)
        decoded, decode_seconds = timed(decompressor.decompress, frames, repeats=5)
        assert all(d == t.tobytes() for d, t in zip(decoded, tiles)), "a frame did not decode to its tile"
        kinds = np.bincount([k for f in frames for k in block_types(f)], minlength=3)
        entropy_bytes, huffman_bytes = block_bounds(tiles, block_size)
        rows.append(
            {
                "block_size": block_size,
                "ratio": total / sum(map(len, frames)),
                "entropy_bound": total / entropy_bytes,
                "huffman_payload_bound": total / huffman_bytes,
                "blocks": {"compressed": int(kinds[2]), "raw": int(kinds[0]), "rle": int(kinds[1])},
                "encode_mb_s": total / seconds / 1e6,
                "decode_mb_s": total / decode_seconds / 1e6,
            }
        )
    libzstd = ".".join(map(str, zstandard.ZSTD_VERSION))
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"NumPy {np.__version__}, python-zstandard {zstandard.__version__} (libzstd {libzstd})",
        "data": data,
        "zstd1": {
            "ratio": total / sum(map(len, zstd_frames)),
            "encode_mb_s": total / zstd_seconds / 1e6,
            "decode_mb_s": total / zstd_decode_seconds / 1e6,
        },
        "zstd3": {"ratio": total / zstd3_bytes},
        "huffman_and_runs_estimate": {"ratio": total / runs_bytes},
        "huffman": rows,
    }
    lines = [
        result["data"],
        result["machine"],
        "one thread; MB/s = 10^6 bytes of tiles per CPU second (zstd: best of 3, decodes: best of 5)",
        "",
        f"{'encoder':<30}{'ratio':>7}{'vs zstd-1':>10}{'vs bound':>9}{'Huffman bound':>14}"
        f"{'blocks C/R/RLE':>16}{'encode MB/s':>12}{'decode MB/s':>12}",
        f"{'zstd level 1':<30}{result['zstd1']['ratio']:>7.3f}{1:>10.3f}{'':>9}{'':>14}{'':>16}"
        f"{result['zstd1']['encode_mb_s']:>12.0f}{result['zstd1']['decode_mb_s']:>12.0f}",
        f"{'zstd level 3':<30}{result['zstd3']['ratio']:>7.3f}"
        f"{result['zstd3']['ratio'] / result['zstd1']['ratio']:>10.3f}",
        f"{'Huffman + runs (estimate)':<30}{total / runs_bytes:>7.3f}"
        f"{total / runs_bytes / result['zstd1']['ratio']:>10.3f}",
    ]
    for row in rows:
        blocks = row["blocks"]
        lines.append(
            f"{'Huffman-only, ' + str(row['block_size'] >> 10) + ' KiB blocks':<30}{row['ratio']:>7.3f}"
            f"{row['ratio'] / result['zstd1']['ratio']:>10.3f}{row['ratio'] / row['entropy_bound']:>9.3f}"
            f"{row['huffman_payload_bound']:>14.3f}"
            f"{'{compressed}/{raw}/{rle}'.format(**blocks):>16}"
            f"{row['encode_mb_s']:>12.1f}{row['decode_mb_s']:>12.0f}"
        )
        lines.append(f"{'  order-0 entropy bound':<30}{row['entropy_bound']:>7.3f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "huffman_ratio.txt").write_text(text + "\n")
        (args.out / "huffman_ratio.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
