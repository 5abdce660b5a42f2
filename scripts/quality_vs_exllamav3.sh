#!/usr/bin/env bash
# Our EXL3 SmolLM2 files against exllamav3 1.6.5's own, by its protocol
# (../shared/research/quality-anchors-smollm2.md): calibrated on exllamav3's default corpus mix
# (scripts/exllamav3_calibration.py, read from its wheel), evaluated on its slice of wikitext-2
# (the test file without \r, splitlines(), lines [int(0.6 n):] joined with \n plus a final \n),
# 40 chunks of 512, KL divergence against the Q4_1 file's exact distributions.
#   scripts/quality_vs_exllamav3.sh WORKDIR [BITS...]    (default bits: 4 2 3)
# Needs: target/release/trellm, python3 with tokenizers and numpy, pip (to fetch the wheel).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:?usage: quality_vs_exllamav3.sh WORKDIR [BITS...]}
shift
bits=("$@")
[ ${#bits[@]} -eq 0 ] && bits=(4 2 3)
mkdir -p "$work"
cd "$work"
bin=$repo/target/release/trellm
wheel=$(ls exllamav3-1.6.5-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: -d . exllamav3==1.6.5
    wheel=$(ls exllamav3-1.6.5-*.whl | head -n1)
fi
python3 - "$repo/../shared/data/wikitext-2-raw-test.raw" <<'EOF'
import sys
lines = open(sys.argv[1], encoding="utf8").read().replace("\r", "").splitlines()
open("eval.txt", "w", encoding="utf8").write("\n".join(lines[int(0.6 * len(lines)):]) + "\n")
EOF
# The source as an f32 Hugging Face folder (the tokenizer the corpus script reads).
[ -d src/.source ] || "$bin" quantize --model smollm2-135m-instruct --out src --bits 4 --calib-rows 0 \
    --stop-after-layers 1 -q
python3 "$repo/scripts/exllamav3_calibration.py" "$wheel" src/.source cal.safetensors --rows 250
[ -f base.kld ] || "$bin" eval --model smollm2-135m-instruct --file eval.txt --chunks 40 --save-logits base.kld
for b in "${bits[@]}"; do
    /usr/bin/time -v "$bin" quantize --model src/.source --out "exl3-$b" --bits "$b" \
        --calibration cal.safetensors 2> "quantize-$b.log"
    "$bin" eval --model "exl3-$b" --file eval.txt --chunks 40 --kl-base base.kld --json | tee "eval-$b.json"
done
