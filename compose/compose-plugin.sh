#!/usr/bin/env bash
# Build the docker compose v2 CLI plugin from the Go module proxy, once, into the project's cache, and
# print its path. No image registry is needed: the module's sources come from the Go proxy, and the
# binary runs as `docker compose` (installed as a CLI plugin) or on its own.
#   compose/compose-plugin.sh            build if missing; print the binary's path
#   COMPOSE_VERSION=v2.40.3 (default)    which release of github.com/docker/compose/v2
set -euo pipefail

version="${COMPOSE_VERSION:-v2.40.3}"
cache="${ROLLOUT_BUS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-bus}"
out="$cache/docker-compose-$version/docker-compose"

if [ -x "$out" ]; then
    echo "$out"
    exit 0
fi
command -v go >/dev/null || { echo "compose-plugin: Go is needed to build docker compose $version" >&2; exit 1; }

echo "compose-plugin: downloading github.com/docker/compose/v2@$version from the Go module proxy ..." >&2
module_dir="$(go mod download -json "github.com/docker/compose/v2@$version" |
              python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
work="$(mktemp -d)"
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
cp -r "$module_dir/." "$work/"   # the module cache is read-only: build in a copy
chmod -R u+w "$work"
echo "compose-plugin: building (a few minutes the first time; progress below) ..." >&2
mkdir -p "$(dirname "$out")"
(cd "$work" && CGO_ENABLED=0 go build -v -trimpath \
    -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$version" -o "$out.partial" ./cmd) 2>&1 |
    awk '{ n++ } n % 50 == 0 { printf "compose-plugin: %d packages compiled\n", n > "/dev/stderr" }'
mv "$out.partial" "$out"
echo "compose-plugin: built $out" >&2
echo "$out"
