#!/usr/bin/env bash
# Run on the GPU machine from the repo root: build, then the named stages in order. Every stage
# writes its log and its CSV rows to $OUT/r as it goes (a call cut short keeps what finished),
# and everything is packed into $OUT/results.tgz at the end (the device tool returns at most
# 8 files). Copy the CSV rows into benchmarks/results/ here afterwards.
#   bash benchmarks/run_gpu.sh STAGE [STAGE ...]
#
# Stages and their device time on one H200 (the build adds ~60 s to each call, a fresh machine
# ~95 s more); each open target's stage is named after its issue's item:
#   tests        the whole suite, GPU tests included (~10 min)
#   cuda         the CUDA-marked tests only (~2.5 min; issue 39: green at the commit)
#   ceilings     GEMM / HBM / PCIe rates (bench_ceilings.py)
#   optim ring_dtp sco llep transport demo tiled composed ...   bench_<stage>.py [--quick unless FULL=1]
#   spill        the disk tier's bandwidth beside dd with O_DIRECT on the same disk (issue 40, 3)
#   demo_timed   the quick start's main job, `python -m moepeak demo`, timed (issue 39: 1-2 minutes)
#   llep_cache   PipelinedLLEP at 256k: the growing default cache vs a fixed 1536 MiB one, beside
#                torchtitan's GroupedExperts (picks the default cache)
#   attention    the tiled core's attention per backend and head grouping, both models at 128k, and
#                the opt-in backend's exactness (CUDA tests of test_attention_backend) (issue 38, 3)
#   attention_step  OLMoE at 256k tiled: torch's SDPA choice vs attention "auto" (cuDNN first, the
#                fewest head groups that fit), decides whether "auto" becomes the default (~5 min)
#   alst_qwen    ALST vs moepeak on the 2.0B Qwen3-MoE, T doubling from 8k (issue 38, 2; ~9 min)
#   alst_olmoe   the same on the OLMoE-1B-7B shape (~9 min)
#   olmoe_256k   OLMoE at 256k: automatic placement vs keep_last 10 by hand (issue 40: within 5%)
#   olmoe_1m     OLMoE at 1M tokens on 4 of its 16 layers, placed by the planner (issue 40; ~6 min)
# Within 30 minutes of device time, in issue order: `cuda spill demo_timed llep_cache attention`
# (one call), `alst_qwen`, `alst_olmoe`, `attention_step olmoe_256k`, then `olmoe_1m`.
. benchmarks/gpu_env.sh
R="$OUT/r"; mkdir -p "$R"
cp "$OUT/gpu.txt" "$R/" 2>/dev/null
QUICK=--quick; [ "${FULL:-0}" = 1 ] && QUICK=
say() { echo "== $1 $(date -u +%H:%M:%S)" | tee -a "$R/stages.log"; }
hf() { timeout "$1" python3 benchmarks/bench_hf.py "${@:2}" 2>&1; }
for what in "$@"; do
  say "$what"
  case "$what" in
    tests)
      python3 -m pytest -q -rs ${PYTEST_ARGS:-tests} 2>&1 | tee "$R/tests.log" | tail -40 ;;
    cuda)
      timeout 300 python3 -m pytest -q -rs -m cuda tests --ignore=tests/test_multigpu.py -p no:cacheprovider \
        2>&1 | tee "$R/cuda_tests.log" | tail -20 ;;
    ceilings)
      python3 benchmarks/bench_ceilings.py --out "$R" 2>&1 | tee "$R/bench_ceilings.log" ;;
    spill)
      mkdir -p /tmp/spill; df -h /tmp | tee "$R/spill.log"
      timeout 120 python3 benchmarks/bench_spill.py --dir /tmp/spill --out "$R" 2>&1 | tee -a "$R/spill.log" | tail -8 ;;
    demo_timed)
      ( time timeout 240 python3 -m moepeak demo --plot "$R/demo.png" ) 2>&1 | tee "$R/demo.log" | tail -30 ;;
    llep_cache)
      timeout 120 python3 benchmarks/bench_llep.py --quick --tokens 262144 \
        --arms grouped_mm_titan,pipelined,pipelined_b1536 --iters 5 --out "$R" 2>&1 | tee "$R/llep.log" | tail -10 ;;
    attention)
      timeout 120 python3 -m pytest -q -rs -m cuda tests/test_attention_backend.py -p no:cacheprovider 2>&1 \
        | tee "$R/attention_tests.log" | tail -5
      timeout 120 python3 benchmarks/bench_attention.py --quick --backends auto,cudnn,flash --groups all --gqa gqa \
        --reps 2 --max-seconds 90 --out "$R" 2>&1 | tee "$R/attention.log" | tail -20 ;;
    attention_step)
      for a in torch auto; do
        hf 200 --model olmoe --arms moepeak_tiled --T 262144 --attention $a --budget-s 190 --csv "$R/hf_olmoe.csv" \
          | tee -a "$R/attention_step.log" | tail -3
      done ;;
    alst_qwen)
      hf 560 --arms alst,moepeak_tiled --T 8192,16384,32768,65536,131072,262144,524288 --budget-s 540 \
        --csv "$R/hf.csv" | tee "$R/alst_qwen.log" | tail -30 ;;
    alst_olmoe)
      hf 560 --model olmoe --arms alst,moepeak_tiled --T 8192,16384,32768,65536,131072,262144 --budget-s 540 \
        --csv "$R/hf_olmoe.csv" | tee "$R/alst_olmoe.log" | tail -30 ;;
    olmoe_256k)
      hf 200 --model olmoe --arms moepeak_tiled --T 262144 --budget-s 190 --csv "$R/hf_olmoe.csv" \
        | tee "$R/olmoe_256k.log" | tail -5
      hf 200 --model olmoe --arms moepeak_tiled --T 262144 --sco-keep-last 10 --budget-s 190 \
        --csv "$R/hf_olmoe.csv" | tee -a "$R/olmoe_256k.log" | tail -5 ;;
    olmoe_1m)
      hf 560 --model olmoe --arms moepeak_tiled --layers 4 --T 1048576 --warmup 0 --max-step-s 540 \
        --budget-s 550 --csv "$R/hf_olmoe.csv" | tee "$R/olmoe_1m.log" | tail -5 ;;
    *)
      timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/bench_$what.py $QUICK --out "$R" 2>&1 | tee "$R/bench_$what.log" | tail -60 ;;
  esac
done
say done
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"  # the tool returns at most 8 files
