"""The DSpark-shaped drafter (torch reference backend): a few residual layers plus a Markov head.

Inputs per request: the target's hidden state at the tap layer (float32[H]) and the last
``n_ctx`` context tokens. Architecture (all matrices float32, stored in ``drafter.safetensors``):

* ``x0 = in_proj([rms(hidden) * in_norm ; embed(t[-n_ctx:]) flattened])`` (``d_model`` wide),
* ``n_layers`` pre-norm residual SiLU-MLP blocks,
* per draft step ``i``: ``logits_i = lm_head(rms(x_i) * out_norm) + markov_a[prev] @ markov_b``
  (the Markov head: low-rank bigram logits of the previous token, as in DSpark's drafter where a
  cheap first-order head corrects the state head), the draft token is chosen from the top-32
  distribution, then ``x_{i+1} = x_i + embed(tok_i)`` followed by one shared "step" block.

Draft choice: the top ``top_n`` (32) softmax(logits / T) probabilities are renormalised to sum
to 1 (these are the ``top_probs`` sent to the verifier, so q is exactly the distribution drafts are
drawn from); T = 0 picks the argmax, T > 0 inverts the CDF at a uniform ``u`` from a counter-based
generator (SplitMix64 of seed, context length and step, see :func:`draft_uniforms`), so drafts are
reproducible per seed, independent of batch composition and backend, and graph-capturable.

Identities (hex sha256): drafter = sha256(b"dsv41-drafter/1" + sha256(config json canonical) +
sha256(weights file)); Markov head = sha256(b"dsv41-markov/1" + vocab/rank + markov tensors).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dsv41 import fileio
from dsv41.engine.spec_decode import TOP_K
from dsv41.errors import ConfigError, Dsv41Error

CONFIG_NAME = "drafter.json"
WEIGHTS_NAME = "drafter.safetensors"
FORMAT = "dsv41-drafter"


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters (stored as ``drafter.json``).

    ``hidden_offset``: how many tokens before the end of the context the hidden state belongs
    to: 1 is the engine's convention (engine/spec_decode.py: the hidden at position ``len(tokens) - 2``,
    whose logits produced the newest token); training uses it so training and inference agree.
    """

    vocab_size: int
    hidden_size: int
    d_model: int = 128
    n_layers: int = 3
    n_ctx: int = 4
    markov_rank: int = 32
    max_k: int = 7
    top_n: int = TOP_K
    tap_layer: int = 0
    hidden_offset: int = 1
    rms_norm_eps: float = 1e-6
    seed: int = 0
    target_identity: str = ""
    train: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise :class:`ConfigError` on an inconsistent configuration."""
        for name in ("vocab_size", "hidden_size", "d_model", "n_layers", "n_ctx", "markov_rank", "max_k", "top_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"drafter config: {name} must be a positive integer, got {v!r}")
        if self.top_n > self.vocab_size:
            raise ConfigError(f"drafter config: top_n {self.top_n} > vocab_size {self.vocab_size}")
        if self.max_k > 64:
            raise ConfigError(f"drafter config: max_k {self.max_k} > 64")
        for name in ("tap_layer", "hidden_offset"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"drafter config: {name} must be a non-negative integer, got {v!r}")
        if not isinstance(self.rms_norm_eps, (int, float)) or not 0 < float(self.rms_norm_eps) < 1:
            raise ConfigError(f"drafter config: rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if self.target_identity and (
            not isinstance(self.target_identity, str)
            or len(self.target_identity) != 64
            or any(c not in "0123456789abcdef" for c in self.target_identity)
        ):
            raise ConfigError("drafter config: target_identity must be a lowercase hex sha256")

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys; what the drafter identity hashes)."""
        d = {"format": FORMAT, "version": 1, **asdict(self)}
        return fileio.dumps_json(d, sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        """Build and validate from a parsed ``drafter.json``; :class:`ConfigError` otherwise."""
        if d.get("format") != FORMAT:
            raise ConfigError(f"drafter config: format {d.get('format')!r} != {FORMAT!r}")
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("vocab_size", "hidden_size") if k not in d]
        if missing:
            raise ConfigError(f"drafter config: missing {', '.join(missing)}")
        try:
            cfg = cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as exc:
            raise ConfigError(f"drafter config: {exc}") from None
        cfg.validate()
        return cfg


