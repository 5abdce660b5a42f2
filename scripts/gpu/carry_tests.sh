#!/usr/bin/env bash
# Builds the binary and the test binaries that exercise a GPU, stripped into .device/ (git-ignored,
# carried to the device machine), for `SRC_ROOT=$PWD bash scripts/gpu/run_cuda.sh` there.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release
mkdir -p .device/tests
strip -o .device/trellm target/release/trellm
for pt in trellm:cuda_vs_cpu trellm-cuda:gpu_dense trellm-cuda:gpu_exl3; do
    pkg=${pt%%:*} t=${pt#*:}
    # The test target's executable (the package's binary is built and listed too).
    bin=$(cargo test --release --no-run --message-format=json -p "$pkg" --test "$t" 2>/dev/null \
        | python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["kind"] == ["test"] and m.get("executable"):
        print(m["executable"])' | tail -n1)
    strip -o ".device/tests/$t" "$bin"
done
ls -la .device .device/tests
