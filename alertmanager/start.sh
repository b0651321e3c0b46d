#!/bin/sh
# Start Alertmanager with alertmanager/alertmanager.yml and the ALERT_* settings from .env (given by
# compose/stack.yaml; empty keeps the file's value). The result goes to /tmp (a tmpfs), then this
# execs `alertmanager` with the arguments compose passes. POSIX sh: runs in the official (busybox)
# image and in the Debian one.
set -eu
template=/etc/alertmanager/alertmanager.yml
config=/tmp/alertmanager.yml
url_file=/tmp/alertmanager-webhook-url

fail() {
    echo "alertmanager/start.sh: $*" >&2
    exit 2
}

script=""
for name in ALERT_GROUP_WAIT ALERT_GROUP_INTERVAL ALERT_REPEAT_INTERVAL; do
    eval "value=\${$name:-}"
    [ -n "$value" ] || continue
    printf '%s' "$value" | grep -Eq '^([0-9]+(ms|s|m|h|d|w|y))+$' \
        || fail "$name='$value' is not a duration such as 30s, 5m or 4h"
    key=$(echo "$name" | sed 's/^ALERT_//' | tr 'A-Z' 'a-z')
    # The top-level route's keys (two spaces in): the only place they are set.
    script="$script
s/^  $key: .*/  $key: $value/"
done

url=${ALERT_WEBHOOK_URL:-}
if [ -n "$url" ]; then
    case "$url" in
        http://* | https://*) ;;
        *) fail "ALERT_WEBHOOK_URL must start with http:// or https://" ;;
    esac
    (umask 077 && printf '%s\n' "$url" >"$url_file")
else
    echo "alertmanager/start.sh: ALERT_WEBHOOK_URL is empty: alerts reach no receiver (set it in .env)" >&2
    script="$script
s/^  receiver: webhook$/  receiver: nobody/"
fi

sed "$script" "$template" >"$config"
exec alertmanager "$@"
