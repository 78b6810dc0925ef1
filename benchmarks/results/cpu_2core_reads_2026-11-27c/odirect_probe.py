"""A recording's shard files read cold, buffered against O_DIRECT: rate and CPU per GB of file bytes.

python benchmarks/results/cpu_2core_reads_2026-11-27c/odirect_probe.py /var/tmp/abdisk/256k-4m.zarr
"""

import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_read import _files, evict  # noqa: E402

path = Path(sys.argv[1])
files = sorted(_files(path))
buffer = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs


def read_all(direct: bool) -> tuple[float, float]:
    evict(path)
    cpu, wall, total = time.process_time(), time.perf_counter(), 0
    for name in files:
        fd = os.open(name, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            size = os.fstat(fd).st_size
            aligned = -(-size // 4096) * 4096
            total += min(os.preadv(fd, [memoryview(buffer)[:aligned]], 0), size)
        finally:
            os.close(fd)
    return total / (time.perf_counter() - wall) / 1e9, (time.process_time() - cpu) / (total / 1e9)


for _ in range(3):
    for direct in (False, True):
        rate, cpu_per_gb = read_all(direct)
        print(f"{'O_DIRECT' if direct else 'buffered'}: {rate:.2f} GB/s, {cpu_per_gb:.3f} CPU-s per file GB")
