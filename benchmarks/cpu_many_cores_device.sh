#!/usr/bin/env bash
# The CPU paths on a many-core host (the GPU machine's 16 cores) in one call: interleaved A/Bs of
# reads and writes against tensorstore with variants of ours, where threads wait and who holds
# the GIL (py-spy), the table of every layout against tensorstore and libzstd with per-stage CPU
# (cpu_many_cores.py), and the GPU tests.  Logs and JSON under $OUT.  (It replaced cpu_reads_device.sh,
# whose read A/B and GIL profiles are its readab and profile parts.)
#
#   run(command="bash benchmarks/cpu_many_cores_device.sh", carry=[".kit/site.tar.xz", ".kit/pyspy.xz"])
#   bash benchmarks/cpu_many_cores_device.sh --quick     # small, on any machine
#
# Knobs: PARTS (readab,planes,writeab,profile,table,diskab,scrub,gputests; diskab needs DISK_DIR and takes DISK_TILES, DISK_ROUNDS, DISK_VARIANTS; planes needs readab's recordings), GIB (2), ROUNDS (5), READ_TILES
# (64k-4m,256k-4m,1m-16m), WRITE_TILES (64k-d2,default,1m-d8), READ_VARIANTS and
# WRITE_VARIANTS (space-separated --variant values of ab_cpu_read.py / ab_cpu_write.py),
# TABLE_GIB (2), TABLE_ROUNDS (3), .kit/before_src.tar.xz (carried: `git archive <commit> src`, for
# READ_VARIANTS like `before@/tmp/before/src`), DISK_DIR (unset: a local-disk folder for the table's cold reads), LIMIT_S (570: the whole call; a part that cannot finish in
# what is left is skipped and says so).  Each part runs under its own `timeout`.
set -uo pipefail
root=$(pwd)
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
OUT=${OUT:-$root/.cpu_many_out}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-570}
PARTS=${PARTS:-readab,planes,writeab,profile,table,gputests}
PARTS_LOG=$OUT
# shellcheck source=device_parts.sh
source benchmarks/device_parts.sh
export PYTHONUNBUFFERED=1
site=""
if [ $QUICK = 0 ] && [ -f .kit/site.tar.xz ]; then # Python 3.12 wheels the GPU machine lacks
  mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site && site=/tmp/site:
fi
export PYTHONPATH=${site}$root/src
SPY=""
if [ -f .kit/pyspy.xz ]; then
  xz -dc .kit/pyspy.xz >/tmp/py-spy && chmod +x /tmp/py-spy && SPY=/tmp/py-spy
fi
GIB=${GIB:-2}
ROUNDS=${ROUNDS:-5}
TABLE_GIB=${TABLE_GIB:-2}
TABLE_ROUNDS=${TABLE_ROUNDS:-3}
READ_TILES=${READ_TILES:-64k-4m,256k-4m,1m-16m}
WRITE_TILES=${WRITE_TILES:-64k-d2,default,1m-d8}
READ_VARIANTS=${READ_VARIANTS:-ours= w24=workers=24 per256=RELEASED_DECODE_MAX_CHUNK_BYTES=131072}
WRITE_VARIANTS=${WRITE_VARIANTS:-ours= helpers7=STAGING_COPY_HELPERS=7 helpers2=STAGING_COPY_HELPERS=2}
quick=()
if [ $QUICK = 1 ]; then
  GIB=0.125
  ROUNDS=2
  TABLE_GIB=0.125
  TABLE_ROUNDS=1
  quick=(--quick)
fi
DIR=/dev/shm/tileshard-many
{
  nproc
  lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node\(s\)|L3" || true
  python3 -c "import sys, numpy, zstandard; print(sys.version.split()[0], 'numpy', numpy.__version__, 'zstandard', zstandard.__version__)"
  free -g | head -2
} >"$OUT/info.txt" 2>&1
cat "$OUT/info.txt"
variants() { for v in $1; do printf -- '--variant %s ' "$v"; done; }

# an earlier source tree for `name@/tmp/before/src` variants (every read then in a fresh process)
if [ -f .kit/before_src.tar.xz ]; then
  mkdir -p /tmp/before && tar -xJf .kit/before_src.tar.xz -C /tmp/before
fi

