#!/usr/bin/env bash
# Installs a moe bundle (`make bundle`) with no network. From the unpacked
# bundle directory:
#   ./install-bundle.sh [--prefix DIR] [--unpack] [--python venv|user|off]
#                       [--venv DIR] [--no-units]
#   --prefix   where to install (default /opt/moe as root, else ~/.local/moe)
#   --unpack   as root too: unpack the .debs into PREFIX/deps (dpkg -x)
#              instead of installing them system-wide (dpkg -i)
#   --python   the Python client: into a venv (default PREFIX/venv, with the
#              system's site packages visible), the user's site (pip --user),
#              or not at all; only from the bundle's wheels (pip --no-index)
#   --no-units no systemd units (as root they go to /etc/systemd/system and
#              the user moe to /etc/sysusers.d; never as another user)
# Lays out PREFIX/bin (moe-coordinator, moe-worker, moectl: small wrappers
# that set LD_LIBRARY_PATH and run PREFIX/libexec/moe/*), PREFIX/lib
# (libmoe.so, libnccl.so.2 when bundled), PREFIX/include, PREFIX/deps (the
# unpacked .debs), PREFIX/env.sh (source it for PATH and LD_LIBRARY_PATH:
# Python and programs linking libmoe.so need it when the .debs were
# unpacked), PREFIX/share/doc/moe.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOTUSER=0
[ "$(id -u)" = 0 ] && ROOTUSER=1
if [ "$ROOTUSER" = 1 ]; then PREFIX=/opt/moe; else PREFIX=$HOME/.local/moe; fi
UNPACK=$((1 - ROOTUSER))
PYMODE=venv
VENV=""
UNITS=$ROOTUSER
while [ $# -gt 0 ]; do
    case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --unpack) UNPACK=1; shift ;;
    --python) PYMODE=$2; shift 2 ;;
    --venv) VENV=$2; shift 2 ;;
    --no-units) UNITS=0; shift ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "install-bundle.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
case "$PYMODE" in venv | user | off) ;; *) echo "install-bundle.sh: --python venv|user|off" >&2; exit 2 ;; esac
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
VENV=${VENV:-$PREFIX/venv}
say() { echo "install-bundle: $*"; }

# 1. the runtime libraries
LIBDIRS=""
if ls "$HERE"/debs/*.deb >/dev/null 2>&1; then
    if [ "$UNPACK" = 1 ]; then
        mkdir -p "$PREFIX/deps"
        for f in "$HERE"/debs/*.deb; do dpkg -x "$f" "$PREFIX/deps"; done
        LIBDIRS=$(find "$PREFIX/deps" -name '*.so.*' -printf '%h\n' | sort -u | paste -sd: -)
        say "runtime libraries unpacked into $PREFIX/deps"
    else
        dpkg -i "$HERE"/debs/*.deb >/dev/null
        say "runtime libraries installed (dpkg -i)"
    fi
fi

# 2. binaries, library, header, docs (and units as root)
if [ "$UNITS" = 1 ]; then
    bash "$HERE/deploy/install.sh" --prefix "$PREFIX" --unitdir /etc/systemd/system \
        --sysusersdir /etc/sysusers.d >/dev/null
    systemd-sysusers /etc/sysusers.d/moe.conf 2>/dev/null || say "run systemd-sysusers to create the user moe"
else
    bash "$HERE/deploy/install.sh" --prefix "$PREFIX" --no-units >/dev/null
fi
if [ -f "$HERE/nccl/libnccl.so.2" ]; then
    install -m 0755 "$HERE/nccl/libnccl.so.2" "$PREFIX/lib/"
    ln -sf libnccl.so.2 "$PREFIX/lib/libnccl.so"
fi
LDPATH=$PREFIX/lib${LIBDIRS:+:$LIBDIRS}

# 3. the programs run through wrappers that find the libraries above
mkdir -p "$PREFIX/libexec/moe"
for b in moe-coordinator moe-worker moectl; do
    mv -f "$PREFIX/bin/$b" "$PREFIX/libexec/moe/$b"
    cat >"$PREFIX/bin/$b" <<EOF
#!/bin/sh
# moe bundle wrapper: the bundle's libraries first
LD_LIBRARY_PATH="$LDPATH\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$PREFIX/libexec/moe/$b" "\$@"
EOF
    chmod 0755 "$PREFIX/bin/$b"
done
cat >"$PREFIX/env.sh" <<EOF
# source this: moe's programs on PATH, its libraries for Python and libmoe users
export PATH="$PREFIX/bin:\$PATH"
export LD_LIBRARY_PATH="$LDPATH\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
say "programs in $PREFIX/bin (source $PREFIX/env.sh for PATH and LD_LIBRARY_PATH)"

# 4. the Python client, from the bundle's wheels only
PY=${PYTHON3:-python3}
if [ "$PYMODE" != off ] && ls "$HERE"/wheels/moe-*.whl >/dev/null 2>&1; then
    # pip_in PYTHON [pip options]: the client and its dependencies from the wheels
    pip_in() {
        local py=$1
        shift
        "$py" -m pip install -q --no-index --find-links "$HERE/wheels" "$@" moe
    }
    ok=0
    if [ "$PYMODE" = venv ]; then
        if "$PY" -m venv --system-site-packages "$VENV" >/dev/null 2>&1 && pip_in "$VENV/bin/python"; then
            echo ". \"$PREFIX/env.sh\"" >>"$VENV/bin/activate"
            say "Python client in the venv $VENV (. $VENV/bin/activate)"
            ok=1
        else
            say "no venv ($PY -m venv failed: Debian's python3-venv missing?): trying --user"
            PYMODE=user
        fi
    fi
    if [ "$PYMODE" = user ] && [ "$ok" = 0 ]; then
        if pip_in "$PY" --user 2>/dev/null || pip_in "$PY" --user --break-system-packages; then
            say "Python client in the user's site packages ($PY)"
            ok=1
        fi
    fi
    if [ "$ok" = 0 ]; then
        say "WARNING: the Python client was not installed (NumPy neither in the bundle nor" \
            "on this host? see the bundle's MANIFEST)"
    fi
fi
say "done: $PREFIX"
