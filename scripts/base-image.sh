#!/usr/bin/env bash
# Build a local stand-in for `python:3.11-slim` when no container registry can be
# reached: Debian bookworm (Python 3.11) made with debootstrap from the Debian
# mirror this machine's apt already uses, imported with `podman import`.
#
#   scripts/base-image.sh [--force] [--tag NAME]
#
# The result (default localhost/inferbus-base:bookworm) is what
# `scripts/images.sh --local` passes to every Dockerfile as BASE_IMAGE. It holds
# python3 (3.11), pip, venv and the CA certificates; like the official image its
# pip may install into the system Python (no EXTERNALLY-MANAGED marker).
# Skips the work when the image exists (--force rebuilds). Needs root, podman
# and debootstrap (scripts/bootstrap-containers.sh installs them). About a
# minute; see docs/operations.md ("Build the images without a registry").
set -euo pipefail

tag="localhost/inferbus-base:bookworm"
force=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --force) force=1 ;;
        --tag) tag="$2"; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "base-image.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

log() { printf '[base-image] %s\n' "$*" >&2; }

if [[ "$force" == "0" ]] && podman image exists "$tag"; then
    log "$tag exists (use --force to rebuild)"
    exit 0
fi
if [[ "$(id -u)" != "0" ]]; then
    log "debootstrap needs root"
    exit 1
fi

# The mirror apt uses (deb822 .sources files first, then sources.list);
# DEBIAN_MIRROR overrides.
mirror="${DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null |
        awk '{print $2}' | grep -v -- '-security' | head -n 1 || true)"
fi
if [[ -z "$mirror" ]]; then
    mirror="$(grep -hs '^deb ' /etc/apt/sources.list 2>/dev/null |
        awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' |
        grep -v -- '-security' | head -n 1 || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

work="$(mktemp -d /var/tmp/inferbus-base.XXXXXX)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
log "debootstrap bookworm from $mirror"
started=$SECONDS
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    log "debootstrap failed"
    exit 1
}
# What an image should not carry: downloaded packages and package lists
# (a Dockerfile runs `apt-get update` itself), and the marker that stops pip
# from installing into the system Python (python:3.11-slim has none).
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
log "podman import -> $tag"
tar -C "$rootfs" -c . | podman import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag" >/dev/null
log "$tag built in $((SECONDS - started)) s ($(podman image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1 / 1e6}'))"
