"""Is production healthy, and what is it running? One implementation behind ``dsv41 status``,
``ansible-playbook status.yml`` and the summary that ends every deploy.

Three steps, each usable on its own:

1. :func:`dsv41.entrypoints.status_host.host_facts` runs *on* each host (``dsv41 status --local --json``, run by
   ``playbooks/status.yml`` through the inventory's own connection): its dsv41 services and their
   state, the package version, the serving container's image, the Engram manifest's revision and
   table identities, the drafter's identities, the current promotion package.
2. :func:`probe` runs on the controller against the endpoints that already exist (no new
   daemons): rank 0's ``/health``, ``/is_paused`` (admission and since when), ``/metrics`` (Engram
   counters per rank, drafter rounds, accepted tokens, fail-closed rounds, proxy respawns), the
   table server's ``/ready`` and the drafter worker's ``/metrics`` (connections, identities).
   ``/metrics`` is read twice, ``window_s`` seconds apart, for the "over the last N seconds" deltas.
3. :func:`evaluate` turns hosts + probe into a report: healthy, or the reasons it is not
   (unreachable host or rank, a service not running, fallbacks growing, admission held, identity
   mismatch, table server not ready). ``dsv41.entrypoints.status_render`` prints it.

:func:`summarize` is the whole judgement from what ``playbooks/status.yml`` gathered (its summary
task, the ``dsv41_status`` module, calls it); ``dsv41 status`` runs that playbook through
ansible-runner (``dsv41.entrypoints.status_cli``).

Report shape (JSON, what ``--json`` prints)::

    {"time": unix s, "window_s": float, "healthy": bool, "reasons": [str], "warnings": [str],
     "hosts": {name: {"groups": [..], "rank": int|None, "reachable": bool, "error": str|None,
                      "services": {name: state}, "dsv41": str, "image": str|None,
                      "manifest": {"revision": str, "sha256": str, "tables": {layer: identity}}|None,
                      "drafter": {"drafter", "markov", "target"}|None, "promotion": str|None}},
     "api": {...}, "engram": {...}, "drafter": {...}, "window": {...}|None,
     "alerts": {"url": str, "firing": [{"name", "severity", "labels", "summary", "active_at"}],
                "error": str|None}|None}

With a Prometheus URL (``--prometheus``, ``status_prometheus_url``), :func:`add_alerts` reads the
dsv41 alerts it has firing (roles/monitoring's rules): a firing ``critical`` alert is a reason,
any other a warning, and a Prometheus that does not answer is a warning (status still judges from
the endpoints).
"""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

from dsv41 import fileio, service_control
from dsv41.errors import Dsv41Error

# Healthy service states (systemd's "active").
_UP = frozenset().union(*(service_control.for_manager(m).up_states for m in service_control.MANAGERS))
#: Every dsv41 service name starts with it.
SERVICE_PREFIX = service_control.SERVICE_PREFIX


class StatusError(Dsv41Error):
    """Status could not be gathered at all (bad inventory, no project, Ansible failed to start,
    a bad argument)."""


# ---- 2. the endpoints, from the controller -----------------------------------------------------


def _get(url: str, timeout_s: float):
    """(status code, body text), or (None, why) when nothing answered (the harness HTTP client)."""
    from dsv41.harness import http

    try:
        r = http.request("GET", url, what=url, timeout_s=timeout_s)
        return r.status_code, r.text
    except http.HttpError as exc:
        resp = getattr(exc.__cause__, "response", None)
        if resp is not None:  # a non-2xx answer: the caller judges the status
            return resp.status_code, resp.text
        return None, str(exc).removeprefix(f"{url}: ").removesuffix(f" (GET {url})")


def engine_counters(text: str) -> dict:
    """From rank 0's ``/metrics`` text: ``{"engram": {rank: {key: value}}, "drafter": {key: value},
    "spec": {"drafts", "draft_tokens", "accepted_tokens"}}`` (names in ``dsv41.engine.metrics``)."""
    from dsv41.harness import refs

    spec = {}
    for name, _labels, value in refs.parse_metrics(text):
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if name in (f"vllm:spec_decode_{key}_total", f"vllm:spec_decode_{key}"):
                spec[key.removeprefix("num_")] = spec.get(key.removeprefix("num_"), 0.0) + value
    return {"engram": refs.engram_counters(text), "drafter": refs.flat_values(text, "dsv41_drafter_"), "spec": spec}


def worker_facts(text: str) -> dict:
    """From the drafter worker's ``/metrics`` text: ``{"connections": int, "identities": {"drafter",
    "markov", "target"}}`` (``dsv41.drafter.status.parse_status``; Dsv41Error on foreign text)."""
    from dsv41.drafter.status import parse_status

    return parse_status(text)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if isinstance(after[k], (int, float))}


