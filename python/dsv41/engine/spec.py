"""Speculation hook (docs/interfaces.md, "Speculation hook") and the sampling/verification rules.

The engine asks a :class:`Speculator` for drafts and verifies them itself with one multi-token
forward over ``[pending, d_0 .. d_{k-1}]`` (k+1 positions), then rolls the KV cache back to the
accepted length.

- ``DraftInput.token_ids``: every committed token of the request (prompt + generated, including
  the newest sampled token, which the target has not consumed yet); ``hidden``: the target's tap
  hidden (``drafter_tap_layer``, float32 ``[H]``) at position ``len(token_ids) - 2``, i.e. the
  position whose logits produced ``token_ids[-1]`` (the last position the target processed).
- Greedy verify (temperature 0): accept ``d_i`` while it equals the target argmax at position i,
  then emit the target's token at the first mismatch, or the bonus token (argmax after the last
  draft) when all are accepted. Output is identical to non-speculative greedy decoding.
- Sampled verify (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding", Algorithm 1): accept ``d_i`` with probability ``min(1, p(d_i)/q(d_i))`` where p is
  the target's (temperature/top_p-processed) distribution and q the drafter's, given as the sparse
  ``top_ids/top_probs``; on rejection sample from ``normalise(max(0, p - q))``; after all accepted
  sample the bonus from p. ``q(d_i) == 0`` is treated as ``p/q = inf`` (accept when p > 0). All
  draws use the request's own ``torch.Generator`` (seeded per request).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dsv41.errors import Dsv41Error

TOP_K = 32  # width of DraftProposal.top_ids/top_probs (docs/interfaces.md)
# Temperatures below this are greedy: vLLM's ``_SAMPLING_EPS`` (vllm/sampling_params.py) does the
# same, and it keeps ``logits / temperature`` finite (1e-320 would overflow to inf -> NaN probs).
SAMPLING_EPS = 1e-5


@dataclass
class DraftInput:
    """One request's drafting input: ``request_id``; ``token_ids`` int64 ``[L]``; ``hidden``
    float32 ``[H]``; ``depth``: the most drafts the engine will verify this round;
    ``temperature``: the request's (0.0 when greedy) and ``seed``: its effective sampling seed
    (the drafter samples its drafts from q when temperature > 0: sampled verification is exact
    only for drafts drawn from the q it reports, Leviathan et al. 2023, Algorithm 1)."""

    request_id: str
    token_ids: np.ndarray
    hidden: np.ndarray
    depth: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class DraftProposal:
    """Drafts for one request: ``tokens`` int64 ``[k]`` (k <= depth, may be 0); ``top_ids``
    int64 ``[k, 32]`` and ``top_probs`` float32 ``[k, 32]``: the drafter's distribution q at
    each draft position (ids outside the list have q = 0)."""

    tokens: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray


class Speculator(Protocol):
    """What the engine holds when speculation is on (implemented in ``dsv41.drafter``)."""

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        """One proposal per input, same order (engine thread, once per step). Raising, or a list
        of the wrong length, or a malformed proposal costs that round only (no drafts)."""
        ...

    def counters(self) -> dict:
        """Numeric counters shown in ``/metrics`` as ``dsv41_drafter_<key>`` (read at scrape,
        from the HTTP thread: must not block on the drafter)."""
        ...

    def close(self) -> None:
        """Release the drafter's resources (engine shutdown); must not raise."""
        ...


def draft_depth(env=os.environ) -> int:
    """``DSV41_DRAFTER_K`` (default 5); ``Dsv41Error`` when not a non-negative integer."""
    raw = env.get("DSV41_DRAFTER_K", "5") or "5"
    try:
        k = int(raw)
    except ValueError:
        raise Dsv41Error(f"DSV41_DRAFTER_K must be an integer, got {raw!r}") from None
    if not 0 <= k <= 64:
        raise Dsv41Error(f"DSV41_DRAFTER_K must be in [0, 64], got {k}")
    return k


def speculator_from_env(env, model_cfg: dict, target_identity: str, device: str):
    """Build the Speculator the environment asks for, or None when speculation is off.

    On when ``DSV41_DRAFTER_REMOTE`` or ``DSV41_DRAFTER_LOCAL`` is set (non-empty); then
    ``dsv41.drafter.spark.speculator_from_env(env, model_cfg=..., target_identity=...,
    device=...)`` builds it (``model_cfg`` is the model config dict). Raises ``Dsv41Error`` when
    the drafter package is not installed.
    """
    if not (env.get("DSV41_DRAFTER_REMOTE") or env.get("DSV41_DRAFTER_LOCAL")):
        return None
    try:
        from dsv41.drafter.spark import speculator_from_env as build
    except ModuleNotFoundError as exc:
        if exc.name and ("dsv41.drafter".startswith(exc.name) or exc.name.startswith("dsv41.drafter")):
            raise Dsv41Error("DSV41_DRAFTER_REMOTE/DSV41_DRAFTER_LOCAL is set but the drafter module "
                             "dsv41.drafter.spark is not installed") from None
        raise
    return build(env, model_cfg=model_cfg, target_identity=target_identity, device=device)


