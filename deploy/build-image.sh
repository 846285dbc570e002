#!/usr/bin/env bash
# Build the pstrain image with no network in the build: from a wheelhouse made
# on this host, optionally on a Debian base image made here (no registry).
#
#   deploy/build-image.sh                   wheelhouse, then docker build on python:3.11-slim
#   deploy/build-image.sh --local-base      ... on a Debian bookworm base made with debootstrap
#                                           (root; from the Debian mirror apt uses here)
#   options: --tag IMAGE (default pstrain:0.1.0), --base IMAGE (a base image you have),
#            --mirror URL (debootstrap's mirror), --no-build (wheelhouse and base only)
#
# 1. deploy/wheelhouse/: wheels of every dependency of pstrain[examples] and of
#    its build backend (setuptools, wheel) for this host's Python; the
#    Dockerfile installs from it alone when it holds wheels (pip --no-index),
#    and builds pstrain itself from the source tree. The image's Python must be
#    the same minor version as this host's (python3 --version; bookworm has 3.11).
# 2. --local-base: `debootstrap --variant=minbase --include=python3,python3-venv
#    bookworm` into a temporary directory, `docker import`ed as
#    pstrain-base:bookworm (kept: made once).
# 3. docker build --build-arg BASE_IMAGE=<base> -t <tag> .
#
# For compose, give it the same base: BASE_IMAGE=pstrain-base:bookworm docker-compose up --build
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=pstrain:0.1.0 BASE="" LOCAL_BASE=0 BUILD=1 MIRROR=""
LOCAL_BASE_IMAGE=pstrain-base:bookworm
while [ $# -gt 0 ]; do
    case "$1" in
        --local-base) LOCAL_BASE=1 ;;
        --tag) TAG="$2"; shift ;;
        --base) BASE="$2"; shift ;;
        --mirror) MIRROR="$2"; shift ;;
        --no-build) BUILD=0 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "build-image.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
PYTHON=${PYTHON:-python3}

echo "build-image.sh: wheels of pstrain[examples]'s dependencies into deploy/wheelhouse/ ($($PYTHON --version))"
rm -f deploy/wheelhouse/*.whl
"$PYTHON" -m pip wheel -q --wheel-dir deploy/wheelhouse ".[examples]" "setuptools>=68" wheel
# pstrain itself is built from the source in the image (no stale copy here)
rm -f deploy/wheelhouse/pstrain-*.whl

if [ "$LOCAL_BASE" = 1 ]; then
    BASE=$LOCAL_BASE_IMAGE
    if docker image inspect "$BASE" >/dev/null 2>&1; then
        echo "build-image.sh: base image $BASE exists"
    else
        command -v debootstrap >/dev/null || {
            echo "build-image.sh: --local-base needs debootstrap (apt-get install debootstrap)" >&2
            exit 2; }
        if [ -z "$MIRROR" ]; then   # the Debian mirror apt already uses here
            MIRROR=$({ grep -hoE '(URIs:|deb) +https?://[^ ]+/debian/?( |$)' \
                     /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
                     || true; } | head -n1 | awk '{print $2}')
            MIRROR=${MIRROR:-http://deb.debian.org/debian}
        fi
        ROOTFS=$(mktemp -d)
        trap 'rm -rf "$ROOTFS"' EXIT
        echo "build-image.sh: debootstrap bookworm from $MIRROR"
        debootstrap --variant=minbase --include=python3,python3-venv bookworm "$ROOTFS" \
            "$MIRROR" >/dev/null
        rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
        tar -C "$ROOTFS" -c . | docker import - "$BASE" >/dev/null
        echo "build-image.sh: made base image $BASE"
    fi
fi

if [ "$BUILD" = 1 ]; then
    echo "build-image.sh: docker build -t $TAG${BASE:+ (base $BASE)}"
    # --network none: the build reaches nothing (the wheelhouse has every wheel)
    docker build -q --network none ${BASE:+--build-arg BASE_IMAGE="$BASE"} -t "$TAG" . >/dev/null
    echo "build-image.sh: built $TAG"
fi
