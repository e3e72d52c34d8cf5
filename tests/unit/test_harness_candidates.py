"""Candidate files (``dsv41.harness.candidates``): the shipped ones validate, every refusal is one
CandidateError line, the role variables cover every setting the schema admits, the
restorability check and ``dsv41 window candidate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv41 import envs
from dsv41.harness import candidates
from dsv41.harness.candidates import CandidateError
from dsv41.harness.window import WindowError

REPO_CANDIDATES = str(Path(__file__).resolve().parents[2] / "candidates")
BASE = "name: {n}\nquestion: q\nkind: plain\nprimary_metric: step_ms_p50\nmin_effect: 0.05\n"


def _cand(root: Path, name: str, text: str) -> None:
    (root / f"{name}.yml").write_text(text)


def test_shipped_candidates_validate():
    names = sorted(p.stem for p in Path(REPO_CANDIDATES).glob("*.yml"))
    assert {"aa", "slow-rows", "async-drafter", "sync-drafter"} <= set(names)
    for n in names:
        doc = candidates.load_candidate(n, REPO_CANDIDATES)
        assert doc["name"] == n
        candidates.check_restorable(doc)  # every shipped candidate is one a window can restore
    assert candidates.role_vars(candidates.load_candidate("aa", REPO_CANDIDATES)) == {}
    assert candidates.role_vars(candidates.load_candidate("slow-rows", REPO_CANDIDATES)) == {
        "serve_extra_env": {"DSV41_ENGRAM_FAULT_DELAY_MS": "20"}
    }
    assert candidates.role_vars(candidates.load_candidate("async-drafter", REPO_CANDIDATES)) == {
        "spec_decode_async": True
    }
    with pytest.raises(CandidateError, match="known: aa, async-drafter"):
        candidates.load_candidate("nope", REPO_CANDIDATES)


def test_candidate_refusals(tmp_path):
    _cand(tmp_path, "badenv", BASE.format(n="badenv") + "roles:\n  serve:\n    env:\n      PATH: /tmp\n")
    _cand(tmp_path, "norestore", BASE.format(n="norestore") + "roles:\n  serve:\n    flags: ['--x']\n")
    _cand(tmp_path, "unknownrole", BASE.format(n="unknownrole") + "roles:\n  kernel: {}\n")
    _cand(tmp_path, "badmetric", BASE.format(n="badmetric").replace("step_ms_p50", "p99") + "roles: {}\n")
    _cand(tmp_path, "renamed", BASE.format(n="other") + "roles: {}\n")
    _cand(tmp_path, "broken", "name: [unclosed\n")
    _cand(tmp_path, "newline", BASE.format(n="newline") + 'roles:\n  serve:\n    env:\n      DSV41_X: "a\\nb"\n')
    for name, msg in [
        ("badenv", "schema at roles/serve/env"),
        ("norestore", "schema at roles/serve"),
        ("unknownrole", "schema at roles"),
        ("badmetric", "schema at primary_metric"),
        ("renamed", "named 'other'"),
        ("broken", "not readable YAML"),
        ("newline", "schema at roles/serve/env/DSV41_X"),
        ("../etc", "plain name"),
        ("", "plain name"),
        (".hidden", "plain name"),
    ]:
        with pytest.raises(CandidateError, match=msg) as exc:
            candidates.load_candidate(name, tmp_path)
        assert isinstance(exc.value, WindowError) and "\n" not in str(exc.value)
    with pytest.raises(CandidateError, match="known: none"):
        candidates.load_candidate("aa", tmp_path / "absent")


def test_role_vars_cover_every_setting_the_schema_admits():
    """Fix the class: every ``roles.<role>.<key>`` of schemas/candidate.schema.json has a role
    variable, and no role variable names a setting the schema does not admit."""
    schema = json.loads(candidates.CANDIDATE_SCHEMA.read_text())
    admitted = {
        (role, key) for role, sub in schema["properties"]["roles"]["properties"].items() for key in sub["properties"]
    }
    assert admitted == set(candidates.ROLE_VARS)
    doc = {"roles": {}}
    for role, key in admitted:
        doc["roles"].setdefault(role, {})[key] = f"{role}.{key}"
    assert candidates.role_vars(doc) == {v: f"{r}.{k}" for (r, k), v in candidates.ROLE_VARS.items()}


def test_check_restorable_refuses_unknown_and_derived_env():
    known = next(n for n in sorted(envs.ENV_VARS) if n not in candidates.DERIVED_ENV)
    candidates.check_restorable({"name": "ok", "roles": {"serve": {"env": {known: "1"}}}})
    assert candidates.DERIVED_ENV <= set(envs.ENV_VARS)  # every derived name is a real variable
    for role in ("serve", "engram_server"):
        with pytest.raises(CandidateError, match=f"{role} env DSV41_NOT_A_VARIABLE is not a dsv41 variable"):
            candidates.check_restorable({"name": "x", "roles": {role: {"env": {"DSV41_NOT_A_VARIABLE": "1"}}}})
        for name in sorted(candidates.DERIVED_ENV):
            with pytest.raises(CandidateError, match=f"{role} env {name} is derived by the role"):
                candidates.check_restorable({"name": "x", "roles": {role: {"env": {name: "v"}}}})


def test_load_checked_resolves_and_loads_the_spec(tmp_path):
    from dsv41.harness.bench import BenchError

    root = tmp_path / "candidates"
    root.mkdir()
    spec = json.loads((Path(REPO_CANDIDATES) / "specs" / "drill.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps(spec))
    _cand(root, "withspec", BASE.format(n="withspec") + "spec: w.json\nroles: {}\n")
    assert candidates.load_checked("withspec", root)["spec"] == str(tmp_path / "w.json")
    _cand(root, "nospec", BASE.format(n="nospec") + "spec: missing.json\nroles: {}\n")
    with pytest.raises(BenchError):
        candidates.load_checked("nospec", root)
    _cand(root, "derived", BASE.format(n="derived") + "roles:\n  serve:\n    env:\n      DSV41_WINDOW_TOKEN: t\n")
    with pytest.raises(CandidateError, match="derived by the role"):
        candidates.load_checked("derived", root)


def test_cli_candidate(tmp_path, capsys):
    from dsv41.cli import main

    out = tmp_path / "vars.json"
    assert main(["window", "candidate", "slow-rows", "--root", REPO_CANDIDATES, "--vars-out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"serve_extra_env": {"DSV41_ENGRAM_FAULT_DELAY_MS": "20"}}
    printed = json.loads(capsys.readouterr().out)
    assert printed["candidate"]["name"] == "slow-rows" and printed["role_vars"] == json.loads(out.read_text())
    assert main(["window", "candidate", "nope", "--root", REPO_CANDIDATES]) == 1
    err = capsys.readouterr().err
    assert "unknown candidate" in err and len(err.strip().splitlines()) == 1


def test_vllm_serving_arguments_are_typed_and_only_for_vllm(tmp_path, capsys):
    """``roles.serve.vllm_*`` set the serving role's ``serve_vllm_*`` (the unit's launch line);
    out-of-range values and unknown flags are schema refusals; a candidate that sets them for
    Sparks that serve the stand-in engine is refused, as is an unknown runtime."""
    doc = candidates.load_candidate("vllm-seqs", REPO_CANDIDATES)
    assert candidates.role_vars(doc) == {"serve_vllm_max_num_seqs": 2}
    candidates.check_runtime(doc, "vllm")
    with pytest.raises(CandidateError, match=r"vllm_max_num_seqs\) but the Sparks serve with dsv41_serve_runtime=lab"):
        candidates.check_runtime(doc, "lab")
    with pytest.raises(CandidateError, match="serve runtime must be one of vllm, lab"):
        candidates.check_runtime(doc, "sglang")
    candidates.check_runtime(candidates.load_candidate("slow-rows", REPO_CANDIDATES), "lab")  # env: any runtime
    for body, where in [
        ("vllm_max_num_seqs: 0", "roles/serve/vllm_max_num_seqs"),
        ("vllm_max_num_seqs: '2'", "roles/serve/vllm_max_num_seqs"),
        ("vllm_gpu_memory_utilization: 1.5", "roles/serve/vllm_gpu_memory_utilization"),
        ("vllm_kv_cache_gib: 0", "roles/serve/vllm_kv_cache_gib"),
        ("vllm_trust_remote_code: true", "roles/serve"),
    ]:
        _cand(tmp_path, "v", BASE.format(n="v") + f"roles:\n  serve:\n    {body}\n")
        with pytest.raises(CandidateError, match=f"schema at {where}"):
            candidates.load_candidate("v", tmp_path)
    from dsv41.cli import main

    assert main(["window", "candidate", "vllm-seqs", "--root", REPO_CANDIDATES, "--serve-runtime", "vllm"]) == 0
    capsys.readouterr()
    assert main(["window", "candidate", "vllm-seqs", "--root", REPO_CANDIDATES, "--serve-runtime", "lab"]) == 1
    err = capsys.readouterr().err
    assert "nothing would change" in err and len(err.strip().splitlines()) == 1
