#!/usr/bin/env bash
# Debian's chromium-headless-shell (the browser tests/test_report_browser.py renders report.html in)
# and a CJK font (the report's Chinese prompts render as text, not boxes, in its screenshot).
# Installed once per machine; about 10 s from the Debian registry.
set -euo pipefail
if command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium-headless-shell fonts-wqy-microhei >/dev/null
