#!/usr/bin/env bash
# kvtrace on one GPU (issue #19), one prepared run: environment, export for CUDA, verify, CUDA-graph checks and
# the decode bench, as JSON lines on stdout and in $OUT (gpu.jsonl, verify-*.json, trace.txt, gpu.log,
# nvidia-smi.txt). Runs from this working tree with the machine's own torch (PYTHONPATH=src, nothing
# installed); wheels in .whl/ (if any) are installed to /tmp/site first. Arguments go to bench/gpu.py
# (e.g. --skip hf-compile, --budget-s 400). README "CUDA" says how a session with a GPU calls it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv \
  >"$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" bench/gpu.py --device cuda --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu.log"
status=${PIPESTATUS[0]}
# GPU_PYTEST=1: also the test suite's GPU tests (tiny models; a few AOTInductor compiles), log in $OUT/pytest.log
if [ "${GPU_PYTEST:-0}" = 1 ]; then
  "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/runtime/test_graphs.py tests/artifact/test_artifact_device.py \
    tests/runtime/test_jit_cuda.py >"$OUT/pytest.log" 2>&1
  pytest_status=$?
  tail -3 "$OUT/pytest.log"
  [ "$status" = 0 ] && status=$pytest_status
fi
exit "$status"
