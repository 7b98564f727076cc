#!/usr/bin/env bash
# Checks and times the engine on a CUDA GPU: the GPU tests, then the engine benchmark with the
# Triton decode kernels off and on (same card, back to back), then the kernels alone.
# Everything goes to $OUT (or ./gpu-check-out): logs, JSON, and a summary of pass/fail counts.
#
# Needs a CUDA build of torch and the gpu extra (flash-attn-4):
#   pip install torch && pip install -e ".[gpu,test]"
#   bash scripts/gpu_check.sh [quick]
# "quick" runs only the decode-kernel tests and the 1B engine benchmark (about 4 minutes on an
# H200); the full run takes about 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
quick="${1:-}"

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/card.txt"

tests=(tests/gpu)
[ "$quick" = quick ] && tests=(tests/gpu/test_gpu_decode_kernels.py)
# -rfE: the failing tests' names and errors stay in the summary even when the log is cut.
timeout 420 python -m pytest "${tests[@]}" -q -rfE -p no:cacheprovider >"$out/tests.log" 2>&1
echo "tests: $(tail -n 1 "$out/tests.log")"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20

shapes=1b,8b
[ "$quick" = quick ] && shapes=1b
for mode in off on; do
  flag="--no-triton-decode"
  [ "$mode" = on ] && flag="--triton-decode"
  timeout 240 python bench/engine.py --device cuda --shapes "$shapes" $flag --json "$out/engine_$mode.json" \
    >"$out/engine_$mode.log" 2>"$out/engine_$mode.err"
  echo "engine, Triton decode kernels $mode:"
  grep -E "decode step|prefill 4096" "$out/engine_$mode.log"
done

if [ "$quick" != quick ]; then
  timeout 240 python bench/decode_kernels.py --json "$out/kernels.json" >"$out/kernels.log" 2>"$out/kernels.err"
  tail -n 25 "$out/kernels.log"
fi
