#!/usr/bin/env bash
# Start the stack on a fresh machine: prepare .env, a first API key and the secrets folder,
# build the local images when the mode needs them, then `docker compose up --wait`.
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
case $mode in
    gpu) compose_file=compose.yaml ;;
    airgap) compose_file=compose.yaml:compose.airgap.yaml ;;
    cpu) compose_file=compose.yaml:compose.airgap.yaml:compose.cpu.yaml ;;
esac

if [[ $mode == gpu ]]; then scripts/install-tools.sh; else scripts/install-tools.sh --build; fi

if [[ ! -f .env ]]; then
    sed "s|^COMPOSE_FILE=.*|COMPOSE_FILE=$compose_file|" .env.example > .env
    echo "Wrote .env for the $mode mode; edit it to change the model or limits." >&2
fi
# .env in compose's syntax (KEY=value, no shell quoting): the shell's environment wins, as with compose.
while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" =~ ^[[:space:]]*([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] || continue
    name=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    [[ -n "${!name+set}" ]] && continue
    [[ "$value" =~ ^\"(.*)\"$ || "$value" =~ ^\'(.*)\'$ ]] && value=${BASH_REMATCH[1]}
    export "$name=$value"
done < .env
if [[ "$COMPOSE_FILE" != "$compose_file" ]]; then
    echo "up.sh: .env has COMPOSE_FILE=$COMPOSE_FILE; starting the $mode mode ($compose_file) for this run" >&2
    export COMPOSE_FILE=$compose_file
fi

mkdir -p secrets "${MODELS_DIR:-./models}"
chmod 700 secrets
[[ -f "${HF_TOKEN_FILE:-./secrets/hf_token}" ]] || install -m 600 /dev/null "${HF_TOKEN_FILE:-./secrets/hf_token}"
grafana_password=${GRAFANA_ADMIN_PASSWORD_FILE:-./secrets/grafana_admin_password}
if [[ ! -s "$grafana_password" ]]; then
    openssl rand -base64 18 > "$grafana_password"
    echo "Grafana: user admin, password in $grafana_password" >&2
fi
prometheus_htpasswd=${PROMETHEUS_HTPASSWD_FILE:-./secrets/prometheus_htpasswd}
if [[ ! -s "$prometheus_htpasswd" ]]; then
    prometheus_password=$(openssl rand -base64 18)
    printf 'admin:%s\n' "$(printf '%s' "$prometheus_password" | openssl passwd -6 -stdin)" > "$prometheus_htpasswd"
    echo "Prometheus (/prometheus/): user admin, password $prometheus_password (shown only now)" >&2
fi
chmod 644 "$grafana_password" "$prometheus_htpasswd"
keys_file=${API_KEYS_FILE:-./secrets/api_keys}
if [[ ! -s "$keys_file" ]] || ! grep -q '^sk-' "$keys_file"; then
    key=$(python3 scripts/apikeys.py --file "$keys_file" --no-reload create admin)
    echo "Created the first API key (owner 'admin'); it is shown only now: $key" >&2
fi

loadtest_key=${LOADTEST_API_KEY_FILE:-./secrets/loadtest_api_key}
if [[ ! -s "$loadtest_key" ]]; then
    python3 scripts/apikeys.py --file "$keys_file" --no-reload create loadtest > "$loadtest_key"
    chmod 644 "$loadtest_key"
fi
locust_htpasswd=${LOCUST_HTPASSWD_FILE:-./secrets/locust_htpasswd}
if [[ ! -s "$locust_htpasswd" ]]; then
    password=$(openssl rand -base64 18)
    printf 'admin:%s\n' "$(printf '%s' "$password" | openssl passwd -6 -stdin)" > "$locust_htpasswd"
    chmod 644 "$locust_htpasswd"
    echo "Locust web UI at /locust/: user admin, password $password (shown only now)" >&2
fi

if [[ $mode != gpu ]]; then
    python3 scripts/build_images.py --variant "$([[ $mode == cpu ]] && echo cpu || echo gpu)"
fi

started=$(date +%s)
docker compose up -d --wait
echo "Stack healthy after $(( $(date +%s) - started ))s. Try:" >&2
echo "  curl -N http://localhost:${GATEWAY_PORT:-8080}/v1/chat/completions -H \"Authorization: Bearer \$KEY\" \\" >&2
echo "       -H 'Content-Type: application/json' -d '{\"model\": \"<served model>\", \"stream\": true, \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'" >&2
