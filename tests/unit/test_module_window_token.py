"""Every Ansible module whose package code sends HTTP through dsv41.harness.http (and so carries
the window header) takes the window token as an explicit option, ``window_token``, falling back to
DSV41_WINDOW_TOKEN (Ansible's env_fallback), and passes it to the package (http.window_token)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted((REPO / "plugins" / "modules").glob("*.py"))


def _package_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "import_dsv41"
            and n.args and isinstance(n.args[0], ast.Constant)]


def _sends_http(name: str) -> bool:
    """The package module imports dsv41.harness.http, at load time (sys.modules after importing it)
    or inside a function (``from dsv41.harness import http|refs``, refs sending through http)."""
    code = f"import sys, {name}; print('dsv41.harness.http' in sys.modules, {name}.__file__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded, file = r.stdout.split()
    src = Path(file).read_text()
    return loaded == "True" or any(s in src for s in ("from dsv41.harness import http", "from dsv41.harness import refs"))


def _option(path: Path):
    """The window_token entry of the module's argument_spec (an ast.Call of dict) or None."""
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.keyword) and n.arg == "window_token" and isinstance(n.value, ast.Call):
            return n.value
    return None


# Modules whose package module can send HTTP, but whose calls into it send none (none today:
# qualify_report's dsv41.entrypoints.qualify no longer holds the HTTP probes, which moved to
# qualify_controller; an entry that stops being found fails test_the_class_is_found).
NO_REQUESTS: dict[str, str] = {}
FOUND = [p for p in MODULES if any(_sends_http(m) for m in _package_modules(p) if m != "dsv41.harness.http")]
SENDERS = [p for p in FOUND if p.stem not in NO_REQUESTS]


def test_the_class_is_found():
    assert {p.stem for p in SENDERS} >= {"admission", "greedy_refs", "component_check", "dsv41_status"}
    assert set(NO_REQUESTS) <= {p.stem for p in FOUND}
    for stem in NO_REQUESTS:  # it calls no function of its package that reaches an endpoint
        src = (REPO / "plugins" / "modules" / f"{stem}.py").read_text()
        assert "window_token" not in src and "http" not in src.split("def main")[1]


@pytest.mark.parametrize("path", SENDERS, ids=lambda p: p.stem)
def test_window_token_is_an_option_with_env_fallback(path):
    opt = _option(path)
    assert opt is not None, f"{path.name}: no window_token option"
    kw = {k.arg: k.value for k in opt.keywords}
    assert ast.literal_eval(kw["type"]) == "str" and ast.literal_eval(kw["default"]) == ""
    fb = kw["fallback"]
    assert isinstance(fb, ast.Tuple) and fb.elts[0].id == "env_fallback"
    assert ast.literal_eval(fb.elts[1]) == ["DSV41_WINDOW_TOKEN"]
    src = path.read_text()
    assert 'window_token(p["window_token"])' in src, f"{path.name}: the option does not reach the package"
    doc = src[src.index("DOCUMENTATION"):src.index("EXAMPLES")]
    assert "  window_token:\n" in doc, f"{path.name}: window_token is not documented"
