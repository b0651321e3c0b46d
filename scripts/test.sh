#!/usr/bin/env bash
# Run every test on a fresh machine: installs what is missing (Compose v2, mmdebstrap, the test
# dependencies in .venv), builds the images of the CPU/air-gapped path, then runs pytest against
# the real stack. Arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,4p' "$0" | sed 's/^# //'
    exit 0
fi

phase_started=$(date +%s)
phase() {
    local now; now=$(date +%s)
    echo "== $1 (previous phase took $((now - phase_started))s)" >&2
    phase_started=$now
}
run_started=$phase_started

phase "tools: Docker Compose v2, mmdebstrap"
scripts/install-tools.sh --build

phase "test dependencies (.venv)"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r tests/requirements.txt

phase "images (scripts/build_images.py --variant cpu)"
python3 scripts/build_images.py --variant cpu

phase "tests (pytest)"
export TESTCONTAINERS_RYUK_DISABLED=true
# Each test stack names its own compose project; a name from the shell would override it.
unset COMPOSE_PROJECT_NAME COMPOSE_FILE
status=0
.venv/bin/python -m pytest "$@" || status=$?
phase "done in $(( $(date +%s) - run_started ))s, pytest exit code $status"
exit $status
