#!/usr/bin/env bash
# Builds one AMP-RL image with the builder this machine has: docker when its daemon
# answers, else podman, else buildah (BUILDER=docker|podman|buildah picks one).
#
#   docker/build.sh cpu|cuda [BUILD-OPTION...]
#
# The tag is $IMAGE_REGISTRY/amprl-<flavour>:<version> (IMAGE_REGISTRY defaults to the
# chart's ghcr.io/amp-rl); the labels carry pyproject.toml's version (the one version of
# package, chart and images) and the commit, "-dirty" when the tree has uncommitted
# changes. BUILD-OPTIONs go to the builder as they are, e.g. an offline build:
#   --network none --build-arg BASE_IMAGE=localhost/amprl-base:bookworm
#   --build-arg WHEELHOUSE=build/wheelhouse/cpu --build-arg PIP_NO_INDEX=1
set -euo pipefail

flavour=${1:?usage: docker/build.sh cpu|cuda [BUILD-OPTION...]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$root/docker/Dockerfile.$flavour" ] || { echo "build.sh: no docker/Dockerfile.$flavour" >&2; exit 2; }
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml")
revision=$(git -C "$root" describe --always --dirty --abbrev=40 2>/dev/null || echo unknown)
tag=${IMAGE_REGISTRY:-ghcr.io/amp-rl}/amprl-$flavour:$version

builder=${BUILDER:-}
if [ -z "$builder" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then builder=docker
  elif command -v podman >/dev/null; then builder=podman
  elif command -v buildah >/dev/null; then builder=buildah
  else echo "build.sh: no image builder: install docker, podman or buildah" >&2; exit 1
  fi
fi
case $builder in
  docker) build=(docker build) ;;
  # docker format: OCI image configs have no field for HEALTHCHECK, which the image needs
  podman) build=(podman build --format docker) ;;
  buildah) build=(buildah bud --format docker) ;;
  *) echo "build.sh: BUILDER=$builder: expected docker, podman or buildah" >&2; exit 2 ;;
esac

echo "build.sh: $tag with $builder (revision $revision)"
start=$SECONDS
"${build[@]}" -f "$root/docker/Dockerfile.$flavour" -t "$tag" \
  --build-arg "VERSION=$version" --build-arg "REVISION=$revision" "$@" "$root"
echo "build.sh: built $tag with $builder in $((SECONDS - start)) s"
