"""The overlay's drafter seam on the CPU: hidden-row choice, DraftInputs from the runner's
state, fail-closed drafts, the TP broadcast and the init_speculator replacement.

vLLM's ``BaseSpeculator`` and TP group are absent in CI: a small ABC with the same abstract
methods and a recording group stand in (tests/gpu/vllm_overlay_qualify.py runs the seam
against a real ``dsv41 drafter serve``).
"""

from __future__ import annotations

import abc
import types

import numpy as np
import pytest
import torch

from dsv41 import envs
from dsv41.drafter.model import random_drafter
from dsv41.drafter.speculators import LocalSpeculator
from dsv41.engine.spec_decode import DraftProposal
from dsv41.errors import ConfigError
from dsv41.overlay import drafter as D

ns = types.SimpleNamespace
H, V, K = 32, 260, 4


class FakeBase(abc.ABC):
    """Stands in for vLLM's BaseSpeculator (same abstract methods)."""

    @abc.abstractmethod
    def init_cudagraph_manager(self, cudagraph_mode): ...

    @abc.abstractmethod
    def capture(self): ...

    @abc.abstractmethod
    def propose(self, *a, **k): ...


class Group:
    def __init__(self, rank: int) -> None:
        self.rank_in_group, self.world_size, self.calls = rank, 2, []

    def broadcast(self, t, src=0):
        self.calls.append((t.clone(), src))
        return t


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    random_drafter(d, vocab_size=V, hidden_size=H, seed=9)
    return d


def _vcfg(layers=(2, 3)):
    return ns(
        speculative_config=ns(
            num_speculative_tokens=K,
            method="dspark",
            draft_model_config=ns(hf_config=ns(dspark_target_layer_ids=list(layers))),
        ),
        scheduler_config=ns(max_num_seqs=8),
        model_config=ns(hf_config=ns(hidden_size=H, vocab_size=V)),
    )


def _state(n: int):
    g = torch.Generator().manual_seed(0)
    return ns(
        total_len=ns(gpu=torch.tensor([10, 3, 30, 5, 7][:n], dtype=torch.int32)),
        all_token_ids=ns(gpu=torch.randint(0, V, (n, 40), dtype=torch.int32, generator=g)),
    )


def _batch(n: int):
    q = np.array([0, 2, 3, 8, 9, 10][: n + 1])
    return ns(num_reqs=n, query_start_loc_np=q, idx_mapping=torch.arange(n), req_ids=[f"r{i}" for i in range(n)])


def test_hidden_row_is_the_newest_tokens_position() -> None:
    # prefill chunk [0,2): row 1; decode [2,3): row 2; verification of 4 drafts [3,8) with 1
    # rejected: 4 sampled, row 3+4-1 = 6
    assert D.hidden_rows([0, 2, 3, 8], [0, 0, 1]).tolist() == [1, 2, 6]


def test_draft_inputs_from_runner_state() -> None:
    tails = np.array([[5, 6, 7, 8], [0, 1, 2, 3], [9, 9, 9, 9]])
    live, batch = D.draft_inputs(
        ["a", "b", "c"], np.array([1, 2, 0]), np.ones((3, H), np.float32), tails, np.array([10, 2, 7]), K
    )
    assert live == [0, 1]  # c sampled nothing this step (a chunked-prefill chunk)
    a, b = batch
    assert a.token_ids.size == 10 and a.token_ids[-4:].tolist() == [5, 6, 7, 8] and a.depth == K
    assert b.token_ids.tolist() == [2, 3]  # shorter than n_ctx: only real tokens
    assert a.temperature == 0.0 and a.hidden.dtype == np.float32
    assert D.draft_inputs(["a"], np.array([1]), np.ones((1, H)), tails[:1], np.array([4]), 0) == ([], [])


def test_fill_drafts_fails_closed() -> None:
    good = [DraftProposal(np.array([3, 4, 5, 6, 7]), None, None), DraftProposal(np.array([1]), None, None)]
    out = D.fill_drafts(3, K, [0, 2], good)
    assert out.tolist() == [[3, 4, 5, 6], [-1] * K, [1, -1, -1, -1]]
    assert (D.fill_drafts(3, K, [0, 2], good[:1]) == -1).all()  # wrong count: no drafts
    assert (D.fill_drafts(3, K, [0, 2], None) == -1).all()
    assert (D.fill_drafts(3, K, [0, 2], [object(), object()]) == -1).all()  # malformed


