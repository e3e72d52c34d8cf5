"""The staged bring-up (``bringup.yml``): which stages run next, and each stage's gate decision.

The published bring-up order (docs/operations.md, "First deploy: the bring-up"), one name each:

==================  ==========================================================================
stage               what passes its gate
==================  ==========================================================================
``stock``           deploy's roles with every offloaded component off; the greedy references
                    and the baseline recorded (the references 6/6 in the record itself)
``links_rows``      every link check and peer answer, 0 bad rows / 0 fallbacks in the exactness
                    sweep (required mode, against the local shards) on every Spark
``remote_engram``   references identical to ``stock``'s; Engram lookups counted on both ranks
                    with zero fallbacks while they ran (the measured interval)
``remote_drafter``  references identical; the drafter ran rounds with no identity refusal; the
                    KV pool equals the expected size where the engine exports it
``async``           the proxy self-test passed on each Spark; references identical; zero
                    fallbacks and fail-closed (watchdog) rounds while they ran
``window``          the fenced window of the final configuration ran to its verdict
==================  ==========================================================================

Each passed stage is one ``stage_passed`` step in the promotion journal (:mod:`.journal`) under
the operation that ran it, whose ``begin`` has ``kind: bringup``, ``stage`` and ``bringup`` (the
bring-up's run id). :func:`plan` reads those back: a re-run continues after the last passed stage.
The gates are pure decisions over what the playbook measured; a failing one is a single line
naming the stage, the host and the measured value (:class:`GateError`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from dsv41.errors import Dsv41Error
from dsv41.harness.components import ROLE_VARS

#: The stages in the published order.
STAGES = ("stock", "links_rows", "remote_engram", "remote_drafter", "async", "window")
#: The journal ``begin`` kind of a bring-up stage's operation.
KIND = "bringup"
#: The journal step of a passed gate.
STEP = "stage_passed"
#: Stage -> the component (harness.components.ROLE_VARS) it switches on; before that stage the
#: component's role variables keep it off.
ENABLES = {"remote_engram": "remote_engram", "remote_drafter": "remote_drafter", "async": "async_handoff"}
#: Stages that change serving production: a change under a HOLD (roles/change begin, check, finish).
CHANGE_STAGES = tuple(ENABLES)


class BringupError(Dsv41Error):
    """A stage name that is not a stage, or a plan that cannot run (an earlier stage not passed)."""


class GateError(Dsv41Error):
    """A gate that failed: one line naming the stage, the host and the measured value."""


def stage_name(name: object) -> str:
    """``name`` if it is exactly one of STAGES; BringupError (one line listing them) otherwise.
    Names are names: no globs, prefixes, paths or case folding."""
    if not isinstance(name, str) or name not in STAGES:
        raise BringupError(f"unknown bring-up stage {name!r}: choose one of {', '.join(STAGES)}")
    return name


def role_vars(stage: str) -> dict[str, bool]:
    """The role variables that keep off every component not yet switched on at ``stage``
    (``{}`` from ``async`` on: deploy.yml's production). Set over the inventory's values."""
    at = STAGES.index(stage_name(stage))
    out: dict[str, bool] = {}
    for enabling, comp in ENABLES.items():
        if STAGES.index(enabling) > at:
            out.update(ROLE_VARS[comp])
    return out


def new_run_id() -> str:
    """A fresh bring-up run id (``<utc yyyymmddThhmmss>-<8 hex>``)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def passed(entries: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[str]]:
    """``(run id, stages passed in that run, in STAGES order)`` of the latest bring-up in the
    journal ``entries`` (:func:`dsv41.promotion.journal.read`); ``(None, [])`` when none ran.
    Only ``stage_passed`` entries of operations whose ``begin`` is a bring-up of that run count."""
    ops: dict[str, str] = {}
    run = None
    for e in entries:
        if e.get("step") == "begin" and e.get("kind") == KIND and isinstance(e.get("bringup"), str):
            ops[e["op"]] = e["bringup"]
            run = e["bringup"]
    if run is None:
        return None, []
    done = {
        e.get("stage")
        for e in entries
        if e.get("step") == STEP and ops.get(e.get("op")) == run and e.get("bringup") == run
    }
    return run, [s for s in STAGES if s in done]


def plan(entries: Sequence[Mapping[str, Any]], stage: str = "", restart: bool = False) -> dict:
    """Which stages this run executes: ``{"run": id, "new": bool, "passed": [...], "stages": [...]}``.

    ``restart``: a new run from ``stock``. ``stage``: only that stage, in the latest run; every
    earlier stage must have passed there (BringupError naming the first that did not). Neither:
    continue after the last passed stage (all of them when no bring-up ran; none when every
    stage passed). ``restart`` with ``stage`` is refused (one or the other)."""
    if stage:
        stage_name(stage)
    if restart and stage:
        raise BringupError("give -e stage=NAME or -e bringup_restart=true, not both")
    run, done = passed(entries)
    if restart or run is None:
        return {
            "run": new_run_id(),
            "new": True,
            "passed": [],
            "stages": _missing(stage, []) if stage else list(STAGES),
        }
    if stage:
        _missing(stage, done)
        return {"run": run, "new": False, "passed": done, "stages": [stage]}
    last = max((STAGES.index(s) for s in done), default=-1)
    return {"run": run, "new": False, "passed": done, "stages": list(STAGES[last + 1 :])}


def _missing(stage: str, done: Sequence[str]) -> list[str]:
    for s in STAGES[: STAGES.index(stage)]:
        if s not in done:
            raise BringupError(f"stage {stage} needs stage {s} passed first (run bringup.yml without -e stage)")
    return [stage]


# ---- the gates --------------------------------------------------------------------------------


def _fail(stage: str, host: str, what: str) -> GateError:
    return GateError(f"bring-up stopped at stage {stage} on {host}: {what}")


def gate_links_rows(host: str, records: Sequence[Mapping[str, Any]]) -> dict:
    """Stage ``links_rows`` on ``host``: ``records`` are the qualify records of its link, peer and
    exactness-sweep checks (``dsv41 qualify peers|sweep`` records with ``status``; ``rdma_link``
    checks with ``link``, ``check`` and ``ok``).
    Passes when none failed (a skipped exactness record fails: the sweep must run) and at least one
    ran; GateError names the first failed check and its
    value (the sweep's bad rows / lookups / fallbacks)."""
    if not records:
        raise _fail("links_rows", host, "no link or exactness check ran")
    for r in records:
        # a sweep that did not run is not a pass (required mode)
        failed = (
            r.get("status") == "fail"
            or r.get("ok") is False
            or (r.get("status") == "skipped" and str(r.get("id", "")).startswith("exactness"))
        )
        if failed:
            name = r.get("id") or f"{r.get('link', '?')}.{r.get('check', '?')}"
            why = r.get("reason") or f"value {r.get('value')!r}, expected {r.get('expected')!r}"
            raise _fail("links_rows", host, f"{name}: {why}")
    return {"stage": "links_rows", "host": host, "checks": len(records)}


def _refs(stage: str, host: str, refs: Mapping[str, Any]) -> None:
    ident, total = refs.get("identical"), refs.get("total")
    if not isinstance(total, int) or total <= 0 or ident != total:
        raise _fail(stage, host, f"greedy references {ident}/{total} identical to stage stock's")


def gate_remote_engram(host: str, refs: Mapping[str, Any], ranks: Sequence[str]) -> dict:
    """Stage ``remote_engram``: ``refs`` is the greedy_refs verify result (``identical``,
    ``total``, ``counters_delta``: ``{rank: {lookups, fallbacks}}`` over the prompts, the measured
    interval). Every rank of ``ranks`` must count lookups with zero fallbacks."""
    _refs("remote_engram", host, refs)
    delta = refs.get("counters_delta") or {}
    for r in ranks:
        d = delta.get(str(r))
        if d is None:
            raise _fail("remote_engram", host, f"rank {r}: no Engram counters (remote rows not served)")
        if d.get("lookups", 0) <= 0:
            raise _fail("remote_engram", host, f"rank {r}: {int(d.get('lookups', 0))} Engram lookups in the interval")
        if d.get("fallbacks", 0) != 0:
            raise _fail("remote_engram", host, f"rank {r}: {int(d['fallbacks'])} Engram fallbacks in the interval")
    return {"stage": "remote_engram", "host": host, "ranks": {str(r): delta[str(r)] for r in ranks}}


def gate_remote_drafter(host: str, refs: Mapping[str, Any], kv_tokens: float | None, kv_expected: int) -> dict:
    """Stage ``remote_drafter``: references identical; ``refs["drafter_delta"]`` (rank 0's
    speculator over the prompts) ran rounds with no identity refusal (the worker's drafter,
    Markov and target identities match the Spark's); ``kv_tokens`` (the engine's
    ``dsv41_engine_kv_cache_tokens`` gauge, None where the engine exports none: skipped) equals
    ``kv_expected`` (the baseline budget plus, in capacity mode, the local drafter's memory tokens)."""
    _refs("remote_drafter", host, refs)
    d = refs.get("drafter_delta") or {}
    if d.get("identity_refusals", 0) > 0:
        raise _fail("remote_drafter", host, f"{int(d['identity_refusals'])} drafter identity refusals")
    if d.get("rounds", 0) <= 0:
        raise _fail("remote_drafter", host, f"{int(d.get('rounds', 0))} drafter rounds in the interval")
    if kv_tokens is not None and int(kv_tokens) != int(kv_expected):
        raise _fail("remote_drafter", host, f"KV pool {int(kv_tokens)} tokens, expected {int(kv_expected)}")
    return {
        "stage": "remote_drafter",
        "host": host,
        "rounds": d.get("rounds"),
        "kv_tokens": None if kv_tokens is None else int(kv_tokens),
    }


def gate_async(host: str, selftests: Mapping[str, Any], refs: Mapping[str, Any], ranks: Sequence[str]) -> dict:
    """Stage ``async``: ``selftests`` is ``{spark: report}`` of ``dsv41 proxy self-test --json``
    run where the proxy runs (``ring``/``host_flags`` ``ok``, ``torch_loaded`` false, and
    ``mlock`` ``ok`` where the report carries it: anything else is the failure it names, e.g. the
    ``RLIMIT_MEMLOCK`` refusal; a string is the command's error line); references identical, zero
    Engram fallbacks on ``ranks``, drafter rounds over the prompts with zero watchdog fires,
    proxy respawns and give-ups (fail-closed rounds and timeouts are recorded, not refused)."""
    for spark, rep in sorted(selftests.items()):
        if not isinstance(rep, Mapping):
            raise _fail("async", spark, f"proxy self-test: {rep}")
        if "mlock" in rep and rep["mlock"] != "ok":
            raise _fail("async", spark, f"proxy memory locking: {rep['mlock']}")
        if rep.get("ring") != "ok" or rep.get("host_flags") != "ok" or rep.get("torch_loaded") is not False:
            raise _fail("async", spark, f"proxy self-test: {dict(rep)}")
    if not selftests:
        raise _fail("async", host, "no proxy self-test ran")
    _refs("async", host, refs)
    delta = refs.get("counters_delta") or {}
    for r in ranks:
        fb = (delta.get(str(r)) or {}).get("fallbacks", 0)
        if fb:
            raise _fail("async", host, f"rank {r}: {int(fb)} Engram fallbacks in the interval")
    d = refs.get("drafter_delta") or {}
    # Fresh watchdog counters: the proxy was never found hung or dead and never respawned in the
    # interval. A round that timed out and decoded target-only (fail-closed) is the designed path
    # for one slow worker round, not a broken proxy: counted and recorded, not a gate failure.
    for key, what in (
        ("watchdog_fires", "watchdog fires (a hung or dead proxy)"),
        ("proxy_respawns", "proxy respawns"),
        ("proxy_gave_up", "proxy gave up (respawn budget spent)"),
    ):
        if d.get(key, 0):
            raise _fail("async", host, f"{int(d[key])} {what} in the interval")
    if d.get("rounds", 0) <= 0:
        raise _fail("async", host, f"{int(d.get('rounds', 0))} drafter rounds in the interval")
    return {
        "stage": "async",
        "host": host,
        "selftests": sorted(selftests),
        "rounds": d.get("rounds"),
        "fail_closed_rounds": d.get("fail_closed_rounds", 0),
        "timeouts": d.get("timeouts", 0),
    }


def gate_window(host: str, rc: int, verdict: str | None = None) -> dict:
    """Stage ``window``: ``rc`` is the exit status of the fenced window of the final configuration,
    ``verdict`` its WIN2 decision; passes when the window ran to its verdict (rc 0)."""
    if rc != 0:
        raise _fail("window", host, f"window exit {rc!r}, verdict {verdict!r}")
    return {"stage": "window", "host": host, "verdict": verdict}


#: Stage -> its gate (``stock`` has none of its own: the references' record and the baseline).
GATES = {
    "links_rows": gate_links_rows,
    "remote_engram": gate_remote_engram,
    "remote_drafter": gate_remote_drafter,
    "async": gate_async,
    "window": gate_window,
}


def gate(stage: str, host: str, measured: Mapping[str, Any]) -> dict:
    """Run ``stage``'s gate on ``measured`` (its keyword arguments as a mapping); returns the
    fields to journal with ``stage_passed``. GateError (one line) when it fails; BringupError for
    an unknown stage, a stage without a gate or measured values of the wrong shape."""
    fn = GATES.get(stage_name(stage))
    if fn is None:
        raise BringupError(f"stage {stage} has no gate")
    if not isinstance(measured, Mapping):
        raise BringupError(f"stage {stage}: measured values must be a mapping")
    try:
        return fn(host, **measured)
    except TypeError as exc:
        raise BringupError(f"stage {stage}: measured values do not fit its gate: {exc}") from None
    except (AttributeError, ValueError) as exc:
        raise BringupError(f"stage {stage}: measured values of the wrong shape: {exc}") from None
