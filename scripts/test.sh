#!/usr/bin/env bash
# Run every test on a fresh machine: installs what is missing (Compose v2, mmdebstrap, .venv with the
# llmstack package), checks lint, format and types, builds the images of the CPU/air-gapped path,
# prints what differs between the shipped and the tested versions, then runs pytest against the real
# stack. Arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    echo "usage: scripts/test.sh [PYTEST ARGS...]"
    echo
    sed -n '2,5p' "$0" | sed 's/^# //'
    exit 0
fi

phase_started=$(date +%s)
phase() {
    local now; now=$(date +%s)
    echo "== $1 (previous phase took $((now - phase_started))s)" >&2
    phase_started=$now
}
run_started=$phase_started

phase "tools: Docker Compose v2, mmdebstrap, .venv"
scripts/install-tools.sh --build --python test,dev,charts

phase "lint, format, types (ruff, mypy)"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy

phase "images (scripts/build_images.py --variant cpu)"
.venv/bin/python scripts/build_images.py --variant cpu

phase "versions: shipped (official images) vs tested (built here)"
.venv/bin/python -m llmstack.versions --compare

phase "tests (pytest)"
export TESTCONTAINERS_RYUK_DISABLED=true
# Each test stack names its own compose project; a name from the shell would override it.
unset COMPOSE_PROJECT_NAME COMPOSE_FILE
status=0
.venv/bin/python -m pytest "$@" || status=$?
phase "done in $(( $(date +%s) - run_started ))s, pytest exit code $status"
exit $status