def _read_ranks(rank_urls: dict[str, str], timeout_s: float) -> tuple[str | None, str]:
    """(joined text, "") of every rank's endpoint, each URL read once; (None, one line naming
    the rank and its endpoint) on the first that does not answer 200."""
    seen: dict[str, list[str]] = {}
    for r, u in rank_urls.items():
        seen.setdefault(u, []).append(str(r))
    parts = []
    for u, rs in seen.items():
        code, body = _get(u, timeout_s)
        if code != 200:
            why = f"unreachable ({body})" if code is None else f"HTTP {code}"
            named = [r for r in rs if r != "api"]
            who = f"rank {', '.join(named)}" if named else "rank 0's API"
            return None, f"{who}: metrics endpoint {u} {why}"
        parts.append(body if body.endswith("\n") else body + "\n")
    return "".join(parts), ""


def probe(
    api_url: str,
    engram_url: str | None,
    drafter_url: str | None,
    window_s: float = 5.0,
    timeout_s: float = 5.0,
    sleep=time.sleep,
    rank_metrics: dict[str, str] | None = None,
) -> dict:
    """Read the endpoints. ``api_url``: rank 0's base URL; ``engram_url`` / ``drafter_url``: the
    table server's and the drafter worker's metrics base URLs (``http://A:P``) or None.
    ``window_s`` (s, >= 0): the gap between the two reads of the counters. ``rank_metrics``:
    ``{rank: /metrics URL}`` of every rank's counters (:func:`dsv41.harness.rank_metrics.urls`;
    default rank 0's ``/metrics`` for every rank, the stand-in engine's); under vLLM the
    overlay's state per rank lands in ``engine["overlay"]``.
    Never raises for an unreachable endpoint: the report says so, naming the rank and endpoint."""
    if not window_s >= 0:  # NaN fails too
        raise StatusError(f"--window must be >= 0 seconds, got {window_s}")
    api: dict = {"url": api_url, "health": None, "error": None, "admission": None, "since": None, "model": None}
    code, body = _get(api_url.rstrip("/") + "/health", timeout_s)
    if code is None:
        api["error"] = f"unreachable ({body})"
    else:
        api["health"] = "ok" if code == 200 else f"HTTP {code}: {body[:200]}"
        code, body = _get(api_url.rstrip("/") + "/is_paused", timeout_s)
        try:
            doc = fileio.loads_json(body) if code == 200 else {}
            api["admission"] = "held" if doc["is_paused"] else "open"
            api["since"] = doc.get("paused_since")
        except (ValueError, KeyError, TypeError):
            api["admission"] = f"unknown (/is_paused: {code} {str(body)[:100]})"
        code, body = _get(api_url.rstrip("/") + "/v1/models", timeout_s)
        try:
            api["model"] = fileio.loads_json(body)["data"][0]["id"] if code == 200 else None
        except (ValueError, KeyError, IndexError, TypeError):
            pass

    engine: dict = {
        "error": None,
        "engram": {},
        "drafter": {},
        "spec": {},
        "window": {},
        "overlay": {},
        "metrics_urls": {},
    }
    from dsv41.harness import rank_metrics as RM

    urls = dict(rank_metrics) if rank_metrics is not None else {"0": api_url.rstrip("/") + "/metrics"}
    engine["metrics_urls"] = urls
    engine["per_rank"] = rank_metrics is not None  # a rank missing from urls exports no dsv41 counters
    read = RM.with_api(urls, api_url)  # vLLM's own series (speculation) stay on rank 0's API
    if api["error"] is None:
        first, err = _read_ranks(read, timeout_s)
        second = first
        if first is not None and window_s > 0:
            sleep(window_s)
            second, err = _read_ranks(read, timeout_s)
        before = after = None
        if second is not None:
            try:
                before, after = engine_counters(first), engine_counters(second)
                engine["overlay"] = RM.overlay_states(second)
            except Dsv41Error as exc:  # answered, but not Prometheus text
                err = str(exc)
        if after is not None and not err:
            engine.update(after)
            engine["window"] = {
                "engram": {r: _delta(before["engram"].get(r, {}), c) for r, c in after["engram"].items()},
                "drafter": _delta(before["drafter"], after["drafter"]),
                "spec": _delta(before["spec"], after["spec"]),
            }
        else:
            engine["error"] = err
    else:
        engine["error"] = api["error"]

    server: dict = {"url": engram_url, "ready": None, "error": None}
    if engram_url:
        code, body = _get(engram_url.rstrip("/") + "/ready", timeout_s)
        server["ready"] = code == 200
        server["error"] = None if code == 200 else (f"unreachable ({body})" if code is None else f"/ready HTTP {code}")
    worker: dict = {"url": drafter_url, "error": None}
    if drafter_url:
        code, body = _get(drafter_url.rstrip("/") + "/metrics", timeout_s)
        if code == 200:
            try:
                worker.update(worker_facts(body))
            except Dsv41Error as exc:
                worker["error"] = str(exc)
        else:
            worker["error"] = f"unreachable ({body})" if code is None else f"/metrics HTTP {code}"
    return {
        "time": time.time(),
        "window_s": float(window_s),
        "api": api,
        "engine": engine,
        "engram_server": server,
        "drafter_worker": worker,
    }


