#!/usr/bin/env bash
# Installs and starts what the container tests need on a fresh Debian machine with no container
# registry: the Docker engine (Debian's docker.io) and a locally built image holding PostgreSQL 15
# and Redis (built with mmdebstrap from Debian packages, then `docker import`ed).
#
# Sourced by .ci/run; also usable alone: `bash .ci/docker.sh` prepares a developer machine.
# Exports the harness's environment (see README "How the tests find services").
set -euo pipefail

IMAGE="${IDEMPOTENCY_TEST_IMAGE:-idempotency-services:bookworm}"

need_pkg() { dpkg -s "$1" >/dev/null 2>&1 || MISSING="$MISSING $1"; }
MISSING=""
command -v dockerd >/dev/null 2>&1 || need_pkg docker.io
command -v mmdebstrap >/dev/null 2>&1 || need_pkg mmdebstrap
# One Redis test makes a host vanish by dropping its packets on the loopback interface.
command -v iptables >/dev/null 2>&1 || need_pkg iptables
if [ -n "$MISSING" ]; then
  echo "==> installing:$MISSING"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q $MISSING
fi

# The engine: no bridge and no iptables on these machines; containers use the host
# network and the harness passes each service a free port on 127.0.0.1.
if ! docker info >/dev/null 2>&1; then
  echo "==> starting dockerd"
  nohup dockerd --bridge=none --iptables=false --ip-masq=false --storage-driver=overlay2 \
    >/var/log/idempotency-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -50 /var/log/idempotency-dockerd.log; exit 1; }
fi

# Containers leaked by an earlier run killed with SIGKILL (the harness labels what it starts,
# with its process id). Those of a process still running (another test run, a fault campaign)
# are left alone: removed under it, they failed that run midway.
remove_leftovers() {
  local c pid
  for c in $(docker ps -aq --filter label=io.idempotency.test=1); do
    pid=$(docker inspect -f '{{ index .Config.Labels "io.idempotency.test.pid" }}' "$c" 2>/dev/null || true)
    if ! [[ "$pid" =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null; then
      docker rm -f -v "$c" >/dev/null 2>&1 || true
    fi
  done
}
remove_leftovers

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "==> building $IMAGE with mmdebstrap (Debian bookworm, postgresql-15, redis)"
  tarball=$(mktemp /tmp/idempotency-rootfs.XXXXXX.tar)
  mmdebstrap --variant=minbase --aptopt='APT::Install-Recommends "false"' \
    --include=postgresql-15,redis-server,redis-tools bookworm "$tarball" </dev/null
  docker import "$tarball" "$IMAGE"
  rm -f "$tarball"
fi

export IDEMPOTENCY_TEST_IMAGE="$IMAGE"
export IDEMPOTENCY_TEST_NETWORK=host
