"""Spark-side speculators for the engine's speculation hook (``dsv41.engine.spec.Speculator``).

* :class:`LocalSpeculator` - the drafter in-process (torch).
* :class:`RemoteSpeculator` - one synchronous round per engine step over TCP to
  ``dsv41 drafter serve``; per-round timeout; identity-checked.
* :class:`AsyncSpeculator` - the engine never touches the network: rounds go through a
  shared-memory ring to a separate torch-free proxy process (``dsv41 proxy run``). ``propose``
  submits this step's round and returns the drafts of the previous round that are ready,
  re-aligned to the current context: if the tokens committed since that round equal the first
  ``g`` drafts, the remaining drafts continue the current context and are proposed; otherwise
  none. A watchdog (each call) detects a dead or stuck proxy (heartbeat older than
  ``watchdog_ms``), kills it and respawns it within a budget of N per T seconds, then stays down.
* :class:`ShadowSpeculator` - remote drafts, plus the same round drafted locally and compared.

Every failure fails closed: the affected round returns no drafts (target-only decoding) and is
counted; nothing a request receives changes under greedy verification.

Drafts are greedy (argmax) unless the engine's ``DraftInput`` carries ``temperature`` > 0 and
``seed`` attributes; then they are sampled from the drafter's top-32 distribution (see
:mod:`dsv41.drafter.model`), which is what exact sampled verification needs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from dsv41.drafter import protocol as P
from dsv41.drafter.client import DrafterClient, DrafterUnavailable, IdentityMismatch, RoundTimeout, WorkerRefused
from dsv41.drafter.policy import DepthPolicy, RespawnBudget
from dsv41.errors import ConfigError, Dsv41Error

log = logging.getLogger("dsv41.drafter.spark")

COUNTER_KEYS = (
    "rounds", "items", "drafted_tokens", "fail_closed_rounds", "timeouts", "refusals", "identity_refusals",
    "unavailable", "late_dropped", "reconnects", "latency_sum_s", "latency_count", "proxy_spawns",
    "proxy_respawns", "watchdog_fires", "proxy_down", "proxy_gave_up", "stale_drafts", "parity_rounds",
    "parity_items", "parity_mismatches",
)


def _proposal(tokens=None, ids=None, probs=None, top_n: int = P.TOP_N):
    from dsv41.engine.spec import DraftProposal

    if tokens is None:
        return DraftProposal(np.zeros(0, np.int64), np.zeros((0, top_n), np.int64), np.zeros((0, top_n), np.float32))
    return DraftProposal(np.asarray(tokens, np.int64), np.asarray(ids, np.int64), np.asarray(probs, np.float32))


def _empty(n: int) -> list:
    return [_proposal() for _ in range(n)]


def _round_items(batch, depths: list[int], tail: int | None) -> list[P.RoundItem]:
    """DraftInputs -> RoundItems (only the last ``tail`` tokens travel; the full length rides
    along as ``position`` so sampled drafts stay keyed by context length)."""
    items = []
    for x, d in zip(batch, depths):
        toks = np.asarray(x.token_ids, dtype=np.int64).reshape(-1)
        items.append(P.RoundItem(
            request_id=str(x.request_id), tokens=toks[-tail:] if tail else toks,
            hidden=np.asarray(x.hidden, dtype=np.float32).reshape(-1), depth=int(d),
            temperature=float(getattr(x, "temperature", 0.0) or 0.0), seed=int(getattr(x, "seed", 0) or 0),
            position=int(toks.size)))
    return items


class _Base:
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
        return _empty(n)

    def close(self) -> None:
        return None


class LocalSpeculator(_Base):
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
        out = _empty(len(batch))
        if not live:
            return out
        items = _round_items([batch[i] for i in live], [depths[i] for i in live], self.cfg.n_ctx)
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
            out[i] = _proposal(drafts.tokens[j], drafts.top_ids[j], drafts.top_probs[j])
            self._c["drafted_tokens"] += int(drafts.tokens[j].size)
        return out


class RemoteSpeculator(_Base):
    """Synchronous remote drafting: one round per ``propose`` over :class:`DrafterClient`."""

    def __init__(self, url: str, expected: dict, *, k: int = 5, policy: DepthPolicy | None = None,
                 timeout_ms: float = 100.0, reconnect_s: float = 1.0, hidden_size: int | None = None) -> None:
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
        items = _round_items([batch[i] for i in live], [min(depths[i], hello.max_k) for i in live], hello.max_context)
        drafts = self.client.round(P.Round(items, int(items[0].hidden.size), int(self.client.timeout_s * 1000)))
        return live, items, drafts

    def propose(self, batch) -> list:
        """One synchronous round; fails closed (no drafts, counted) on any drafter failure."""
        if not batch:
            return []
        depths = self._depths(batch)
        out = _empty(len(batch))
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
            out[i] = _proposal(drafts.tokens[j][:d], drafts.top_ids[j][:d], drafts.top_probs[j][:d])
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
            diff = float(np.max(np.abs(drafts.top_probs[j] - mine.top_probs[j]))) if a.size and a.size == b.size else 0.0
            self.max_prob_diff = max(self.max_prob_diff, diff)
            if a.size != b.size or not np.array_equal(a, b) or diff > self.prob_tol:
                self._c["parity_mismatches"] += 1
                log.warning("shadow parity mismatch for %s: remote %s local %s (max |dp| %.2e)",
                            items[j].request_id, a.tolist(), b.tolist(), diff)
        return out

    def counters(self) -> dict:
        c = super().counters()
        c["parity_max_prob_diff"] = self.max_prob_diff
        return c


@dataclass
class _Ready:
    ctx_len: int
    tail: np.ndarray
    tokens: np.ndarray
    ids: np.ndarray
    probs: np.ndarray


class AsyncSpeculator(_Base):
    """Asynchronous remote drafting through the torch-free proxy process and a shared-memory ring.

    ``propose`` never blocks on the network: it (1) runs the watchdog, (2) collects the reply of
    the round in flight if the proxy has published it, (3) proposes, for each request, the drafts
    of that reply that still continue its context, (4) submits this step's round when no round is
    in flight. ``clock`` is injectable for tests of the respawn budget.
    """

    TAIL = 16  # context tokens remembered per request to check that a reply still applies

    def __init__(self, url: str, expected: dict, *, k: int = 5, policy: DepthPolicy | None = None,
                 timeout_ms: float = 100.0, watchdog_ms: float = 2000.0, startup_grace_s: float = 20.0,
                 respawns: int = 3, window_s: float = 60.0, n_slots: int = 4, slot_size: int = 4 << 20,
                 nap_us: float = 50.0, max_context: int = 64, max_k: int = 7, clock=time.monotonic,
                 proxy_cmd: list[str] | None = None) -> None:
        super().__init__(k, policy or DepthPolicy.parse(None, k))
        P.parse_url(url)
        self.url, self.expected = url, expected
        self.timeout_ms, self.watchdog_s, self.startup_grace_s = timeout_ms, watchdog_ms / 1000.0, startup_grace_s
        self.budget = RespawnBudget(respawns, window_s)
        self.n_slots, self.slot_size, self.nap_us = n_slots, slot_size, nap_us
        self.max_context, self.max_k = max_context, max_k
        self.clock = clock
        self.proxy_cmd = proxy_cmd or [sys.executable, "-m", "dsv41.drafter.proxy_cli"]
        self.ring = None
        self.proc: subprocess.Popen | None = None
        self.spawned_at = 0.0
        self.down_logged = False
        self._seq = 0
        self._inflight: tuple[int, int, dict] | None = None  # (slot, seq, {rid: (ctx_len, tail)})
        self._inflight_t = 0.0  # clock() when the round in flight was submitted
        # a round unanswered this long means a broken proxy (its own client gives up after
        # timeout_ms and connects within 0.5 s): at least the watchdog period, at least 2 s
        self._inflight_limit_s = max(self.watchdog_s, 2.0, 20 * timeout_ms / 1000.0)
        self._ready: dict[str, _Ready] = {}
        self._last_state_error = ""
        # propose (engine thread) and counters (metrics scrape thread) both touch the ring, and a
        # respawn replaces it: one lock keeps a scrape from reading a closed segment.
        self._lock = threading.Lock()
        try:
            self._spawn()
        except Dsv41Error as exc:
            # Fail closed: an engine whose proxy cannot start serves target-only (counted, logged)
            # rather than not serving at all.
            self._kill()
            self._c["proxy_gave_up"] = 1
            self.down_logged = True
            log.error("%s; the proxy stays down, decoding continues target-only", exc)

    # ------------------------------------------------------------------ proxy lifecycle

    def _spawn(self) -> None:
        from dsv41.drafter.shm import Ring

        try:
            self.ring = Ring.create(self.n_slots, self.slot_size)
        except OSError as exc:  # /dev/shm full or not mounted
            raise Dsv41Error(f"drafter proxy: cannot create the shared-memory ring: {exc}") from None
        self.ring.beat_engine()
        cmd = [*self.proxy_cmd, "run", "--shm", self.ring.name, "--remote", self.url,
               "--drafter-identity", self.expected.get("drafter", ""),
               "--markov-identity", self.expected.get("markov", ""),
               "--target-identity", self.expected.get("target", ""),
               "--timeout-ms", str(self.timeout_ms), "--nap-us", str(self.nap_us),
               "--parent-pid", str(os.getpid())]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:  # fork/exec failed: do not leave the fresh segment behind
            self.ring.close()
            self.ring = None
            raise Dsv41Error(f"drafter proxy: cannot start {cmd[0]}: {exc}") from None
        self.spawned_at = self.clock()
        self._inflight = None
        self._ready = {}
        self._c["proxy_spawns"] += 1
        log.info("drafter proxy started (pid %d, ring %s, worker %s)", self.proc.pid, self.ring.name, self.url)

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                if self.ring is not None:
                    self.ring.stop = True
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - kill -9 does not fail
                pass
            self.proc = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self._inflight = None
        self._ready = {}

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Block until the proxy has connected (True) or refused the worker / timed out (False).

        For engine start-up and tests; ``propose`` itself never waits.
        """
        from dsv41.drafter.shm import ProxyState, RingCorrupt

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with self._lock:
                if self.ring is None:
                    return False
                self.ring.beat_engine()
                try:
                    st = self.ring.proxy_state
                except RingCorrupt:  # propose's corrupt-ring path replaces the proxy
                    return False
            if st == ProxyState.CONNECTED:
                return True
            if st == ProxyState.REFUSED:
                return False
            time.sleep(0.01)
        return False

    @property
    def proxy_pid(self) -> int | None:
        """Pid of the current proxy process, None while it is down."""
        return self.proc.pid if self.proc is not None else None

    def watchdog(self) -> bool:
        """Check the proxy; kill and respawn (within budget) a dead or stuck one.

        Returns True when a live proxy is available after the check.
        """
        if self.proc is None:
            return False
        now = self.clock()
        dead = self.proc.poll() is not None
        hb = self.ring.proxy_heartbeat
        if hb:
            stuck = (time.monotonic_ns() - hb) / 1e9 > self.watchdog_s
        else:
            stuck = now - self.spawned_at > self.startup_grace_s
        if not (dead or stuck):
            return True
        return self._replace("exited" if dead else f"is stuck (heartbeat older than {self.watchdog_s:.1f} s)")

    def _replace(self, why: str) -> bool:
        """Kill the current proxy (and unlink its ring) and respawn one while the budget allows;
        returns True when a fresh proxy was spawned."""
        now = self.clock()
        self._c["watchdog_fires"] += 1
        log.warning("drafter proxy pid %d %s; drafting target-only until it is back", self.proc.pid, why)
        self._kill()
        if self.budget.allow(now):
            self._c["proxy_respawns"] += 1
            try:
                self._spawn()
                return True
            except (OSError, Dsv41Error) as exc:  # /dev/shm full, fork failed: stay down, say so
                self._kill()
                log.error("drafter proxy respawn failed: %s", exc)
        self._c["proxy_gave_up"] = 1
        if not self.down_logged:
            log.error("drafter proxy respawn budget (%d per %.0f s) spent: the proxy stays down, "
                      "decoding continues target-only", self.budget.n, self.budget.window_s)
            self.down_logged = True
        return False

    # ------------------------------------------------------------------ rounds

    def _collect(self) -> None:
        from dsv41.drafter.shm import ProxyState, SlotState

        if self._inflight is None:
            return
        slot, seq, meta = self._inflight
        if self.ring.slot_state(slot) != SlotState.REPLY:
            return
        got = self.ring.read(slot)
        if got is None:
            return
        rseq, status, data = got
        self.ring.set_state(slot, SlotState.FREE)
        self._inflight = None
        if rseq != seq:
            self._c["late_dropped"] += 1
            return
        if status != P.Status.OK:
            if status == P.Status.TIMEOUT:
                self._c["timeouts"] += 1
            elif status == P.Status.IDENTITY_MISMATCH:
                self._c["identity_refusals"] += 1
            elif status == P.Status.UNAVAILABLE:
                self._c["unavailable"] += 1
            else:
                self._c["refusals"] += 1
            st = self.ring.proxy_state
            if st == ProxyState.REFUSED and self.ring.error != self._last_state_error:
                self._last_state_error = self.ring.error
                log.error("%s", self.ring.error)
            self._c["fail_closed_rounds"] += 1
            return
        try:
            drafts = P.Drafts.decode(data)
        except P.ProtocolError as exc:
            log.warning("async drafter: malformed reply dropped: %s", exc)
            self._c["refusals"] += 1
            return
        rids = list(meta)
        if len(drafts.tokens) != len(rids):
            self._c["refusals"] += 1
            return
        self._c["rounds"] += 1
        self._c["items"] += len(rids)
        self._c["latency_count"] += 1
        self._c["latency_sum_s"] += max(0.0, self.clock() - meta[rids[0]][2])
        self._ready = {rid: _Ready(meta[rid][0], meta[rid][1], drafts.tokens[j], drafts.top_ids[j], drafts.top_probs[j])
                       for j, rid in enumerate(rids)}

    def _aligned(self, x, depth: int):
        r = self._ready.get(str(x.request_id))
        if r is None or depth <= 0:
            return None
        toks = np.asarray(x.token_ids, dtype=np.int64).reshape(-1)
        g = toks.size - r.ctx_len
        if g < 0 or g > r.tokens.size or not np.array_equal(toks[r.ctx_len - r.tail.size:r.ctx_len], r.tail):
            self._c["stale_drafts"] += 1
            return None
        if not np.array_equal(toks[r.ctx_len:], r.tokens[:g]):
            self._c["stale_drafts"] += 1
            return None
        d = min(depth, r.tokens.size - g)
        if d <= 0:
            return None
        return r.tokens[g:g + d], r.ids[g:g + d], r.probs[g:g + d]

    def _submit(self, batch, depths: list[int]) -> None:
        from dsv41.drafter.shm import SlotState

        live = [i for i, d in enumerate(depths) if d > 0]
        if not live:
            return
        free = self.ring.find(SlotState.FREE)
        if not free:
            return
        # Ask for two more drafts than the policy depth: the reply is used one step later, after
        # the tokens committed meanwhile have consumed the first ones.
        sub_depths = [min(depths[i] + 2, self.max_k) for i in live]
        items = _round_items([batch[i] for i in live], sub_depths, self.max_context)
        try:
            payload = P.Round(items, int(items[0].hidden.size), int(self.timeout_ms)).encode()
        except P.ProtocolError as exc:
            log.warning("async drafter: round not encodable: %s", exc)
            self._c["refusals"] += 1
            return
        if len(payload) > self.ring.slot_size:
            self._c["refusals"] += 1
            return
        self._seq += 1
        now = self.clock()
        meta = {}
        for i, it in zip(live, items):
            toks = np.asarray(batch[i].token_ids, dtype=np.int64).reshape(-1)
            meta[it.request_id] = (int(toks.size), toks[-self.TAIL:].copy(), now)
        self.ring.write(free[0], SlotState.REQUEST, self._seq, payload)
        self._inflight = (free[0], self._seq, meta)
        self._inflight_t = now

    def propose(self, batch) -> list:
        """Non-blocking: previous round's still-valid drafts (or none), and submit this round."""
        if not batch:
            return []
        with self._lock:
            return self._propose(batch)

    def _propose(self, batch) -> list:
        if self.ring is not None:
            self.ring.beat_engine()
        if not self.watchdog():
            self._c["proxy_down"] += 1
            return self._fail(len(batch), "proxy down")
        from dsv41.drafter.shm import RingCorrupt

        try:
            self._collect()
        except RingCorrupt as exc:  # garbage in the ring: the proxy (or a stray writer) is broken
            self._replace(f"left a corrupt ring ({exc})")
            self._c["proxy_down"] += 1
            return self._fail(len(batch), "corrupt ring")
        if self._inflight is not None and self.clock() - self._inflight_t > self._inflight_limit_s:
            # The proxy beats but never publishes a readable reply (its client answers or times
            # out within timeout_ms, so this is a broken proxy): replace it rather than stop
            # drafting for good behind a round that never completes.
            self._c["timeouts"] += 1
            self._replace(f"left round {self._inflight[1]} unanswered for {self._inflight_limit_s:.1f} s")
            return self._fail(len(batch), "round never answered")
        depths = self._depths(batch)
        out = _empty(len(batch))
        for i, x in enumerate(batch):
            got = self._aligned(x, depths[i])
            if got is not None:
                out[i] = _proposal(*got)
                self._c["drafted_tokens"] += int(got[0].size)
        if self._inflight is None:
            self._submit(batch, depths)
        return out

    def counters(self) -> dict:
        with self._lock:
            return self._counters()

    def _counters(self) -> dict:
        c = dict(self._c)
        if self.ring is not None:
            for k, v in self.ring.counters().items():
                c[f"proxy_{k}"] = v
            from dsv41.drafter.shm import RingCorrupt

            try:
                c["proxy_state"] = int(self.ring.proxy_state)
            except RingCorrupt:  # a scrape must not fail; the next propose replaces the proxy
                c["proxy_state"] = -1
        c["proxy_up"] = int(self.proc is not None and self.proc.poll() is None)
        return c

    def close(self) -> None:
        """Stop the proxy (stop flag, then kill by pid) and unlink the ring."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.proc is not None and self.ring is not None:
            self.ring.stop = True
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        self._kill()


# ----------------------------------------------------------------------------------------------
# environment contract


def _env_int(env, name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name, "")
    if raw in ("", None):
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _env_float(env, name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name, "")
    if raw in ("", None):
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _env_bool(env, name: str) -> bool:
    raw = (env.get(name, "") or "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be 0 or 1, got {raw!r}")


def expected_identities(drafter_dir: str, target_identity: str) -> dict:
    """Identities the Spark side requires of a worker: drafter and Markov head from the drafter
    files in ``drafter_dir``, target = the engine's own ``target_identity``.

    Raises :class:`ConfigError` when the files are missing or were distilled for another target.
    """
    from dsv41.drafter.model import identities

    ids = identities(drafter_dir)
    if ids["target"] and target_identity and ids["target"] != target_identity:
        raise ConfigError(f"DSV41_DRAFTER_DIR {drafter_dir}: drafter was distilled for target {ids['target'][:12]}, "
                          f"the engine serves {target_identity[:12]}")
    return {"drafter": ids["drafter"], "markov": ids["markov"], "target": target_identity or ids["target"]}


def _check_model(drafter_dir: str, model_cfg: dict) -> None:
    from dsv41.drafter.model import load_config

    cfg = load_config(drafter_dir)
    for key, mine in (("hidden_size", cfg.hidden_size), ("vocab_size", cfg.vocab_size)):
        theirs = model_cfg.get(key)
        if theirs is not None and int(theirs) != mine:
            raise ConfigError(f"drafter {drafter_dir}: {key} {mine} != target model's {theirs}")
    tap = model_cfg.get("drafter_tap_layer")
    if tap is not None and int(tap) != cfg.tap_layer:
        raise ConfigError(f"drafter {drafter_dir}: tap layer {cfg.tap_layer} != target's drafter_tap_layer {tap}")


def speculator_from_env(env=os.environ, *, model_cfg: dict, target_identity: str, device: str = "cpu"):
    """Build the speculator the environment asks for (docs/interfaces.md, drafter section).

    ``DSV41_DRAFTER_REMOTE`` (tcp URL) -> remote (``DSV41_DRAFTER_ASYNC=1``: async via the proxy;
    ``DSV41_DRAFTER_SHADOW=1``: shadow parity), needs ``DSV41_DRAFTER_DIR`` for identities;
    ``DSV41_DRAFTER_LOCAL`` (drafter dir) -> in-process; neither -> None. Also read:
    ``DSV41_DRAFTER_K`` (5), ``DSV41_DRAFTER_TIMEOUT_MS`` (100), ``DSV41_DRAFTER_DEPTH_POLICY``,
    ``DSV41_DRAFTER_WATCHDOG_MS`` (2000), ``DSV41_DRAFTER_PROXY_RESPAWNS`` (3),
    ``DSV41_DRAFTER_PROXY_WINDOW_S`` (60). Raises :class:`ConfigError` on inconsistent settings.
    """
    remote = (env.get("DSV41_DRAFTER_REMOTE") or "").strip()
    local = (env.get("DSV41_DRAFTER_LOCAL") or "").strip()
    if remote and local:
        raise ConfigError("set only one of DSV41_DRAFTER_REMOTE and DSV41_DRAFTER_LOCAL")
    kv_budget_extra_tokens(env)  # validate capacity settings up front
    if not remote and not local:
        return None
    k = _env_int(env, "DSV41_DRAFTER_K", 5, 0, 64)
    policy = DepthPolicy.parse(env.get("DSV41_DRAFTER_DEPTH_POLICY") or None, k)
    log.info("drafter depth policy: %s", policy)
    if local:
        _check_model(local, model_cfg)
        ids = expected_identities(local, target_identity)
        log.info("local drafter %s (drafter %s, markov %s)", local, ids["drafter"][:12], ids["markov"][:12])
        return LocalSpeculator(local, k=k, policy=policy, device=device)
    P.parse_url(remote)
    drafter_dir = (env.get("DSV41_DRAFTER_DIR") or "").strip()
    if not drafter_dir:
        raise ConfigError("DSV41_DRAFTER_REMOTE needs DSV41_DRAFTER_DIR (the drafter files the worker must match)")
    _check_model(drafter_dir, model_cfg)
    expected = expected_identities(drafter_dir, target_identity)
    timeout_ms = _env_float(env, "DSV41_DRAFTER_TIMEOUT_MS", 100.0, 1.0, 60000.0)
    if _env_bool(env, "DSV41_DRAFTER_ASYNC"):
        if _env_bool(env, "DSV41_DRAFTER_SHADOW"):
            raise ConfigError("DSV41_DRAFTER_SHADOW works with synchronous rounds only; unset DSV41_DRAFTER_ASYNC")
        from dsv41.drafter.model import load_config

        cfg = load_config(drafter_dir)
        spec = AsyncSpeculator(
            remote, expected, k=k, policy=policy, timeout_ms=timeout_ms,
            watchdog_ms=_env_float(env, "DSV41_DRAFTER_WATCHDOG_MS", 2000.0, 10.0, 600000.0),
            respawns=_env_int(env, "DSV41_DRAFTER_PROXY_RESPAWNS", 3, 0, 1000),
            window_s=_env_float(env, "DSV41_DRAFTER_PROXY_WINDOW_S", 60.0, 0.001, 86400.0),
            max_context=cfg.n_ctx, max_k=cfg.max_k)
        # At engine start-up give the proxy a moment to connect (never required: fail closed).
        if not spec.wait_ready(10.0):
            log.warning("drafter proxy not connected to %s after 10 s (%s); drafting target-only until it is",
                        remote, spec.ring.error if spec.ring is not None else "proxy down")
        return spec
    if _env_bool(env, "DSV41_DRAFTER_SHADOW"):
        return ShadowSpeculator(remote, expected, drafter_dir, k=k, policy=policy, timeout_ms=timeout_ms)
    return RemoteSpeculator(remote, expected, k=k, policy=policy, timeout_ms=timeout_ms)


def kv_budget_extra_tokens(env=os.environ) -> int:
    """Extra KV-cache tokens the engine may allocate because the drafter runs remotely.

    Capacity mode (``DSV41_DRAFTER_CAPACITY_MODE=1``) with ``DSV41_DRAFTER_REMOTE`` set returns
    ``DSV41_DRAFTER_LOCAL_MEMORY_TOKENS`` (the KV tokens the local drafter's memory would hold);
    otherwise 0. Raises :class:`ConfigError` when capacity mode is on with a local drafter or
    without a positive token count. The engine adds the result to its KV budget and reports it.
    """
    if not _env_bool(env, "DSV41_DRAFTER_CAPACITY_MODE"):
        return 0
    if (env.get("DSV41_DRAFTER_LOCAL") or "").strip():
        raise ConfigError("DSV41_DRAFTER_CAPACITY_MODE=1 with DSV41_DRAFTER_LOCAL: a local drafter frees no memory")
    if not (env.get("DSV41_DRAFTER_REMOTE") or "").strip():
        return 0
    n = _env_int(env, "DSV41_DRAFTER_LOCAL_MEMORY_TOKENS", 0, 0, 1 << 40)
    if n <= 0:
        raise ConfigError("DSV41_DRAFTER_CAPACITY_MODE=1 needs DSV41_DRAFTER_LOCAL_MEMORY_TOKENS > 0")
    return n
