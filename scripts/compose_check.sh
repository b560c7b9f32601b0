#!/usr/bin/env bash
# make compose-check: build the images from Debian's packages (no registry), bring the compose
# stack up for real and use it from the host, then leave nothing running:
#   daemon (its own unless one answers) -> images -> up -> health -> host client puts/gets ->
#   `kvsplice stats` -> Prometheus scrapes the sidecar -> restart keeps the LMDB volume's
#   segments -> graceful stop -> down (ps empty) -> the daemon it started is stopped.
# It skips, saying why, only where Docker cannot run at all. Any other failing step fails it.
#   scripts/compose_check.sh [PYTHON]       (PYTHON: the venv whose kvsplice is the host client)
# Knobs: KVSPLICE_COMPOSE_CACHE (debootstrap tarball, the daemon's data root: a second run
# reuses both), KVSPLICE_HOST_{GRPC,ADMIN}_PORT / PROMETHEUS_HOST_PORT (default: free ports),
# COMPOSE_CHECK_EXTRA_FILE (one more compose file on top), DOCKERD_STORAGE_DRIVER (vfs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-.venv/bin/python}
KVSPLICE="$(dirname "$PYTHON")/kvsplice"
cache=${KVSPLICE_COMPOSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvsplice/compose-check}
project=${COMPOSE_CHECK_PROJECT:-kvsplice-check}
namespace=compose-check
num_segments=8
python_image=kvsplice-local/python:3.11-bookworm
start_s=$(date +%s)
started_daemon=0
brought_up=0
dockerd_pid=

say() { echo "compose-check: $*"; }
step() { say "[$(($(date +%s) - start_s)) s] $*"; }
fail() {
  echo "compose-check: FAILED: $*" >&2
  exit 1
}
skip() {
  say "SKIPPED: $*"
  exit 0
}

# ---- tools: Docker, debootstrap and compose, installed from Debian when missing ---------------
missing_packages() {
  if ! command -v docker >/dev/null || { ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null; }; then
    echo docker.io
  fi
  command -v debootstrap >/dev/null || echo debootstrap
  docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || echo docker-compose
}

install_tools() {
  local packages
  packages=$(missing_packages | tr '\n' ' ')
  [ -z "$packages" ] && return
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    skip "missing $packages and this user cannot install them (needs root and apt-get)"
  fi
  step "installing $packages(Debian packages)"
  apt-get update -qq
  # shellcheck disable=SC2086  # one word per package
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >"$cache/apt.log" 2>&1 \
    || { tail -n 20 "$cache/apt.log" >&2; fail "apt-get install $packages"; }
}

# ---- the daemon: the one that answers, else one of our own (own socket, data root, pidfile) ---
start_daemon() {
  if docker info >/dev/null 2>&1; then
    say "using the Docker daemon that runs already (${DOCKER_HOST:-default socket}); it is left running"
    return
  fi
  [ "$(id -u)" = 0 ] || skip "no Docker daemon answers and starting one needs root"
  local run_dir=/run/kvsplice-compose-check
  mkdir -p "$run_dir" "$cache/docker"
  stop_stale_daemon "$run_dir/dockerd.pid"
  step "starting dockerd (storage driver ${DOCKERD_STORAGE_DRIVER:-vfs}, data root $cache/docker)"
  dockerd --storage-driver="${DOCKERD_STORAGE_DRIVER:-vfs}" --data-root "$cache/docker" \
    --exec-root "$run_dir/exec" --pidfile "$run_dir/dockerd.pid" -H "unix://$run_dir/docker.sock" \
    >"$cache/dockerd.log" 2>&1 &
  dockerd_pid=$!
  started_daemon=1
  export DOCKER_HOST="unix://$run_dir/docker.sock"
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return
    if ! kill -0 "$dockerd_pid" 2>/dev/null; then
      started_daemon=0
      tail -n 15 "$cache/dockerd.log"
      skip "dockerd cannot run here (it exited; log above, $cache/dockerd.log)"
    fi
    sleep 1
  done
  fail "dockerd did not answer within 60 s ($cache/dockerd.log)"
}

stop_stale_daemon() {  # a daemon an interrupted run left behind (ours: same pidfile)
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ]; then
    say "stopping the dockerd (pid $pid) an interrupted run left"
    kill -TERM "$pid"
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
}

stop_daemon() {
  [ "$started_daemon" = 1 ] || return 0
  docker image prune -f >/dev/null 2>&1 || true  # superseded builds: only in our own daemon
  kill -TERM "$dockerd_pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
  if kill -0 "$dockerd_pid" 2>/dev/null; then
    kill -KILL "$dockerd_pid"
    say "dockerd (pid $dockerd_pid) ignored SIGTERM for 30 s: killed"
  fi
  wait "$dockerd_pid" 2>/dev/null || true
  started_daemon=0
  step "stopped the Docker daemon it started (pid $dockerd_pid)"
}

