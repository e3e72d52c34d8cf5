"""What ``window.yml`` checks and decides before it takes a HOLD, and its switch readiness check.

:func:`plan` turns ``-e candidate=NAME`` / ``-e candidates=a,b`` and ``-e control=NAME`` into the
window's plan: every candidate (and the control) loaded and schema-checked, refused when its
delta touches something the window cannot restore, its workload spec readable (all three:
``harness.candidates.load_checked``), its question under the two-window cap; per window the
Ansible variables of each arm and the roles a switch re-applies (only those either arm changes). Any refusal is one :class:`WindowError` line, raised
before anything is held or written.

:func:`wait_ready` is the last step of every arm switch: one short greedy request through the
held engine (the window's token admits it) and, when Engram is remote, lookups counted on every
rank with zero fallbacks (``harness.refs``).
"""

from __future__ import annotations

import time

from dsv41.harness import bench, win2_cap
from dsv41.harness.candidates import check_runtime, load_checked, role_vars
from dsv41.harness.window import WindowError

#: The roles whose ``configure`` entry point a switch re-applies when a candidate sets that role's
#: variables (playbooks/window_switch.yml): only env files are re-templated, and a service
#: restarts (its role's restart-then-wait-healthy handlers) only when its files differ.
SWITCH_ROLES = {
    "serve": ["serve"],
    # drafter.env is an input of the engine: its change restarts both ranks through serve
    "spec_decode": ["serve", "spec_decode"],
    "engram_server": ["engram_server"],
}
PRODUCTION = "production"


def split_names(text: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; WindowError when empty or a name repeats."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if not names:
        raise WindowError("no candidate given: -e candidate=NAME or -e candidates=a,b,c")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise WindowError(f"candidate(s) named twice: {', '.join(dup)}")
    return names


def plan(
    candidates: list[str],
    control: str = PRODUCTION,
    root: str = "candidates",
    windows_dir: str = "windows",
    spec: str | None = None,
    serve_runtime: str | None = None,
) -> dict:
    """The plan of one HOLD: ``{"control", "control_vars", "windows": [...]}``; one window per
    candidate, in order: ``{"candidate", "question", "kind", "metric", "min_effect", "spec",
    "window_number", "arms": {"control": vars, "candidate": vars}, "roles", "switch_roles"}``.
    ``roles``: the roles the two arms' settings differ in; ``switch_roles``: the roles whose
    ``configure`` a switch re-applies (:data:`SWITCH_ROLES`; empty: nothing differs, no switch). ``spec``: the candidate's, else ``spec``, else the default chain of
    ``bench.load_spec``. ``serve_runtime``: the Sparks' runtime (``vllm`` or ``lab``); when given, a
    candidate or control setting vLLM serving arguments for Sparks that do not serve vLLM is
    refused (``candidates.check_runtime``). Raises WindowError (or win2.Win2Error for the cap)
    before any HOLD."""
    if control != PRODUCTION and control in candidates:
        raise WindowError(f"{control!r} is both the control and a candidate")
    control_doc = None if control == PRODUCTION else load_checked(control, root)
    if control_doc and serve_runtime is not None:
        check_runtime(control_doc, serve_runtime)
    control_vars = role_vars(control_doc) if control_doc else {}
    if spec:
        bench.load_spec(spec)
    windows = []
    for name in candidates:
        doc = load_checked(name, root)
        if serve_runtime is not None:
            check_runtime(doc, serve_runtime)
        metric = doc["primary_metric"]
        nth = win2_cap.check_cap(windows_dir, name, metric)  # a third window is refused here
        cand_vars = role_vars(doc)
        roles = sorted(set((control_doc or {}).get("roles", {})) | set(doc.get("roles", {})))
        switch_roles = sorted({t for r in roles for t in SWITCH_ROLES[r]})
        windows.append(
            {
                "candidate": name,
                "question": doc["question"],
                "kind": doc["kind"],
                "metric": metric,
                "min_effect": doc["min_effect"],
                "spec": doc.get("spec") or spec or "",
                "window_number": nth,
                "arms": {"control": control_vars, "candidate": cand_vars},
                "roles": roles,
                "switch_roles": switch_roles,
            }
        )
    if spec is None:
        bench.load_spec(None)
    return {"control": control, "control_vars": control_vars, "windows": windows}


def wait_ready(
    api_url: str,
    ranks: list[str],
    timeout_s: float = 120.0,
    max_tokens: int = 4,
    poll_s: float = 1.0,
    rank_metrics: dict[str, str] | None = None,
) -> dict:
    """Readiness of a switched arm: rank 0 answers a greedy ``max_tokens`` completion and, with
    ``ranks`` (Engram remote), every listed rank's ``dsv41_engram_lookups`` moved with zero
    ``fallbacks`` across it and, where the vLLM overlay exports its state, every listed rank runs
    it ``active`` (``harness.refs``). ``rank_metrics``: ``{rank: /metrics URL}``
    (:func:`dsv41.harness.rank_metrics.urls`; default rank 0's ``/metrics``). Retries until
    ``timeout_s`` (seconds); returns ``{"seconds", "attempts", "delta"}``; WindowError with the
    last reason otherwise."""
    from dsv41.errors import Dsv41Error
    from dsv41.harness import refs

    base = api_url.rstrip("/")
    t0 = time.monotonic()
    attempts, reason = 0, "not tried"
    while True:
        attempts += 1
        try:
            model = refs.served_model(base)
            if rank_metrics is None:  # the stand-in engine: every rank on rank 0's /metrics
                before = refs.fetch_engram_counters(base + "/metrics") if ranks else {}
                refs.generate(base, "window readiness", model, max_tokens)
                delta = refs.counter_delta(before, refs.fetch_engram_counters(base + "/metrics")) if ranks else {}
                reason = refs.check_remote_engram(delta, ranks) if ranks else None
            else:
                before = refs.engram_counters(refs.read_metrics(rank_metrics)) if ranks else {}
                refs.generate(base, "window readiness", model, max_tokens)
                after = refs.read_metrics(rank_metrics) if ranks else ""
                delta = refs.counter_delta(before, refs.engram_counters(after)) if ranks else {}
                reason = (
                    (refs.check_overlay(after, ranks, rank_metrics) or refs.check_remote_engram(delta, ranks))
                    if ranks
                    else None
                )
            if reason is None:
                return {"seconds": round(time.monotonic() - t0, 3), "attempts": attempts, "delta": delta}
        except Dsv41Error as exc:
            reason = str(exc)
        if time.monotonic() - t0 > timeout_s:
            raise WindowError(f"arm not ready at {base} after {timeout_s:g} s ({attempts} attempts): {reason}")
        time.sleep(poll_s)
