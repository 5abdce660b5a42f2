#!/usr/bin/env bash
# trellm vs llama.cpp on the same GGUF files, same threads, same run: pp512 and tg128 (median of
# 5 after a warm-up) for each model, and the ratios. llama.cpp runs through llama-cpp-python in a
# local venv (.venv-bench, git-ignored; building it takes ~5 minutes on 2 cores).
#
# Usage: scripts/bench_vs_llamacpp.sh [THREADS] [MODEL_ALIAS...]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
shift || true
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m-instruct gemma-3-270m)
reps=${REPS:-5}

venv=${BENCH_VENV:-.venv-bench}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "llama-cpp-python==0.3.36"
fi
bin=${TRELLM_BIN:-target/release/trellm}
[ -n "${TRELLM_BIN:-}" ] || cargo build --release -q -p trellm

printf '| model | threads | engine | pp512 tok/s | tg128 tok/s |\n|---|---|---|---|---|\n'
for m in "${models[@]}"; do
  path=$("$bin" pull "$m" 2>/dev/null | tail -n 1)
  ours=$("$bin" bench --model "$path" --threads "$threads" -r "$reps" --json)
  peer=$("$venv/bin/python" scripts/llamacpp_bench.py "$path" --threads "$threads" -r "$reps")
  python3 - "$m" "$threads" "$ours" "$peer" <<'PY'
import json, sys
m, t, ours, peer = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
print(f"| {m} | {t} | trellm | {ours['pp_tok_s']:.1f} | {ours['tg_tok_s']:.1f} |")
print(f"| {m} | {t} | {peer['engine']} | {peer['pp_tok_s']:.1f} | {peer['tg_tok_s']:.1f} |")
print(f"| {m} | {t} | ratio | {ours['pp_tok_s'] / peer['pp_tok_s']:.2f}x | {ours['tg_tok_s'] / peer['tg_tok_s']:.2f}x |")
PY
done
