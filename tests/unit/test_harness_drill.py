"""The fault drill's computations and fault actions on constructed data (no lab): fault-list and
argument validation, recovery time, rates, counter deltas, the report, summary and timeline, and
each fault's inject / clear against a fake ``nsenter`` runner. The lab run is
tests/integration/test_drill_lab.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from dsv41.cli import main
from dsv41.harness import drill_faults, drill_measure, drill_report
from dsv41.harness.drill_faults import DrillError
from dsv41.harness.drill_measure import Sample
from dsv41.service_control import for_manager

# ---- validation -----------------------------------------------------------------------------------


def test_parse_faults_order_all_and_errors() -> None:
    assert drill_faults.parse_faults("all") == list(drill_faults.FAULTS)
    assert drill_faults.parse_faults("netem, engram_server") == ["netem", "engram_server"]
    assert drill_faults.parse_faults(["async_proxy"]) == ["async_proxy"]
    with pytest.raises(DrillError, match=r"unknown fault 'tablez' \(known: engram_server, drafter_worker"):
        drill_faults.parse_faults("engram_server,tablez")
    with pytest.raises(DrillError, match="no fault named"):
        drill_faults.parse_faults(" , ")
    with pytest.raises(DrillError, match="'netem' named twice"):
        drill_faults.parse_faults("netem,netem")


def test_lab_only_urls_links_and_netem() -> None:
    assert drill_faults.check_lab_url("http://198.18.0.11:8000", "x") == "http://198.18.0.11:8000"
    assert drill_faults.check_lab_url("http://198.19.255.1/metrics", "x")
    for bad in ("http://10.0.0.1:8000", "http://localhost:8000", "http://198.20.0.1", "nonsense"):
        with pytest.raises(DrillError, match="not a lab address"):
            drill_faults.check_lab_url(bad, "--endpoint")
    assert drill_faults.parse_link("sparkworker:ofl0") == ("sparkworker", "ofl0")
    for bad in ("sparkhead", "sparkhead:", "spark head:ofl0", "sparkhead:ofl0;reboot", "h:" + "x" * 16):
        with pytest.raises(DrillError, match="HOST:IFACE"):
            drill_faults.parse_link(bad)
    assert drill_faults.parse_netem("delay 60ms 20ms loss 5%") == ["delay", "60ms", "20ms", "loss", "5%"]
    for bad in ("", "delay 10ms; rm -rf /", "rate 1mbit"):
        with pytest.raises(DrillError):
            drill_faults.parse_netem(bad)
    with pytest.raises(DrillError, match="bad interface"):
        drill_faults.Topology(link_iface="a/b").validate()


def test_proxy_pid_is_the_engines_proxy_child() -> None:
    kids = [
        (40, ["/opt/dsv41/venv/bin/python", "-c", "x"]),
        (41, ["/opt/dsv41/venv/bin/dsv41", "proxy", "run", "--shm", "r", "--parent-pid", "99"]),
        (42, ["/opt/dsv41/venv/bin/dsv41", "proxy", "run", "--shm", "r", "--parent-pid", "7"]),
        (43, ["/opt/dsv41/venv/bin/python", "-m", "dsv41.drafter.proxy_cli", "run", "--parent-pid", "9"]),
    ]
    assert drill_faults.proxy_pid(kids, 7) == 42
    assert drill_faults.proxy_pid(kids, 9) == 43
    assert drill_faults.proxy_pid(kids, 8) is None
    assert drill_faults.proxy_pid([(5, ["proxy", "self-test", "--parent-pid", "7"])], 7) is None


# ---- computations ---------------------------------------------------------------------------------


def _samples(
    fallback_until: float,
    t_end: float = 30.0,
    dt: float = 1.0,
    fail_closed_until: float = -1.0,
    gap: tuple[float, float] | None = None,
) -> list[Sample]:
    """Counters of a 2-rank lab sampled every ``dt`` s: 100 lookups/s per rank, 10 tokens/s,
    5 drafting rounds/s; fallbacks grow by 7/s on rank 0 until ``fallback_until``, fail-closed
    rounds by 2/s until ``fail_closed_until``; samples in ``gap`` are unreadable."""
    out, fb, fc, t = [], 0.0, 0.0, 0.0
    while t <= t_end + 1e-9:
        if t > 0 and t <= fallback_until + 1e-9:
            fb += 7 * dt
        if t > 0 and t <= fail_closed_until + 1e-9:
            fc += 2 * dt
        if gap and gap[0] <= t <= gap[1]:
            out.append(Sample(t, error="cannot read metrics"))
        else:
            out.append(
                Sample(
                    t,
                    engram={
                        "0": {"lookups": 100 * t, "fallbacks": fb, "remote_rows": 50 * t},
                        "1": {"lookups": 100 * t, "fallbacks": 0.0, "remote_rows": 50 * t},
                    },
                    drafter={"rounds": 5 * t, "fail_closed_rounds": fc, "proxy_respawns": 1.0 if t > 12 else 0.0},
                    gen_tokens=10 * t,
                    server_requests=20 * t,
                    worker_rounds=5 * t,
                )
            )
        t = round(t + dt, 6)
    return out


def test_recovery_time_from_the_first_stable_healthy_run() -> None:
    s = _samples(fallback_until=13.0)
    # Fallbacks grow through the interval ending at t=13; healthy from 13 on, cleared at 10.
    assert drill_measure.recovery_time(s, 10.0, ["0", "1"], stable_s=3.0) == pytest.approx(3.0)
    assert drill_measure.recovery_time(_samples(fallback_until=5.0), 10.0, ["0", "1"]) == 0.0
    assert drill_measure.recovery_time(_samples(fallback_until=40.0), 10.0, ["0", "1"]) is None
    # Fail-closed rounds count as not recovered when the drafter is required.
    s = _samples(fallback_until=0.0, fail_closed_until=16.0)
    assert drill_measure.recovery_time(s, 10.0, ["0", "1"], drafter=True) == pytest.approx(6.0)
    assert drill_measure.recovery_time(s, 10.0, ["0", "1"], drafter=False) == 0.0
    # An unreadable sample breaks a healthy run; a run shorter than stable_s does not count.
    s = _samples(fallback_until=11.0, gap=(13.0, 13.0))
    assert drill_measure.recovery_time(s, 10.0, ["0", "1"], stable_s=3.0) == pytest.approx(4.0)
    # A rank missing from the counters is never healthy.
    s = _samples(fallback_until=0.0)
    for x in s:
        x.engram.pop("1")
    assert drill_measure.recovery_time(s, 0.0, ["0", "1"]) is None


def test_healthy_interval_needs_lookups_and_rounds() -> None:
    a = Sample(0.0, engram={"0": {"lookups": 5, "fallbacks": 0}}, drafter={"rounds": 3, "fail_closed_rounds": 0})
    idle = Sample(1.0, engram={"0": {"lookups": 5, "fallbacks": 0}}, drafter={"rounds": 4, "fail_closed_rounds": 0})
    busy = Sample(1.0, engram={"0": {"lookups": 9, "fallbacks": 0}}, drafter={"rounds": 3, "fail_closed_rounds": 0})
    assert not drill_measure.healthy_interval(a, idle, ["0"], drafter=False)
    assert drill_measure.healthy_interval(a, busy, ["0"], drafter=False)
    assert not drill_measure.healthy_interval(a, busy, ["0"], drafter=True)


def test_throughput_recovery_time() -> None:
    s = _samples(fallback_until=0.0, t_end=30.0)
    for x in s:  # 10 tok/s, except 1 tok/s from t=5 to t=16
        x.gen_tokens = 10 * min(x.t, 5) + 1 * max(0.0, min(x.t, 16) - 5) + 10 * max(0.0, x.t - 16)
    # Cleared at 10: the first interval from which 3 s average >= 5 tok/s starts at 14 (midpoint 14.5).
    assert drill_measure.throughput_recovery_time(s, 5.0, 10.0) == pytest.approx(4.5)
    assert drill_measure.throughput_recovery_time(s, 5.0, 10.0, frac=0.05) == pytest.approx(0.5)
    assert drill_measure.throughput_recovery_time(s, 0.0, 10.0) is None  # no baseline
    assert drill_measure.throughput_recovery_time(s[:14], 5.0, 10.0) is None  # never back within the samples


def test_timeline_rates_and_counter_deltas() -> None:
    s = _samples(fallback_until=12.0, t_end=20.0, dt=2.0, gap=(6.0, 6.0))
    rates = drill_measure.timeline(s)
    assert rates[0] == {"t": 1.0, "tok_s": 10.0, "fallbacks_s": 7.0, "lookups_s": 200.0, "fail_closed_s": 0.0}
    # The unreadable sample at 6 is skipped: one 4 s interval 4 -> 8.
    assert [r["t"] for r in rates][:3] == [1.0, 3.0, 6.0]
    assert rates[-1]["fallbacks_s"] == 0.0
    d = drill_measure.counter_deltas(s)
    assert d["engram"]["0"]["fallbacks"] == 84.0 and d["engram"]["1"]["fallbacks"] == 0.0
    assert d["drafter"]["proxy_respawns"] == 1.0 and d["gen_tokens"] == 200.0 and d["seconds"] == 20.0
    assert drill_measure.counter_deltas(s, 3.0, 5.0)["engram"] == {}  # fewer than two samples inside


def _result(failed: int = 0, fallback_until: float = 13.0, refs_ok: bool = True) -> dict:
    s = _samples(fallback_until=fallback_until)
    reqs = [
        {
            "prompt_id": f"p{i}",
            "ok": i >= failed,
            "error": None if i >= failed else "HTTP 500: boom",
            "t_start": 2.0 * i,
            "t_end": 2.0 * i + 3,
        }
        for i in range(12)
    ]
    refs = {"ok": refs_ok, "summary": "6/6 identical" if refs_ok else "5/6 identical"}
    return drill_report.fault_result(
        "engram_server",
        s,
        reqs,
        5.0,
        10.0,
        ["0", "1"],
        3.0,
        {"host": "x86host", "action": "systemctl stop dsv41-engram-server.service"},
        {"host": "x86host", "action": "systemctl start dsv41-engram-server.service"},
        refs,
    )


def test_fault_result_counts_and_verdict() -> None:
    r = _result()
    assert (r["requests"], r["failed"], r["fallbacks"], r["fallbacks_total"]) == (12, 0, {"0": 91, "1": 0}, 91)
    assert r["recovery_s"] == pytest.approx(3.0) and r["recovered"] and r["ok"]
    assert r["proxy_respawns"] == 1 and r["fail_closed_rounds"] == 0
    assert r["requests_across_fault"] == 3  # [4, 7], [6, 9], [8, 11] overlap the fault [5, 10]
    assert r["tok_s_before"] == pytest.approx(10.0)
    bad = _result(failed=2)
    assert bad["failed"] == 2 and not bad["ok"] and bad["failures"][0]["error"] == "HTTP 500: boom"
    assert not _result(fallback_until=40.0)["ok"]
    assert not _result(refs_ok=False)["ok"]


def test_report_summary_and_timeline(tmp_path) -> None:
    rep = drill_report.build_report(
        "t1",
        [_result(), _result(failed=1)],
        {
            "streams": 4,
            "spec": "s",
            "max_tokens": 48,
            "baseline_s": 8,
            "duration_s": 20,
            "recover_timeout_s": 60,
            "stable_s": 3,
        },
        "2026-12-01T03:00:00+00:00",
        "2026-12-01T03:05:00+00:00",
        "box (2 CPUs)",
    )
    assert rep["format"] == drill_report.FORMAT and rep["ok"] is False
    assert drill_report.build_report("t2", [_result()], {}, "a", "b", "m")["ok"] is True
    assert drill_report.build_report("t3", [], {}, "a", "b", "m")["ok"] is False
    md = drill_report.summary_markdown(rep)
    assert "| engram_server | 12 | 0 | r0 91, r1 0 | 0 | 1 | 3.0 | 10.0 / 10.0 | 0.5 | 6/6 identical | yes |" in md
    assert "Verdict: FAIL" in md and "failed request p0: HTTP 500: boom" in md
    paths = drill_report.write_report(rep, tmp_path / "t1")
    assert json.loads(open(paths["report"]).read())["id"] == "t1"
    png = open(paths["timeline"], "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# ---- faults against a fake runner -----------------------------------------------------------------


class FakeLab:
    """Records every ``nsenter`` argv and answers from ``replies`` (argv suffix -> (rc, stdout))."""

    def __init__(self, tmp_path, replies: dict[tuple[str, ...], tuple[int, str]]) -> None:
        import os

        for h in ("x86host", "sparkhead", "sparkworker"):
            (tmp_path / f"{h}.pid").write_text(f"{os.getpid()}\n")
        self.replies, self.calls, self.replies_err = replies, [], ""
        self.hosts = drill_faults.LabHosts(tmp_path, for_manager("systemd"), self)

    def __call__(self, cmd, **kw):
        argv = tuple(cmd[cmd.index("--") + 1 :])
        self.calls.append(argv)
        for key, (rc, out) in self.replies.items():
            if argv[: len(key)] == key or argv[-len(key) :] == key:
                return subprocess.CompletedProcess(cmd, rc, out, self.replies_err if rc else "")
        return subprocess.CompletedProcess(cmd, 0, "", "")


CTL = ("systemctl",)
# The engine as a plain process (its fake answers unknown commands with exit 0, which the auto
# detection would read as "the container exists").
PLAIN = drill_faults.Topology(serve_container=False)
ENGRAM, DRAFTER, SERVE = "dsv41-engram-server.service", "dsv41-drafter.service", "dsv41-serve.service"
MAIN_PID = (*CTL, "show", "-p", "MainPID", "--value", SERVE)


def test_program_stop_and_idempotent_clear(tmp_path) -> None:
    lab = FakeLab(tmp_path, {(*CTL, "is-active", ENGRAM): (3, "inactive\n")})
    f = drill_faults.EngramServerStop(lab.hosts, drill_faults.Topology())
    assert f.inject()["action"] == f"systemctl stop {ENGRAM}"
    assert f.clear()["action"] == f"systemctl start {ENGRAM}"
    assert lab.calls == [(*CTL, "stop", ENGRAM), (*CTL, "is-active", ENGRAM), (*CTL, "start", ENGRAM)]
    # a failed unit: its start limit cleared first
    lab = FakeLab(tmp_path, {(*CTL, "is-active", ENGRAM): (3, "failed\n")})
    assert drill_faults.EngramServerStop(lab.hosts, drill_faults.Topology()).clear()["was"] == "failed"
    assert lab.calls == [(*CTL, "is-active", ENGRAM), (*CTL, "reset-failed", ENGRAM), (*CTL, "start", ENGRAM)]
    lab = FakeLab(tmp_path, {(*CTL, "is-active", DRAFTER): (0, "active\n")})
    assert drill_faults.DrafterWorkerStop(lab.hosts, drill_faults.Topology()).clear()["action"] == "none"
    assert all("start" not in c for c in lab.calls)


def test_link_and_netem_clear_only_what_is_set(tmp_path) -> None:
    down = "7: ofl0@if6: <BROADCAST,MULTICAST> mtu 9000 qdisc netem state DOWN\n"
    up = "7: ofl0@if6: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 9000 state UP\n"
    lab = FakeLab(
        tmp_path,
        {
            ("ip", "-o", "link", "show", "dev", "ofl0"): (0, down),
            ("tc", "qdisc", "show", "dev", "ofl0", "root"): (0, "qdisc netem 8001: root limit 1000\n"),
        },
    )
    topo = drill_faults.Topology(link_host="sparkworker")
    assert drill_faults.LinkDown(lab.hosts, topo).clear()["action"] == "ip link set dev ofl0 up"
    assert drill_faults.Netem(lab.hosts, topo).clear()["action"] == "tc qdisc del dev ofl0 root (netem)"
    assert (
        drill_faults.Netem(lab.hosts, topo).inject()["action"]
        == "tc qdisc replace dev ofl0 root netem delay 60ms 20ms loss 5%"
    )
    # A kernel without sch_netem: tbf instead, said in the record, and cleared the same way.
    lab = FakeLab(
        tmp_path,
        {
            ("netem", "delay", "60ms", "20ms", "loss", "5%"): (2, ""),
            ("tc", "qdisc", "show", "dev", "ofl0", "root"): (0, "qdisc tbf 8002: root refcnt 2\n"),
        },
    )
    lab.replies_err = "Error: Specified qdisc kind is unknown."
    rec = drill_faults.Netem(lab.hosts, topo).inject()
    assert rec["qdisc"] == "tbf" and rec["action"].startswith("tc qdisc replace dev ofl0 root tbf rate 4mbit")
    assert drill_faults.Netem(lab.hosts, topo).clear()["action"] == "tc qdisc del dev ofl0 root (tbf)"
    lab.replies_err = "Error: Cannot find device"
    with pytest.raises(DrillError, match="Cannot find device"):
        drill_faults.Netem(lab.hosts, topo).inject()
    lab = FakeLab(
        tmp_path,
        {
            ("ip", "-o", "link", "show", "dev", "ofl0"): (0, up),
            ("tc", "qdisc", "show", "dev", "ofl0", "root"): (0, "qdisc noqueue 0: root\n"),
        },
    )
    out = drill_faults.clear_all(lab.hosts, topo, ["offload_link", "netem"])
    assert out == {
        "offload_link": {"host": "sparkworker", "action": "none", "iface": "ofl0"},
        "netem": {"host": "sparkworker", "action": "none", "iface": "ofl0"},
    }


def test_async_proxy_kill_by_pid_and_errors(tmp_path) -> None:
    # the plain-process path, said (auto would ask docker; test_drill_engine_pid.py covers that)
    kids = json.dumps(
        [
            [12, 12, ["dsv41", "engine", "serve"]],
            [
                [29, 29, ["python3", "-c", "x\ny"]],
                [30, 30, ["/opt/dsv41/venv/bin/dsv41", "proxy", "run", "--parent-pid", "12"]],
            ],
        ]
    )
    lab = FakeLab(tmp_path, {MAIN_PID: (0, "12\n"), ("12",): (0, kids)})
    f = drill_faults.AsyncProxyKill(lab.hosts, PLAIN)
    rec = f.inject()
    assert rec["proxy_pid"] == 30 and rec["engine_pid"] == 12 and ("kill", "-KILL", "30") in lab.calls
    assert f.clear()["respawned"] is False  # the fake still lists pid 30
    lab = FakeLab(tmp_path, {MAIN_PID: (0, "12\n"), ("12",): (0, "[[12, 12, []], []]")})
    with pytest.raises(DrillError, match="no async proxy process"):
        drill_faults.AsyncProxyKill(lab.hosts, PLAIN).inject()
    lab = FakeLab(tmp_path, {MAIN_PID: (0, "0\n")})
    with pytest.raises(DrillError, match="dsv41-serve on sparkhead is not running"):
        drill_faults.AsyncProxyKill(lab.hosts, PLAIN).inject()
    # A failing command is one line with its stderr's last line; clear_all keeps going.
    lab = FakeLab(
        tmp_path,
        {
            (*CTL, "is-active", ENGRAM): (3, "inactive\n"),
            (*CTL, "start", ENGRAM): (7, ""),
            (*CTL, "is-active", DRAFTER): (0, "active\n"),
        },
    )
    out = drill_faults.clear_all(lab.hosts, drill_faults.Topology(), ["engram_server", "drafter_worker"])
    assert "failed (exit 7)" in out["engram_server"]["error"] and out["drafter_worker"]["action"] == "none"


def test_lab_not_up(tmp_path) -> None:
    hosts = drill_faults.LabHosts(tmp_path, for_manager("systemd"))
    with pytest.raises(DrillError, match="the lab is not up"):
        hosts.run("x86host", ["true"])


# ---- the command's bad input: one line, exit 1, nothing touched -------------------------------------


@pytest.mark.parametrize(
    "args, msg",
    [
        (["check", "--faults", "engram_server,tablez"], "unknown fault 'tablez'"),
        (["run", "--faults", "tablez"], "unknown fault 'tablez'"),
        (["run", "--endpoint", "http://10.1.2.3:8000"], "not a lab address"),
        (["run", "--link", "sparkhead"], "HOST:IFACE"),
        (["run", "--netem", "rate 1mbit"], "--netem word 'rate'"),
        (["run", "--streams", "0"], "--streams must be between 1 and 64"),
        (["run", "--duration", "-1"], "--duration must be between 0 and 3600"),
        (["run", "--refs", "/nonexistent/refs.json"], "no greedy references at /nonexistent/refs.json"),
        (["clear", "--faults", "nope"], "unknown fault 'nope'"),
    ],
)
def test_cli_bad_input_one_line(args, msg, capsys, tmp_path) -> None:
    assert main(["drill", *args, "--lab-dir", str(tmp_path)] if args[0] != "check" else ["drill", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv41: error: ") and msg in err[0], err


def test_cli_check_and_lab_not_up(capsys, tmp_path) -> None:
    assert main(["drill", "check", "--faults", "netem,async_proxy"]) == 0
    assert capsys.readouterr().out.strip() == "netem,async_proxy"
    refs = tmp_path / "refs.json"
    refs.write_text("{}")
    assert (
        main(
            [
                "drill",
                "run",
                "--refs",
                str(refs),
                "--lab-dir",
                str(tmp_path / "nolab"),
                "--out-dir",
                str(tmp_path / "d"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the lab is not up" in err[0]
    assert not (tmp_path / "d").exists()
