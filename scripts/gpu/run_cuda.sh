#!/usr/bin/env bash
# One GPU run of the CUDA backend (issue 6): a smoke run of the tiny shape, the GPU-against-CPU
# checks on every tiny fixture in three configurations (defaults; every optional fusion, bf16
# gate/up and one-token attention chunks; CUDA-core prefill attention), then the Llama-3.1-8B-shape
# benchmark over a matrix of the TRELLM_CUDA_* switches (see crates/cuda/src/dense.rs, Tuning).
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

# Each configuration: a label, then VAR=VALUE settings.
CHECKS=(
    "default"
    "fusions+gu_bf16+chunk1 TRELLM_CUDA_FUSE_ROPE=1 TRELLM_CUDA_FUSE_COMBINE=1 TRELLM_CUDA_FUSE_RESIDUAL=1 TRELLM_CUDA_GU_BF16=1 TRELLM_CUDA_ATTN_BUDGET=8"
    "cuda_core_attn TRELLM_CUDA_ATTN_GEMM=0"
)
BENCHES=(
    "default"
    "fuse_rope TRELLM_CUDA_FUSE_ROPE=1"
    "fuse_combine TRELLM_CUDA_FUSE_COMBINE=1"
    "gu_bf16 TRELLM_CUDA_GU_BF16=1"
    "cuda_core_attn TRELLM_CUDA_ATTN_GEMM=0"
)
for cfg in "${CHECKS[@]}"; do
    read -r label settings <<<"$cfg"
    echo "== checks (CUDA vs CPU, 32 greedy steps): $label"
    for d in tests/fixtures/tiny/*/; do
        env ${settings:-} timeout 120 "$BIN" bench --device cuda --check --model "$d" --n-gen 32 2>&1 \
            || echo "{\"model\": \"$d\", \"error\": true}"
    done | sed "s/^{/{\"config\":\"$label\",/" | tee -a "$OUT/check.jsonl"
done
echo "== llama-3.1-8b shape"
for cfg in "${BENCHES[@]}"; do
    read -r label settings <<<"$cfg"
    env ${settings:-} timeout 120 "$BIN" bench --device cuda --shape llama-3.1-8b --n-prompt 2048 \
        --context 512 --n-gen 128 -r ${REPS:-5} --json 2>&1 | sed "s/^{/{\"config\":\"$label\",/" | tee -a "$OUT/bench_8b.jsonl"
done
