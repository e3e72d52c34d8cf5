"""The collection as an operator gets it: ``ansible-galaxy collection build`` of the checkout,
``ansible-galaxy collection install`` into an empty collections path, and every entry playbook
run by its FQCN (``ansible-playbook dsv41.offload.<name>``) from a directory outside the checkout,
with the installed collection's ansible.cfg (ANSIBLE_CONFIG, as the execution environment sets it)
and inventory:

- the install works (each link of the installed tree a file inside it, no build output in it);
- each top-level playbook is a thin import of ``playbooks/<its name>.yml``, and that playbook is
  found by FQCN: ``--syntax-check`` (every module and role resolves) and ``--list-tasks`` pass, every
  role task comes from ``dsv41.offload``, and the task list is the repository's own run of the
  top-level file (same plays and tasks, role names qualified);
- the installed collection carries the dsv41 package source the roles install (the same source
  tarball, so the same wheelhouse cache key, python/dsv41/wheelhouse.py);
- lab (the integrator's CI): ``dsv41.offload.status`` passes against the deployed lab; under
  make lab-long, ``dsv41.offload.deploy --check --diff`` changes nothing on any host.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from labutil import needs_lab

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FQCN = "dsv41.offload"


def entry_playbooks() -> dict[str, str]:
    """``{name: imported path}`` of the top-level playbooks (root *.yml whose items are all plays or
    imports): the operator's entry points, each ``dsv41.offload.<name>`` in the collection."""
    out = {}
    for p in sorted(ROOT.glob("*.yml")):
        doc = yaml.safe_load(p.read_text())
        if not (isinstance(doc, list) and doc and all(isinstance(i, dict) for i in doc)):
            continue
        imports = [i.get("ansible.builtin.import_playbook") or i.get("import_playbook") for i in doc]
        if all(imports) or any("hosts" in i for i in doc):
            out[p.stem] = imports
    return out


