#!/usr/bin/env bash
# Installs NVRTC 13.0 and the CUDA headers from pinned pip wheels into a venv under target/, so
# that `cargo test -p trellm-cuda --test nvrtc_kernels` can compile every kernel for sm_90a on a
# machine without a GPU or a CUDA toolkit. Prints the variables to export (eval-able):
#
#   eval "$(scripts/ci_nvrtc_setup.sh)"
#   cargo test --release -p trellm-cuda --test nvrtc_kernels
#
# NVRTC 13.0.88 matches the GPU machines' driver and toolkit (CUBIN and PTX from it load there).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/target/nvrtc-venv"
NVRTC_VERSION=13.0.88
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "nvidia-cuda-nvrtc==$NVRTC_VERSION" \
    "nvidia-cuda-runtime==13.0.*" \
    "nvidia-cuda-crt==13.0.*" >&2
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
lib="$(ls -d "$site"/nvidia/cu13/lib 2>/dev/null || true)"
inc="$(ls -d "$site"/nvidia/cu13/include 2>/dev/null || true)"
nvrtc="$(ls "$lib"/libnvrtc.so.* 2>/dev/null | grep -v builtins | head -n1 || true)"
if [ -z "$nvrtc" ]; then
    echo "libnvrtc not found under $site/nvidia" >&2
    exit 1
fi
echo "export TRELLM_NVRTC=$nvrtc"
echo "export TRELLM_CUDA_INCLUDE=$inc"
# NVRTC 13.0.88 dlopens libnvrtc-builtins by name; the test preloads it from TRELLM_NVRTC's
# folder, and this makes other tools find it too.
echo "export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
