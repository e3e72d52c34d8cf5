"""Hardware qualification (``ansible-playbook qualify.yml``, ``dsv41 qualify ...``): the check
records, the preflight and the report.

Every check produces one record (:func:`record`)::

    {"id": "links.mtu[ofl0]", "group": "links", "check": "mtu", "subject": "ofl0", "host": "sparkhead",
     "status": "pass" | "fail" | "skipped", "value": ..., "expected": ..., "unit": "bytes",
     "reason": "one line (why it failed or was skipped)", "time": "2026-12-02T01:02:03Z"}

Host-side probes (``dsv41 qualify peers|transport|sweep|serving-host|vllm-tiny``,
``dsv41.entrypoints.qualify_host``, ``qualify_serving``) run on the host being qualified, through the inventory's own
connection, and print a JSON list of records; controller-side probes (``dsv41 qualify
serving|reconnect|fail-closed|drafter-identity``, ``dsv41.entrypoints.qualify_controller``) read
rank 0's API and the servers' metrics; ``playbooks/qualify.yml`` gathers every record and the
``qualify_report`` module calls :func:`assemble` and :func:`write_report`, which writes
``<out>/report.json`` and ``<out>/summary.md``. This module holds what every probe shares: the
record (:func:`record`), the refusal before any step (:func:`preflight`) and the report. A check that
needs what a host lacks (an RDMA device, vLLM, a GPU, a container) is ``skipped`` with the reason,
never passed; a host that could not be reached fails every check it owed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsv41 import fileio
from dsv41.errors import Dsv41Error

GROUPS = ("links", "transport", "exactness", "serving", "drafter")
PLACEHOLDER = "CHANGE_ME"


class QualifyError(Dsv41Error):
    """Bad input to a qualification (inventory placeholder, report directory, arguments)."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record(
    group: str,
    check: str,
    host: str,
    ok: bool | None,
    value: Any = None,
    expected: Any = None,
    *,
    unit: str = "",
    reason: str = "",
    subject: str = "",
) -> dict:
    """One check record (module docstring). ``ok``: True = pass, False = fail, None = skipped
    (``reason`` required: a skipped check always says why)."""
    if group not in GROUPS:
        raise ValueError(f"unknown group {group!r}")
    if ok is None and not reason:
        raise ValueError(f"skipped check {group}.{check} needs a reason")
    cid = f"{group}.{check}" + (f"[{subject}]" if subject else "")
    return {
        "id": cid,
        "group": group,
        "check": check,
        "subject": subject,
        "host": host,
        "status": "pass" if ok is True else "fail" if ok is False else "skipped",
        "value": value,
        "expected": expected,
        "unit": unit,
        "reason": reason,
        "time": _now(),
    }


def skipped(group: str, checks: Iterable[str], host: str, reason: str, subject: str = "") -> list[dict]:
    """The same skip reason for several checks."""
    return [record(group, c, host, None, reason=reason, subject=subject) for c in checks]


# --- bad input: before any step runs -------------------------------------------------------------


def find_placeholders(doc: Any, placeholder: str = PLACEHOLDER, path: str = "") -> list[str]:
    """Dotted paths (``sparkhead.dsv41_links[0].name``) of every string in ``doc`` (nested dicts
    and lists) that contains ``placeholder``."""
    out: list[str] = []
    if isinstance(doc, str):
        if placeholder in doc:
            out.append(path or "(value)")
    elif isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(find_placeholders(v, placeholder, f"{path}.{k}" if path else str(k)))
    elif isinstance(doc, (list, tuple)):
        for i, v in enumerate(doc):
            out.extend(find_placeholders(v, placeholder, f"{path}[{i}]"))
    return out


