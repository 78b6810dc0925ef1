#!/usr/bin/env bash
# A/B of the Writer on the GPU machine: GPU tests on .ab/new, then bench_write alternating the
# code of two commits. Prepare here (both ignored, carried with .whl):
#   mkdir -p .ab/old .ab/new && git archive OLD src benchmarks | tar -x -C .ab/old
#   git archive HEAD src tests benchmarks pyproject.toml | tar -x -C .ab/new
# then: run(command="bash benchmarks/ab_writer_gpu.sh", carry=[".whl", ".ab"])
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.ab/new/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
(cd .ab/new && timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider tests) 2>&1 | tail -25 | tee $OUT/pytest_gpu.log
for round in 1 2; do
  for code in old new; do
    src=$PWD/.ab/new/src; [ $code = old ] && src=$PWD/.ab/old/src
    PYTHONPATH=/tmp/site:$src timeout 100 python3 $src/../benchmarks/bench_write.py --gib 4 --frame 2048x2048 --tiles 256k,1m \
      --engines tileshard-gpu,tileshard-cpu --out /dev/shm/ab-$code --json $OUT/ab_${code}_$round.json 2>&1 | grep -v "^\s*$" | tail -14 | sed "s/^/[$code $round] /" | tee -a $OUT/ab.log
    rm -rf /dev/shm/ab-$code
  done
done
