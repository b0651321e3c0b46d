#!/bin/sh
# Render /etc/nginx/templates/**/*.template into /etc/nginx/conf.d with envsubst, substituting
# only variables that are set (nginx's own $variables stay as they are), then run the command.
set -eu
template_dir=${NGINX_ENVSUBST_TEMPLATE_DIR:-/etc/nginx/templates}
output_dir=${NGINX_ENVSUBST_OUTPUT_DIR:-/etc/nginx/conf.d}
suffix=${NGINX_ENVSUBST_TEMPLATE_SUFFIX:-.template}
if [ -d "$template_dir" ]; then
    defined=$(env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/${\1}/p' | tr '\n' ' ')
    find "$template_dir" -follow -type f -name "*$suffix" | while read -r template; do
        relative=${template#"$template_dir/"}
        target="$output_dir/${relative%"$suffix"}"
        mkdir -p "$(dirname "$target")"
        envsubst "$defined" < "$template" > "$target"
    done
fi
exec "$@"
