#!/usr/bin/env bash
# GPU check at HEAD: pytest -m gpu, and warm GPU reads (whole arrays and single planes) against bc5c6ce
set -uo pipefail
root=$(pwd); mkdir -p "$OUT"
mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site
mkdir -p /tmp/before && tar -xJf .kit/before_src.tar.xz -C /tmp/before
NEW=/tmp/site:$root/src; OLD=/tmp/site:/tmp/before/src
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/info.txt"
PYTHONPATH=$NEW timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -4 > "$OUT/pytest_gpu.log"; tail -1 "$OUT/pytest_gpu.log"
PYTHONPATH=$NEW timeout 60 python3 .kit/gpu_read_ab.py write /dev/shm/g64.zarr 0
for v in old new new old old new; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 60 python3 .kit/gpu_read_ab.py read /dev/shm/g64.zarr 5 | sed "s/^/$v /" | tee -a "$OUT/gpu_read_ab.log"
done
for v in old new new old; do
  if [ $v = old ]; then P=$OLD; else P=$NEW; fi
  PYTHONPATH=$P timeout 60 python3 - <<'PY' | sed "s/^/$v planes /" | tee -a "$OUT/gpu_planes_ab.log"
import time, statistics, numpy as np
from napari_tileshard import ShardReader
r = ShardReader("/dev/shm/g64.zarr", backend="gpu"); r.read((0,))
ts = np.random.default_rng(1).integers(0, r.shape[0], 60).tolist(); w = []
for t in ts:
    s = time.perf_counter(); r.read((t,)); w.append(time.perf_counter() - s)
print(f"median {statistics.median(w)*1e3:.2f} ms")
PY
done
echo "# done at ${SECONDS} s"
