#!/usr/bin/env bash
# Download the wheels of benchmarks/wheels.txt into .whl/ (git-ignored) for the GPU machine:
# CPython 3.12, manylinux x86_64, no dependencies (the list is complete by itself). A package
# PyPI has only as an sdist (deepspeed) is built here into a wheel, which must come out pure
# Python (py3-none-any), else this script fails; DS_BUILD_OPS=0 leaves DeepSpeed's ops to
# its JIT build on the GPU machine. A wheel already in .whl/ is kept. Needs pip, and torch
# for deepspeed's setup.py.
#   bash benchmarks/fetch_wheels.sh [LIST]      (from the repo root; LIST: benchmarks/wheels.txt)
set -euo pipefail
list=${1:-benchmarks/wheels.txt}
dest=.whl
[ -f "$list" ] || { echo "fetch_wheels: no list at $list" >&2; exit 2; }
mkdir -p "$dest"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
wanted=()
while IFS= read -r line; do
  spec=${line%%#*}; spec=${spec//[[:space:]]/}
  [ -z "$spec" ] && continue
  case "$spec" in
    *==*) ;;
    *) echo "fetch_wheels: $list: expected name==version, got '$spec'" >&2; exit 2 ;;
  esac
  name=${spec%%==*}; version=${spec#*==}
  stem=$(echo "$name" | tr 'A-Z-.' 'a-z__')-$version  # a wheel file's name: normalized, then the version
  wanted+=("$stem")
  if compgen -G "$dest/$stem-*.whl" >/dev/null; then
    echo "have  $spec"
    continue
  fi
  if python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" "$spec" 2>/dev/null; then
    echo "got   $spec"
    continue
  fi
  echo "build $spec (no wheel for the GPU machine on the index)"
  DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$spec"
  built=$(compgen -G "$dest/$stem-*.whl" || true)
  case "$built" in
    *-py3-none-any.whl) echo "built $built" ;;
    *) echo "fetch_wheels: building $spec gave '${built:-nothing}', not a py3-none-any wheel" >&2; exit 1 ;;
  esac
done < "$list"
for f in "$dest"/*.whl; do  # .whl/*.whl all get installed on the GPU machine: say what the list does not name
  base=$(basename "$f")
  keep=0
  for stem in "${wanted[@]}"; do [[ $base == "$stem"-* ]] && keep=1; done
  [ $keep = 1 ] || echo "note: $f is not in $list (benchmarks/gpu_env.sh installs it too)"
done
du -sh "$dest"
