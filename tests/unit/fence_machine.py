"""The vLLM admission fence's pause/resume state machine (issue 25 item 1), shared by
tests/unit/test_pause_state_machine.py (bounded) and tests/fuzz/test_pause_fuzz.py (many).

hypothesis drives fenced pauses (``mode=wait``, short or long drain, either of two window
tokens), refused fenced pauses (``abort``/``keep`` with a window: 400, nothing changes), plain
pauses (forwarded to vLLM: they replace the fenced HOLD), ``/resume``, another API server process
removing the hold file, new requests (with or without a token) and finishing them, against
:class:`AdmissionFence` in front of :class:`HeldVllm` (requests end only when the test releases
them; the fence cannot abort). Invariants: held means 503 unless the token matches; a drain's
reply arrives exactly when the model says, with the model's outcome and exact counts
(``in_flight_at_pause``, ``outlived_drain``, ``still_running``: requests admitted after the
pause, after a resume or with the token are never counted); ``/is_paused`` agrees;
``drain_outlived_total`` is the sum of the replies' ``outlived_drain``.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from authutil import OP_HEADERS, OPERATOR, TEST_HOSTS
from dsv41.engine.hold import remove_hold
from dsv41.overlay.fence import AdmissionFence
from pause_machine import WAIT_S, Loop, _until

TOKENS = ("win-a", "win-b")
SHORT_S, LONG_S = 0.01, 300.0


class HeldVllm:
    """Raw ASGI stand-in for vLLM: ``/v1/completions`` (named by its ``x-seed`` header) answers
    only once :meth:`release` is called for that seed; every other path answers at once."""

    def __init__(self) -> None:
        self.gates: dict[int, asyncio.Event] = {}

    async def __call__(self, scope, receive, send):
        if scope["path"] == "/v1/completions":
            seed = int(dict(scope["headers"])[b"x-seed"])
            gate = self.gates.setdefault(seed, asyncio.Event())
            await gate.wait()
        body = json.dumps({"vllm": scope["path"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    def release(self, seed: int) -> None:
        self.gates.setdefault(seed, asyncio.Event()).set()


class FenceMachine(RuleBasedStateMachine):
    """The model and rules (module docstring). ``hold_dir`` must be set on the class (a fresh
    directory per run: the test sets it)."""

    hold_dir = None

    def __init__(self) -> None:
        super().__init__()
        self.lp = Loop()
        self.vllm = HeldVllm()
        self.hold_file = self.hold_dir / f"hold-{time.monotonic_ns()}"
        self.fence = AdmissionFence(
            self.vllm, hold_file=self.hold_file, dev_routes=False, credential=OPERATOR, allowed_hosts=TEST_HOSTS
        )
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.fence),
            base_url="http://rank0",
            headers=OP_HEADERS,
            timeout=LONG_S * 2,
        )
        self.seed = 0
        self.window: str | None = None  # the fenced HOLD's token; None: open
        self.in_flight: dict[int, dict] = {}
        self.pending: list[dict] = []
        self.outlived = 0

    def _post(self, path: str, **kw):
        return self.lp.submit(self.client.post(path, **kw))

    def _reply(self, p: dict, outcome: str, outlived: int = 0) -> None:
        resp = p["fut"].result(WAIT_S)
        assert resp.status_code == 200, resp.text
        want = {
            "paused": self.window is not None,
            "mode": "wait",
            "window": p["window"],
            "drain": outcome,
            "in_flight_at_pause": p["at_pause"],
            "aborted": 0,
            "aborted_after_timeout": 0,
            "outlived_drain": outlived,
            "still_running": len(p["scope"]),
        }
        assert resp.json() == want, (resp.json(), want)

    def _end_pending(self, outcome: str) -> None:
        for p in self.pending:
            self._reply(p, outcome)
        self.pending = []

    # ---------------------------------------------------------------- rules
    @rule(token=st.sampled_from((None,) + TOKENS), n=st.integers(1, 2))
    def new_requests(self, token, n):
        for _ in range(n):
            self.seed += 1
            seed = self.seed
            headers = {"x-seed": str(seed)} | ({"x-dsv41-window": token} if token else {})
            fut = self._post("/v1/completions", json={"prompt": "x"}, headers=headers)
            if self.window is not None and token != self.window:
                resp = fut.result(WAIT_S)
                assert resp.status_code == 503 and resp.headers["retry-after"] == "10", resp.text
                continue
            _until(lambda seed=seed: seed in self.vllm.gates, f"request {seed} to reach vLLM")
            self.in_flight[seed] = {"fut": fut, "token": token, "seed": seed}

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def finish(self, data):
        seed = data.draw(st.sampled_from(sorted(self.in_flight)))
        r = self.in_flight.pop(seed)
        self.lp.call(self.vllm.release, seed)
        assert r["fut"].result(WAIT_S).status_code == 200
        for p in self.pending:
            p["scope"].discard(seed)
        for p in [p for p in self.pending if not p["scope"]]:
            self._reply(p, "drained")
            self.pending.remove(p)

    @rule(short=st.booleans(), window=st.sampled_from(TOKENS))
    def fenced_pause(self, short, window):
        fut = self._post(f"/pause?mode=wait&timeout_s={SHORT_S if short else LONG_S}&window={window}")
        superseded, self.pending = self.pending, []
        self.window = window
        scope = {s for s, r in self.in_flight.items() if r["token"] != window}
        p = {"fut": fut, "window": window, "scope": scope, "at_pause": len(scope)}
        if not scope:
            self._reply(p, "drained")
        elif short:
            self.outlived += len(scope)
            self._reply(p, "timed_out", outlived=len(scope))
        else:
            self.pending.append(p)
        for q in superseded:
            self._reply(q, "superseded")

    @rule(mode=st.sampled_from(["abort", "keep", "bogus"]), window=st.sampled_from(TOKENS))
    def refused_fenced_pause(self, mode, window):
        resp = self._post(f"/pause?mode={mode}&window={window}").result(WAIT_S)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "mode"

    @rule()
    def plain_pause(self):
        resp = self._post("/pause?mode=wait").result(WAIT_S)  # vLLM's own: it replaces the fenced HOLD
        assert resp.json() == {"vllm": "/pause"}
        self.window = None
        self._end_pending("superseded")

    @precondition(lambda self: self.window is not None)
    @rule()
    def resume(self):
        assert self._post("/resume").result(WAIT_S).json() == {"paused": False}
        self.window = None
        self._end_pending("resumed")

    @precondition(lambda self: self.window is not None)
    @rule()
    def other_process_resumes(self):
        remove_hold(self.hold_file)  # another API server process of the rank answered /resume
        self.window = None
        self._end_pending("resumed")

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        for p in self.pending:
            assert not p["fut"].done(), p["fut"].result().json()
        assert self.fence.in_flight == len(self.in_flight)
        assert self.fence.drain_outlived_total == self.outlived
        doc = self.lp.submit(self.client.get("/is_paused")).result(WAIT_S).json()
        assert doc["is_paused"] == (self.window is not None)

    def teardown(self):
        try:
            if self.window is not None:
                self.resume()
            for seed in sorted(self.in_flight):
                self.lp.call(self.vllm.release, seed)
                assert self.in_flight[seed]["fut"].result(WAIT_S).status_code == 200
            assert not self.fence.book.entries and not self.fence.book.pending
        finally:
            self.lp.submit(self.client.aclose()).result(WAIT_S)
            self.lp.close()
