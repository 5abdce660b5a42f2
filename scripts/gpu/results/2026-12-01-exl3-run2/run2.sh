#!/usr/bin/env bash
# Device run 2 of branch exl3-gpu: every EXL3 GPU test (incl. the tiny exllamav3 folders), then
# the timing sweep (JSON lines in $OUT/exl3_timing.jsonl).
set -u
D=.device/exl3
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
export TRELLM_EXL3_TINY=$PWD/$D/tiny
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 300 $D/gpu_exl3 --include-ignored --test-threads 1 --skip timing --nocapture > "$OUT/test-gpu_exl3.txt" 2>&1
echo "tests rc=$?"
grep -E "^test |test result|failures|EXL3 layers checked" "$OUT/test-gpu_exl3.txt" | tail -20
TRELLM_RESULTS="$OUT/exl3_timing.jsonl" timeout 240 $D/gpu_exl3 --include-ignored --exact timing --nocapture > "$OUT/timing.txt" 2>&1
echo "timing rc=$?"; tail -3 "$OUT/timing.txt"
echo "== done ${SECONDS}s"