def last_window(windows_dir: str | os.PathLike | None) -> dict | None:
    """The newest ``<windows_dir>/<id>/decision.json`` (by mtime) as ``{"id", "verdict", "path"}``;
    None when there is none. ``verdict``: the file's ``verdict`` (or ``decision``) field."""
    if not windows_dir:
        return None
    files = sorted(glob.glob(os.path.join(str(windows_dir), "*", "decision.json")), key=os.path.getmtime)
    if not files:
        return None
    path = files[-1]
    try:
        doc = fileio.read_json(path, "window decision")
        verdict = doc.get("verdict", doc.get("decision")) if isinstance(doc, dict) else None
        if isinstance(verdict, dict):  # what `dsv41 window run` writes: {"decision": {"verdict": ...}}
            verdict = verdict.get("verdict")
    except (OSError, ValueError) as exc:
        verdict = f"unreadable: {exc}"
    return {"id": Path(path).parent.name, "verdict": str(verdict) if verdict is not None else "?", "path": path}


# ---- 3. judge --------------------------------------------------------------------------------


def fmt_since(since: float | None, now: float) -> str:
    """``since <UTC stamp> (<seconds> s)`` of a HOLD taken at Unix time ``since`` (s), seen at ``now``."""
    if not since:
        return "since an unknown time"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since))
    return f"since {stamp} ({max(0, int(now - since))} s)"


