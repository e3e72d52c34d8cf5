"""Controller-side qualification probes (``dsv41 qualify serving|reconnect|fail-closed|drafter-identity``):
they read rank 0's API (``/v1/completions``, ``/metrics``) and the drafter worker's identities
from the controller, and return the check records (``dsv41.entrypoints.qualify.record``) of the
serving, transport (reconnect) and drafter groups.
"""

from __future__ import annotations

import time

from dsv41.entrypoints.qualify import record
from dsv41.errors import Dsv41Error


def _completions(api_url: str, n: int, timeout_s: float = 60.0) -> tuple[int, list[str]]:
    """Send ``n`` short completions to rank 0; (how many succeeded, error lines)."""
    import httpx

    from dsv41.harness.refs import served_model

    model = served_model(api_url)
    ok, errors = 0, []
    from dsv41.harness import http

    with httpx.Client(timeout=timeout_s, trust_env=False, headers=http.auth_headers(what="qualification traffic")) as c:
        for i in range(n):
            try:
                r = c.post(
                    api_url.rstrip("/") + "/v1/completions",
                    json={
                        "model": model,
                        "prompt": f"qualification traffic {i}: the",
                        "max_tokens": 8,
                        "temperature": 0,
                    },
                )
                if r.status_code == 200:
                    ok += 1
                else:
                    errors.append(f"HTTP {r.status_code}: {r.text[:120]}")
            except httpx.HTTPError as exc:
                errors.append(str(exc))
    return ok, errors


def _engine(api_url: str, rank_metrics: dict[str, str] | None = None) -> dict:
    """Counters as :func:`dsv41.entrypoints.status.engine_counters` returns them, plus
    ``overlay`` (:func:`dsv41.harness.rank_metrics.overlay_states`), read from every rank's
    endpoint (``rank_metrics``: ``{rank: url}``) or rank 0's ``/metrics``."""
    from dsv41.entrypoints.status import engine_counters
    from dsv41.harness import rank_metrics as RM
    from dsv41.harness.refs import read_metrics

    text = read_metrics(RM.with_api(rank_metrics, api_url) if rank_metrics else api_url.rstrip("/") + "/metrics")
    return {**engine_counters(text), "overlay": RM.overlay_states(text)}


