"""Deadlines the engine enforces itself on its step path (issue 10, item 1): a drafter whose
``propose`` never returns, or a remote Engram lookup that never returns, must cost drafts or a
local read, never the step; ``max_tokens: 0`` requests are counted like every other."""

from __future__ import annotations

import threading
import time

import pytest

from dsv41.engine.deadline import CallTimeout, DeadlineCaller, Deadlines, deadlines_from_env
from dsv41.envs import ConfigError
from engineutil import lab_assets, local_rows


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def target(assets):
    from dsv41.engine.model_config import load_config
    from dsv41.engine.weights import load_weights

    cfg = load_config(assets.config)
    return {"cfg": cfg, "weights": load_weights(cfg, assets.weights)}


class HangingSpeculator:
    """A drafter whose propose blocks until released (a wedged proxy or worker)."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        self.release.wait()
        raise RuntimeError("released")

    def counters(self):
        return {"calls": self.calls}

    def close(self):
        self.release.set()


def run(target, rows, spec=None, depth=0, deadlines=None, max_tokens=12, prompts=("The quick dog ", "count 3 4")):
    from dsv41.engine.engine import Engine
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.model import TargetModel
    from dsv41.engine.sampler import SamplingParams
    from dsv41.engine.scheduler import Scheduler
    from dsv41.engine.tp import LocalComm
    from dsv41.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    model = TargetModel(target["cfg"], target["weights"], LocalComm(), rows)
    sched = Scheduler(kv_cache_tokens=4096, max_model_len=1024, max_running=8, spec_depth=depth)
    metrics = EngineMetrics("lab", lambda: {})
    eng = Engine(
        model, sched, LocalComm(), rows, speculator=spec, spec_depth=depth, metrics=metrics, deadlines=deadlines
    )
    outs = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    reasons = [None] * len(prompts)

    def sink(i):
        def f(ev):
            if ev["type"] == "tokens":
                outs[i].extend(ev["ids"])
            else:
                reasons[i] = ev["reason"]
                done[i].set()

        return f

    eng.start()
    try:
        for i, p in enumerate(prompts):
            eng.submit(tok.encode(p), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), sink(i))
        for d in done:
            assert d.wait(60), "a request never finished: the engine stalled"
    finally:
        eng.shutdown(2)
    return outs, reasons, eng, metrics


def metric(metrics, name, labels=None):
    return metrics.registry.get_sample_value(name, labels or {"model_name": "lab"})


def test_hanging_propose_fails_closed_within_the_deadline(assets, target):
    want, _, _, _ = run(target, local_rows(assets))
    spec = HangingSpeculator()
    t0 = time.monotonic()
    got, reasons, eng, metrics = run(target, local_rows(assets), spec=spec, depth=3, deadlines=Deadlines(propose_s=0.2))
    elapsed = time.monotonic() - t0
    assert got == want and reasons == ["length", "length"]
    assert spec.calls == 1  # no second call stacked on the stuck one
    assert eng.spec_deadline_exceeded >= 1
    assert metric(metrics, "dsv41_engine_spec_deadline_exceeded_total") == eng.spec_deadline_exceeded
    assert elapsed < 30


def test_frozen_remote_engram_server_costs_a_local_read_within_the_deadline(assets, target, tmp_path):
    """The engine's Engram deadline lives in RemoteRowSource (no wrapper, no helper thread): a
    table server that accepts and never answers (request timeout far past the deadline) costs
    each step's lookup the deadline and a local read, and the tokens stay exact."""
    from dsv41 import envs
    from dsv41.engram import sources
    from dsv41.engram.manifest import load_manifest
    from dsv41.engram.server import load_tables
    from serverutil import SilentServer

    want, _, _, _ = run(target, local_rows(assets))
    tables, _ = load_tables(load_manifest(assets.manifest), assets.data)
    hung = SilentServer(tables)
    s = envs.parse(
        {
            "DSV41_ENGRAM_REMOTE": f"tcp://127.0.0.1:{hung.port}",
            "DSV41_ENGRAM_REMOTE_TIMEOUT_MS": "5000",
            "DSV41_ENGRAM_LOOKUP_DEADLINE_MS": "100",
        }
    )
    rows = sources.from_env(str(assets.manifest), str(assets.data), 0, 1, settings=s)
    assert rows.connected and rows.deadline_s == 0.1
    t0 = time.monotonic()
    got, _, _, _ = run(target, rows)
    elapsed = time.monotonic() - t0
    assert got == want  # exact rows from the local reader
    c = rows.counters()
    assert c["deadline_exceeded"] >= 1 and c["fallbacks"] >= c["deadline_exceeded"]
    assert elapsed < 60
    rows.close()
    hung.close()


def test_deadline_caller_returns_values_and_errors():
    c = DeadlineCaller("t")
    assert c.call(lambda a, b: a + b, 2, 3, timeout_s=5) == 5
    with pytest.raises(ZeroDivisionError):
        c.call(lambda: 1 / 0, timeout_s=5)
    gate = threading.Event()
    with pytest.raises(CallTimeout, match="deadline"):
        c.call(gate.wait, timeout_s=0.05)
    assert c.busy
    gate.set()
    for _ in range(100):
        if not c.busy:
            break
        time.sleep(0.01)
    assert c.call(lambda: "again", timeout_s=5) == "again"
    c.close()


@pytest.mark.parametrize(
    "env, frag",
    [
        ({"DSV41_TP_PEER_TIMEOUT_S": "abc"}, "DSV41_TP_PEER_TIMEOUT_S must be a number"),
        ({"DSV41_TP_PEER_TIMEOUT_S": "nan"}, "DSV41_TP_PEER_TIMEOUT_S must be a number"),
        ({"DSV41_DRAFTER_PROPOSE_DEADLINE_MS": "0"}, "DSV41_DRAFTER_PROPOSE_DEADLINE_MS must be a number"),
        ({"DSV41_ENGRAM_LOOKUP_DEADLINE_MS": "-5"}, "DSV41_ENGRAM_LOOKUP_DEADLINE_MS must be a number"),
        ({"DSV41_TP_PEER_TIMEOUT_S": "1"}, "DSV41_TP_PEER_TIMEOUT_S must be a number"),
        ({"DSV41_TP_PEER_TIMEOUT_S": "2", "DSV41_DRAFTER_PROPOSE_DEADLINE_MS": "3000"}, "must exceed"),
    ],
)
def test_bad_deadline_variables_name_the_variable(env, frag):
    with pytest.raises(ConfigError, match=frag):
        deadlines_from_env(env)


def test_deadline_defaults():
    assert deadlines_from_env({}) == Deadlines(5.0, 1.0)
    assert deadlines_from_env({"DSV41_TP_PEER_TIMEOUT_S": "2.5"}).tp_peer_timeout_s == 2.5


def test_max_tokens_zero_is_counted_as_a_success(assets, target):
    outs, reasons, _, metrics = run(target, local_rows(assets), max_tokens=0, prompts=("x", "y z"))
    assert outs == [[], []] and reasons == ["length", "length"]
    assert metric(metrics, "vllm:request_success_total", {"model_name": "lab", "finished_reason": "length"}) == 2
    assert metric(metrics, "vllm:e2e_request_latency_seconds_count") == 2
