#!/usr/bin/env bash
# trellm serve against llama-server (built from the vendored llama.cpp by ../shared/peers/), same
# GGUF, same threads, as many slots as clients, the same clients (scripts/load_clients.py: the
# official openai package, CLIENTS concurrent streaming clients x REQUESTS greedy requests each).
# Each server runs alone on the machine; ROUNDS rounds alternate the two and the best aggregate of
# each is kept (other load only ever slows a run down). Prints each run's JSON and the ratio.
#
# Usage: scripts/bench_server.sh [THREADS] [MODEL_ALIAS]
# Env: CLIENTS=64 REQUESTS=2 MAX_TOKENS=64 PROMPTS=16 ROUNDS=2 CTX_PER_SLOT=256
#      PYTHON (with the openai package; default target/venv-clients/bin/python)
#      PEERS_BIN (llama.cpp's tools; default: built into PEERS_PREFIX=/tmp/trellm-peers)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
model=${2:-smollm2-135m-instruct}
clients=${CLIENTS:-64}
requests=${REQUESTS:-2}
max_tokens=${MAX_TOKENS:-64}
prompts=${PROMPTS:-16}
rounds=${ROUNDS:-2}
ctx=${CTX_PER_SLOT:-256}
py=${PYTHON:-target/venv-clients/bin/python}
peers=${PEERS_BIN:-$(../shared/peers/build_llamacpp_tools.sh "${PEERS_PREFIX:-/tmp/trellm-peers}")}
bin=${TRELLM_BIN:-target/release/trellm}
[ -n "${TRELLM_BIN:-}" ] || cargo build --release -q -p trellm
path=$("$bin" pull "$model" 2>/dev/null | tail -n 1)
port=${PORT:-18437}
if curl -s -o /dev/null "http://127.0.0.1:$port/health"; then
  echo "something already listens on port $port (a server left from an earlier run?)" >&2
  exit 1
fi
pid=""
trap '[ -z "$pid" ] || kill "$pid" 2>/dev/null || true' EXIT

wait_ready() {
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "server did not become ready" >&2
  return 1
}

load() {
  "$py" scripts/load_clients.py "http://127.0.0.1:$port" "$model" --clients "$clients" \
    --requests "$requests" --max-tokens "$max_tokens" --prompts "$prompts" --retries 2
}

ours=""
peer=""
for _ in $(seq "$rounds"); do
  "$bin" serve --model "$path" --served-model-name "$model" --threads "$threads" \
    --max-seqs "$clients" --port "$port" 2>>"${LOG:-/dev/null}" &
  pid=$!
  wait_ready
  ours+=$(load)$'\n'
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true

  "$peers/llama-server" -m "$path" -t "$threads" -np "$clients" -c $((clients * ctx)) \
    --port "$port" >/dev/null 2>>"${LOG:-/dev/null}" &
  pid=$!
  wait_ready
  peer+=$(load)$'\n'
  kill -0 "$pid" 2>/dev/null || echo "llama-server exited during the run" >&2
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
done

python3 - "$threads" "$ours" "$peer" <<'PY'
import json, sys
t, ours, peer = sys.argv[1], sys.argv[2], sys.argv[3]
def best(text):
    runs = [json.loads(l) for l in text.splitlines() if l.strip()]
    return max(runs, key=lambda r: r["aggregate_tok_s"])
o, p = best(ours), best(peer)
print(json.dumps({"engine": "trellm", **o}))
print(json.dumps({"engine": "llama-server", **p}))
print(f"threads {t}: trellm {o['aggregate_tok_s']} tok/s aggregate ({o['ratio']}x its single "
      f"stream {o['single_stream_tok_s']}), llama-server {p['aggregate_tok_s']} "
      f"({p['ratio']}x of {p['single_stream_tok_s']}); trellm / llama-server = "
      f"{o['aggregate_tok_s'] / p['aggregate_tok_s']:.2f}; TTFT p50/p99 trellm "
      f"{o['ttft_p50_s']}/{o['ttft_p99_s']} s, llama-server {p['ttft_p50_s']}/{p['ttft_p99_s']} s")
PY
