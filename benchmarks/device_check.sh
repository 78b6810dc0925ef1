#!/usr/bin/env bash
# One device call that checks a change on the GPU machine before its figures are taken: the GPU
# tests, then issue 30's readback table (4 and 16 MiB shards; ours on both devices, tensorstore,
# libzstd's and nvCOMP's decode ceilings, the engines in turn), logs under $OUT.
#
#   bash benchmarks/device_kit.sh      # here, once: .kit/site.tar.xz (git-ignored)
#   run(command="bash benchmarks/device_check.sh", carry=[".kit/site.tar.xz"])
#
# Knobs (environment): TESTS=0 skips the GPU tests, READS=0 the readback, GIB (4), ROUNDS (2),
# TILES (64k-4m,256k-4m,1m-16m).  Each part has its own time limit so that one stuck part still
# leaves the others' logs: tests 300 s, readback 240 s.
set -o pipefail
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT" /tmp/site
tar -xJf .kit/site.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
nproc | tee "$OUT/cpus.txt"
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 | tail -40 | tee "$OUT/pytest_gpu.log"
fi
if [ "${READS:-1}" != 0 ]; then
  timeout 240 python3 benchmarks/bench_read.py --tiles "${TILES:-64k-4m,256k-4m,1m-16m}" --gib "${GIB:-4}" \
    --where shm --engines tileshard-cpu,tileshard-gpu-host,tileshard-gpu-device,tensorstore \
    --cpu-ceiling --rounds "${ROUNDS:-2}" --out "$OUT/read.json" 2>&1 | tail -60 | tee "$OUT/read.log"
  rm -rf /dev/shm/tileshard-read 2>/dev/null
fi