def _sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014), vectorised over uint64."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def draft_uniforms(seeds: np.ndarray, ctx_lens: np.ndarray, k: int) -> np.ndarray:
    """Uniforms in [0, 1) for sampled drafting: float64[B, k].

    ``u[b, i] = splitmix64(splitmix64(seed_b) ^ (ctx_len_b * 2^20 + i)) / 2^64`` (53 top bits),
    so the i-th draft after a given context length is the same draw in every run and batch.
    """
    seeds = np.asarray(seeds, dtype=np.uint64).reshape(-1, 1)
    ctx = np.asarray(ctx_lens, dtype=np.uint64).reshape(-1, 1)
    steps = np.arange(k, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        x = _splitmix64(_splitmix64(seeds) ^ (ctx * np.uint64(1 << 20) + steps))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _torch():
    import torch

    return torch


def pick_step(lg, u_i, top_n: int):
    """One draft step's choice, shared by the one-card and the two-card drafter (their drafts are
    identical because this is one function). ``lg``: float32[B, V] logits already scaled by the
    inverse temperature; ``u_i``: float32[B, 1] uniforms (0 = argmax); ``top_n``: kept ids.
    Returns ``(tok int64[B], top_ids int64[B, top_n], top_probs float32[B, top_n])``, the top-n
    probabilities renormalised and descending."""
    torch = _torch()
    p = torch.softmax(lg, dim=-1)
    tp, ti = torch.topk(p, top_n, dim=-1)
    tp = tp / tp.sum(-1, keepdim=True)
    j = (torch.cumsum(tp, dim=-1) < u_i).sum(-1).clamp(max=top_n - 1)
    return ti.gather(1, j[:, None]).squeeze(1), ti, tp


def build_model(cfg: DrafterConfig):
    """Return a freshly initialised :class:`DrafterModel` (deterministic from ``cfg.seed``)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(cfg.seed)
    return DrafterModel(cfg, gen)


def _make_module_class():
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        """Pre-norm residual SiLU MLP: ``x + down(silu(up(rms(x) * w)))``."""

        def __init__(self, d: int, eps: float, gen) -> None:
            super().__init__()
            self.norm = nn.Parameter(torch.ones(d))
            self.up = nn.Parameter(torch.randn(2 * d, d, generator=gen) / math.sqrt(d))
            self.down = nn.Parameter(torch.randn(d, 2 * d, generator=gen) / math.sqrt(2 * d) * 0.5)
            self.eps = eps

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
            return x + torch.nn.functional.silu(h @ self.up.t()) @ self.down.t()

    class DrafterModel(nn.Module):
        """See the module docstring. ``forward`` is the teacher-forced training path;
        :meth:`draft` is inference."""

        def __init__(self, cfg: DrafterConfig, gen) -> None:
            super().__init__()
            d, v, h = cfg.d_model, cfg.vocab_size, cfg.hidden_size
            self.cfg = cfg
            self.embed = nn.Parameter(torch.randn(v, d, generator=gen) * 0.5)
            self.in_norm = nn.Parameter(torch.ones(h))
            self.in_proj = nn.Parameter(torch.randn(d, h + cfg.n_ctx * d, generator=gen) / math.sqrt(h + cfg.n_ctx * d))
            self.layers = nn.ModuleList([Block(d, cfg.rms_norm_eps, gen) for _ in range(cfg.n_layers)])
            self.step = Block(d, cfg.rms_norm_eps, gen)
            self.out_norm = nn.Parameter(torch.ones(d))
            self.lm_head = nn.Parameter(torch.randn(v, d, generator=gen) / math.sqrt(d))
            self.markov_a = nn.Parameter(torch.randn(v, cfg.markov_rank, generator=gen) * 0.1)
            self.markov_b = nn.Parameter(torch.randn(cfg.markov_rank, v, generator=gen) * 0.1)

        def _rms(self, x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * w

        def encode(self, hidden, ctx):
            """hidden float32[B, H], ctx int64[B, n_ctx] -> state float32[B, d]."""
            e = self.embed[ctx].reshape(ctx.shape[0], -1)
            x = torch.cat([self._rms(hidden, self.in_norm), e], dim=-1) @ self.in_proj.t()
            for blk in self.layers:
                x = blk(x)
            return x

        def logits(self, x, prev):
            """state [B, d], prev int64[B] -> logits float32[B, V] (state head + Markov head)."""
            return self._rms(x, self.out_norm) @ self.lm_head.t() + self.markov_a[prev] @ self.markov_b

        def advance(self, x, tok):
            return self.step(x + self.embed[tok])

        def forward(self, hidden, ctx, targets):
            """Teacher-forced logits for ``targets`` int64[B, k]: returns float32[B, k, V]."""
            x = self.encode(hidden, ctx)
            prev = ctx[:, -1]
            out = []
            for i in range(targets.shape[1]):
                out.append(self.logits(x, prev))
                prev = targets[:, i]
                x = self.advance(x, prev)
            return torch.stack(out, dim=1)

        def draft(self, hidden, ctx, inv_temp, u, k: int, top_n: int):
            """Draft ``k`` tokens for a batch.

            hidden float32[B, H]; ctx int64[B, n_ctx]; inv_temp float32[B] (1 for greedy);
            u float32[B, k] uniforms (0 = argmax). Returns tokens int64[B, k], top_ids
            int64[B, k, top_n], top_probs float32[B, k, top_n] (renormalised, descending).
            """
            x = self.encode(hidden, ctx)
            prev = ctx[:, -1]
            toks, ids, probs = [], [], []
            for i in range(k):
                tok, ti, tp = pick_step(self.logits(x, prev) * inv_temp[:, None], u[:, i : i + 1], top_n)
                toks.append(tok)
                ids.append(ti)
                probs.append(tp)
                prev = tok
                x = self.advance(x, tok)
            return torch.stack(toks, 1), torch.stack(ids, 1), torch.stack(probs, 1)

    return DrafterModel


_MODEL_CLS = None


def DrafterModel(cfg: DrafterConfig, gen=None):  # noqa: N802 - a lazily defined torch class
    """Construct the drafter ``torch.nn.Module`` (torch imported lazily)."""
    global _MODEL_CLS
    if _MODEL_CLS is None:
        _MODEL_CLS = _make_module_class()
    torch = _torch()
    if gen is None:
        gen = torch.Generator().manual_seed(cfg.seed)
    return _MODEL_CLS(cfg, gen)


# ----------------------------------------------------------------------------------------------
# files and identities

MARKOV_TENSORS = ("markov_a", "markov_b")


def save_drafter(model, cfg: DrafterConfig, out_dir: str | os.PathLike) -> dict:
    """Write ``drafter.json`` + ``drafter.safetensors`` into ``out_dir``; returns identities."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tensors = {k: v.detach().to("cpu", dtype=_torch().float32).contiguous() for k, v in model.state_dict().items()}
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Dsv41Error(f"drafter: cannot write {out}: {exc}") from None
    # both staged before either is renamed: a full disk leaves the old pair, never a mixed one
    with fileio.atomic_path(out / WEIGHTS_NAME, "drafter weights") as tmp_w:
        save_file(tensors, str(tmp_w), metadata={"format": FORMAT})
        staged_cfg = fileio.stage(out / CONFIG_NAME, cfg.to_json() + "\n", "drafter config")
    staged_cfg.commit()
    return identities(out)


def load_config(drafter_dir: str | os.PathLike) -> DrafterConfig:
    """Read and validate ``DIR/drafter.json``; :class:`ConfigError` when missing or invalid."""

    p = Path(drafter_dir) / CONFIG_NAME
    if not os.path.lexists(p):
        raise ConfigError(f"drafter: {p} not found (expected a directory made by `dsv41 drafter train`)")
    d = fileio.read_json(p, "drafter config", error=ConfigError)
    if not isinstance(d, dict):
        raise ConfigError(f"drafter: {p} is not a JSON object")
    return DrafterConfig.from_dict(d)


def _file_sha(path: Path) -> bytes:

    h = hashlib.sha256()
    if not os.path.lexists(path):
        raise ConfigError(f"drafter: {path} not found")
    with fileio.open_input(path, "drafter file", error=ConfigError) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()


def identities(drafter_dir: str | os.PathLike) -> dict:
    """Identities of a drafter directory: ``{"drafter", "markov", "target"}`` hex sha256 strings.

    ``target`` is the target identity recorded at training time ("" when none).
    Raises :class:`ConfigError` for missing/invalid files.
    """
    d = Path(drafter_dir)
    cfg = load_config(d)

    canon = fileio.dumps_json(
        fileio.read_json(d / CONFIG_NAME, "drafter config", error=ConfigError), sort_keys=True, separators=(",", ":")
    ).encode()
    fileio.check_input(d / WEIGHTS_NAME, "drafter weights", error=ConfigError)
    drafter = hashlib.sha256(b"dsv41-drafter/1" + _sha(canon) + _file_sha(d / WEIGHTS_NAME)).hexdigest()
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(d / WEIGHTS_NAME))
    except Exception as exc:  # safetensors raises its own error types
        raise ConfigError(f"drafter: cannot read {d / WEIGHTS_NAME}: {exc}") from None
    h = hashlib.sha256(b"dsv41-markov/1")
    h.update(f"{cfg.vocab_size}:{cfg.markov_rank}".encode())
    for name in MARKOV_TENSORS:
        if name not in tensors:
            raise ConfigError(f"drafter: {d / WEIGHTS_NAME} lacks tensor {name}")
        h.update(np.ascontiguousarray(tensors[name], "<f4").tobytes())
    return {"drafter": drafter, "markov": h.hexdigest(), "target": cfg.target_identity}


