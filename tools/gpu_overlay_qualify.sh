#!/usr/bin/env bash
# GPU qualification and step benchmark of the vLLM overlay (docs/gpu.md): run from a checkout on a CUDA host.
#   VLLM_PY=vllm-py.tar.xz WHEELS=dir OUT=dir bash tools/gpu_overlay_qualify.sh [qualify|step]
#   bash tools/gpu_overlay_qualify.sh pack WHEEL [vllm-py.tar.xz]
# qualify (default): tests/gpu/vllm_overlay_qualify.py (QUAL_ARGS, e.g. "--bench-only --reps 21 --reuse-tables");
# step: tests/gpu/vllm_overlay_step_bench.py (STEP_ARGS, e.g. "--reuse-tables --kill-server"; STEP_RUNS runs, default 1;
#   each into the next overlay_step_N.json not in OUT yet).
# VLLM_PY: tar.xz of the vLLM 0.33.0 wheel's Python files; WHEELS: jsonschema, jsonschema-specifications,
# referencing, rpds-py wheels when the host lacks them; OUT: where the JSON goes (on a lent machine: $OUT).
# TRANSPORT=c++ (default): builds the extensions (dsv41.transport._fastrow, dsv41.overlay._core) in place when
# either does not import and refuses to run without them (a benchmark labelled C++ must be one); TRANSPORT=python: the pure-Python transport.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
mode="${1:-qualify}"
if [ "$mode" = pack ]; then  # pack WHEEL -> vllm-py.tar.xz (Python files only, no compiled extension)
  tmp="$(mktemp -d)"; unzip -q "$2" 'vllm/*.py' 'vllm-*.dist-info/*' -d "$tmp"
  (cd "$tmp" && tar -cf - vllm vllm-*.dist-info | xz -T0 -6) > "${3:-vllm-py.tar.xz}"; rm -rf "$tmp"; exit 0
fi
case "$mode" in qualify|step) ;; *) echo "gpu_overlay_qualify: unknown mode '$mode' (qualify, step, pack)" >&2; exit 2;; esac
: "${VLLM_PY:?set VLLM_PY to the tar.xz of the vLLM Python files}" "${OUT:?set OUT to an output directory}"
transport="${TRANSPORT:-c++}"
case "$transport" in c++|python) ;; *) echo "gpu_overlay_qualify: TRANSPORT must be c++ or python, not '$transport'" >&2; exit 2;; esac
site=/tmp/dsv41-site; src=/tmp/dsv41-vllm-src; work=${WORK:-/tmp/dsv41-qual}
mkdir -p "$site" "$src" "$work" "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl
fi
[ -d "$src/vllm" ] || tar -xJf "$VLLM_PY" -C "$src"
export PYTHONPATH="$here/python:$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 VLLM_USE_BREAKABLE_CUDAGRAPH=1
# c++ only when both the transport's and the overlay core's extensions import (dsv41.overlay.core)
impl() { python3 -c 'from dsv41.overlay import core; print(core.implementation())'; }
if [ "$transport" = c++ ]; then
  unset DSV41_TRANSPORT_PURE
  if [ "$(impl)" != c++ ]; then  # build the extension in place (needs g++, the Python headers, pybind11)
    (cd "$here" && python3 setup.py -q build_ext --inplace >"$OUT/build_ext.log" 2>&1) || true
  fi
  if [ "$(impl)" != c++ ]; then
    echo "gpu_overlay_qualify: TRANSPORT=c++ but dsv41.transport._fastrow or dsv41.overlay._core does not import (build log: $OUT/build_ext.log); refusing to report a C++ benchmark" >&2
    exit 3
  fi
else
  export DSV41_TRANSPORT_PURE=1
fi
echo "transport and worker core implementation: $(impl) (client and table server share this PYTHONPATH)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import torch, triton, cupy; print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__)'
# QUAL_ARGS and STEP_ARGS are word lists (split on blanks, never globbed)
read -ra qual_args <<< "${QUAL_ARGS:-}"
read -ra step_args <<< "${STEP_ARGS:-}"
if [ "$mode" = qualify ]; then
  python3 "$here/tests/gpu/vllm_overlay_qualify.py" --vllm-src "$src" --work "$work" --out "$OUT/overlay_qualify.json" "${qual_args[@]}"
else
  rc=0; k=0
  for i in $(seq 1 "${STEP_RUNS:-1}"); do
    k=$((k + 1)); while [ -e "$OUT/overlay_step_$k.json" ]; do k=$((k + 1)); done  # earlier runs' files stay
    python3 "$here/tests/gpu/vllm_overlay_step_bench.py" --vllm-src "$src" --work "$work" \
      --out "$OUT/overlay_step_$k.json" --tag "run $i" "${step_args[@]}" || rc=$?
  done
  exit "$rc"
fi
