#!/usr/bin/env bash
# The CPU reader on a many-core host in one call: whole-array reads against tensorstore with each
# decode path (a native call per chunk, or one GIL-free call per unit of chunks), exactness against
# zarr-python on small copies, and where the GIL goes (py-spy, only the thread holding it). Logs
# under $OUT.
#
#   run(command="bash benchmarks/cpu_reads_device.sh", carry=[".kit/site.tar.xz", ".kit/pyspy.xz"])
#   bash benchmarks/cpu_reads_device.sh --quick     # small, on any machine
#
# Knobs: GIB (2), ROUNDS (5), TILES (64k-4m,256k-4m,1m-16m), LIMIT_S (560), VARIANTS (the A/B's
# variants of ours, space-separated ab_cpu_read.py --variant values; default: the two decode paths
# and the default reader).
set -uo pipefail
root=$(pwd)
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
OUT=${OUT:-$root/.cpu_reads_out}
mkdir -p "$OUT"
LIMIT_S=${LIMIT_S:-560}
export PYTHONUNBUFFERED=1
site=""
if [ $QUICK = 0 ] && [ -f .kit/site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .kit/site.tar.xz -C /tmp/site && site=/tmp/site:
fi
export PYTHONPATH=${site}$root/src
SPY=""
if [ -f .kit/pyspy.xz ]; then
  xz -dc .kit/pyspy.xz > /tmp/py-spy && chmod +x /tmp/py-spy && SPY=/tmp/py-spy
fi
GIB=${GIB:-2}
ROUNDS=${ROUNDS:-5}
TILES=${TILES:-64k-4m,256k-4m,1m-16m}
if [ $QUICK = 1 ]; then GIB=0.125; ROUNDS=2; fi
DIR=/dev/shm/tileshard-cpu-reads
left() { echo $((LIMIT_S - SECONDS)); }
{ nproc; python3 -c "import numpy, zstandard; print('numpy', numpy.__version__, 'zstandard', zstandard.__version__)"; } \
  > "$OUT/info.txt" 2>&1
cat "$OUT/info.txt"

# 1. Exact: each decode path against zarr-python on small recordings.
timeout 120 python3 benchmarks/ab_cpu_read.py --tiles "$TILES" --gib 0.0625 --rounds 1 --dir "$DIR-check" \
  --variant per_chunk= --variant released=RELEASED_DECODE_MIN_WORKERS=1 --check 2>&1 | tee "$OUT/check.log"
rm -rf "$DIR-check"

# 2. The A/B against tensorstore: per-chunk calls, one GIL-free call per unit, and the default.
VARIANTS=${VARIANTS:-per_chunk=RELEASED_DECODE_MIN_WORKERS=1073741824 released=RELEASED_DECODE_MIN_WORKERS=1 default=}
args=()
for variant in $VARIANTS; do args+=(--variant "$variant"); done
timeout $(($(left) - 90)) python3 benchmarks/ab_cpu_read.py --tiles "$TILES" --gib "$GIB" --rounds "$ROUNDS" \
  --dir "$DIR" "${args[@]}" --out "$OUT/ab_read.json" 2>&1 | tee "$OUT/ab_read.log"

# 3. Who holds the GIL during 64 KiB-chunk reads, per path (10 reads each).
if [ -n "$SPY" ] && [ "$(left)" -gt 60 ]; then
  first=$(ls -d "$DIR"/*64k* 2>/dev/null | head -1)
  for variant in per_chunk=RELEASED_DECODE_MIN_WORKERS=1073741824 released=RELEASED_DECODE_MIN_WORKERS=1; do
    name=${variant%%=*}
    [ -n "$first" ] && timeout 60 $SPY record --gil --rate 250 --format raw -o "$OUT/gil_$name.txt" -- \
      python3 benchmarks/ab_cpu_read.py --path "$first" --rounds 10 --no-tensorstore --variant "$variant" \
      > "$OUT/gil_$name.log" 2>&1
    [ -f "$OUT/gil_$name.txt" ] && xz -9 "$OUT/gil_$name.txt"
  done
fi
rm -rf "$DIR"
echo "# done at ${SECONDS} s"
