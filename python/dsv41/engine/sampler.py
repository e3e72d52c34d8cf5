"""Sampling rules of the engine: per-request :class:`SamplingParams`, logits processing, the
target distribution p (temperature, nucleus top_p) and one seeded draw.

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
