#!/usr/bin/env bash
# Device run 1 of branch exl3-gpu: the EXL3 GPU tests, then the timing sweep.
set -u
D=.device/exl3
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
timeout 240 $D/gpu_exl3 --include-ignored --test-threads 1 --skip timing 2>&1 | tee "$OUT/test-gpu_exl3.txt" | tail -30
TRELLM_RESULTS="$OUT/exl3_timing.jsonl" timeout 300 $D/gpu_exl3 --include-ignored --exact timing --nocapture 2>&1 | tail -5 > "$OUT/timing-tail.txt"
cat "$OUT/timing-tail.txt"
echo "== done ${SECONDS}s"
