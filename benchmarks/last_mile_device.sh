#!/usr/bin/env bash
# Every recording path against the Writer's own speed, on the GPU machine, in one call: the
# recorder (Qt-free loop, the dock's path, a live layer) against a paced Writer.append loop, the
# soak, pymmcore-plus MDAs with and without the sink, the machine's own disk, the GPU tests; the
# code before (.kit/base.tar.xz) where a figure needs a "before".  Logs and JSON under $OUT
# (packed into $OUT/last_mile.tar.xz, a summary in $OUT/summary.txt).
#
#   bash benchmarks/device_kit.sh                      # here, once: .kit/site.tar.xz
#   bash benchmarks/last_mile_device.sh --prepare      # here: .kit/base.tar.xz (the code before), .kit/pyspy.xz
#   run(command="bash benchmarks/last_mile_device.sh",
#       carry=[".kit/site.tar.xz", ".kit/base.tar.xz", ".kit/pyspy.xz"])
#   bash benchmarks/last_mile_device.sh --quick        # small sizes on any machine (the CPU backend without a GPU)
#
# Knobs (environment): PARTS (default info,copy,discard,discard10,shm,base,profile,soak,mda,disk,
# hashes,pytest; also pytest_quick, discard_base, mdaspy), FALLBACK_FPS (the rate of discard10 without the discard search),
# SECONDS_LONG (60: the discard run), SECONDS_SHM (10), RATES and SHM_RATES (the paced-Writer
# searches, frames/s), BASE_CODES ("base new"), SPY_BASE and MDA_BASE (1: the code before too),
# SPY_PATHS, SPY_FPS, SPY_SECONDS (the profiled run: dock, the paths' rate, 8), KIT (.kit: where
# the kit's files are; a helper's worktree is not what `run` sends, so its snapshot and the kit
# travel in an ignored folder of the session's checkout, named by carry),
# SOAK_RUNS (30), SOAK_SECONDS (2), MDA_CONFIGS, MDA_REPEATS (5), MDA_LONG (frames of a longer
# MDA, unset: none), MDA_CPU (1: the CPU sink with a large buffer), MDA_SPY_FRAMES (2000),
# MDA_SPY_CONFIGS (tileshard-gpu), SPY_FLAGS, LIMIT_S (590: the whole call; a part that cannot finish in
# what is left is skipped and says so).  Each part runs under its own `timeout`.
set -uo pipefail
root=$(pwd)
if [ "${1:-}" = --prepare ]; then
  mkdir -p .kit
  base=${BASE:-5a9624f}
  git archive "$base" src benchmarks | xz -9 > .kit/base.tar.xz
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$tmp" py-spy==0.4.3
  unzip -q -p "$tmp"/py_spy-*.whl '*/scripts/py-spy' | xz -9 > .kit/pyspy.xz
  rm -rf "$tmp"
  du -sh .kit/base.tar.xz .kit/pyspy.xz
  exit 0
fi
QUICK=0
[ "${1:-}" = --quick ] && QUICK=1
OUT=${OUT:-$root/.last_mile_out}
L=$OUT/logs
mkdir -p "$L"
LIMIT_S=${LIMIT_S:-590}
PARTS=${PARTS:-info,copy,discard,discard10,shm,base,profile,soak,mda,disk,hashes,pytest}
export PYTHONUNBUFFERED=1
KIT=${KIT:-.kit}
site=""
if [ $QUICK = 0 ] && [ -f "$KIT/site.tar.xz" ]; then  # Python 3.12 wheels: the GPU machine's
  mkdir -p /tmp/site && tar -xJf "$KIT/site.tar.xz" -C /tmp/site && site=/tmp/site:
fi
NEW=${site}$root/src
BASEP=""
if [ -f "$KIT/base.tar.xz" ]; then
  rm -rf /tmp/base && mkdir -p /tmp/base && tar -xJf "$KIT/base.tar.xz" -C /tmp/base && BASEP=${site}/tmp/base/src
