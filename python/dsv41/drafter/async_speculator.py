"""Asynchronous remote drafting: :class:`AsyncSpeculator` and the supervision of its proxy.

The engine never touches the network: rounds go through a shared-memory ring
(:mod:`dsv41.drafter.shm`) to a separate torch-free proxy process (``dsv41 proxy run``).
``propose`` submits this step's round and returns the drafts of the previous round that are
ready, re-aligned to the current context: if the tokens committed since that round equal the
first ``g`` drafts, the remaining drafts continue the current context and are proposed; otherwise
none. A watchdog (each call) detects a dead or stuck proxy (heartbeat older than
``watchdog_ms``), kills it and respawns it within a budget of N per T seconds, then stays down.
Every failure fails closed (no drafts that round, counted).
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
from dsv41.drafter.policy import DepthPolicy, RespawnBudget
from dsv41.drafter.speculators import SpeculatorBase, empty_proposals, proposal, round_items
from dsv41.errors import Dsv41Error

log = logging.getLogger("dsv41.drafter.async_speculator")


@dataclass
class _Ready:
    ctx_len: int
    tail: np.ndarray
    tokens: np.ndarray
    ids: np.ndarray
    probs: np.ndarray


class AsyncSpeculator(SpeculatorBase):
    """Asynchronous remote drafting through the torch-free proxy process and a shared-memory ring.

    ``propose`` never blocks on the network: it (1) runs the watchdog, (2) collects the reply of
    the round in flight if the proxy has published it, (3) proposes, for each request, the drafts
    of that reply that still continue its context, (4) submits this step's round when no round is
    in flight. ``clock`` is injectable for tests of the respawn budget. ``memlock``: the proxy
    locks its memory (``--memlock``) and publishes the result, exported as ``proxy_memlock``
    (:class:`dsv41.drafter.memlock.MemlockState`: 1 locked, 2 refused, 3 off).
    """

    TAIL = 16  # context tokens remembered per request to check that a reply still applies
    #: seconds (monotonic) a stale proxy heartbeat must stay stale before the watchdog fires
    STALE_CONFIRM_S = 0.25

    def __init__(
        self,
        url: str,
        expected: dict,
        *,
        k: int = 5,
        policy: DepthPolicy | None = None,
        timeout_ms: float = 100.0,
        watchdog_ms: float = 2000.0,
        startup_grace_s: float = 20.0,
        respawns: int = 3,
        window_s: float = 60.0,
        n_slots: int = 4,
        slot_size: int = 4 << 20,
        nap_us: float = 50.0,
        memlock: bool = True,
        max_context: int = 64,
        max_k: int = 7,
        clock=time.monotonic,
        proxy_cmd: list[str] | None = None,
    ) -> None:
        super().__init__(k, policy or DepthPolicy.parse(None, k))
        P.parse_url(url)
        self.url, self.expected = url, expected
        self.timeout_ms, self.watchdog_s, self.startup_grace_s = timeout_ms, watchdog_ms / 1000.0, startup_grace_s
        self.budget = RespawnBudget(respawns, window_s)
        self.n_slots, self.slot_size, self.nap_us = n_slots, slot_size, nap_us
        self.memlock = memlock
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
        self._stale_since: float | None = None  # when the watchdog first saw this stale heartbeat
        self._stale_hb = 0
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
        cmd = [
            *self.proxy_cmd,
            "run",
            "--shm",
            self.ring.name,
            "--remote",
            self.url,
            "--drafter-identity",
            self.expected.get("drafter", ""),
            "--markov-identity",
            self.expected.get("markov", ""),
            "--target-identity",
            self.expected.get("target", ""),
            "--timeout-ms",
            str(self.timeout_ms),
            "--nap-us",
            str(self.nap_us),
            "--parent-pid",
            str(os.getpid()),
            "--memlock" if self.memlock else "--no-memlock",
        ]
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
        if stuck and not dead:
            # A stale heartbeat is confirmed over STALE_CONFIRM_S of the engine's own time first:
            # after the whole host stalled (CPU starvation, a VM pause) longer than the watchdog
            # period, the engine may run before the proxy has been scheduled to beat again, and a
            # healthy proxy would be killed. A frozen proxy is still replaced, that much later.
            t = time.monotonic()
            if self._stale_since is None or self._stale_hb != hb:
                self._stale_since, self._stale_hb = t, hb
            if t - self._stale_since < self.STALE_CONFIRM_S:
                return True
        self._stale_since = None
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
            log.error(
                "drafter proxy respawn budget (%d per %.0f s) spent: the proxy stays down, "
                "decoding continues target-only",
                self.budget.n,
                self.budget.window_s,
            )
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
        self._ready = {
            rid: _Ready(meta[rid][0], meta[rid][1], drafts.tokens[j], drafts.top_ids[j], drafts.top_probs[j])
            for j, rid in enumerate(rids)
        }

    def _aligned(self, x, depth: int):
        r = self._ready.get(str(x.request_id))
        if r is None or depth <= 0:
            return None
        toks = np.asarray(x.token_ids, dtype=np.int64).reshape(-1)
        g = toks.size - r.ctx_len
        if g < 0 or g > r.tokens.size or not np.array_equal(toks[r.ctx_len - r.tail.size : r.ctx_len], r.tail):
            self._c["stale_drafts"] += 1
            return None
        if not np.array_equal(toks[r.ctx_len :], r.tokens[:g]):
            self._c["stale_drafts"] += 1
            return None
        d = min(depth, r.tokens.size - g)
        if d <= 0:
            return None
        return r.tokens[g : g + d], r.ids[g : g + d], r.probs[g : g + d]

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
        items = round_items([batch[i] for i in live], sub_depths, self.max_context)
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
        for i, it in zip(live, items, strict=False):
            toks = np.asarray(batch[i].token_ids, dtype=np.int64).reshape(-1)
            meta[it.request_id] = (int(toks.size), toks[-self.TAIL :].copy(), now)
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
        out = empty_proposals(len(batch))
        for i, x in enumerate(batch):
            got = self._aligned(x, depths[i])
            if got is not None:
                out[i] = proposal(*got)
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
            c["proxy_memlock"] = self.ring.proxy_memlock
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
