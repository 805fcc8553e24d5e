#!/usr/bin/env bash
# Build Belayer's images where no container registry is reachable (air-gapped clusters, this CI).
#
#   deploy/docker/build.sh base     belayer-python-base: Debian bookworm minbase + python3 + python3-venv,
#                                   made by debootstrap from Debian packages (root; cached rootfs tarball)
#   deploy/docker/build.sh wheels   every dependency as a wheel in deploy/docker/wheels/ (pip on this host,
#                                   through its own index configuration), so `docker build` needs no network
#   deploy/docker/build.sh images   the gateway and trainer-example images from deploy/docker/Dockerfile
#   deploy/docker/build.sh all      the three above, in order
#
# Idempotent: the base image is kept when it exists; the wheels are kept while pyproject.toml's
# dependencies are unchanged; an image is rebuilt only when its source hash (Dockerfile, pyproject.toml,
# README.md, the packages, the wheels, the base image's id) differs from the `belayer.source-hash` label
# of the image already there. With a registry, none of this is needed:
#   docker build -f deploy/docker/Dockerfile -t belayer-gateway .
#
# Environment (defaults in brackets):
#   BELAYER_IMAGE_BASE      [belayer-python-base]  base image for `images` (python:3.11-slim works too)
#   BELAYER_GATEWAY_IMAGE   [belayer-gateway:local]
#   BELAYER_TRAINER_IMAGE   [belayer-trainer-example:local]
#   BELAYER_CACHE_DIR       [/var/cache/belayer]   the rootfs tarball goes in $BELAYER_CACHE_DIR/images
#   PYTHON                  [.venv/bin/python if present, else python3]  runs `pip download` (3.11)
#   DEBIAN_MIRROR           [from /etc/apt/sources.list.d/debian.sources, else http://deb.debian.org/debian]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BASE_IMAGE=${BELAYER_IMAGE_BASE:-belayer-python-base}
GATEWAY_IMAGE=${BELAYER_GATEWAY_IMAGE:-belayer-gateway:local}
TRAINER_IMAGE=${BELAYER_TRAINER_IMAGE:-belayer-trainer-example:local}
CACHE_DIR=${BELAYER_CACHE_DIR:-/var/cache/belayer}/images
WHEELS=deploy/docker/wheels
SUITE=bookworm  # its python3 is 3.11, like python:3.11-slim
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# What the trainer-example image adds; downloaded with the gateway's dependencies.
EXTRA_WHEELS=("openai>=1.50" "setuptools>=68" "wheel")
PACKAGES=(belayer core gateway engine_pool sandbox store harness_adapters)

say() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }
now() { echo "${EPOCHREALTIME/,/.}"; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# ---------------------------------------------------------------- base image
build_base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "$BASE_IMAGE: present, kept"; return 0
  fi
  local t tarball tmp
  t=$(now); tarball="$CACHE_DIR/$BASE_IMAGE-$SUITE.tar"
  if [ ! -f "$tarball" ]; then
    [ "$(id -u)" = 0 ] || die "debootstrap needs root (or docker-import a rootfs with python3 and python3-venv yourself)"
    command -v debootstrap >/dev/null 2>&1 || die "debootstrap is missing (deploy/host/setup_sandbox_host.sh install)"
    mkdir -p "$CACHE_DIR"
    tmp=$(mktemp -d "$CACHE_DIR/rootfs-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    say "$BASE_IMAGE: debootstrap $SUITE minbase + python3 python3-venv (about a minute, once)"
    debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$tmp/rootfs" "$(debian_mirror)" \
      >"$tmp/debootstrap.log" 2>&1 || { tail -20 "$tmp/debootstrap.log" >&2; die "debootstrap failed"; }
    # Trimmed like the sandbox images (sandbox/images.py); only a complete tarball is ever cached.
    tar -C "$tmp/rootfs" --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*' \
      --exclude='./usr/share/doc/*' --exclude='./usr/share/locale/*' --exclude='./usr/share/man/*' \
      -cf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    rm -rf "$tmp"; trap - EXIT
  fi
  docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' "$tarball" "$BASE_IMAGE" >/dev/null
  say "$BASE_IMAGE: imported in $(since "$t") from $tarball"
}

# ---------------------------------------------------------------- wheels
requirements() {  # the gateway's dependencies (pyproject.toml) and the trainer example's, one a line
  "$PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] + sys.argv[1:]))' \
    "${EXTRA_WHEELS[@]}"
}

build_wheels() {
  local t want stamp="$WHEELS/.requirements"
  want=$(requirements)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    say "wheels: up to date in $WHEELS"; return 0
  fi
  t=$(now)
  find "$WHEELS" -maxdepth 1 -name '*.whl' -delete
  # Binary wheels only: the image has no compiler. The versions this venv runs are preferred (constraints),
  # so the image runs what the tests ran; anything else is resolved afresh.
  local constraints; constraints=$(mktemp)
  "$PYTHON" -m pip freeze --exclude-editable 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==' >"$constraints" || true
  echo "$want" >"$constraints.in"
  "$PYTHON" -m pip download -q --only-binary=:all: -d "$WHEELS" -c "$constraints" -r "$constraints.in" \
    >"$constraints.log" 2>&1 || { grep -v '^WARNING: Location' "$constraints.log" >&2; die "pip download failed"; }
  rm -f "$constraints" "$constraints.log" "$constraints.in"
  echo "$want" >"$stamp"
  say "wheels: $(compgen -G "$WHEELS/*.whl" | wc -l) in $WHEELS, $(du -sh "$WHEELS" | cut -f1), in $(since "$t")"
}

# ---------------------------------------------------------------- images
source_hash() {  # everything the image is built from
  {
    docker image inspect -f '{{.Id}}' "$BASE_IMAGE"
    find deploy/docker/Dockerfile deploy/docker/trainer_example.py pyproject.toml README.md "${PACKAGES[@]}" \
      -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
    find "$WHEELS" -maxdepth 1 -name '*.whl' -printf '%f %s\n' | sort
  } | sha256sum | cut -d' ' -f1
}

build_image() {  # IMAGE TARGET HASH
  local image=$1 target=$2 hash=$3 t have
  have=$(docker image inspect -f '{{index .Config.Labels "belayer.source-hash"}}' "$image" 2>/dev/null || true)
  if [ "$have" = "$hash" ]; then say "$image: up to date (source hash ${hash:0:12})"; return 0; fi
  t=$(now)
  local log old; log=$(mktemp)
  old=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
  docker build --force-rm -f deploy/docker/Dockerfile --target "$target" --build-arg "BASE=$BASE_IMAGE" \
    --label "belayer.source-hash=$hash" -t "$image" . >"$log" 2>&1 || { tail -40 "$log" >&2; rm -f "$log"; die "docker build of $image failed"; }
  rm -f "$log"
  # The version this build replaced, unless a container still uses it (its layers stay cached).
  if [ -n "$old" ] && [ "$old" != "$(docker image inspect -f '{{.Id}}' "$image")" ]; then
    docker image rm "$old" >/dev/null 2>&1 || true
  fi
  say "$image: built in $(since "$t") (target $target, base $BASE_IMAGE)"
}

build_images() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || die "no base image $BASE_IMAGE (run '$0 base')"
  local hash; hash=$(source_hash)
  build_image "$GATEWAY_IMAGE" gateway "$hash"
  build_image "$TRAINER_IMAGE" trainer-example "$hash"
}

case "${1:-all}" in
  base) build_base ;;
  wheels) build_wheels ;;
  images) build_images ;;
  all) build_base; build_wheels; build_images ;;
  *) echo "usage: $0 [base|wheels|images|all]" >&2; exit 2 ;;
esac
