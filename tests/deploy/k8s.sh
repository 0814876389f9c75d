#!/usr/bin/env bash
# The Kubernetes deploy: deploy/Dockerfile linted without docker
# (check_dockerfile.py), deploy/k8s/moe.yaml checked for consistency
# (check_k8s.py, needs PyYAML) and against the Kubernetes schemas
# (kubernetes-validate --strict, from PyPI: pip install kubernetes-validate).
# Exit 0 pass, 1 fail, 77 when the manifest checks could not run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/tests/deploy
python3 "$HERE/check_dockerfile.py" "$ROOT"
skipped=()
if python3 -c 'import yaml' 2>/dev/null; then
    python3 "$HERE/check_k8s.py" "$ROOT/deploy/k8s/moe.yaml"
else
    skipped+=("check_k8s.py (no PyYAML)")
fi
if command -v kubernetes-validate >/dev/null; then
    kubernetes-validate --strict --quiet "$ROOT/deploy/k8s/moe.yaml"
    echo "k8s.sh: kubernetes-validate --strict: ok"
else
    skipped+=("kubernetes-validate (pip install kubernetes-validate)")
fi
if [ ${#skipped[@]} -gt 0 ]; then
    echo "k8s.sh: Dockerfile ok; not installed, skipped: ${skipped[*]}"
    exit 77
fi
echo "k8s.sh: ok"
