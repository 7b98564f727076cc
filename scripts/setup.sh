#!/usr/bin/env bash
# The project's one set-up command (README "Install"; CI runs exactly this): the Python package
# with its test extras, and promtool, which the metrics test runs on /metrics.
#
# PyPI ships no promtool, so it comes from Debian's `prometheus` package, unpacked into .tools/
# instead of installed: installing the package would also start a Prometheus server. promtool is
# one static binary, so unpacking is enough. Skipped where a promtool is already on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

pip install "torch==2.13.0" -e ".[test]"

if ! command -v promtool >/dev/null && [ ! -x .tools/prometheus/usr/bin/promtool ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if ! (cd "$tmp" && apt-get download prometheus); then
    # A machine whose package lists were never fetched: refresh them (needs root) and retry.
    apt-get update -qq
    (cd "$tmp" && apt-get download prometheus)
  fi
  mkdir -p .tools/prometheus
  dpkg-deb -x "$tmp"/prometheus_*.deb .tools/prometheus
  .tools/prometheus/usr/bin/promtool --version | head -n 1
fi
