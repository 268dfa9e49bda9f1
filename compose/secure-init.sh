#!/usr/bin/env bash
# Write the secrets of the secured compose stack (compose/docker-compose.secure.yml)
# into compose/secrets/ (gitignored), or into the folder given:
#
#   compose/secure-init.sh [DIR]          # then:
#   scripts/compose.sh -f compose/docker-compose.yml -f compose/docker-compose.secure.yml \
#       --env-file compose/.env up -d     # (or: make up SECURE=1)
#
#   nats-auth.conf              NATS users + per-service permissions (inferbus_common.security)
#   <role>.nats-password        one per service role, and `admin` for the CLI
#   redis.password, redis.conf  the Redis password, and `requirepass` for redis-server
#   registry-admin.token        registry admin token (gateway repository extension, CLI)
#   registry-reader.token       registry reader token (workers download with it)
#   gateway-tls.crt/.key        gateway TLS; a self-signed certificate for localhost,
#                               127.0.0.1 and `gateway` unless you put your own there
#
# Idempotent: existing files are kept (delete one to regenerate it; restart the
# services that use it). The folder is mode 0700, so other users of this host
# cannot read it; the files in it are 0644 because compose mounts each file as is
# into the containers that need it (and only those), where the services run as
# uid 10001 (redis as uid 999). See docs/security.md.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR="${1:-compose/secrets}"
umask 077
mkdir -p "$DIR"
chmod 0700 "$DIR"
log() { printf '[secure-init] %s\n' "$*" >&2; }

random_secret() {
    # 32 URL-safe characters from the kernel's CSPRNG.
    head -c 48 /dev/urandom | base64 | tr -d '\n/+=' | head -c 32
}

# 1. NATS users and permissions, from inferbus_common.security (the permission
#    table lives there): through uv in this checkout, else a built inferbus image.
if [[ ! -f "$DIR/nats-auth.conf" ]]; then
    if command -v uv >/dev/null 2>&1 || [[ -x "$HOME/.local/bin/uv" ]]; then
        PATH="$HOME/.local/bin:$PATH" uv run --frozen python -m inferbus_common.security "$DIR" >&2
    else
        image="${INFERBUS_IMAGE_REPO:-inferbus}/router:${INFERBUS_VERSION:-dev}"
        log "no uv here: generating with $image"
        docker run --rm --user "$(id -u):$(id -g)" -v "$(cd "$DIR" && pwd):/out" \
            --entrypoint python "$image" -m inferbus_common.security /out >&2
    fi
    # The <role>.env files it also writes name host paths; compose sets the same
    # variables with the in-container paths, so they are not needed here.
    rm -f "$DIR"/*.env
else
    log "keeping $DIR/nats-auth.conf (delete it to regenerate every NATS password)"
fi

# 2. Redis: the password for the gateway, and a config line for redis-server
#    (read with --include, so the password is never on a command line).
if [[ ! -f "$DIR/redis.password" ]]; then
    random_secret > "$DIR/redis.password"
fi
printf 'requirepass "%s"\n' "$(cat "$DIR/redis.password")" > "$DIR/redis.conf"

# 3. Registry tokens.
for role in admin reader; do
    if [[ ! -f "$DIR/registry-$role.token" ]]; then
        random_secret > "$DIR/registry-$role.token"
    fi
done

# 4. Gateway TLS.
if [[ ! -f "$DIR/gateway-tls.crt" || ! -f "$DIR/gateway-tls.key" ]]; then
    log "self-signed gateway certificate (clients: --cacert $DIR/gateway-tls.crt); replace it with a real one"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
        -subj "/CN=inferbus-gateway" \
        -addext "subjectAltName=DNS:localhost,DNS:gateway,IP:127.0.0.1" \
        -keyout "$DIR/gateway-tls.key" -out "$DIR/gateway-tls.crt" 2>/dev/null
fi

chmod 0644 "$DIR"/*
log "wrote $DIR: $(cd "$DIR" && ls | tr '\n' ' ')"
