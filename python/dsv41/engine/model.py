"""The lab target model: a small DSV41-shaped decoder with the real Engram data path.

Architecture (per layer ``i`` of ``num_hidden_layers``), residual stream ``x`` of shape
``[N, hc_mult, H]`` (``hc_mult`` hyper-connection copies, engram-spec.md section 7):

1. at Engram layers (``engram_layer_ids``): the spec's gate, before the attention block
   (:meth:`TargetModel._engram`);
2. ``h = sum_c softmax(hc_attn_pre)[c] * x[c]``; ``x[c] += hc_attn_post[c] * Attn(RMSNorm(h))``
   (causal multi-head attention with RoPE and a KV cache);
3. ``h = sum_c softmax(hc_ffn_pre)[c] * x[c]``; ``x[c] += hc_ffn_post[c] * SwiGLU(RMSNorm(h))``;

then ``logits = head(RMSNorm(mean_c x[c]))``. The drafter tap (``drafter_tap_layer``) is
``mean_c x[c]`` after that layer, float32.

Numerics: weights are stored float32 (``wkv`` values are FP8-E4M3 representable times a
power-of-two scale, i.e. an FP8 linear held in fp32); inference runs in float64. Tensor
parallelism splits attention heads and the MLP's intermediate dimension into ``tp_shards``
fixed virtual shards; every run (TP1 or TP2) computes each shard's partial output with the same
shapes and sums the shards in shard order (see ``tp.Comm.sum_shards``), so TP1 and TP2 give the
same bits. float64 keeps batch composition (GEMM vs GEMV paths) from moving a greedy argmax.

Weights are deterministic from the config seed: ``init_weights`` draws them with
``torch.Generator`` seeded by ``seed`` and then trains the backbone (Engram off) on the built-in
toy-grammar corpus (``corpus.py``) single-threaded for ``train_steps`` AdamW steps, so greedy
text is non-degenerate and a drafter has something learnable. Determinism holds for a given
torch build and CPU ISA (reduction order); ``target_identity`` pins the exact bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsv41.errors import ConfigError, Dsv41Error
from dsv41.engine.tokenizer import TOKEN_MAP, VOCAB_SIZE

_REQUIRED = ["seed", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "hc_mult", "rms_norm_eps", "max_position_embeddings",
             "engram_layer_ids", "drafter_tap_layer"]
ENGRAM_COLUMNS = 24  # 3 orders x 8 heads (engram-spec.md section 2)
ENGRAM_HEAD_DIM = 256
ROW_BYTES = 264
ENGRAM_EPS = 1e-20  # engram-spec.md section 7
# Rows per Engram layer up to which a step's row buffers are reused (4.3 MB each; decode steps and
# small prefill chunks); larger chunks get fresh arrays so nothing prefill-sized stays resident.
ENGRAM_BUF_ROWS = 16384


@dataclass
class ModelConfig:
    """Model keys of ``lab_model.json`` (engram keys are read by ``dsv41.engram``).

    ``raw`` keeps the whole JSON dict (what ``EngramLayout.from_config`` takes).
    """

    seed: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hc_mult: int
    rms_norm_eps: float
    max_position_embeddings: int
    engram_layer_ids: list[int]
    drafter_tap_layer: int
    rope_theta: float = 10000.0
    tp_shards: int = 2
    train_steps: int = 200
    train_batch: int = 16
    train_seq_len: int = 64
    train_lr: float = 4e-3
    engram_wkv_std: float = 5e-7
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def head_dim(self) -> int:
        """Per-head width: hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    @property
    def engram_dim(self) -> int:
        """Engram row width in values: 24 columns x 256 = 6144 (docs/engram-spec.md)."""
        return ENGRAM_COLUMNS * ENGRAM_HEAD_DIM  # 6144


