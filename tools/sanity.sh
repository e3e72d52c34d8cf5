#!/usr/bin/env bash
# ansible-test on the repository's collection (galaxy.yml: dsv41.offload = plugins/, meta/,
# tests/sanity/, tests/unit/plugins/), offline.
# ansible-test only runs inside ansible_collections/NS/NAME, so the collection's files are copied
# into a throwaway tree (the repository's python/ and other tests are not part of the collection).
# ansible-test downloads get-pip from ci-files.testing.ansible.com to build its venvs; the cache is
# pre-seeded with tools/ansible-test-get-pip-stub.py (bootstraps pip via ensurepip).
# Usage: tools/sanity.sh [sanity|units] [ansible-test args, e.g. --test validate-modules]
#   sanity (default): every sanity test, with tests/sanity/ignore-<core>.txt
#   units: the module and plugin tests (tests/unit/plugins) in this Python environment, which
#          has the dsv41 package they drive (ansible-test's own venv would not)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-sanity}
[ $# -gt 0 ] && shift
command -v ansible-test >/dev/null || { echo "sanity.sh: ansible-test not on PATH (use the project venv)" >&2; exit 1; }
cache=~/.ansible/test/cache
mkdir -p "$cache"
for v in 24_2 25_0; do
  [ -f "$cache/get_pip_$v.py" ] || cp "$here/tools/ansible-test-get-pip-stub.py" "$cache/get_pip_$v.py"
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
c=$tmp/ansible_collections/dsv41/offload
mkdir -p "$c/tests/unit"
# -L: library/ and other links are followed, so the mirror holds plain files
cp -rL "$here"/galaxy.yml "$here"/README.md "$here"/meta "$here"/plugins "$c/"
cp -rL "$here"/tests/sanity "$c/tests/"
cp -rL "$here"/tests/unit/plugins "$c/tests/unit/"
# the helper module the module tests import (serverutil.FakeServing): a helper, never a test file
cp "$here"/tests/unit/serverutil.py "$c/tests/unit/"
find "$c" -name __pycache__ -prune -exec rm -rf {} +
pyver=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cd "$c"
case "$what" in
  sanity) ansible-test sanity --python "$pyver" "$@" ;;
  units) ansible-test units --local --python "$pyver" --python-interpreter "$(command -v python)" "$@" tests/unit/plugins/ ;;
  *) echo "sanity.sh: unknown command $what (sanity or units)" >&2; exit 2 ;;
esac
