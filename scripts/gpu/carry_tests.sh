#!/usr/bin/env bash
# Builds the binary and the test binaries that exercise a GPU, stripped into .device/ (git-ignored,
# carried to the device machine), for `SRC_ROOT=$PWD bash scripts/gpu/run_cuda.sh` there.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release
mkdir -p .device/tests
strip -o .device/trellm target/release/trellm
for pt in trellm:cuda_vs_cpu trellm-cuda:gpu_dense; do
    pkg=${pt%%:*} t=${pt#*:}
    bin=$(cargo test --release --no-run --message-format=json -p "$pkg" --test "$t" 2>/dev/null \
        | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n1)
    strip -o ".device/tests/$t" "$bin"
done
ls -la .device .device/tests
