#!/usr/bin/env bash
# one-off: are the batch decode's fresh output buffers (glibc giving memory back) what slows 16-core reads?
mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src
python3 benchmarks/ab_cpu_read.py --tiles 64k-4m,256k-4m --gib 2 --rounds 1 --dir /dev/shm/pl --no-tensorstore >/dev/null 2>&1
for env in "" "MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456"; do
  echo "== env: ${env:-default}"
  env $env python3 benchmarks/ab_cpu_planes.py --path /dev/shm/pl/64k-4m.zarr --path /dev/shm/pl/256k-4m.zarr --planes 60 2>&1 | grep median
  env $env python3 benchmarks/ab_cpu_read.py --path /dev/shm/pl/64k-4m.zarr --path /dev/shm/pl/256k-4m.zarr --rounds 3 --repeat 2 2>&1 | grep "GB/s"
done
