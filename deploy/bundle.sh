#!/usr/bin/env bash
# Builds the air-gapped bundle from a built tree (`make bundle` runs it after
# make): one tarball with everything a GPU host without network needs.
#   deploy/bundle.sh [--out DIR] [--nccl auto|off|PATH] [--no-python]
#                    [--no-python-deps] [--debs-from DIR]
# OUT/moe-bundle-VERSION-ARCH.tar.gz holds moe-bundle-VERSION-ARCH/:
#   install-bundle.sh       installs it, no network (deploy/install-bundle.sh)
#   bin/ lib/ base/moe.h README.md docs/ deploy/   the built tree (install.sh)
#   debs/*.deb              the runtime libraries, at this host's versions
#                           (from DIR, .deps/, apt's cache, else apt-get download)
#   nccl/libnccl.so.2       NCCL, when the worker links it (--nccl auto), or PATH
#   wheels/*.whl            the Python client (pip wheel ./python) and NumPy's
#                           wheel (pip download, when it can be had)
#   MANIFEST                what is inside, and what was left out and why
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$ROOT/build
NCCL=auto
PYTHON=1
PYDEPS=1
DEBS_FROM=""
while [ $# -gt 0 ]; do
    case "$1" in
    --out) OUT=$2; shift 2 ;;
    --nccl) NCCL=$2; shift 2 ;;
    --no-python) PYTHON=0; shift ;;
    --no-python-deps) PYDEPS=0; shift ;;
    --debs-from) DEBS_FROM=$2; shift 2 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "bundle.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
# the runtime packages of the daemons, moectl and libmoe.so (Debian 12)
DEBS=(libnng1 libmbedtls14 libmbedx509-1 libmbedcrypto7 libmsgpackc2 libuv1
    libopenblas0 libopenblas0-pthread libgfortran5 libquadmath0)

for f in bin/moe-coordinator bin/moe-worker bin/moectl lib/libmoe.so lib/libmoe.a; do
    [ -f "$ROOT/$f" ] || { echo "bundle.sh: $f is missing: run make first" >&2; exit 1; }
