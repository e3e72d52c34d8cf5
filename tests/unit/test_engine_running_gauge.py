"""``vllm:num_requests_running`` (and ``waiting``) follow the scheduler when requests end without
a step: a client that leaves a keep-frozen engine (``/pause?mode=keep``: no step until
``/resume``) is aborted and the gauge is back to 0 at once, not after ``/resume``. A real lab
engine (the local row source)."""

from __future__ import annotations

import time

import pytest

from engineutil import lab_assets, local_rows  # noqa: E402


def _wait(cond, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture()
def engine(tmp_path_factory):
    from dsv41.engine.engine import Engine
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.model import TargetModel
    from dsv41.engine.model_config import load_config
    from dsv41.engine.scheduler import Scheduler
    from dsv41.engine.tp import LocalComm
    from dsv41.engine.weights import load_weights

    assets = lab_assets(tmp_path_factory)
    cfg = load_config(assets.config)
    rows = local_rows(assets)
    model = TargetModel(cfg, load_weights(cfg, assets.weights), LocalComm(), rows)
    metrics = EngineMetrics("m", lambda: {})
    eng = Engine(
        model,
        Scheduler(kv_cache_tokens=512, max_model_len=128, max_running=1, max_step_tokens=64),
        LocalComm(),
        rows,
        metrics=metrics,
    )
    eng.start()
    yield eng, metrics
    eng.shutdown(5)


def _gauge(g) -> float:
    return g._value.get()


def test_requests_that_leave_a_frozen_engine_leave_the_gauges(engine) -> None:
    from dsv41.engine.sampler import SamplingParams

    eng, metrics = engine
    events: list = []
    a = eng.submit(list(range(1, 9)), SamplingParams(max_tokens=100, ignore_eos=True), events.append)
    assert _wait(lambda: any(e["type"] == "tokens" for e in events)), "the request never ran"
    b = eng.submit(list(range(1, 9)), SamplingParams(max_tokens=100, ignore_eos=True), lambda e: None)  # waits
    eng.freeze(True)
    time.sleep(0.2)
    assert _gauge(metrics.running) == 1
    eng.abort(a.request_id)  # what the API does when its client goes away
    eng.abort(b.request_id)
    assert _wait(lambda: _gauge(metrics.running) == 0 and _gauge(metrics.waiting) == 0, 5.0), (
        _gauge(metrics.running),
        _gauge(metrics.waiting),
    )
    assert eng.frozen and eng.idle()
    eng.freeze(False)
