"""The speculative-decoding hook between the engine and a drafter (docs/interfaces.md,
"Speculation hook"), named as vLLM names it (``vllm/v1/spec_decode``).

Both sides import this module and nothing of each other: the engine holds a :class:`Speculator`,
``dsv41.drafter`` implements it, and only a composition root (``dsv41.entrypoints``) knows both.

The engine asks a :class:`Speculator` for drafts and verifies them itself
(:mod:`dsv41.engine.rejection_sampler`) with one multi-token forward over
``[pending, d_0 .. d_{k-1}]`` (k+1 positions), then rolls the KV cache back to the accepted
length.

- ``DraftInput.token_ids``: every committed token of the request (prompt + generated, including
  the newest sampled token, which the target has not consumed yet); ``hidden``: the target's tap
  hidden (``drafter_tap_layer``, float32 ``[H]``) at position ``len(token_ids) - 2``, i.e. the
  position whose logits produced ``token_ids[-1]`` (the last position the target processed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

#: Width of ``DraftProposal.top_ids/top_probs`` and of the drafter wire format's top-k lists: the
#: drafter's distribution q is sent as its 32 most likely ids (docs/interfaces.md).
TOP_K = 32


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
    int64 ``[k, TOP_K]`` and ``top_probs`` float32 ``[k, TOP_K]``: the drafter's distribution q at
    each draft position (ids outside the list have q = 0)."""

    tokens: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray


#: ``Speculator.counters()`` keys that are levels, not counts: they can go down (the proxy process
#: is up 1/0; the ring's proxy state, an enum value, -1 when unreadable), so ``/metrics`` exports
#: them as gauges ``dsv41_drafter_<key>``; a counter that went down would read as a reset to
#: Prometheus' ``rate``/``increase``. Every other key is monotonic since start.
LEVEL_KEYS = frozenset({"proxy_up", "proxy_state", "proxy_memlock"})


class Speculator(Protocol):
    """What the engine holds when speculation is on (implemented in ``dsv41.drafter``)."""

    def propose(self, batch: list[DraftInput]) -> list[DraftProposal]:
        """One proposal per input, same order (engine thread, once per step). Raising, or a list
        of the wrong length, or a malformed proposal costs that round only (no drafts)."""
        ...

    def counters(self) -> dict:
        """Numeric counters shown in ``/metrics`` as ``dsv41_drafter_<key>`` (read at scrape,
        from the HTTP thread: must not block on the drafter). Monotonic since start, except the
        levels named in :data:`LEVEL_KEYS` and maxima (``*max*``)."""
        ...

    def close(self) -> None:
        """Release the drafter's resources (engine shutdown); must not raise."""
        ...
