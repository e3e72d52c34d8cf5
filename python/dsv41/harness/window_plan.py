"""What ``window.yml`` checks and decides before it takes a HOLD, and its switch readiness check.

:func:`plan` turns ``-e candidate=NAME`` / ``-e candidates=a,b`` and ``-e control=NAME`` into the
window's plan: every candidate (and the control) loaded and schema-checked, refused when its
delta touches something the window cannot restore, its workload spec readable, its question
under the two-window cap; per window the Ansible variables of each arm and the roles a switch
re-applies (only those either arm changes). Any refusal is one :class:`WindowError` line, raised
before anything is held or written.

:func:`wait_ready` is the last step of every arm switch: one short greedy request through the
held engine (the window's token admits it) and, when Engram is remote, lookups counted on every
rank with zero fallbacks (``harness.refs``).
"""

from __future__ import annotations

import time
from pathlib import Path

from dsv41 import envs
from dsv41.harness import bench, win2
from dsv41.harness.window import WindowError, load_candidate, role_vars

#: The roles whose ``configure`` entry point a switch re-applies when a candidate sets that role's
#: variables (playbooks/window_switch.yml): only env files are re-templated, and a service
#: restarts (its role's restart-then-wait-healthy handlers) only when its files differ.
SWITCH_ROLES = {
    "serve": ["serve"],
    # drafter.env is an input of the engine: its change restarts both ranks through serve
    "spec_decode": ["serve", "spec_decode"],
    "engram_server": ["engram_server"],
}
#: Variables the roles derive from production's own files (digests, paths): a candidate that set
#: them would change what production's inputs are said to be, not a setting; refused.
DERIVED_ENV = frozenset({"DSV41_SERVE_INPUTS_SHA256", "DSV41_TABLES_MANIFEST", "DSV41_TABLES_MANIFEST_SHA256",
                         "DSV41_DRAFTER_FILES_SHA256", "DSV41_WINDOW_TOKEN"})
PRODUCTION = "production"


def check_restorable(doc: dict) -> None:
    """Raise WindowError when a candidate's delta touches something the window cannot restore
    or judge: an env variable unknown to ``dsv41.envs`` (no role would template it back, and
    the engine refuses unknown names) or one the roles derive from production files
    (:data:`DERIVED_ENV`). Settings outside the roles' env files cannot be expressed at all
    (``schemas/candidate.schema.json``)."""
    for role, settings in doc.get("roles", {}).items():
        for name in sorted((settings.get("env") or {})):
            if name not in envs.ENV_VARS:
                raise WindowError(f"candidate {doc['name']!r}: {role} env {name} is not a dsv41 variable "
                                  f"(python/dsv41/envs.py); the window cannot restore what no role templates")
            if name in DERIVED_ENV:
                raise WindowError(f"candidate {doc['name']!r}: {role} env {name} is derived by the role from "
                                  f"production's files; a window may not set it")


def _load(name: str, root: str) -> dict:
    doc = load_candidate(name, root)
    check_restorable(doc)
    if doc.get("spec"):
        spec_path = Path(doc["spec"])
        if not spec_path.is_absolute():
            spec_path = Path(root).resolve().parent / spec_path
        doc["spec"] = str(spec_path)
        bench.load_spec(doc["spec"])  # malformed spec: refused now, not after the HOLD
    return doc


def split_names(text: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; WindowError when empty or a name repeats."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        raise WindowError("no candidate given: -e candidate=NAME or -e candidates=a,b,c")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise WindowError(f"candidate(s) named twice: {', '.join(dup)}")
    return names


def plan(candidates: list[str], control: str = PRODUCTION, root: str = "candidates",
         windows_dir: str = "windows", spec: str | None = None) -> dict:
    """The plan of one HOLD: ``{"control", "control_vars", "windows": [...]}``; one window per
    candidate, in order: ``{"candidate", "question", "kind", "metric", "min_effect", "spec",
    "window_number", "arms": {"control": vars, "candidate": vars}, "roles", "switch_roles"}``.
    ``roles``: the roles the two arms' settings differ in; ``switch_roles``: the roles whose
    ``configure`` a switch re-applies (:data:`SWITCH_ROLES`; empty: nothing differs, no switch). ``spec``: the candidate's, else ``spec``, else the default chain of
    ``bench.load_spec``. Raises WindowError (or win2.Win2Error for the cap) before any HOLD."""
    if control != PRODUCTION and control in candidates:
        raise WindowError(f"{control!r} is both the control and a candidate")
    control_doc = None if control == PRODUCTION else _load(control, root)
    control_vars = role_vars(control_doc) if control_doc else {}
    if spec:
        bench.load_spec(spec)
    windows = []
    for name in candidates:
        doc = _load(name, root)
        metric = doc["primary_metric"]
        nth = win2.check_cap(windows_dir, name, metric)  # a third window is refused here
        cand_vars = role_vars(doc)
        roles = sorted(set((control_doc or {}).get("roles", {})) | set(doc.get("roles", {})))
        switch_roles = sorted({t for r in roles for t in SWITCH_ROLES[r]})
        windows.append({"candidate": name, "question": doc["question"], "kind": doc["kind"], "metric": metric,
                        "min_effect": doc["min_effect"], "spec": doc.get("spec") or spec or "",
                        "window_number": nth, "arms": {"control": control_vars, "candidate": cand_vars},
                        "roles": roles, "switch_roles": switch_roles})
    if spec is None:
        bench.load_spec(None)
    return {"control": control, "control_vars": control_vars, "windows": windows}


def wait_ready(api_url: str, ranks: list[str], timeout_s: float = 120.0, max_tokens: int = 4,
               poll_s: float = 1.0) -> dict:
    """Readiness of a switched arm: rank 0 answers a greedy ``max_tokens`` completion and, with
    ``ranks`` (Engram remote), every listed rank's ``dsv41_engram_lookups`` moved with zero
    ``fallbacks`` across it (``harness.refs``). Retries until ``timeout_s`` (seconds);
    returns ``{"seconds", "attempts", "delta"}``; WindowError with the last reason otherwise."""
    from dsv41.errors import Dsv41Error
    from dsv41.harness import refs

    base = api_url.rstrip("/")
    t0 = time.monotonic()
    attempts, reason = 0, "not tried"
    while True:
        attempts += 1
        try:
            model = refs.served_model(base)
            before = refs.fetch_engram_counters(base + "/metrics") if ranks else {}
            refs.generate(base, "window readiness", model, max_tokens)
            delta = refs.counter_delta(before, refs.fetch_engram_counters(base + "/metrics")) if ranks else {}
            reason = refs.check_remote_engram(delta, ranks) if ranks else None
            if reason is None:
                return {"seconds": round(time.monotonic() - t0, 3), "attempts": attempts, "delta": delta}
        except Dsv41Error as exc:
            reason = str(exc)
        if time.monotonic() - t0 > timeout_s:
            raise WindowError(f"arm not ready at {base} after {timeout_s:g} s ({attempts} attempts): {reason}")
        time.sleep(poll_s)
