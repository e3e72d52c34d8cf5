"""The pause/resume state machine of the lab engine's API (issue 25 item 1), shared by
tests/unit/test_pause_state_machine.py (bounded examples, ``make test``) and
tests/fuzz/test_pause_fuzz.py (many, ``make fuzz``).

hypothesis' ``RuleBasedStateMachine`` drives random sequences of pause(abort|wait|keep, short or
long drain deadline, with or without a window token), resume, new requests (plain or streaming,
with or without the token), finishing a request, and the shutdown drain against the real app
(``create_app``, in-process through httpx's ASGI transport, on one event loop thread) over
:class:`ControlledEngine`, a fake whose requests end only when the test finishes them, a pause
or the shutdown aborts them. A model of docs/engine.md's table ("Pause, resume and drains")
predicts every answer; the invariants:

- no request ends ``abort`` unless a pause whose scope held it (in flight at that pause, refused
  by its HOLD) or the shutdown aborted it: a request admitted after a ``/resume`` is never
  aborted by an earlier pause's drain;
- held means new requests get 503 unless they carry the HOLD's window token; shutting down means
  503 for every request and every ``/pause``;
- every count in a pause reply and in the shutdown report is exact, and a pause reply arrives
  exactly when the model says its drain ended (``drain`` outcome included);
- ``/is_paused`` agrees with the model; the engine is frozen exactly while the latest pause is
  ``keep``; the shutdown drain ends within its timeout plus the abort settle time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS
from dsv41.engine.server import create_app
from dsv41.engine.server_state import ServerState, shutdown_drain

TOKEN = "win-1"
SHORT_S, LONG_S = 0.01, 300.0  # a drain deadline that expires at once / never within a test
SHUTDOWN_S = 0.05
WAIT_S = 10.0  # the most a step waits for something the model says must happen


class ControlledEngine:
    """The engine API the server uses (submit, abort, freeze, idle, fatal); a request stays in
    flight until :meth:`finish` (ignored while frozen) or an abort (applied while frozen too,
    as in ``engine.Engine``). Requests are named by their ``seed``. Loop thread only."""

    def __init__(self) -> None:
        self.fatal = None
        self.frozen = False
        self.live: dict[str, tuple] = {}  # rid -> (seed, sink, prompt_len)
        self.by_seed: dict[int, str] = {}
        self.n = 0

    def submit(self, ids, params, sink):
        self.n += 1
        rid = f"req-{self.n}"
        self.live[rid] = (params.seed, sink, len(ids))
        self.by_seed[params.seed] = rid
        sink({"type": "tokens", "ids": [65], "prompt_tokens": len(ids), "completion_tokens": 1})

        class R:
            request_id = rid

        return R()

    def _end(self, rid: str, reason: str) -> None:
        seed, sink, plen = self.live.pop(rid)
        sink({"type": "finish", "reason": reason, "prompt_tokens": plen, "completion_tokens": 1})

    def abort(self, rid=None):
        for r in [rid] if rid is not None else list(self.live):
            if r in self.live:
                self._end(r, "abort")

    def finish(self, seed: int) -> bool:
        rid = self.by_seed.get(seed)
        if self.frozen or rid not in self.live:
            return False
        self._end(rid, "length")
        return True

    def freeze(self, frozen: bool) -> None:
        self.frozen = frozen

    def idle(self) -> bool:
        return not self.live


class Loop:
    """One event loop on a daemon thread; :meth:`submit` runs a coroutine there (a future)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn, *args):
        async def run():
            return fn(*args)

        return self.submit(run()).result(WAIT_S)

    def settle(self, s: float = 0.01) -> None:
        self.submit(asyncio.sleep(s)).result(WAIT_S)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


