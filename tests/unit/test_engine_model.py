"""Lab target model: config/weights checks, Engram path, TP bit-identity, caches, LocalRunner."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from dsv41.engine.model import TargetModel
from dsv41.engine.model_config import ENGRAM_COLUMNS, load_config
from dsv41.engine.runner import LocalRunner
from dsv41.engine.tp import LocalComm, ordered_sum
from dsv41.engine.weights import init_weights, load_weights, save_weights, target_identity, train_forward
from dsv41.engram.rowsource import RowSource
from dsv41.errors import ConfigError, Dsv41Error
from dsv41.tokenizer import ByteTokenizer
from engineutil import LAB_CONFIG, lab_assets, local_rows

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    torch.set_num_threads(1)
    return lab_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def cfg(assets):
    return load_config(assets.config)


@pytest.fixture(scope="module")
def weights(assets, cfg):
    return load_weights(cfg, assets.weights)


def _filled(out, rows):
    """``rows`` written into the caller's ``out`` buffer when given (RowSource.lookup's contract)."""
    if out is None:
        return rows
    out[...] = rows
    return out


class ZeroRows(RowSource):
    """Test double: every row is 264 zero bytes (dequantizes to exact zeros)."""

    def __init__(self):
        self.n = 0

    def lookup(self, layer_id, rows, out=None):
        self.n += len(rows)
        return _filled(out, np.zeros((len(rows), 264), dtype=np.uint8))

    def counters(self):
        return {"lookups": 0}

    def close(self):
        pass


class ThreadComm:
    """Test double for TP2 inside one process: two threads exchange tensors through a barrier."""

    def __init__(self, rank, shared):
        self.rank, self.tp, self.sh = rank, 2, shared

    def _exchange(self, x):
        self.sh["bufs"][self.rank] = x
        self.sh["barrier"].wait()
        out = list(self.sh["bufs"])
        self.sh["barrier"].wait()
        return out

    def sum_shards(self, parts):
        got = self._exchange(torch.stack(parts))
        return ordered_sum([p for b in got for p in b.unbind(0)])

    def gather_cols(self, local):
        return torch.cat(self._exchange(local), 1)


# ------------------------------------------------------------------------------ config/weights


def test_config_errors(tmp_path):
    base = json.loads(LAB_CONFIG.read_text())
    for mutate, msg in [
        (lambda c: c.pop("hidden_size"), "lacks keys"),
        (lambda c: c.update(vocab_size=300), "vocab_size"),
        (lambda c: c.update(drafter_tap_layer=9), "drafter_tap_layer"),
        (lambda c: c.update(engram_layer_ids=[1, 7]), "engram layer"),
        (lambda c: c.update(num_attention_heads=3), "divisible"),
    ]:
        c = dict(base)
        mutate(c)
        with pytest.raises(ConfigError, match=msg):
            load_config(c)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):  # engram.config reads the file
        load_config(tmp_path / "bad.json")
    assert load_config({"text_config": base}).hidden_size == 128


def test_init_weights_deterministic_and_seeded():
    base = json.loads(LAB_CONFIG.read_text())
    c1 = load_config({**base, "train_steps": 2})
    a, _ = init_weights(c1)
    b, _ = init_weights(c1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c2 = load_config({**base, "train_steps": 2, "seed": 42})
    d, _ = init_weights(c2)
    assert not torch.equal(a["embed.weight"], d["embed.weight"])
    # wkv is an FP8 linear held in fp32: every value is E4M3-representable times a power of two
    wkv = a["layers.1.engram.wkv.weight"]
    scale = 2.0 ** round(np.log2(c1.engram_wkv_std))
    v = wkv / scale
    assert torch.equal(v.to(torch.float8_e4m3fn).to(torch.float32), v)
    assert wkv.shape == (5 * 128, ENGRAM_COLUMNS * 256)


def test_load_weights_errors(tmp_path, cfg, weights, assets):
    with pytest.raises(Dsv41Error, match="does not exist"):
        load_weights(cfg, tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Dsv41Error, match="not readable safetensors"):
        load_weights(cfg, tmp_path / "junk.safetensors")
    other = load_config({**cfg.raw, "intermediate_size": 256})
    with pytest.raises(Dsv41Error, match="shape"):
        load_weights(other, assets.weights)
    part = dict(weights)
    part.pop("head.weight")
    from safetensors.torch import save_file

    save_file(part, str(tmp_path / "part.safetensors"))
    with pytest.raises(Dsv41Error, match="lacks"):
        load_weights(cfg, tmp_path / "part.safetensors")


def test_target_identity_tracks_bytes(tmp_path, assets, cfg, weights):
    ident = target_identity(assets.config, assets.weights)
    assert len(ident) == 64 and ident == target_identity(assets.config, assets.weights)
    w2 = dict(weights)
    w2["norm.weight"] = w2["norm.weight"] * 2
    save_weights(cfg, w2, {}, tmp_path / "w2.safetensors")
    assert target_identity(assets.config, tmp_path / "w2.safetensors") != ident
    with pytest.raises(Dsv41Error, match="cannot read"):
        target_identity(assets.config, tmp_path / "missing")


# ------------------------------------------------------------------------------ forward


def test_inference_matches_training_forward_without_engram(cfg, weights):
    m = TargetModel(cfg, weights, LocalComm(), ZeroRows())
    ids = TOK.encode("The small cat sees a red ball.")
    out = m.forward([(m.new_cache(64), ids)], [list(range(len(ids)))])
    ref = train_forward(cfg, {k: v.double() for k, v in weights.items()}, torch.tensor([ids]))[0]
    assert torch.allclose(out.logits[0].double(), ref, atol=1e-4, rtol=1e-4)


def test_engram_rows_change_the_output(cfg, weights, assets):
    ids = TOK.encode("Every tiny tree opens this cold cat. count 3 4")
    real = TargetModel(cfg, weights, LocalComm(), local_rows(assets))
    zero = TargetModel(cfg, weights, LocalComm(), ZeroRows())
    a = real.forward([(real.new_cache(64), ids)], [list(range(len(ids)))]).logits[0]
    b = zero.forward([(zero.new_cache(64), ids)], [list(range(len(ids)))]).logits[0]
    assert torch.isfinite(a).all()
    assert (a - b).abs().max() > 1e-2
    c = real.rows.counters()
    assert c["lookups"] == 2 and c["rows"] == 2 * len(ids) * ENGRAM_COLUMNS


def test_nonfinite_rows_are_zeroed_and_counted(cfg, weights):
    class NanRows(ZeroRows):
        def lookup(self, layer_id, rows, out=None):
            r = np.zeros((len(rows), 264), dtype=np.uint8)
            r[:, :256] = 0x38  # e4m3 1.0
            r[:, 256:] = 127  # scale 2^0
            r[0, 256] = 255  # reference convention: NaN for this block
            return _filled(out, r)

    m = TargetModel(cfg, weights, LocalComm(), NanRows())
    out = m.forward([(m.new_cache(16), TOK.encode("abc"))], [[2]])
    assert torch.isfinite(out.logits[0]).all()
    assert m.engram_stats["scale_bytes_255"] == 2 and m.engram_stats["nonfinite_values"] == 64


def test_chunked_batched_and_rollback_equal_one_shot(cfg, weights, assets):
    m = TargetModel(cfg, weights, LocalComm(), local_rows(assets))
    a = TOK.encode("One token moves the quiet tree. Every cat")
    b = TOK.encode("count 12 13 14")
    c1 = m.new_cache(8)
    one = m.forward([(c1, a)], [[len(a) - 1]]).logits[0]
    # chunked, batched with another request, cache growing past its first capacity
    c2, c3 = m.new_cache(4), m.new_cache(4)
    m.forward([(c2, a[:5]), (c3, b)], [[], []])
    m.forward([(c2, a[5:17])], [[]])
    two = m.forward([(c3, [7]), (c2, a[17:])], [[0], [len(a) - 18]]).logits[1]
    assert torch.allclose(one, two, atol=1e-9, rtol=0) and int(one.argmax()) == int(two.argmax())
    # rollback: feed wrong tokens, truncate, feed the right ones
    c4 = m.new_cache(8)
    m.forward([(c4, a[:10] + [9, 9, 9])], [[]])
    c4.truncate(10)
    assert c4.tokens == a[:10]
    three = m.forward([(c4, a[10:])], [[len(a) - 11]]).logits[0]
    assert torch.allclose(one, three, atol=1e-9, rtol=0)
    with pytest.raises(ValueError):
        c4.truncate(1000)


def test_position_limit(cfg, weights):
    small = load_config({**cfg.raw, "max_position_embeddings": 8})
    m = TargetModel(small, weights, LocalComm(), ZeroRows())
    with pytest.raises(Dsv41Error, match="max_position_embeddings"):
        m.forward([(m.new_cache(16), list(range(4, 14)))], [[0]])


def test_tp2_threads_bit_identical_to_tp1(cfg, weights, assets):
    """Real sharding (each rank its heads, MLP slice and Engram columns) gives TP1's exact bits."""
    prompts = [TOK.encode("The quick dog finds a stone."), TOK.encode("count 5 6 7")]
    tp1 = TargetModel(cfg, weights, LocalComm(), local_rows(assets))
    ref = tp1.forward([(tp1.new_cache(64), p) for p in prompts], [list(range(len(p))) for p in prompts]).logits
    shared = {"bufs": [None, None], "barrier": threading.Barrier(2, timeout=60)}
    results, errors = {}, []
    srcs = [local_rows(assets), local_rows(assets)]

    def run(rank):
        try:
            m = TargetModel(cfg, weights, ThreadComm(rank, shared), srcs[rank])
            results[rank] = m.forward(
                [(m.new_cache(64), p) for p in prompts], [list(range(len(p))) for p in prompts], logits=(rank == 0)
            ).logits
        except Exception as exc:  # surfaced below
            errors.append(exc)
            shared["barrier"].abort()

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    for x, y in zip(ref, results[0], strict=False):
        assert torch.equal(x, y)
    # each rank read only its own 12 columns of every token
    n = sum(map(len, prompts))
    assert srcs[0].counters()["rows"] == srcs[1].counters()["rows"] == 2 * n * 12


