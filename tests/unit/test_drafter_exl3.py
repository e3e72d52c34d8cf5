"""The exllamav3 (EXL3) backend.

CPU part (always): sidecar and identities, clear refusals. GPU part (only with CUDA, exllamav3 and
transformers importable and ``DSV41_EXL3_BUILD=1``; run on the H200): a tiny Llama-architecture
model is made locally (random weights, seeded, with a byte-level tokenizer matching the lab's),
quantised to EXL3 by exllamav3's own converter, loaded through Config/Model/Cache and drafted
with; round latency for k = 1..7 is written to ``$OUT/drafter_exl3.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dsv41.drafter.exl3 import SIDECAR, exl3_identities
from dsv41.drafter.protocol import RoundItem
from dsv41.errors import ConfigError, Dsv41Error

TARGET = "ab" * 32


def _sidecar(d: Path, **kw):
    side = {
        "format": "dsv41-exl3-drafter",
        "target_identity": TARGET,
        "hidden_size": 128,
        "n_ctx": 64,
        "max_k": 7,
        "top_n": 32,
        **kw,
    }
    (d / SIDECAR).write_text(json.dumps(side))


def test_identities_and_sidecar_errors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError, match="not found"):
        exl3_identities(tmp_path)
    _sidecar(tmp_path)
    ids = exl3_identities(tmp_path)
    assert ids["target"] == TARGET and len(ids["drafter"]) == 64
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert exl3_identities(tmp_path)["drafter"] != ids["drafter"]
    (tmp_path / SIDECAR).write_text(json.dumps({"format": "x"}))
    with pytest.raises(ConfigError, match="not a"):
        exl3_identities(tmp_path)


def test_backend_refuses_without_cuda(tmp_path):
    import torch

    from dsv41.drafter.exl3 import Exl3Drafter

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(Dsv41Error, match="needs --device cuda"):
        Exl3Drafter(tmp_path)


def _gpu_ready() -> bool:
    if os.environ.get("DSV41_EXL3_BUILD") != "1":
        return False
    try:
        import exllamav3  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _byte_tokenizer(path: Path) -> None:
    """tokenizer.json: the lab's byte-level ids (0-3 specials, byte b -> b + 4), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # bytes_to_unicode order: map each byte value to its printable stand-in
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    b2u = {b: chr(c) for b, c in zip(bs, cs, strict=False)}
    assert set(b2u.values()) == set(alphabet)
    vocab = {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2, "<|sep|>": 3}
    vocab.update({b2u[b]: b + 4 for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>", "<|sep|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"})
    )


@pytest.fixture(scope="module")
def exl3_dir(tmp_path_factory):
    if not _gpu_ready():
        pytest.skip("needs CUDA, exllamav3, transformers and DSV41_EXL3_BUILD=1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tmp_path_factory.mktemp("exl3")
    hf, out, work = base / "hf", base / "exl3", base / "work"
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=260,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float16)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked distributions: argmax robust to quantisation noise
    model.save_pretrained(str(hf), safe_serialization=True)
    _byte_tokenizer(hf)
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "exllamav3.conversion.convert_model",
            "-i",
            str(hf),
            "-o",
            str(out),
            "-w",
            str(work),
            "-b",
            "4",
            "-hb",
            "16",
            "-cr",
            "8",
            "-cc",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    print(f"convert: rc={r.returncode} in {time.monotonic() - t0:.1f} s\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    assert r.returncode == 0 and (out / "config.json").exists(), r.stdout[-2000:] + r.stderr[-2000:]
    _sidecar(out, hidden_size=128)
    return out


def _items(rng, n, depth, temp=0.0):
    return [
        RoundItem(f"r{i}", rng.integers(4, 260, 20 + i), np.zeros(128, np.float32), depth, temp, 5 + i)
        for i in range(n)
    ]


def test_exl3_drafts_and_latency(exl3_dir):
    import torch

    from dsv41.drafter.client import DrafterClient
    from dsv41.drafter.exl3 import Exl3Drafter
    from dsv41.drafter.protocol import Round
    from dsv41.drafter.worker import DrafterWorker

    d = Exl3Drafter(exl3_dir)
    rng = np.random.default_rng(1)
    items = _items(rng, 3, 5)
    a, b = d.draft(items), d.draft(items)
    for i in range(3):
        assert a.tokens[i].shape == (5,)
        np.testing.assert_array_equal(a.tokens[i], b.tokens[i])
        np.testing.assert_array_equal(a.tokens[i], a.top_ids[i][:, 0])
        np.testing.assert_allclose(a.top_probs[i].sum(-1), 1.0, rtol=1e-4)
    # the cached drafting path agrees with exllamav3's no-cache forward on the same context
    for it, toks in zip(items, a.tokens, strict=False):
        ctx = np.concatenate([it.tokens, toks[:2]])
        ref = d.logits_no_cache(ctx)
        assert int(torch.argmax(ref)) == int(toks[2])
    sampled = _items(np.random.default_rng(7), 2, 4, temp=1.0)
    s1, s2 = d.draft(sampled), d.draft(sampled)  # reproducible per seed
    for x, y, ids in zip(s1.tokens, s2.tokens, s1.top_ids, strict=False):
        np.testing.assert_array_equal(x, y)
        assert x.shape == (4,) and all(t in row for t, row in zip(x, ids, strict=False))
    # served over TCP by the worker with the exl3 backend
    w = DrafterWorker(d, target_identity=TARGET)
    w.start()
    rows = []
    try:
        c = DrafterClient(f"tcp://127.0.0.1:{w.address[1]}", exl3_identities(exl3_dir), timeout_ms=10000)
        got = c.round(Round(items, 128))
        for x, y in zip(got.tokens, a.tokens, strict=False):
            np.testing.assert_array_equal(x, y)
        for k in range(1, 8):
            one = _items(rng, 1, k)
            for _ in range(5):
                d.draft(one)
            ts = []
            for _ in range(50):
                t0 = time.perf_counter()
                d.draft(one)
                ts.append((time.perf_counter() - t0) * 1000)
            tcp = []
            r = Round(one, 128)
            for _ in range(50):
                t0 = time.perf_counter()
                c.round(r)
                tcp.append((time.perf_counter() - t0) * 1000)
            rows.append(
                {
                    "k": k,
                    "backend_p50_ms": round(float(np.median(ts)), 3),
                    "tcp_round_p50_ms": round(float(np.median(tcp)), 3),
                }
            )
        c.close()
    finally:
        w.stop()
    print(json.dumps(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "drafter_exl3.json").write_text(
            json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1)
        )
