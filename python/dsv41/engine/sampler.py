"""Sampling rules of the engine: per-request :class:`SamplingParams`, logits processing, the
target distribution p (temperature, then min_p, top_k and nucleus top_p in vLLM's v1 sampler
order: ``vllm/v1/sample/sampler.py`` applies temperature, min_p, then top-k/top-p) and one
seeded draw. The speculative verifier uses the same p, so drafts never change the distribution.

Greedy below ``SAMPLING_EPS``; every draw uses the request's own ``torch.Generator`` (seeded per
request), so a seeded request gives the same tokens whatever its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.errors import Dsv41Error

# Temperatures below this are greedy: vLLM's ``_SAMPLING_EPS`` (vllm/sampling_params.py) does the
# same, and it keeps ``logits / temperature`` finite (1e-320 would overflow to inf -> NaN probs).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling: ``temperature`` (< ``SAMPLING_EPS`` = greedy), ``top_p`` in (0, 1],
    ``seed`` (None: a random seed), ``max_tokens`` >= 0, ``min_tokens`` (EOS suppressed before),
    ``ignore_eos``, ``top_k`` >= 0 (0 = off), ``min_p`` in [0, 1] (0 = off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    #: Keep the ``top_k`` most likely tokens; 0 (or vLLM's -1) = all (vLLM's convention).
    top_k: int = 0
    #: Keep tokens whose probability is at least ``min_p`` times the largest; 0 = all.
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: ``temperature < SAMPLING_EPS``, or ``top_k == 1`` (the
        distribution keeps one token: the argmax, as vLLM's top-k sampling does)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def process_logits(logits, params: SamplingParams, n_generated: int, eos_id: int):
    """Mask EOS while ``n_generated < min_tokens`` (or always with ``ignore_eos``).

    logits float32 ``[V]`` (not modified) -> float32 ``[V]``.
    """
    if params.ignore_eos or n_generated < params.min_tokens:
        logits = logits.clone()
        logits[eos_id] = float("-inf")
    return logits


def probs_of(logits, params: SamplingParams):
    """Target distribution p (float64 ``[V]``): softmax(logits / temperature); min_p keeps the
    tokens with ``p >= min_p * max(p)`` (Nguyen et al. 2024, vLLM's ``apply_min_p``); top_k the
    ``top_k`` largest (ties at the k-th value kept, as vLLM's mask by threshold does); then
    nucleus (top_p) truncation (Holtzman et al. 2019) keeping the smallest prefix of the sorted
    distribution whose mass reaches top_p; renormalised after each cut."""
    import torch

    p = torch.softmax(logits.to(torch.float64) / params.temperature, -1)
    if params.min_p > 0.0:
        p = torch.where(p >= params.min_p * p.max(), p, torch.zeros_like(p))
        p = p / p.sum()
    if 0 < params.top_k < p.numel():
        kth = torch.topk(p, params.top_k).values[-1]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
        p = p / p.sum()
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