# ------------------------------------------------------------------------------ LocalRunner


def test_local_runner_generate(assets, cfg):
    r = LocalRunner(assets.config, assets.weights, local_rows(assets))
    p = TOK.encode("The red cat ")
    res = r.generate(p, 12)
    assert len(res.tokens) == 12 and res.hidden_tap.shape == (len(p) + 12, 128)
    assert res.hidden_tap.dtype == np.float32 and np.isfinite(res.hidden_tap).all()
    again = r.generate(p, 12, chunk=3)
    assert again.tokens == res.tokens
    assert np.allclose(again.hidden_tap, res.hidden_tap, atol=1e-5)
    assert r.identity == target_identity(assets.config, assets.weights)
    for bad, msg in [(([], 3), "empty"), (([999], 3), "outside"), ((p, -1), ">= 0"), ((p, 9000), "max_position")]:
        with pytest.raises(Dsv41Error, match=msg):
            r.generate(*bad)


def test_both_layers_fetched_together_equal_per_layer(cfg, weights, assets):
    """The engine asks its row source once per step for both Engram layers (``lookup_layers``);
    a source with only the protocol's default (one ``lookup`` per layer) gives the same output
    bit for bit as one that fetches the layers together."""

    per_layer, together = [], []

    class PerLayer(RowSource):  # lookup_layers: the protocol's default
        def __init__(self, inner):
            self.inner = inner

        def lookup(self, layer_id, rows, out=None):
            per_layer.append(layer_id)
            return self.inner.lookup(layer_id, rows, out=out)

        def counters(self):
            return self.inner.counters()

        def close(self):
            self.inner.close()

    class Together(PerLayer):
        def lookup_layers(self, layer_ids, rows, outs=None):
            together.append(list(layer_ids))
            return self.inner.lookup_layers(layer_ids, rows, outs)

    ids = TOK.encode("Every tiny tree opens this cold cat. count 3 4")
    a = TargetModel(cfg, weights, LocalComm(), PerLayer(local_rows(assets)))
    b = TargetModel(cfg, weights, LocalComm(), Together(local_rows(assets)))
    la = a.forward([(a.new_cache(64), ids)], [list(range(len(ids)))]).logits[0]
    assert per_layer == list(cfg.engram_layer_ids)
    per_layer.clear()
    lb = b.forward([(b.new_cache(64), ids)], [list(range(len(ids)))]).logits[0]
    assert torch.equal(la, lb)
    assert together == [list(cfg.engram_layer_ids)] and per_layer == []
