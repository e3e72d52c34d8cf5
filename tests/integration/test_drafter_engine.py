"""Speculation end to end with the lab engine (in-process Engine, TP1): greedy output identical
with speculation off / local / remote / async proxy; sampled output reproducible per seed;
killing the worker or the proxy mid-stream loses no request; drafter distillation deterministic."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from dsv41 import envs  # noqa: E402
from dsv41.drafter.client import IdentityMismatch  # noqa: E402
from dsv41.drafter.factory import build_speculator  # noqa: E402
from dsv41.tokenizer import ByteTokenizer  # noqa: E402
from engineutil import lab_assets, local_rows, start_worker  # noqa: E402

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()
PROMPTS = ["The table server on the x86 host answers", "count 3 4 5 6", "Every green lamp holds the"]
K = 5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return lab_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def target(assets):
    from dsv41.engine.model_config import load_config
    from dsv41.engine.weights import load_weights, target_identity

    cfg = load_config(assets.config)
    return {
        "cfg": cfg,
        "weights": load_weights(cfg, assets.weights),
        "identity": target_identity(assets.config, assets.weights),
        "rows": local_rows(assets),
    }


@pytest.fixture(scope="module")
def drafter(assets, target, tmp_path_factory):
    from dsv41.drafter.train import train_drafter
    from dsv41.engine.runner import LocalRunner

    out = tmp_path_factory.mktemp("drafter")
    runner = LocalRunner(assets.config, assets.weights, target["rows"])
    rep = train_drafter(
        str(assets.config),
        str(assets.weights),
        str(out),
        runner=runner,
        steps=150,
        n_prompts=10,
        gen_tokens=32,
        eval_tokens=24,
    )
    return {"dir": str(out), "report": rep, "runner": runner}


def run_engine(target, spec, prompts, max_tokens=24, temperature=0.0, seed=None, on_first=None):
    """Run ``prompts`` concurrently through an in-process Engine; returns (outputs, metrics)."""
    from dsv41.engine.engine import Engine
    from dsv41.engine.metrics import EngineMetrics
    from dsv41.engine.model import TargetModel
    from dsv41.engine.sampler import SamplingParams
    from dsv41.engine.scheduler import Scheduler
    from dsv41.engine.tp import LocalComm

    model = TargetModel(target["cfg"], target["weights"], LocalComm(), target["rows"])
    k = K if spec is not None else 0
    sched = Scheduler(kv_cache_tokens=4096, max_model_len=1024, max_running=8, spec_depth=k)
    metrics = EngineMetrics("lab", lambda: {}, spec.counters if spec is not None else None)
    eng = Engine(model, sched, LocalComm(), target["rows"], speculator=spec, spec_depth=k, metrics=metrics)
    outs = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    reasons = [None] * len(prompts)

    def sink(i):
        def f(ev):
            if ev["type"] == "tokens":
                outs[i].extend(ev["ids"])
                if on_first is not None and len(outs[i]) >= 4:
                    on_first(i)
            elif ev["type"] == "finish":
                reasons[i] = ev["reason"]
                done[i].set()

        return f

    eng.start()
    try:
        for i, p in enumerate(prompts):
            eng.submit(
                TOK.encode(p, bos=True),
                SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True),
                sink(i),
            )
        for d in done:
            assert d.wait(180), "request did not finish"
    finally:
        eng.shutdown()
    assert all(r == "length" for r in reasons), reasons
    acc = metrics.spec_accepted._value.get()
    drafted = metrics.spec_draft_tokens._value.get()
    rounds = metrics.spec_drafts._value.get()
    return outs, {"accepted": acc, "drafted": drafted, "rounds": rounds}


@pytest.fixture(scope="module")
def worker(drafter, target, tmp_path_factory):
    proc, url = start_worker(drafter["dir"], target["identity"], tmp_path_factory.mktemp("w") / "worker.log")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def reference(target):
    return run_engine(target, None, PROMPTS)[0]


def _env(drafter, url=None, **kw):
    env = {"DSV41_DRAFTER_DIR": drafter["dir"], "DSV41_DRAFTER_TIMEOUT_MS": "2000"}
    if url:
        env["DSV41_DRAFTER_REMOTE"] = url
    else:
        env["DSV41_DRAFTER_LOCAL"] = drafter["dir"]
    env.update(kw)
    return env


def test_distilled_drafter_is_useful(drafter, reference):
    rep = drafter["report"]
    assert 0.2 < rep["heldout_acceptance"] <= 1.0
    assert rep["identities"]["target"] and rep["examples"] > 100


@pytest.mark.parametrize("mode", ["local", "remote", "async"])
def test_greedy_identical_with_speculation(mode, target, drafter, worker, reference):
    env = _env(drafter, None if mode == "local" else worker, DSV41_DRAFTER_ASYNC="1" if mode == "async" else "0")
    spec = build_speculator(envs.parse(env), model_cfg=target["cfg"].raw, target_identity=target["identity"])
    if mode == "async":
        assert spec.wait_ready(60)  # an engine starts long before its first request
    outs, m = run_engine(target, spec, PROMPTS)
    assert outs == reference
    assert m["drafted"] > 0 and m["accepted"] > 0  # drafts were proposed and some accepted
    c = spec.counters()
    assert c["fail_closed_rounds"] == 0 and c["identity_refusals"] == 0


def test_sampled_reproducible_per_seed(target, drafter, worker):
    def run(seed):
        spec = build_speculator(
            envs.parse(_env(drafter, worker)), model_cfg=target["cfg"].raw, target_identity=target["identity"]
        )
        return run_engine(target, spec, PROMPTS[:2], temperature=0.9, seed=seed)[0]

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c


@pytest.mark.parametrize("mode", ["remote", "async"])
def test_killing_worker_or_proxy_mid_stream_loses_nothing(mode, target, drafter, reference, tmp_path):
    proc, url = start_worker(drafter["dir"], target["identity"], tmp_path / "worker.log")
    env = _env(drafter, url, DSV41_DRAFTER_ASYNC="1" if mode == "async" else "0", DSV41_DRAFTER_TIMEOUT_MS="200")
    spec = build_speculator(envs.parse(env), model_cfg=target["cfg"].raw, target_identity=target["identity"])
    if mode == "async":
        assert spec.wait_ready(60)
    killed = []

    def kill(_i):
        if killed:
            return
        killed.append(1)
        if mode == "async":
            os.kill(spec.proxy_pid, signal.SIGKILL)  # the proxy first: the watchdog respawns it
        proc.kill()  # then the worker: everything fails closed to target-only

    try:
        outs, m = run_engine(target, spec, PROMPTS, max_tokens=32, on_first=kill)
        ref = run_engine(target, None, PROMPTS, max_tokens=32)[0]
        assert outs == ref
        c = spec.counters()
        assert killed
        if mode == "async":  # the respawned proxy may still be starting when the requests end
            assert c["watchdog_fires"] >= 1 and c["proxy_respawns"] >= 1
        else:
            assert c["fail_closed_rounds"] > 0
    finally:
        proc.kill()
        proc.wait(10)


def test_identity_mismatch_refused_end_to_end(target, drafter, tmp_path, reference):
    from dsv41.drafter.model import random_drafter

    other = tmp_path / "other"
    random_drafter(
        other,
        vocab_size=target["cfg"].vocab_size,
        hidden_size=target["cfg"].hidden_size,
        seed=3,
        target_identity=target["identity"],
        tap_layer=int(target["cfg"].drafter_tap_layer),
    )
    proc, url = start_worker(str(other), target["identity"], tmp_path / "worker.log")
    try:
        spec = build_speculator(
            envs.parse(_env(drafter, url)), model_cfg=target["cfg"].raw, target_identity=target["identity"]
        )
        outs, m = run_engine(target, spec, PROMPTS)
        assert outs == reference and m["drafted"] == 0
        assert spec.counters()["fail_closed_rounds"] >= 1
        with pytest.raises(IdentityMismatch, match="identity mismatch"):
            spec.client.connect(force=True)  # the refusal itself, independent of machine load
        assert spec.counters()["identity_refusals"] >= 1
    finally:
        proc.kill()
        proc.wait(10)


def test_distillation_deterministic(assets, drafter, tmp_path):
    from dsv41.drafter.train import train_drafter

    kw = dict(runner=drafter["runner"], steps=10, n_prompts=3, gen_tokens=12, eval_tokens=4)
    a = train_drafter(str(assets.config), str(assets.weights), str(tmp_path / "a"), **kw)
    b = train_drafter(str(assets.config), str(assets.weights), str(tmp_path / "b"), **kw)
    assert a["identities"] == b["identities"]
