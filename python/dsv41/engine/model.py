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

The config is :mod:`dsv41.engine.model_config`, the weights (init, training, save/load,
identity) :mod:`dsv41.engine.weights`; this module is the forward pass and its KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv41.engine.layers import apply_rope, rms_norm, rope_tables
from dsv41.engine.model_config import ENGRAM_HEAD_DIM, ModelConfig
from dsv41.errors import ConfigError, Dsv41Error
from dsv41.tokenizer import TOKEN_MAP

ENGRAM_EPS = 1e-20  # engram-spec.md section 7
# Rows per Engram layer up to which a step's row buffers are reused (4.3 MB each; decode steps and
# small prefill chunks); larger chunks get fresh arrays so nothing prefill-sized stays resident.
ENGRAM_BUF_ROWS = 16384


class SeqCache:
    """One request's state on one rank: KV cache and the tokens fed so far.

    ``k[layer]``/``v[layer]``: float64 ``[local_heads, capacity, head_dim]``; ``length``: tokens
    in the cache; ``tokens``: the fed tokens (the Engram hash window reads the last 3).
    """

    def __init__(self, n_layers: int, local_heads: int, head_dim: int, capacity: int, device) -> None:
        import torch

        cap = max(16, capacity)
        self.k = [torch.zeros(local_heads, cap, head_dim, dtype=torch.float64, device=device) for _ in range(n_layers)]
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
        hd = cfg.head_dim
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
                L["attn"].append(
                    tuple(W[p + f"attn.{n}.weight"][a:b].contiguous() for n in ("wq", "wk", "wv"))
                    + (W[p + "attn.wo.weight"][:, a:b].contiguous(),)
                )
                a, b = s * self.inter_per_shard, (s + 1) * self.inter_per_shard
                L["ffn"].append(
                    (
                        W[p + "ffn.w1.weight"][a:b].contiguous(),
                        W[p + "ffn.w3.weight"][a:b].contiguous(),
                        W[p + "ffn.w2.weight"][:, a:b].contiguous(),
                    )
                )
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
            tab = rope_tables(
                torch.arange(n, device=self.device), self.cfg.head_dim, self.cfg.rope_theta, torch.float64
            )
            self._rope_cache["tab"] = tab
        return tab[0][positions], tab[1][positions]

    def engram_rows(self, windows: list[list[int]], n_new: list[int]):
        """Global row ids int64 ``[N, n_layers, 24]`` for the new tokens of each item.

        ``windows[i]`` = up to 3 earlier tokens + the new ones; the first ``len - n_new`` rows
        of each window are dropped (their slots only look back inside the window, so this equals
        one-shot hashing of the whole sequence, engram-spec.md section 3).
        """
        out = []
        for win, n in zip(windows, n_new, strict=False):
            rows, _ = self.hasher.hash(np.asarray(win, dtype=np.int64))
            out.append(np.asarray(rows)[len(win) - n :])
        return np.concatenate(out, 0)

    def _engram_prefetch(self, rows_np) -> list | None:
        """Packed rows ``uint8[N, 264]`` of every Engram layer of this step, in one
        ``RowSource.lookup_layers`` call (one request for both layers over tcp protocol v2 or
        one NIXL READ; one lookup per layer locally); None when the model has no Engram layers."""
        if rows_np is None:
            return None
        lids = list(self.cfg.engram_layer_ids)
        ids = [
            np.ascontiguousarray(rows_np[:, li, self.col0 : self.col1].reshape(-1), dtype=np.int64)
            for li in range(len(lids))
        ]
        n = ids[0].shape[0]
        if n > ENGRAM_BUF_ROWS:  # a large prefill chunk: fresh arrays, nothing that size kept
            return self.rows.lookup_layers(lids, ids)
        if len(self._engram_bufs) != len(lids) or self._engram_bufs[0].shape[0] < n:
            # The rows are dequantized into new arrays before the next step, so one buffer per
            # layer is reused: no allocation per step, and the row source's buffer path.
            self._engram_bufs = [np.empty((max(n, 1024), 264), np.uint8) for _ in lids]
        return self.rows.lookup_layers(lids, ids, [b[:n] for b in self._engram_bufs])

    def _engram(self, li: int, L: dict, x, raw):
        """The spec's gate (engram-spec.md section 7) on x ``[N, hc, H]`` float64.

        ``raw``: this rank's columns ``[col0, col1)`` of Engram layer ``li``'s rows, packed
        ``uint8[N * (col1 - col0), 264]`` (:meth:`_engram_prefetch`); dequantizes them
        (reference convention), all-gathers the columns, then
        ``kv = wkv(emb)``: 4 keys + 1 value; ``gate_c = sigmoid(sign(dot)*sqrt(max(|dot|,1e-6)))``.
        """
        import torch

        from dsv41.engram.dequant import dequantize

        N = x.shape[0]
        H, hc = self.cfg.hidden_size, self.cfg.hc_mult
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
        value = kv[:, hc * H :]
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
    def forward(
        self, items: list[tuple[SeqCache, list[int]]], want: list[list[int]], logits: bool = True
    ) -> ForwardOut:
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
        pos = torch.cat(
            [torch.arange(c.length, c.length + n, device=self.device) for (c, _), n in zip(items, lens, strict=False)]
        )
        if int(pos.max()) >= cfg.max_position_embeddings:
            raise Dsv41Error(f"position {int(pos.max())} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        cos, sin = self._rope(pos)
        rows_np = None
        if self.hasher is not None:
            wins = [c.tokens[-3:] + list(t) for c, t in items]
            rows_np = self.engram_rows(wins, lens)
        raws = self._engram_prefetch(rows_np)
        for c, n in zip((c for c, _ in items), lens, strict=False):
            c.ensure(c.length + n)
        x = self.embed[toks][:, None, :].expand(N, hc, H).clone()
        offs = np.cumsum([0] + lens)
        taps = None
        for i, L in enumerate(self.layers):
            if "wkv" in L:
                li = cfg.engram_layer_ids.index(i)
                x = self._engram(li, L, x, raws[li])
            h = (x * L["hc_attn_pre"][None, :, None]).sum(1)
            hn = rms_norm(h, L["attn_norm.weight"], cfg.rms_norm_eps)
            parts = []
            hps = self.heads_per_shard
            for si, (wq, wk, wv, wo) in enumerate(L["attn"]):
                q = (hn @ wq.T).view(N, hps, hd).transpose(0, 1)
                k = (hn @ wk.T).view(N, hps, hd).transpose(0, 1)
                v = (hn @ wv.T).view(N, hps, hd).transpose(0, 1)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                o = torch.empty(hps, N, hd, dtype=torch.float64, device=self.device)
                hs = slice(si * hps, (si + 1) * hps)
                for j, (c, _) in enumerate(items):
                    a, b = int(offs[j]), int(offs[j + 1])
                    L0, n = c.length, b - a
                    c.k[i][hs, L0 : L0 + n] = k[:, a:b]
                    c.v[i][hs, L0 : L0 + n] = v[:, a:b]
                    K, Vv = c.k[i][hs, : L0 + n], c.v[i][hs, : L0 + n]
                    sc = (q[:, a:b] @ K.transpose(1, 2)) / math.sqrt(hd)
                    if n > 1:
                        mask = (
                            torch.arange(L0 + n, device=self.device)[None, :]
                            > (L0 + torch.arange(n, device=self.device))[:, None]
                        )
                        sc = sc.masked_fill(mask[None], float("-inf"))
                    o[:, a:b] = torch.softmax(sc, -1) @ Vv
                parts.append(o.transpose(0, 1).reshape(N, hps * hd) @ wo.T)
            out = self.comm.sum_shards(parts)
            x = x + L["hc_attn_post"][None, :, None] * out[:, None, :]
            h = (x * L["hc_ffn_pre"][None, :, None]).sum(1)
            hn = rms_norm(h, L["ffn_norm.weight"], cfg.rms_norm_eps)
            parts = [(F.silu(hn @ w1.T) * (hn @ w3.T)) @ w2.T for w1, w3, w2 in L["ffn"]]
            out = self.comm.sum_shards(parts)
            x = x + L["hc_ffn_post"][None, :, None] * out[:, None, :]
            if i == cfg.drafter_tap_layer:
                taps = x.mean(1)
        for (c, t), n in zip(items, lens, strict=False):
            c.length += n
            c.tokens.extend(int(v) for v in t)
        sel = torch.tensor(
            [int(offs[j]) + w for j, ws in enumerate(want) for w in ws], dtype=torch.int64, device=self.device
        )
        counts = [len(ws) for ws in want]
        tap_sel = taps[sel].to(torch.float32).cpu().split(counts)
        lg = None
        if logits:
            hf = rms_norm(x[sel].mean(1), self.norm, cfg.rms_norm_eps)
            lg = (hf @ self.head.T).to(torch.float32).cpu().split(counts)
        return ForwardOut(logits=list(lg) if lg is not None else [None] * len(items), taps=list(tap_sel))