fi
SPY=""
if [ -f "$KIT/pyspy.xz" ]; then
  xz -dc "$KIT/pyspy.xz" > /tmp/py-spy && chmod +x /tmp/py-spy && SPY=/tmp/py-spy
fi
if [ $QUICK = 1 ]; then
  FRAME=${FRAME:-512x512}
  BACKEND=${BACKEND:-auto}
  RATES=${RATES:-100,200,400}
  SHM_RATES=${SHM_RATES:-100,200,400}
  SECONDS_LONG=${SECONDS_LONG:-4}
  SECONDS_SHM=${SECONDS_SHM:-2}
  SOAK_RUNS=${SOAK_RUNS:-4}
  SOAK_SECONDS=${SOAK_SECONDS:-1}
  SOAK_RATES=${SOAK_RATES:-100:200}
  BASE_FPS=${BASE_FPS:-200}
  MDA_ARGS="--quick"
  MDA_CONFIGS=${MDA_CONFIGS:-none,probe-hold,probe-copy,tileshard-cpu}
  DISK_GIB=${DISK_GIB:-0.25}
  DISK_FRAMES=${DISK_FRAMES:-200}
else
  FRAME=${FRAME:-2304x2304}
  BACKEND=${BACKEND:-gpu}
  RATES=${RATES:-500,540,580,620,660,700}
  SHM_RATES=${SHM_RATES:-300,340,380,420,460,500,540}
  SECONDS_LONG=${SECONDS_LONG:-60}
  SECONDS_SHM=${SECONDS_SHM:-10}
  SOAK_RUNS=${SOAK_RUNS:-30}
  SOAK_SECONDS=${SOAK_SECONDS:-2}
  SOAK_RATES=${SOAK_RATES:-300:600}
  BASE_FPS=${BASE_FPS:-400}
  MDA_ARGS="--frames 400"
  DISK_GIB=${DISK_GIB:-4}
  DISK_FRAMES=${DISK_FRAMES:-1500}
fi
SHM=/dev/shm/last_mile
DISK=${DISK_DIR:-/var/tmp/last_mile_disk}
mkdir -p "$SHM" "$DISK"

PARTS_LOG=$L
source "$root/benchmarks/device_parts.sh"
BENCH=(env "PYTHONPATH=$NEW" python3 benchmarks/bench_recorder.py --frame "$FRAME" --backend "$BACKEND")

if want info 5; then
  {
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1
    echo "cpus $(nproc)"
    free -g
    df -h /tmp /var/tmp /dev/shm "$DISK"
    python3 -c "import numpy, sys; print('python', sys.version.split()[0], 'numpy', numpy.__version__)"
    PYTHONPATH=$NEW python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
    cat /proc/sys/vm/dirty_ratio /proc/sys/vm/dirty_background_ratio 2>/dev/null | tr '\n' ' '; echo "(dirty ratios)"
  } > "$L/info.txt" 2>&1
  cat "$L/info.txt"
fi

# 0. The GPU tests of the engine and the MDA sink first (the measurements below rely on them).
if want pytest_quick 60 && [ $QUICK = 0 ]; then
  timeout 120 env PYTHONPATH="$NEW" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/engine/test_gpu.py \
    tests/apps/test_mmcore.py 2>&1 | tail -15 | tee "$L/pytest_quick.log"
fi

# How fast a frame reaches the GPU's input buffer, by each way there is.
if want copy 30; then
  timeout 60 env PYTHONPATH="$NEW" python3 benchmarks/copy_paths.py --frame "$FRAME" 2>&1 | tee "$L/copy_paths.log"
fi

