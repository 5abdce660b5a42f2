#!/usr/bin/env bash
# `trellm eval` against llama.cpp's llama-perplexity on the same GGUF files and text (the
# wikitext-2 test split, `\r` removed), same threads, CHUNKS chunks of 512:
#   1. perplexity of both default models as shipped: within 1%;
#   2. perplexity of SmolLM2 dequantized exactly to F32 (llama-quantize ... F32), where llama.cpp
#      also runs f32 activations: within 0.1%, and strided (llama's -c 512 --ppl-stride 256 runs
#      chunks of 768) within 0.1%;
#   3. KL divergence of a Q4_K_M SmolLM2 against a Q8_0 one (llama-quantize --allow-requantize from
#      the Q4_1 file): as shipped (reported; llama.cpp rounds activations to 8 bits against these
#      weight types, trellm does not), and on their exact F32 copies, where mean KLD, same top and
#      the PPL ratio must agree within 2% — each tool on its own base file, and trellm on llama's.
# Needs llama.cpp's tools (../shared/peers/build_llamacpp_tools.sh builds them; LLAMA_BIN names
# their folder) and ~2.5 GB in EVAL_WORK. Prints a table; exits non-zero when a number is out of
# its bound. About 20 minutes on 2 busy cores with CHUNKS=20.
#
# Usage: scripts/eval_vs_llama.sh [CHUNKS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
chunks=${1:-20}
threads=${2:-2}
llama=${LLAMA_BIN:-/work/peers/bin}
[ -x "$llama/llama-perplexity" ] || llama=$(../shared/peers/build_llamacpp_tools.sh)
bin=${TRELLM_BIN:-target/release/trellm}
[ -n "${TRELLM_BIN:-}" ] || cargo build --release -q -p trellm
work=${EVAL_WORK:-$(mktemp -d)}
mkdir -p "$work"
text=$work/wiki.test.raw
tr -d '\r' < ../shared/data/wikitext-2-raw-test.raw > "$text"

fail=0
check() { # name ours theirs bound_percent (empty bound: reported only)
  python3 - "$@" <<'PY' || fail=1
import sys
name, ours, theirs, bound = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
d = 100 * (ours / theirs - 1)
ok = not bound or abs(d) <= float(bound)
verdict = f"{'ok' if ok else 'FAIL'} (within {bound}%)" if bound else "reported"
print(f"| {name} | {ours:.6g} | {theirs:.6g} | {d:+.3f}% | {verdict} |")
sys.exit(0 if ok else 1)
PY
}
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
lp() { "$llama/llama-perplexity" -b 512 -t "$threads" "$@" 2>&1; }
llama_ppl() { lp -m "$1" -f "$text" -c 512 --chunks "$chunks" | sed -n 's/.*Final estimate: PPL = \([0-9.]*\).*/\1/p'; }
ours_ppl() { "$bin" eval -q --json --file "$text" --chunks "$chunks" -t "$threads" --model "$@" | field ppl; }
quant() { # src type out
  [ -f "$3" ] || "$llama/llama-quantize" --allow-requantize "$1" "$3" "$2" "$threads" >/dev/null 2>&1
}

echo "| quantity | trellm | llama-perplexity | difference | |"
echo "|---|---|---|---|---|"
for m in smollm2-135m-instruct gemma-3-270m; do
  path=$("$bin" pull "$m" 2>/dev/null | tail -n 1)
  check "PPL $m ($chunks x 512)" "$(ours_ppl "$path")" "$(llama_ppl "$path")" 1
done
src=$("$bin" pull smollm2-135m-instruct 2>/dev/null | tail -n 1)
quant "$src" F32 "$work/smollm2-F32.gguf"
check "PPL SmolLM2 as F32" "$(ours_ppl "$work/smollm2-F32.gguf")" "$(llama_ppl "$work/smollm2-F32.gguf")" 0.1
strided=$(lp -m "$work/smollm2-F32.gguf" -f "$text" -c 512 --ppl-stride 256 --chunks "$chunks" |
  grep -o '\[[0-9]*\][0-9.]*' | tail -n 1 | sed 's/.*\]//')
check "PPL SmolLM2 as F32, stride 256" "$(ours_ppl "$work/smollm2-F32.gguf" --ctx 768 --stride 256)" "$strided" 0.1

kl_pair() { # label ref cand bound
  local label=$1 ref=$2 cand=$3 bound=$4 tag
  tag=$(basename "$ref" .gguf)
  lp -m "$ref" -f "$text" -c 512 --chunks "$chunks" --kl-divergence-base "$work/$tag.llama.bin" >/dev/null
  "$bin" eval -q --json --model "$ref" --file "$text" --chunks "$chunks" -t "$threads" \
    --save-logits "$work/$tag.trellm.bin" >/dev/null
  read -r l_kld l_top l_ratio < <(lp -m "$cand" --kl-divergence --kl-divergence-base "$work/$tag.llama.bin" |
    awk '/^Mean    KLD:/ {k=$3} /^Same top p:/ {s=$4} /^Mean PPL\(Q\)\/PPL\(base\)/ {r=$4} END {print k, s, r}')
  local ours cross
  ours=$("$bin" eval -q --json --model "$cand" --kl-base "$work/$tag.trellm.bin" -t "$threads")
  cross=$("$bin" eval -q --json --model "$cand" --kl-base "$work/$tag.llama.bin" -t "$threads")
  check "mean KLD $label" "$(field kld_mean <<<"$ours")" "$l_kld" "$bound"
  check "same top % $label" "$(python3 -c "print(100*$(field same_top <<<"$ours"))")" "$l_top" "$bound"
  check "PPL ratio $label" "$(field ppl_ratio <<<"$ours")" "$l_ratio" "$bound"
  check "mean KLD $label, trellm on llama's base file" "$(field kld_mean <<<"$cross")" "$l_kld" "$bound"
}
for t in Q8_0 Q4_K_M; do
  quant "$src" "$t" "$work/smollm2-$t.gguf"
  quant "$work/smollm2-$t.gguf" F32 "$work/smollm2-$t-F32.gguf"
done
kl_pair "Q4_K_M vs Q8_0, as shipped" "$work/smollm2-Q8_0.gguf" "$work/smollm2-Q4_K_M.gguf" ""
kl_pair "Q4_K_M vs Q8_0, exact F32 copies" "$work/smollm2-Q8_0-F32.gguf" "$work/smollm2-Q4_K_M-F32.gguf" 2
echo "(files in $work)"
exit $fail
