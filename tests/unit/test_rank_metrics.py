"""Where each TP rank's counters are read (dsv41.harness.rank_metrics) and every reader of them
under vLLM, against loopback fakes: rank 0's API exports only vLLM's own series, and each rank's
overlay endpoint exports its Engram counters, its state and its transport (what
dsv41.overlay.metrics serves). Each reader must read rank 1 from rank 1's endpoint, name the rank
and the endpoint when that endpoint is unreachable, and fail naming the rank when its overlay is
inert."""

from __future__ import annotations

import json
import threading

import pytest

from dsv41.entrypoints import qualify_controller as QC, status as ST
from dsv41.harness import components as CO, rank_metrics as RM, refs, window_plan as WP
from serverutil import HttpStandIn, QuietHandler

# ---- the URL function ----------------------------------------------------------------------------

FACTS = {"api_url": "http://192.0.2.10:8000", "ranks": {"0": "192.0.2.10", "1": "192.0.2.11"}, "overlay_port": 9471}


def test_stand_in_engine_reads_every_rank_on_rank0s_api():
    assert RM.urls({**FACTS, "runtime": "lab"}) == {
        "0": "http://192.0.2.10:8000/metrics",
        "1": "http://192.0.2.10:8000/metrics",
    }


def test_vllm_reads_each_spark_overlay_endpoint():
    assert RM.urls({**FACTS, "runtime": "vllm"}) == {
        "0": "http://192.0.2.10:9471/metrics",
        "1": "http://192.0.2.11:9471/metrics",
    }
    # ranks in rank order whatever the inventory's order; integer ranks as Ansible may pass them
    assert list(RM.urls({**FACTS, "runtime": "vllm", "ranks": {1: "192.0.2.11", 0: "192.0.2.10"}})) == ["0", "1"]


def test_vllm_only_the_ranks_whose_overlay_is_on():
    assert RM.urls({**FACTS, "runtime": "vllm", "overlay_ranks": ["1"]}) == {"1": "http://192.0.2.11:9471/metrics"}
    assert RM.urls({**FACTS, "runtime": "vllm", "overlay_ranks": []}) == {}
    assert len(RM.urls({**FACTS, "runtime": "lab", "overlay_ranks": []})) == 2  # the engine counts every rank


@pytest.mark.parametrize(
    "facts, words",
    [
        ({**FACTS, "runtime": "sglang"}, "runtime must be one of lab, vllm"),
        ({**FACTS, "runtime": "vllm", "ranks": {}}, "ranks must map"),
        ({**FACTS, "runtime": "vllm", "ranks": {"x": "192.0.2.10"}}, "rank 'x' is not a TP rank"),
        ({**FACTS, "runtime": "vllm", "ranks": {"0": "192.0.2.10/metrics"}}, "rank 0's address must be a bare host"),
        ({**FACTS, "runtime": "vllm", "ranks": {"0": "192.0.2.10:9"}}, "rank 0's address must be a bare host"),
        ({**FACTS, "runtime": "vllm", "ranks": {"0": ""}}, "rank 0's address must be a bare host"),
        ({**FACTS, "runtime": "vllm", "overlay_port": 0}, "overlay_port must be 1..65535"),
        ({**FACTS, "runtime": "vllm", "overlay_port": "http"}, "overlay_port must be 1..65535"),
        ({**FACTS, "runtime": "vllm", "overlay_ranks": "0"}, "overlay_ranks must be a list"),
        ({**FACTS, "runtime": "lab", "api_url": ""}, "api_url must be http://HOST:PORT"),
        ([1], "must be a mapping"),
    ],
)
def test_bad_facts_are_one_error_naming_the_fact(facts, words):
    with pytest.raises(RM.RankMetricsError, match="rank metrics") as exc:
        RM.urls(facts)
    assert words in str(exc.value)


# ---- the fakes: vLLM's API on rank 0 and one overlay endpoint per rank -------------------------


