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

# With nvcc present the tests read the CUDA library's kernel images with
# cuobjdump (tests/test_cuda_images.c). A toolkit installed from NVIDIA's pip
# wheels has no cuobjdump: fetch NVIDIA's cuobjdump wheel into .tools/
# (ignored by git), where the test looks after PATH and /usr/local/cuda/bin.
CUOBJDUMP_WHEEL="nvidia-cuda-cuobjdump==13.5.37"
nvcc_found=$(command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc_found" ] && [ -z "${NO_CUDA:-}" ] &&
    ! command -v cuobjdump >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/cuobjdump ] &&
    [ ! -x .tools/cuobjdump/nvidia/cu13/bin/cuobjdump ]; then
    echo "moe: installing cuobjdump ($CUOBJDUMP_WHEEL) into .tools/cuobjdump"
    if ! python3 -m pip install -q --no-deps --target .tools/cuobjdump "$CUOBJDUMP_WHEEL"; then
        echo "moe: cuobjdump could not be installed; test_cuda_images will fail until" \
            "cuobjdump is on PATH" >&2
    fi
fi
