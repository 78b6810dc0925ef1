#!/usr/bin/env bash
# (run from the checkout root with .kit/site.tar.xz and .kit/base.tar.xz = git archive afdbde3 src)
# GPU checks at HEAD after the staging change: pytest -m gpu, byte-identical stores and speed of the
# GPU Writer/reader against afdbde3, and the GPU recording's cold start.  Logs under $OUT.
set -uo pipefail
root=$(pwd); OUT=${OUT:-/tmp/gpucheck}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site
mkdir -p /tmp/base && tar -xJf .kit/base.tar.xz -C /tmp/base
NEW=/tmp/site:$root/src; OLD=/tmp/site:/tmp/base/src
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/info.txt"; nproc >> "$OUT/info.txt"
PYTHONPATH=$NEW timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -15 > "$OUT/pytest_gpu.log"
tail -2 "$OUT/pytest_gpu.log"
PYTHONPATH=$OLD timeout 90 python3 benchmarks/ab_versions.py hash --backend gpu --out /dev/shm/ha > "$OUT/hash_old.json" 2> "$OUT/hash_old.err"
PYTHONPATH=$NEW timeout 90 python3 benchmarks/ab_versions.py hash --backend gpu --out /dev/shm/hb > "$OUT/hash_new.json" 2> "$OUT/hash_new.err"
PYTHONPATH=$NEW python3 benchmarks/ab_versions.py compare "$OUT/hash_old.json" "$OUT/hash_new.json" 2>&1 | tail -5 | tee "$OUT/hash_compare.log"
for i in 1 2; do for v in old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 70 python3 benchmarks/ab_versions.py speed --backend gpu --gib 2 2>&1 | tail -8 | sed "s/^/$v$i /" | tee -a "$OUT/speed.log"
done; done
for i in 1 2; do for v in old new; do
  if [ $v = old ]; then S=/tmp/base/src; else S=$root/src; fi
  PYTHONPATH=/tmp/site timeout 60 python3 benchmarks/record_cold_start.py --src "/tmp/site:$S" --label $v --runs 1 --backend gpu 2>&1 | tail -1 | tee -a "$OUT/cold_start.log"
done; done
echo "# done at ${SECONDS} s"