def probe_serving(
    api_url: str,
    refs_path: str,
    *,
    host: str,
    ranks: list[str],
    interval_s: float = 10.0,
    requests: int = 8,
    rank_metrics: dict[str, str] | None = None,
) -> list[dict]:
    """Controller-side serving checks: ``counters[rank R]`` (Engram lookups, rows and remote rows
    grow on each rank over ``interval_s`` seconds of traffic, fallbacks, transport errors and refusals stay 0;
    under vLLM the rank's overlay is ``active`` and its transport implementation is reported)
    and ``greedy_refs`` (6/6 identical to the recorded references, ``dsv41.harness.refs``).
    ``rank_metrics``: ``{rank: /metrics URL}`` (:func:`dsv41.harness.rank_metrics.urls`; default
    rank 0's ``/metrics``); a rank it leaves out (vLLM with that rank's overlay off) is skipped with
    the reason."""
    from dsv41.harness import refs

    out = []
    try:
        before = _engine(api_url, rank_metrics)
        t0 = time.monotonic()
        sent, errors = 0, []
        while True:
            k, e = _completions(api_url, requests)
            sent, errors = sent + k, errors + e
            if time.monotonic() - t0 >= interval_s:
                break
        after = _engine(api_url, rank_metrics)
        secs = time.monotonic() - t0
    except Dsv41Error as exc:
        return [
            record("serving", "counters", host, False, reason=f"{api_url}: {exc}", subject=f"rank {r}") for r in ranks
        ] + [record("serving", "greedy_refs", host, False, reason=f"{api_url}: {exc}")]
    where = rank_metrics or {}
    for r in ranks:
        if rank_metrics is not None and r not in rank_metrics:
            # under vLLM a rank without remote Engram or remote drafting runs vLLM's own code
            out.append(
                record(
                    "serving",
                    "counters",
                    host,
                    None,
                    subject=f"rank {r}",
                    reason=f"rank {r} runs vLLM's own code (remote Engram and remote drafting off): no dsv41 counters",
                )
            )
            continue
        b, a = before["engram"].get(r, {}), after["engram"].get(r)
        url = where.get(r, f"{api_url}/metrics")
        st = after["overlay"].get(r) if after["overlay"] else None
        if after["overlay"] and (st or {}).get("state") != "active":
            out.append(
                record(
                    "serving",
                    "counters",
                    host,
                    False,
                    st,
                    "overlay active",
                    subject=f"rank {r}",
                    reason=f"rank {r}: overlay {(st or {}).get('state') or 'state missing'} on {url}: "
                    "its Engram rows and drafts are not remote",
                )
            )
            continue
        if a is None:
            out.append(
                record(
                    "serving",
                    "counters",
                    host,
                    False,
                    None,
                    "growing, 0 fallbacks",
                    subject=f"rank {r}",
                    reason=f"rank {r}: no Engram counters on {url}",
                )
            )
            continue
        # remote_rows is reported by the vLLM overlay's counters; the lab engine's /metrics has no such series
        keys = [
            k
            for k in ("lookups", "rows", "remote_rows", "fallbacks", "transport_errors", "refusals")
            if k in a or k != "remote_rows"
        ]
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in keys}
        grow = [k for k in ("lookups", "rows") if d[k] <= 0]
        if "remote_rows" in d and d["remote_rows"] <= 0:
            grow.append("remote_rows")
        bad = [k for k in ("fallbacks", "transport_errors", "refusals") if d[k] != 0]
        ok = not grow and not bad and sent > 0
        seen = {k: int(v) for k, v in d.items()} | {"seconds": round(secs, 1), "requests": sent}
        if st:
            seen["transport"] = st.get("transport", "")
        out.append(
            record(
                "serving",
                "counters",
                host,
                ok,
                seen,
                "lookups/rows grow; fallbacks, transport_errors, refusals 0",
                subject=f"rank {r}",
                reason=""
                if ok
                else f"rank {r} over {secs:.0f} s: "
                + "; ".join(
                    [f"{k} did not grow" for k in grow]
                    + [f"{k} +{int(d[k])}" for k in bad]
                    + ([f"no request succeeded ({errors[:1]})"] if sent == 0 else [])
                ),
            )
        )
    try:
        cmp = refs.verify(api_url, refs.load_refs(refs_path))
        ok = cmp.identical == cmp.total == 6
        out.append(
            record(
                "serving",
                "greedy_refs",
                host,
                ok,
                f"{cmp.identical}/{cmp.total}",
                "6/6",
                reason="" if ok else f"greedy references from {refs_path}: {cmp.summary()}",
            )
        )
    except Dsv41Error as exc:
        out.append(record("serving", "greedy_refs", host, False, None, "6/6", reason=f"greedy references: {exc}"))
    return out


