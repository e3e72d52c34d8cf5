#!/bin/sh
# Runs inside the lab's image build container (docker run --network none: no registry, no route):
# the dsv41 project and its pinned dependencies from the wheelhouse mounted at /wheelhouse into
# VENV, _fastrow and _core built for the image's own Python. Arguments: VENV SOURCE_TARBALL EXTRAS ("[torch]").
set -eu
venv=$1 src=$2 extras=$3
wh=/wheelhouse
echo "dsv41 image: venv $venv from $wh/$src$extras (no index)"
python3 -m venv "$venv"
"$venv/bin/pip" install --disable-pip-version-check --no-index --no-cache-dir --progress-bar off \
  --find-links "$wh" -c "$wh/constraints-host.txt" "$wh/$src$extras"
"$venv/bin/pip" check
"$venv/bin/dsv41" version
rm -rf /root/.cache /tmp/* 2>/dev/null || true
