#!/usr/bin/env bash
# The compose deployment brought up for real, on a machine that reaches Debian's packages, PyPI, Maven
# Central and the Go module proxy but no image registry (`make compose-test`):
#   1. a Docker daemon: the one $DOCKER_HOST (or the default socket) answers on, never stopped here; else a
#      private dockerd started as root with its own data root (images cached between runs), exec root and
#      socket, overlay2, no iptables, stopped again at the end;
#   2. the docker compose v2 CLI (compose/compose-plugin.sh: built once from the Go module proxy);
#   3. local stand-ins for the public images, built once and cached by the daemon: a Debian bookworm
#      root from debootstrap (`docker import`), Python 3.11 on it, Kafka 4.1.1 on it (Debian's Java 17
#      and the jars the project fetches), Prometheus on it (Debian's package); then the rollout-bus image
#      from compose/Dockerfile through compose;
#   4. compose/stack_check.py single  (one broker, --scale stream=3, and the observability profile's
#      Prometheus, asked through its HTTP API),
#      compose/stack_check.py cluster (three brokers, one killed mid-run and restarted) and
#      compose/stack_check.py secure  (one secured broker, each stage its role's principal; its secrets made
#      first with `rollout-bus kafka secrets` in a temporary directory, removed at the end): see its docstring.
# Every stack it brings up comes down with its volumes, and a daemon it started is stopped, also on
# failure or Ctrl-C.
#   compose/compose-test.sh [single|cluster|secure|all] (default all)
#   COMPOSE_TEST_EPISODES (256; cluster run: twice that), COMPOSE_TEST_KEEP=1 (leave stacks and daemon up)
set -euo pipefail

runs="${1:-all}"
case "$runs" in single|cluster|secure|all) ;; *) echo "usage: $0 [single|cluster|secure|all]" >&2; exit 2 ;; esac
repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${ROLLOUT_BUS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rollout-bus}"
python="${PYTHON:-$repo/.venv/bin/python}"
episodes="${COMPOSE_TEST_EPISODES:-256}"
keep="${COMPOSE_TEST_KEEP:-0}"
began=$SECONDS
say() { printf '[compose-test %s +%ss] %s\n' "$(date +%H:%M:%S)" "$((SECONDS - began))" "$*" >&2; }
die() { say "error: $*"; exit 1; }
# A Debian package this script needs (dockerd, debootstrap): installed with apt-get when missing and root,
# as the project fetches its other tools itself; otherwise the error says what to install.
need_package() {  # need_package COMMAND PACKAGE
    command -v "$1" >/dev/null && return 0
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null ||
        die "no $1: install Debian's $2 package (or point DOCKER_HOST at a running daemon)"
    say "installing Debian's $2 (for $1) with apt-get ..."
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2"; } \
        >/tmp/rollout-bus-apt.log 2>&1 || { tail -20 /tmp/rollout-bus-apt.log >&2; die "apt-get install $2 failed"; }
}

export ROLLOUT_BUS_BASE_IMAGE="${ROLLOUT_BUS_BASE_IMAGE:-rollout-bus-local/debian:bookworm}"
export ROLLOUT_BUS_PYTHON_IMAGE="${ROLLOUT_BUS_PYTHON_IMAGE:-rollout-bus-local/python:3.11-bookworm}"
export ROLLOUT_BUS_KAFKA_IMAGE="${ROLLOUT_BUS_KAFKA_IMAGE:-rollout-bus-local/kafka:4.1.1}"
export ROLLOUT_BUS_PROMETHEUS_IMAGE="${ROLLOUT_BUS_PROMETHEUS_IMAGE:-rollout-bus-local/prometheus:2.42-bookworm}"
export ROLLOUT_BUS_BUILD_NETWORK="${ROLLOUT_BUS_BUILD_NETWORK:-host}"

[ -x "$python" ] || die "no $python: run \`make venv\` first (or set PYTHON)"

