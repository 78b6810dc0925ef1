#!/usr/bin/env bash
# One call on the offline GPU machine: build chucky, then compare it with our GPU Writer.
#   run(command="bash benchmarks/chucky/device_run.sh",
#       carry=[".kit/site.tar.xz", "benchmarks/scratch/chucky-src"], timeout_s=600)
# .kit/site.tar.xz: benchmarks/device_kit.sh (nvCOMP's wheel, zarr, ...); chucky-src:
# benchmarks/chucky/prepare_source.sh. Knobs (env): GIB (4), TILES (256k-d2,1m-d8),
# TARGETS (shm,discard), APPENDS (1,8: frames per append call), ROUNDS (3),
# GIB_LONG (16: one more pass, frames one by one, 1 round, if time is left; 0 = none).
# Files in $OUT: gpu.txt, chucky_configure.log, chucky_build.log, chucky_compare.{json,log}
# and chucky_compare_long.{json,log}.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/chucky-out}
mkdir -p "$OUT"
export SITE=${SITE:-/tmp/site}
if [ ! -f "$SITE/nvidia/libnvcomp/include/nvcomp/zstd.h" ]; then
  [ -f .kit/site.tar.xz ] || { echo "carry .kit/site.tar.xz (benchmarks/device_kit.sh)"; exit 1; }
  mkdir -p "$SITE" && tar -xJf .kit/site.tar.xz -C "$SITE" || exit 1
fi
export PYTHONPATH=$SITE:$PWD/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
df -h /dev/shm /tmp | tee -a "$OUT/gpu.txt"
timeout 300 bash benchmarks/chucky/build.sh /tmp/chucky-build || exit 1
echo "build done at ${SECONDS} s"
timeout $((560 - SECONDS)) python3 benchmarks/chucky/compare.py --binary /tmp/chucky-build/chucky_frames \
  --gib "${GIB:-4}" --tiles "${TILES:-256k-d2,1m-d8}" --targets "${TARGETS:-shm,discard}" --rounds "${ROUNDS:-3}" --appends "${APPENDS:-1,8}" \
  --timeout 90 --json "$OUT/chucky_compare.json" 2>&1 | tee "$OUT/chucky_compare.log"
status=$?
echo "first pass done at ${SECONDS} s (exit $status)"
# A longer recording (the 17 GB column), once, while the call has time for it.
if [ "${GIB_LONG:-16}" != 0 ] && [ $SECONDS -lt 330 ]; then
  timeout $((580 - SECONDS)) python3 benchmarks/chucky/compare.py --binary /tmp/chucky-build/chucky_frames \
    --gib "${GIB_LONG:-16}" --tiles "${TILES:-256k-d2,1m-d8}" --targets shm,discard --rounds 1 \
    --timeout 120 --json "$OUT/chucky_compare_long.json" 2>&1 | tee "$OUT/chucky_compare_long.log"
  echo "long pass done at ${SECONDS} s (exit $?)"
fi
exit $status