def load_model(drafter_dir: str | os.PathLike, device: str = "cpu"):
    """Load (config, model in eval mode on ``device``); :class:`ConfigError` on bad files."""
    from safetensors.torch import load_file

    cfg = load_config(drafter_dir)
    model = DrafterModel(cfg)
    if os.path.lexists(Path(drafter_dir) / WEIGHTS_NAME):
        fileio.check_input(Path(drafter_dir) / WEIGHTS_NAME, "drafter weights", error=ConfigError)
    try:
        sd = load_file(str(Path(drafter_dir) / WEIGHTS_NAME))
    except FileNotFoundError:
        raise ConfigError(f"drafter: {Path(drafter_dir) / WEIGHTS_NAME} not found") from None
    except Exception as exc:
        raise ConfigError(f"drafter: cannot read weights: {exc}") from None
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"drafter: weights do not match drafter.json: {str(exc).splitlines()[0]}") from None
    model.eval().requires_grad_(False)
    return cfg, model.to(device)


def round_arrays(cfg: DrafterConfig, items):
    """The arrays one drafting round computes on, from its RoundItems (every backend, one recipe).

    Returns ``(ctx int64[B, n_ctx] (left-padded with 0), hidden float32[B, H], inv_temp float32[B]
    (1 for greedy), u float32[B, k] (0 for greedy), k = max depth capped at max_k)``. Raises
    :class:`Dsv41Error` for an item without tokens or with token ids outside the vocabulary.
    """
    b = len(items)
    ctx = np.zeros((b, cfg.n_ctx), dtype=np.int64)
    hid = np.zeros((b, cfg.hidden_size), dtype=np.float32)
    inv_t = np.ones(b, dtype=np.float32)
    k = max(min(it.depth, cfg.max_k) for it in items)
    seeds = np.zeros(b, dtype=np.uint64)
    lens = np.zeros(b, dtype=np.uint64)
    temps = np.zeros(b, dtype=np.float64)
    for i, it in enumerate(items):
        t = np.asarray(it.tokens, dtype=np.int64)
        if t.size == 0:
            raise Dsv41Error(f"drafter: request {it.request_id!r} has no context tokens")
        if t.min() < 0 or t.max() >= cfg.vocab_size:
            raise Dsv41Error(f"drafter: request {it.request_id!r} has token ids outside 0..{cfg.vocab_size - 1}")
        tail = t[-cfg.n_ctx :]
        ctx[i, cfg.n_ctx - tail.size :] = tail
        hid[i] = it.hidden
        # float32 first: the wire carries f32, so local and remote drafting see one value.
        temp32 = np.float32(it.temperature)
        if temp32 > 0:
            inv_t[i] = np.float32(1.0) / temp32
        seeds[i] = np.uint64(it.seed & 0xFFFFFFFFFFFFFFFF)
        lens[i] = it.context_len
        temps[i] = temp32
    u = draft_uniforms(seeds, lens, max(k, 1)).astype(np.float32)
    u[temps == 0] = 0.0
    return ctx, hid, inv_t, u, k


