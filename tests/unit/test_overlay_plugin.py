"""The vLLM overlay's plugin: entry point, inertness, env parsing and refusals, contract checks.

CI has no vLLM: the contract checks run against a fake vLLM tree whose file digests a test
writes into an edited copy of the committed contract.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dsv41.errors import ConfigError
from dsv41.overlay import contract as C, hooks, plugin, settings as S

REPO = Path(__file__).resolve().parents[2]


def test_entry_point_is_declared_and_installed() -> None:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = C.load()["entry_point"]["group"]
    assert group == "vllm.general_plugins"
    assert doc["project"]["entry-points"][group] == {C.PLUGIN_NAME: C.PLUGIN_VALUE}
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
    assert eps.get(C.PLUGIN_NAME) == C.PLUGIN_VALUE
    ep = next(ep for ep in importlib.metadata.entry_points(group=group) if ep.name == C.PLUGIN_NAME)
    assert ep.load() is plugin.register


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_", "VLLM_ENGRAM"))}


def test_register_is_inert_and_imports_no_torch_without_a_remote() -> None:
    code = (
        "import sys; from dsv41.overlay import plugin, hooks; plugin.register(); plugin.register(); "
        "print(plugin.STATE['state'], 'torch' in sys.modules, any(m.startswith('vllm') for m in sys.modules), "
        "hooks._finder in sys.meta_path)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["inert", "False", "False", "False"]


def test_register_imports_no_torch_when_active(tmp_path: Path) -> None:
    # active but vLLM absent (CI): contract mismatch, inert, still no torch
    env = dict(
        _clean_env(),
        DSV41_ENGRAM_REMOTE="tcp://127.0.0.1:7441",
        DSV41_DRAFTER_REMOTE="tcp://127.0.0.1:7450",
        DSV41_DRAFTER_DIR=str(tmp_path),
    )
    code = (
        "import sys; from dsv41.overlay import plugin; plugin.register(); "
        "print(plugin.STATE['state'], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[1] == "False"


@pytest.mark.parametrize("old,new", sorted(C.OLD_ENV.items()))
def test_old_engram_names_are_refused_naming_the_new(old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=f"^{old} was renamed: set {new} instead"):
        S.parse({old: "1"})


@pytest.mark.parametrize(
    "env,msg",
    [
        ({"DSV41_ENGRAM_REMOTE_REQUIRED": "maybe"}, "^DSV41_ENGRAM_REMOTE_REQUIRED must be 0 or 1"),
        ({"DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "0"}, "^DSV41_ENGRAM_REMOTE_TIMEOUT_MS must be an integer"),
        ({"DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "600001"}, "^DSV41_ENGRAM_REMOTE_TIMEOUT_MS must be an integer"),
        ({"DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "1.5"}, "^DSV41_ENGRAM_REMOTE_TIMEOUT_MS must be an integer"),
        ({"DSV41_ENGRAM_REMOTE_REQUIRED": "1"}, "^DSV41_ENGRAM_REMOTE_REQUIRED=1 but DSV41_ENGRAM_REMOTE is empty"),
    ],
)
def test_bad_settings_give_one_clear_error(env: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        S.parse(env)


def test_settings_parse_values() -> None:
    s = S.parse({})
    assert not s.active and not s.engram and s.runtime_root == Path(S.DEFAULT_RUNTIME_ROOT)
    s = S.parse(
        {
            "DSV41_ENGRAM_REMOTE": " tcp://10.0.0.1:7441 , tcp://10.0.1.1:7441 ",
            "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "250",
            "DSV41_ENGRAM_REMOTE_REQUIRED": "1",
            "DSV41_RUNTIME_ROOT": "/x",
        }
    )
    assert s.engram_urls == ("tcp://10.0.0.1:7441", "tcp://10.0.1.1:7441") and s.timeout_ms == 250
    assert s.required and s.active and not s.drafter and s.runtime_root == Path("/x")
    assert S.rank_url(s, 2, 1) == "tcp://10.0.1.1:7441"
    with pytest.raises(ConfigError, match="^DSV41_ENGRAM_REMOTE names 2 URL"):
        S.rank_url(s, 4, 0)
    bad = S.parse({"DSV41_ENGRAM_REMOTE": "http://h:1"})
    with pytest.raises(ConfigError, match="^DSV41_ENGRAM_REMOTE"):
        S.rank_url(bad, 1, 0)
    assert S.parse({"DSV41_DRAFTER_REMOTE": "tcp://h:1", "DSV41_DRAFTER_DIR": "/d"}).drafter
    with pytest.raises(ConfigError, match="^DSV41_DRAFTER_DIR"):
        S.parse({"DSV41_DRAFTER_REMOTE": "tcp://h:1"})


def test_runtime_files(tmp_path: Path) -> None:
    s = S.parse({"DSV41_ENGRAM_REMOTE": "tcp://h:1", "DSV41_RUNTIME_ROOT": str(tmp_path)})
    with pytest.raises(ConfigError, match="no manifest.json"):
        S.runtime_files(s)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="overlay.json"):
        S.runtime_files(s)
    (tmp_path / "overlay.json").write_text("not json")
    with pytest.raises(ConfigError, match="not JSON"):
        S.runtime_files(s)
    (tmp_path / "overlay.json").write_text(json.dumps({"tables_dir": str(tmp_path / "missing")}))
    assert S.runtime_files(s) == (tmp_path / "manifest.json", None)
    (tmp_path / "overlay.json").write_text(json.dumps({"tables_dir": str(tmp_path)}))
    assert S.runtime_files(s) == (tmp_path / "manifest.json", tmp_path)


# ------------------------------------------------------------------------- contract checks


def _fake_vllm(root: Path, contract: dict) -> dict:
    """A fake vLLM tree with one small file per contract path; returns an edited copy of the
    contract whose digests are those files'."""
    edited = json.loads(json.dumps(contract))
    for rel in contract["files"]:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# stand-in for {rel}\n")
        edited["files"][rel]["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return edited


def test_committed_contract_covers_the_patched_files() -> None:
    c = C.load()
    assert c["vllm_version"] == "0.33.0"
    assert set(c["files"]) == set(C.CHECKED_FILES)
    assert {p for p, r in c["files"].items() if r["role"] == "patched"} == set(C.PATCHED_FILES)
    assert all(len(r["sha256"]) == 64 for r in c["files"].values())
    assert set(c["wheels"]) == {"x86_64", "aarch64"}  # the tool checked their Python files are the same
    assert all(len(w["sha256"]) == 64 for w in c["wheels"].values())
    assert c["compilation"]["engram_remote"]["cudagraph_mode_allowed"] == ["NONE", "PIECEWISE"]
    assert c["env"]["refused"] == C.OLD_ENV
    # TP2: 12 of 24 columns per rank; ~94 GiB of host table per rank is what the overlay saves
    r2 = c["ranges"]["tp"]["2"]
    assert [r["part_n_hash_cols"] for r in r2] == [12, 12] and r2[1]["head_start"] == 12
    rank0 = sum(x["vocab_end_idx"] - x["vocab_start_idx"] for x in r2[0]["layers"]) * 264
    assert 90 * 2**30 < rank0 < 100 * 2**30


def test_check_files_accepts_the_matching_tree_and_names_each_difference(tmp_path: Path) -> None:
    edited = _fake_vllm(tmp_path, C.load())
    assert C.check_files(edited, tmp_path, "0.33.0") == []
    (tmp_path / C.ENGRAM_FILE).write_text("# patched upstream\n")
    (tmp_path / C.PLUGINS_FILE).unlink()
    problems = C.check_files(edited, tmp_path, "0.34.0")
    assert problems[0] == "vLLM version 0.34.0 != contract 0.33.0"
    assert any(p.startswith(f"{C.ENGRAM_FILE} sha256") for p in problems)
    assert f"{C.PLUGINS_FILE} is missing" in problems


@pytest.mark.parametrize(
    "text,msg",
    [
        ("nope", "not JSON"),
        ("{}", "not a dsv41-vllm-contract"),
        (json.dumps({"format": C.FORMAT, "version": C.VERSION}), "missing"),
    ],
)
def test_bad_contract_files(tmp_path: Path, text: str, msg: str) -> None:
    p = tmp_path / "c.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        C.load(p)
    with pytest.raises(ConfigError, match="does not exist"):
        C.load(tmp_path / "absent.json")


@pytest.fixture
def fake_installed(tmp_path: Path, monkeypatch):
    """register() sees a fake installed vLLM and an edited contract copy that matches it."""
    edited = _fake_vllm(tmp_path / "site", C.load())
    cpath = tmp_path / "contract.json"
    cpath.write_text(json.dumps(edited))
    monkeypatch.setattr(C, "CONTRACT_PATH", cpath)
    monkeypatch.setattr(C, "installed_vllm_root", lambda: tmp_path / "site")
    monkeypatch.setattr(C, "installed_version", lambda: "0.33.0")
    installed = []
    monkeypatch.setattr(hooks, "install", lambda s, c: installed.append((s, c)))
    for k in [k for k in os.environ if k.startswith(("DSV41_", "VLLM_ENGRAM"))]:
        monkeypatch.delenv(k)
    return tmp_path, cpath, installed


def test_register_patches_when_the_contract_holds(fake_installed, monkeypatch) -> None:
    _, _, installed = fake_installed
    monkeypatch.setenv("DSV41_ENGRAM_REMOTE", "tcp://127.0.0.1:7441")
    plugin.register()
    assert plugin.STATE["state"] == "active" and len(installed) == 1
    assert installed[0][0].engram and installed[0][1]["vllm_version"] == "0.33.0"


def test_contract_mismatch_refuses_in_required_mode(fake_installed, monkeypatch) -> None:
    tmp, cpath, installed = fake_installed
    doc = json.loads(cpath.read_text())
    doc["files"][C.ENGRAM_FILE]["sha256"] = "0" * 64  # the test edits its copy of the contract
    cpath.write_text(json.dumps(doc))
    monkeypatch.setenv("DSV41_ENGRAM_REMOTE", "tcp://127.0.0.1:7441")
    monkeypatch.setenv("DSV41_ENGRAM_REMOTE_REQUIRED", "1")
    with pytest.raises(C.ContractMismatch, match=f"{C.ENGRAM_FILE} sha256 .*refusing to start"):
        plugin.register()
    assert installed == []


def test_contract_mismatch_is_inert_with_one_log_line(fake_installed, monkeypatch, caplog) -> None:
    tmp, cpath, installed = fake_installed
    monkeypatch.setattr(C, "installed_version", lambda: "0.34.0")
    monkeypatch.setenv("DSV41_ENGRAM_REMOTE", "tcp://127.0.0.1:7441")
    with caplog.at_level(logging.INFO, logger="dsv41.overlay"):
        plugin.register()
    assert installed == [] and plugin.STATE["state"] == "contract-mismatch"
    lines = [r for r in caplog.records if r.name == "dsv41.overlay"]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert "0.34.0 != contract 0.33.0" in lines[0].getMessage() and "overlay inert" in lines[0].getMessage()


def test_bad_env_stops_register(fake_installed, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ENGRAM_REMOTE", "tcp://127.0.0.1:7441")
    with pytest.raises(ConfigError, match="was renamed: set DSV41_ENGRAM_REMOTE instead"):
        plugin.register()


# ------------------------------------------------------------------------------- hooks


def test_post_import_hook_patches_on_import_and_when_already_imported(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "ovlfake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hooks.on_import("ovlfake.mod", lambda m: (seen.append(m.VALUE), setattr(m, "VALUE", 2)))
    import ovlfake.mod as m  # noqa: PLC0415 - the import under test

    assert seen == [1] and m.VALUE == 2
    hooks.on_import("ovlfake.mod", lambda m: setattr(m, "VALUE", 3))  # already imported: at once
    assert m.VALUE == 3
    assert "ovlfake.mod" not in hooks._pending
    for name in ("ovlfake.mod", "ovlfake"):
        sys.modules.pop(name, None)
