#!/usr/bin/env bash
# exllamav3 1.6.5 beside trellm on the GPU machine (issue 15): (A) it loads folders our quantizer wrote and its
# logits are compared with trellm's, (B) its CUDA tile quantizer's tiles/s and MSE per K (MUL1) on seeded
# Gaussian tiles. Prep here: bash scripts/gpu/prep_exllamav3_peer.sh (writes .device/peer, git-ignored).
# run (device, .device/peer carried): bash scripts/gpu/run_exllamav3.sh   (results in $OUT/exl3peer.*)
# Compiling its CUDA extension takes ~5 minutes at the first import (300 s on 2026-12-02; a bare machine each
# call); the parts after it ~10 s. Writes 3 files to $OUT (EXL3PEER_TENSORS=0: 2, no 12 MB tensors file).
set -u
PEER=${PEER:-.device/peer}
OUT=${OUT:-/tmp/exl3peer-out}
mkdir -p "$OUT"
s=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$PEER"/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "== exllamav3 peer: wheels installed in $((SECONDS - s))s"
timeout "${EXL3PEER_TIMEOUT:-560}" python3 scripts/gpu/exllamav3_peer.py --peer "$PEER" --out "$OUT" 2>&1 \
    | tee "$OUT/exl3peer.log"
echo "== exllamav3 peer: rc=${PIPESTATUS[0]} in $((SECONDS - s))s"
