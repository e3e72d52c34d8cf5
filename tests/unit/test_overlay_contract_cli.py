"""`dsv41 overlay contract` on fake vLLM trees: the installed version and each hooked file's sha256
against the shipped contract, exactly what differs, exit 0 (holds) / 1 (differs) / 2 (could not
read), through another interpreter (--python) and through an image (--image, a stand-in docker)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41.cli import main
from dsv41.overlay import contract as C

ROOT = Path(__file__).resolve().parents[2]


from contractutil import contract_of, fake_tree  # noqa: E402


def run(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), e.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "dsv41.cli", "overlay", "contract", *argv],
        capture_output=True,
        text=True,
        env=e,
        cwd="/",
        timeout=120,
    )


def test_version_and_file_hash_mismatch_are_each_named(tmp_path):
    c = C.load()
    fake_tree(tmp_path, "0.31.1", c, change=(C.ENGRAM_FILE,), drop=(C.PLUGINS_FILE,))
    r = run(["--python", sys.executable], env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"interpreter {sys.executable}: vLLM 0.31.1 at {tmp_path}")
    assert "  version: expected 0.33.0, found 0.31.1" in lines
    eng = hashlib.sha256(f"# changed\n{C.ENGRAM_FILE}\n".encode()).hexdigest()
    assert f"  {C.ENGRAM_FILE}: expected sha256 {c['files'][C.ENGRAM_FILE]['sha256']}, found {eng}" in lines
    assert f"  {C.PLUGINS_FILE}: expected sha256 {c['files'][C.PLUGINS_FILE]['sha256']}, found missing" in lines
    assert lines[-1].startswith("unsupported: the overlay supports vLLM 0.33.0 only")


def test_json_lists_each_difference(tmp_path):
    fake_tree(tmp_path, "0.33.0", C.load(), change=(C.SPECULATOR_FILE,))
    r = run(["--python", sys.executable, "--json"], env={"PYTHONPATH": str(tmp_path)})
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["holds"] is False
    whats = [d["what"] for d in doc["contracts"][0]["differences"]]
    assert "version" not in whats and C.SPECULATOR_FILE in whats and len(whats) == len(C.CHECKED_FILES)


def test_matching_tree_holds(tmp_path, monkeypatch, capsys):
    fake_tree(tmp_path, "0.33.0", C.load())
    monkeypatch.setattr(C, "shipped_contracts", lambda: [contract_of(tmp_path)])
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main(["overlay", "contract", "--python", sys.executable]) == 0
    assert "matches the overlay's vLLM 0.33.0 contract: supported" in capsys.readouterr().out


def test_one_changed_file_is_the_one_difference(tmp_path, monkeypatch, capsys):
    fake_tree(tmp_path, "0.33.0", C.load(), change=(C.MODEL_RUNNER_FILE,))
    monkeypatch.setattr(C, "shipped_contracts", lambda: [contract_of(tmp_path)])
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main(["overlay", "contract", "--python", sys.executable]) == 1
    out = capsys.readouterr().out
    assert "differs from the overlay's vLLM 0.33.0 contract (1):" in out and C.MODEL_RUNNER_FILE in out


def test_through_an_image(tmp_path):
    """--image runs the probe with the container CLI (--pull never, no network, python3 as the
    entry point); a stand-in docker runs it with this Python on the fake tree."""
    tree = tmp_path / "site"
    fake_tree(tree, "0.31.1", C.load())
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "argv.json"
    docker = bindir / "docker"
    docker.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
json.dump(args, open({str(log)!r}, "w"))
i = args.index("--entrypoint")
assert args[:i] == ["run", "--rm", "--pull", "never", "--network", "none"] and args[i + 1] == "python3"
image, rest = args[i + 2], args[i + 3:]
if image != "registry.example/vllm:0.31.1":
    sys.exit("Unable to find image " + image + " locally")
os.execve({sys.executable!r}, [{sys.executable!r}, *rest], dict(os.environ, PYTHONPATH={str(tree)!r}))
""")
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    r = run(["--image", "registry.example/vllm:0.31.1"], env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("image registry.example/vllm:0.31.1: vLLM 0.31.1")
    assert json.loads(log.read_text())[-3] == "-c"
    r = run(["--image", "registry.example/other:1"], env=env)
    assert r.returncode == 2 and r.stderr.strip().endswith("Unable to find image registry.example/other:1 locally")
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--image", "-it"], "--image must be an image reference"),
        (["--image", "a b"], "--image must be an image reference"),
        (["--image", "x", "--python", sys.executable], "give --image or --python, not both"),
        (["--image", "x", "--container-runtime", "/bin/sh"], "--container-runtime must be docker or podman"),
        (["--python", "/nonexistent/python3"], "cannot run /nonexistent/python3: not found"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, words):
    r = run(argv)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr


def test_no_vllm_is_exit_2_naming_the_supported_versions(tmp_path):
    r = run(["--python", sys.executable], env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2 and "no vllm package is installed (supported: vLLM 0.33.0)" in r.stderr
