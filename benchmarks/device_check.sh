#!/usr/bin/env bash
# One device call's worth of checks, for the H200 machine (30 device minutes a session, 10 a call): run from
# the repository root with PYTHONPATH=. and $OUT set; writes logs and JSON under $OUT and prints a summary.
#
#   bash benchmarks/device_check.sh tests        # every GPU test, six processes in parallel (~10 min since session
#                                                # 30: more than one call; session 33 ran the rest by --deselect)
#   bash benchmarks/device_check.sh bench        # e2e, MoE decode points + CUDA kernels, MSA grid, traces (~330 s)
#   bash benchmarks/device_check.sh sweep        # MSA top-k launch shapes + CUDA indexer chunking (~200 s)
#   bash benchmarks/device_check.sh attn         # the CUDA C++ attention decode vs Triton, then the MSA grid with Triton
#   bash benchmarks/device_check.sh decode       # MegaMoE's decode GPU tests, then issue 6's decode table (~250 s)
#   bash benchmarks/device_check.sh folds        # the act / combine folds: a same-run A/B, then the decode's GPU tests
#   bash benchmarks/device_check.sh prefetch     # PREFETCH_FC2 0 / 1 / 2 / 3: a same-run A/B at T = 1, 2, its GPU tests
#   bash benchmarks/device_check.sh timeline     # the decode CTA by CTA (moe_cuda.TIMELINE) at T = 1, 4, 16 (~90 s)
#   bash benchmarks/device_check.sh queue        # QUEUE (FC1 + FC2 in one launch): GPU tests, A/B at T = 1, timeline
#   bash benchmarks/device_check.sh acquire      # ACQUIRE_LAST and QUEUE: their GPU tests, A/B of the four at T = 1
#   bash benchmarks/device_check.sh ring         # the bulk-copy ring probe against the register buffers (~2 min)
#
# Each step has its own timeout, so one slow step cannot eat the call; what finished is in $OUT.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
t0=$(date +%s)
mark() { echo "[$1: $(( $(date +%s) - t0 )) s]"; }

tests() {
  local p="python -m pytest -m gpu -v -p no:cacheprovider"  # (-v: a line a test as it ends, so a cut-off log names them)
  # six processes at once need the H200's 141 GB: on an 80 GB H100 they ran out of memory (session 30), so there
  # the second three wait for the first three
  local mib; mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  ($p tests/backends/kernels/test_msa_attention.py tests/backends/kernels/test_msa_attention_cuda.py \
     tests/fused/test_sparse_attention.py tests/runtime tests/frontend \
     > "$OUT/t_attn_runtime.log" 2>&1; echo "rc=$?" >> "$OUT/t_attn_runtime.log") &
  ($p tests/backends/kernels/test_moe_prefill.py > "$OUT/t_moe_prefill.log" 2>&1
   echo "rc=$?" >> "$OUT/t_moe_prefill.log") &
  ($p tests/backends/kernels/test_moe_prefill_cuda.py > "$OUT/t_moe_prefill_cuda.log" 2>&1  # with the fp8 builds: its own
   echo "rc=$?" >> "$OUT/t_moe_prefill_cuda.log") &
  [ "${mib:-0}" -lt 100000 ] && wait
  ($p tests/backends/kernels/test_moe_routing.py tests/backends/kernels/test_qkv_fused.py \
     tests/backends/kernels/test_msa_indexer.py tests/backends/kernels/test_msa_indexer_cuda.py \
     > "$OUT/t_route_qkv_indexer.log" 2>&1
   echo "rc=$?" >> "$OUT/t_route_qkv_indexer.log") &
  ($p tests/backends/kernels/test_moe_decode.py tests/backends/kernels/test_moe_cuda.py tests/fused/test_moe.py \
     tests/backends/kernels/test_moe_cuda_route.py tests/test_cli_compile.py tests/backends/test_cuda_driver.py \
     tests/backends/kernels/test_moe_cuda_prefetch.py tests/backends/kernels/test_moe_cuda_queue.py \
     tests/backends/kernels/test_moe_cuda_timeline.py \
     > "$OUT/t_moe_cli.log" 2>&1; echo "rc=$?" >> "$OUT/t_moe_cli.log") &
  ($p tests/backends/kernels/test_moe_prefill_ws.py > "$OUT/t_moe_prefill_ws.log" 2>&1  # (float64 models: slow)
   echo "rc=$?" >> "$OUT/t_moe_prefill_ws.log") &
  wait
  mark tests
  for f in "$OUT"/t_*.log; do echo "$(basename "$f"): $(grep -E 'passed|failed' "$f" | tail -1)"; grep -E '^FAILED' "$f"; done
}

