"""The deploy's image check (roles/serve/tasks/overlay.yml), its own tasks run by ansible-playbook
against a stand-in container CLI that runs the image's Python on a fake vLLM tree with the overlay
site mounted: an image whose vLLM the overlay has no contract for is refused naming its version,
the supported ones and `dsv41 overlay contract`; a matching one passes; an overlay site without
the C++ extension is reported per rank."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from contractutil import contract_of, fake_tree
from dsv41.overlay import contract as C

REPO = Path(__file__).resolve().parents[2]
TASKS = (
    "The serving image sees the plugin, its entry point, and the vLLM and transport it would run",
    "The image's vLLM is one the overlay has a contract for (refused before anything stops)",
    "Say so when the image runs the overlay's pure-Python transport or worker core (no C++ extension for its Python)",
)
IMAGE = "registry.example/serve@sha256:" + "b" * 64


def _docker(bindir: Path, tree: Path) -> None:
    """``docker run ... -v SITE:DST:ro -e PYTHONPATH=DST IMAGE -c CODE``: this Python with the
    site and the image's fake vLLM on its path."""
    d = bindir / "docker"
    d.write_text(f"""#!{sys.executable}
import os, sys
a = sys.argv[1:]
assert a[:4] == ["run", "--rm", "--pull", "never"] and a[a.index("--entrypoint") + 1] == "python3", a
site = a[a.index("-v") + 1].split(":")[0]
rest = a[a.index("-c"):]
os.execve({sys.executable!r}, [{sys.executable!r}, *rest],
          dict(os.environ, PYTHONPATH=site + os.pathsep + {str(tree)!r}))
""")
    d.chmod(d.stat().st_mode | stat.S_IXUSR)


def run_check(
    tmp: Path, *, version: str, contract: dict | None = None, missing: tuple[str, ...] = (), overlay_active: bool = True
) -> subprocess.CompletedProcess:
    tree = tmp / "image-vllm"
    fake_tree(tree, version, C.load())
    site = tmp / "site"
    shutil.copytree(
        REPO / "python" / "dsv41",
        site / "dsv41",
        ignore=shutil.ignore_patterns(*(f"{m}*.so" for m in missing)) if missing else None,
    )
    if contract is not None:
        (site / "dsv41" / "overlay" / "vllm_contract.json").write_text(json.dumps(contract(tree)))
    bindir = tmp / "bin"
    bindir.mkdir()
    _docker(bindir, tree)
    doc = yaml.safe_load((REPO / "roles" / "serve" / "tasks" / "overlay.yml").read_text())
    tasks = [t for t in doc if t.get("name") in TASKS]
    assert [t["name"] for t in tasks] == list(TASKS)
    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "connection": "local",
            "tasks": tasks,
            "vars": {
                "serve_container_runtime": str(bindir / "docker"),
                "serve_overlay_site": str(site),
                "serve_overlay_container_site": "/opt/dsv41/overlay-site",
                "serve_image": IMAGE,
                "serve_overlay_plugin": C.PLUGIN_NAME,
                "serve_rank": 1,
                "serve_overlay_active": overlay_active,
            },
        }
    ]
    (tmp / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    py = Path(sys.executable).parent
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{py}{os.pathsep}{os.environ['PATH']}",
    )
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(py / "ansible-playbook"), "-i", "localhost,", str(tmp / "play.yml")],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_unsupported_vllm_is_refused_naming_versions_and_the_command(tmp_path):
    r = run_check(tmp_path, version="0.31.1")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0, out[-3000:]
    assert f"the serving image {IMAGE} has vLLM 0.31.1" in out, out[-3000:]
    assert "the overlay supports vLLM 0.33.0 only" in out
    assert f"dsv41 overlay contract --image {IMAGE}" in out
    assert "vLLM version 0.31.1 != contract 0.33.0" in out


def test_matching_vllm_passes_and_the_cpp_transport_says_nothing(tmp_path):
    r = run_check(tmp_path, version="0.33.0", contract=contract_of)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "the overlay imports the pure-Python transport" not in " ".join(r.stdout.split())
    assert "skipping: [localhost]" in r.stdout  # the transport line


# each extension the site may lack (setup.py's NATIVE): the transport's, the worker core's, both
@pytest.mark.parametrize("missing", [("_fastrow",), ("_core",), ("_fastrow", "_core")])
def test_no_cpp_extension_in_the_site_is_reported_for_the_rank(tmp_path, missing):
    r = run_check(tmp_path, version="0.33.0", contract=contract_of, missing=missing)
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "rank 1 (localhost): the overlay imports the pure-Python transport" in out, out[-3000:]


@pytest.mark.parametrize("version", ["0.33.1"])
def test_any_other_version_is_refused(tmp_path, version):
    r = run_check(tmp_path, version=version)
    assert r.returncode != 0 and f"has vLLM {version}" in " ".join(r.stdout.split())


def test_a_fence_only_rank_runs_on_any_vllm(tmp_path):
    # the stock stage: only the fence middleware (ASGI) is mounted, no overlay hook has a contract
    r = run_check(tmp_path, version="0.32.0+cpu", overlay_active=False)
    assert r.returncode == 0, r.stdout[-3000:]
