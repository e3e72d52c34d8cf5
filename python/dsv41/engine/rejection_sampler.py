"""Verification of drafts against the target (rejection sampling), one request at a time.

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

import numpy as np

from dsv41.engine.sampler import SamplingParams, probs_of, process_logits, sample
from dsv41.engine.spec_decode import DraftProposal


def verify(
    logits,
    drafts: list[int],
    proposal: DraftProposal | None,
    params: SamplingParams,
    n_generated: int,
    eos_id: int,
    gen,
) -> tuple[list[int], int]:
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