# --- 1. the daemon ------------------------------------------------------------------------------------
private=""      # the private daemon's run directory, when this script started one
dockerd_pid=""
projects=()     # compose projects this script brought up: taken down on exit
compose=""
secrets_dir=""  # the secured stack's secrets (a temporary directory), removed on exit

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    if [ "$keep" != 1 ] && [ -n "$compose" ]; then
        for project in "${projects[@]}"; do
            if [ -n "$(docker ps -aq --filter "label=com.docker.compose.project=$project" 2>/dev/null)" ] ||
               [ -n "$(docker volume ls -q --filter "label=com.docker.compose.project=$project" 2>/dev/null)" ]; then
                say "taking down what is left of $project"
                overlay="$repo/compose/docker-compose.cluster.yml"
                [ "$project" = rollout-bus-ctest-secure ] && overlay="$repo/compose/docker-compose.secure.yml"
                $compose -p "$project" -f "$repo/compose/docker-compose.yml" -f "$overlay" \
                    --profile observability --profile tools \
                    down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 || true
            fi
        done
    fi
    if [ "$keep" != 1 ]; then
        if [ -n "$dockerd_pid" ]; then
            say "stopping the private dockerd (pid $dockerd_pid)"
            kill -TERM "$dockerd_pid" 2>/dev/null || true
            for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
            kill -KILL "$dockerd_pid" 2>/dev/null || true
            # dockerd leaves its default network namespace mounted under the exec root
            awk -v dir="$private/" 'index($2, dir) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
            rm -rf "$private"
        fi
    elif [ -n "$dockerd_pid" ]; then
        say "COMPOSE_TEST_KEEP=1: the private dockerd stays up: export DOCKER_HOST=$DOCKER_HOST; kill $dockerd_pid stops it"
    fi
    [ -n "$secrets_dir" ] && [ "$keep" != 1 ] && rm -rf "$secrets_dir"
    say "done, exit $status"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if docker info >/dev/null 2>&1; then
    say "using the running Docker daemon at ${DOCKER_HOST:-the default socket} (it is not stopped afterwards)"
else
    [ "$(id -u)" = 0 ] || die "no Docker daemon answers and a private one needs root (or set DOCKER_HOST)"
    need_package dockerd docker.io
    private="$(mktemp -d /tmp/rollout-bus-dockerd.XXXXXX)"   # short: the socket's path has a length limit
    mkdir -p "$cache/docker"
    say "starting a private dockerd: data root $cache/docker (kept: the images stay cached), socket $private/docker.sock"
    # In a session of its own: a Ctrl-C reaches this script, whose EXIT trap takes the stacks down first and
    # then stops the daemon; sent to the daemon too, it would stop first and leave the stacks behind.
    setsid dockerd --data-root "$cache/docker" --exec-root "$private/exec" --pidfile "$private/dockerd.pid" \
        -H "unix://$private/docker.sock" --storage-driver overlay2 --iptables=false --ip-masq=false --bridge=none \
        >"$private/dockerd.log" 2>&1 < /dev/null &
    dockerd_pid=$!   # until its pid file says otherwise (setsid forks when it has to)
    export DOCKER_HOST="unix://$private/docker.sock"
    for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    [ -s "$private/dockerd.pid" ] && dockerd_pid="$(cat "$private/dockerd.pid")"
    docker info >/dev/null 2>&1 || { tail -20 "$private/dockerd.log" >&2; die "the private dockerd did not come up"; }
    say "dockerd $(docker version --format '{{.Server.Version}}') is up"
fi

# --- 2. the compose CLI -------------------------------------------------------------------------------
if docker compose version >/dev/null 2>&1; then
    compose="docker compose"
else
    compose="$("$repo/compose/compose-plugin.sh")"
fi
say "compose: $($compose version)"

for project in rollout-bus-ctest-single rollout-bus-ctest-cluster rollout-bus-ctest-secure; do   # never take down a stack not ours
    [ -z "$(docker ps -aq --filter "label=com.docker.compose.project=$project")$(docker volume ls -q \
            --filter "label=com.docker.compose.project=$project")" ] ||
        die "compose project $project already exists on this daemon: not touched (docker compose -p $project down -v)"
done

# --- 3. images ----------------------------------------------------------------------------------------
build_local() {  # build_local TAG DIR [FILE...]: a compose/images/DIR image on the base, context in a temp dir
    local tag="$1" dir="$2"; shift 2
    local context; context="$(mktemp -d)"
    cp -a "$repo/compose/images/$dir/." "$context/"
    for extra in "$@"; do cp -a "$extra" "$context/"; done
    say "building $tag (compose/images/$dir on $ROLLOUT_BUS_BASE_IMAGE; cached layers are reused)"
    if ! DOCKER_BUILDKIT=0 docker build --quiet --network host --build-arg "BASE_IMAGE=$ROLLOUT_BUS_BASE_IMAGE" \
            -t "$tag" "$context" >"$context.log" 2>&1; then
        tail -30 "$context.log" >&2; rm -rf "$context" "$context.log"; die "building $tag failed"
    fi
    rm -rf "$context" "$context.log"
}