# 1. Reads: every variant against tensorstore, interleaved; outputs checked against zarr-python.
if want readab 150; then
  # shellcheck disable=SC2046
  timeout 100 python3 benchmarks/ab_cpu_read.py --tiles "$READ_TILES" --gib 0.0625 --rounds 1 --dir "$DIR-check" \
    $(variants "$READ_VARIANTS") --check 2>&1 | grep -E "exact|Error|error" | tee "$OUT/read_check.log"
  rm -rf "$DIR-check"
  # shellcheck disable=SC2046
  timeout $(($(left) - 30)) python3 benchmarks/ab_cpu_read.py --tiles "$READ_TILES" --gib "$GIB" --rounds "$ROUNDS" \
    --dir "$DIR-read" $(variants "$READ_VARIANTS") --out "$OUT/read_ab.json" 2>&1 | tee "$OUT/read_ab.log"
fi

# 1b. Single planes of the same recordings (ab_cpu_planes.py): PLANE_VARIANTS against tensorstore.
if want planes 40; then
  paths=()
  for tile in ${READ_TILES//,/ }; do [ -d "$DIR-read/$tile.zarr" ] && paths+=(--path "$DIR-read/$tile.zarr"); done
  # shellcheck disable=SC2046
  [ ${#paths[@]} -gt 0 ] && timeout $(($(left) - 20)) python3 benchmarks/ab_cpu_planes.py "${paths[@]}" \
    --planes "${PLANES:-60}" $(variants "${PLANE_VARIANTS:-ours=}") 2>&1 | tee "$OUT/planes_ab.log"
fi

# 2. Writes: every variant against tensorstore, interleaved, on the user's clock.
if want writeab 150; then
  # shellcheck disable=SC2046
  timeout $(($(left) - 30)) python3 benchmarks/ab_cpu_write.py --tiles "$WRITE_TILES" --gib "$GIB" --rounds "$ROUNDS" \
    --out "$DIR-write" $(variants "$WRITE_VARIANTS") 2>&1 | tee "$OUT/write_ab.log"
  rm -rf "$DIR-write"
fi

# 3. Where the threads of a 64 KiB-chunk read and write wait (--idle) and who holds the GIL
#    (--gil), the default code (raw py-spy stacks, xz).
if [ -n "$SPY" ] && want profile 90; then
  for tile in 64k 256k; do
    first=$(ls -d "$DIR-read/$tile-4m.zarr" 2>/dev/null | head -1)
    [ -n "$first" ] && timeout 40 "$SPY" record --idle --rate 200 --format raw -o "$OUT/read${tile}_idle.txt" -- \
      python3 benchmarks/ab_cpu_read.py --path "$first" --rounds 10 --no-tensorstore --variant ours= \
      >"$OUT/read${tile}_idle.log" 2>&1
  done
  for how in ${WRITE_PROFILES-idle gil}; do
    timeout 40 "$SPY" record --"$how" --rate 200 --format raw -o "$OUT/write64k_$how.txt" -- \
      python3 benchmarks/ab_cpu_write.py --tiles 64k-d2 --gib "$GIB" --rounds 3 --no-tensorstore \
      --variant base= --out "$DIR-write" >"$OUT/write64k_$how.log" 2>&1
  done
  rm -rf "$DIR-write"
  for f in "$OUT"/*_idle.txt "$OUT"/*_gil.txt; do [ -f "$f" ] && xz -9 "$f"; done
fi
rm -rf "$DIR-read"

# 4. The table: every layout, reads and writes, against tensorstore and libzstd, per-stage CPU.
if want table 200; then
  disk=()
  if [ -n "${DISK_DIR:-}" ]; then
    mkdir -p "$DISK_DIR" && df -h "$DISK_DIR" >>"$OUT/info.txt" && disk=(--disk "$DISK_DIR")
  fi
  timeout $(($(left) - 20)) python3 benchmarks/cpu_many_cores.py --gib "$TABLE_GIB" --rounds "$TABLE_ROUNDS" \
    --dir "$DIR-table" --out "$OUT/table.json" "${quick[@]}" "${disk[@]}" >"$OUT/table.log" 2>&1
  [ -n "${DISK_DIR:-}" ] && rm -rf "$DISK_DIR"
  grep -v '^{' "$OUT/table.log"
  rm -rf "$DIR-table"
fi

# 4a. Cold reads from the local disk (DISK_DIR, needed): DISK_VARIANTS against tensorstore, pages
#     evicted before every read, and the disk's own rate by 1, 4 and 16 threads beside them.
if [ -n "${DISK_DIR:-}" ] && want diskab 90; then
  mkdir -p "$DISK_DIR/ab"
  # shellcheck disable=SC2046
  timeout $(($(left) - 20)) python3 benchmarks/ab_cpu_read.py --tiles "${DISK_TILES:-64k-4m,1m-16m}" --gib "$GIB" \
    --rounds "${DISK_ROUNDS:-3}" --cold --dir "$DISK_DIR/ab" \
    $(variants "${DISK_VARIANTS:-ours= d16=shard_reader.DISK_FETCH_THREADS=16}") 2>&1 | tee "$OUT/disk_ab.log"
  timeout 60 python3 -c "
import sys, json; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_read import disk_ceiling
for p in sorted(Path('$DISK_DIR/ab').glob('*.zarr')):
    print(p.name, json.dumps(disk_ceiling(p, threads=(1, 4, 8, 16))))
" 2>&1 | tee -a "$OUT/disk_ab.log"
  rm -rf "$DISK_DIR/ab"
fi

# 4b. napari scrubbing on this host's cores, without napari (no Qt here): the plugin's reader indexed
#     as napari's slicing does, DRAW_MS of Python per step standing in for napari's drawing, the
#     read-ahead on (4+ CPUs); SCRUB_RUNS runs per layout and order, and one read-ahead A/B.
#     SCRUB_CPUS (e.g. 0-3): the scrubs run on those CPUs alone (taskset; set TILESHARD_READ_WORKERS
#     to their count too: the reader sizes its pool by os.cpu_count()).
if want scrub 60; then
  mkdir -p "$OUT/scrub"
  timeout 120 python3 - <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from cpu_many_cores import layouts, make_layout
from napari_tileshard import SyntheticCamera, Writer
camera = SyntheticCamera((2048, 2048), "uint16", seed=0)
camera.prepare()
for name in ("64k-4m", "default"):
    tile, per_shard = layouts()[name]
    with Writer(f"/dev/shm/tileshard-scrub/{name}.zarr", make_layout(tile, per_shard), backend="cpu", overwrite=True) as writer:
        for frame in camera.frames(128):
            writer.append(frame)
PY
  # SCRUB_VARIANTS: name=SWITCH=v (bench_scrub.py --switch), each run alternating; "now=" the default
  for run in $(seq "${SCRUB_RUNS:-3}"); do
    for name in 64k-4m default; do
      for order in forward random; do
        for variant in ${SCRUB_VARIANTS:-now=}; do
          label=${variant%%=*} switch=${variant#*=}
          timeout 60 ${SCRUB_CPUS:+taskset -c "$SCRUB_CPUS"} python3 benchmarks/bench_scrub.py --path "/dev/shm/tileshard-scrub/$name.zarr" --steps 120 \
            --order "$order" --headless "${DRAW_MS:-25}" ${switch:+--switch "$switch"} \
            --out "$OUT/scrub/${name}_${order}_${label}_$run.json" |
            python3 -c "import json, sys; d = json.load(sys.stdin); print('$name $order $label $run', d['read_ahead'], d['all']['plugin_ms'])"
        done
      done
    done
  done 2>&1 | tee "$OUT/scrub.log"
  timeout 60 ${SCRUB_CPUS:+taskset -c "$SCRUB_CPUS"} python3 benchmarks/bench_scrub.py --path /dev/shm/tileshard-scrub/64k-4m.zarr --steps 160 --order forward \
    --headless "${DRAW_MS:-25}" --ab-read-ahead 10 --out "$OUT/scrub/64k-4m_forward_ab.json" >/dev/null 2>&1
  rm -rf /dev/shm/tileshard-scrub
fi

# 5. The GPU tests (the GPU code paths this host also runs).
if [ $QUICK = 0 ] && want gputests 200; then
  timeout $(($(left) - 10)) python3 -m pytest -m gpu -q -p no:cacheprovider -x tests 2>&1 | tail -40 >"$OUT/pytest_gpu.log"
  tail -3 "$OUT/pytest_gpu.log"
fi
echo "# done at ${SECONDS} s"
cat "$OUT"/info.txt "$OUT"/parts.txt "$OUT"/skipped.txt "$OUT"/read_check.log "$OUT"/read_ab.log "$OUT"/planes_ab.log "$OUT"/write_ab.log "$OUT"/disk_ab.log "$OUT"/scrub.log \
  "$OUT"/pytest_gpu.log 2>/dev/null >"$OUT/summary.txt"
grep -v '^{' "$OUT/table.log" >>"$OUT/summary.txt" 2>/dev/null
# one file back (a call brings back only a few): every log, JSON and profile
(cd "$OUT" && tar -cJf all.tar.xz --exclude=all.tar.xz ./* && find . -type f ! -name all.tar.xz ! -name summary.txt -delete)
