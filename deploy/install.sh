#!/usr/bin/env bash
# Installs a built moe tree (bin/, lib/) under DESTDIR + PREFIX: what
# `make install` runs once the binaries are built; it builds nothing.
#   deploy/install.sh [--prefix /usr/local] [--destdir DIR] [--unitdir DIR]
#                     [--sysusersdir DIR] [--no-units]
# (PREFIX, DESTDIR, UNITDIR, SYSUSERSDIR from the environment work too.)
# Lays out:
#   PREFIX/bin/moe-coordinator moe-worker moectl
#   PREFIX/lib/libmoe.so libmoe.a        PREFIX/include/moe.h
#   UNITDIR/moe-coordinator.service moe-worker@.service  (PREFIX/lib/systemd/system;
#       the units' /usr/local/ paths rewritten to PREFIX)
#   SYSUSERSDIR/moe.conf                 (PREFIX/lib/sysusers.d: the user moe)
#   PREFIX/share/doc/moe/*.md, examples/coordinator.conf worker.conf
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
UNITDIR=${UNITDIR:-}
SYSUSERSDIR=${SYSUSERSDIR:-}
UNITS=1
while [ $# -gt 0 ]; do
    case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --destdir) DESTDIR=$2; shift 2 ;;
    --unitdir) UNITDIR=$2; shift 2 ;;
    --sysusersdir) SYSUSERSDIR=$2; shift 2 ;;
    --no-units) UNITS=0; shift ;;
    -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
case "$PREFIX" in
/*) ;;
*) echo "install.sh: PREFIX must be absolute (got '$PREFIX')" >&2; exit 2 ;;
esac
PREFIX=${PREFIX%/}
UNITDIR=${UNITDIR:-$PREFIX/lib/systemd/system}
SYSUSERSDIR=${SYSUSERSDIR:-$PREFIX/lib/sysusers.d}
D=$DESTDIR

for f in bin/moe-coordinator bin/moe-worker bin/moectl lib/libmoe.so lib/libmoe.a; do
    if [ ! -f "$ROOT/$f" ]; then
        echo "install.sh: $f is missing: run make first" >&2
        exit 1
    fi
done
install -d "$D$PREFIX/bin" "$D$PREFIX/lib" "$D$PREFIX/include" \
    "$D$PREFIX/share/doc/moe/examples"
install -m 0755 "$ROOT/bin/moe-coordinator" "$ROOT/bin/moe-worker" "$ROOT/bin/moectl" \
    "$D$PREFIX/bin/"
install -m 0755 "$ROOT/lib/libmoe.so" "$D$PREFIX/lib/"
install -m 0644 "$ROOT/lib/libmoe.a" "$D$PREFIX/lib/"
install -m 0644 "$ROOT/base/moe.h" "$D$PREFIX/include/"
install -m 0644 "$ROOT/README.md" "$ROOT"/docs/*.md "$D$PREFIX/share/doc/moe/"
install -m 0644 "$ROOT/deploy/systemd/coordinator.conf" "$ROOT/deploy/systemd/worker.conf" \
    "$D$PREFIX/share/doc/moe/examples/"
if [ "$UNITS" = 1 ]; then
    install -d "$D$UNITDIR" "$D$SYSUSERSDIR"
    for u in moe-coordinator.service moe-worker@.service; do
        sed "s|/usr/local/|$PREFIX/|g" "$ROOT/deploy/systemd/$u" >"$D$UNITDIR/$u"
        chmod 0644 "$D$UNITDIR/$u"
    done
    install -m 0644 "$ROOT/deploy/systemd/moe.sysusers" "$D$SYSUSERSDIR/moe.conf"
fi
echo "moe: installed under $D$PREFIX"
if [ "$UNITS" = 1 ] && [ -z "$D" ]; then
    echo "moe: next: systemd-sysusers; put /etc/moe/coordinator.conf and worker.conf" \
        "(examples in $PREFIX/share/doc/moe/examples); systemctl daemon-reload;" \
        "systemctl enable --now moe-coordinator moe-worker@0"
fi
