"""Every Ansible module whose package code sends HTTP through dsv41.harness.http (and so carries
the window header) takes the window token as an explicit option, ``window_token``, falling back to
DSV41_WINDOW_TOKEN (Ansible's env_fallback), and passes it to the package (http.window_token).
The option is declared once: its spec is dsv41_common.WINDOW_TOKEN_SPEC, its documentation the
doc fragment dsv41.offload.window_token, its use dsv41_common.window_token(module)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted((REPO / "plugins" / "modules").glob("*.py"))


def _package_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", "") == "import_dsv41"
        and n.args
        and isinstance(n.args[0], ast.Constant)
    ]


def _sends_http(name: str) -> bool:
    """The package module imports dsv41.harness.http, at load time (sys.modules after importing it)
    or inside a function (``from dsv41.harness import http|refs``, refs sending through http)."""
    code = f"import sys, {name}; print('dsv41.harness.http' in sys.modules, {name}.__file__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded, file = r.stdout.split()
    src = Path(file).read_text()
    return loaded == "True" or any(
        s in src for s in ("from dsv41.harness import http", "from dsv41.harness import refs")
    )


def _merges_the_shared_spec(path: Path) -> bool:
    """The module's AnsibleModule(argument_spec=dict(..., **WINDOW_TOKEN_SPEC)) call."""
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.keyword) and n.arg == "argument_spec" and isinstance(n.value, ast.Call):
            return any(k.arg is None and getattr(k.value, "id", "") == "WINDOW_TOKEN_SPEC" for k in n.value.keywords)
    return False


def _doc(path: Path) -> dict:
    src = path.read_text()
    return yaml.safe_load(
        ast.literal_eval(src[src.index("DOCUMENTATION = ") + len("DOCUMENTATION = ") : src.index("EXAMPLES")].strip())
    )


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


def test_the_shared_spec_and_fragment():
    sys.path.insert(0, str(REPO / "plugins" / "module_utils"))
    try:
        import dsv41_common
        from ansible.module_utils.basic import env_fallback
    finally:
        sys.path.pop(0)
    # the token is a secret (it admits requests past a fenced HOLD): no_log; the credentials are files
    assert dsv41_common.WINDOW_TOKEN_SPEC == {
        "window_token": dict(type="str", default="", no_log=True, fallback=(env_fallback, ["DSV41_WINDOW_TOKEN"])),
        "operator_credential_file": dict(
            type="path", default="", fallback=(env_fallback, ["DSV41_OPERATOR_CREDENTIAL_FILE"])
        ),
        "api_key_file": dict(type="path", default="", fallback=(env_fallback, ["DSV41_API_KEY_FILE"])),
    }
    ns: dict = {}
    exec((REPO / "plugins" / "doc_fragments" / "window_token.py").read_text(), ns)
    opt = yaml.safe_load(ns["ModuleDocFragment"].DOCUMENTATION)["options"]["window_token"]
    assert opt["type"] == "str" and opt["default"] == "" and "E(DSV41_WINDOW_TOKEN)" in " ".join(opt["description"])


@pytest.mark.parametrize("path", SENDERS, ids=lambda p: p.stem)
def test_window_token_is_the_shared_option(path):
    assert _merges_the_shared_spec(path), f"{path.name}: argument_spec does not merge **WINDOW_TOKEN_SPEC"
    src = path.read_text()
    assert "window_token(module)" in src.split("def main")[1], f"{path.name}: the option does not reach the package"
    doc = _doc(path)
    assert "dsv41.offload.window_token" in doc.get("extends_documentation_fragment", []), (
        f"{path.name}: window_token is not documented (extends_documentation_fragment)"
    )
    assert "window_token" not in doc["options"], f"{path.name}: restates the fragment's window_token"
    assert "env_fallback" not in src and 'DSV41_WINDOW_TOKEN"]' not in src, f"{path.name}: a second window_token spec"


@pytest.mark.parametrize("path", [p for p in MODULES if p not in SENDERS], ids=lambda p: p.stem)
def test_no_other_module_takes_the_option(path):
    assert not _merges_the_shared_spec(path)
    assert "dsv41.offload.window_token" not in _doc(path).get("extends_documentation_fragment", [])
