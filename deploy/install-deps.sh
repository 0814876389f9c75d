#!/usr/bin/env bash
# Installs the Debian packages moe needs, only those missing.
set -euo pipefail
need=()
for p in build-essential libuv1-dev libnng-dev libmsgpack-dev libcriterion-dev libopenblas-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
[ ${#need[@]} -eq 0 ] && exit 0
echo "moe: installing ${need[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
