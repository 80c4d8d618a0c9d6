#!/usr/bin/env bash
# The test command of the README: the whole suite against real Postgres and Redis.
#
# Services, in order: IDEMPOTENCY_TEST_POSTGRES_URL / IDEMPOTENCY_TEST_REDIS_URL if you run your
# own; else a Docker engine (on a Debian machine without one, as root, .ci/docker.sh installs it
# and builds the local services image); else the tests fail and say what to do.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${IDEMPOTENCY_TEST_POSTGRES_URL:-}${IDEMPOTENCY_TEST_REDIS_URL:-}${IDEMPOTENCY_TEST_SKIP_SERVICES:-}" ]; then
  if ! docker info >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # shellcheck source=../.ci/docker.sh
    source .ci/docker.sh
  fi
  # A locally built image (no registry needed) wins over pulling the official ones.
  local_image="${IDEMPOTENCY_TEST_IMAGE:-idempotency-services:bookworm}"
  if docker image inspect "$local_image" >/dev/null 2>&1; then
    export IDEMPOTENCY_TEST_IMAGE="$local_image"
    export IDEMPOTENCY_TEST_NETWORK="${IDEMPOTENCY_TEST_NETWORK:-host}"
  fi
fi

# Every test binary runs even after one fails: one run shows every failure.
cargo test --workspace --no-fail-fast "$@"