def _until(pred, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def _finish_reason(resp: httpx.Response, stream: bool) -> str:
    if not stream:
        return resp.json()["choices"][0]["finish_reason"]
    chunks = [
        json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert resp.text.rstrip().endswith("data: [DONE]")
    return [c for c in chunks if c.get("choices")][-1]["choices"][0]["finish_reason"]


class PauseMachine(RuleBasedStateMachine):
    """The model and rules (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.lp = Loop()
        self.engine = ControlledEngine()
        self.state = ServerState()
        app = create_app(self.engine, "m", 64, self.state, operator_credential=OPERATOR, allowed_hosts=TEST_HOSTS)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://engine", headers=OP_HEADERS, timeout=LONG_S * 2
        )
        self.seed = 0
        self.steps = 0
        self.held = False
        self.window: str | None = None
        self.frozen = False
        self.shut = False
        self.in_flight: dict[int, dict] = {}  # seed -> {"fut", "stream", "token"}
        self.ended: list[tuple[dict, str]] = []  # (request, expected finish reason)
        self.pending: list[dict] = []  # pause drains the model says are still running

    # ---------------------------------------------------------------- helpers
    def _post(self, path: str, **kw):
        return self.lp.submit(self.client.post(path, **kw))

    def _end(self, seed: int, reason: str, by: dict | None = None) -> None:
        r = self.in_flight.pop(seed)
        self.ended.append((r, reason))
        if by is not None:
            by["aborted"] += 1
        for p in self.pending:
            p["scope"].discard(seed)

    def _check_ended(self) -> None:
        for r, reason in self.ended:
            resp = r["fut"].result(WAIT_S)
            assert resp.status_code == 200, resp.text
            got = _finish_reason(resp, r["stream"])
            # the invariant of the report: only an abort the model attributes may end a request
            assert got == reason, f"request {r['seed']} ended {got!r}, the model says {reason!r}"
        self.ended = []

    def _reply(self, p: dict, outcome: str) -> None:
        resp = p["fut"].result(WAIT_S)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        want = {
            "paused": self.held,
            "mode": p["mode"],
            "drain": outcome,
            "in_flight_at_pause": p["at_pause"],
            "aborted": p["aborted"],
            "aborted_after_timeout": p["aborted"] if p["mode"] == "wait" else 0,
            "still_running": len(p["scope"]),
        }
        assert doc == want, (doc, want)

    def _end_pending(self, outcome: str) -> None:
        for p in self.pending:
            self._reply(p, outcome)
        self.pending = []

    # ---------------------------------------------------------------- rules
    @rule(streams=st.lists(st.booleans(), min_size=1, max_size=3), with_token=st.booleans())
    def new_requests(self, streams, with_token):
        for stream in streams:
            self.new_request(stream, with_token)

    @rule(stream=st.booleans())
    def new_window_request(self, stream):
        self.new_request(stream, True)

    def new_request(self, stream, with_token):
        self.seed += 1
        seed = self.seed
        headers = {"x-dsv41-window": TOKEN} if with_token else {}
        body = {"prompt": "x", "max_tokens": 4, "seed": seed, "stream": stream}
        fut = self._post("/v1/completions", json=body, headers=headers)
        admitted = not self.shut and (not self.held or (with_token and self.window == TOKEN))
        if not admitted:
            resp = fut.result(WAIT_S)
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["type"] == "ServiceUnavailableError"
            return
        _until(lambda: seed in self.engine.by_seed, f"request {seed} to reach the engine")
        self.in_flight[seed] = {"fut": fut, "stream": stream, "token": TOKEN if with_token else None, "seed": seed}

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def finish(self, data):
        seed = data.draw(st.sampled_from(sorted(self.in_flight)))
        done = self.lp.call(self.engine.finish, seed)
        assert done == (not self.frozen)
        if done:
            self._end(seed, "length")
            self.lp.settle()
            for p in [p for p in self.pending if not p["scope"]]:
                self._reply(p, "drained")
                self.pending.remove(p)
        self._check_ended()

    @rule(mode=st.sampled_from(["abort", "wait", "keep"]), short=st.booleans(), with_window=st.booleans())
    def pause(self, mode, short, with_window):
        timeout = SHORT_S if short else LONG_S
        path = f"/pause?mode={mode}&timeout_s={timeout}" + (f"&window={TOKEN}" if with_window else "")
        fut = self._post(path)
        if self.shut:
            assert fut.result(WAIT_S).status_code == 503
            return
        window = TOKEN if with_window else None
        superseded = [p for p in self.pending if p["mode"] == "wait"]
        self.held, self.window, self.frozen = True, window, mode == "keep"
        scope = {s for s, r in self.in_flight.items() if not (window is not None and r["token"] == window)}
        p = {"fut": fut, "mode": mode, "scope": set(scope), "at_pause": len(scope), "aborted": 0}
        for q in superseded:
            self.pending.remove(q)
        if mode == "abort" or (mode == "wait" and short and scope):
            for s in sorted(scope):
                self._end(s, "abort", by=p)
            p["scope"].clear()
            self._reply(p, "drained" if mode == "abort" else "timed_out")
        elif mode == "keep":
            self._reply(p, "frozen")
        elif not scope:
            self._reply(p, "drained")
        else:
            self.pending.append(p)
        for q in superseded:  # the later pause decides; the superseded reply lists what is left
            self._reply(q, "superseded")
        self._check_ended()

    @precondition(lambda self: not self.shut)
    @rule(
        n=st.integers(1, 3),
        mode=st.sampled_from(["abort", "wait", "keep"]),
        short=st.booleans(),
        with_window=st.booleans(),
    )
    def traffic_then_pause(self, n, mode, short, with_window):
        """The common shape: requests in flight, then a HOLD (the random rules alone rarely
        pause with a scope)."""
        for _ in range(n):
            self.new_request(False, False)
        self.pause(mode, short, with_window)

    @precondition(lambda self: self.held and not self.shut)
    @rule(n=st.integers(1, 3))
    def resume_then_traffic(self, n):
        """The field report's shape: a HOLD released while its drain runs, then new requests."""
        self.resume()
        for _ in range(n):
            self.new_request(True, False)

    @precondition(lambda self: self.held)  # a resume while open is covered by test_engine_server_app
    @rule()
    def resume(self):
        resp = self._post("/resume").result(WAIT_S)
        assert resp.json() == {"paused": False}
        self.held, self.window, self.frozen = False, None, False
        self._end_pending("resumed")

    @precondition(lambda self: not self.shut and self.steps >= 15)  # rare: nothing but 503s after it
    @rule()
    def shutdown(self):
        t0 = time.monotonic()
        fut = self.lp.submit(shutdown_drain(self.engine, self.state, SHUTDOWN_S))
        n = len(self.in_flight)
        report = fut.result(WAIT_S)
        took = time.monotonic() - t0
        self.shut = True
        self._end_pending("shutdown")
        for s in sorted(self.in_flight):
            self._end(s, "abort")
        assert report["in_flight"] == n and report["aborted"] == n and report["still_running"] == 0, report
        assert took < SHUTDOWN_S + 2.0, took
        self._check_ended()

    # ---------------------------------------------------------------- invariants
    @invariant()
    def pending_replies_are_pending(self):
        self.steps += 1
        for p in self.pending:
            assert not p["fut"].done(), f"a {p['mode']} pause answered early: {p['fut'].result().json()}"
        for r in self.in_flight.values():
            assert not r["fut"].done(), f"request {r['seed']} ended, the model has it in flight"

    @invariant()
    def admission_state(self):
        doc = self.lp.submit(self.client.get("/is_paused")).result(WAIT_S).json()
        assert doc["is_paused"] == self.held
        assert self.engine.frozen == self.frozen
        assert set(self.engine.by_seed[s] for s in self.in_flight) == set(self.engine.live)

    def teardown(self):
        try:
            if not self.shut:
                self.shutdown()
            for p in self.pending:
                p["fut"].result(WAIT_S)
            assert not self.engine.live and not self.state.book.entries and not self.state.book.pending
        finally:
            self.lp.submit(self.client.aclose()).result(WAIT_S)
            self.lp.close()
