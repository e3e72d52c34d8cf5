"""``make lint``'s call-signature check: a pinned pylint with only the messages that mean a call no
longer fits what it calls (or a name that does not exist), over every Python source the project
ships.

The class: a changed signature whose caller no unit test drives. ``harness/drill_measure.py``
called ``bench._client(timeout_s)`` after it became ``(timeout_s, endpoint)``; only a 4-minute
lab drill caught it. The messages are pylint's own definitions (``pylint --list-msgs``), checked
here against a package that reproduces each mistake, so the fence is known to catch what it is for.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RC = ROOT / "tools" / "pylintrc-calls"
CODES = {
    "E1120": "no-value-for-parameter",
    "E1121": "too-many-function-args",
    "E1123": "unexpected-keyword-arg",
    "E1124": "redundant-keyword-arg",
    "E0602": "undefined-variable",
}


def _pin(name: str) -> str:
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith(f"{name}==")]
    assert len(pins) == 1, pins
    return pins[0]


def test_make_lint_runs_the_pinned_check_first_over_every_shipped_source() -> None:
    mk = (ROOT / "Makefile").read_text()
    src = re.search(r"^LINT_CALLS_SRC := (.+)$", mk, re.M)
    assert src and src.group(1).split() == ["python/dsv41", "plugins", "$(wildcard", "tools/*.py)"], src
    body = re.search(r"^lint: venv\n((?:\t.*\n)+)", mk, re.M)
    assert body and body.group(1).splitlines()[0] == "\t$(BIN)/pylint --rcfile=tools/pylintrc-calls $(LINT_CALLS_SRC)"
    pin = _pin("pylint")
    assert f'"{pin}"' in (ROOT / "pyproject.toml").read_text()
    from importlib.metadata import version

    assert f"pylint=={version('pylint')}" == pin and f"astroid=={version('astroid')}" == _pin("astroid")
    # library/ is links into plugins/modules: scanning plugins/ covers it
    assert all(
        p.is_symlink() and p.resolve().parent == ROOT / "plugins" / "modules" for p in (ROOT / "library").glob("*.py")
    )


def test_the_rc_enables_exactly_the_call_messages() -> None:
    cp = configparser.ConfigParser()
    cp.read(RC)
    assert cp["MESSAGES CONTROL"]["disable"].strip() == "all"
    enabled = {m.strip() for m in cp["MESSAGES CONTROL"]["enable"].split(",") if m.strip()}
    assert enabled == set(CODES.values())


MISTAKES = {
    "bench.py": "def _client(timeout_s, endpoint):\n    return (timeout_s, endpoint)\n\n\n"
    "def body(model, *, seed=0):\n    return (model, seed)\n",
    "drill.py": "class Load:\n    def worker(self):\n        from pkg import bench\n\n"
    "        bench._client(1.0)\n"  # E1120 (the drill's bug)
    "        bench._client(1.0, 'http://x', 3)\n"  # E1121
    "        bench.body('m', salt='s')\n"  # E1123
    "        bench._client(1.0, 'http://x', timeout_s=2)\n"  # E1124
    "        return streams\n",  # E0602
    "ok.py": "from pkg import bench\n\n\ndef fine():\n    return bench._client(1.0, 'http://x'), bench.body('m', seed=1)\n",
}


def test_the_check_catches_each_mistake_and_passes_good_calls(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in MISTAKES.items():
        (pkg / name).write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "pylint", f"--rcfile={RC}", "--jobs=1", "pkg"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = re.findall(r"^pkg/(\w+\.py):(\d+):\d+: (E\d{4}):", r.stdout, re.M)
    assert r.returncode != 0, r.stdout + r.stderr
    assert sorted(code for _f, _l, code in found) == sorted(CODES), r.stdout + r.stderr
    assert {f for f, _l, _c in found} == {"drill.py"}, r.stdout  # good calls are not flagged
    assert ("drill.py", "5", "E1120") in found and "No value for argument 'endpoint'" in r.stdout


def test_each_code_is_the_named_pylint_message() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pylint", f"--help-msg={','.join(sorted(CODES))}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    for code, symbol in CODES.items():
        assert f":{symbol} ({code}):" in r.stdout, r.stdout[:500]
