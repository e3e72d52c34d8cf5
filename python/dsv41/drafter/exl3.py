"""exllamav3 backend: drafting with an EXL3-quantised draft model on CUDA (``--backend exl3``).

The directory is an EXL3 model as exllamav3's own converter writes it (``config.json``,
``*.safetensors``, ``tokenizer.json``, ``quantization_config.json``) plus a sidecar
``dsv41_exl3.json`` ({"format": "dsv41-exl3-drafter", "target_identity", "hidden_size",
"n_ctx", "max_k", "top_n"}) that ties it to the target it drafts for. Loading uses exllamav3's
real API: ``Config.from_directory`` -> ``Model.from_config`` -> ``Cache(model, max_num_tokens)``
-> ``model.load(device)``; each item is drafted by one cached prefill of its last ``n_ctx``
tokens (``attn_mode`` "flash_attn", ``batch_shape`` (1, 256), ``past_len`` 0) and ``k - 1``
single-token forwards, choosing tokens from the top-32 distribution exactly as the torch backend
does (:mod:`dsv41.drafter.model`: argmax for T = 0, SplitMix64 uniforms for T > 0). The EXL3
draft model is token-only: it reads the context, not the target's hidden state.

Identities: drafter = sha256("dsv41-exl3/1" + sha256 of every file, in name order); Markov head =
sha256("dsv41-exl3-markov/none") (this backend has no separate Markov head); target from the
sidecar.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsv41 import fileio
from dsv41.engine.spec_decode import TOP_K
from dsv41.errors import ConfigError, Dsv41Error

SIDECAR = "dsv41_exl3.json"
FORMAT = "dsv41-exl3-drafter"
PAGE = 256  # exllamav3's cache page size: batch_shape max_seq_len must be a multiple of it


@dataclass
class Exl3Config:
    """What the worker's hello reports for this backend."""

    vocab_size: int
    hidden_size: int
    n_ctx: int = 64
    max_k: int = 7
    top_n: int = TOP_K
    target_identity: str = ""


def exl3_identities(model_dir: str | Path) -> dict:
    """Identities of an EXL3 drafter directory (see module docstring)."""
    d = Path(model_dir)
    files = sorted(p for p in d.iterdir() if p.is_file())
    if not files:
        raise ConfigError(f"exl3 drafter: {d} has no files")
    h = hashlib.sha256(b"dsv41-exl3/1")
    for p in files:
        fh = hashlib.sha256()
        with fileio.open_input(p, "exl3 drafter file", error=ConfigError) as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                fh.update(chunk)
        h.update(p.name.encode() + b"\0" + fh.digest())
    side = _sidecar(d)
    return {
        "drafter": h.hexdigest(),
        "markov": hashlib.sha256(b"dsv41-exl3-markov/none").hexdigest(),
        "target": side.get("target_identity", ""),
    }


def _sidecar(d: Path) -> dict:
    if not os.path.lexists(d / SIDECAR):
        raise ConfigError(f"exl3 drafter: {d / SIDECAR} not found (write it next to the EXL3 model)")
    try:
        side = fileio.loads_json(fileio.read_text(d / SIDECAR, "exl3 drafter sidecar", error=ConfigError))
    except ValueError as exc:
        raise ConfigError(f"exl3 drafter: cannot read {d / SIDECAR}: {exc}") from None
    if not isinstance(side, dict) or side.get("format") != FORMAT:
        raise ConfigError(f"exl3 drafter: {d / SIDECAR} is not a {FORMAT} file")
    return side