# 1. The paced Writer's limit (2304² uint16, the default layout), then the paths at 95 % of it
#    into a sink that counts and discards the shards: the recorder for SECONDS_LONG.
FPS=""
discard_limit() { # discard_limit NAME COMMAND...: the paced Writer's limit, then the recorder at 95 % of it
  local name=$1
  shift
  timeout $((90 + SECONDS_LONG + 60)) "$@" --out discard --limit "$RATES" --limit-seconds 5 \
    --seconds "$SECONDS_LONG" --paths recorder --json "$L/$name.json" 2>&1 | tee "$L/$name.log"
}
if want discard $((60 + SECONDS_LONG + 30)); then
  discard_limit discard "${BENCH[@]}"
  FPS=$(sed -n 's/.*; paths at \([0-9.]*\) frames\/s.*/\1/p' "$L/discard.log" | tail -1)
fi
# ... and the same with the code before, in the same call
if want discard_base $((60 + SECONDS_LONG + 30)) && [ -n "$BASEP" ]; then
  discard_limit discard_base env "PYTHONPATH=$BASEP" python3 /tmp/base/benchmarks/bench_recorder.py \
    --frame "$FRAME" --backend "$BACKEND"
fi
FPS=${FPS:-${FALLBACK_FPS:-$BASE_FPS}}
echo "# paths at $FPS frames/s" | tee -a "$L/parts.txt"
if want discard10 40; then
  timeout 90 "${BENCH[@]}" --out discard --fps "$FPS" --seconds 10 --paths writer,layer \
    --json "$L/discard_10s.json" 2>&1 | tee "$L/discard_10s.log"
fi

# 2. Into /dev/shm for SECONDS_SHM: the paced Writer's limit there (storage, not the GPU, bounds
#    it), then at 95 % of it the plain Writer, the recorder, the dock's path (with the preview
#    reading the store back).
if want shm $((8 * (SECONDS_SHM + 4))); then
  timeout $((10 * (SECONDS_SHM + 8))) "${BENCH[@]}" --out "$SHM/rec.zarr" --limit "$SHM_RATES" \
    --limit-seconds "$SECONDS_SHM" --seconds "$SECONDS_SHM" --paths writer,recorder,dock --json "$L/shm.json" 2>&1 |
    tee "$L/shm.log"
  rm -rf "$SHM/rec.zarr"
fi

# 3. Before/after at the issue's setting (400 frames/s of 2304², 6 s, drop, /dev/shm): the code
#    before (its recorder renders the camera's frames inside its clock), then this code.
if want base 20 && [ -n "$BASEP" ]; then
  for code in ${BASE_CODES:-base new}; do
    py=$NEW
    [ $code = base ] && py=$BASEP
    timeout 60 env PYTHONPATH="$py" python3 benchmarks/bench_recorder.py --frame "$FRAME" --backend "$BACKEND" \
      --out "$SHM/base.zarr" --fps "$BASE_FPS" --seconds 6 --paths recorder --json "$L/issue_setting_$code.json" 2>&1 |
      tee "$L/issue_setting_$code.log"
    rm -rf "$SHM/base.zarr"
  done
fi

# 4. Where the time goes: py-spy over the dock's path (this code) and the recorder (the code before).
if want profile 60 && [ -n "$SPY" ]; then
  SPY_PATHS=${SPY_PATHS:-dock}
  PYTHONPATH="$NEW" timeout 45 $SPY record --rate 250 --format raw --nonblocking -o "$L/spy_new_$SPY_PATHS.txt" -- \
    python3 benchmarks/bench_recorder.py --frame "$FRAME" --backend "$BACKEND" --out "$SHM/spy.zarr" \
    --fps "${SPY_FPS:-$FPS}" --seconds "${SPY_SECONDS:-8}" --paths "$SPY_PATHS" > "$L/spy_new_$SPY_PATHS.log" 2>&1
  rm -rf "$SHM/spy.zarr"
  if [ -n "$BASEP" ] && [ "${SPY_BASE:-1}" = 1 ]; then
    PYTHONPATH="$BASEP" timeout 45 $SPY record --rate 250 --format raw --nonblocking -o "$L/spy_base_recorder.txt" -- \
      python3 benchmarks/bench_recorder.py --frame "$FRAME" --backend "$BACKEND" \
      --out "$SHM/spy.zarr" --fps "$BASE_FPS" --seconds 6 --paths recorder > "$L/spy_base_recorder.log" 2>&1
    rm -rf "$SHM/spy.zarr"
  fi
  for f in "$L"/spy_*.txt; do
    [ -f "$f" ] && python3 benchmarks/last_mile_summary.py spy "$f" > "${f%.txt}.summary" 2>&1
  done