cleanup() {
  local rc=$?
  if [ "$brought_up" = 1 ]; then
    [ "$rc" = 0 ] || compose logs --no-color --tail 40 >&2 || true
    compose --profile monitoring down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  stop_daemon
  exit "$rc"
}

# ---- docker CLI and compose ------------------------------------------------------------------
use_buildkit_cli() {  # `docker build` must run BuildKit (the Dockerfile's RUN --mount)
  export DOCKER_BUILDKIT=1
  docker buildx version >/dev/null 2>&1 && return
  local cli major
  for cli in $(type -ap docker) /usr/bin/docker; do
    major=$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
    # Before 23 the CLI drives the daemon's BuildKit itself; later ones need buildx.
    if [ -n "$major" ] && [ "$major" -lt 23 ]; then
      mkdir -p "$cache/bin"
      ln -sf "$cli" "$cache/bin/docker"
      export PATH="$cache/bin:$PATH"
      say "docker CLI for BuildKit builds: $cli (the first docker on PATH has no buildx)"
      return
    fi
  done
  fail "no docker CLI here builds with BuildKit (install buildx)"
}

compose_files=(-f docker-compose.yml -f docker-compose.local.yml)
[ -n "${COMPOSE_CHECK_EXTRA_FILE:-}" ] && compose_files+=(-f "$COMPOSE_CHECK_EXTRA_FILE")
compose() {
  if docker compose version >/dev/null 2>&1; then
    docker compose -p "$project" "${compose_files[@]}" "$@"
  else
    # Debian bookworm's docker-compose 1.29 builds through the docker CLI this way.
    COMPOSE_DOCKER_CLI_BUILD=1 docker-compose -p "$project" "${compose_files[@]}" "$@"
  fi
}

logged() {  # run "$@" with its output in $cache/logs/NAME.log, shown on failure
  local name=$1
  shift
  "$@" >"$cache/logs/$name.log" 2>&1 || {
    tail -n 40 "$cache/logs/$name.log" >&2
    fail "$name: $* (log: $cache/logs/$name.log)"
  }
}

# ---- checks ------------------------------------------------------------------------------------
wait_healthy() {
  local service=$1 cid status
  cid=$(compose ps -q "$service")
  [ -n "$cid" ] || fail "service $service has no container"
  for _ in $(seq 60); do
    status=$(docker inspect -f '{{.State.Status}} {{.State.Health.Status}}' "$cid")
    [ "$status" = "running healthy" ] && return
    [ "${status%% *}" = running ] || fail "$service is ${status%% *}"
    sleep 2
  done
  fail "$service not healthy within 120 s (state: $status)"
}

http_get() {  # URL -> body on stdout; exit 1 unless 200
  "$PYTHON" -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"
}

wait_ready() {
  for _ in $(seq 60); do
    http_get "http://127.0.0.1:$KVSPLICE_HOST_ADMIN_PORT/readyz" >/dev/null 2>&1 && return
    sleep 1
  done
  fail "/readyz did not answer 200 within 60 s"
}

stats_segments() {  # the sidecar's own count of the namespace's segments, via `kvsplice stats`
  "$KVSPLICE" stats --admin-url "http://127.0.0.1:$KVSPLICE_HOST_ADMIN_PORT" -n "$namespace" --json \
    | "$PYTHON" -c 'import json, sys; print(sum(r["num_segments"] for r in json.load(sys.stdin)["namespaces"]))'
}

lmdb_records() {  # records in the volume's LMDB environment itself, read inside the container
  compose exec -T kvsplice python -c '
import lmdb
from kvsplice.storage.lmdb_tier import DB_NAME
env = lmdb.open("/data/lmdb", readonly=True, lock=False, max_dbs=1)
with env.begin(db=env.open_db(DB_NAME, create=False)) as txn:
    print(txn.stat()["entries"])'
}

