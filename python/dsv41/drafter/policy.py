"""Batch-aware depth policy: fewer drafts per request as the batch grows.

Rationale (docs/drafter.md): verification cost grows with batch x (k + 1) tokens while the
chance that the last drafts are accepted falls geometrically, so deep drafting pays at batch 1 and
not at large batches. The production stack drafts 5 tokens with batch-aware depth
(stack-overview.txt, "five draft tokens with batch-aware depth").

Policy string (``DSV41_DRAFTER_DEPTH_POLICY``): comma-separated ``MAXBATCH:DEPTH`` steps in
ascending MAXBATCH, the last one may be ``*:DEPTH``; e.g. the default ``1:5,2:4,4:3,8:2,*:1``
means batch 1 -> 5, batch 2 -> 4, 3..4 -> 3, 5..8 -> 2, larger -> 1. Depth is then capped by
``k`` (``DSV41_DRAFTER_K``) and by each request's own asked depth.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dsv41.errors import ConfigError

DEFAULT_POLICY = "1:5,2:4,4:3,8:2,*:1"
log = logging.getLogger("dsv41.drafter.policy")


@dataclass(frozen=True)
class DepthPolicy:
    """``steps``: ((max_batch or None for '*'), depth) pairs; ``k``: global cap."""

    steps: tuple[tuple[int | None, int], ...]
    k: int = 5

    @classmethod
    def parse(cls, text: str | None, k: int = 5) -> DepthPolicy:
        """Parse a policy string; :class:`ConfigError` on bad syntax, order or values."""
        if not isinstance(k, int) or not 0 <= k <= 64:
            raise ConfigError(f"drafter depth policy: k={k!r} must be an integer in 0..64")
        text = (text or DEFAULT_POLICY).strip()
        steps: list[tuple[int | None, int]] = []
        last = 0
        for part in text.split(","):
            mb, sep, dp = part.strip().partition(":")
            if not sep:
                raise ConfigError(f"drafter depth policy {text!r}: step {part!r} is not MAXBATCH:DEPTH")
            if steps and steps[-1][0] is None:
                raise ConfigError(f"drafter depth policy {text!r}: '*' must be the last step")
            try:
                depth = int(dp)
                maxb = None if mb.strip() == "*" else int(mb)
            except ValueError:
                raise ConfigError(f"drafter depth policy {text!r}: step {part!r} is not MAXBATCH:DEPTH") from None
            if depth < 0 or depth > 64 or (maxb is not None and maxb <= last):
                raise ConfigError(f"drafter depth policy {text!r}: batches must ascend and depths be 0..64")
            if maxb is not None:
                last = maxb
            steps.append((maxb, depth))
        return cls(tuple(steps), k)

    def depth(self, batch_size: int) -> int:
        """Drafts per request for a batch of ``batch_size`` (0 beyond the last finite step
        when there is no ``*`` step)."""
        for maxb, d in self.steps:
            if maxb is None or batch_size <= maxb:
                return min(d, self.k)
        return 0

    def apply(self, batch_size: int, asked: list[int]) -> list[int]:
        """Per-request depths: min(policy depth, asked); logs the decision (DEBUG, per round)."""
        d = self.depth(batch_size)
        out = [max(0, min(d, int(a))) for a in asked]
        log.debug("drafter round: batch=%d policy_depth=%d depths=%s", batch_size, d, out)
        return out

    def __str__(self) -> str:
        return ",".join(f"{'*' if m is None else m}:{d}" for m, d in self.steps) + f" (k={self.k})"


class RespawnBudget:
    """At most ``n`` respawns within any window of ``window_s`` seconds; once a respawn is
    refused the budget is spent for good (the proxy stays down: flapping is worse than
    target-only decoding, stack-overview "bounded respawn").

    ``allow(now)`` -> bool records the respawn when allowed. ``clock`` is injectable for tests.
    """

    def __init__(self, n: int, window_s: float) -> None:
        if n < 0 or window_s <= 0:
            raise ConfigError(f"respawn budget: need n >= 0 and window > 0, got n={n} window={window_s}")
        self.n = n
        self.window_s = window_s
        self.times: list[float] = []
        self.exhausted = False

    def allow(self, now: float) -> bool:
        """Record a respawn at ``now`` (seconds, any monotonic clock) and return True while
        fewer than ``n`` happened in the last ``window_s``; the first refusal is final."""
        if self.exhausted:
            return False
        self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.n:
            self.exhausted = True
            return False
        self.times.append(now)
        return True