def test_rank0_drafts_match_the_drafter_in_process_and_are_broadcast(ddir) -> None:
    cls = D.speculator_class(FakeBase)
    group = Group(0)
    spec = cls(
        _vcfg(),
        torch.device("cpu"),
        _state(5),
        tp_group=group,
        make_spec=lambda c: (LocalSpeculator(str(ddir), k=K), 3, 4),
    )
    assert spec.tap_index == 1 and spec.draft_logits is None
    aux = [torch.randn(10, H, dtype=torch.bfloat16) for _ in range(2)]
    ns_ = torch.tensor([1, 1, 2, 0, 1])
    nr = torch.tensor([0, 0, 3, 0, 0])
    drafts = spec.propose(_batch(5), None, None, None, aux, ns_, nr, None, None, None, None)
    assert drafts.shape == (5, K) and drafts.dtype == torch.int64
    assert (drafts[3] == -1).all() and (drafts[[0, 1, 2, 4], 0] >= 0).all()  # k <= depth drafts each
    # the same round straight through the drafter
    rows = D.hidden_rows(_batch(5).query_start_loc_np, nr.numpy())
    st = _state(5)
    tot = st.total_len.gpu.long()
    cols = (tot[:, None] - 4 + torch.arange(4)[None]).clamp(min=0)
    tails = st.all_token_ids.gpu[torch.arange(5)[:, None], cols].numpy()
    live, items = D.draft_inputs(
        _batch(5).req_ids, ns_.numpy(), aux[1][torch.from_numpy(rows)].float().numpy(), tails, tot.numpy(), K
    )
    want = D.fill_drafts(5, K, live, LocalSpeculator(str(ddir), k=K).propose(items))
    assert drafts.tolist() == want.tolist()
    assert len(group.calls) == 1 and group.calls[0][1] == 0 and torch.equal(group.calls[0][0], drafts)


def test_other_ranks_never_ask_the_drafter_and_take_the_broadcast() -> None:
    cls = D.speculator_class(FakeBase)
    asked = []
    group = Group(1)
    spec = cls(_vcfg(), torch.device("cpu"), _state(2), tp_group=group, make_spec=lambda c: asked.append(c))
    out = spec.propose(
        _batch(2),
        None,
        None,
        None,
        [torch.zeros(3, H)] * 2,
        torch.ones(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        None,
        None,
        None,
        None,
    )
    assert asked == [] and len(group.calls) == 1 and out.shape == (2, K)


@pytest.mark.parametrize("why", ["raises", "tap missing", "dummy"])
def test_no_drafts_never_an_error(why: str, ddir) -> None:
    class Boom:
        def propose(self, batch):
            raise RuntimeError("worker gone")

        def counters(self):
            return {"rounds": 0}

    cls = D.speculator_class(FakeBase)
    layers = (5, 6) if why == "tap missing" else (2, 3)
    spec = cls(_vcfg(layers), torch.device("cpu"), _state(2), tp_group=Group(0), make_spec=lambda c: (Boom(), 3, 4))
    aux = [torch.randn(3, H) for _ in range(2)]
    out = spec.propose(
        _batch(2),
        None,
        None,
        None,
        aux,
        torch.ones(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        None,
        None,
        None,
        None,
        dummy_run=why == "dummy",
    )
    assert (out == -1).all()
    assert spec.counters()["overlay_failures"] == (1 if why == "raises" else 0)


def test_nothing_to_capture() -> None:
    cls = D.speculator_class(FakeBase)
    spec = cls(_vcfg(), torch.device("cpu"), _state(1), tp_group=Group(1), make_spec=None)
    assert spec.init_cudagraph_manager(None) is None and spec.capture() is None


def test_init_speculator_is_replaced_for_dspark_only(monkeypatch) -> None:
    calls = []

    def orig(vllm_config, device, req_states):
        calls.append(vllm_config.speculative_config.method)
        return "vllm's own"

    mod = types.ModuleType("fake_spec_decode")
    mod.init_speculator = orig
    D.apply_init_speculator(mod, ns(env=envs.Settings()))
    assert mod.init_speculator is not orig and mod._dsv41_overlay
    cfg = _vcfg()
    cfg.speculative_config.method = "mtp"
    assert mod.init_speculator(cfg, "cpu", None) == "vllm's own" and calls == ["mtp"]
    runner = types.ModuleType("fake_model_runner")
    runner.init_speculator = mod.init_speculator  # bound by name after the patch
    D.apply_init_speculator(runner, ns(env=envs.Settings()))
    assert runner.init_speculator is mod.init_speculator and runner._dsv41_overlay


def test_make_dsv41_spec_needs_the_drafter_files(ddir) -> None:
    with pytest.raises(ConfigError, match="DSV41_DRAFTER_DIR"):
        D.make_dsv41_spec(_vcfg(), envs.Settings(drafter_remote="tcp://127.0.0.1:1"))
    bad = _vcfg()
    bad.model_config.hf_config.hidden_size = H + 1
    with pytest.raises(Exception, match="hidden_size"):
        D.make_dsv41_spec(
            bad, envs.parse({"DSV41_DRAFTER_REMOTE": "tcp://127.0.0.1:1", "DSV41_DRAFTER_DIR": str(ddir)})
        )
    spec, tap, n_ctx = D.make_dsv41_spec(
        _vcfg(),
        envs.parse(
            {
                "DSV41_DRAFTER_REMOTE": "tcp://127.0.0.1:1",
                "DSV41_DRAFTER_DIR": str(ddir),
                "DSV41_DRAFTER_TIMEOUT_MS": "50",
            }
        ),
    )
    try:
        assert (tap, n_ctx) == (0, 4)
        # nothing listens: one round fails closed inside the dsv41 speculator
        assert spec.propose([]) == []
    finally:
        spec.close()
