#!/usr/bin/env bash
# Put chucky's source (acquire-project/chucky, the CUDA streaming Zarr writer) under the git-ignored
# benchmarks/scratch/chucky-src, pruned to what benchmarks/chucky/build.sh compiles and what a
# reader of the comparison needs (src, cmake, docs, bench sources, licence): ~1 MB, so it travels
# to the offline GPU machine as a carried path. Third-party code: never committed here.
#
#   bash benchmarks/chucky/prepare_source.sh GIT_DIR [COMMIT]   # a bare clone (git --git-dir)
#   bash benchmarks/chucky/prepare_source.sh chucky.tar.gz      # or an archive of the tree
set -euo pipefail
top=$(git rev-parse --show-toplevel)
src=${1:?usage: prepare_source.sh GIT_DIR_OR_TARBALL [COMMIT]}
commit=${2:-HEAD}
dest="$top/benchmarks/scratch/chucky-src"
rm -rf "$dest"
mkdir -p "$dest"
if [ -d "$src" ]; then
  git --git-dir="$src" archive "$commit" | tar -x -C "$dest"
  git --git-dir="$src" rev-parse "$commit" > "$dest/COMMIT"
else
  tar -xzf "$src" -C "$dest" --strip-components=1
  echo "unknown (from $(basename "$src"))" > "$dest/COMMIT"
fi
# What the build and the reader of the comparison do not need: measured results, tests, CI, Nix,
# Docker, scripts (the bench sources stay as the reference the driver mirrors).
rm -rf "$dest"/bench/results "$dest"/tests "$dest"/scripts "$dest"/.github "$dest"/flake.* \
  "$dest"/Dockerfile* "$dest"/docker-compose.yml "$dest"/codecov.yml "$dest"/.clang-format \
  "$dest"/.dockerignore "$dest"/.gitignore "$dest"/docs/devlog.md
du -sh "$dest"
echo "chucky $(cat "$dest/COMMIT") -> $dest"
