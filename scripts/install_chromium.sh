#!/usr/bin/env bash
# Installs Debian's headless Chromium for the UI's browser test (never downloads a browser
# bundle from a test tool). Idempotent; needs root or sudo and apt.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
command -v apt-get >/dev/null 2>&1 || { echo "install_chromium.sh: no apt-get on this machine" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null 2>&1
