#!/usr/bin/env bash
# trellm quantize's EXL3 files beside llama.cpp's imatrix K-quants of the same model, by the protocol of
# BENCHMARKS.md's `trellm quantize` section (and ../shared/research/quality-anchors-smollm2.md):
#   - reference: the model's GGUF as shipped (its exactly dequantized weights);
#   - calibration: the first 40% of the lines of wikitext-2's test file (`\r` removed, split on `\n`):
#     trellm quantize's default, and the text llama-imatrix (-c 512) runs over, on the reference GGUF;
#   - K-quants: llama-quantize --imatrix from an F32 copy of the reference (llama-quantize
#     --allow-requantize ... F32: its exact dequantization). Not --allow-requantize from the reference
#     itself: llama-quantize copies a tensor whose type is already the target's (gemma's Q4_K_M to
#     Q4_K_M would come out as the shipped file, no importance matrix applied);
#   - evaluation: lines [2313:] of the same split (the last 20%), joined with `\n`, 40 chunks of 512,
#     trellm eval with KL divergence against the reference's saved distributions;
#   - size: scripts/block_linear_bits.py (everything stored for q/k/v/o/gate/up/down over their weights).
#
#   scripts/quality_vs_kquants.sh WORKDIR MODEL THREADS [BITS...]
#   e.g. scripts/quality_vs_kquants.sh /work/q gemma-3-270m 2 2 3 4
# Long steps run under nice; each step is skipped when its output exists (rerun to resume). Prints a
# Markdown table: file, bits per block-linear weight, PPL, mean KLD, same top, wall time / max RSS.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:?usage: quality_vs_kquants.sh WORKDIR MODEL THREADS [BITS...]}
model=${2:?}
threads=${3:?}
shift 3
bin=${TRELLM_BIN:-$repo/target/release/trellm}
llama=${LLAMA_BIN:-$("$repo/../shared/peers/build_llamacpp_tools.sh")}
wiki=$repo/../shared/data/wikitext-2-raw-test.raw
mkdir -p "$work"
cd "$work"
python3 - "$wiki" <<'PY'
import sys
lines = open(sys.argv[1], encoding="utf-8").read().replace("\r", "").split("\n")
open("calib.txt", "w", encoding="utf-8").write("\n".join(lines[: int(0.4 * len(lines))]))
open("heldout.txt", "w", encoding="utf-8").write("\n".join(lines[2313:]))
PY
src=$("$bin" pull "$model" | tail -1)
run() { nice -n 19 /usr/bin/time -v "$@"; }
[ -f imatrix.gguf ] || run "$llama/llama-imatrix" -m "$src" -f calib.txt -o imatrix.gguf -c 512 \
    -t "$threads" > imatrix.log 2>&1
[ -f f32.gguf ] || run "$llama/llama-quantize" --allow-requantize "$src" f32.gguf F32 "$threads" \
    > f32.log 2>&1
names=()
for t in Q2_K Q3_K_M Q4_K_M; do
    f=$model-$t.gguf
    [ -f "$f" ] || run "$llama/llama-quantize" --imatrix imatrix.gguf f32.gguf "$f" "$t" "$threads" \
        > "quant-$t.log" 2>&1
    names+=("$f")
done
for b in "$@"; do
    d=$model-exl3-$b
    [ -f "$d/config.json" ] || run "$bin" quantize --model "$model" --out "$d" --bits "$b" \
        --threads "$threads" > "quant-$b.log" 2>&1
    names+=("$d")
done
[ -f base.kld ] || run "$bin" eval --model "$model" --file heldout.txt --chunks 40 \
    --save-logits base.kld --threads "$threads" --json > base.json 2> base.log
for m in "${names[@]}"; do
    n=$(basename "$m")
    [ -s "eval-$n.json" ] || run "$bin" eval --model "$m" --kl-base base.kld --file heldout.txt \
        --threads "$threads" --json > "eval-$n.json" 2> "eval-$n.log"
done
python3 - "$repo/scripts/block_linear_bits.py" "${names[@]}" <<'PY'
import json, re, subprocess, sys
base = json.load(open("base.json"))
print(f"reference PPL {base['ppl']:.4f} ({base['tokens']} tokens)\n")
print("| file | bits per block-linear weight | PPL | mean KLD | same top | make: wall / max RSS |")
print("|---|---|---|---|---|---|")
for m in sys.argv[2:]:
    bits = subprocess.run([sys.executable, sys.argv[1], m], capture_output=True, text=True).stdout.split("\t")[1].split()[0]
    e = json.load(open(f"eval-{m.split('/')[-1]}.json"))
    t = m.split("-")[-1].removesuffix(".gguf")
    log = open(f"quant-{t}.log", errors="replace").read()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", log)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    made = f"{wall.group(1)} / {int(rss.group(1)) / 1e6:.2f} GB" if wall and rss else ""
    print(f"| {m} | {bits} | {e['ppl']:.2f} | {e['kld_mean']:.4g} ± {e['kld_err']:.2g} | {100 * e['same_top']:.1f}% | {made} |")
PY
