#!/usr/bin/env bash
# one-off: where 16 threads spend a single-plane read (perf if present, else py-spy --native)
set -u
mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src
xz -dc .kit/pyspy.xz > /tmp/py-spy && chmod +x /tmp/py-spy
python3 benchmarks/ab_cpu_read.py --tiles 64k-4m --gib 2 --rounds 1 --dir /dev/shm/pl --no-tensorstore >/dev/null 2>&1
which perf > $OUT/which_perf.txt 2>&1
python3 benchmarks/ab_cpu_planes.py --path /dev/shm/pl/64k-4m.zarr --planes 100 --no-tensorstore --variant ours= 2>&1 | tail -1 > $OUT/plain.txt
if command -v perf >/dev/null; then
  perf record -F 2000 -g -o /tmp/perf.data -- python3 benchmarks/ab_cpu_planes.py --path /dev/shm/pl/64k-4m.zarr --planes 400 --no-tensorstore > $OUT/perf_run.txt 2>&1
  perf report -i /tmp/perf.data --no-children --sort dso,sym -g none 2>/dev/null | head -80 > $OUT/perf_report.txt
else
  timeout 120 /tmp/py-spy record --native --idle --rate 200 --format raw -o $OUT/native_idle.txt -- python3 benchmarks/ab_cpu_planes.py --path /dev/shm/pl/64k-4m.zarr --planes 300 --no-tensorstore > $OUT/spy_run.txt 2>&1
  xz -9 $OUT/native_idle.txt
fi
python3 - <<'PY' > $OUT/strace_like.txt 2>&1
import resource, time, sys
sys.path.insert(0, "src")
from napari_tileshard import ShardReader
r = ShardReader("/dev/shm/pl/64k-4m.zarr")
r.read((0,))
u0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
for t in range(200): r.read((t % 256,))
u1 = resource.getrusage(resource.RUSAGE_SELF); t1 = time.perf_counter()
n = 200
print(f"per plane {(t1-t0)/n*1e3:.2f} ms, user {(u1.ru_utime-u0.ru_utime)/n*1e3:.2f} ms, sys {(u1.ru_stime-u0.ru_stime)/n*1e3:.2f} ms, minflt {(u1.ru_minflt-u0.ru_minflt)/n:.0f}, vcsw {(u1.ru_nvcsw-u0.ru_nvcsw)/n:.0f}, ivcsw {(u1.ru_nivcsw-u0.ru_nivcsw)/n:.0f}")
PY
cat $OUT/*.txt | head -120
