#!/usr/bin/env bash
# Full `vllm serve` of a tiny DeepSeek-V4.1-shaped model with the dsv41 overlay (README, "Qualify
# on hardware"). Needs a CUDA host with the vLLM 0.33.0 wheel installed with its own dependencies
# (torch 2.14) and this checkout's package importable (pip install --no-deps -e .). Not runnable in
# CI (no GPU, no vLLM); not run in the session that wrote it (the H200 there had torch 2.11).
#
#   REAL_CONFIG=/opt/dsv41/model/config.json bash tools/qualify_vllm_tiny.sh
#
# REAL_CONFIG: the served checkpoint's config.json; the script keeps its structure and shrinks
# the sizes below (dummy weights, --load-format dummy), and shrinks the Engram vocabulary so the
# tables are small; the Engram layer ids, head count, head dim and n-gram size stay real.
# Checks: (1) vLLM's own path serves (overlay inert, plugin loaded), (2) the overlay refuses
# FULL graphs with the flag, (3) remote Engram + PIECEWISE serves from the table server, (4) the
# same with the server unreachable serves from the exact local fallback: greedy text of (3) and
# (4) identical (the dummy weights are the same in both; vLLM's own dummy tables of (1) are not
# the synthetic rows, so (1) is not compared).
set -euo pipefail
: "${REAL_CONFIG:?set REAL_CONFIG to the checkpoint config.json}"
work="${WORK:-$(mktemp -d /tmp/dsv41-tiny-XXXXXX)}"
port="${PORT:-8123}"
py="${PYTHON:-python3}"
mkdir -p "$work/model" "$work/runtime"

"$py" - "$REAL_CONFIG" "$work" <<'EOF'
import json, sys
from pathlib import Path
from dsv41.engram.layout import EngramLayout
cfg = json.loads(Path(sys.argv[1]).read_text())
work = Path(sys.argv[2])
text = cfg.get("text_config", cfg)
shrink = {"hidden_size": 512, "moe_intermediate_size": 256, "intermediate_size": 512,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
          "num_attention_heads": 8, "vocab_size": text["vocab_size"]}
text.update({k: v for k, v in shrink.items() if k in text or k in ("hidden_size",)})
text["engram_vocab_size"] = 2000
lay = EngramLayout.from_config({**text, "engram_compressed_vocab_size": text.get("engram_compressed_vocab_size", 99092)})
text["engram_num_embeddings"] = lay.rows
(work / "model" / "config.json").write_text(json.dumps(cfg, indent=1))
(work / "engram.json").write_text(json.dumps({**text, "engram_compressed_vocab_size":
                                               text.get("engram_compressed_vocab_size", 99092)}))
print("tiny model:", {k: text.get(k) for k in shrink}, "engram rows", lay.rows)
EOF
cp "$(dirname "$REAL_CONFIG")"/tokenizer* "$work/model/" 2>/dev/null || true

dsv41 engram make-tables --config "$work/engram.json" --out "$work/tables" --seed 41
cp "$work/tables/manifest.json" "$work/runtime/manifest.json"
echo "{\"tables_dir\": \"$work/tables\"}" > "$work/runtime/overlay.json"
dsv41 engram serve --manifest "$work/tables/manifest.json" --listen tcp://127.0.0.1:0 \
  --ready-file "$work/srv.ready" > "$work/srv.log" 2>&1 &
srv=$!
trap 'kill $srv 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$work/srv.ready" ] && break; sleep 0.5; done
url="$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["listen"][0])' "$work/srv.ready")"

serve() {  # serve LOG ARGS... : start vllm, wait for /v1/models, greedy completion -> $work/LOG.txt
  local log="$1"; shift
  vllm serve "$work/model" --load-format dummy --served-model-name tiny --port "$port" \
    --max-model-len 4096 --max-num-batched-tokens 4096 --max-num-seqs 8 "$@" > "$work/$log.log" 2>&1 &
  local pid=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    kill -0 $pid 2>/dev/null || { echo "vllm exited ($log):"; tail -20 "$work/$log.log"; return 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"tiny","prompt":"The quick brown fox jumps over the lazy dog and then","max_tokens":32,"temperature":0}' \
    > "$work/$log.txt"
  kill $pid; wait $pid 2>/dev/null || true
}

export VLLM_PLUGINS=dsv41_overlay DSV41_RUNTIME_ROOT="$work/runtime"
echo "== 1: overlay inert (no remote): vLLM's own Engram tables"
env -u DSV41_ENGRAM_REMOTE bash -c "$(declare -f serve); work=$work port=$port; serve own"

echo "== 2: remote Engram with FULL graphs must refuse with the flag"
if DSV41_ENGRAM_REMOTE="$url" DSV41_ENGRAM_REMOTE_REQUIRED=1 serve full; then
  echo "FAIL: FULL graphs were not refused"; exit 1
fi
grep -q "cudagraph_mode.: .PIECEWISE" "$work/full.log" && echo "refused with the PIECEWISE flag: ok"

echo "== 3: remote Engram, required, PIECEWISE"
DSV41_ENGRAM_REMOTE="$url" DSV41_ENGRAM_REMOTE_REQUIRED=1 \
  serve remote --compilation-config '{"cudagraph_mode": "PIECEWISE"}'
grep -h "dsv41 overlay" "$work/remote.log" | head -5
cat /tmp/dsv41-overlay-rank0.json 2>/dev/null || echo "(no counter report yet: reports are every 60 s)"
grep -q "no vLLM host table" "$work/remote.log" && echo "no vLLM host table: ok"

echo "== 4: remote Engram unreachable, not required: exact local fallback, PIECEWISE"
DSV41_ENGRAM_REMOTE=tcp://127.0.0.1:1 serve fallback --compilation-config '{"cudagraph_mode": "PIECEWISE"}'
"$py" - "$work" <<'EOF'
import json, sys
w = sys.argv[1]
a = json.load(open(f"{w}/fallback.txt"))["choices"][0]["text"]
b = json.load(open(f"{w}/remote.txt"))["choices"][0]["text"]
print("identical greedy text:", a == b)
sys.exit(0 if a == b else 1)
EOF