def drafts_of(cfg: DrafterConfig, items, toks, ids, probs):
    """Cut a batch's drafts (numpy ``toks[B, k]``, ``ids[B, k, top_n]``, ``probs[B, k, top_n]``) to
    each item's own depth; returns :class:`~dsv41.drafter.protocol.Drafts`."""
    from dsv41.drafter.protocol import Drafts

    out_t, out_i, out_p = [], [], []
    for i, it in enumerate(items):
        d = min(it.depth, cfg.max_k)
        out_t.append(toks[i, :d].astype(np.int64))
        out_i.append(ids[i, :d].astype(np.int64))
        out_p.append(probs[i, :d].astype(np.float32))
    return Drafts(out_t, out_i, out_p, cfg.top_n)


# ----------------------------------------------------------------------------------------------
# the torch backend the worker and the local speculator use


class TorchDrafter:
    """Batch drafting with the torch model (CPU or CUDA; CUDA graphs optional on CUDA).

    :meth:`draft` takes :class:`dsv41.drafter.protocol.RoundItem` objects and returns a
    :class:`dsv41.drafter.protocol.Drafts`. Batches are padded to a power-of-two bucket and a
    depth of ``max(depth)`` so that each (bucket, depth) pair can be captured once as a CUDA graph.
    """

    backend = "torch"

    def __init__(
        self, drafter_dir: str | os.PathLike, device: str = "cpu", cuda_graphs: bool = False, max_batch: int = 64
    ) -> None:
        torch = _torch()
        self.torch = torch
        if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise Dsv41Error(f"drafter: device {device!r}: expected cpu, cuda or cuda:N")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise Dsv41Error("drafter: --device cuda requested but CUDA is not available")
        self.cfg, self.model = load_model(drafter_dir, device)
        self.ids = identities(drafter_dir)
        self.device = torch.device(device)
        self.cuda_graphs = bool(cuda_graphs and self.device.type == "cuda")
        if cuda_graphs and self.device.type != "cuda":
            raise Dsv41Error("drafter: CUDA graphs need --device cuda")
        self.max_batch = max_batch
        self._graphs: dict = {}

    @staticmethod
    def _bucket(n: int) -> int:
        b = 1
        while b < n:
            b *= 2
        return b

    def draft(self, items):
        """Draft for a batch of RoundItems; returns :class:`~dsv41.drafter.protocol.Drafts`."""
        from dsv41.drafter.protocol import Drafts

        torch = self.torch
        top_n = self.cfg.top_n
        if not items:
            return Drafts([], [], [], top_n)
        if len(items) > self.max_batch:
            raise Dsv41Error(f"drafter: batch of {len(items)} > max_batch {self.max_batch}")
        ctx, hid, inv_t, u, k = round_arrays(self.cfg, items)
        if k == 0:
            z = np.zeros(0, np.int64)
            return Drafts(
                [z] * len(items),
                [np.zeros((0, top_n), np.int64)] * len(items),
                [np.zeros((0, top_n), np.float32)] * len(items),
                top_n,
            )
        with torch.inference_mode():
            if self.cuda_graphs:
                toks, ids, probs = self._draft_graph(ctx, hid, inv_t, u, k)
            else:
                dev = self.device
                toks, ids, probs = self.model.draft(
                    torch.from_numpy(hid).to(dev),
                    torch.from_numpy(ctx).to(dev),
                    torch.from_numpy(inv_t).to(dev),
                    torch.from_numpy(u).to(dev),
                    k,
                    top_n,
                )
            toks, ids, probs = toks.cpu().numpy(), ids.cpu().numpy(), probs.cpu().numpy()
        return drafts_of(self.cfg, items, toks, ids, probs)

    def _draft_graph(self, ctx, hid, inv_t, u, k):
        """Replay (capturing on first use) a CUDA graph for this (batch bucket, k)."""
        torch = self.torch
        b = ctx.shape[0]
        bb = self._bucket(b)
        key = (bb, k)
        g = self._graphs.get(key)
        if g is None:
            dev = self.device
            st = {
                "hid": torch.zeros(bb, self.cfg.hidden_size, device=dev),
                "ctx": torch.zeros(bb, self.cfg.n_ctx, dtype=torch.int64, device=dev),
                "inv": torch.ones(bb, device=dev),
                "u": torch.zeros(bb, k, device=dev),
            }
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up outside capture, as torch.cuda.graphs docs advise
                    self.model.draft(st["hid"], st["ctx"], st["inv"], st["u"], k, self.cfg.top_n)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                st["out"] = self.model.draft(st["hid"], st["ctx"], st["inv"], st["u"], k, self.cfg.top_n)
            g = self._graphs[key] = (graph, st)
        graph, st = g
        st["hid"][:b].copy_(torch.from_numpy(hid))
        st["ctx"][:b].copy_(torch.from_numpy(ctx))
        st["inv"][:b].copy_(torch.from_numpy(inv_t))
        st["u"][:b].copy_(torch.from_numpy(u[:, :k]))
        graph.replay()
        toks, ids, probs = st["out"]
        return toks[:b], ids[:b], probs[:b]


def random_drafter(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int,
    hidden_size: int,
    seed: int = 0,
    target_identity: str = "",
    **overrides,
) -> dict:
    """Write an untrained (seeded) drafter to ``out_dir``; returns its identities.

    For tests, benchmarks of round latency and fault drills, where draft quality does not matter.
    """
    cfg = DrafterConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, seed=seed, target_identity=target_identity, **overrides
    )
    cfg.validate()
    return save_drafter(DrafterModel(cfg), cfg, out_dir)
