"""A disk's sequential write bandwidth with direct I/O (what the page cache cannot hide), and the
same written through the page cache with and without an fsync at the end.

    python benchmarks/disk_bandwidth.py /path/on/the/disk --gib 4

Writes incompressible bytes in 64 MiB blocks (O_DIRECT, from one page-aligned buffer), then
removes the file.  Prints one JSON line: direct GB/s, buffered GB/s without and with fsync (and
the fsync's own seconds).  What ``dd if=... of=FILE bs=64M oflag=direct`` measures, without
depending on dd's output format.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np

BLOCK = 64 << 20


def write_file(path: Path, nbytes: int, direct: bool, fsync: bool) -> dict:
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buffer.write(np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        start = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, buffer)
        wrote = time.perf_counter()
        if fsync:
            os.fsync(fd)
        done = time.perf_counter()
    finally:
        os.close(fd)
        path.unlink()
    return {"bytes": written, "write_s": wrote - start, "fsync_s": done - wrote, "gbps": written / (done - start) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--gib", type=float, default=4)
    args = parser.parse_args()
    directory = Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.gib * 2**30) // BLOCK * BLOCK
    path = directory / "disk_bandwidth.bin"
    direct = write_file(path, nbytes, direct=True, fsync=True)
    buffered = write_file(path, nbytes, direct=False, fsync=False)
    synced = write_file(path, nbytes, direct=False, fsync=True)
    print(
        json.dumps(
            {
                "directory": str(directory),
                "gib": args.gib,
                "direct_gbps": round(direct["gbps"], 3),
                "buffered_gbps": round(buffered["gbps"], 3),
                "buffered_fsync_gbps": round(synced["gbps"], 3),
                "fsync_s": round(synced["fsync_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
