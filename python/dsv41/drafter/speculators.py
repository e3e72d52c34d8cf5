"""Spark-side speculators for the engine's speculation hook
(:class:`dsv41.engine.spec_decode.Speculator`): local, synchronous remote and shadow.

* :class:`LocalSpeculator` - the drafter in-process (torch).
* :class:`RemoteSpeculator` - one synchronous round per engine step over TCP to
  ``dsv41 drafter serve``; per-round timeout; identity-checked.
* :class:`ShadowSpeculator` - remote drafts, plus the same round drafted locally and compared.

The asynchronous speculator (rounds through the torch-free proxy process) is in
:mod:`dsv41.drafter.async_speculator`; :mod:`dsv41.drafter.factory` builds the one the settings
ask for.

Every failure fails closed: the affected round returns no drafts (target-only decoding) and is
counted; nothing a request receives changes under greedy verification.

Drafts are greedy (argmax) unless the engine's ``DraftInput`` carries ``temperature`` > 0 and
``seed`` attributes; then they are sampled from the drafter's top-k distribution (``TOP_K`` = 32,
see :mod:`dsv41.drafter.model`), which is what exact sampled verification needs.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from dsv41.drafter import protocol as P
from dsv41.drafter.client import DrafterClient, DrafterUnavailable, IdentityMismatch, RoundTimeout, WorkerRefused
from dsv41.drafter.policy import DepthPolicy
from dsv41.engine.spec_decode import TOP_K, DraftProposal
from dsv41.errors import Dsv41Error

log = logging.getLogger("dsv41.drafter.speculators")

#: Counter keys every speculator reports (``latency_*`` in seconds).
COUNTER_KEYS = (
    "rounds",
    "items",
    "drafted_tokens",
    "fail_closed_rounds",
    "timeouts",
    "refusals",
    "identity_refusals",
    "unavailable",
    "late_dropped",
    "reconnects",
    "latency_sum_s",
    "latency_count",
    "proxy_spawns",
    "proxy_respawns",
    "watchdog_fires",
    "proxy_down",
    "proxy_gave_up",
    "stale_drafts",
    "parity_rounds",
    "parity_items",
    "parity_mismatches",
)


def proposal(tokens=None, ids=None, probs=None, top_k: int = TOP_K) -> DraftProposal:
    """A :class:`DraftProposal` of ``tokens`` int64 ``[k]`` with their top-k ``ids``/``probs``
    (``[k, top_k]``); no arguments: the empty proposal (no drafts)."""
    if tokens is None:
        return DraftProposal(np.zeros(0, np.int64), np.zeros((0, top_k), np.int64), np.zeros((0, top_k), np.float32))
    return DraftProposal(np.asarray(tokens, np.int64), np.asarray(ids, np.int64), np.asarray(probs, np.float32))


def empty_proposals(n: int) -> list[DraftProposal]:
    """``n`` empty proposals (a round that fails closed)."""
    return [proposal() for _ in range(n)]


def round_items(batch, depths: list[int], tail: int | None) -> list[P.RoundItem]:
    """DraftInputs -> RoundItems (only the last ``tail`` tokens travel; the full length rides
    along as ``position`` so sampled drafts stay keyed by context length)."""
    items = []
    for x, d in zip(batch, depths, strict=False):
        toks = np.asarray(x.token_ids, dtype=np.int64).reshape(-1)
        items.append(
            P.RoundItem(
                request_id=str(x.request_id),
                tokens=toks[-tail:] if tail else toks,
                hidden=np.asarray(x.hidden, dtype=np.float32).reshape(-1),
                depth=int(d),
                temperature=float(getattr(x, "temperature", 0.0) or 0.0),
                seed=int(getattr(x, "seed", 0) or 0),
                position=int(toks.size),
            )
        )
    return items


class SpeculatorBase:
    """Counters, the depth policy and the propose() skeleton shared by all speculators."""

    def __init__(self, k: int, policy: DepthPolicy) -> None:
        self.k = k
        self.policy = policy
        self._c = {key: 0 for key in COUNTER_KEYS}
        self._c["latency_sum_s"] = 0.0

    def counters(self) -> dict:
        """Counters since start (monotonic; ``latency_*`` in seconds)."""
        return dict(self._c)

    def _depths(self, batch) -> list[int]:
        return self.policy.apply(len(batch), [min(int(x.depth), self.k) for x in batch])

    def _fail(self, n: int, why: str) -> list:
        self._c["fail_closed_rounds"] += 1
        return empty_proposals(n)

    def close(self) -> None:
        return None


class LocalSpeculator(SpeculatorBase):
    """The drafter in the engine process (``DSV41_DRAFTER_LOCAL``)."""

    def __init__(self, drafter_dir: str, *, k: int = 5, policy: DepthPolicy | None = None, device: str = "cpu") -> None:
        from dsv41.drafter.model import TorchDrafter

        super().__init__(k, policy or DepthPolicy.parse(None, k))
        self.drafter = TorchDrafter(drafter_dir, device=device)
        self.cfg = self.drafter.cfg

    def propose(self, batch) -> list:
        """Draft for ``batch`` (list of DraftInput) in-process; never raises for bad rounds."""
        if not batch:
            return []
        depths = self._depths(batch)
        live = [i for i, d in enumerate(depths) if d > 0]
        out = empty_proposals(len(batch))
        if not live:
            return out
        items = round_items([batch[i] for i in live], [depths[i] for i in live], self.cfg.n_ctx)
        t0 = time.perf_counter()
        try:
            drafts = self.drafter.draft(items)
        except Dsv41Error as exc:
            log.warning("local drafter refused a round: %s", exc)
            self._c["refusals"] += 1
            return self._fail(len(batch), "refused")
        self._c["latency_sum_s"] += time.perf_counter() - t0
        self._c["latency_count"] += 1
        self._c["rounds"] += 1
        self._c["items"] += len(items)
        for j, i in enumerate(live):
            out[i] = proposal(drafts.tokens[j], drafts.top_ids[j], drafts.top_probs[j])
            self._c["drafted_tokens"] += int(drafts.tokens[j].size)
        return out


class RemoteSpeculator(SpeculatorBase):
    """Synchronous remote drafting: one round per ``propose`` over :class:`DrafterClient`."""

    def __init__(
        self,
        url: str,
        expected: dict,
        *,
        k: int = 5,
        policy: DepthPolicy | None = None,
        timeout_ms: float = 100.0,
        reconnect_s: float = 1.0,
        hidden_size: int | None = None,
    ) -> None:
        super().__init__(k, policy or DepthPolicy.parse(None, k))
        self.client = DrafterClient(url, expected, timeout_ms=timeout_ms, reconnect_s=reconnect_s)
        self.hidden_size = hidden_size
        self._logged = ""
        try:
            self.client.connect(force=True)
        except IdentityMismatch as exc:
            log.error("%s", exc)
            self._logged = str(exc)
        except DrafterUnavailable as exc:
            log.warning("drafter worker not reachable yet, drafting off until it is: %s", exc)

    def _sync_client_counters(self) -> None:
        c = self.client.counters
        for key in ("timeouts", "refusals", "identity_refusals", "late_dropped", "reconnects"):
            self._c[key] = c[key]

    def counters(self) -> dict:
        self._sync_client_counters()
        return dict(self._c)

    def run_round(self, batch, depths: list[int]):
        """Run one round for the items with depth > 0; returns (live indices, items, Drafts) or
        raises the client's typed errors."""
        live = [i for i, d in enumerate(depths) if d > 0]
        if not live:
            return live, [], None
        hello = self.client.connect()
        items = round_items([batch[i] for i in live], [min(depths[i], hello.max_k) for i in live], hello.max_context)
        drafts = self.client.round(P.Round(items, int(items[0].hidden.size), int(self.client.timeout_s * 1000)))
        return live, items, drafts

    def propose(self, batch) -> list:
        """One synchronous round; fails closed (no drafts, counted) on any drafter failure."""
        if not batch:
            return []
        depths = self._depths(batch)
        out = empty_proposals(len(batch))
        t0 = time.perf_counter()
        try:
            live, items, drafts = self.run_round(batch, depths)
        except IdentityMismatch as exc:
            if str(exc) != self._logged:
                log.error("%s", exc)
                self._logged = str(exc)
            return self._fail(len(batch), "identity")
        except (DrafterUnavailable, RoundTimeout, WorkerRefused) as exc:
            if isinstance(exc, DrafterUnavailable):
                self._c["unavailable"] += 1
            log.debug("remote drafting round failed closed: %s", exc)
            return self._fail(len(batch), type(exc).__name__)
        if drafts is None:
            return out
        self._c["latency_sum_s"] += time.perf_counter() - t0
        self._c["latency_count"] += 1
        self._c["rounds"] += 1
        self._c["items"] += len(items)
        for j, i in enumerate(live):
            d = min(depths[i], int(drafts.tokens[j].size))
            out[i] = proposal(drafts.tokens[j][:d], drafts.top_ids[j][:d], drafts.top_probs[j][:d])
            self._c["drafted_tokens"] += d
        self._last = (live, items, drafts)
        return out

    def close(self) -> None:
        self.client.close()


