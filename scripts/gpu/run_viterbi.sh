#!/usr/bin/env bash
# One GPU run of the CUDA tile encoder (issue 15): the bit-identity tests against the CPU encoder
# (every codebook x K, odd tiles, batch sizes), the tiles/s per K, then `trellm quantize` of a
# tiny model on cuda vs cpu (the folders must be byte-identical).
# Build here: the binary stripped to $DEV/trellm, the test binary to $DEV/tests/gpu_viterbi.
# run: DEV=<folder> bash scripts/gpu/run_viterbi.sh   (results in $OUT)
set -u
DEV=${DEV:-.device}
OUT=${OUT:-/tmp/trellm-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TRELLM_CUDA_CACHE=/tmp/trellm-cuda-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# A gzipped binary (to stay under the carry limit beside exllamav3's peer folder) is unpacked.
if [ -f "$DEV/trellm.gz" ] && [ ! -x "$DEV/trellm" ]; then gunzip -c "$DEV/trellm.gz" >"$DEV/trellm" && chmod +x "$DEV/trellm"; fi
# The throughput test's tiles: the ones scripts/gpu/exllamav3_peer.py times exllamav3's quantizer on
# (numpy default_rng(15), 8448 x 256 f32), so both encoders are timed on the same tiles in one run.
if [ -z "${TRELLM_TILES:-}" ] && python3 -c "import numpy" 2>/dev/null; then
    python3 -c "import numpy as np; np.save('/tmp/tiles.npy', np.random.default_rng(15).standard_normal((8448, 256), dtype=np.float32))"
    export TRELLM_TILES=/tmp/tiles.npy
fi
t() { # name, timeout, test binary args...
    local name=$1 limit=$2; shift 2
    echo "== $name  (t=${SECONDS}s)"
    timeout "$limit" "$@" >"$OUT/test-$name.txt" 2>&1
    echo "rc=$?"; grep -E "^test .*(ok|FAILED)$|test result|panicked|differ|tiles_per_s" "$OUT/test-$name.txt" | cut -c1-300 | tail -40
}
t identity 240 $DEV/tests/gpu_viterbi --include-ignored --exact states_and_costs_match_the_cpu --nocapture
t batches 120 $DEV/tests/gpu_viterbi --include-ignored --exact batches_of_any_size_match_one_at_a_time --nocapture
TRELLM_RESULTS="$OUT/viterbi_throughput.jsonl" t throughput 200 $DEV/tests/gpu_viterbi --include-ignored --exact throughput --nocapture
echo "== quantize tiny llama on cuda vs cpu  (t=${SECONDS}s)"
for args in "-b 3" "-b 2 --codebook mcg" "-b 5 --codebook 3inst"; do
    tag=$(echo "$args" | tr -d ' -')
    for dev in cpu cuda; do
        rm -rf "/tmp/q-$tag-$dev"
        s=$SECONDS
        timeout 120 "$DEV/trellm" quantize --model tests/fixtures/tiny/llama --out "/tmp/q-$tag-$dev" \
            --calib-rows 0 $args -q --device $dev >"$OUT/quantize-$tag-$dev.txt" 2>&1
        echo "$args $dev rc=$? $((SECONDS - s))s"
    done
    if cmp "/tmp/q-$tag-cpu/model.safetensors" "/tmp/q-$tag-cuda/model.safetensors" \
        && diff -r -x .checkpoint "/tmp/q-$tag-cpu" "/tmp/q-$tag-cuda" >/dev/null; then
        echo "$args: identical"
    else
        echo "$args: DIFFERENT"
    fi
done 2>&1 | tee "$OUT/quantize.txt"
tail -n +1 "$OUT"/test-*.txt >"$OUT/tests.txt"
rm -f "$OUT"/test-*.txt "$OUT"/quantize-*.txt
echo "== done (t=${SECONDS}s)"
