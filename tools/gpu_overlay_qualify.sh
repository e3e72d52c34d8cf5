#!/usr/bin/env bash
# GPU qualification of the vLLM overlay (docs/gpu.md): run from a checkout on a CUDA host.
#   VLLM_PY=vllm-py.tar.xz WHEELS=dir OUT=dir bash tools/gpu_overlay_qualify.sh
# VLLM_PY: tar.xz of the vLLM 0.33.0 wheel's Python files (tools/gpu_overlay_qualify.sh pack WHEEL);
# WHEELS: jsonschema, jsonschema-specifications, referencing, rpds-py wheels when the host lacks them.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = pack ]; then  # pack WHEEL -> vllm-py.tar.xz (Python files only, no compiled extension)
  tmp="$(mktemp -d)"; unzip -q "$2" 'vllm/*.py' 'vllm-*.dist-info/*' -d "$tmp"
  (cd "$tmp" && tar -cf - vllm vllm-*.dist-info | xz -T0 -6) > "${3:-vllm-py.tar.xz}"; rm -rf "$tmp"; exit 0
fi
: "${VLLM_PY:?set VLLM_PY to the tar.xz of the vLLM Python files}" "${OUT:?set OUT to an output directory}"
site=/tmp/dsv41-site; src=/tmp/dsv41-vllm-src; work=/tmp/dsv41-qual
mkdir -p "$site" "$src" "$work" "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl
fi
tar -xJf "$VLLM_PY" -C "$src"
export PYTHONPATH="$here/python:$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 VLLM_USE_BREAKABLE_CUDAGRAPH=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton, cupy; print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__)'
python3 "$here/tests/gpu/vllm_overlay_qualify.py" --vllm-src "$src" --work "$work" --out "$OUT/overlay_qualify.json" ${QUAL_ARGS:-}