fi

# 5. Soak: SOAK_RUNS recorder runs at 300-600 frames/s, each within 1.5x its nominal duration;
#    a stall dumps every thread's stack into the log.
if want soak $((SOAK_RUNS * (SOAK_SECONDS + 2) + 30)); then
  timeout $((SOAK_RUNS * (SOAK_SECONDS + 3) + 120)) env PYTHONPATH="$NEW" python3 benchmarks/soak_recorder.py \
    --runs "$SOAK_RUNS" --rates "$SOAK_RATES" --seconds "$SOAK_SECONDS" --frame "$FRAME" --backend "$BACKEND" \
    --processes 3 --log "$L/soak_runs.log" 2>&1 | tail -3 | tee "$L/soak.log"
fi

# 6. pymmcore-plus: the same MDA with no sink and with ours (2048², demo camera unthrottled,
#    pymmcore-plus's default buffer), this code and the code before; the CPU sink with a buffer
#    large enough to finish (what it sustains).
MDA_CONFIGS=${MDA_CONFIGS:-none,probe-hold,probe-copy,tileshard-gpu}
if want mda 60; then
  timeout 150 env PYTHONPATH="$NEW" python3 benchmarks/bench_mda.py $MDA_ARGS --repeats "${MDA_REPEATS:-5}" \
    --configs "$MDA_CONFIGS" --out "$SHM/mda" --json "$L/mda.json" 2>&1 |
    grep -v "Micro-Manager\|mmcore install\|^Discovered\|^$" | tee "$L/mda.log"
  if [ -n "${MDA_LONG:-}" ]; then  # a longer MDA: the fixed cost after the last frame weighs less
    timeout 150 env PYTHONPATH="$NEW" python3 benchmarks/bench_mda.py --frames "$MDA_LONG" --repeats 3 \
      --configs "$MDA_CONFIGS" --out "$SHM/mda" --json "$L/mda_long.json" 2>&1 |
      grep -v "Micro-Manager\|mmcore install\|^Discovered\|^$" | tee "$L/mda_long.log"
  fi
  if [ "${MDA_CPU:-1}" = 1 ]; then
    timeout 90 env PYTHONPATH="$NEW" python3 benchmarks/bench_mda.py $MDA_ARGS --repeats 1 --buffer-mb 16384 \
      --configs none,tileshard-cpu --out "$SHM/mda" --json "$L/mda_cpu_big_buffer.json" 2>&1 |
      grep -v "Micro-Manager\|mmcore install\|^Discovered\|^$" | tee "$L/mda_cpu_big_buffer.log"
  fi
  if [ -n "$BASEP" ] && [ "${MDA_BASE:-1}" = 1 ]; then
    timeout 90 env PYTHONPATH="$BASEP" python3 /tmp/base/benchmarks/bench_mda.py $MDA_ARGS --repeats 3 \
      --configs none,tileshard-gpu --out "$SHM/mda" --json "$L/mda_base.json" 2>&1 |
      grep -v "Micro-Manager\|mmcore install\|^Discovered\|^$" | tee "$L/mda_base.log"
  fi
  rm -rf "$SHM/mda"