if docker image inspect "$ROLLOUT_BUS_BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $ROLLOUT_BUS_BASE_IMAGE is cached"
else
    need_package debootstrap debootstrap
    root="$(mktemp -d /tmp/rollout-bus-rootfs.XXXXXX)"
    say "debootstrap --variant=minbase bookworm (about a minute) ..."
    debootstrap --variant=minbase bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" \
        > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -rf "$root" "$root.log"; die "debootstrap failed"; }
    rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*
    tar -C "$root" -c . | docker import --change 'CMD ["bash"]' - "$ROLLOUT_BUS_BASE_IMAGE" >/dev/null
    rm -rf "$root" "$root.log"
    say "imported $ROLLOUT_BUS_BASE_IMAGE"
fi
# The build machine's CA bundle: where TLS to PyPI passes through a proxy with its own root (see the Dockerfile).
ca_bundle="$(mktemp -d)/host-ca-certificates.crt"
cp "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" "$ca_bundle" 2>/dev/null || : > "$ca_bundle"
build_local "$ROLLOUT_BUS_PYTHON_IMAGE" python "$ca_bundle"
rm -rf "$(dirname "$ca_bundle")"
libs="$("$python" -m rollout_bus.local_kafka.runtime)"   # the jars the project runs its own broker from
kafka_ctx_libs="$(mktemp -d)/libs"
cp -a "$libs" "$kafka_ctx_libs" && rm -f "$kafka_ctx_libs/.complete"
build_local "$ROLLOUT_BUS_KAFKA_IMAGE" kafka "$kafka_ctx_libs"
build_local "$ROLLOUT_BUS_PROMETHEUS_IMAGE" prometheus
rm -rf "$(dirname "$kafka_ctx_libs")"
say "building the rollout-bus image through compose (the first time pip installs torch: a few minutes) ..."
# One service builds the image every project service runs; its steps are shown as they start.
set +e
$compose -f "$repo/compose/docker-compose.yml" --progress plain build topics 2>&1 | tee "$cache/compose-build.log" |
    grep --line-buffered -E '^#[0-9]+ (\[|ERROR)' | grep --line-buffered -v 'internal\]' |
    sed -u 's/^/  build: /'
built="${PIPESTATUS[0]}"
set -e
[ "$built" = 0 ] || { tail -30 "$cache/compose-build.log" >&2; die "building the rollout-bus image failed (exit $built)"; }
if [ -n "$dockerd_pid" ]; then   # our own daemon only: bound its disk (old image versions, build cache LRU)
    docker image prune -f >/dev/null
    docker builder prune -f --keep-storage "${COMPOSE_TEST_BUILD_CACHE:-12GB}" >/dev/null 2>&1 || true
fi
say "images ready: $(docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'rollout-bus' | paste -sd ';')"

# --- 4. the stacks ------------------------------------------------------------------------------------
extra=(); [ "$keep" = 1 ] && extra=(--keep)
if [ "$runs" = single ] || [ "$runs" = all ]; then
    projects+=(rollout-bus-ctest-single)
    ROLLOUT_BUS_EPISODES="$episodes" "$python" "$repo/compose/stack_check.py" single --compose "$compose" \
        --episodes "$episodes" "${extra[@]}"
fi
if [ "$runs" = cluster ] || [ "$runs" = all ]; then
    projects+=(rollout-bus-ctest-cluster)
    ROLLOUT_BUS_EPISODES="$((2 * episodes))" "$python" "$repo/compose/stack_check.py" cluster --compose "$compose" \
        --episodes "$((2 * episodes))" "${extra[@]}"
fi
if [ "$runs" = secure ] || [ "$runs" = all ]; then
    projects+=(rollout-bus-ctest-secure)
    secrets_dir="$(mktemp -d /tmp/rollout-bus-secrets.XXXXXX)"
    "$python" -m rollout_bus.cli.main kafka secrets --dir "$secrets_dir" >/dev/null
    export ROLLOUT_BUS_SECRETS_DIR="$secrets_dir"
    ROLLOUT_BUS_EPISODES="$episodes" "$python" "$repo/compose/stack_check.py" secure --compose "$compose" \
        --episodes "$episodes" "${extra[@]}"
fi
say "compose test passed ($runs) in $((SECONDS - began))s"
