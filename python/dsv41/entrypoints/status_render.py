"""The status report (``dsv41.entrypoints.status``'s :func:`~dsv41.entrypoints.status.evaluate`
and :func:`~dsv41.entrypoints.status.summarize`) for people: :func:`render_lines` (plain lines:
the deploy's summary, ``dsv41 status`` without a tty) and :func:`render_tables` (rich tables on a
tty). Both read the report only; neither judges.
"""

from __future__ import annotations

from dsv41.entrypoints.status import SERVICE_PREFIX, fmt_since


def _short(x: str | None, n: int = 12) -> str:
    return (x or "-")[:n]


def _host_cells(name: str, h: dict) -> list[str]:
    role = f"rank {h['rank']}" if h.get("rank") is not None else ",".join(h.get("groups") or []) or "-"
    if not h.get("reachable"):
        return [name, role, f"unreachable: {h.get('error') or ''}"[:80], "-", "-", "-", "-", "-"]
    svcs = (
        ", ".join(f"{s.removeprefix(SERVICE_PREFIX)} {st}" for s, st in sorted((h.get("services") or {}).items()))
        or "none"
    )
    man = h.get("manifest")
    tables = (
        "-"
        if man is None
        else man.get("error", "")[:40]
        if "error" in man
        else f"{man['revision']} " + " ".join(f"L{k}:{_short(v, 8)}" for k, v in sorted(man["tables"].items()))
    )
    dr = h.get("drafter")
    drafter = (
        "-"
        if dr is None
        else dr.get("error", "")[:40]
        if "error" in dr
        else (f"drafter {_short(dr.get('drafter'), 8)} target {_short(dr.get('target'), 8)}")
    )
    image = h.get("image") or "none (no container)"
    return [name, role, svcs, h.get("dsv41") or "-", image, tables, drafter, h.get("promotion") or "none"]


def _rank_rows(report: dict) -> list[list[str]]:
    eng = report["engine"]
    rows = []
    for r, c in sorted(eng.get("engram", {}).items()):
        d = eng.get("window", {}).get("engram", {}).get(r, {})
        rows.append(
            [
                r,
                f"{int(c.get('lookups', 0))}",
                f"+{int(d.get('lookups', 0))}",
                f"{int(c.get('fallbacks', 0))}",
                f"+{int(d.get('fallbacks', 0))}",
            ]
        )
    return rows


def _drafting_line(report: dict) -> str:
    eng = report["engine"]
    dr, spec, w = eng.get("drafter", {}), eng.get("spec", {}), eng.get("window", {})
    wd, ws = w.get("drafter", {}), w.get("spec", {})
    line = (
        f"drafter rounds {int(dr.get('rounds', 0))} (+{int(wd.get('rounds', 0))}), accepted tokens "
        f"{int(spec.get('accepted_tokens', 0))}/{int(spec.get('draft_tokens', 0))} (+{int(ws.get('accepted_tokens', 0))}), "
        f"fail-closed {int(dr.get('fail_closed_rounds', 0))} (+{int(wd.get('fail_closed_rounds', 0))}), "
        f"proxy respawns {int(dr.get('proxy_respawns', 0))}"
    )
    worker = report["drafter_worker"]
    if worker.get("url") and not worker.get("error"):
        ids = worker.get("identities") or {}
        line += (
            f"; worker {worker['url']} connections {int(worker.get('connections', 0))}, "
            f"drafter {_short(ids.get('drafter'))} target {_short(ids.get('target'))}"
        )
    return line


def _admission_line(report: dict) -> str:
    api = report["api"]
    adm = api.get("admission") or "unknown"
    if adm == "held":
        adm += " " + fmt_since(api.get("since"), report["time"])
    return adm


def _alerts_line(report: dict) -> str | None:
    al = report.get("alerts")
    if not al:
        return None
    if al.get("error"):
        return f"alerts ({al['url']}): not read"
    names = sorted({a["name"] for a in al["firing"]})
    return f"alerts ({al['url']}): " + (f"{len(al['firing'])} firing: {', '.join(names)}" if names else "none firing")


