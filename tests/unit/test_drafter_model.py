"""The torch drafter: determinism, sampling per seed, identities, file errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dsv41.drafter import model as M
from dsv41.drafter.protocol import RoundItem
from dsv41.errors import ConfigError, Dsv41Error

torch.set_num_threads(1)
H, V = 16, 40


@pytest.fixture(scope="module")
def ddir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    M.random_drafter(d, vocab_size=V, hidden_size=H, seed=3, d_model=32, target_identity="ab" * 32)
    return d


def _items(n=3, temp=0.0, seed=0, depth=5):
    rng = np.random.default_rng(5)
    return [
        RoundItem(f"r{i}", rng.integers(0, V, 6 + i), rng.standard_normal(H).astype(np.float32), depth, temp, seed + i)
        for i in range(n)
    ]


def test_greedy_drafts_are_argmax_and_deterministic(ddir):
    d = M.TorchDrafter(ddir)
    a, b = d.draft(_items()), d.draft(_items())
    for i in range(3):
        np.testing.assert_array_equal(a.tokens[i], b.tokens[i])
        assert a.tokens[i].shape == (5,) and a.top_ids[i].shape == (5, 32)
        np.testing.assert_array_equal(a.tokens[i], a.top_ids[i][:, 0])  # argmax = top-1
        np.testing.assert_allclose(a.top_probs[i].sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.diff(a.top_probs[i], axis=-1) <= 1e-7)


def test_batch_independence_and_depth(ddir):
    d = M.TorchDrafter(ddir)
    items = _items()
    items[1].depth = 2
    batch = d.draft(items)
    assert batch.tokens[1].size == 2
    for i, it in enumerate(items):
        alone = d.draft([it])
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[i])
        np.testing.assert_allclose(alone.top_probs[0], batch.top_probs[i], atol=1e-6)


def test_sampled_drafts_reproducible_per_seed(ddir):
    d = M.TorchDrafter(ddir)
    a, b = d.draft(_items(temp=1.5, seed=11)), d.draft(_items(temp=1.5, seed=11))
    c = d.draft(_items(temp=1.5, seed=99))
    assert all(np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens, strict=False))
    assert not all(np.array_equal(x, y) for x, y in zip(a.tokens, c.tokens, strict=False))
    for i in range(3):  # every sampled draft lies in the reported top-32 support
        assert all(t in ids for t, ids in zip(a.tokens[i], a.top_ids[i], strict=False))


def test_uniforms_keyed_by_seed_and_position():
    u1 = M.draft_uniforms(np.array([1, 2]), np.array([10, 10]), 4)
    u2 = M.draft_uniforms(np.array([1]), np.array([10]), 4)
    assert u1.shape == (2, 4) and np.all((u1 >= 0) & (u1 < 1))
    np.testing.assert_array_equal(u1[0], u2[0])
    assert not np.array_equal(u1[0], u1[1])


def test_identities_track_weights_and_markov(tmp_path, ddir):
    ids = M.identities(ddir)
    assert ids["target"] == "ab" * 32 and len(ids["drafter"]) == 64
    other = tmp_path / "o"
    M.random_drafter(other, vocab_size=V, hidden_size=H, seed=4, d_model=32, target_identity="ab" * 32)
    ids2 = M.identities(other)
    assert ids2["drafter"] != ids["drafter"] and ids2["markov"] != ids["markov"]
    assert M.identities(ddir) == ids  # stable


def test_bad_inputs_and_files(tmp_path, ddir):
    d = M.TorchDrafter(ddir)
    bad = _items(1)
    bad[0].tokens = np.array([V + 5])
    with pytest.raises(Dsv41Error, match="outside"):
        d.draft(bad)
    with pytest.raises(ConfigError, match="not found"):
        M.load_model(tmp_path / "missing")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / M.CONFIG_NAME).write_text(json.dumps({"format": "nope"}))
    with pytest.raises(ConfigError, match="format"):
        M.load_config(tmp_path / "x")
    # weights that do not match the config
    cfg = json.loads((ddir / M.CONFIG_NAME).read_text())
    cfg["d_model"] = 64
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / M.CONFIG_NAME).write_text(json.dumps(cfg))
    (tmp_path / "y" / M.WEIGHTS_NAME).write_bytes((ddir / M.WEIGHTS_NAME).read_bytes())
    with pytest.raises(ConfigError, match="do not match"):
        M.load_model(tmp_path / "y")
    with pytest.raises(ConfigError, match="positive"):
        M.DrafterConfig(vocab_size=0, hidden_size=4).validate()
    for mutate, msg in [
        (lambda c: c.pop("vocab_size"), "missing vocab_size"),
        (lambda c: c.update(max_k=True), "max_k"),
        (lambda c: c.update(max_k=10**9), "max_k"),
        (lambda c: c.update(tap_layer=-1), "tap_layer"),
        (lambda c: c.update(rms_norm_eps="x"), "rms_norm_eps"),
        (lambda c: c.update(target_identity="Z" * 64), "target_identity"),
    ]:
        c = json.loads((ddir / M.CONFIG_NAME).read_text())
        mutate(c)
        (tmp_path / "y" / M.CONFIG_NAME).write_text(json.dumps(c))
        with pytest.raises(ConfigError, match=msg):
            M.load_config(tmp_path / "y")
    with pytest.raises(Dsv41Error, match="expected cpu, cuda or cuda:N"):
        M.TorchDrafter(ddir, device="tpu")
