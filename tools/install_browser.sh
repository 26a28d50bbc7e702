#!/usr/bin/env bash
# Install the browser tests/test_browser.py drives: Debian's chromium package.
#
# Why Debian's and not Playwright's own?  `playwright install` downloads a browser
# build from its CDN, which machines here cannot reach; the distribution package
# comes from the same mirror as every other system package.  Playwright for
# Python (pinned in pyproject's dev extra) then launches it via executable_path.
#
# Idempotent: does nothing when chromium is already installed.  Uses sudo when
# not root.  Called by `make browser` and by .ci/run before `make test`.
set -euo pipefail

if [ -x /usr/lib/chromium/chromium ] || command -v chromium >/dev/null 2>&1; then
    echo "install_browser: chromium is already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install Chromium yourself (tests/test_browser.py skips without it)" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "install_browser: not root and no sudo; run as root: apt-get install chromium" >&2
        exit 1
    fi
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
echo "install_browser: installing chromium with apt-get"
for attempt in 1 2; do
    if $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; then
        break
    fi
    [ "$attempt" = 2 ] && { echo "install_browser: apt-get failed twice" >&2; exit 1; }
    sleep 5
done
echo "install_browser: $(/usr/lib/chromium/chromium --version 2>/dev/null || chromium --version)"
