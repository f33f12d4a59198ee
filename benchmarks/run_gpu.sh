#!/usr/bin/env bash
# Run on the GPU machine from the repo root: build, the whole test suite
# (GPU tests included), then the named benchmarks (quick mode unless FULL=1).
# Everything lands in $OUT/r and is packed into $OUT/results.tgz (the device
# tool returns at most 8 files).
#   bash benchmarks/run_gpu.sh [tests] [ceilings optim ring_dtp sco llep transport demo]
. benchmarks/gpu_env.sh
R="$OUT/r"; mkdir -p "$R"
cp "$OUT/gpu.txt" "$R/" 2>/dev/null
QUICK=--quick; [ "${FULL:-0}" = 1 ] && QUICK=
for what in "$@"; do
  case "$what" in
    tests)
      python3 -m pytest -q -rs ${PYTEST_ARGS:-tests} 2>&1 | tee "$R/tests.log" | tail -40 ;;
    ceilings)
      python3 benchmarks/bench_ceilings.py --out "$R" 2>&1 | tee "$R/bench_ceilings.log" ;;
    *)
      timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/bench_$what.py $QUICK --out "$R" 2>&1 | tee "$R/bench_$what.log" | tail -60 ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"  # the tool returns at most 8 files
