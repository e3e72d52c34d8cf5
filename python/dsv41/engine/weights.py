"""Weights of the lab target: names and shapes, deterministic init and training, safetensors
save/load, and the target identity.

Weights are deterministic from the config seed: :func:`init_weights` draws them with
``torch.Generator`` seeded by ``seed`` and then trains the backbone (Engram off) on the built-in
toy-grammar corpus (``corpus.py``) single-threaded for ``train_steps`` AdamW steps, so greedy
text is non-degenerate and a drafter has something learnable. Determinism holds for a given
torch build and CPU ISA (reduction order); :func:`target_identity` pins the exact bytes.
Stored float32 (``wkv`` values are FP8-E4M3 representable times a power-of-two scale, i.e. an
FP8 linear held in fp32).
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

from dsv41.engine.layers import apply_rope, rms_norm, rope_tables
from dsv41.engine.model_config import ModelConfig
from dsv41.errors import Dsv41Error


def weight_names(cfg: ModelConfig) -> list[str]:
    """All tensor names of the weights file, in file order."""
    names = ["embed.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if i in cfg.engram_layer_ids:
            names += [p + "engram.wkv.weight", p + "engram.q_weight", p + "engram.k_weight"]
        names += [
            p + n
            for n in (
                "hc_attn_pre",
                "hc_attn_post",
                "attn_norm.weight",
                "attn.wq.weight",
                "attn.wk.weight",
                "attn.wv.weight",
                "attn.wo.weight",
                "hc_ffn_pre",
                "hc_ffn_post",
                "ffn_norm.weight",
                "ffn.w1.weight",
                "ffn.w3.weight",
                "ffn.w2.weight",
            )
        ]
    return names + ["norm.weight", "head.weight"]


def _random_weights(cfg: ModelConfig):
    import torch

    g = torch.Generator().manual_seed(int(cfg.seed))
    H, F, hc, V = cfg.hidden_size, cfg.intermediate_size, cfg.hc_mult, cfg.vocab_size

    def rn(*shape, std):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    w: dict[str, Any] = {"embed.weight": rn(V, H, std=1.0)}
    out_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if i in cfg.engram_layer_ids:
            # FP8 linear: E4M3-representable values times a power-of-two scale, held in fp32.
            scale = 2.0 ** round(math.log2(cfg.engram_wkv_std))
            wkv = rn(5 * H, cfg.engram_dim, std=1.0).clamp(-448, 448).to(torch.float8_e4m3fn)
            w[p + "engram.wkv.weight"] = wkv.to(torch.float32) * scale
            w[p + "engram.q_weight"] = 1.0 + rn(hc, H, std=0.1)
            w[p + "engram.k_weight"] = 1.0 + rn(hc, H, std=0.1)
        w[p + "hc_attn_pre"] = rn(hc, std=0.1)
        w[p + "hc_attn_post"] = 1.0 + rn(hc, std=0.1)
        w[p + "attn_norm.weight"] = torch.ones(H)
        for n in ("wq", "wk", "wv"):
            w[p + f"attn.{n}.weight"] = rn(H, H, std=0.02 * 2)
        w[p + "attn.wo.weight"] = rn(H, H, std=out_std)
        w[p + "hc_ffn_pre"] = rn(hc, std=0.1)
        w[p + "hc_ffn_post"] = 1.0 + rn(hc, std=0.1)
        w[p + "ffn_norm.weight"] = torch.ones(H)
        w[p + "ffn.w1.weight"] = rn(F, H, std=0.04)
        w[p + "ffn.w3.weight"] = rn(F, H, std=0.04)
        w[p + "ffn.w2.weight"] = rn(H, F, std=out_std)
    w["norm.weight"] = torch.ones(H)
    w["head.weight"] = rn(V, H, std=0.04)
    return w


def train_forward(cfg: ModelConfig, w: dict, tokens):
    """Full-sequence forward without Engram (training); tokens int64[B, T] -> logits [B, T, V].

    Same math as :class:`dsv41.engine.model.TargetModel` with Engram's contribution at zero.
    """
    import torch
    import torch.nn.functional as F

    B, T = tokens.shape
    H, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    x = w["embed.weight"][tokens][:, :, None, :].expand(B, T, cfg.hc_mult, H)
    cos, sin = rope_tables(torch.arange(T), hd, cfg.rope_theta, x.dtype)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = (x * torch.softmax(w[p + "hc_attn_pre"], 0)[:, None]).sum(2)
        hn = rms_norm(h, w[p + "attn_norm.weight"], cfg.rms_norm_eps)
        q = (hn @ w[p + "attn.wq.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        k = (hn @ w[p + "attn.wk.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        v = (hn @ w[p + "attn.wv.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, T, H) @ w[p + "attn.wo.weight"].T
        x = x + w[p + "hc_attn_post"][:, None] * o[:, :, None, :]
        h = (x * torch.softmax(w[p + "hc_ffn_pre"], 0)[:, None]).sum(2)
        hn = rms_norm(h, w[p + "ffn_norm.weight"], cfg.rms_norm_eps)
        m = F.silu(hn @ w[p + "ffn.w1.weight"].T) * (hn @ w[p + "ffn.w3.weight"].T)
        x = x + w[p + "hc_ffn_post"][:, None] * (m @ w[p + "ffn.w2.weight"].T)[:, :, None, :]
    hf = rms_norm(x.mean(2), w["norm.weight"], cfg.rms_norm_eps)
    return hf @ w["head.weight"].T


def init_weights(cfg: ModelConfig, progress=None) -> tuple[dict, dict]:
    """Deterministic weights for ``cfg``: seeded init, then ``train_steps`` of training.

    Returns (name -> float32 CPU tensor, metadata dict with the final training loss in nats).
    Runs single-threaded (``torch.set_num_threads(1)``) so the result does not depend on the
    thread count. ``progress(step, loss)`` is called every 50 steps when given.
    """
    import torch

    from dsv41.engine.corpus import corpus_text
    from dsv41.tokenizer import ByteTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = _random_weights(cfg)
        data = torch.tensor(ByteTokenizer().encode(corpus_text(int(cfg.seed))), dtype=torch.int64)
        trainable = {k: v.requires_grad_(True) for k, v in w.items() if ".engram." not in k}
        opt = torch.optim.AdamW(list(trainable.values()), lr=cfg.train_lr, weight_decay=0.0, betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(int(cfg.seed) + 1)
        L, B = cfg.train_seq_len, cfg.train_batch
        loss_v = float("nan")
        for step in range(cfg.train_steps):
            lr = cfg.train_lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / max(1, cfg.train_steps)))
            for grp in opt.param_groups:
                grp["lr"] = lr
            starts = torch.randint(0, len(data) - L - 1, (B,), generator=g)
            batch = torch.stack([data[s : s + L + 1] for s in starts.tolist()])
            logits = train_forward(cfg, w, batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(trainable.values()), 1.0)
            opt.step()
            loss_v = float(loss.detach())
            if progress and step % 50 == 0:
                progress(step, loss_v)
        out = {k: v.detach().clone().contiguous() for k, v in w.items()}
    finally:
        torch.set_num_threads(threads)
    return out, {"train_final_loss": f"{loss_v:.4f}", "train_steps": str(cfg.train_steps)}


def save_weights(cfg: ModelConfig, weights: dict, meta: dict, out: str | os.PathLike) -> None:
    """Write ``weights`` to safetensors at ``out`` (atomic rename). Raises ``Dsv41Error`` on I/O."""
    from safetensors.torch import save_file

    from dsv41 import fileio

    out = Path(out)
    md = {"format": "dsv41-lab-target-v1", "seed": str(cfg.seed), **meta}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Dsv41Error(f"cannot write weights to {out}: {exc}") from None
    with fileio.atomic_path(out, "weights") as tmp:
        save_file({k: weights[k] for k in weight_names(cfg)}, str(tmp), metadata=md)


def load_weights(cfg: ModelConfig, path: str | os.PathLike) -> dict:
    """Read and check a weights file against ``cfg`` (names and shapes).

    Raises ``Dsv41Error`` when the file is missing, not safetensors, or does not match.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dsv41 import fileio

    p = Path(path)
    if not os.path.lexists(p):
        raise Dsv41Error(f"weights file {p} does not exist (run `dsv41 engine init-weights`)")
    fileio.check_input(p, "weights file")
    try:
        w = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        raise Dsv41Error(f"weights file {p} is not readable safetensors: {exc}") from None
    ref = _shapes(cfg)
    missing = [n for n in ref if n not in w]
    if missing:
        raise Dsv41Error(
            f"weights file {p} lacks {len(missing)} tensors (first: {missing[0]}); was it made for another config?"
        )
    for n, shape in ref.items():
        if tuple(w[n].shape) != shape:
            raise Dsv41Error(f"weights file {p}: {n} has shape {tuple(w[n].shape)}, config wants {shape}")
    return w


