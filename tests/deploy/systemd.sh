#!/usr/bin/env bash
# The systemd deploy: deploy/install.sh lays out binaries, library, header,
# units, sysusers.d file and docs under a fresh PREFIX; the units are
# Type=notify, run as the user moe, sandboxed; `systemd-analyze verify`
# accepts them (its warnings count as failures) and systemd-sysusers creates
# the user from the sysusers.d file in a scratch root.
# Exit 0 pass, 1 fail, 77 skipped (no systemd-analyze).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
T=$(mktemp -d /tmp/moe-systemd-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() { echo "systemd.sh: FAIL: $*" >&2; exit 1; }

P=$T/prefix
bash "$ROOT/deploy/install.sh" --prefix "$P" >/dev/null
for f in bin/moe-coordinator bin/moe-worker bin/moectl lib/libmoe.so lib/libmoe.a include/moe.h \
    lib/systemd/system/moe-coordinator.service lib/systemd/system/moe-worker@.service \
    lib/sysusers.d/moe.conf share/doc/moe/OPERATIONS.md share/doc/moe/README.md \
    share/doc/moe/examples/coordinator.conf share/doc/moe/examples/worker.conf; do
    [ -e "$P/$f" ] || fail "install.sh did not install $f"
done
[ -x "$P/bin/moe-coordinator" ] || fail "moe-coordinator is not executable"
"$P/bin/moe-coordinator" --help >/dev/null || fail "the installed coordinator does not run"
U=$P/lib/systemd/system
for u in moe-coordinator.service moe-worker@.service; do
    grep -q "^ExecStart=$P/bin/" "$U/$u" || fail "$u: ExecStart not under the PREFIX"
    if grep -q '/usr/local/' "$U/$u"; then fail "$u: a /usr/local/ path left"; fi
    for d in Type=notify NotifyAccess=main User=moe Group=moe StateDirectory=moe \
        ProtectSystem=strict ProtectHome=yes NoNewPrivileges=yes PrivateTmp=yes \
        TimeoutStartSec=infinity WatchdogSec=; do
        grep -q "^$d" "$U/$u" || fail "$u: no $d"
    done
done
# DESTDIR keeps the PREFIX paths in the units (a staged install)
bash "$ROOT/deploy/install.sh" --prefix /usr/local --destdir "$T/stage" >/dev/null
grep -q '^ExecStart=/usr/local/bin/moe-coordinator ' \
    "$T/stage/usr/local/lib/systemd/system/moe-coordinator.service" ||
    fail "DESTDIR install: ExecStart is not /usr/local/bin/moe-coordinator"

if command -v systemd-sysusers >/dev/null; then
    mkdir -p "$T/sysroot/etc"
    systemd-sysusers --root="$T/sysroot" "$P/lib/sysusers.d/moe.conf" >/dev/null 2>&1 ||
        fail "systemd-sysusers refused moe.conf"
    grep -q '^moe:x:[0-9]*:[0-9]*:moe service:/var/lib/moe:' "$T/sysroot/etc/passwd" ||
        fail "systemd-sysusers did not create the user moe"
fi
if ! command -v systemd-analyze >/dev/null; then
    echo "systemd.sh: systemd-analyze not installed (Debian package systemd): verify skipped"
    exit 77
fi
cp "$U/moe-worker@.service" "$U/moe-worker@0.service" # an instance of the template
out=$(cd "$U" && systemd-analyze verify ./moe-coordinator.service ./moe-worker@0.service 2>&1) ||
    fail "systemd-analyze verify: $out"
[ -z "$out" ] || fail "systemd-analyze verify warned: $out"
echo "systemd.sh: ok (installed, units verified)"
