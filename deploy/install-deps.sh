#!/usr/bin/env bash
# Installs the Debian packages moe needs, only those missing.
set -euo pipefail
need=()
for p in build-essential libuv1-dev libnng-dev libmsgpack-dev libcriterion-dev libopenblas-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "moe: installing ${need[*]}"
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

# A build with CUDA (the Makefile passes MOE_CUDA=1 when it compiles the
# CUDA sources) has its kernel images read by tests/unit/test_cuda_images.c with
# cuobjdump. A toolkit installed from NVIDIA's pip wheels has none: fetch
# NVIDIA's cuobjdump wheel into .tools/ (ignored by git), the last place on
# the test's search path (PATH, /usr/local/cuda/bin, .tools/cuobjdump/...).
CUOBJDUMP_WHEEL="nvidia-cuda-cuobjdump==13.5.37"
CUOBJDUMP_PATH="$PATH:/usr/local/cuda/bin:.tools/cuobjdump/nvidia/cu13/bin"
if [ "${MOE_CUDA:-0}" = 1 ] && ! PATH="$CUOBJDUMP_PATH" command -v cuobjdump >/dev/null 2>&1; then
    echo "moe: installing cuobjdump ($CUOBJDUMP_WHEEL) into .tools/cuobjdump"
    if ! python3 -m pip install -q --no-deps --target .tools/cuobjdump "$CUOBJDUMP_WHEEL"; then
        echo "moe: cuobjdump could not be installed; test_cuda_images will fail until" \
            "cuobjdump is on PATH" >&2
    fi
fi
