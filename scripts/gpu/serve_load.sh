#!/usr/bin/env bash
# `trellm serve --device cuda` under concurrent load on the GPU machine: a synthetic llama folder
# (random bf16 weights, scripts/gpu/synthetic_hf.py; SHAPE_ARGS to change its shape), then
# scripts/gpu/serve_load.py (prompts as token ids; the standard library's HTTP client) at each
# CLIENTS count: one stream alone against all clients at once. Results in $OUT/serve_load.jsonl.
#   run: bash scripts/gpu/serve_load.sh   (binary at .device/trellm, carried)
set -u
DEV=${DEV:-.device}
BIN=${BIN:-$DEV/trellm}
OUT=${OUT:-/tmp/trellm-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
model=/tmp/trellm-synthetic-llama
[ -f "$model/model.safetensors" ] || python3 scripts/gpu/synthetic_hf.py "$model" ${SHAPE_ARGS:-} 2>&1 | tail -1
port=18555
"$BIN" serve --device cuda --model "$model" --max-seqs "${MAX_SEQS:-64}" --kv-memory 16G \
    --port "$port" 2>"$OUT/serve_log.txt" &
pid=$!
for _ in $(seq 600); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health')" \
        2>/dev/null && break
    sleep 0.5
done
for c in ${CLIENTS:-8 32 64}; do
    echo "== $c clients  (t=${SECONDS}s)"
    timeout 300 python3 scripts/gpu/serve_load.py "$port" --clients "$c" --requests 2 \
        --prompt-len 128 --max-tokens 128 2>&1 | tee -a "$OUT/serve_load.jsonl"
done
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
    >"$OUT/serve_metrics.txt" 2>&1
kill "$pid"; wait "$pid"
echo "serve exit: $?  (t=${SECONDS}s)"