def _window_line(report: dict) -> str:
    w = report.get("window")
    return "none" if not w else f"{w['id']}: {w['verdict']}"


def _metrics_where(report: dict) -> str:
    """Where the counters were read: rank 0's /metrics, or each rank's endpoint (vLLM overlay),
    with the overlay's state and transport per rank when it exports them."""
    eng = report.get("engine") or {}
    urls = eng.get("metrics_urls") or {}
    overlay = eng.get("overlay") or {}
    if len(set(urls.values())) <= 1 and not overlay:
        return f"{report['api']['url']}/metrics"
    parts = []
    for r, u in sorted(urls.items()):
        st = overlay.get(r, {})
        extra = f" (overlay {st.get('state', '?')}, transport {st.get('transport', '?')})" if overlay else ""
        parts.append(f"rank {r} {u}{extra}")
    return ", ".join(parts)


def render_lines(report: dict) -> list[str]:
    """The report as plain lines (the playbook's summary; also ``dsv41 status`` without a tty)."""
    api = report["api"]
    lines = [
        f"status: {'HEALTHY' if report['healthy'] else 'UNHEALTHY'}",
        f"API: {api['url']} (model {api.get('model') or '?'}; health {api.get('health') or api.get('error')}); "
        f"metrics {_metrics_where(report)}; admission {_admission_line(report)}",
    ]
    for name, h in sorted(report["hosts"].items()):
        c = _host_cells(name, h)
        if not h.get("reachable"):
            lines.append(f"{c[0]} ({c[1]}): unreachable")
            continue
        lines.append(f"{c[0]} ({c[1]}): {c[2]}; dsv41 {c[3]}; image {c[4]}; tables {c[5]}; {c[6]}; promotion {c[7]}")
    srv = report["engram_server"]
    if srv.get("url"):
        lines.append(f"Engram table server {srv['url']}/metrics: {'ready' if srv.get('ready') else srv.get('error')}")
    for r, look, dlook, fb, dfb in _rank_rows(report):
        lines.append(
            f"Engram rank {r}: {look} lookups ({dlook} in {report['window_s']:g} s), "
            f"{fb} fallbacks ({dfb} in {report['window_s']:g} s)"
        )
    lines.append(_drafting_line(report))
    lines.append(f"last window: {_window_line(report)}")
    if _alerts_line(report):
        lines.append(_alerts_line(report))
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    lines += [f"unhealthy: {r}" for r in report["reasons"]]
    return lines


def render_tables(report: dict, console) -> None:
    """Print the report with rich tables on ``console`` (a ``rich.console.Console``)."""
    from rich.table import Table

    api = report["api"]
    t = Table(title="dsv41 hosts", title_justify="left")
    for col in ("host", "role", "services", "dsv41", "image", "tables (revision, identities)", "drafter", "promotion"):
        t.add_column(col, overflow="fold")
    for name, h in sorted(report["hosts"].items()):
        t.add_row(*_host_cells(name, h))
    console.print(t)
    console.print(
        f"API {api['url']}  model {api.get('model') or '?'}  health {api.get('health') or api.get('error')}"
        f"  admission [bold]{_admission_line(report)}[/bold]",
        markup=True,
        highlight=False,
    )
    srv = report["engram_server"]
    if srv.get("url"):
        console.print(
            f"Engram table server {srv['url']}: {'ready' if srv.get('ready') else srv.get('error')}", highlight=False
        )
    e = Table(title=f"Engram per rank (since start / last {report['window_s']:g} s)", title_justify="left")
    for col in ("rank", "lookups", "Δ lookups", "fallbacks", "Δ fallbacks"):
        e.add_column(col, justify="right")
    for row in _rank_rows(report):
        e.add_row(*row)
    console.print(e)
    console.print(_drafting_line(report), highlight=False)
    console.print(f"last window: {_window_line(report)}", highlight=False)
    if _alerts_line(report):
        console.print(_alerts_line(report), highlight=False)
    for w in report.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    if report["healthy"]:
        console.print("[green]healthy[/green]")
    for r in report["reasons"]:
        console.print(f"[red]unhealthy:[/red] {r}", highlight=False)
