#!/usr/bin/env bash
# GPU check of apcscore: all GPU work in one call of at most 9 minutes, printed as JSON lines.
#
#   scripts/gpu_check.sh             on the GPU machine (device tool: one call, timeout_s 590)
#   scripts/gpu_check.sh --dry-run   anywhere, on the CPU: tiny shapes, end to end (= GPU_CHECK_SMALL=1)
#
# Parts, in this order (each its own process under its own timeout, see scripts/gpu_check.py): env, the
# gpu/triton tests, the matmul configuration sweep (the later parts run with its proposed table), exactness end
# to end, the invariance tax, the 1B benchmark against transformers, eval-shaped work, an 8B shape and long
# prompts. With $OUT set, the lines also go to
# $OUT/gpu_check.jsonl and a Markdown summary to $OUT/gpu_check_summary.md.
# Uses the machine's own python3 (PYTHON=... to change it) with this checkout on PYTHONPATH: no install.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
args=()
for a in "$@"; do
  case "$a" in
    --dry-run|--small) export GPU_CHECK_SMALL=1 ;;
    *) args+=("$a") ;;
  esac
done
limit=555  # backstop: gpu_check.py keeps its own 540 s deadline and per-part limits
[[ "${GPU_CHECK_SMALL:-0}" == 1 ]] && limit=1500
[[ -n "${OUT:-}" ]] && mkdir -p "$OUT"
exec timeout --kill-after=5 "$limit" "${PYTHON:-python3}" scripts/gpu_check.py ${args[@]+"${args[@]}"}
