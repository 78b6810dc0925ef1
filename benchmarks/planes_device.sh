#!/usr/bin/env bash
# One call on a GPU machine (its host: 16 cores): the GPU tests, and single-plane CPU reads of
# CPU-written recordings (libzstd level 1, as a CPU user's), ours (each chunk decoded only as far
# as the plane needs: reader.cpu.PREFIX_DECODE) against whole chunks (PREFIX_DECODE=0) and
# tensorstore, two passes; PARTS=table: the docs' read table (bench_read.py --gib 16 --tiles 256k,
# every engine).  Each part under its own timeout; logs under $OUT.
#
#   run(command="bash benchmarks/planes_device.sh", carry=[".kit/site.tar.xz"])
#   run(command="PARTS=table bash benchmarks/planes_device.sh", carry=[".kit/site.tar.xz"])
#   bash benchmarks/planes_device.sh --quick        # small, on any machine
#
# Knobs: PARTS (pytest,planes[,timeline][,whole] | table; timeline: plane_timeline.py, whole: whole reads
# of the planes' recordings), GIB (2), PLANES (60), LAYOUTS (64k-4m,256k-4m,1m-16m,256k,
# default), VARIANTS (ab_cpu_planes.py's --variant arguments), TABLE_GIB (16), LIMIT_S (570: the
# whole call).
set -uo pipefail
root=$(pwd)
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
OUT=${OUT:-$root/.planes_out}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-570}
PARTS=${PARTS:-pytest,planes}
GIB=${GIB:-2}
PLANES=${PLANES:-60}
LAYOUTS=${LAYOUTS:-64k-4m,256k-4m,1m-16m,256k,default}
TABLE_GIB=${TABLE_GIB:-16}
VARIANTS=${VARIANTS:---variant ours= --variant whole=PREFIX_DECODE=0}
SHM=/dev/shm/tileshard-planes
export PYTHONUNBUFFERED=1
site=""
if [ $QUICK = 0 ] && [ -f .kit/site.tar.xz ]; then # Python 3.12 wheels the GPU machine lacks
  mkdir -p /tmp/site && { [ -d /tmp/site/zarr ] || tar -xJf .kit/site.tar.xz -C /tmp/site; } && site=/tmp/site:
fi
export PYTHONPATH=${site}$root/src
if [ $QUICK = 1 ]; then
  GIB=0.125 PLANES=6 TABLE_GIB=0.25
fi
PARTS_LOG=$OUT
source "$root/benchmarks/device_parts.sh"
machine_info

if want pytest 240; then
  timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$OUT/pytest_gpu.log" 2>&1
  tail -4 "$OUT/pytest_gpu.log"
fi

if want planes 120; then
  timeout 150 python3 benchmarks/write_recordings.py --dir "$SHM" --gib "$GIB" --layouts "$LAYOUTS" \
    > "$OUT/write.log" 2>&1
  cat "$OUT/write.log"
  paths=""
  for layout in ${LAYOUTS//,/ }; do paths="$paths --path $SHM/$layout.zarr"; done
  for pass in 1 2; do
    [ "$(left)" -lt 60 ] && break
    # shellcheck disable=SC2086
    timeout $(($(left) - 20)) python3 benchmarks/ab_cpu_planes.py $paths --planes "$PLANES" --seed "$pass" \
      $VARIANTS > "$OUT/planes_$pass.log" 2>&1
    grep -v '^#' "$OUT/planes_$pass.log"
  done
  if want timeline 40; then # each stage's start and end in a single-plane read (medians)
    for layout in ${LAYOUTS//,/ }; do
      timeout 30 python3 benchmarks/plane_timeline.py "$SHM/$layout.zarr" --planes "$PLANES" >> "$OUT/timeline.log" 2>&1
    done
    cat "$OUT/timeline.log"
  fi
  if want whole 90; then # whole reads of the same recordings, the same variants (3 rounds, best of 2)
    # shellcheck disable=SC2086
    timeout $(($(left) - 20)) python3 benchmarks/ab_cpu_read.py $paths --rounds 3 --repeat 2 $VARIANTS \
      --out "$OUT/whole.json" > "$OUT/whole.log" 2>&1
    grep -v '^{' "$OUT/whole.log"
  fi
  rm -rf "$SHM"
fi

if want table 300; then
  timeout $(($(left) - 15)) python3 benchmarks/bench_read.py --gib "$TABLE_GIB" --tiles 256k --repeat 2 \
    --out "$OUT/read_table.json" > "$OUT/read_table.log" 2>&1
  tail -14 "$OUT/read_table.log"
fi
echo "# done at ${SECONDS} s"
