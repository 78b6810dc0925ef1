#!/usr/bin/env bash
# Build chucky's GPU pipeline and our driver chucky_frames offline (the GPU machine: nvcc, cmake,
# no network). Needs chucky's source in benchmarks/scratch/chucky-src (prepare_source.sh) and
# nvCOMP's headers and library from the nvidia-libnvcomp-cu13 wheel unpacked in $SITE
# (default /tmp/site: .kit/site.tar.xz, benchmarks/device_kit.sh). Release flags (-O3): chucky's
# presets set no build type, which would compare unoptimised host code.
#
#   bash benchmarks/chucky/build.sh [BUILD_DIR]     # default /tmp/chucky-build
#
# Logs (configure, build) go to $OUT when set (the device machine's result folder), else BUILD_DIR.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=${1:-/tmp/chucky-build}
site=${SITE:-/tmp/site}
logs=${OUT:-$build}
mkdir -p "$build" "$logs"
fail() { echo "chucky build: $*" >&2; exit 1; }

src=${CHUCKY_SOURCE_DIR:-$here/../scratch/chucky-src}
[ -f "$src/src/gpu/stream.c" ] || fail "no chucky source at $src (carry benchmarks/scratch/chucky-src; see prepare_source.sh)"
echo "chucky source: $src ($(cat "$src/COMMIT" 2>/dev/null || echo 'commit unknown'))"

# nvCOMP from the wheel: the headers in include/, libnvcomp.so.6 in lib64/ (no unversioned link).
nvcomp_include= nvcomp_library=
for root in "$site/nvidia/libnvcomp" "$site/nvidia/nvcomp"; do
  if [ -f "$root/include/nvcomp/zstd.h" ]; then
    nvcomp_include=$root/include
    nvcomp_library=$(find "$root" -maxdepth 2 -name 'libnvcomp.so*' ! -name '*cpu*' | sort | head -1)
    [ -n "$nvcomp_library" ] && break
  fi
done
[ -n "$nvcomp_library" ] || fail "no nvCOMP headers + libnvcomp.so* under $site/nvidia/{libnvcomp,nvcomp} (unpack .kit/site.tar.xz into $site)"
echo "nvCOMP: $nvcomp_library"

nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$nvcc" ] || fail "no nvcc on PATH nor at /usr/local/cuda/bin/nvcc"
"$nvcc" --version | tail -2
generator=${GENERATOR:-}
if [ -z "$generator" ]; then
  generator="Unix Makefiles"
  command -v ninja >/dev/null && generator=Ninja
fi

cmake -S "$here" -B "$build" -G "$generator" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" \
  -DCHUCKY_SOURCE_DIR="$src" \
  -DNVCOMP_INCLUDE_DIR="$nvcomp_include" \
  -DNVCOMP_LIBRARY="$nvcomp_library" \
  ${CHUCKY_CMAKE_ARGS:-} >"$logs/chucky_configure.log" 2>&1 \
  || { tail -40 "$logs/chucky_configure.log"; fail "cmake configure failed (log: $logs/chucky_configure.log)"; }
grep '^-- chucky' "$logs/chucky_configure.log"
cmake --build "$build" --target chucky_frames -j "$(nproc)" >"$logs/chucky_build.log" 2>&1 \
  || { grep -B2 -A6 -m 12 -i 'error' "$logs/chucky_build.log" | head -80; fail "build failed (log: $logs/chucky_build.log)"; }
echo "built $build/chucky_frames ($(grep -ci 'warning' "$logs/chucky_build.log") warning lines in $logs/chucky_build.log)"
