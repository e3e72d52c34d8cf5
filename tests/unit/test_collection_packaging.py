"""The collection's packaging, checked without building an image or publishing anything:

- requirements-controller.txt is the controller set of constraints.txt (tools/controller_requirements.py
  derives it from pyproject.toml and the installed metadata), and ``ansible-builder create`` of
  execution-environment.yml writes exactly those pins into the build context, with ansible-core
  and ansible-runner as constraints.txt pins them and the collection tarball galaxy.yml's version
  names;
- ``antsibull-changelog lint`` passes on the fragments and changelog.yaml, and changelog.yaml names
  only plugins the collection has (every plugin type of plugins/), every module among them;
- the ansible-lint configuration skips one rule only, galaxy[no-repository], and only while
  galaxy.yml has no repository URL (docs/operations.md says why there is none).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    """The venv's ``name`` (else the one on PATH); a missing one fails naming the fix."""
    found = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        pytest.fail(f"{name} is not installed (pinned in constraints.txt, dev extra): make venv")
    return found


def _controller_requirements():
    spec = importlib.util.spec_from_file_location(
        "controller_requirements", ROOT / "tools" / "controller_requirements.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pin(name: str) -> str:
    line = next(ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith(f"{name}=="))
    return line.strip()


def test_requirements_controller_is_the_controller_set():
    cr = _controller_requirements()
    want = cr.controller_set(ROOT)
    have = cr.requirement_lines((ROOT / cr.REQUIREMENTS).read_text())
    assert have == want, (
        f"{cr.REQUIREMENTS} differs from the controller set: missing {sorted(set(want) - set(have))}, "
        f"extra {sorted(set(have) - set(want))} (python tools/controller_requirements.py)"
    )
    # every root is in it: the package's dependencies, its torch extra, its build requirements, the tools
    names = {re.split(r"==", ln)[0].lower().replace("_", "-") for ln in have}
    for req in cr.roots(ROOT):
        assert req.name.lower().replace("_", "-") in names, req


def test_a_dependency_without_a_pin_is_one_error(tmp_path):
    cr = _controller_requirements()
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "constraints.txt").write_text(
        "\n".join(ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if not ln.startswith("psutil=="))
    )
    with pytest.raises(cr.MissingPin, match="constraints.txt has no pin for psutil"):
        cr.controller_set(tmp_path)


def test_builder_create_writes_the_controller_set(tmp_path):
    ee = yaml.safe_load((ROOT / "execution-environment.yml").read_text())
    version = yaml.safe_load((ROOT / "galaxy.yml").read_text())["version"]
    tarball = f"dsv41-offload-{version}.tar.gz"
    assert ee["version"] == 3
    assert ee["dependencies"]["ansible_core"]["package_pip"] == _pin("ansible-core")
    assert ee["dependencies"]["ansible_runner"]["package_pip"] == _pin("ansible-runner")
    assert ee["dependencies"]["galaxy"]["collections"] == [{"name": f"collections/{tarball}", "type": "file"}]
    assert ee["additional_build_files"] == [{"src": tarball, "dest": "collections"}]
    ctx = tmp_path / "ee"
    ctx.mkdir()
    for name in ("execution-environment.yml", ee["dependencies"]["python"], ee["dependencies"]["system"]):
        shutil.copy(ROOT / name, ctx / name)
    build = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(ctx), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0 and (ctx / tarball).is_file(), build.stdout + build.stderr
    r = subprocess.run(
        [_tool("ansible-builder"), "create", "--file", "execution-environment.yml", "--context", str(ctx / "context")],
        cwd=ctx,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    cr = _controller_requirements()
    written = cr.requirement_lines((ctx / "context" / "_build" / "requirements.txt").read_text())
    assert written == cr.controller_set(ROOT)
    assert (ctx / "context" / "_build" / "bindep.txt").read_text() == (ROOT / "bindep.txt").read_text()
    assert (ctx / "context" / "_build" / "collections" / tarball).is_file()
    containerfile = next(
        p for p in (ctx / "context").iterdir() if p.name in ("Containerfile", "Dockerfile")
    ).read_text()
    assert f'ANSIBLE_INSTALL_REFS="{_pin("ansible-core")} {_pin("ansible-runner")}"' in containerfile
    assert "ANSIBLE_CONFIG" not in containerfile  # the AWX project's own ansible.cfg applies there


def test_navigator_runs_the_image_with_the_collection_config():
    nav = yaml.safe_load((ROOT / "ansible-navigator.yml").read_text())["ansible-navigator"]["execution-environment"]
    version = yaml.safe_load((ROOT / "galaxy.yml").read_text())["version"]
    assert nav["enabled"] and nav["image"] == f"dsv41-offload-ee:{version}"
    assert (
        nav["environment-variables"]["set"]["ANSIBLE_CONFIG"]
        == "/usr/share/ansible/collections/ansible_collections/dsv41/offload/ansible.cfg"
    )


def test_meta_execution_environment_names_the_same_files():
    meta = yaml.safe_load((ROOT / "meta" / "execution-environment.yml").read_text())
    ee = yaml.safe_load((ROOT / "execution-environment.yml").read_text())
    assert meta["dependencies"] == {"python": ee["dependencies"]["python"], "system": ee["dependencies"]["system"]}


def test_antsibull_changelog_lint():
    tool = _tool("antsibull-changelog")
    for args in (["lint"], ["lint-changelog-yaml", "changelogs/changelog.yaml"]):
        r = subprocess.run([tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr
    config = yaml.safe_load((ROOT / "changelogs" / "config.yaml").read_text())
    assert [o["file"] for o in config["output"]] == ["CHANGELOG.md"] and (ROOT / "CHANGELOG.md").is_file()


def test_changelog_md_is_what_antsibull_changelog_generates(tmp_path):
    """CHANGELOG.md is generated, never edited: regenerating it from changelog.yaml changes nothing."""
    for name in ("galaxy.yml", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "changelogs", tmp_path / "changelogs")
    r = subprocess.run(
        [_tool("antsibull-changelog"), "generate"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "CHANGELOG.md").read_text() == (ROOT / "CHANGELOG.md").read_text(), (
        "CHANGELOG.md differs from antsibull-changelog generate's"
    )


def test_the_changelog_names_only_plugins_the_collection_has():
    """Every plugin (any type, modules included) changelog.yaml announces exists in plugins/<type>/,
    and every module of plugins/modules is announced."""
    log = yaml.safe_load((ROOT / "changelogs" / "changelog.yaml").read_text())
    announced = {("module", m["name"]) for rel in log["releases"].values() for m in rel.get("modules", [])}
    announced |= {
        (kind, p["name"])
        for rel in log["releases"].values()
        for kind, items in rel.get("plugins", {}).items()
        for p in items
    }
    exists = {
        (("module" if d.name == "modules" else d.name), p.stem)
        for d in (ROOT / "plugins").iterdir()
        if d.is_dir()
        for p in d.glob("*.py")
        if p.stem != "__init__"
    }
    assert announced - exists == set(), (
        f"changelog.yaml names plugins the collection does not have: {sorted(announced - exists)}"
    )
    modules = {n for kind, n in exists if kind == "module"}
    assert modules <= {n for kind, n in announced if kind == "module"}


def test_ansible_lint_skips_only_the_missing_repository_url():
    conf = yaml.safe_load((ROOT / ".ansible-lint").read_text())
    has_url = bool(yaml.safe_load((ROOT / "galaxy.yml").read_text()).get("repository"))
    assert (conf.get("skip_list") or []) == ([] if has_url else ["galaxy[no-repository]"]), conf
    assert not conf.get("warn_list"), conf
