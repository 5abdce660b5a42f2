#!/usr/bin/env bash
# One GPU run of the EXL3 path (issue 14): the EXL3 kernel tests and the CUDA-vs-CPU tests
# (EXL3 folders alone and batched, the bf16 fixtures as regressions), the Llama-3.1-8B-shape
# benchmark with synthetic EXL3 weights (MUL1 K = 2, 3, 4, exact and int8 fast path; bf16 beside),
# batched at B = 1, 8, 32,
# then the per-row-count kernel timing. Binaries and folders from scripts/gpu/carry_tests.sh.
# run: SRC_ROOT=<checkout the tests were built in> bash scripts/gpu/run_exl3.sh   (results in $OUT)
set -u
DEV=${DEV:-.device}
BIN=$DEV/trellm
OUT=${OUT:-/tmp/trellm-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
src=${SRC_ROOT:-}
if [ -n "$src" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
t() { # name, timeout, test binary args...
    local name=$1 limit=$2; shift 2
    echo "== $name  (t=${SECONDS}s)"
    timeout "$limit" "$@" >"$OUT/test-$name.txt" 2>&1
    echo "rc=$?"; grep -E "^test .*(ok|FAILED)$|test result|panicked" "$OUT/test-$name.txt" | tail -12
}
t exl3_rows 120 $DEV/tests/gpu_exl3 --include-ignored --exact row_regimes_match_cpu --nocapture
t cuda_vs_cpu_exl3 120 $DEV/tests/cuda_vs_cpu --include-ignored --exact exl3_folders_match_the_cpu_alone_and_batched --nocapture
t exl3_int8 120 $DEV/tests/gpu_exl3 --include-ignored --exact int8_path_matches_cpu_within_its_rounding --nocapture
t exl3_int8_kl 120 $DEV/tests/cuda_vs_cpu --include-ignored --exact exl3_int8_path_kl_against_the_exact_path --nocapture
echo "== generate --device cuda on an EXL3 folder, against --device cpu  (t=${SECONDS}s)"
for d in tests/fixtures/exl3/tiny-llama/*/; do
    for dev in cpu cuda; do
        echo "$(basename "$d") $dev $("$BIN" generate -M "$d" --prompt-ids 1,2,3,4,5 -m 16 --json -q --device $dev 2>&1 | cut -c1-300)"
    done
done | tee "$OUT/generate_exl3.txt"
bench() { # label, extra flags
    local label=$1; shift
    echo "== bench 8b $label  (t=${SECONDS}s)"
    timeout 150 "$BIN" bench --device cuda --shape llama-3.1-8b --n-prompt 2048 --context 512 --n-gen 128 \
        -r ${REPS:-3} --json "$@" 2>&1 | sed "s/^{/{\"config\":\"$label\",/" | tee -a "$OUT/bench_8b.jsonl" | cut -c1-600
}
bench exl3-mul1-3 --exl3 mul1:3
bench exl3-mul1-2 --exl3 mul1:2
bench exl3-mul1-4 --exl3 mul1:4
for k in 2 3 4; do bench exl3-mul1-$k-exact --exl3 mul1:$k --exl3-exact; done
bench bf16
echo "== batched exl3 mul1:3  (t=${SECONDS}s)"
timeout 200 "$BIN" bench --device cuda --shape llama-3.1-8b --exl3 mul1:3 --batch 1,8,32 -p 512 -n 64 --json \
    2>&1 | tee "$OUT/batched_8b_exl3.jsonl" | cut -c1-400
t gpu_exl3 200 $DEV/tests/gpu_exl3 --include-ignored --skip timing --test-threads 1
t cuda_vs_cpu 200 $DEV/tests/cuda_vs_cpu --include-ignored --test-threads 1
t gpu_dense 120 $DEV/tests/gpu_dense --include-ignored --test-threads 1
echo "== timing  (t=${SECONDS}s)"
TRELLM_RESULTS="$OUT/exl3_timing.jsonl" timeout 150 $DEV/tests/gpu_exl3 --include-ignored --exact timing \
    >"$OUT/timing.txt" 2>&1
echo "rc=$?"
echo "== done (t=${SECONDS}s)"