bench() {
  timeout 170 python benchmarks/bench_e2e.py --preset m3.1-small --prompt-tokens 512 --decode-steps 32 \
    --no-torch-compile > "$OUT/e2e.txt" 2>&1; mark e2e
  timeout 130 python benchmarks/bench_moe.py --tokens 1,4,16,64 > "$OUT/moe.txt" 2>&1; mark moe
  timeout 80 python benchmarks/bench_moe_mma.py --tokens 1,4,8,16 --decode 0 > "$OUT/moe_mma.txt" 2>&1
  mark moe_mma
  timeout 150 python benchmarks/bench_msa.py --quick --no-reference > "$OUT/msa.txt" 2>&1; mark msa
  timeout 40 python benchmarks/profile_targets.py attn1m --trace > "$OUT/trace_attn1m.txt" 2>&1
  timeout 40 python benchmarks/profile_targets.py moe1 --trace > "$OUT/trace_moe1.txt" 2>&1; mark traces
  tail -6 "$OUT/e2e.txt"; grep -v '^{' "$OUT/moe.txt" | tail -6; tail -5 "$OUT/moe_mma.txt"; tail -14 "$OUT/msa.txt"
  grep -E '^ +[0-9]' "$OUT/trace_attn1m.txt" | head -6; grep -E '^ +[0-9]' "$OUT/trace_moe1.txt" | head -8
}

attn() {  # the CUDA C++ attention decode (ATTN_CUDA) against the Triton one, then the MSA grid with Triton attention
  timeout 150 python benchmarks/bench_msa_attention_decode.py --contexts 524288 --batches 1 8 32 --stages 3 \
    --warps 8 --block-n 64 --splits 4 8 16 --cuda > "$OUT/attn_cuda.txt" 2>&1; mark attn
  timeout 150 python benchmarks/bench_msa.py --quick --no-reference --attn-triton > "$OUT/msa_attn_triton.txt" 2>&1
  mark msa_attn_triton
  grep -E '^ +[0-9]' "$OUT/attn_cuda.txt" | head -40; tail -14 "$OUT/msa_attn_triton.txt"
}

decode() {  # MegaMoE's decode: its GPU tests against the reference, then issue 6's decode table (bench_moe.py)
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/backends/kernels/test_moe_cuda.py \
    -k "matches_reference or early or dependent" > "$OUT/t_moe_decode.log" 2>&1; mark moe_decode_tests
  timeout 150 python benchmarks/bench_moe.py --tokens 1,4,16,64 > "$OUT/moe_decode.txt" 2>&1; mark moe_decode_table
  tail -2 "$OUT/t_moe_decode.log"; grep -v '^{' "$OUT/moe_decode.txt" | tail -8
}