def probe_reconnect(
    api_url: str,
    *,
    host: str,
    ranks: list[str],
    requests: int = 16,
    wait_s: float = 30.0,
    rank_metrics: dict[str, str] | None = None,
) -> list[dict]:
    """After the table server was restarted (the playbook restarts it and waits for /ready just
    before): traffic until every rank counts a reconnect and remote lookups again with no
    fallback in the last round (``transport.reconnect[rank R]``), within ``wait_s`` seconds.
    ``rank_metrics`` as :func:`probe_serving`."""
    out = []
    try:
        base = _engine(api_url, rank_metrics)
        deadline = time.monotonic() + wait_s
        state: dict = {}
        while True:
            before = _engine(api_url, rank_metrics)
            _completions(api_url, requests)
            after = _engine(api_url, rank_metrics)
            for r in ranks:
                a, b, z = after["engram"].get(r, {}), before["engram"].get(r, {}), base["engram"].get(r, {})
                state[r] = {
                    "reconnects": int(a.get("reconnects", 0) - z.get("reconnects", 0)),
                    "fallbacks_during_restart": int(a.get("fallbacks", 0) - z.get("fallbacks", 0)),
                    "last_round_lookups": int(a.get("lookups", 0) - b.get("lookups", 0)),
                    "last_round_fallbacks": int(a.get("fallbacks", 0) - b.get("fallbacks", 0)),
                }
            if (
                all(s["last_round_lookups"] > 0 and s["last_round_fallbacks"] == 0 for s in state.values())
                or time.monotonic() > deadline
            ):
                break
    except Dsv41Error as exc:
        return [
            record("transport", "reconnect", host, False, reason=f"{api_url}: {exc}", subject=f"rank {r}")
            for r in ranks
        ]
    for r in ranks:
        s = state.get(r, {})
        ok = bool(s) and s["last_round_lookups"] > 0 and s["last_round_fallbacks"] == 0
        out.append(
            record(
                "transport",
                "reconnect",
                host,
                ok,
                s,
                "remote lookups again, 0 fallbacks",
                subject=f"rank {r}",
                reason=""
                if ok
                else f"rank {r}: not serving remote rows {wait_s:.0f} s after the table server restart: {s}",
            )
        )
    return out


def probe_fail_closed(
    api_url: str, refs_path: str, *, host: str, requests: int = 8, rank_metrics: dict[str, str] | None = None
) -> list[dict]:
    """With the drafter worker stopped (by the playbook, just before): requests still succeed,
    rank 0 counts fail-closed drafting rounds and no identity refusal, and the greedy references
    stay 6/6 (``drafter.fail_closed``). ``rank_metrics`` as :func:`probe_serving`."""
    from dsv41.harness import refs

    try:
        before = _engine(api_url, rank_metrics)
        ok_n, errors = _completions(api_url, requests)
        after = _engine(api_url, rank_metrics)
        cmp = refs.verify(api_url, refs.load_refs(refs_path))
        same, total = cmp.identical, cmp.total
    except Dsv41Error as exc:
        return [record("drafter", "fail_closed", host, False, reason=f"{api_url}: {exc}")]
    fc = int(after["drafter"].get("fail_closed_rounds", 0) - before["drafter"].get("fail_closed_rounds", 0))
    ok = ok_n == requests and fc > 0 and same == total == 6
    return [
        record(
            "drafter",
            "fail_closed",
            host,
            ok,
            {"requests_ok": ok_n, "requests": requests, "fail_closed_rounds": fc, "greedy_refs": f"{same}/{total}"},
            {"requests_ok": requests, "fail_closed_rounds": "> 0", "greedy_refs": "6/6"},
            reason=""
            if ok
            else f"drafter worker stopped: {ok_n}/{requests} requests ok, {fc} fail-closed rounds, "
            f"refs {same}/{total}" + (f" ({errors[0]})" if errors else ""),
        )
    ]


def probe_drafter_identity(worker: dict | None, expected: dict | None, *, host: str) -> list[dict]:
    """``drafter.worker_identity``: the worker's drafter / Markov / target identities (its
    ``/metrics``, ``dsv41 drafter status``) equal rank 0's drafter files (``dsv41 drafter identity``)."""
    if not worker or not expected:
        return [
            record(
                "drafter",
                "worker_identity",
                host,
                False,
                worker,
                expected,
                reason="drafter worker or rank 0's drafter files could not be read",
            )
        ]
    keys = ("drafter", "markov", "target")
    got = {k: (worker.get("identities") or {}).get(k) for k in keys}
    want = {k: expected.get(k) for k in keys}
    ok = got == want and all(want.values())
    return [
        record(
            "drafter",
            "worker_identity",
            host,
            ok,
            got,
            want,
            reason=""
            if ok
            else "worker identities differ from rank 0's drafter files: "
            + ", ".join(k for k in keys if got[k] != want[k]),
        )
    ]