def _shapes(cfg: ModelConfig) -> dict[str, tuple]:
    H, F, hc, V = cfg.hidden_size, cfg.intermediate_size, cfg.hc_mult, cfg.vocab_size
    s: dict[str, tuple] = {"embed.weight": (V, H), "norm.weight": (H,), "head.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if i in cfg.engram_layer_ids:
            s[p + "engram.wkv.weight"] = (5 * H, cfg.engram_dim)
            s[p + "engram.q_weight"] = (hc, H)
            s[p + "engram.k_weight"] = (hc, H)
        for n in ("hc_attn_pre", "hc_attn_post", "hc_ffn_pre", "hc_ffn_post"):
            s[p + n] = (hc,)
        s[p + "attn_norm.weight"] = (H,)
        s[p + "ffn_norm.weight"] = (H,)
        for n in ("wq", "wk", "wv", "wo"):
            s[p + f"attn.{n}.weight"] = (H, H)
        s[p + "ffn.w1.weight"] = (F, H)
        s[p + "ffn.w3.weight"] = (F, H)
        s[p + "ffn.w2.weight"] = (H, F)
    return s


def target_identity(config_path: str | os.PathLike, weights_path: str | os.PathLike) -> str:
    """Hex sha256 over the config file bytes followed by the weights file bytes.

    Identifies the exact target a drafter was distilled against. Raises ``Dsv41Error`` if a file
    cannot be read.
    """
    h = hashlib.sha256()
    from dsv41 import fileio

    for p in (config_path, weights_path):
        with fileio.open_input(p) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
