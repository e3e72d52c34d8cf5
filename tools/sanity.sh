#!/usr/bin/env bash
# ansible-test sanity on the custom modules (library/*.py) and the lab connection plugin, offline.
# ansible-test only runs inside ansible_collections/NS/NAME, so the files are mirrored into a
# throwaway collection. It downloads get-pip from ci-files.testing.ansible.com to build its venvs;
# the cache is pre-seeded with tools/ansible-test-get-pip-stub.py (bootstraps pip via ensurepip).
# Usage: tools/sanity.sh [ansible-test sanity args, e.g. --test validate-modules]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
command -v ansible-test >/dev/null || { echo "sanity.sh: ansible-test not on PATH (use the project venv)" >&2; exit 1; }
cache=~/.ansible/test/cache
mkdir -p "$cache"
for v in 24_2 25_0; do
  [ -f "$cache/get_pip_$v.py" ] || cp "$here/tools/ansible-test-get-pip-stub.py" "$cache/get_pip_$v.py"
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
c=$tmp/ansible_collections/dsv41/offload
mkdir -p "$c/plugins/modules" "$c/plugins/connection" "$c/meta" "$c/tests/sanity"
cp "$here"/library/*.py "$c/plugins/modules/"
cp "$here"/plugins/connection/*.py "$c/plugins/connection/"
printf 'namespace: dsv41\nname: offload\nversion: 0.1.0\nreadme: README.md\nauthors: [dsv41-offload]\n' > "$c/galaxy.yml"
echo '# sanity mirror of dsv41-offload library/ and plugins/' > "$c/README.md"
echo 'requires_ansible: ">=2.19.0"' > "$c/meta/runtime.yml"
core=$(python -c 'import ansible.release as r; print(".".join(r.__version__.split(".")[:2]))')
{
  # Apache-2.0 project: the GPLv3 header check does not apply.
  for f in "$c"/plugins/modules/*.py "$c"/plugins/connection/*.py; do
    echo "plugins/${f#"$c"/plugins/} validate-modules:missing-gplv3-license"
  done
} > "$c/tests/sanity/ignore-$core.txt"
pyver=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cd "$c" && ansible-test sanity --python "$pyver" "$@"
