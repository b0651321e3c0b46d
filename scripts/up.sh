#!/usr/bin/env bash
# Start the stack on a fresh machine: prepare .env and the secrets (llmstack.secrets), build the
# local images when the mode needs them, then `docker compose up --wait`.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'USAGE'
usage: scripts/up.sh [--gpu | --airgap | --cpu]

  --gpu      GPU host that can pull the official images (default)
  --airgap   GPU host without registry access: builds every image locally first
  --cpu      no GPU: vLLM's CPU build serving a tiny made-up model, all images built locally

The mode is written into .env (COMPOSE_FILE) the first time, so later plain
`docker compose ps|logs|down` commands use the same files.
USAGE
}

mode=gpu
case "${1:-}" in
    ""|--gpu) mode=gpu ;;
    --airgap) mode=airgap ;;
    --cpu) mode=cpu ;;
    -h|--help) usage; exit 0 ;;
    *) echo "up.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac
# The last file holds the vLLM replicas beyond the first and the router's list of them, written
# below from .env (VLLM_GPUS, VLLM_CPU_REPLICAS) by llmstack.replicas.
replicas_file=.build/compose.replicas.yaml
case $mode in
    gpu) compose_file=compose.yaml:$replicas_file ;;
    airgap) compose_file=compose.yaml:compose.airgap.yaml:$replicas_file ;;
    cpu) compose_file=compose.yaml:compose.airgap.yaml:compose.cpu.yaml:$replicas_file ;;
esac

if [[ $mode == gpu ]]; then build=(); else build=(--build); fi
scripts/install-tools.sh "${build[@]}" --python charts

if [[ ! -f .env ]]; then
    sed "s|^COMPOSE_FILE=.*|COMPOSE_FILE=$compose_file|" .env.example > .env
    echo "Wrote .env for the $mode mode; edit it to change the model or limits." >&2
fi
configured=$(sed -n 's/^COMPOSE_FILE=//p' .env | tail -n 1)
if [[ -z "${COMPOSE_FILE:-}" && "$configured" != "$compose_file" ]]; then
    echo "up.sh: .env has COMPOSE_FILE=$configured; starting the $mode mode ($compose_file) for this run" >&2
    export COMPOSE_FILE=$compose_file
fi

# Secret files (API keys, passwords) where .env says, made once; what to keep is printed once.
.venv/bin/python -m llmstack.secrets >&2

if [[ $mode != gpu ]]; then
    .venv/bin/python scripts/build_images.py --variant "$([[ $mode == cpu ]] && echo cpu || echo gpu)"
fi

.venv/bin/python -m llmstack.replicas --output "$replicas_file"

started=$(date +%s)
# Replicas no longer listed in .env (VLLM_GPUS, VLLM_CPU_REPLICAS lowered) go, their GPU with them.
if ! docker compose up -d --wait --remove-orphans; then
    # A change that restarts every replica (the model, a replica's cores) leaves the router without
    # one in rotation, unhealthy, for as long as they load; compose then gives up on nginx, which
    # depends on it, at once. Wait for the router to see a replica again, then start the rest.
    echo "up.sh: waiting for the router to have a replica in rotation again" >&2
    for _ in $(seq 120); do
        [[ $(docker compose ps router --format '{{.Health}}') == healthy ]] && break
        sleep 5
    done
    docker compose up -d --wait --remove-orphans
fi
gateway=$(docker compose port nginx 8443 2>/dev/null | tail -n 1)
gateway=${gateway/0.0.0.0/localhost}
ca_file=$(.venv/bin/python -m llmstack.secrets --path tls_certificate)
echo "Stack healthy after $(( $(date +%s) - started ))s. Try (HTTPS; plain HTTP is on 127.0.0.1 only):" >&2
echo "  curl -N --cacert $ca_file https://${gateway:-localhost:8443}/v1/chat/completions -H \"Authorization: Bearer \$KEY\" \\" >&2
echo "       -H 'Content-Type: application/json' -d '{\"model\": \"<served model>\", \"stream\": true, \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'" >&2
