#!/usr/bin/env bash
# One GPU run of the CUDA backend: a smoke run of the tiny shape, the GPU-against-CPU check on
# every tiny fixture, the Llama-3.1-8B-shape benchmark (twice, for the run-to-run spread) and its
# batched steps (B = 1..64, as llama-batched-bench), and
# the GPU tests whose binaries scripts/gpu/carry_tests.sh put in .device/tests (with --ignored).
# Results go to $OUT.   run: bash scripts/gpu/run_cuda.sh   (binary at .device/trellm, carried;
# DEV=<folder> for binaries carried elsewhere)
set -u
DEV=${DEV:-.device}
BIN=${BIN:-$DEV/trellm}
OUT=${OUT:-/tmp/trellm-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
# NCCL for tensor parallelism: cudarc loads libnccl.so; the image has libnccl.so.2 (system or the
# nvidia-nccl wheel). NVLink multicast stays off (the device's rules).
export NCCL_NVLS_ENABLE=0
if ! ldconfig -p | grep -q 'libnccl.so '; then
    lib=$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')
    [ -n "$lib" ] || lib=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib/libnccl.so.2")' 2>/dev/null)
    mkdir -p /tmp/trellm-nccl && ln -sf "$lib" /tmp/trellm-nccl/libnccl.so
    export LD_LIBRARY_PATH=/tmp/trellm-nccl:$LD_LIBRARY_PATH
fi
gpus=$(nvidia-smi -L | wc -l)
# Tests that need two GPUs are skipped, and say so, on a one-GPU machine.
skip_multi=()
if [ "$gpus" -lt 2 ]; then skip_multi=(--skip multi_gpu); echo "one GPU: multi_gpu tests skipped"; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
echo "== tiny shape"
timeout 120 "$BIN" bench --device cuda --shape tiny --n-prompt 64 --context 32 --n-gen 16 -r 2 --json 2>&1 | tee "$OUT/tiny.json"

checks() {
    echo "== checks (CUDA vs CPU, 32 greedy steps)  (t=${SECONDS}s)"
    for d in tests/fixtures/tiny/*/; do
        timeout 120 "$BIN" bench --device cuda --check --model "$d" --n-gen 32 2>&1 \
            || echo "{\"model\": \"$d\", \"error\": true}"
    done | tee -a "$OUT/check.jsonl"
}
benches() {
    for label in "$@"; do
        echo "== llama-3.1-8b shape: $label  (t=${SECONDS}s)"
        timeout 120 "$BIN" bench --device cuda --shape llama-3.1-8b --n-prompt 2048 \
            --context 512 --n-gen 128 -r ${REPS:-5} --json 2>&1 | sed "s/^{/{\"config\":\"$label\",/" | tee -a "$OUT/bench_8b.jsonl"
    done
}
# `trellm generate --device cuda` against --device cpu on two fixtures (greedy ids), and the
# GPU tests of the test suite whose binaries were carried in $DEV/tests/ (scripts/gpu/
# carry_tests.sh puts them there; SRC_ROOT is the checkout they were built in).
echo "== generate --device cuda vs cpu"
for m in llama qwen3; do
    for dev in cpu cuda; do
        echo "$m $dev $("$BIN" generate -M tests/fixtures/tiny/$m --prompt-ids 1,2,3,4,5 -m 24 --json -q --device $dev 2>&1)"
    done
done | tee "$OUT/generate.txt"
echo "== bench --device cuda on a model folder"
"$BIN" bench --device cuda -M tests/fixtures/tiny/llama -p 64 -n 32 -r 3 --json 2>&1 | tee "$OUT/bench_model.json"
"$BIN" bench --device cuda -M tests/fixtures/tiny/llama --batch 1,4,16 -p 32 -n 16 --json 2>&1 | tee -a "$OUT/bench_model.json"
for t in "$DEV"/tests/*; do
    [ -x "$t" ] || continue
    echo "== test binary $(basename "$t") (carried)"
    # SRC_ROOT: the checkout the binaries were built in (their fixture paths are compiled in).
    src=${SRC_ROOT:-}
    if [ -n "$src" ] && [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
    "$t" --include-ignored --test-threads 1 "${skip_multi[@]}" 2>&1 | tee "$OUT/test-$(basename "$t").txt" | tail -8
done
checks
benches default default_again
echo "== llama-3.1-8b shape, batched (as llama-batched-bench)  (t=${SECONDS}s)"
timeout 300 "$BIN" bench --device cuda --shape llama-3.1-8b --batch ${BATCHES:-1,2,4,8,16,32,64} -p 512 -n 128 \
    --json 2>&1 | tee "$OUT/batched_8b.jsonl"
if [ "$gpus" -ge 2 ]; then
    # Tensor parallelism (issue 16): batch-1 decode of the 8B shape on 1 and 2 GPUs, and the 70B
    # shape (141 GB in bf16) over every GPU; T_TG / 128 is the time per token.
    echo "== tensor parallelism  (t=${SECONDS}s)"
    for tp in 1 2; do
        timeout 300 "$BIN" bench --device cuda --shape llama-3.1-8b --batch 1,8 -p 512 -n 128 \
            --tensor-parallel $tp --json 2>&1 | sed "s/^{/{\"tp\":$tp,/" | tee -a "$OUT/tp.jsonl"
    done
    timeout 500 "$BIN" bench --device cuda --shape llama-3.1-70b --batch 1,8 -p 512 -n 64 \
        --tensor-parallel "$gpus" --json 2>&1 | sed "s/^{/{\"tp\":$gpus,\"shape\":\"70b\",/" | tee -a "$OUT/tp.jsonl"
fi
echo "== done (t=${SECONDS}s)"
