#!/usr/bin/env bash
# CI sanitizer job: build moepeak._C CPU-only with AddressSanitizer +
# UndefinedBehaviorSanitizer in a copy of the tree, run the C-heavy CPU tests
# against it, and fail on any sanitizer report (or any test failure).
#
# The interpreter and torch are not instrumented, so the ASan runtime is
# preloaded (libstdc++ with it: ASan must find the real __cxa_throw, which
# torch's C++ exceptions go through). Leak detection is off (CPython's and
# torch's process-lifetime allocations are not ours). Every report goes to a
# log file as well as stderr, because pytest's capture swallows what a dying
# test writes; any ASan error or UBSan "runtime error" in the logs fails the
# job. Reports raised inside torch or python through an ASan interceptor are
# suppressed (.ci/asan.supp); a report whose stack is in moepeak never is.
#
# Usage: .ci/sanitize.sh [pytest args...]  (default: the selection below)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moepeak-sanitize.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

# 1. a copy of the tracked (and new, not ignored) files, built in place
git ls-files -co --exclude-standard -z | grep -zv '\.so$' | tar --null -cf - -T - | tar -xf - -C "$WORK"
mkdir -p "$WORK/.logs"
(cd "$WORK" && MOEPEAK_CUDA=0 MOEPEAK_SANITIZE=address,undefined python setup.py -q build_ext --inplace >"$WORK/.logs/build.txt" 2>&1) \
  || { cat "$WORK/.logs/build.txt"; exit 1; }

# the extension really carries the sanitizer runtimes (a silently plain build would pass everything)
for lib in libasan libubsan; do
  readelf -d "$WORK"/moepeak/_C*.so | grep -q "NEEDED.*$lib" || { echo "sanitize: _C is not linked to $lib"; exit 1; }
done

export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$WORK/.logs/asan:suppressions=$ROOT/.ci/asan.supp"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$WORK/.logs/ubsan"

cd "$WORK"
python - <<'PY'
import os, moepeak, moepeak._C as C
here = os.getcwd()
assert moepeak.__file__.startswith(here) and C.__file__.startswith(here), \
    f"the sanitized copy is not the moepeak imported: {moepeak.__file__}, {C.__file__}"
PY

if [ $# -eq 0 ]; then
  # The C kernels' callers on CPU: bindings, planner/layout/kernels of LLEP,
  # the Ring-DTP fold/gradient/finish kernels (single device, and on 2 gloo ranks
  # with padded shards, empty batches and non-finite rows: spawned ranks inherit
  # LD_PRELOAD and import this copy), SCO, the AdamW kernels and the fuzz tests
  # (default, small example counts).
  set -- tests/test_bindings.py tests/test_plan.py tests/test_llep.py tests/test_llep_act.py \
         tests/test_llep_one_chunk.py tests/test_ring_dtp_ops.py tests/test_ring_dtp_kernels.py \
         tests/test_ring_dtp_edge.py tests/test_ring_dtp_dist_edge.py tests/test_sco.py tests/test_stream_adamw.py \
         tests/test_stream_adamw_amsgrad.py $(ls tests/test_fuzz_*.py 2>/dev/null)
fi
rc=0
python -m pytest -q -p no:cacheprovider "$@" || rc=$?

shopt -s nullglob
logs=("$WORK"/.logs/asan* "$WORK"/.logs/ubsan*)
found=0
for f in "${logs[@]}"; do
  echo "==== sanitizer log $(basename "$f")"
  cat "$f"
  if grep -qE "ERROR: AddressSanitizer|runtime error:|CHECK failed" "$f"; then found=1; fi
done
echo "sanitizer job: pytest rc=$rc, sanitizer reports: $found, $(( $(date +%s) - start )) s"
if [ "$found" -ne 0 ]; then exit 1; fi
exit "$rc"