class Exl3Drafter:
    """The exl3 backend (same interface as :class:`dsv41.drafter.model.TorchDrafter`).

    Raises :class:`Dsv41Error` when exllamav3 or CUDA is missing, :class:`ConfigError` for a bad
    directory.
    """

    backend = "exl3"

    def __init__(self, model_dir: str | Path, device: str = "cuda", max_batch: int = 64) -> None:
        import torch

        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise Dsv41Error("drafter exl3 backend needs --device cuda and a CUDA GPU")
        try:
            from exllamav3 import Cache, Config, Model
        except ImportError as exc:
            raise Dsv41Error(f"drafter exl3 backend: exllamav3 is not installed ({exc})") from None
        d = Path(model_dir)
        side = _sidecar(d)
        self.ids = exl3_identities(d)
        self.torch = torch
        self.config = Config.from_directory(str(d))
        self.model = Model.from_config(self.config)
        n_ctx = int(side.get("n_ctx", 64))
        max_k = int(side.get("max_k", 7))
        self.max_seq = ((n_ctx + max_k + PAGE - 1) // PAGE) * PAGE
        self.cache = Cache(self.model, max_num_tokens=self.max_seq)
        self.model.load(device=device)
        self.cfg = Exl3Config(
            vocab_size=int(self.config.vocab_size),
            hidden_size=int(side["hidden_size"]),
            n_ctx=n_ctx,
            max_k=max_k,
            top_n=int(side.get("top_n", TOP_K)),
            target_identity=side.get("target_identity", ""),
        )
        self.max_batch = max_batch

    def _fwd(self, ids, past_len: int):
        params = {
            "attn_mode": "flash_attn",
            "cache": self.cache,
            "past_len": past_len,
            "batch_shape": (1, self.max_seq),
        }
        out = self.model.forward(ids, params)
        return out[0, -1, : self.cfg.vocab_size].float()

    def logits_no_cache(self, tokens: np.ndarray):
        """Last-position logits of ``tokens`` without the cache (``flash_attn_nc``): a reference
        for checking the cached drafting path."""
        ids = self.torch.from_numpy(np.asarray(tokens, np.int64))[None]
        out = self.model.forward(ids, {"attn_mode": "flash_attn_nc"})
        return out[0, -1, : self.cfg.vocab_size].float()

    def draft(self, items):
        """Draft for RoundItems; returns :class:`~dsv41.drafter.protocol.Drafts`."""
        from dsv41.drafter.model import draft_uniforms
        from dsv41.drafter.protocol import Drafts

        torch = self.torch
        cfg = self.cfg
        if len(items) > self.max_batch:
            raise Dsv41Error(f"drafter: batch of {len(items)} > max_batch {self.max_batch}")
        out_t, out_i, out_p = [], [], []
        with torch.inference_mode():
            for it in items:
                t = np.asarray(it.tokens, dtype=np.int64)
                if t.size == 0 or t.min() < 0 or t.max() >= cfg.vocab_size:
                    raise Dsv41Error(
                        f"drafter: request {it.request_id!r} has no tokens or ids outside 0..{cfg.vocab_size - 1}"
                    )
                k = min(int(it.depth), cfg.max_k)
                if k == 0:
                    out_t.append(np.zeros(0, np.int64))
                    out_i.append(np.zeros((0, cfg.top_n), np.int64))
                    out_p.append(np.zeros((0, cfg.top_n), np.float32))
                    continue
                tail = t[-cfg.n_ctx :]
                temp = float(np.float32(it.temperature))
                u = draft_uniforms(np.array([it.seed & 0xFFFFFFFFFFFFFFFF], np.uint64), np.array([it.context_len]), k)[
                    0
                ]
                logits = self._fwd(torch.from_numpy(tail)[None], 0)
                toks, ids, probs = [], [], []
                for i in range(k):
                    p = torch.softmax(logits / temp if temp > 0 else logits, -1)
                    tp, ti = torch.topk(p, cfg.top_n)
                    tp = tp / tp.sum()
                    j = 0
                    if temp > 0:
                        j = min(int((torch.cumsum(tp, 0) < float(u[i])).sum()), cfg.top_n - 1)
                    tok = int(ti[j])
                    toks.append(tok)
                    ids.append(ti.cpu().numpy())
                    probs.append(tp.cpu().numpy())
                    if i < k - 1:
                        logits = self._fwd(torch.tensor([[tok]], dtype=torch.long), tail.size + i)
                out_t.append(np.asarray(toks, np.int64))
                out_i.append(np.stack(ids).astype(np.int64))
                out_p.append(np.stack(probs).astype(np.float32))
        return Drafts(out_t, out_i, out_p, cfg.top_n)