class Api(HttpStandIn):
    """Rank 0's API under vLLM: completions (greedy ids from the prompt bytes), /v1/models,
    /health, /is_paused and a /metrics with vLLM's own series only. Each completion makes every
    rank in ``ranks`` count ``lookups_per_call`` Engram lookups."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.completions = 0
        api = self

        class H(QuietHandler):
            def _send(self, code, body, ctype="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                p = self.path.split("?")[0]
                if p == "/health":
                    return self._send(200, {"status": "ok"})
                if p == "/is_paused":
                    return self._send(200, {"is_paused": False})
                if p == "/v1/models":
                    return self._send(200, {"data": [{"id": "dsv41"}]})
                if p == "/metrics":
                    return self._send(
                        200,
                        'vllm:spec_decode_num_drafts_total{model_name="m"} '
                        f'{api.completions}\nvllm:num_requests_running{{model_name="m"}} 0\n',
                        "text/plain",
                    )
                return self._send(404, {})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/v1/completions":
                    return self._send(404, {})
                prompt = str(body.get("prompt", "x")).encode() or b"x"
                ids = [(prompt[i % len(prompt)] * 7 + i) % 260 for i in range(int(body.get("max_tokens", 4)))]
                api.completions += 1
                for r in api.ranks:
                    r.count()
                return self._send(200, {"choices": [{"text": "x", "token_ids": ids}]})

        self._serve(H)


class Rank(HttpStandIn):
    """One rank's overlay endpoint, in the names dsv41.overlay.metrics exports."""

    def __init__(self, rank: int, state: str = "active", transport: str = "c++") -> None:
        self.rank, self.state, self.transport = rank, state, transport
        self.lookups = self.fallbacks = 0
        self.lock = threading.Lock()
        self.drafter = rank == 0
        me = self

        class H(QuietHandler):
            def do_GET(self):  # noqa: N802
                if self.path.split("?")[0] != "/metrics":
                    self.send_response(404)
                    self.end_headers()
                    return
                data = me.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._serve(H)

    def count(self) -> None:
        with self.lock:
            if self.state == "active":
                self.lookups += 3

    def text(self) -> str:
        r = self.rank
        lines = [
            f'dsv41_overlay_state{{rank="{r}",state="{s}"}} {1.0 if s == self.state else 0.0}'
            for s in ("active", "inert", "refused")
        ]
        lines.append(f'dsv41_overlay_transport_info{{rank="{r}",implementation="{self.transport}"}} 1.0')
        if self.state == "active":
            lines += [
                f'dsv41_engram_lookups_total{{rank="{r}"}} {self.lookups}',
                f'dsv41_engram_rows_total{{rank="{r}"}} {self.lookups * 8}',
                f'dsv41_engram_fallbacks_total{{rank="{r}"}} {self.fallbacks}',
            ]
        if self.drafter:
            lines += [f"dsv41_drafter_rounds_total {self.lookups}", "dsv41_drafter_identity_refusals_total 0"]
        return "\n".join(lines) + "\n"


@pytest.fixture
def stack(tmp_path):
    ranks = [Rank(0), Rank(1)]
    api = Api(ranks)
    urls = {str(r.rank): r.url + "/metrics" for r in ranks}
    yield api, ranks, urls, tmp_path
    api.close()
    for r in ranks:
        r.close()


def _hosts() -> dict:
    return {
        "sparkhead": {"groups": ["spark"], "rank": 0, "reachable": True, "services": {"dsv41-serve": "active"}},
        "sparkworker": {"groups": ["spark"], "rank": 1, "reachable": True, "services": {"dsv41-serve": "active"}},
    }


# ---- every reader: (name, call -> one failure line or None) -------------------------------------


def read_refs(api, urls, tmp):
    try:
        res = refs.check(
            api.url,
            tmp / "refs.json",
            mode="record",
            max_tokens=4,
            metrics_url=urls,
            require_ranks=["0", "1"],
            require_drafter=True,
        )
    except refs.RefsError as exc:  # the module's one failure line
        return str(exc)
    return res.problem


def read_status(api, urls, tmp):
    rep = ST.evaluate(_hosts(), ST.probe(api.url, None, None, window_s=0, rank_metrics=urls))
    return "; ".join(r for r in rep["reasons"] if "rank" in r) or None


def read_status_window(api, urls, tmp):
    """status with a window: traffic between the two reads, so the deltas come from the ranks."""
    probed = ST.probe(
        api.url, None, None, window_s=0.3, rank_metrics=urls, sleep=lambda _s: refs.generate(api.url, "the", "dsv41", 4)
    )
    rep = ST.evaluate(_hosts(), probed)
    if not rep["reasons"]:
        assert probed["engine"]["window"]["engram"]["1"]["lookups"] > 0  # read from rank 1's endpoint
    return "; ".join(rep["reasons"]) or None


def read_qualify(api, urls, tmp):
    refs.save_refs(refs.run_prompts(api.url, None, 4), tmp / "q.json")
    recs = QC.probe_serving(
        api.url, str(tmp / "q.json"), host="localhost", ranks=["0", "1"], interval_s=0.05, requests=2, rank_metrics=urls
    )
    bad = [r["reason"] for r in recs if r["status"] != "pass"]
    return "; ".join(bad) or None


def read_window_ready(api, urls, tmp):
    try:
        WP.wait_ready(api.url, ["0", "1"], timeout_s=0.2, poll_s=0.05, rank_metrics=urls)
    except Exception as exc:  # noqa: BLE001 - the reader's one error line is the result
        return str(exc)
    return None