def load_config(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
    """Read and check the model config.

    Accepts a path to JSON or a dict (flat, or nested under ``text_config``). Raises
    ``ConfigError`` naming the missing or inconsistent key.
    """
    if isinstance(path_or_dict, dict):
        raw = dict(path_or_dict)
    else:
        p = Path(path_or_dict)
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"model config {p} does not exist") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"model config {p} is not readable JSON: {exc}") from None
    if isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"model config lacks keys: {', '.join(missing)}")
    kw = {k: raw[k] for k in ModelConfig.__dataclass_fields__ if k in raw and k != "raw"}
    try:
        cfg = ModelConfig(**kw, raw=raw)
    except TypeError as exc:
        raise ConfigError(f"model config: {exc}") from None
    if cfg.vocab_size != VOCAB_SIZE:
        raise ConfigError(f"vocab_size must be {VOCAB_SIZE} (byte tokenizer), got {cfg.vocab_size}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError("hidden_size must be divisible by num_attention_heads")
    if cfg.head_dim % 2:
        raise ConfigError("head_dim must be even (RoPE)")
    if cfg.num_attention_heads % cfg.tp_shards or cfg.intermediate_size % cfg.tp_shards:
        raise ConfigError("num_attention_heads and intermediate_size must be divisible by tp_shards")
    if not 0 <= cfg.drafter_tap_layer < cfg.num_hidden_layers:
        raise ConfigError("drafter_tap_layer must name a layer in [0, num_hidden_layers)")
    for lid in cfg.engram_layer_ids:
        if not 0 <= lid < cfg.num_hidden_layers:
            raise ConfigError(f"engram layer {lid} is outside [0, num_hidden_layers)")
    if int(raw.get("engram_pad_token_id", 2)) != int(TOKEN_MAP[2]):
        raise ConfigError("engram_pad_token_id must be 2 (the tokenizer's pad id)")
    return cfg


# ----------------------------------------------------------------------------------- weights


def weight_names(cfg: ModelConfig) -> list[str]:
    """All tensor names of the weights file, in file order."""
    names = ["embed.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        if i in cfg.engram_layer_ids:
            names += [p + "engram.wkv.weight", p + "engram.q_weight", p + "engram.k_weight"]
        names += [p + n for n in ("hc_attn_pre", "hc_attn_post", "attn_norm.weight", "attn.wq.weight",
                                  "attn.wk.weight", "attn.wv.weight", "attn.wo.weight", "hc_ffn_pre",
                                  "hc_ffn_post", "ffn_norm.weight", "ffn.w1.weight", "ffn.w3.weight",
                                  "ffn.w2.weight")]
    return names + ["norm.weight", "head.weight"]


def _random_weights(cfg: ModelConfig):
    import torch

    g = torch.Generator().manual_seed(int(cfg.seed))
    H, I, hc, V = cfg.hidden_size, cfg.intermediate_size, cfg.hc_mult, cfg.vocab_size

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
        w[p + "ffn.w1.weight"] = rn(I, H, std=0.04)
        w[p + "ffn.w3.weight"] = rn(I, H, std=0.04)
        w[p + "ffn.w2.weight"] = rn(H, I, std=out_std)
    w["norm.weight"] = torch.ones(H)
    w["head.weight"] = rn(V, H, std=0.04)
    return w


def _rope(positions, head_dim: int, theta: float, dtype):
    """cos/sin tables ``[T, head_dim/2]`` for integer positions (RoFormer, Su et al. 2021)."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def _apply_rope(x, cos, sin):
    """Rotate pairs (even, odd) of the last dim; x ``[..., T, D]``, cos/sin ``[T, D/2]``."""
    import torch

    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _rms(x, w, eps: float):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def train_forward(cfg: ModelConfig, w: dict, tokens):
    """Full-sequence forward without Engram (training); tokens int64[B, T] -> logits [B, T, V].

    Same math as :class:`TargetModel` with Engram's contribution at zero.
    """
    import torch
    import torch.nn.functional as F

    B, T = tokens.shape
    H, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    x = w["embed.weight"][tokens][:, :, None, :].expand(B, T, cfg.hc_mult, H)
    cos, sin = _rope(torch.arange(T), hd, cfg.rope_theta, x.dtype)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = (x * torch.softmax(w[p + "hc_attn_pre"], 0)[:, None]).sum(2)
        hn = _rms(h, w[p + "attn_norm.weight"], cfg.rms_norm_eps)
        q = (hn @ w[p + "attn.wq.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        k = (hn @ w[p + "attn.wk.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        v = (hn @ w[p + "attn.wv.weight"].T).view(B, T, nh, hd).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, T, H) @ w[p + "attn.wo.weight"].T
        x = x + w[p + "hc_attn_post"][:, None] * o[:, :, None, :]
        h = (x * torch.softmax(w[p + "hc_ffn_pre"], 0)[:, None]).sum(2)
        hn = _rms(h, w[p + "ffn_norm.weight"], cfg.rms_norm_eps)
        m = F.silu(hn @ w[p + "ffn.w1.weight"].T) * (hn @ w[p + "ffn.w3.weight"].T)
        x = x + w[p + "hc_ffn_post"][:, None] * (m @ w[p + "ffn.w2.weight"].T)[:, :, None, :]
    hf = _rms(x.mean(2), w["norm.weight"], cfg.rms_norm_eps)
    return hf @ w["head.weight"].T


def init_weights(cfg: ModelConfig, progress=None) -> tuple[dict, dict]:
    """Deterministic weights for ``cfg``: seeded init, then ``train_steps`` of training.

    Returns (name -> float32 CPU tensor, metadata dict with the final training loss in nats).
    Runs single-threaded (``torch.set_num_threads(1)``) so the result does not depend on the
    thread count. ``progress(step, loss)`` is called every 50 steps when given.
    """
    import torch

    from dsv41.engine.corpus import corpus_text
    from dsv41.engine.tokenizer import ByteTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = _random_weights(cfg)
        data = torch.tensor(ByteTokenizer().encode(corpus_text(int(cfg.seed))), dtype=torch.int64)
        trainable = {k: v.requires_grad_(True) for k, v in w.items() if ".engram." not in k}
        opt = torch.optim.AdamW(list(trainable.values()), lr=cfg.train_lr, weight_decay=0.0,
                                betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(int(cfg.seed) + 1)
        L, B = cfg.train_seq_len, cfg.train_batch
        loss_v = float("nan")
        for step in range(cfg.train_steps):
            lr = cfg.train_lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / max(1, cfg.train_steps)))
            for grp in opt.param_groups:
                grp["lr"] = lr
            starts = torch.randint(0, len(data) - L - 1, (B,), generator=g)
            batch = torch.stack([data[s:s + L + 1] for s in starts.tolist()])
            logits = train_forward(cfg, w, batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     batch[:, 1:].reshape(-1))
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

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    md = {"format": "dsv41-lab-target-v1", "seed": str(cfg.seed), **meta}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: weights[k] for k in weight_names(cfg)}, str(tmp), metadata=md)
        os.replace(tmp, out)
    except OSError as exc:
        raise Dsv41Error(f"cannot write weights to {out}: {exc}") from None


def load_weights(cfg: ModelConfig, path: str | os.PathLike) -> dict:
    """Read and check a weights file against ``cfg`` (names and shapes).

    Raises ``Dsv41Error`` when the file is missing, not safetensors, or does not match.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise Dsv41Error(f"weights file {p} does not exist (run `dsv41 engine init-weights`)")
    try:
        w = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        raise Dsv41Error(f"weights file {p} is not readable safetensors: {exc}") from None
    ref = _shapes(cfg)
    missing = [n for n in ref if n not in w]
    if missing:
        raise Dsv41Error(f"weights file {p} lacks {len(missing)} tensors (first: {missing[0]}); "
                         "was it made for another config?")
    for n, shape in ref.items():
        if tuple(w[n].shape) != shape:
            raise Dsv41Error(f"weights file {p}: {n} has shape {tuple(w[n].shape)}, config wants {shape}")
    return w


def _shapes(cfg: ModelConfig) -> dict[str, tuple]:
    H, I, hc, V = cfg.hidden_size, cfg.intermediate_size, cfg.hc_mult, cfg.vocab_size
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
        s[p + "ffn.w1.weight"] = (I, H)
        s[p + "ffn.w3.weight"] = (I, H)
        s[p + "ffn.w2.weight"] = (H, I)
    return s


def target_identity(config_path: str | os.PathLike, weights_path: str | os.PathLike) -> str:
    """Hex sha256 over the config file bytes followed by the weights file bytes.

    Identifies the exact target a drafter was distilled against. Raises ``Dsv41Error`` if a file
    cannot be read.
    """
    h = hashlib.sha256()
    for p in (config_path, weights_path):
        try:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as exc:
            raise Dsv41Error(f"cannot read {p}: {exc}") from None
    return h.hexdigest()


# ----------------------------------------------------------------------------------- inference


class SeqCache:
    """One request's state on one rank: KV cache and the tokens fed so far.

    ``k[layer]``/``v[layer]``: float64 ``[local_heads, capacity, head_dim]``; ``length``: tokens
    in the cache; ``tokens``: the fed tokens (the Engram hash window reads the last 3).
    """

    def __init__(self, n_layers: int, local_heads: int, head_dim: int, capacity: int, device) -> None:
        import torch

        cap = max(16, capacity)
        self.k = [torch.zeros(local_heads, cap, head_dim, dtype=torch.float64, device=device)
                  for _ in range(n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0
        self.tokens: list[int] = []

    def ensure(self, n: int) -> None:
        """Grow capacity (doubling) to hold at least ``n`` tokens."""
        import torch

        cap = self.k[0].shape[1]
        if n <= cap:
            return
        new = max(n, 2 * cap)
        for lst in (self.k, self.v):
            for i, t in enumerate(lst):
                g = torch.zeros(t.shape[0], new, t.shape[2], dtype=t.dtype, device=t.device)
                g[:, :cap] = t
                lst[i] = g

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` tokens (speculation rejection)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n
        del self.tokens[n:]


@dataclass
class ForwardOut:
    """Per-item outputs of one forward: ``logits[i]`` float32 ``[len(want[i]), V]`` (None when
    logits were not requested), ``taps[i]`` float32 ``[len(want[i]), H]``."""

    logits: list
    taps: list


class TargetModel:
    """The inference model for one rank of a TP group.

    ``TargetModel(cfg, weights, comm, row_source, device)``: ``comm`` is a ``tp.Comm`` (rank,
    tp, collectives); ``row_source`` implements ``dsv41.engram.rowsource.RowSource`` and is
    asked only for this rank's columns (``EngramLayout.columns_for_rank``).
    """

    def __init__(self, cfg: ModelConfig, weights: dict, comm, row_source, device: str = "cpu") -> None:
        import torch

        self.cfg, self.comm, self.rows, self.device = cfg, comm, row_source, torch.device(device)
        if cfg.tp_shards % comm.tp:
            raise ConfigError(f"tp={comm.tp} must divide tp_shards={cfg.tp_shards}")
        S = cfg.tp_shards
        per = S // comm.tp
        self.shards = list(range(comm.rank * per, (comm.rank + 1) * per))
        self.heads_per_shard = cfg.num_attention_heads // S
        self.local_heads = self.heads_per_shard * per
        self.inter_per_shard = cfg.intermediate_size // S
        dt = torch.float64
        W = {k: v.to(device=self.device, dtype=dt) for k, v in weights.items()}
        H, hd = cfg.hidden_size, cfg.head_dim
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            L: dict[str, Any] = {}
            for n in ("hc_attn_pre", "hc_ffn_pre"):
                L[n] = torch.softmax(W[p + n], 0)
            for n in ("hc_attn_post", "hc_ffn_post", "attn_norm.weight", "ffn_norm.weight"):
                L[n] = W[p + n]
            L["attn"] = []
            L["ffn"] = []
            for s in self.shards:
                a, b = s * self.heads_per_shard * hd, (s + 1) * self.heads_per_shard * hd
                L["attn"].append(tuple(W[p + f"attn.{n}.weight"][a:b].contiguous() for n in ("wq", "wk", "wv"))
                                 + (W[p + "attn.wo.weight"][:, a:b].contiguous(),))
                a, b = s * self.inter_per_shard, (s + 1) * self.inter_per_shard
                L["ffn"].append((W[p + "ffn.w1.weight"][a:b].contiguous(), W[p + "ffn.w3.weight"][a:b].contiguous(),
                                 W[p + "ffn.w2.weight"][:, a:b].contiguous()))
            if i in cfg.engram_layer_ids:
                L["wkv"] = W[p + "engram.wkv.weight"]
                L["qk"] = W[p + "engram.q_weight"] * W[p + "engram.k_weight"]
            self.layers.append(L)
        self.embed = W["embed.weight"]
        self.norm = W["norm.weight"]
        self.head = W["head.weight"]
        self._rope_cache: dict = {}
        self._engram_bufs: list = []  # per Engram layer: reused staging buffer for decode-size steps
        self.layout = None
        self.hasher = None
        if cfg.engram_layer_ids:
            from dsv41.engram.hashing import NgramHasher
            from dsv41.engram.layout import EngramLayout

            self.layout = EngramLayout.from_config(cfg.raw)
            if list(self.layout.layer_ids) != list(cfg.engram_layer_ids):
                raise ConfigError("engram layout layer ids differ from the model's engram_layer_ids")
            self.hasher = NgramHasher(self.layout, TOKEN_MAP)
            self.col0, self.col1 = self.layout.columns_for_rank(comm.tp, comm.rank)
        self.engram_stats = {"scale_bytes_0": 0, "scale_bytes_255": 0, "nonfinite_values": 0}

    # -- caches
    def new_cache(self, capacity: int) -> SeqCache:
        """An empty KV cache for one sequence of at most ``capacity`` tokens (this rank's heads)."""
        return SeqCache(self.cfg.num_hidden_layers, self.local_heads, self.cfg.head_dim, capacity, self.device)

    # -- pieces
    def _rope(self, positions):
        import torch

        key = int(positions.max()) + 1 if positions.numel() else 0
        tab = self._rope_cache.get("tab")
        if tab is None or tab[0].shape[0] < key:
            n = max(key, 1024, 2 * (tab[0].shape[0] if tab else 0))
            tab = _rope(torch.arange(n, device=self.device), self.cfg.head_dim, self.cfg.rope_theta, torch.float64)
            self._rope_cache["tab"] = tab
        return tab[0][positions], tab[1][positions]

    def engram_rows(self, windows: list[list[int]], n_new: list[int]):
        """Global row ids int64 ``[N, n_layers, 24]`` for the new tokens of each item.

        ``windows[i]`` = up to 3 earlier tokens + the new ones; the first ``len - n_new`` rows
        of each window are dropped (their slots only look back inside the window, so this equals
        one-shot hashing of the whole sequence, engram-spec.md section 3).
        """
        out = []
        for win, n in zip(windows, n_new):
            rows, _ = self.hasher.hash(np.asarray(win, dtype=np.int64))
            out.append(np.asarray(rows)[len(win) - n:])
        return np.concatenate(out, 0)

    def _engram_prefetch(self, rows_np) -> list | None:
        """Packed rows of every Engram layer of this step, fetched together where the row
        source can (``lookup_layers``: one request for both layers over tcp protocol v2 or one
        NIXL READ); None when it cannot (``_engram`` then looks each layer up itself)."""
        both = getattr(self.rows, "lookup_layers", None)
        if both is None or rows_np is None:
            return None
        lids = list(self.cfg.engram_layer_ids)
        ids = [np.ascontiguousarray(rows_np[:, li, self.col0:self.col1].reshape(-1), dtype=np.int64)
               for li in range(len(lids))]
        n = ids[0].shape[0]
        if n > ENGRAM_BUF_ROWS:  # a large prefill chunk: fresh arrays, nothing that size kept
            return both(lids, ids)
        if len(self._engram_bufs) != len(lids) or self._engram_bufs[0].shape[0] < n:
            # The rows are dequantized into new arrays before the next step, so one buffer per
            # layer is reused: no allocation per step, and the row source's buffer path.
            self._engram_bufs = [np.empty((max(n, 1024), 264), np.uint8) for _ in lids]
        return both(lids, ids, [b[:n] for b in self._engram_bufs])

    def _engram(self, li: int, L: dict, x, rows_np, raw=None):
        """The spec's gate (engram-spec.md section 7) on x ``[N, hc, H]`` float64.

        Looks up this rank's columns ``[col0, col1)`` of ``rows_np[:, li]`` through the row
        source, dequantizes (reference convention), all-gathers the columns, then
        ``kv = wkv(emb)``: 4 keys + 1 value; ``gate_c = sigmoid(sign(dot)*sqrt(max(|dot|,1e-6)))``.
        """
        import torch

        from dsv41.engram.tables import dequantize

        N = x.shape[0]
        H, hc = self.cfg.hidden_size, self.cfg.hc_mult
        lid = self.cfg.engram_layer_ids[li]
        if raw is None:
            ids = np.ascontiguousarray(rows_np[:, li, self.col0:self.col1].reshape(-1), dtype=np.int64)
            raw = self.rows.lookup(lid, ids)
        with np.errstate(over="ignore", invalid="ignore"):  # scale byte 255 -> NaN by convention
            vals, counts = dequantize(np.asarray(raw), convention="reference")
        self._count_scales(counts)
        vals = torch.as_tensor(vals).to(device=self.device, dtype=torch.float64)
        # Reference convention decodes scale byte 255 as NaN (engram-spec.md section 4); a NaN
        # would poison the whole residual stream, so non-finite values are zeroed and counted.
        bad = ~torch.isfinite(vals)
        nbad = int(bad.sum())
        if nbad:
            self.engram_stats["nonfinite_values"] += nbad
            vals = vals.masked_fill(bad, 0.0)
        local = vals.reshape(N, (self.col1 - self.col0) * ENGRAM_HEAD_DIM)
        emb = self.comm.gather_cols(local)  # [N, 6144], columns in rank order
        kv = emb @ L["wkv"].T
        keys = kv[:, : hc * H].view(N, hc, H)
        value = kv[:, hc * H:]
        dot = (x * L["qk"][None] * keys).sum(-1)
        dot = dot * torch.rsqrt(x.pow(2).mean(-1) + ENGRAM_EPS) * torch.rsqrt(keys.pow(2).mean(-1) + ENGRAM_EPS)
        dot = dot / math.sqrt(H)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        return x + gate[:, :, None] * value[:, None, :]

    def _count_scales(self, counts) -> None:
        """Add ``dequantize``'s special scale-byte counts (0 and 255) to ``engram_stats``."""
        if isinstance(counts, dict):
            z = counts.get("scale_zero", 0)
            f = counts.get("scale_255", 0)
        else:
            z, f = counts
        self.engram_stats["scale_bytes_0"] += int(z)
        self.engram_stats["scale_bytes_255"] += int(f)

    # -- forward
    def forward(self, items: list[tuple[SeqCache, list[int]]], want: list[list[int]],
                logits: bool = True) -> ForwardOut:
        """Run new tokens of several requests through the model, appending to their caches.

        ``items[i] = (cache, new_tokens)``; ``want[i]`` = indices into ``new_tokens`` whose
        logits/taps are returned. Every rank of the TP group must call this with the same items
        in the same order (collectives inside). ``logits=False`` skips the LM head (rank 1).
        """
        import torch
        import torch.nn.functional as F

        cfg = self.cfg
        H, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
        lens = [len(t) for _, t in items]
        N = sum(lens)
        toks = torch.tensor([t for _, ts in items for t in ts], dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(c.length, c.length + n, device=self.device) for (c, _), n in zip(items, lens)])
        if int(pos.max()) >= cfg.max_position_embeddings:
            raise Dsv41Error(f"position {int(pos.max())} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        cos, sin = self._rope(pos)
        rows_np = None
        if self.hasher is not None:
            wins = [c.tokens[-3:] + list(t) for c, t in items]
            rows_np = self.engram_rows(wins, lens)
        raws = self._engram_prefetch(rows_np)
        for c, n in zip((c for c, _ in items), lens):
            c.ensure(c.length + n)
        x = self.embed[toks][:, None, :].expand(N, hc, H).clone()
        offs = np.cumsum([0] + lens)
        taps = None
        for i, L in enumerate(self.layers):
            if "wkv" in L:
                li = cfg.engram_layer_ids.index(i)
                x = self._engram(li, L, x, rows_np, None if raws is None else raws[li])
            h = (x * L["hc_attn_pre"][None, :, None]).sum(1)
            hn = _rms(h, L["attn_norm.weight"], cfg.rms_norm_eps)
            parts = []
            hps = self.heads_per_shard
            for si, (wq, wk, wv, wo) in enumerate(L["attn"]):
                q = (hn @ wq.T).view(N, hps, hd).transpose(0, 1)
                k = (hn @ wk.T).view(N, hps, hd).transpose(0, 1)
                v = (hn @ wv.T).view(N, hps, hd).transpose(0, 1)
                q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
                o = torch.empty(hps, N, hd, dtype=torch.float64, device=self.device)
                hs = slice(si * hps, (si + 1) * hps)
                for j, (c, _) in enumerate(items):
                    a, b = int(offs[j]), int(offs[j + 1])
                    L0, n = c.length, b - a
                    c.k[i][hs, L0:L0 + n] = k[:, a:b]
                    c.v[i][hs, L0:L0 + n] = v[:, a:b]
                    K, Vv = c.k[i][hs, : L0 + n], c.v[i][hs, : L0 + n]
                    sc = (q[:, a:b] @ K.transpose(1, 2)) / math.sqrt(hd)
                    if n > 1:
                        mask = torch.arange(L0 + n, device=self.device)[None, :] > (L0 + torch.arange(n, device=self.device))[:, None]
                        sc = sc.masked_fill(mask[None], float("-inf"))
                    o[:, a:b] = torch.softmax(sc, -1) @ Vv
                parts.append(o.transpose(0, 1).reshape(N, hps * hd) @ wo.T)
            out = self.comm.sum_shards(parts)
            x = x + L["hc_attn_post"][None, :, None] * out[:, None, :]
            h = (x * L["hc_ffn_pre"][None, :, None]).sum(1)
            hn = _rms(h, L["ffn_norm.weight"], cfg.rms_norm_eps)
            parts = [(F.silu(hn @ w1.T) * (hn @ w3.T)) @ w2.T for w1, w3, w2 in L["ffn"]]
            out = self.comm.sum_shards(parts)
            x = x + L["hc_ffn_post"][None, :, None] * out[:, None, :]
            if i == cfg.drafter_tap_layer:
                taps = x.mean(1)
        for (c, t), n in zip(items, lens):
            c.length += n
            c.tokens.extend(int(v) for v in t)
        sel = torch.tensor([int(offs[j]) + w for j, ws in enumerate(want) for w in ws], dtype=torch.int64,
                           device=self.device)
        counts = [len(ws) for ws in want]
        tap_sel = taps[sel].to(torch.float32).cpu().split(counts)
        lg = None
        if logits:
            hf = _rms(x[sel].mean(1), self.norm, cfg.rms_norm_eps)
            lg = (hf @ self.head.T).to(torch.float32).cpu().split(counts)
        return ForwardOut(logits=list(lg) if lg is not None else [None] * len(items), taps=list(tap_sel))