# ------------------------------------------------------------------------------ sampling


@dataclass
class SamplingParams:
    """Per-request sampling: ``temperature`` (< ``SAMPLING_EPS`` = greedy), ``top_p`` in (0, 1],
    ``seed`` (None: a random seed), ``max_tokens`` >= 0, ``min_tokens`` (EOS suppressed before),
    ``ignore_eos``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (``temperature < SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS


def process_logits(logits, params: SamplingParams, n_generated: int, eos_id: int):
    """Mask EOS while ``n_generated < min_tokens`` (or always with ``ignore_eos``).

    logits float32 ``[V]`` (not modified) -> float32 ``[V]``.
    """
    if params.ignore_eos or n_generated < params.min_tokens:
        logits = logits.clone()
        logits[eos_id] = float("-inf")
    return logits


def probs_of(logits, params: SamplingParams):
    """Target distribution p (float64 ``[V]``): softmax(logits / temperature), then nucleus
    (top_p) truncation (Holtzman et al. 2019) keeping the smallest prefix of the sorted
    distribution whose mass reaches top_p, renormalised."""
    import torch

    p = torch.softmax(logits.to(torch.float64) / params.temperature, -1)
    if params.top_p < 1.0:
        sp, idx = torch.sort(p, descending=True)
        cum = torch.cumsum(sp, 0)
        keep = (cum - sp) < params.top_p
        keep[0] = True
        mask = torch.zeros_like(p, dtype=torch.bool)
        mask[idx[keep]] = True
        p = torch.where(mask, p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def sample(p, gen) -> int:
    """One draw from probabilities ``p`` (``[V]``, any float dtype) with generator ``gen``.

    Raises ``Dsv41Error`` when ``p`` is not a distribution (non-finite, negative or all zero), so
    the engine ends only that request instead of hitting torch's opaque multinomial error."""
    import torch

    p = p.to(torch.float64)
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or not float(p.sum()) > 0.0:
        raise Dsv41Error("sampling distribution is not finite/normalisable (temperature/top_p too extreme?)")
    return int(torch.multinomial(p, 1, generator=gen))


def verify(logits, drafts: list[int], proposal: DraftProposal | None, params: SamplingParams,
           n_generated: int, eos_id: int, gen) -> tuple[list[int], int]:
    """Apply the verification rule to one request.

    ``logits`` float32 ``[k+1, V]`` (target at the pending token and after each draft);
    ``drafts`` the k proposed ids. Returns (emitted tokens, accepted draft count): emitted =
    accepted drafts + one target token (correction or bonus), so ``1 <= len(emitted) <= k+1``.
    """
    import torch

    out: list[int] = []
    k = len(drafts)
    for i in range(k + 1):
        lg = process_logits(logits[i], params, n_generated + i, eos_id)
        if params.greedy:
            t = int(torch.argmax(lg))
            if i < k and drafts[i] == t:
                out.append(t)
                continue
            out.append(t)
            return out, i
        p = probs_of(lg, params)
        if i == k:
            out.append(sample(p, gen))
            return out, k
        d = drafts[i]
        q_d = 0.0
        q = torch.zeros_like(p)
        if proposal is not None and len(proposal.top_ids) > i:
            ids = torch.as_tensor(np.asarray(proposal.top_ids[i], dtype=np.int64))
            qs = torch.as_tensor(np.asarray(proposal.top_probs[i], dtype=np.float64))
            ok = (ids >= 0) & (ids < p.numel())
            q.index_put_((ids[ok],), qs[ok], accumulate=True)
            q_d = float(q[d])
        p_d = float(p[d])
        ratio = 1.0 if q_d <= 0.0 and p_d > 0.0 else (p_d / q_d if q_d > 0 else 0.0)
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if u < min(1.0, ratio):
            out.append(d)
            continue
        r = (p - q).clamp_min(0.0)
        s = float(r.sum())
        out.append(sample(r / s if s > 0 else p, gen))
        return out, i
    raise AssertionError("unreachable")
