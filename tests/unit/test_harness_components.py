"""dsv41.harness.components: names, env files, the checks of each component's rollback, and a
whole run against fake rank 0 / drafter worker / table server endpoints on 127.0.0.1."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsv41.harness import components as C, refs
from serverutil import FakeServing

PROD_DRAFTER = (
    "# managed\nDSV41_DRAFTER_REMOTE=tcp://198.18.1.1:7451\nDSV41_DRAFTER_DIR=/opt/dsv41/drafter\n"
    "DSV41_DRAFTER_ASYNC=1\nDSV41_DRAFTER_K=5\n"
)
PROD_ENGRAM = (
    "# managed\nDSV41_ENGRAM_REMOTE=tcp://198.18.1.1:7441@198.18.1.2,tcp://198.18.2.1:7441@198.18.2.2\n"
    "DSV41_ENGRAM_REMOTE_TIMEOUT_MS=100\nDSV41_ENGRAM_REMOTE_REQUIRED=0\nDSV41_RUNTIME_ROOT=/opt/dsv41/runtime\n"
)
ENGRAM_OFF = "# managed\n# Remote Engram off (no DSV41_ENGRAM_REMOTE*, no overlay env): the local reader serves.\n"


def test_unknown_component_is_one_line_naming_the_known_ones():
    for bad, shown in (
        ("bogus", "'bogus'"),
        ("", "(none given: -e component=NAME)"),
        ("Async_Handoff", "'Async_Handoff'"),
    ):
        with pytest.raises(C.ComponentError) as ei:
            C.component(bad)
        msg = str(ei.value)
        assert "\n" not in msg
        assert msg == f"unknown component {shown}: choose one of async_handoff, remote_drafter, remote_engram"
    assert [C.component(n) for n in sorted(C.COMPONENTS)] == ["async_handoff", "remote_drafter", "remote_engram"]


def test_env_problems_names_a_malformed_env_file():
    got = C.env_problems("remote_engram", {"sparkhead": "# x=1\n\nnoequals\n"})
    assert got == ["sparkhead: the engine would refuse its env files: env file sparkhead:3: not KEY=VALUE: 'noequals'"]


def test_env_problems_async_handoff():
    both = {"sparkhead": PROD_DRAFTER + PROD_ENGRAM, "sparkworker": PROD_ENGRAM}
    assert C.env_problems("async_handoff", both) == [
        "sparkhead: DSV41_DRAFTER_ASYNC=1 (async handoff still configured)"
    ]
    sync = {"sparkhead": PROD_DRAFTER.replace("ASYNC=1", "ASYNC=0"), "sparkworker": ""}
    assert C.env_problems("async_handoff", sync) == []


def test_env_problems_remote_drafter():
    cap = PROD_DRAFTER + "DSV41_DRAFTER_CAPACITY_MODE=1\nDSV41_DRAFTER_LOCAL_MEMORY_TOKENS=4096\n"
    got = C.env_problems("remote_drafter", {"sparkhead": cap, "sparkworker": ""}, drafting_hosts=["sparkhead"])
    assert got == [
        "sparkhead: DSV41_DRAFTER_REMOTE=tcp://198.18.1.1:7451 (remote drafter still configured)",
        "sparkhead: capacity mode 1 with 4096 extra KV tokens (remote drafter still configured)",
        "sparkhead: no DSV41_DRAFTER_LOCAL (this rank drafts; it must draft locally)",
    ]
    local = {"sparkhead": "DSV41_DRAFTER_LOCAL=/opt/dsv41/drafter\nDSV41_DRAFTER_K=5\n", "sparkworker": ""}
    assert C.env_problems("remote_drafter", local, drafting_hosts=["sparkhead"]) == []
    # target-only (nothing drafts) is also free of the remote drafter
    assert C.env_problems("remote_drafter", {"sparkhead": "", "sparkworker": ""}) == []


def test_env_problems_remote_engram_names_every_overlay_variable():
    got = C.env_problems("remote_engram", {"sparkworker": PROD_ENGRAM})
    assert [g.split("=")[0] for g in got] == [
        "sparkworker: DSV41_ENGRAM_REMOTE",
        "sparkworker: DSV41_ENGRAM_REMOTE_REQUIRED",
        "sparkworker: DSV41_ENGRAM_REMOTE_TIMEOUT_MS",
        "sparkworker: DSV41_RUNTIME_ROOT",
    ]
    assert C.env_problems("remote_engram", {"sparkhead": ENGRAM_OFF + PROD_DRAFTER, "sparkworker": ENGRAM_OFF}) == []


def test_env_problems_reads_values_the_way_the_engine_does():
    # a file the engine would refuse is a problem, named by the engine's own message
    bad = {"sparkhead": "DSV41_DRAFTER_REMOTE=tcp://h:1\nDSV41_DRAFTER_LOCAL=/opt/dsv41/drafter\n"}
    got = C.env_problems("remote_drafter", bad, drafting_hosts=["sparkhead"])
    assert len(got) == 1 and got[0].startswith("sparkhead: the engine would refuse its env files: DSV41_DRAFTER_REMOTE")
    # any spelling the engine takes as on counts as on
    assert C.env_problems("async_handoff", {"h": "DSV41_DRAFTER_ASYNC=true\n"}) == [
        "h: DSV41_DRAFTER_ASYNC=1 (async handoff still configured)"
    ]


def test_env_problems_refuses_unknown_component():
    with pytest.raises(C.ComponentError):
        C.env_problems("nope", {})


ENGINE_TEXT = """# HELP x
vllm:spec_decode_num_drafts_total{model_name="dsv41-lab"} 7.0
vllm:request_success_total{finished_reason="length",model_name="dsv41-lab"} 6.0
vllm:request_success_total{finished_reason="abort",model_name="dsv41-lab"} 1.0
dsv41_engine_kv_cache_tokens{model_name="dsv41-lab"} 65536.0
dsv41_engine_kv_extra_tokens{model_name="dsv41-lab"} 0.0
dsv41_engram_lookups_total{rank="0"} 40.0
dsv41_engram_fallbacks_total{rank="0"} 0.0
dsv41_engram_lookups_total{rank="1"} 41.0
dsv41_drafter_rounds_total 12.0
dsv41_drafter_proxy_rounds_total 3.0
"""


def test_parse_engine_reads_what_the_checks_judge():
    engine, engram = C.parse_engine(ENGINE_TEXT)
    assert engine["spec_drafts"] == 7 and engine["kv_tokens"] == 65536 and engine["kv_extra_tokens"] == 0
    assert engine["finished_length"] == 6 and engine["finished_abort"] == 1
    assert engine["rounds"] == 12 and engine["proxy_rounds"] == 3
    assert engram == {"0": {"lookups": 40.0, "fallbacks": 0.0}, "1": {"lookups": 41.0}}
    with pytest.raises(C.ComponentError, match="rank 0 metrics: not Prometheus text"):
        C.parse_engine("this is { not prometheus\n")


def snap(engine=None, engram=None, worker=None, server=None) -> C.Snapshot:
    return C.Snapshot(engine or {}, engram or {}, worker or {}, server or {})


def _eval(name, before, after, **kw):
    args = dict(
        refs_identical=6, refs_total=6, failed_requests=0, sent_requests=14, env_problems_found=[], kv_baseline=65536
    )
    args.update(kw)
    return {c.name: c for c in C.evaluate(name, before, after, **args)}


def test_async_handoff_passes_on_sync_rounds_and_fails_when_the_proxy_still_counts():
    before = snap({"rounds": 0}, worker={"rounds": 100})
    after = snap({"rounds": 30, "fail_closed_rounds": 1}, worker={"rounds": 130})
    got = _eval("async_handoff", before, after)
    assert all(c.ok for c in got.values()), got
    assert got["synchronous rounds continue"].detail == "engine rounds +30, worker rounds +30, failed closed +1"
    # the proxy still drafting: the async counters grow
    after_async = snap({"rounds": 30, "proxy_rounds": 30, "proxy_up": 1, "proxy_state": 2}, worker={"rounds": 130})
    bad = _eval(
        "async_handoff", snap({"rounds": 0, "proxy_rounds": 0, "proxy_state": 2}, worker={"rounds": 100}), after_async
    )
    assert not bad["async counters still"].ok and "proxy_rounds" in bad["async counters still"].detail
    # rounds that stopped (target-only) are not synchronous remote drafting either
    stopped = _eval("async_handoff", before, snap({"rounds": 0}, worker={"rounds": 100}))
    assert not stopped["synchronous rounds continue"].ok


def test_remote_drafter_needs_still_worker_local_rounds_and_the_baseline_kv():
    before = snap({"rounds": 0, "spec_drafts": 0}, worker={"rounds": 500})
    after = snap({"rounds": 40, "spec_drafts": 40, "kv_tokens": 65536, "kv_extra_tokens": 0}, worker={"rounds": 500})
    got = _eval("remote_drafter", before, after)
    assert all(c.ok for c in got.values()), got
    # the worker still drafting
    moving = _eval("remote_drafter", before, snap(dict(after.engine), worker={"rounds": 540}))
    assert not moving["worker rounds still"].ok and moving["worker rounds still"].detail == "worker rounds +40"
    # capacity mode left on: the KV budget is not the baseline
    cap = _eval(
        "remote_drafter",
        before,
        snap(dict(after.engine, kv_tokens=69632, kv_extra_tokens=4096), worker={"rounds": 500}),
    )
    assert not cap["KV budget baseline"].ok
    assert cap["KV budget baseline"].detail == "kv_cache_tokens 69632 (baseline 65536), extra 4096"
    # no local speculation (target-only)
    none = _eval(
        "remote_drafter", before, snap({"rounds": 0, "spec_drafts": 0, "kv_tokens": 65536}, worker={"rounds": 500})
    )
    assert not none["local speculation"].ok
    # no KV gauge at all is a failure, not a pass
    assert not _eval("remote_drafter", before, snap({"rounds": 4, "spec_drafts": 4}))["KV budget baseline"].ok


def test_remote_engram_needs_a_still_table_server_and_local_lookups_without_fallbacks():
    before = snap(engram={"0": {"lookups": 10}, "1": {"lookups": 10}}, server={"requests": 900, "rows_served": 9000})
    after = snap(engram={"0": {"lookups": 50}, "1": {"lookups": 50}}, server={"requests": 900, "rows_served": 9000})
    got = _eval("remote_engram", before, after)
    assert all(c.ok for c in got.values()), got
    assert got["local reader serves"].detail == "rank 0 lookups +40 fallbacks +0, rank 1 lookups +40 fallbacks +0"
    remote = _eval(
        "remote_engram", before, snap(after.engine, after.engram, server={"requests": 980, "rows_served": 9800})
    )
    assert (
        not remote["remote lookups still"].ok
        and remote["remote lookups still"].detail == "table server requests +80, rows +800"
    )
    fb = _eval(
        "remote_engram",
        before,
        snap(engram={"0": {"lookups": 50, "fallbacks": 3}, "1": {"lookups": 50}}, server={"requests": 900}),
    )
    assert not fb["local reader serves"].ok
    idle = _eval(
        "remote_engram", before, snap(engram={"0": {"lookups": 50}, "1": {"lookups": 10}}, server={"requests": 900})
    )
    assert not idle["local reader serves"].ok  # rank 1 did no lookups


@pytest.mark.parametrize("name", sorted(C.COMPONENTS))
def test_common_checks_refs_failures_and_configuration(name):
    before, after = snap(), snap()
    got = _eval(name, before, after, refs_identical=5, failed_requests=1, env_problems_found=["h: X=1 (left)"])
    assert not got["greedy references"].ok and got["greedy references"].detail == "5/6 identical"
    assert not got["failed requests"].ok and got["failed requests"].detail == "1 failed of 14 sent"
    assert not got["configuration"].ok and got["configuration"].detail == "h: X=1 (left)"
    # aborted requests counted by the engine are failures too; no refs at all is not a pass
    got = _eval(
        name,
        snap({"finished_abort": 1}),
        snap({"finished_abort": 3, "finished_error": 1}),
        refs_total=0,
        refs_identical=0,
    )
    assert got["failed requests"].detail == "3 failed of 14 sent" and not got["greedy references"].ok


class Metrics:
    """A /metrics endpoint serving ``text`` (settable) on 127.0.0.1."""

    def __init__(self, text: str) -> None:
        self.text = text
        m = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server API
                body = m.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def lab(tmp_path):
    serving = FakeServing()
    worker = Metrics("dsv41_drafter_rounds_total 500.0\n")
    server = Metrics("dsv41_engram_requests_total 900.0\ndsv41_engram_rows_served_total 9000.0\n")
    path = tmp_path / "refs.json"
    refs.save_refs(refs.run_prompts(serving.url, max_tokens=8), path)
    yield serving, worker, server, path
    for s in (serving, worker, server):
        s.close()


def _run(lab, name, **kw):
    serving, worker, server, path = lab
    args = dict(
        engine_metrics_url=serving.url + "/metrics",
        worker_metrics_url=worker.url,
        server_metrics_url=server.url,
        envs={"sparkhead": ENGRAM_OFF, "sparkworker": ENGRAM_OFF},
        kv_baseline=65536,
        burst=4,
        max_tokens=8,
    )
    args.update(kw)
    return C.run(name, serving.url, str(path), **args)


def test_run_remote_engram_passes_on_a_still_table_server(lab):
    res = _run(lab, "remote_engram")
    assert res.ok, res.message()
    assert res.sent == 10 and res.failed == 0 and res.errors == []
    # FakeServing counts one lookup per completion on each rank: 6 refs + 4 burst
    assert res.after.engram["0"]["lookups"] - res.before.engram["0"]["lookups"] == 10
    d = res.to_dict()
    assert d["sent_requests"] == 10 and d["failed_requests"] == 0 and "failed" not in d
    assert d["ok"] and [c["name"] for c in d["checks"]] == [
        "configuration",
        "greedy references",
        "failed requests",
        "remote lookups still",
        "local reader serves",
    ]


def test_run_names_the_failed_check_when_the_remote_is_still_used(lab):
    serving, worker, server, path = lab
    orig = serving.httpd.RequestHandlerClass.do_POST

    def post(self):  # every completion also reaches the table server
        server.text = server.text.replace("900.0", "901.0")
        return orig(self)

    serving.httpd.RequestHandlerClass.do_POST = post
    res = _run(lab, "remote_engram", envs={"sparkhead": PROD_ENGRAM})
    assert not res.ok
    assert [c.name for c in res.failed_checks()] == ["configuration", "remote lookups still"]
    assert res.message().startswith("configuration: sparkhead: DSV41_ENGRAM_REMOTE=")


def test_run_counts_failed_requests_and_differing_refs(lab):
    serving, *_ = lab
    serving.shift_names = {refs.PROMPTS[0][0]}
    serving.no_token_ids = False
    res = _run(lab, "remote_engram")
    assert [c.name for c in res.failed_checks()] == ["greedy references"]
    assert res.checks[1].detail == "5/6 identical"
    serving.no_token_ids = True  # every completion now fails
    res = _run(lab, "remote_engram")
    assert res.failed == 5 and len(res.errors) == 5  # the refs run (stops at the first) + 4 burst requests
    assert {c.name for c in res.failed_checks()} == {"greedy references", "failed requests"}


def test_run_unreadable_metrics_is_one_error_line(lab):
    serving, worker, server, path = lab
    with pytest.raises(C.ComponentError, match=r"^cannot read metrics at http://127.0.0.1:9/metrics: cannot connect"):
        _run(lab, "async_handoff", worker_metrics_url="http://127.0.0.1:9/metrics")
    with pytest.raises(C.ComponentError, match="^unknown component 'x'"):
        _run(lab, "x")
