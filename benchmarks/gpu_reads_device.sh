#!/usr/bin/env bash
# GPU reads on one GPU machine in one call: the GPU tests of the reader, whole-array reads of the
# three layouts against tensorstore with nvCOMP's decode alone and pinned H2D beside them (the
# ceilings), the code before against the code now alternately (A/B), the device time line of
# every stage, and reads from the VM's disk.  Logs and JSON under $OUT.
#
#   BASE=<rev> bash benchmarks/gpu_reads_device.sh --prepare   # here: .kit/base.tar.xz, the code before
#   run(command="bash benchmarks/gpu_reads_device.sh", carry=[".kit/site.tar.xz", ".kit/base.tar.xz"])
#   bash benchmarks/gpu_reads_device.sh --quick                # small, on any machine (no GPU: CPU rows)
#
# Knobs: PARTS (pytest,bench,ab,timeline,disk), GIB (4), TILES (64k-4m,256k-4m,1m-16m),
# AB_ROUNDS (3), LIMIT_S (560: the whole call; a part that cannot finish in what is left is
# skipped and says so).  Each part runs under its own `timeout`.
set -uo pipefail
root=$(pwd)
if [ "${1:-}" = --prepare ]; then
  mkdir -p .kit
  git archive "${BASE:?BASE=<rev> names the code before}" src benchmarks | xz -9 > .kit/base.tar.xz
  du -sh .kit/base.tar.xz
  exit 0
fi
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
OUT=${OUT:-$root/.gpu_reads_out}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-560}
PARTS=${PARTS:-pytest,bench,ab,timeline,disk}
GIB=${GIB:-4}
TILES=${TILES:-64k-4m,256k-4m,1m-16m}
AB_ROUNDS=${AB_ROUNDS:-3}
export PYTHONUNBUFFERED=1
site=""
if [ $QUICK = 0 ] && [ -f .kit/site.tar.xz ]; then  # Python 3.12 wheels the GPU machine lacks
  mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site && site=/tmp/site:
fi
NEW=${site}$root/src
BASEP=""
if [ -f .kit/base.tar.xz ]; then
  rm -rf /tmp/base && mkdir -p /tmp/base && tar -xJf .kit/base.tar.xz -C /tmp/base && BASEP=${site}/tmp/base/src
fi
SHM=/dev/shm/tileshard-read
ENGINES=tileshard-gpu-device,tileshard-gpu-host,tensorstore
PROBES=gpu-device,gpu-host
if [ $QUICK = 1 ]; then
  GIB=0.125
  AB_ROUNDS=1
  python3 -c "import cupy; cupy.cuda.runtime.getDeviceCount()" 2>/dev/null ||
    { ENGINES=tileshard-cpu,tensorstore; PROBES=cpu; }
fi
PARTS_LOG=$OUT
source "$root/benchmarks/device_parts.sh"
machine_info

if want pytest 150; then
  PYTHONPATH=$NEW timeout 140 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/reader \
    > "$OUT/pytest_gpu_reader.log" 2>&1
  tail -3 "$OUT/pytest_gpu_reader.log"
fi

# The table: each layout written by our Writer into /dev/shm, read whole (best of 3) and as 30
# random planes by each engine, nvCOMP's decode alone and pinned H2D on the same chunks.
if want bench 200; then
  PYTHONPATH=$NEW timeout $(($(left) - 60)) python3 benchmarks/bench_read.py --gib "$GIB" --tiles "$TILES" \
    --where shm --engines "$ENGINES" --repeat 3 --planes 30 --keep --shm-dir "$SHM" --out "$OUT/bench_shm.json" \
    > "$OUT/bench_shm.log" 2>&1
  tail -12 "$OUT/bench_shm.log"
fi

# The code before against the code now, alternately, in fresh processes: whole reads (best of 3)
# and the median plane, per layout.
if want ab 120 && [ -n "$BASEP" ]; then
  for round in $(seq "$AB_ROUNDS"); do
    for tile in ${TILES//,/ }; do
      for code in base new; do
        py=$NEW tree=$root
        [ $code = base ] && py=$BASEP tree=/tmp/base
        [ "$(left)" -lt 100 ] && break 3
        echo "## round $round $tile $code" >> "$OUT/ab.log"
        PYTHONPATH=$py timeout 60 python3 "$tree/benchmarks/read_probes.py" engines "$SHM/$tile.zarr" "$PROBES" \
          --repeat 3 >> "$OUT/ab.log" 2>&1
      done
    done
  done
  grep -v "^#" "$OUT/ab.log" | tail -12
fi

# Where the device's time goes: CUDA events around every stage of three reads, then the host's
# costs before the first decode; the code now on every layout, the code before on the first.
if want timeline 60 && [ "$PROBES" != cpu ]; then
  for tile in ${TILES//,/ }; do
    echo "## $tile new" >> "$OUT/timeline.log"
    PYTHONPATH=$NEW timeout 40 python3 benchmarks/read_probes.py timeline "$SHM/$tile.zarr" >> "$OUT/timeline.log" 2>&1
  done
  first=${TILES%%,*}
  if [ -n "$BASEP" ]; then
    echo "## $first base" >> "$OUT/timeline.log"
    PYTHONPATH=$BASEP timeout 40 python3 /tmp/base/benchmarks/read_probes.py timeline "$SHM/$first.zarr" \
      >> "$OUT/timeline.log" 2>&1
  fi
  cat "$OUT/timeline.log"
fi

# From the VM's disk (pages evicted before every read), one layout.
if want disk 120; then
  disk_tile=${DISK_TILE:-256k-4m}
  PYTHONPATH=$NEW timeout $(($(left) - 20)) python3 benchmarks/bench_read.py --gib "$GIB" --tiles "$disk_tile" \
    --where disk --engines "$ENGINES" --repeat 2 --planes 10 --shm-dir "$SHM" --out "$OUT/bench_disk.json" \
    > "$OUT/bench_disk.log" 2>&1
  tail -6 "$OUT/bench_disk.log"
fi
rm -rf "$SHM" /var/tmp/tileshard-read
echo "# done at ${SECONDS} s"