ab() {  # ab NAME REPS TOKENS LIMIT TAG=ARGS...: a same-run A/B of bench_moe_ab.py, each setting (its --tag TAG, then
  # ARGS split into words, e.g. "pf1=--knob PREFETCH_FC2=1") once a round, REPS rounds, each run under LIMIT seconds,
  # into $OUT/NAME.jsonl; then its table
  local name=$1 reps=$2 tokens=$3 limit=$4 rep setting; shift 4
  for rep in $(seq "$reps"); do
    for setting in "$@"; do
      # shellcheck disable=SC2086  # (the setting's arguments are meant to split)
      timeout "$limit" python benchmarks/bench_moe_ab.py --tag "${setting%%=*}" --tokens "$tokens" ${setting#*=} \
        >> "$OUT/$name.jsonl" 2>> "$OUT/$name.err"
    done
  done; mark "$name"
  python benchmarks/bench_moe_ab.py --summarize "$OUT/$name.jsonl"
}

folds() {  # the act / combine folds: a same-run A/B (none vs the default choice, FOLD_REPS alternations), their GPU
  # tests (at every T: forced), the rest of the decode's GPU tests and the routing kernel's (its arrival is shared)
  ab folds_ab "${FOLD_REPS:-2}" "${FOLD_TOKENS:-1,4,16,64}" 100 "none=--knob FOLD_ACT=0 --knob FOLD_COMBINE=0" "default="
  timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/backends/kernels/test_moe_cuda.py \
    tests/backends/kernels/test_moe_cuda_route.py -k "not test_route_stage_matches_fused_route_and_reference" \
    > "$OUT/t_folds.log" 2>&1; mark fold_tests
  tail -3 "$OUT/t_folds.log"
}

prefetch() {  # PREFETCH_FC2 (FC1 asks L2 for FC2's first super-chunks where the call folds): a same-run A/B of
  # n = 0 (off), 1, 2, 3 at T = 1 (folded) and 2 (not folded: the same build, a control), then its GPU tests
  ab prefetch_ab "${PF_REPS:-3}" "${PF_TOKENS:-1,2}" 60 "pf0=--knob PREFETCH_FC2=0" "pf1=--knob PREFETCH_FC2=1" \
    "pf2=--knob PREFETCH_FC2=2" "pf3=--knob PREFETCH_FC2=3"
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/backends/kernels/test_moe_cuda_prefetch.py \
    > "$OUT/t_prefetch.log" 2>&1; mark prefetch_tests
  tail -3 "$OUT/t_prefetch.log"
}

timeline() {  # when each FC1 / FC2 CTA enters, stages, streams and leaves, and the weight bytes a microsecond (TL_ARGS:
  # more of the script's arguments, e.g. "--knob DECODE=2" for the weight loads alone)
  # shellcheck disable=SC2086  # (TL_ARGS is meant to split)
  timeout 150 python benchmarks/bench_moe_cta_timeline.py --tokens "${TL_TOKENS:-1,4,16}" ${TL_ARGS:-} \
    --tag "${TL_TAG:-}" \
    > "$OUT/cta_timeline${TL_TAG:-}.txt" 2>&1
  mark timeline
  grep -E '^T =' "$OUT/cta_timeline${TL_TAG:-}.txt"
}

queue() {  # moe_cuda.QUEUE where the call folds: its GPU tests first (a deadlock ends in the timeout, and the rest
  # is skipped), then a same-run A/B at T = 1 (QUEUE_REPS alternations; QUEUE launched programmatically too: its
  # shared-expert FC1 items during the routing launch), then its timeline beside the plain one's
  timeout 240 python -m pytest -m gpu -v -p no:cacheprovider tests/backends/kernels/test_moe_cuda_queue.py \
    > "$OUT/t_queue.log" 2>&1
  local rc=$?; mark queue_tests; tail -3 "$OUT/t_queue.log"
  [ "$rc" -ne 0 ] && { echo "queue: GPU tests rc=$rc, no timing"; return; }
  ab queue_ab "${QUEUE_REPS:-3}" "${QUEUE_TOKENS:-1}" 60 "queue0=--knob QUEUE=0" "queue1=--knob QUEUE=1" \
    "queue1_pdl=--knob QUEUE=1 --pdl fold=moe_experts"
  timeout 120 python benchmarks/bench_moe_cta_timeline.py --tokens 1 --knob QUEUE=1 > "$OUT/cta_timeline_queue.txt" 2>&1
  mark queue_timeline; grep -E '^T =' "$OUT/cta_timeline_queue.txt"
}

acquire() {  # ACQUIRE_LAST (the folds' arrivals release; the last CTA alone acquires) and QUEUE (its spin relaxed
  # since session 34): QUEUE's and the folds' GPU tests, then a same-run A/B of the four at T = 1 (ACQ_REPS
  # alternations), then QUEUE's timeline with both
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/backends/kernels/test_moe_cuda_queue.py \
    tests/backends/kernels/test_moe_cuda.py -k "queue or (folded_launches and (knobs2 or knobs3))" \
    > "$OUT/t_acquire.log" 2>&1
  local rc=$?; mark acquire_tests; tail -3 "$OUT/t_acquire.log"
  [ "$rc" -ne 0 ] && { echo "acquire: GPU tests rc=$rc, no timing"; return; }
  ab acquire_ab "${ACQ_REPS:-2}" "${ACQ_TOKENS:-1}" 60 "fold=" "acqlast=--knob ACQUIRE_LAST=1" \
    "queue=--knob QUEUE=1" "queue_acqlast=--knob QUEUE=1 --knob ACQUIRE_LAST=1"
  timeout 120 python benchmarks/bench_moe_cta_timeline.py --tokens 1 --knob QUEUE=1 --knob ACQUIRE_LAST=1 \
    > "$OUT/cta_timeline_queue.txt" 2>&1
  mark queue_timeline; grep -E '^T =' "$OUT/cta_timeline_queue.txt"
}

ring() {  # the bulk-copy ring probe (benchmarks/probes/decode_ring.cu): register double buffer vs a producer warp's
  # bulk copies into a shared-memory ring, the decode's own math (and DECODE 2: loads alone), bitwise checked
  timeout 300 python benchmarks/bench_decode_ring.py ${RING_ARGS:-} > "$OUT/decode_ring.txt" 2>&1
  mark ring; cat "$OUT/decode_ring.txt"
}

sweep() {  # the MSA top-k's launch shape (slice width, slices, warps, rank merge) and the CUDA indexer's CTAs per SM
  local b="python benchmarks/bench_msa_indexer_variants.py --no-prefill --contexts 524288 1048576 --batches 8 --deq cuda"
  for cfg in "1024 8 0 6 0" "1024 8 0 6 256" "512 16 0 6 256" "256 32 1 6 0" "128 64 1 6 0" "1024 8 0 9 0"; do
    set -- $cfg
    timeout 40 $b --topk-ch $1 --topk-slices $2 --topk-warps $3 --cuda-ctas $4 --topk-rank-merge $5 \
      > "$OUT/idx_topk_$1_$2_$3_$4_$5.txt" 2>&1
  done; mark sweep
  for f in "$OUT"/idx_topk_*.txt; do echo "$(basename "$f"):"; grep -E '^ decode' "$f"; done
}

for step in "$@"; do
  case "$step" in
    tests|bench|sweep|attn|decode|folds|prefetch|timeline|queue|acquire|ring) "$step" ;;
    *) echo "unknown step '$step': expected tests, bench, sweep, attn, decode, folds, prefetch, timeline, queue," \
         "acquire or ring" >&2
       exit 2 ;;
  esac
done