def evaluate(hosts: dict, probed: dict, *, expected_image: str = "", window: dict | None = None) -> dict:
    """The report (module docstring) and its verdict.

    ``hosts``: ``{name: {"groups": [...], "rank": int|None, "reachable": bool, "error": str|None,
    **host_facts}}``; ``probed``: :func:`probe`'s result; ``expected_image``: the configured serving
    image (``serve_image``, pinned by digest), compared with what runs when both are known.
    Unhealthy reasons: an unreachable host, rank or endpoint; a dsv41 service not running;
    Engram fallbacks growing over the window; admission held; identity mismatch (manifest tables,
    package version, drafter vs target, image); the table server not ready.
    """
    reasons: list[str] = []
    warnings: list[str] = []
    now = probed.get("time", time.time())
    for name, h in sorted(hosts.items()):
        if not h.get("reachable"):
            reasons.append(f"{name}: unreachable ({h.get('error') or 'no answer'})")
            continue
        for svc, state in sorted((h.get("services") or {}).items()):
            if state not in _UP:
                reasons.append(f"{name}: {svc} is {state}")
        if not h.get("services"):
            reasons.append(f"{name}: no dsv41 services")
        for key in ("manifest", "drafter"):
            if isinstance(h.get(key), dict) and "error" in h[key]:
                reasons.append(f"{name}: {key} unreadable ({h[key]['error']})")
        img = h.get("image")
        if expected_image and img and expected_image.split()[0] not in img.split():
            reasons.append(f"identity mismatch: {name} runs image {img.split()[0]}, configured {expected_image}")

    up = {n: h for n, h in hosts.items() if h.get("reachable")}
    # identity: every host that holds tables holds the same ones (x86host serves, the Sparks fall back)
    tables = {
        n: h["manifest"]["tables"]
        for n, h in up.items()
        if isinstance(h.get("manifest"), dict) and "tables" in h["manifest"]
    }
    if len({fileio.dumps_json(t, sort_keys=True) for t in tables.values()}) > 1:
        ref_name = next(iter(sorted(n for n in tables if "offload" in hosts[n].get("groups", []))), sorted(tables)[0])
        for n, t in sorted(tables.items()):
            if t != tables[ref_name]:
                diff = sorted(k for k in set(t) | set(tables[ref_name]) if t.get(k) != tables[ref_name].get(k))
                reasons.append(
                    f"identity mismatch: Engram tables on {n} differ from {ref_name} (layers {', '.join(diff)})"
                )
    versions = {h.get("dsv41") for h in up.values() if h.get("dsv41")}
    if len(versions) > 1:
        reasons.append(
            "identity mismatch: dsv41 versions differ: "
            + ", ".join(f"{n} {h.get('dsv41')}" for n, h in sorted(up.items()))
        )

    api = probed["api"]
    if api.get("error"):
        reasons.append(f"rank 0 API {api['url']}: {api['error']}")
    elif api.get("health") != "ok":
        reasons.append(f"rank 0 API {api['url']}: {api['health']}")
    held_reason = None
    if api.get("admission") == "held":
        held_reason = f"admission held {fmt_since(api.get('since'), now)}"
        reasons.append(held_reason)
    elif api.get("admission") not in (None, "open"):
        reasons.append(f"admission {api['admission']}")

    eng = probed["engine"]
    if eng.get("error") and not api.get("error"):
        reasons.append(f"metrics: {eng['error']}")
    ranks = sorted({int(h["rank"]) for h in hosts.values() if h.get("rank") is not None})
    win = probed.get("window_s", 0.0)
    murls = eng.get("metrics_urls") or {}
    if not eng.get("error"):
        overlay = eng.get("overlay") or {}
        for r in ranks:
            if eng.get("per_rank") and str(r) not in murls:
                continue  # no overlay on this rank (vLLM's own Engram and drafter): nothing of dsv41's to read
            where = murls.get(str(r)) or murls.get("0") or "rank 0's /metrics"
            if overlay:
                st = overlay.get(str(r), {})
                if st.get("state") != "active":
                    reasons.append(
                        f"rank {r}: overlay {st.get('state') or 'state missing'} on {where} "
                        "(Engram rows and drafts are not remote)"
                    )
                    continue
                if st.get("transport") == "python":
                    warnings.append(
                        f"rank {r}: the overlay runs the pure-Python transport (no C++ extension in the image)"
                    )
            c = eng["engram"].get(str(r))
            if c is None:
                reasons.append(f"rank {r}: unreachable (no Engram counters on {where})")
                continue
            d = eng["window"].get("engram", {}).get(str(r), {})
            if d.get("fallbacks", 0) > 0:
                reasons.append(
                    f"rank {r}: Engram fallbacks growing (+{int(d['fallbacks'])} in {win:g} s, "
                    f"{int(c.get('fallbacks', 0))} since start)"
                )
            elif c.get("fallbacks", 0) > 0:
                warnings.append(
                    f"rank {r}: {int(c['fallbacks'])} Engram fallbacks since start (none in the last {win:g} s)"
                )
        dr = eng.get("drafter", {})
        if dr.get("proxy_gave_up", 0) > 0:
            reasons.append("rank 0: async proxy respawn budget spent, drafting failed closed to target-only")
        fc = eng["window"].get("drafter", {}).get("fail_closed_rounds", 0)
        if fc > 0:
            warnings.append(f"rank 0: {int(fc)} drafting rounds failed closed in the last {win:g} s")
    server = probed["engram_server"]
    if server.get("url") and not server.get("ready"):
        reasons.append(f"Engram table server {server['url']}: {server.get('error') or 'not ready'}")
    worker = probed["drafter_worker"]
    if worker.get("url"):
        if worker.get("error"):
            reasons.append(f"drafter worker {worker['url']}: {worker['error']}")
        else:
            have = worker.get("identities") or {}
            rank0 = [
                h
                for h in up.values()
                if h.get("rank") == 0 and isinstance(h.get("drafter"), dict) and "error" not in h["drafter"]
            ]
            if rank0:
                want = rank0[0]["drafter"]
                bad = [k for k in ("drafter", "markov", "target") if have.get(k, "") != want.get(k, "")]
                if bad:
                    reasons.append(
                        "identity mismatch: drafter worker reports "
                        + ", ".join(f"{k} {have.get(k, '')[:12] or '-'}" for k in bad)
                        + "; rank 0 expects "
                        + ", ".join(f"{k} {want.get(k, '')[:12] or '-'}" for k in bad)
                    )
            if worker.get("connections", 0) < 1:
                warnings.append(f"drafter worker {worker['url']}: no client connected")
    return {
        "time": now,
        "window_s": win,
        "healthy": not reasons,
        "reasons": reasons,
        "warnings": warnings,
        "hosts": hosts,
        "api": api,
        "engine": eng,
        "engram_server": server,
        "drafter_worker": worker,
        "window": window,
        "held_reason": held_reason,
    }