def run(cmd: list[str], env: dict, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout its whole process group is killed."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"{' '.join(cmd)}: no end in {timeout} s\n{out[-3000:]}{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(collection dir, environment, cwd)`` of the collection built from the checkout and
    installed into an empty collections path."""
    tmp = tmp_path_factory.mktemp("collection")
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", ANSIBLE_FORCE_COLOR="0", NO_COLOR="1")
    for k in (
        "ANSIBLE_CONFIG",
        "ANSIBLE_COLLECTIONS_PATH",
        "ANSIBLE_COLLECTIONS_PATHS",
        "ANSIBLE_ROLES_PATH",
        "ANSIBLE_LIBRARY",
    ):
        env.pop(k, None)
    b = run([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(tmp), str(ROOT)], env, tmp, 300)
    assert b.returncode == 0, b.stdout + b.stderr
    tarball = next(tmp.glob("dsv41-offload-*.tar.gz"))
    i = run(
        [str(BIN / "ansible-galaxy"), "collection", "install", "-p", str(tmp / "collections"), str(tarball)],
        env,
        tmp,
        300,
    )
    assert i.returncode == 0 and "was installed successfully" in i.stdout, i.stdout + i.stderr
    coll = tmp / "collections" / "ansible_collections" / "dsv41" / "offload"
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    env.update(ANSIBLE_COLLECTIONS_PATH=str(tmp / "collections"), ANSIBLE_CONFIG=str(coll / "ansible.cfg"))
    return coll, env, cwd


def test_the_installed_tree_has_no_dangling_link_and_no_build_outputs(installed):
    coll, _, _ = installed
    links = [p for p in coll.rglob("*") if p.is_symlink()]
    outside = [
        str(p.relative_to(coll))
        for p in links
        if not p.resolve().is_file() or not p.resolve().is_relative_to(coll.resolve())
    ]
    assert outside == []
    assert not (coll / "library").exists()  # the repository's links; the collection's modules are plugins/modules
    outputs = [
        str(p.relative_to(coll))
        for p in coll.rglob("*")
        if p.suffix == ".so" or p.name == "__pycache__" or p.name.endswith(".egg-info")
    ]
    assert outputs == []
    for d in ("playbooks", "roles", "plugins/modules", "inventories", "python/dsv41", "meta"):
        assert (coll / d).is_dir(), d


def test_the_installed_collection_carries_the_package_source_the_roles_install(installed):
    """roles/dsv41_package builds its wheelhouse from ``dsv41_package_project_dir`` (the installed
    collection's root when the playbook runs from it): the source tarball, hence the cache key,
    is the checkout's."""
    coll, _, _ = installed
    from dsv41 import wheelhouse

    version = yaml.safe_load((ROOT / "galaxy.yml").read_text())["version"]
    assert wheelhouse.source_files(coll) == wheelhouse.source_files(ROOT)
    assert wheelhouse.source_tarball(coll, version) == wheelhouse.source_tarball(ROOT, version)


def test_entry_playbooks_are_thin_imports_of_the_collection_playbooks():
    books = entry_playbooks()
    assert {"deploy", "window", "promote", "rollback", "qualify", "status", "monitoring"} <= set(books)
    for name, imports in books.items():
        assert imports == [f"playbooks/{name}.yml"], f"{name}.yml: one import of playbooks/{name}.yml, not {imports}"


def _tasks(listing: str) -> list[str]:
    """The play and task lines of ``--list-tasks``, role prefixes reduced to the role's own name."""
    lines = [ln.strip() for ln in listing.splitlines() if ln.strip().startswith(("play #",)) or "\tTAGS:" in ln]
    return [re.sub(rf"^{re.escape(FQCN)}\.", "", ln) for ln in lines]


@pytest.mark.parametrize("name", sorted(entry_playbooks()))
def test_fqcn_playbook_syntax_and_tasks(installed, name):
    coll, env, cwd = installed
    inv = str(coll / "inventories" / "sim" / "hosts.yml")
    syn = run([str(BIN / "ansible-playbook"), f"{FQCN}.{name}", "-i", inv, "--syntax-check"], env, cwd)
    assert syn.returncode == 0, syn.stdout[-3000:] + syn.stderr[-3000:]
    assert f"playbook: {coll}/playbooks/{name}.yml" in syn.stdout
    lst = run(
        [str(BIN / "ansible-playbook"), f"{FQCN}.{name}", "-i", inv, "--list-tasks", "-e", "candidate=x"], env, cwd
    )
    assert lst.returncode == 0, lst.stdout[-3000:] + lst.stderr[-3000:]
    role_tasks = [ln.strip() for ln in lst.stdout.splitlines() if re.match(r"^\s+\S+ : ", ln)]
    assert role_tasks and all(t.startswith(f"{FQCN}.") for t in role_tasks), [
        t for t in role_tasks if not t.startswith(f"{FQCN}.")
    ][:5]
    # the repository's own run of the top-level file: the same plays and tasks
    repo_env = {k: v for k, v in env.items() if k not in ("ANSIBLE_CONFIG", "ANSIBLE_COLLECTIONS_PATH")}
    mine = run([str(BIN / "ansible-playbook"), f"{name}.yml", "--list-tasks", "-e", "candidate=x"], repo_env, ROOT)
    assert mine.returncode == 0, mine.stdout[-3000:] + mine.stderr[-3000:]
    assert _tasks(lst.stdout) == _tasks(mine.stdout)


# ---- the lab (the integrator's CI: root, the deployed lab) ---------------------------------------


def _recap_changed(stdout: str) -> dict[str, int]:
    recap = stdout.split("PLAY RECAP")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", recap, re.M)}


def _state_args() -> list[str]:
    """The controller state where the checkout's runs keep it (docs/operations.md: a state
    directory outside the collection): the operator credential, packages and windows."""
    return [
        "-e",
        f"dsv41_state_dir={ROOT}/state",
        "-e",
        f"dsv41_packages_dir={ROOT}/packages",
        "-e",
        f"promotion_windows_dir={ROOT}/windows",
        "-e",
        f"status_windows_dir={ROOT}/windows",
        "-e",
        f"windows_dir={ROOT}/windows",
    ]


@pytest.mark.lab
@pytest.mark.slow
@needs_lab
def test_status_by_fqcn_on_the_lab(installed, deployed_lab):
    """The installed collection's status playbook against the lab deploy.yml left, with its own
    inventory (so the package source is the installed collection's)."""
    coll, env, cwd = installed
    inv = ["-i", str(coll / "inventories" / "sim" / "hosts.yml")]
    st = run([str(BIN / "ansible-playbook"), f"{FQCN}.status", *inv, *_state_args()], env, cwd, 900)
    assert st.returncode == 0, st.stdout[-4000:] + st.stderr[-2000:]
    assert "status: HEALTHY" in st.stdout


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.lab_long
@needs_lab
def test_deploy_check_by_fqcn_changes_nothing_on_the_lab(installed, deployed_lab):
    """``dsv41.offload.deploy --check --diff`` from the installed collection on the lab deploy.yml
    left: changed=0 on every host (the same inputs: the controller state of the checkout)."""
    coll, env, cwd = installed
    inv = ["-i", str(coll / "inventories" / "sim" / "hosts.yml")]
    dep = run(
        [str(BIN / "ansible-playbook"), f"{FQCN}.deploy", "--check", "--diff", *inv, *_state_args()], env, cwd, 1800
    )
    assert dep.returncode == 0, dep.stdout[-6000:] + dep.stderr[-2000:]
    changed = _recap_changed(dep.stdout)
    assert set(changed) == {"localhost", "sparkhead", "sparkworker", "x86host"}, dep.stdout[-3000:]
    assert set(changed.values()) == {0}, dep.stdout.split("PLAY RECAP")[-1]
