#!/usr/bin/env bash
# `trellm eval` against llama.cpp's llama-perplexity on the same GGUF files and text (the
# wikitext-2 test split, `\r` removed), same threads:
#   1. perplexity (ctx 512, CHUNKS chunks) of each model: must agree within 1%;
#   2. KL divergence of a Q4_K_M SmolLM2 against a Q8_0 one (both made by llama-quantize from the
#      Q4_1 file): mean KLD and same-top of each tool on its own base file must agree within 2%,
#      and each tool also reads the other's base file (the format is the same).
# Needs llama.cpp's tools (../shared/peers/build_llamacpp_tools.sh builds them; LLAMA_BIN names
# their folder). Prints a table; exits non-zero when a number is out of its bound.
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
check() { # name ours theirs bound_percent
  python3 - "$@" <<'PY' || fail=1
import sys
name, ours, theirs, bound = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
d = 100 * (ours / theirs - 1)
ok = abs(d) <= bound
print(f"| {name} | {ours:.6g} | {theirs:.6g} | {d:+.3f}% | {'ok' if ok else 'FAIL'} (within {bound:g}%) |")
sys.exit(0 if ok else 1)
PY
}
llama_ppl() { # model -> "Final estimate" PPL
  "$llama/llama-perplexity" -m "$1" -f "$text" -c 512 -b 512 --chunks "$chunks" -t "$threads" 2>&1 |
    sed -n 's/^Final estimate: PPL = \([0-9.]*\).*/\1/p'
}
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

echo "| quantity | trellm | llama-perplexity | difference | |"
echo "|---|---|---|---|---|"
for m in smollm2-135m-instruct gemma-3-270m; do
  path=$("$bin" pull "$m" 2>/dev/null | tail -n 1)
  ours=$("$bin" eval -q --json --model "$path" --file "$text" --ctx 512 --chunks "$chunks" -t "$threads" | field ppl)
  check "PPL $m ($chunks x 512)" "$ours" "$(llama_ppl "$path")" 1
done

src=$("$bin" pull smollm2-135m-instruct 2>/dev/null | tail -n 1)
for t in Q8_0 Q4_K_M; do
  [ -f "$work/smollm2-$t.gguf" ] ||
    "$llama/llama-quantize" --allow-requantize "$src" "$work/smollm2-$t.gguf" "$t" "$threads" >/dev/null 2>&1
done
ref=$work/smollm2-Q8_0.gguf cand=$work/smollm2-Q4_K_M.gguf
"$llama/llama-perplexity" -m "$ref" -f "$text" -c 512 -b 512 --chunks "$chunks" -t "$threads" \
  --kl-divergence-base "$work/base.llama.bin" >/dev/null 2>&1
"$bin" eval -q --json --model "$ref" --file "$text" --chunks "$chunks" -t "$threads" \
  --save-logits "$work/base.trellm.bin" >/dev/null
llama_kl() { # base file -> "mean_kld same_top% ppl_ratio"
  "$llama/llama-perplexity" -m "$cand" -b 512 -t "$threads" --kl-divergence \
    --kl-divergence-base "$1" 2>&1 |
    awk '/^Mean    KLD:/ {k=$3} /^Same top p:/ {s=$4} /^Mean PPL\(Q\)\/PPL\(base\)/ {r=$4} END {print k, s, r}'
}
read -r l_kld l_top l_ratio < <(llama_kl "$work/base.llama.bin")
read -r lx_kld _ _ < <(llama_kl "$work/base.trellm.bin")
ours=$("$bin" eval -q --json --model "$cand" --kl-base "$work/base.trellm.bin" -t "$threads")
cross=$("$bin" eval -q --json --model "$cand" --kl-base "$work/base.llama.bin" -t "$threads")
check "mean KLD, Q4_K_M vs Q8_0, each tool's own base" "$(field kld_mean <<<"$ours")" "$l_kld" 2
check "same top %, each tool's own base" "$(python3 -c "print(100*$(field same_top <<<"$ours"))")" "$l_top" 2
check "mean KLD, both on llama's base file" "$(field kld_mean <<<"$cross")" "$l_kld" 2
check "mean KLD, both on trellm's base file" "$(field kld_mean <<<"$ours")" "$lx_kld" 2
check "PPL(Q4_K_M)/PPL(Q8_0)" "$(field ppl_ratio <<<"$ours")" "$l_ratio" 1
echo "(files in $work)"
exit $fail
