#!/usr/bin/env bash
# Headless Chromium for the dashboard's browser test (tests/gateway/test_dashboard_browser.py, marker
# `browser`): Debian's `chromium` package, driven by Playwright through its executable path. Playwright
# never downloads a browser here. Idempotent: with /usr/bin/chromium present it does nothing.
#
#   sudo deploy/host/setup_browser.sh          # install (root), or say what is missing
#   deploy/host/setup_browser.sh check         # exit 0 when the browser is there
set -euo pipefail

CHROMIUM="${BELAYER_CHROMIUM:-/usr/bin/chromium}"

case "${1:-install}" in
  check)
    if [ -x "$CHROMIUM" ]; then echo "[browser] $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"; exit 0; fi
    echo "[browser] missing: $CHROMIUM"; exit 1 ;;
  install)
    if [ -x "$CHROMIUM" ]; then exit 0; fi
    if [ "$(id -u)" != 0 ]; then
      echo "[browser] not root: skipping; run 'sudo $0' to install Debian's chromium"; exit 0
    fi
    echo "[browser] installing Debian's chromium (headless, for the dashboard's browser test)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
    "$CHROMIUM" --version ;;
  *)
    echo "usage: $0 [install|check]" >&2; exit 2 ;;
esac
