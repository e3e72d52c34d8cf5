"""tools/vllm_contract.py on bad input: one error line, exit 1, nothing written (the real run
needs the vLLM wheel, which CI does not have; its output is the committed contract)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "vllm_contract.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "kind,msg",
    [
        ("missing", "no such wheel file"),
        ("name", "not a vllm manylinux wheel name"),
        ("notzip", "not a zip file"),
        ("empty", "has no vllm/models/deepseek_v41/common/engram.py"),
    ],
)
def test_bad_wheels_fail_with_one_line(tmp_path: Path, kind: str, msg: str) -> None:
    good_name = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    if kind == "missing":
        wheel = good_name
    elif kind == "name":
        wheel = tmp_path / "other-1.0.whl"
        wheel.write_bytes(b"x")
    elif kind == "notzip":
        wheel = good_name
        wheel.write_bytes(b"not a zip")
    else:
        wheel = good_name
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("vllm/__init__.py", "")
    out = tmp_path / "contract.json"
    r = run("--wheel", str(wheel), "--out", str(out))
    assert r.returncode == 1 and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm_contract: error:") and msg in lines[0]


def _wheel(path: Path, text: str) -> Path:
    from dsv41.overlay.contract import CHECKED_FILES

    with zipfile.ZipFile(path, "w") as z:
        for rel in CHECKED_FILES:
            z.writestr(rel, text)
    return path


def test_wheels_of_two_versions_or_different_sources_are_refused(tmp_path: Path) -> None:
    a = _wheel(tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", "# a\n")
    b = _wheel(tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_aarch64.whl", "# a\n")
    r = run("--wheel", str(a), "--wheel", str(b), "--out", str(tmp_path / "c.json"))
    assert r.returncode == 1 and "version 0.34.0 differs from 0.33.0" in r.stderr
    c = _wheel(tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl", "# other\n")
    r = run("--wheel", str(a), "--wheel", str(c), "--out", str(tmp_path / "c.json"))
    assert r.returncode == 1 and "its Python files differ from the other wheel's" in r.stderr


def test_a_fact_that_no_longer_holds_is_refused(tmp_path: Path) -> None:
    a = _wheel(tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", "x = 1\n")
    r = run("--wheel", str(a), "--out", str(tmp_path / "c.json"))
    assert r.returncode == 1 and "has no ParallelEngramEmbedding.__init__" in r.stderr