done
VERSION=$(sed -n 's/^#define MOE_VERSION_STRING "\(.*\)"/\1/p' "$ROOT/base/moe.h")
ARCH=$(dpkg --print-architecture 2>/dev/null || uname -m)
NAME=moe-bundle-$VERSION-$ARCH
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGE=$(mktemp -d "$OUT/.bundle-XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
B=$STAGE/$NAME
mkdir -p "$B/debs" "$B/wheels" "$B/base" "$B/deploy/systemd"
notes=()

# the built tree, laid out as deploy/install.sh expects it
cp -a "$ROOT/bin" "$ROOT/lib" "$ROOT/docs" "$ROOT/README.md" "$B/"
rm -f "$B"/bin/check-gpu* "$B"/bin/*bench* "$B"/bin/cuda_ipc_check
cp "$ROOT/base/moe.h" "$B/base/"
cp "$ROOT/deploy/install.sh" "$B/deploy/"
cp "$ROOT"/deploy/systemd/*.service "$ROOT"/deploy/systemd/*.conf "$ROOT"/deploy/systemd/moe.sysusers \
    "$B/deploy/systemd/"
cp "$ROOT/deploy/install-bundle.sh" "$B/"

# runtime .debs at the versions this host built and tested with
for p in "${DEBS[@]}"; do
    v=$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null || true)
    file=""
    for dir in "$DEBS_FROM" "$ROOT/.deps" /var/cache/apt/archives; do
        if [ -z "$dir" ] || [ ! -d "$dir" ]; then continue; fi
        # a file name's version has its epoch colon as %3a
        cand=$(ls "$dir/${p}_${v/:/%3a}_"*.deb 2>/dev/null | head -n1 || true)
        [ -n "$v" ] || cand=$(ls "$dir/${p}_"*.deb 2>/dev/null | head -n1 || true)
        if [ -n "$cand" ]; then file=$cand; break; fi
    done
    if [ -n "$file" ]; then
        cp "$file" "$B/debs/"
    elif (cd "$B/debs" && timeout 120 apt-get download -q "$p${v:+=$v}" >/dev/null 2>&1); then
        :
    else
        echo "bundle.sh: cannot find or download $p${v:+ $v} (put it in .deps/)" >&2
        exit 1
    fi
done

# NCCL: the worker's dynamic NCCL (a CUDA build), from where it resolves
nccl_src=""
case "$NCCL" in
off) notes+=("nccl: left out (--nccl off)") ;;
auto)
    nccl_src=$(ldd "$ROOT/bin/moe-worker" 2>/dev/null | awk '/libnccl\.so/ {print $3; exit}')
    if [ -z "$nccl_src" ]; then
        notes+=("nccl: left out: bin/moe-worker does not link NCCL (a CPU build)")
    fi
    ;;
*) nccl_src=$NCCL ;;
esac
if [ -n "$nccl_src" ]; then
    [ -f "$nccl_src" ] || { echo "bundle.sh: NCCL $nccl_src not found" >&2; exit 1; }
    mkdir -p "$B/nccl"
    cp -L "$nccl_src" "$B/nccl/libnccl.so.2"
    notes+=("nccl: nccl/libnccl.so.2 from $nccl_src")
fi

# the Python client's wheel (libmoe.so inside), and NumPy's
if [ "$PYTHON" = 1 ]; then
    PY=${PYTHON3:-python3}
    # built from a copy: pip writes build/ and *.egg-info next to the sources
    cp -r "$ROOT/python" "$STAGE/python"
    rm -rf "$STAGE/python/build" "$STAGE"/python/*.egg-info
    if MOE_LIB="$ROOT/lib/libmoe.so" "$PY" -m pip wheel -q --no-deps --no-build-isolation \
        -w "$B/wheels" "$STAGE/python" >/dev/null 2>&1 ||
        MOE_LIB="$ROOT/lib/libmoe.so" timeout 300 "$PY" -m pip wheel -q --no-deps \
            -w "$B/wheels" "$STAGE/python" >/dev/null 2>&1; then
        notes+=("python: $(cd "$B/wheels" && ls moe-*.whl)")
    else
        notes+=("python: left out: pip wheel ./python failed (no pip or setuptools)")
        PYDEPS=0
    fi
    if [ "$PYDEPS" = 1 ]; then
        npv=$($PY -c 'import numpy; print(numpy.__version__)' 2>/dev/null || true)
        if timeout 300 "$PY" -m pip download -q --only-binary=:all: --no-deps -d "$B/wheels" \
            "numpy${npv:+==$npv}" >/dev/null 2>&1; then
            notes+=("python: $(cd "$B/wheels" && ls numpy-*.whl) for $($PY -V 2>&1)")
        else
            notes+=("python: numpy's wheel left out: pip download numpy failed (offline?);" \
                "the target needs NumPy installed")
        fi
    else
        notes+=("python: numpy's wheel left out (--no-python-deps)")
    fi
else
    notes+=("python: left out (--no-python)")
fi

backends=$("$ROOT/bin/moe-worker" --version 2>/dev/null | grep '^backends' || echo "backends: ?")
{
    echo "moe $VERSION bundle for $ARCH, built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "binaries: $backends"
    echo "debs:"
    (cd "$B/debs" && ls -1 | sed 's/^/  /')
    for n in "${notes[@]}"; do echo "$n"; done
    echo "install: ./install-bundle.sh --help"
} >"$B/MANIFEST"
tar -C "$STAGE" -cf - "$NAME" | gzip -1 >"$OUT/$NAME.tar.gz.tmp"
mv "$OUT/$NAME.tar.gz.tmp" "$OUT/$NAME.tar.gz"
echo "bundle.sh: $OUT/$NAME.tar.gz ($(du -h "$OUT/$NAME.tar.gz" | cut -f1))"
sed 's/^/  /' "$B/MANIFEST"
