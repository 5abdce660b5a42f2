#!/usr/bin/env bash
# Here-side prep for scripts/gpu/run_exllamav3.sh (issue 15: exllamav3 1.6.5 as a side-by-side peer).
# Writes the carried folder $PEER (default .device/peer, git-ignored):
#   whl/                 exllamav3 1.6.5 + the Requires-Dist wheels the device image lacks (from .device/whl)
#   models/src           a tiny seeded HF Llama (../shared/oracle/tiny_llama.py, 512-token tokenizer, hidden 256,
#                        inter 768, 2 layers), fp16: exllamav3 loads it unquantized (its fp16-noise baseline)
#   models/mul1-4.0      `trellm quantize` of it: 4 bpw MUL1, calibrated (small)
#   models/3inst-3.0     the same at 3 bpw 3INST
#   each models/*/trellm_logits.bin   trellm's (CPU, f32) distributions from `trellm eval --save-logits`
#                        (llama-perplexity's kld-base format: tokens + per scored position 16-nat log-probs)
#   tiles.npy            seeded Gaussian tiles (numpy default_rng(TILE_SEED).standard_normal, f32, N x 256)
# Needs python3 with numpy + safetensors (PY=...; default: a venv at /tmp/peervenv, made if missing).
# run: bash scripts/gpu/prep_exllamav3_peer.sh     (from the repo root)
set -euo pipefail
PEER=${PEER:-.device/peer}
TRELLM=${TRELLM:-.device/peer-tools/trellm}
TOK=${TOK:-../shared/oracle-data/tiny-tokenizer}
TEXT=${TEXT:-../shared/data/wikitext-2-raw-test.raw}
CTX=${CTX:-64}
CHUNKS=${CHUNKS:-4}
TILE_SEED=${TILE_SEED:-15}
TILES=${TILES:-8448}   # 16 waves x 132 blocks x 4 tiles a block (K = 8 in crates/cuda/tests/gpu_viterbi.rs)
PY=${PY:-/tmp/peervenv/bin/python}
if [ ! -x "$PY" ]; then python3 -m venv /tmp/peervenv && /tmp/peervenv/bin/pip install -q numpy safetensors; fi
if [ ! -x "$TRELLM" ]; then mkdir -p "$(dirname "$TRELLM")" && cp target/release/trellm "$TRELLM"; fi
rm -rf "$PEER" && mkdir -p "$PEER/whl" "$PEER/models"
cp .device/whl/*.whl "$PEER/whl/"
# The tiny source model.
"$PY" ../shared/oracle/tiny_llama.py "$TOK" "$PEER/models/src" --seed 7
# Evaluation text: the last lines of the held-out wikitext (the quantizer calibrates on the first 40%).
tail -n 300 "$TEXT" >/tmp/peer-eval.txt
calib=/tmp/peer-calib.txt
head -n 400 "$TEXT" >"$calib"
for spec in "mul1-4.0 4 mul1" "3inst-3.0 3 3inst"; do
    set -- $spec
    "$TRELLM" quantize --model "$PEER/models/src" --out "$PEER/models/$1" --bits "$2" --codebook "$3" \
        --calibration "$calib" --calib-rows 16 --calib-cols 256 -q
    rm -rf "$PEER/models/$1/.checkpoint"
done
for m in src mul1-4.0 3inst-3.0; do
    "$TRELLM" eval -M "$PEER/models/$m" -f /tmp/peer-eval.txt --ctx "$CTX" --chunks "$CHUNKS" --json -q \
        --save-logits "$PEER/models/$m/trellm_logits.bin" | tee "$PEER/models/$m/trellm_eval.json"
done
"$PY" - "$PEER/tiles.npy" "$TILE_SEED" "$TILES" <<'EOF'
import sys, hashlib, numpy as np
path, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = np.random.default_rng(seed).standard_normal((n, 256), dtype=np.float32)
np.save(path, t)
print("tiles", t.shape, "seed", seed, "sha256", hashlib.sha256(t.tobytes()).hexdigest())
EOF
du -sh "$PEER" "$PEER"/*
