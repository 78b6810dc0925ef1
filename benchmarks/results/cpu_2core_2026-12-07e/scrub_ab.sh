cd "$(dirname "$0")/../../.." && OUT=${OUT:-/tmp/scrub_ab}; mkdir -p "$OUT"
for run in 1 2 3 4; do
  for name in default 64k-4m; do
    for order in forward random; do
      if [ $((run % 2)) = 1 ]; then arms="pinned unpinned"; else arms="unpinned pinned"; fi
      for arm in $arms; do
        sw=""; [ $arm = unpinned ] && sw="--switch PIN_DECODE_THREADS_MAX_CPUS=0"
        timeout 120 xvfb-run -a -s "-screen 0 1600x1000x24" python benchmarks/bench_scrub.py --path /dev/shm/scrub/$name.zarr --steps 120 --order $order $sw --out $OUT/r2_${name}_${order}_${arm}_$run.json > /dev/null 2>&1
        python -c "import json;d=json.load(open('$OUT/r2_${name}_${order}_${arm}_$run.json'));p=d['all']['plugin_ms'];print('$name $order $arm $run', p['p50'], p['p99'])"
      done
    done
  done
done