check_scrape() {
  local url="http://127.0.0.1:$PROMETHEUS_HOST_PORT" health=
  for _ in $(seq 45); do
    health=$(http_get "$url/api/v1/targets" 2>/dev/null | "$PYTHON" -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
print(",".join(f"{t['"'"'scrapeUrl'"'"']}={t['"'"'health'"'"']}" for t in targets))') || true
    [[ "$health" == *"=up"* ]] && break
    sleep 2
  done
  [[ "$health" == *"=up"* ]] || fail "Prometheus scrape target not up within 90 s (${health:-no answer})"
  say "Prometheus scrape target: $health"
  http_get "$url/api/v1/query?query=kvsplice_segments" | "$PYTHON" -c '
import json, sys
(sample,) = json.load(sys.stdin)["data"]["result"]
print("compose-check: Prometheus reads kvsplice_segments =", sample["value"][1])'
}

image_sizes() {
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E '^(kvsplice:latest|kvsplice-local/)' | sort | sed 's/^/compose-check:   /'
}

# ---- the run -------------------------------------------------------------------------------------
mkdir -p "$cache/logs"
exec 9>"$cache/lock"
flock -n 9 || fail "another compose-check is using $cache"
trap cleanup EXIT
install_tools
start_daemon
use_buildkit_cli
read -r grpc_port admin_port prom_port < <("$PYTHON" -c '
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
export KVSPLICE_HOST_GRPC_PORT=${KVSPLICE_HOST_GRPC_PORT:-$grpc_port}
export KVSPLICE_HOST_ADMIN_PORT=${KVSPLICE_HOST_ADMIN_PORT:-$admin_port}
export PROMETHEUS_HOST_PORT=${PROMETHEUS_HOST_PORT:-$prom_port}
compose --profile monitoring down -v --remove-orphans >/dev/null 2>&1 || true  # an aborted run's

step "base image: Debian bookworm minbase (debootstrap, cached in $cache)"
logged debian-root scripts/debian_root.sh "$cache"
step "building $python_image (Debian's python3 3.11)"
context="$cache/local-context"  # deploy/local plus the host's own CAs (local-ca/)
rm -rf "$context" && cp -r deploy/local "$context"
cp /usr/local/share/ca-certificates/*.crt "$context/local-ca/" 2>/dev/null || true
logged build-python docker build --target python -t "$python_image" "$context"
step "docker compose build: kvsplice (from its wheel), valkey, prometheus"
logged compose-build compose build kvsplice valkey prometheus
say "images:"
image_sizes
for image in kvsplice:latest kvsplice-local/valkey:8.0-bookworm kvsplice-local/prometheus:2.42-bookworm; do
  user=$(docker image inspect -f '{{.Config.User}}' "$image")
  case "$user" in "" | root | 0) fail "$image runs as root" ;; esac
  say "  $image runs as $user"
done

step "docker compose up -d kvsplice (and valkey, which it waits for)"
brought_up=1
logged compose-up compose up -d --no-build kvsplice
wait_healthy valkey
wait_healthy kvsplice
wait_ready
step "sidecar healthy on 127.0.0.1:$KVSPLICE_HOST_GRPC_PORT (admin :$KVSPLICE_HOST_ADMIN_PORT), uid $(compose exec -T kvsplice id -u)"
"$PYTHON" scripts/compose_client.py put --target "127.0.0.1:$KVSPLICE_HOST_GRPC_PORT" \
  --namespace "$namespace" --num-segments "$num_segments"
"$KVSPLICE" stats --admin-url "http://127.0.0.1:$KVSPLICE_HOST_ADMIN_PORT"

step "monitoring profile: Prometheus (Grafana has no Debian package: not started)"
logged compose-up-prometheus compose --profile monitoring up -d --no-build prometheus
check_scrape

before_stats=$(stats_segments)
before_lmdb=$(lmdb_records)
step "docker compose restart kvsplice"
restart_start=$(date +%s)
logged compose-restart compose restart kvsplice
wait_healthy kvsplice
wait_ready
after_stats=$(stats_segments)
after_lmdb=$(lmdb_records)
say "segments before restart: $before_stats (LMDB records $before_lmdb); after: $after_stats (LMDB records $after_lmdb); back in $(($(date +%s) - restart_start)) s"
[ "$before_stats" = "$num_segments" ] || fail "the sidecar counted $before_stats segments, not $num_segments"
[ "$before_stats" = "$after_stats" ] && [ "$before_lmdb" = "$after_lmdb" ] \
  || fail "the restart lost segments: $before_stats -> $after_stats (LMDB records $before_lmdb -> $after_lmdb)"
"$PYTHON" scripts/compose_client.py verify --target "127.0.0.1:$KVSPLICE_HOST_GRPC_PORT" \
  --namespace "$namespace" --num-segments "$num_segments"

step "graceful stop (stop_grace_period 30s)"
cid=$(compose ps -q kvsplice)
stop_start=$(date +%s)
logged compose-stop compose stop kvsplice
stop_s=$(($(date +%s) - stop_start))
exit_code=$(docker inspect -f '{{.State.ExitCode}}' "$cid")
[ "$exit_code" = 0 ] || fail "the sidecar exited $exit_code on SIGTERM (137: killed at the grace period)"
# Its last lines, read whole (`| grep -q` would end the pipe early: pipefail reads SIGPIPE).
last_lines=$(docker logs --tail 5 "$cid" 2>&1)
[[ "$last_lines" == *"kvsplice store stopped"* ]] || fail "no clean shutdown in the sidecar's log"
say "the sidecar drained and exited 0 on SIGTERM in $stop_s s"

step "docker compose down"
logged compose-down compose --profile monitoring down -v --remove-orphans
brought_up=0
say "docker compose ps after down:"
compose --profile monitoring ps | sed 's/^/compose-check:   /'
[ -z "$(compose --profile monitoring ps -q)" ] || fail "containers remain after down"
[ -z "$(docker ps -aq --filter "label=com.docker.compose.project=$project")" ] \
  || fail "containers of $project remain after down"
stop_daemon
say "OK in $(($(date +%s) - start_s)) s"
