#!/usr/bin/env bash
# The air-gapped bundle: deploy/bundle.sh builds it from this tree,
# it is unpacked into a fresh directory and installed there with
# install-bundle.sh (--unpack: the .debs with dpkg -x into the prefix, never
# system-wide; the Python client into a venv), then a cluster runs from the
# installed prefix alone: a coordinator and one CPU worker, a model created
# and a forward through the bundled moectl (its libraries from the bundle:
# ldd), a forward through the bundled Python client when a venv could be
# made, and a drain. NCCL is in the bundle when the worker links it.
# Exit 0 pass, 1 fail.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
T=$(mktemp -d /tmp/moe-bundle-XXXXXX)
COORD=0
WORKER=0
fail() {
    echo "bundle.sh: FAIL: $*" >&2
    for f in "$T"/*.log; do
        [ -f "$f" ] && { echo "--- $f ---"; tail -n 30 "$f"; } >&2
    done
    exit 1
}
cleanup() {
    for p in "$COORD" "$WORKER"; do
        if [ "$p" -gt 0 ] && kill -0 "$p" 2>/dev/null; then kill -KILL "$p" 2>/dev/null || true; fi
    done
    rm -rf "$T"
}
trap cleanup EXIT

bash "$ROOT/deploy/bundle.sh" --out "$T/out" >"$T/bundle.log" 2>&1 || fail "bundle.sh"
tarball=$(ls "$T"/out/moe-bundle-*.tar.gz)
[ -f "$tarball" ] || fail "no tarball"
mkdir "$T/fresh"
tar -C "$T/fresh" -xzf "$tarball"
B=$(ls -d "$T"/fresh/moe-bundle-*)
for p in libnng1 libuv1 libmsgpackc2 libopenblas0-pthread libmbedtls14; do
    ls "$B/debs/${p}_"*.deb >/dev/null 2>&1 || fail "no $p .deb in the bundle"
done
if ldd "$ROOT/bin/moe-worker" | grep -q libnccl; then
    [ -f "$B/nccl/libnccl.so.2" ] || fail "the worker links NCCL, the bundle has none"
fi
ls "$B"/wheels/moe-*.whl >/dev/null 2>&1 || echo "bundle.sh: note: no Python wheel: $(grep python "$B/MANIFEST")"

P=$T/prefix
# the install runs from the unpacked copy only: no network, no source tree
(cd "$T" && env -u LD_LIBRARY_PATH "$B/install-bundle.sh" --prefix "$P" --unpack --no-units \
    >"$T/install.log" 2>&1) || fail "install-bundle.sh"
for f in bin/moe-coordinator bin/moe-worker bin/moectl libexec/moe/moe-worker lib/libmoe.so \
    include/moe.h env.sh share/doc/moe/OPERATIONS.md; do
    [ -e "$P/$f" ] || fail "install-bundle.sh did not install $f"
done
if [ -f "$B/nccl/libnccl.so.2" ]; then [ -f "$P/lib/libnccl.so.2" ] || fail "NCCL not installed"; fi
libpath=$(. "$P/env.sh" && echo "$LD_LIBRARY_PATH")
nng=$(LD_LIBRARY_PATH=$libpath ldd "$P/libexec/moe/moectl" | awk '/libnng/ {print $3}')
case "$nng" in "$P"/deps/*) ;; *) fail "moectl's libnng is $nng, not the bundle's" ;; esac

# a cluster from the prefix
cd "$T"
env -u LD_LIBRARY_PATH "$P/bin/moe-coordinator" --listen tcp://127.0.0.1:0 --addr-file "$T/addr" \
    --workers 1 --cluster-secret-file "$T/secret" >"$T/coord.log" 2>&1 &
COORD=$!
for ((i = 0; i < 600; i++)); do
    [ -s "$T/addr" ] && break
    kill -0 "$COORD" 2>/dev/null || fail "the coordinator exited"
    sleep 0.1
done
URL=$(cat "$T/addr")
env -u LD_LIBRARY_PATH "$P/bin/moe-worker" --coordinator "$URL" --cluster-secret-file "$T/secret" \
    --backend cpu --threads 1 >"$T/worker.log" 2>&1 &
WORKER=$!
moectl() { env -u LD_LIBRARY_PATH "$P/bin/moectl" --url "$URL" --timeout-ms 10000 "$@"; }
for ((i = 0; i < 600; i++)); do
    moectl status 2>/dev/null | grep -q '"ready": true' && break
    kill -0 "$WORKER" 2>/dev/null || fail "the worker exited"
    sleep 0.2
done
moectl status | grep -q '"ready": true' || fail "the cluster did not become ready"
moectl create --name m --layers 1 --d-model 16 --d-ff 32 --experts 4 --top-k 2 >/dev/null ||
    fail "create through the bundled moectl"
moectl forward --model m --tokens 8 >"$T/forward.out" || fail "forward through the bundled moectl"
grep -q "imbalance" "$T/forward.out" || fail "forward printed no stats"

if [ -x "$P/venv/bin/python" ]; then
    (. "$P/env.sh" && "$P/venv/bin/python" - "$URL" "$P" <<'EOF') || fail "Python forward from the venv"
import sys
import numpy as np
import moe
url, prefix = sys.argv[1], sys.argv[2]
assert moe.lib_path.startswith(prefix), moe.lib_path
c = moe.Client(url)
y, _ = c.forward("m", 0, np.ones((4, 16), np.float32))
assert y.shape == (4, 16), y.shape
c.close()
print("python forward ok:", moe.lib_path)
EOF
else
    echo "bundle.sh: note: no venv: $(grep -i python "$T/install.log" || true)"
fi

moectl drain >/dev/null || fail "drain"
for ((i = 0; i < 600; i++)); do
    kill -0 "$COORD" 2>/dev/null || break
    sleep 0.1
done
kill -0 "$COORD" 2>/dev/null && fail "the coordinator did not exit after the drain"
rc=0
wait "$COORD" || rc=$?
COORD=0
[ "$rc" = 0 ] || fail "the coordinator exited $rc after the drain"
kill -TERM "$WORKER"
rc=0
wait "$WORKER" || rc=$?
WORKER=0
[ "$rc" = 0 ] || fail "the worker exited $rc after SIGTERM"
echo "bundle.sh: ok ($(basename "$tarball"), $(du -h "$tarball" | cut -f1))"
