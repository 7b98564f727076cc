#!/usr/bin/env bash
# The nightly sizes of the randomized suites: the fuzz tests of every boundary at 100x the CI size
# (PDSERVE_FUZZ_SCALE) and the fault suite at 1,000 scenarios (PDSERVE_FAULT_SCENARIOS). The fuzz
# seed changes per night unless PDSERVE_FUZZ_SEED is set; the first line printed names it, and
# PDSERVE_FUZZ_SEED=<it> replays a failure.
# Usage: bash scripts/nightly.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PDSERVE_FUZZ_SCALE="${PDSERVE_FUZZ_SCALE:-100}"
export PDSERVE_FAULT_SCENARIOS="${PDSERVE_FAULT_SCENARIOS:-1000}"
export PDSERVE_FUZZ_SEED="${PDSERVE_FUZZ_SEED:-$(date +%Y%m%d)}"
echo "nightly: PDSERVE_FUZZ_SCALE=$PDSERVE_FUZZ_SCALE PDSERVE_FAULT_SCENARIOS=$PDSERVE_FAULT_SCENARIOS PDSERVE_FUZZ_SEED=$PDSERVE_FUZZ_SEED"
python -m pytest -q tests/unit/test_token_channel_fuzz.py tests/unit/test_edge_fuzz.py tests/faults "$@"
