#!/usr/bin/env bash
# One GPU run of the CUDA backend (issue 6): the GPU-against-CPU checks on every tiny fixture,
# a smoke run of the tiny shape, then the Llama-3.1-8B-shape benchmark (GEMV unroll variants).
# Results go to $OUT.   run: bash scripts/gpu/run_cuda.sh   (binary at .device/trellm, carried)
set -u
BIN=${BIN:-.device/trellm}
OUT=${OUT:-/tmp/trellm-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
echo "== tiny shape"
timeout 120 "$BIN" bench --device cuda --shape tiny --n-prompt 64 --context 32 --n-gen 16 -r 2 --json 2>&1 | tee "$OUT/tiny.json"
echo "== checks (CUDA vs CPU, 32 greedy steps)"
for d in tests/fixtures/tiny/*/; do
    timeout 120 "$BIN" bench --device cuda --check --model "$d" --n-gen 32 2>&1 || echo "{\"model\": \"$d\", \"error\": true}"
done | tee "$OUT/check.jsonl"
echo "== llama-3.1-8b shape"
for u in ${UNROLLS:-4 2 8}; do
    TRELLM_GEMV_UNROLL=$u timeout 300 "$BIN" bench --device cuda --shape llama-3.1-8b --n-prompt 2048 \
        --context 512 --n-gen 128 -r 5 --json 2>&1 | sed "s/^{/{\"gemv_unroll\":$u,/" | tee -a "$OUT/bench_8b.jsonl"
done