def prepare_report_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` (parents too) and prove it writable by writing and removing a file.
    QualifyError (one line) when it exists already with a report in it, or cannot be created or
    written."""
    p = Path(out_dir)
    if (p / "report.json").exists():
        raise QualifyError(f"report directory {p} already holds a report; pick another id")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-test"
        fileio.atomic_write(probe, "ok\n", "the report directory's write test", error=QualifyError)
        probe.unlink()
    except OSError as exc:
        raise QualifyError(f"report directory {p} cannot be written: {exc.strerror or exc}") from None
    return p


def preflight(hosts: dict, out_dir: str | os.PathLike, placeholder: str = PLACEHOLDER) -> Path:
    """Refuse a qualification before any host is touched: ``hosts`` ``{host: {var: value}}`` (the
    inventory variables a qualification reads) must hold no ``placeholder`` and at least one
    Spark and one offload host; the report directory must be writable. Returns the directory.
    QualifyError, one line, otherwise."""
    if not hosts:
        raise QualifyError("inventory has no spark and offload hosts")
    found = find_placeholders(hosts, placeholder)
    if found:
        raise QualifyError(f"inventory still has {placeholder} in {len(found)} place(s): {', '.join(found)}")
    return prepare_report_dir(out_dir)


# --- records of a playbook step -------------------------------------------------------------------


def from_links(host: str, result: dict) -> list[dict]:
    """Records of one host from an ``rdma_link`` module result (its ``checks``). A result without
    checks (the module did not run: unreachable, crashed) is one failed record with its message."""
    checks = result.get("checks")
    if not checks:
        msg = result.get("msg") or "rdma_link did not run"
        return [record("links", "rdma_link", host, False, reason=f"{host}: {msg}".replace("\n", " "))]
    out = []
    units = {"mtu": "bytes", "rdma_active_mtu": "bytes"}
    for c in checks:
        src = c.get("rdma_source")
        reason = c.get("reason") or ""
        if c["check"].startswith(("rdma", "roce")) and src and src not in reason:
            reason = f"{reason} (read through {src})" if reason else f"read through {src}"
        r = record(
            "links",
            c["check"],
            host,
            c["ok"],
            c.get("value"),
            c.get("expected"),
            unit=units.get(c["check"], ""),
            reason=reason,
            subject=c["link"],
        )
        out.append(r)
    return out


def bandwidth_both(checks: list[dict], gbps_min: float) -> list[dict]:
    """``transport.bandwidth_both``: the sum of the per-link 64 MiB rates measured at the same
    time (every Spark's ``transport.bandwidth`` starts at the same epoch second); the value also
    gives the overlap of their measurement windows (fraction of the shorter one). Fails below
    ``gbps_min`` or with windows overlapping less than half. [] without two measured links."""
    bw = [
        c
        for c in checks
        if c["group"] == "transport" and c["check"] == "bandwidth" and isinstance(c.get("value"), dict)
    ]
    if len(bw) < 2:
        return []
    total = sum(c["value"]["gbps"] for c in bw)
    start = max(c["value"]["start"] for c in bw)
    end = min(c["value"]["end"] for c in bw)
    shortest = min(c["value"]["end"] - c["value"]["start"] for c in bw) or 1e-9
    overlap = max(0.0, end - start) / shortest
    ok = total >= gbps_min and overlap >= 0.5
    links = " + ".join(f"{c['host']}:{c['subject']}" for c in bw)
    late = [
        f"{c['host']} began {c['value']['late_s']} s after the common start"
        for c in bw
        if (c["value"].get("late_s") or 0) >= 0.5
    ]
    return [
        record(
            "transport",
            "bandwidth_both",
            "localhost",
            ok,
            {"gbps": round(total, 2), "links": links, "overlap": round(min(overlap, 1.0), 2)},
            f">= {gbps_min}",
            unit="Gb/s",
            subject="both links",
            reason=""
            if ok
            else f"both links at once: {total:.2f} Gb/s (floor {gbps_min}), windows overlapping {overlap:.0%}"
            + (f" ({'; '.join(late)}: its earlier checks ran past it)" if late else ""),
        )
    ]


# --- the report ------------------------------------------------------------------------------------


def records_from_step(host: str, step: dict) -> list[dict]:
    """Records of one playbook step of ``host``.

    ``step``: ``{"group", "checks": [names], "subject", "kind": "command" | "rdma_link",
    "skip_reason": str, "result": <the registered task result>}``. A step Ansible skipped (its
    ``when`` false: check mode, no such component, the lab) gives ``skipped`` records with
    ``skip_reason``; a command that printed records gives those; one that failed (exit != 0, one
    ``dsv41: error:`` line) fails every check it owed with that line."""
    res = step.get("result") or {}
    group, subject = step["group"], step.get("subject", "")
    names = step.get("checks") or [step.get("name", "step")]
    if res.get("skipped") or not res:
        reason = step.get("skip_reason") or "not run in this play (--tags / --skip-tags left it out)"
        return skipped(group, names, host, reason, subject=subject)
    if step.get("kind") == "rdma_link":
        return from_links(host, res)
    if res.get("unreachable"):
        return [
            record(group, n, host, False, reason=f"{host}: unreachable: {res.get('msg', '')}"[:300], subject=subject)
            for n in names
        ]
    if res.get("rc") == 0:
        try:
            recs = fileio.loads_json((res.get("stdout") or "").strip().splitlines()[-1])
            if isinstance(recs, list) and all(isinstance(r, dict) and "status" in r for r in recs):
                return recs
        except (ValueError, IndexError):
            pass
        why = "printed no records"
    else:
        lines = [ln for ln in (res.get("stderr") or res.get("msg") or "").splitlines() if ln.strip()]
        why = (lines[-1] if lines else f"exit {res.get('rc')}").strip()
    return [
        record(group, n, host, False, reason=f"{step.get('name', group)}: {why}"[:400], subject=subject) for n in names
    ]


def assemble(hosts: dict[str, Any], *, controller: list[dict] | None = None, meta: dict) -> dict:
    """The report from the playbook's raw results.

    ``hosts``: ``{host: {"version": <registered "dsv41 version --json"> | None, "done": bool,
    "steps": [step, ...]}}`` (:func:`records_from_step`). A host whose version probe is missing
    or unreachable fails one ``links.reachable`` check naming why; a host that did not reach the
    end of its steps fails ``links.finished``. ``controller``: steps run on the controller.
    ``meta``: id, inventory, started, expectations, check_mode. Returns
    ``{"result": "PASS"|"FAIL", "counts", "failed": ["<id>@<host>"...], "reasons", "checks", "versions", ...meta}``.
    """
    checks: list[dict] = []
    versions: dict[str, Any] = {}
    for h, raw in hosts.items():
        raw = raw or {}
        v = raw.get("version") or {}
        if not v or v.get("unreachable") or v.get("skipped"):
            msg = str(v.get("msg") or "not reached").replace("\n", " ")[:300]
            checks.append(record("links", "reachable", h, False, None, "reachable", reason=f"{h}: unreachable: {msg}"))
            continue
        try:
            versions[h] = fileio.loads_json(v.get("stdout") or "{}")
        except ValueError:
            versions[h] = {"error": (v.get("stderr") or "")[-200:]}
        for step in raw.get("steps") or []:
            checks.extend(records_from_step(h, step))
        if not raw.get("done"):
            checks.append(
                record(
                    "links",
                    "finished",
                    h,
                    False,
                    None,
                    "every step ran",
                    reason=f"{h}: stopped before its last step (a task failed or the host went away)",
                )
            )
    exp = meta.get("expectations") or {}
    if exp.get("bandwidth_both_gbps_min") not in (None, ""):
        checks.extend(bandwidth_both(checks, float(exp["bandwidth_both_gbps_min"])))
    for step in controller or []:
        checks.extend(records_from_step("localhost", step))
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in ("pass", "fail", "skipped")}
    failed = [f"{c['id']}@{c['host']}" for c in checks if c["status"] == "fail"]
    return {
        **meta,
        "versions": versions,
        "result": "FAIL" if failed or not checks else "PASS",
        "counts": counts,
        "failed": failed,
        "reasons": [c["reason"] for c in checks if c["status"] == "fail"],
        "checks": checks,
        "finished": _now(),
    }


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        try:
            return fileio.dumps_json(v, separators=(", ", ": "))
        except fileio.EncodeError:  # a table cell for a reader: Python's inf/nan say what was measured
            return str(v)
    return str(v)


def render_summary(report: dict) -> str:
    """``summary.md``: verdict, failed checks with reasons, then one table per group."""
    c = report["counts"]
    lines = [
        f"# Qualification {report.get('id', '')}: {report['result']}",
        "",
        f"- inventory: `{report.get('inventory', '')}`; started {report.get('started', '')}, finished {report.get('finished', '')}",
        f"- checks: {c['pass']} pass, {c['fail']} fail, {c['skipped']} skipped"
        + (" (check mode: checks that change state were skipped)" if report.get("check_mode") else ""),
        f"- versions: {_fmt(report.get('versions', {}))}",
        "",
    ]
    if report["failed"]:
        lines += (
            ["## Failed", ""]
            + [f"- `{c['id']}` on {c['host']}: {c['reason']}" for c in report["checks"] if c["status"] == "fail"]
            + [""]
        )
    for g in GROUPS:
        rows = [x for x in report["checks"] if x["group"] == g]
        if not rows:
            continue
        lines += [
            f"## {g}",
            "",
            "| check | host | status | value | expected | unit | reason / note | time |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for x in rows:
            cells = [
                x["id"],
                x["host"],
                x["status"].upper() if x["status"] == "fail" else x["status"],
                _fmt(x["value"]),
                _fmt(x["expected"]),
                x["unit"],
                x["reason"],
                x["time"],
            ]
            lines.append("| " + " | ".join(s.replace("|", "\\|") for s in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict, out_dir: str | os.PathLike) -> dict:
    """Write ``report.json`` and ``summary.md`` into ``out_dir`` (already prepared by
    :func:`preflight`); returns ``{"report", "summary"}`` paths. QualifyError when it cannot."""
    p = Path(out_dir)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fileio.atomic_write_json(
            p / "report.json", report, "the qualification report", error=QualifyError, nonfinite="null"
        )
        fileio.atomic_write(
            p / "summary.md", render_summary(report) + "\n", "the qualification summary", error=QualifyError
        )
    except OSError as exc:
        raise QualifyError(f"report directory {p} cannot be written: {exc.strerror or exc}") from None
    return {"report": str(p / "report.json"), "summary": str(p / "summary.md")}


def failure_line(report: dict) -> str:
    """One line naming each failed check: ``qualification FAIL: links.mtu[ofl0]@sparkhead, ...``."""
    return f"qualification {report['result']}: " + (
        ", ".join(report["failed"])
        if report["failed"]
        else f"{report['counts']['pass']} checks passed, {report['counts']['skipped']} skipped"
    )