fi
# Where an MDA's time goes with the sink: py-spy over the MDA alone (MDA_SPY_FRAMES frames, twice,
# a buffer large enough not to overflow), once per configuration of MDA_SPY_CONFIGS; SPY_FLAGS (say
# --gil: only the thread holding the GIL is sampled)
if want mdaspy 40 && [ -n "$SPY" ]; then
  for config in $(echo "${MDA_SPY_CONFIGS:-tileshard-gpu}" | tr , ' '); do
    PYTHONPATH="$NEW" timeout 60 $SPY record --rate 500 --format raw --nonblocking ${SPY_FLAGS:-} \
      -o "$L/spy_mda_$config.txt" -- python3 benchmarks/bench_mda.py --frames "${MDA_SPY_FRAMES:-2000}" \
      --repeats 2 --configs "$config" --buffer-mb 16384 --out "$SHM/mda" > "$L/spy_mda_$config.log" 2>&1
    rm -rf "$SHM/mda"
    xz -9 "$L/spy_mda_$config.txt"
  done
fi

# 7. The machine's own disk: its direct-I/O bandwidth, then the recorder (unpaced, block) and the
#    CLI writing there, each followed by a timed sync (what durability costs).
if want disk 90; then
  timeout 120 python3 benchmarks/disk_bandwidth.py "$DISK" --gib "$DISK_GIB" 2>&1 | tee "$L/disk_bandwidth.json"
  timeout 150 "${BENCH[@]}" --out "$DISK/rec.zarr" --fps 0 --policy block --unpaced-fps $((DISK_FRAMES / 10)) \
    --seconds 10 --paths writer,recorder --sync --json "$L/disk_recorder.json" 2>&1 | tee "$L/disk_recorder.log"
  rm -rf "$DISK/rec.zarr"
  sync
  h=${FRAME%x*}
  w=${FRAME#*x}
  start=$(date +%s.%N)
  timeout 150 env PYTHONPATH="$NEW" python3 -m napari_tileshard record "$DISK/cli.zarr" --shape "0,$h,$w" \
    --frames "$DISK_FRAMES" --backend "$BACKEND" --overwrite --no-progress 2>&1 | tee "$L/disk_cli.log"
  recorded=$(date +%s.%N)
  sync
  synced=$(date +%s.%N)
  python3 -c "print(f'# cli: process {$recorded - $start:.2f} s, then sync {$synced - $recorded:.2f} s')" |
    tee -a "$L/disk_cli.log"
  du -sb "$DISK/cli.zarr" | tee -a "$L/disk_cli.log"
  rm -rf "$DISK/cli.zarr"
fi

# 8. Output bytes unchanged: the same stores written by the code before and this code (the
#    Writer's cases and recordings through the recorder), one hash per store.
if want hashes 40 && [ -n "$BASEP" ]; then
  for code in base new; do
    py=$NEW
    [ $code = base ] && py=$BASEP
    timeout 120 env PYTHONPATH="$py" python3 benchmarks/store_hashes.py --backend "$BACKEND" --recorder \
      --out "$SHM/hashes" > "$L/hashes_$code.txt" 2>&1
  done
  if diff "$L/hashes_base.txt" "$L/hashes_new.txt" > "$L/hashes_diff.txt"; then
    echo "# hashes: $(wc -l < "$L/hashes_new.txt") stores identical" | tee "$L/hashes.log"
  else
    echo "# hashes DIFFER" | tee "$L/hashes.log"
  fi
fi

# 9. The GPU tests.
if want pytest 200 && [ $QUICK = 0 ]; then
  timeout $(($(left) - 15)) env PYTHONPATH="$NEW" python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 |
    tail -40 | tee "$L/pytest_gpu.log"
fi

rm -rf "$SHM" "$DISK"
python3 benchmarks/last_mile_summary.py logs "$L" 2>&1 | tee "$OUT/summary.txt"
tar -C "$OUT" -cJf "$OUT/last_mile.tar.xz" logs && rm -rf "$L"
echo "# done at ${SECONDS} s"