def add_alerts(report: dict, prometheus_url: str | None, timeout_s: float = 5.0, fetch=None) -> dict:
    """``report`` with ``alerts`` from the Prometheus at ``prometheus_url`` (None or "": none
    configured, ``alerts`` None). Firing ``critical`` alerts join the reasons (``healthy``
    recomputed), others the warnings; an unreachable Prometheus is a warning. ``fetch``: the
    reader (default :func:`dsv41.monitoring.alerts.firing`). Returns a new dict."""
    if not prometheus_url:
        return {**report, "alerts": None}
    from dsv41.monitoring import alerts as A

    fetch = fetch or A.firing
    reasons, warnings = list(report["reasons"]), list(report["warnings"])
    out = {"url": prometheus_url, "firing": [], "error": None}
    try:
        out["firing"] = fetch(prometheus_url, timeout_s=timeout_s)
    except A.AlertsError as exc:
        out["error"] = str(exc)
        warnings.append(f"alerts not read: {exc}")
    for a in out["firing"]:
        (reasons if a.get("severity") == "critical" else warnings).append(f"alert firing: {A.describe(a)}")
    return {**report, "alerts": out, "reasons": reasons, "warnings": warnings, "healthy": not reasons}


def allow_hold(report: dict) -> dict:
    """``report`` (as :func:`evaluate` returns it) judged with a HOLD expected: the checks of
    promote.yml / rollback.yml run under their own fenced HOLD, so "admission held" moves from the
    reasons to the warnings and ``healthy`` is recomputed; every other reason still counts.
    Returns a new dict; ``report`` is not changed."""
    held = report.get("held_reason")
    if not held or held not in report["reasons"]:
        return dict(report)
    reasons = [r for r in report["reasons"] if r != held]
    return {
        **report,
        "reasons": reasons,
        "healthy": not reasons,
        "warnings": [*report["warnings"], f"{held} (expected: --hold-ok)"],
    }


# ---- the whole judgement (what the playbook's summary task calls) -----------------------------


def host_entry(raw: dict) -> dict:
    """One host's entry from what ``playbooks/status.yml`` registered for it: ``groups``, ``rank``
    and the ``dsv41 status --local --json`` command result (``unreachable``, ``msg``, ``rc``,
    ``stdout``, ``stderr``)."""
    groups = [g for g in (raw.get("groups") or []) if g not in ("all", "ungrouped")]
    rank = raw.get("rank")
    entry = {"groups": groups, "rank": int(rank) if rank not in (None, "") else None, "reachable": False, "error": None}
    if raw.get("unreachable"):
        entry["error"] = " ".join(str(raw.get("msg") or "unreachable").split()).removeprefix("Task failed: ")[:300]
        return entry
    if raw.get("rc") not in (0, "0"):
        err = (raw.get("stderr") or raw.get("msg") or "").strip().splitlines()
        entry["error"] = f"dsv41 status --local failed: {err[-1] if err else 'rc ' + str(raw.get('rc'))}"[:300]
        return entry
    try:
        facts = fileio.loads_json(raw.get("stdout") or "")
    except ValueError:
        entry["error"] = "dsv41 status --local printed no JSON"
        return entry
    entry.update(facts)
    entry["reachable"] = True
    return entry


def summarize(
    hosts: dict,
    api_url: str,
    engram_url: str | None = None,
    drafter_url: str | None = None,
    window_s: float = 5.0,
    expected_image: str = "",
    windows_dir: str | None = None,
    timeout_s: float = 5.0,
    prometheus_url: str | None = None,
    rank_metrics: dict | None = None,
) -> dict:
    """Probe the endpoints and judge: ``hosts`` as :func:`host_entry` takes them (``{name: raw}``);
    the rest as :func:`probe` and :func:`evaluate`; ``prometheus_url``: :func:`add_alerts`;
    ``rank_metrics``: the runtime facts of :func:`dsv41.harness.rank_metrics.urls` (None: rank
    0's ``/metrics``). Returns the report."""
    from dsv41.harness import rank_metrics as RM

    entries = {name: host_entry(raw) for name, raw in hosts.items()}
    try:
        urls, bad_facts = (RM.urls(rank_metrics) if rank_metrics is not None else None), None
    except RM.RankMetricsError as exc:  # the inventory cannot say where a rank's counters are: a reason
        urls, bad_facts = None, str(exc)
    probed = probe(api_url, engram_url, drafter_url, window_s=window_s, timeout_s=timeout_s, rank_metrics=urls)
    rep = evaluate(entries, probed, expected_image=expected_image, window=last_window(windows_dir))
    if bad_facts:
        rep = {**rep, "reasons": [*rep["reasons"], bad_facts], "healthy": False}
    return add_alerts(rep, prometheus_url, timeout_s=timeout_s)
