#!/usr/bin/env bash
# Debian's PostgreSQL server binaries and HAProxy for the replicated-gateway tests (marker `postgres`):
# the tests run `initdb` and `postgres` themselves, in a temporary directory, as an unprivileged user
# (tests/postgres_server.py), and put `haproxy` in front of two gateways (tests/gateway/test_replicas.py);
# no cluster or service is created or started here. Idempotent: with both present it does nothing.
#
#   sudo deploy/host/setup_postgres.sh install   # install (root), or say what is missing
#   deploy/host/setup_postgres.sh check          # exit 0 when the binaries are there
set -euo pipefail

HAPROXY="${BELAYER_HAPROXY:-/usr/sbin/haproxy}"

find_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    if [ -x "$d/initdb" ] && [ -x "$d/postgres" ]; then echo "$d"; fi
  done | sort -V | tail -n 1
}

case "${1:-install}" in
  check)
    dir="$(find_bindir)"
    if [ -n "$dir" ] && [ -x "$HAPROXY" ]; then
      echo "[postgres] $("$dir/postgres" --version); $("$HAPROXY" -v | sed -n 1p)"; exit 0
    fi
    echo "[postgres] missing: Debian's postgresql (initdb, postgres) or haproxy"; exit 1 ;;
  install)
    if [ -n "$(find_bindir)" ] && [ -x "$HAPROXY" ]; then exit 0; fi
    if [ "$(id -u)" != 0 ]; then
      echo "[postgres] not root: skipping; run 'sudo $0 install' to install Debian's postgresql and haproxy"; exit 0
    fi
    echo "[postgres] installing Debian's postgresql and haproxy (for the postgres tests)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # the package's own cluster is not wanted: the tests run initdb themselves
    mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/belayer.conf
    # (Debian's default haproxy.cfg has no frontend: its service, where an init system starts it, listens nowhere)
    apt-get install -y -qq postgresql haproxy >/dev/null
    "$(find_bindir)/postgres" --version
    "$HAPROXY" -v | sed -n 1p ;;
  *)
    echo "usage: $0 [install|check]" >&2; exit 2 ;;
esac