class ShadowSpeculator(RemoteSpeculator):
    """Remote drafts (returned) plus the same round drafted locally from ``DSV41_DRAFTER_DIR``;
    tokens must be identical and probabilities within ``prob_tol``; mismatches are counted
    (``parity_mismatches``) and logged, never acted upon."""

    def __init__(self, url: str, expected: dict, drafter_dir: str, *, prob_tol: float = 1e-4, **kw) -> None:
        from dsv41.drafter.model import TorchDrafter

        super().__init__(url, expected, **kw)
        self.local = TorchDrafter(drafter_dir, device="cpu")
        self.prob_tol = prob_tol
        self.max_prob_diff = 0.0

    def propose(self, batch) -> list:
        self._last = None
        out = super().propose(batch)
        if self._last is None:
            return out
        live, items, drafts = self._last
        mine = self.local.draft(items)
        self._c["parity_rounds"] += 1
        for j in range(len(items)):
            self._c["parity_items"] += 1
            a, b = drafts.tokens[j], mine.tokens[j]
            diff = (
                float(np.max(np.abs(drafts.top_probs[j] - mine.top_probs[j]))) if a.size and a.size == b.size else 0.0
            )
            self.max_prob_diff = max(self.max_prob_diff, diff)
            if a.size != b.size or not np.array_equal(a, b) or diff > self.prob_tol:
                self._c["parity_mismatches"] += 1
                log.warning(
                    "shadow parity mismatch for %s: remote %s local %s (max |dp| %.2e)",
                    items[j].request_id,
                    a.tolist(),
                    b.tolist(),
                    diff,
                )
        return out

    def counters(self) -> dict:
        c = super().counters()
        c["parity_max_prob_diff"] = self.max_prob_diff
        return c
