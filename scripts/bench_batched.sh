#!/usr/bin/env bash
# trellm bench --batch vs llama.cpp's llama-batched-bench on the same GGUF files, same threads,
# same run (-npp 128 -ntg 128 by default): S_TG per batch size B and the ratio. Each engine runs
# ROUNDS times, alternating, and the best S_TG of each is kept (the box is shared: other load only
# ever slows a run down). llama.cpp's tools are built by ../shared/peers/ into PEERS_PREFIX
# (git-ignored; ~6 minutes on 2 cores the first time).
#
# Usage: scripts/bench_batched.sh [THREADS] [MODEL_ALIAS...]
# Env: BATCH=1,2,4,8,16  NPP=128  NTG=128  ROUNDS=2  PEERS_PREFIX=/tmp/trellm-peers
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
shift || true
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m-instruct gemma-3-270m)
batch=${BATCH:-1,2,4,8,16}
npp=${NPP:-128}
ntg=${NTG:-128}
rounds=${ROUNDS:-2}

peers=${PEERS_BIN:-$(../shared/peers/build_llamacpp_tools.sh "${PEERS_PREFIX:-/tmp/trellm-peers}")}
bin=${TRELLM_BIN:-target/release/trellm}
[ -n "${TRELLM_BIN:-}" ] || cargo build --release -q -p trellm

for m in "${models[@]}"; do
  path=$("$bin" pull "$m" 2>/dev/null | tail -n 1)
  ours=""
  peer=""
  for _ in $(seq "$rounds"); do
    ours+=$("$bin" bench --model "$path" --threads "$threads" --batch "$batch" \
      --n-prompt "$npp" --n-gen "$ntg" --json)$'\n'
    peer+=$("$peers/llama-batched-bench" -m "$path" -t "$threads" -tb "$threads" \
      -npp "$npp" -ntg "$ntg" -npl "$batch" --output-format jsonl 2>/dev/null \
      | grep '^{')$'\n'
  done
  python3 - "$m" "$threads" "$ours" "$peer" <<'PY'
import json, sys
m, t = sys.argv[1], sys.argv[2]
def best(text, key_b, key_s):
    out = {}
    for line in text.splitlines():
        if line.strip():
            d = json.loads(line)
            b = d[key_b]
            out[b] = max(out.get(b, 0.0), d[key_s])
    return out
ours = best(sys.argv[3], "b", "s_tg")
peer = best(sys.argv[4], "pl", "speed_tg")
print(f"{m}, {t} threads: S_TG tok/s (best of the rounds)")
print("| B | trellm | llama-batched-bench | ratio |\n|---|---|---|---|")
for b in sorted(ours):
    print(f"| {b} | {ours[b]:.1f} | {peer.get(b, float('nan')):.1f} | {ours[b] / peer[b]:.2f}x |")
PY
done
