# deps-env.sh - sourced from the repository root by the GPU scripts
# (deploy/gpu-cluster.sh, deploy/gpu-kill-test.sh, bench/gpu_*.sh): the
# runtime libraries carried as .deb files in .deps/ (the GPU machines lack
# libnng, libuv, msgpack-c, OpenBLAS) unpacked and put on LD_LIBRARY_PATH.
#
#   . deploy/deps-env.sh && deps_env && echo "unpacked into $MOE_DEPS_DIR"
#
# deps_env: 0 when .deps/ held packages and they were unpacked (into
# /opt/moe-deps, or $TMPDIR/moe-deps where that is not writable:
# MOE_DEPS_DIR says which), 1 when there are none.
deps_env() {
    ls .deps/*.deb >/dev/null 2>&1 || return 1
    MOE_DEPS_DIR=/opt/moe-deps
    mkdir -p "$MOE_DEPS_DIR" 2>/dev/null && [ -w "$MOE_DEPS_DIR" ] ||
        MOE_DEPS_DIR=${TMPDIR:-/tmp}/moe-deps
    mkdir -p "$MOE_DEPS_DIR"
    local f L
    for f in .deps/*.deb; do dpkg -x "$f" "$MOE_DEPS_DIR"; done
    L=$MOE_DEPS_DIR/usr/lib/x86_64-linux-gnu
    export LD_LIBRARY_PATH="$L:$L/openblas-pthread:${LD_LIBRARY_PATH:-}"
    return 0
}