def read_components(api, urls, tmp):
    try:
        snap = CO.snapshot(api.url + "/metrics", urls["0"], urls["0"], rank_urls=urls)
    except CO.ComponentError as exc:
        return str(exc)
    if "1" not in snap.engram:
        return "rank 1: no Engram counters in the snapshot"
    if snap.engine.get("spec_drafts") is None:
        return "vLLM's own series missing from the snapshot"
    return None


READERS = [
    ("greedy_refs", read_refs),
    ("status", read_status),
    ("status window", read_status_window),
    ("qualify serving", read_qualify),
    ("window ready", read_window_ready),
    ("component check", read_components),
]
#: Readers that judge the overlay's state (the component check reads counters for its own table).
JUDGES_STATE = {"greedy_refs", "status", "status window", "qualify serving", "window ready"}


@pytest.mark.parametrize("name, reader", READERS, ids=[n for n, _ in READERS])
def test_each_reader_reads_every_rank_from_its_endpoint(stack, name, reader):
    api, ranks, urls, tmp = stack
    assert reader(api, urls, tmp) is None


@pytest.mark.parametrize("name, reader", READERS, ids=[n for n, _ in READERS])
def test_unreachable_rank_endpoint_names_the_rank_and_the_endpoint(stack, name, reader):
    api, ranks, urls, tmp = stack
    ranks[1].close()
    msg = reader(api, urls, tmp)
    assert msg and "rank 1" in msg and urls["1"] in msg, msg


@pytest.mark.parametrize(
    "name, reader", [r for r in READERS if r[0] in JUDGES_STATE], ids=[n for n, _ in READERS if n in JUDGES_STATE]
)
def test_inert_overlay_on_a_remote_rank_is_a_failure_naming_it(stack, name, reader):
    api, ranks, urls, tmp = stack
    ranks[1].state = "inert"
    msg = reader(api, urls, tmp)
    assert msg and "rank 1" in msg and "inert" in msg, msg


def test_status_warns_of_the_pure_python_transport(stack):
    api, ranks, urls, tmp = stack
    ranks[1].transport = "python"
    rep = ST.evaluate(_hosts(), ST.probe(api.url, None, None, window_s=0, rank_metrics=urls))
    assert rep["healthy"], rep["reasons"]
    assert any("rank 1" in w and "pure-Python transport" in w for w in rep["warnings"]), rep["warnings"]


def test_status_skips_ranks_without_the_overlay(stack):
    """A rank the inventory runs without the overlay (vLLM's own Engram) has no endpoint to read."""
    api, ranks, urls, tmp = stack
    ranks[1].close()
    rep = ST.evaluate(_hosts(), ST.probe(api.url, None, None, window_s=0, rank_metrics={"0": urls["0"]}))
    assert rep["healthy"], rep["reasons"]


def test_qualify_reports_each_ranks_transport(stack):
    api, ranks, urls, tmp = stack
    ranks[0].transport = "python"
    refs.save_refs(refs.run_prompts(api.url, None, 4), tmp / "q.json")
    recs = QC.probe_serving(
        api.url, str(tmp / "q.json"), host="localhost", ranks=["0", "1"], interval_s=0.05, requests=2, rank_metrics=urls
    )
    seen = {r["subject"]: r["value"]["transport"] for r in recs if r.get("subject", "").startswith("rank")}
    assert seen == {"rank 0": "python", "rank 1": "c++"}


def test_refs_verify_cli_reads_each_rank_and_names_an_unreachable_one(stack, capsys):
    """`dsv41 refs verify --rank-metrics FACTS`: the operator's copy of the deploy's check."""
    from dsv41.cli import main

    api, ranks, urls, tmp = stack
    refs.save_refs(refs.run_prompts(api.url, None, 4), tmp / "r.json")
    # the facts name one port for every Spark (dsv41_overlay_metrics_port); nothing listens on port 1
    facts = {"runtime": "vllm", "api_url": api.url, "ranks": {"0": "127.0.0.1", "1": "127.0.0.2"}, "overlay_port": 1}
    argv = [
        "refs",
        "verify",
        "--endpoint",
        api.url,
        "--refs",
        str(tmp / "r.json"),
        "--attempts",
        "1",
        "--rank-metrics",
        json.dumps(facts),
    ]
    assert main(argv) == 1  # nothing listens on port 1 of either address
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 0: metrics endpoint http://127.0.0.1:1/metrics unreachable" in err, err
    assert main(argv[:-1] + ["{"]) == 1 and "--rank-metrics: not JSON" in capsys.readouterr().err
