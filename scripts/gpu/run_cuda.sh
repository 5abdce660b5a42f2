#!/usr/bin/env bash
# One GPU run of the CUDA backend (issue 6): a smoke run of the tiny shape, the GPU-against-CPU
# checks on every tiny fixture in several configurations (the default first; every optional
# fusion, bf16 gate/up and one-token attention chunks; the split decode attention with CUDA-core
# prefill attention), and the Llama-3.1-8B-shape benchmark over a matrix of the TRELLM_CUDA_* switches (see crates/cuda/src/dense.rs, Tuning).
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

# Each configuration: a label, then VAR=VALUE settings (see crates/cuda/src/dense.rs, Tuning).
# "splits" is the decode path before run 9 (attention splits + a combine kernel, no cluster).
CHECKS_FIRST=(
    "default"
)
CHECKS_MORE=(
    "splits+cuda_core_attn TRELLM_CUDA_CLUSTER=0 TRELLM_CUDA_ATTN_GEMM=0"
    "cluster+switch TRELLM_CUDA_CLUSTER_CTX=24"
    "fusions+gu_bf16+chunk1 TRELLM_CUDA_FUSE_RESIDUAL=1 TRELLM_CUDA_GU_BF16=1 TRELLM_CUDA_ATTN_BUDGET=8"
    "flash_prefill TRELLM_CUDA_FLASH=1"
)
BENCHES_FIRST=(
    "splits TRELLM_CUDA_CLUSTER=0"
    "default"
)
BENCHES_MORE=(
    "cluster4 TRELLM_CUDA_CLUSTER=4"
    "gu_bf16 TRELLM_CUDA_GU_BF16=1"
    "default_again"
)
checks() {
    for cfg in "$@"; do
        read -r label settings <<<"$cfg"
        echo "== checks (CUDA vs CPU, 32 greedy steps): $label  (t=${SECONDS}s)"
        for d in tests/fixtures/tiny/*/; do
            env ${settings:-} timeout 120 "$BIN" bench --device cuda --check --model "$d" --n-gen 32 2>&1 \
                || echo "{\"model\": \"$d\", \"error\": true}"
        done | sed "s/^{/{\"config\":\"$label\",/" | tee -a "$OUT/check.jsonl"
    done
}
benches() {
    for cfg in "$@"; do
        read -r label settings <<<"$cfg"
        echo "== llama-3.1-8b shape: $label  (t=${SECONDS}s)"
        env ${settings:-} timeout 120 "$BIN" bench --device cuda --shape llama-3.1-8b --n-prompt 2048 \
            --context 512 --n-gen 128 -r ${REPS:-5} --json 2>&1 | sed "s/^{/{\"config\":\"$label\",/" | tee -a "$OUT/bench_8b.jsonl"
    done
}
# `trellm generate --device cuda` against --device cpu on two fixtures (greedy ids), and the
# GPU tests of the test suite whose binaries were carried in .device/tests/ (scripts/gpu/
# carry_tests.sh puts them there; SRC_ROOT is the checkout they were built in).
echo "== generate --device cuda vs cpu"
for m in llama qwen3; do
    for dev in cpu cuda; do
        echo "$m $dev $("$BIN" generate -M tests/fixtures/tiny/$m --prompt-ids 1,2,3,4,5 -m 24 --json -q --device $dev 2>&1)"
    done
done | tee "$OUT/generate.txt"
echo "== bench --device cuda on a model folder"
"$BIN" bench --device cuda -M tests/fixtures/tiny/llama -p 64 -n 32 -r 3 --json 2>&1 | tee "$OUT/bench_model.json"
for t in .device/tests/*; do
    [ -x "$t" ] || continue
    echo "== test binary $(basename "$t") (carried)"
    # SRC_ROOT: the checkout the binaries were built in (their fixture paths are compiled in).
    src=${SRC_ROOT:-}
    if [ -n "$src" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
    "$t" --test-threads 1 2>&1 | tee "$OUT/test-$(basename "$t").txt" | tail -8
done
checks "${CHECKS_FIRST[@]}"
benches "${BENCHES_FIRST[@]}"
if [ -z "${QUICK:-}" ]; then  # QUICK=1: the default's checks and the two first benches only
    checks "${CHECKS_MORE[@]}"
    benches "${BENCHES_MORE[@]}"
fi
echo "== done (t=${SECONDS}s)"
