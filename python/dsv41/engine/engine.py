"""The engine step loop over the TP ranks.

Rank 0 (:class:`Engine`) owns the scheduler, sampling, speculation and the request sinks; each
step it broadcasts the plan (``{"op": "step", "items": [(request_id, tokens, capacity)],
"truncate": [(request_id, n)], "free": [request_id]}``) over the gloo control group, every rank
runs the same :meth:`TargetModel.forward` (collectives inside), then all ranks exchange a status
object (Engram counters, drain flag). Idle, rank 0 pings every ``heartbeat_s`` so a dead rank 1
is noticed within about a second, and a frozen one within ``DSV41_TP_PEER_TIMEOUT_S`` (the
collectives' own bound, ``tp.DistComm``). Rank 1 runs :func:`worker_loop`.

``Speculator.propose`` runs under a deadline the engine enforces itself
(``dsv41.engine.deadline``): a drafter that does not answer in time costs that round its drafts
(fail-closed, counted in ``dsv41_engine_spec_deadline_exceeded_total``), never the step.

Events to request sinks are emitted from the engine thread (one ``tokens`` event per step that
produced tokens, then one ``finish``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import numpy as np

from dsv41.engine.deadline import CallBusy, CallTimeout, DeadlineCaller, Deadlines
from dsv41.engine.rejection_sampler import verify
from dsv41.engine.sampler import SamplingParams, probs_of, process_logits, sample
from dsv41.engine.scheduler import Request, RequestError, Scheduler
from dsv41.engine.spec_decode import DraftInput, DraftProposal
from dsv41.engine.tp import PeerLost
from dsv41.errors import Dsv41Error
from dsv41.tokenizer import EOS

log = logging.getLogger("dsv41.engine")


def _rank_counters(model, row_source) -> dict:
    c = {}
    if row_source is not None:
        try:
            c.update(row_source.counters())
        except Exception as exc:  # noqa: BLE001 - a counter read must never stop the step loop
            c["counter_error"] = str(exc)
    c.update(model.engram_stats)
    return c


class Engine:
    """Rank 0's engine: ``submit`` requests, ``start`` the step thread, ``shutdown``.

    ``model``: ``TargetModel``; ``scheduler``: ``Scheduler``; ``comm``: ``tp`` comm (``broadcast``/
    ``all_gather_obj`` used when ``comm.tp > 1``); ``speculator``: optional Speculator with
    ``spec_depth`` drafts per round; ``metrics``: optional ``EngineMetrics``; ``on_fatal(msg)``
    is called (engine thread) when a TP peer is lost or the step fails; ``deadlines``: the
    ``Deadlines`` (``propose_s`` bounds each ``speculator.propose``; default ``Deadlines()``).
    """

    def __init__(
        self,
        model,
        scheduler: Scheduler,
        comm,
        row_source=None,
        speculator=None,
        spec_depth: int = 0,
        metrics=None,
        on_fatal: Callable[[str], None] | None = None,
        heartbeat_s: float = 0.5,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.model, self.sched, self.comm, self.rows = model, scheduler, comm, row_source
        self.spec, self.spec_depth = speculator, (spec_depth if speculator is not None else 0)
        self.metrics, self.on_fatal, self.heartbeat_s = metrics, on_fatal, heartbeat_s
        self.rank_counters: dict[int, dict] = {0: {}}
        self.fatal: str | None = None
        self.frozen = False  # /pause?mode=keep: no steps until /resume
        self.peer_draining = False
        self._wake = threading.Event()
        self._stop = False
        self._aborts: list[str | None] = []  # request ids; None = all
        self._ctl = threading.Lock()
        self._truncs: list[tuple[str, int]] = []
        self._frees: list[str] = []
        self._by_id: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.spec_errors = 0
        self.spec_deadline_exceeded = 0
        self.deadlines = deadlines or Deadlines()
        self._spec_caller = DeadlineCaller("dsv41-propose") if speculator is not None else None
        self._refresh_counters()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[dict], None]) -> Request:
        """Queue a request. Raises ``RequestError`` when it can never run, ``Dsv41Error`` when the
        engine has failed."""
        if params.max_tokens < 0:
            raise RequestError("max_tokens must be >= 0")
        r = Request(prompt=list(prompt), params=params, sink=sink)
        # Under _ctl so that either we see `fatal` here or _fail (which sets it under _ctl) finds
        # the request in the waiting queue and finishes it: never a request nobody will finish.
        with self._ctl:
            if self.fatal:
                raise Dsv41Error(f"engine failed: {self.fatal}")
            if params.max_tokens == 0:
                self.sched.check(len(prompt), 0)
            else:
                self.sched.add(r)
        if params.max_tokens == 0:
            r.finished = "length"
            if self.metrics:  # finished without a step: counted like every other finished request
                self.metrics.finished("length")
                self.metrics.e2e.observe(time.monotonic() - r.arrival)
            sink({"type": "finish", "reason": "length", "prompt_tokens": len(prompt), "completion_tokens": 0})
            return r
        self._wake.set()
        return r

    def abort(self, request_id: str | None = None) -> None:
        """Abort one request (``None``: all running and waiting); takes effect at the next step."""
        with self._ctl:
            self._aborts.append(request_id)
        self._wake.set()

    def freeze(self, frozen: bool) -> None:
        """Stop (``True``) or restart stepping, keeping every request where it is (vLLM's
        ``/pause?mode=keep``); aborts still apply while frozen."""
        self.frozen = frozen
        self._wake.set()

    def idle(self) -> bool:
        """True when no request is running or waiting."""
        return self.sched.idle()

    def start(self) -> None:
        """Start the engine thread (daemon) that runs :meth:`step` until :meth:`shutdown`."""
        self._thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step thread; on TP>1 tell the other ranks to exit."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.comm.tp > 1 and not self.fatal:
            try:
                self.comm.broadcast({"op": "shutdown"})
            except PeerLost:
                pass
        if self.spec is not None:
            # A speculator whose propose hung may block close too: bounded, best effort at exit.
            t = threading.Thread(target=self._close_spec, name="dsv41-spec-close", daemon=True)
            t.start()
            t.join(5.0)
            self._spec_caller.close()

    def _close_spec(self) -> None:
        try:
            self.spec.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        last = time.monotonic()
        try:
            while not self._stop:
                self._apply_aborts()
                if not self.frozen and self.step():
                    last = time.monotonic()
                    continue
                self._wake.wait(self.heartbeat_s)
                self._wake.clear()
                if self.comm.tp > 1 and time.monotonic() - last >= self.heartbeat_s and not self._stop:
                    self._ping()
                    last = time.monotonic()
        except PeerLost as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - any step failure ends the engine with a clear message
            log.exception("engine step failed")
            self._fail(f"engine step failed: {type(exc).__name__}: {exc}")

    def _fail(self, msg: str) -> None:
        with self._ctl:
            self.fatal = msg
        for r in list(self.sched.running) + self.sched.take_waiting():
            self._finish(r, "error", error=msg)
        if self.on_fatal:
            self.on_fatal(msg)

    def _ping(self) -> None:
        self.comm.broadcast({"op": "ping", "truncate": self._pop_truncs(), "free": self._pop_frees()})
        self._exchange_status()

    def _pop_truncs(self):
        t, self._truncs = self._truncs, []
        return t

    def _pop_frees(self):
        f, self._frees = self._frees, []
        return f

    def _exchange_status(self) -> None:
        mine = {"counters": _rank_counters(self.model, self.rows), "drain": False}
        allst = self.comm.all_gather_obj(mine)
        for rank, st in enumerate(allst):
            self.rank_counters[rank] = st["counters"]
            if rank and st.get("drain"):
                self.peer_draining = True

    def _refresh_counters(self) -> None:
        self.rank_counters[0] = _rank_counters(self.model, self.rows)

    def _apply_aborts(self) -> None:
        with self._ctl:
            aborts, self._aborts = self._aborts, []
        for rid in aborts:
            if rid is None:
                targets = list(self.sched.running) + self.sched.take_waiting()
            else:
                with self.sched.lock:  # submit() appends to `waiting` from the event-loop thread
                    targets = list(self.sched.running) + list(self.sched.waiting)
            for r in targets:
                if rid is None or r.request_id == rid:
                    self._finish(r, "abort")

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.finished is not None:
            return
        r.finished = reason
        self.sched.release(r)
        if r.cache is not None:
            r.cache = None
            self._frees.append(r.request_id)
        self._by_id.pop(r.request_id, None)
        if self.metrics:
            self.metrics.finished(reason)
            self.metrics.e2e.observe(time.monotonic() - r.arrival)
            self._publish_counts()
        ev = {"type": "finish", "reason": reason, "prompt_tokens": len(r.prompt), "completion_tokens": len(r.output)}
        if error:
            ev["error"] = error
        try:
            r.sink(ev)
        except Exception:  # noqa: BLE001 - a broken client must not stop the engine
            log.exception("request sink failed")

    def _publish_counts(self) -> None:
        """``vllm:num_requests_running``/``waiting`` from the scheduler now: after every step and
        after every request that ends without one (an abort or a client leaving a frozen
        engine, which takes no step until /resume)."""
        if self.metrics:
            run, wait = self.sched.counts()
            self.metrics.running.set(run)
            self.metrics.waiting.set(wait)

    def _depth(self, r: Request) -> int:
        return max(0, min(self.spec_depth, r.params.max_tokens - len(r.output) - 1))

    def _propose(self) -> None:
        batch, reqs = [], []
        for r in self.sched.running:
            r.drafts, r.proposal = [], None
            if r.prefilling or r.pending is None or r.finished:
                continue
            d = self._depth(r)
            if d <= 0 or r.last_hidden is None:
                continue
            ids = np.asarray(r.prompt + r.output, dtype=np.int64)
            batch.append(
                DraftInput(
                    request_id=r.request_id,
                    token_ids=ids,
                    hidden=np.asarray(r.last_hidden, dtype=np.float32),
                    depth=d,
                    temperature=0.0 if r.params.greedy else float(r.params.temperature),
                    seed=r.sample_seed,
                )
            )
            reqs.append((r, d))
        if not batch:
            return
        try:
            props = self._spec_caller.call(self.spec.propose, batch, timeout_s=self.deadlines.propose_s)
            if len(props) != len(batch):
                raise Dsv41Error(f"speculator returned {len(props)} proposals for {len(batch)} requests")
        except (CallTimeout, CallBusy) as exc:
            # The drafter did not answer in time (or is still stuck in an earlier round): this
            # round decodes without drafts; no second call is stacked on a stuck one.
            self.spec_errors += 1
            self.spec_deadline_exceeded += 1
            if self.metrics:
                self.metrics.spec_deadline.inc()
            if self.spec_deadline_exceeded == 1 or self.spec_deadline_exceeded % 100 == 0:
                log.warning(
                    "speculator over its deadline (%d so far), decoding without drafts: %s",
                    self.spec_deadline_exceeded,
                    exc,
                )
            return
        except Exception as exc:  # noqa: BLE001 - fail closed: target-only decoding for this round
            self.spec_errors += 1
            if self.spec_errors == 1 or self.spec_errors % 100 == 0:
                log.warning(
                    "speculator failed (%d so far), decoding without drafts this round: %s", self.spec_errors, exc
                )
            return
        for (r, d), p in zip(reqs, props, strict=False):
            try:
                toks, prop = self._checked_proposal(p, d)
            except Exception as exc:  # noqa: BLE001 - a malformed proposal costs this request's round only
                self.spec_errors += 1
                log.warning("speculator returned a malformed proposal for %s, ignored: %s", r.request_id, exc)
                continue
            r.drafts, r.proposal = toks, prop

    def _checked_proposal(self, p, depth: int) -> tuple[list[int], DraftProposal]:
        """Validate one ``DraftProposal`` (docs/interfaces.md shapes) and return (drafts, proposal
        with numpy arrays). Raises ``Dsv41Error`` on ids outside the vocabulary, a ``top_ids``/
        ``top_probs`` that is not ``[>=k, w]`` or non-finite/negative probabilities: a drafter bug
        must never reach the model or the verifier."""
        toks = [int(t) for t in np.asarray(p.tokens).reshape(-1)[:depth]]
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in toks):
            raise Dsv41Error(f"draft token outside the vocabulary [0, {vocab})")
        ids = np.asarray(p.top_ids, dtype=np.int64)
        probs = np.asarray(p.top_probs, dtype=np.float64)
        if toks and (ids.ndim != 2 or ids.shape != probs.shape or ids.shape[0] < len(toks)):
            raise Dsv41Error(f"top_ids {ids.shape} / top_probs {probs.shape} do not cover {len(toks)} drafts")
        if probs.size and (not np.isfinite(probs).all() or (probs < 0).any()):
            raise Dsv41Error("top_probs has negative or non-finite values")
        return toks, DraftProposal(tokens=np.asarray(toks, dtype=np.int64), top_ids=ids, top_probs=probs)

    def step(self) -> bool:
        """One engine step; returns False when there was nothing to do."""
        import torch

        for r in self.sched.admit():
            r.cache = self.model.new_cache(r.reserved)
            seed = r.params.seed if r.params.seed is not None else random.SystemRandom().randrange(2**63)
            r.sample_seed = int(seed) & ((1 << 63) - 1)
            r.gen = torch.Generator().manual_seed(r.sample_seed)
            r.new = True
            self._by_id[r.request_id] = r
        if self.spec is not None:
            self._propose()
        plan = self.sched.plan()
        self._publish_counts()
        if not plan.items:
            return False
        if self.comm.tp > 1:
            items = []
            for r, toks, _ in plan.items:
                cap = r.reserved if getattr(r, "new", False) else 0
                items.append((r.request_id, toks, cap))
            self.comm.broadcast(
                {"op": "step", "items": items, "truncate": self._pop_truncs(), "free": self._pop_frees()}
            )
        else:
            self._truncs, self._frees = [], []
        for r, _, _ in plan.items:
            r.new = False
        out = self.model.forward([(r.cache, toks) for r, toks, _ in plan.items], [w for _, _, w in plan.items])
        self.steps += 1
        if self.comm.tp > 1:
            self._exchange_status()
        else:
            self._refresh_counters()
        now = time.monotonic()
        for (r, toks, _want), lg, tp in zip(plan.items, out.logits, out.taps, strict=False):
            if r.finished:
                continue
            try:
                self._advance(r, toks, lg, tp, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the engine
                log.exception("request %s failed", r.request_id)
                self._finish(r, "error", error=f"request failed: {type(exc).__name__}: {exc}")
        return True

    def _advance(self, r: Request, toks: list[int], lg, tp, now: float) -> None:
        """Consume one request's share of a forward: count prefill, sample or verify, emit.

        ``lg`` float32 ``[n_wanted, V]`` logits, ``tp`` float32 ``[n_wanted, H]`` taps of the
        positions the plan asked for. Raises on a sampling/verification failure (the caller
        finishes only this request with ``error``)."""
        if r.prefilling:
            r.fed += len(toks)
            if self.metrics:
                self.metrics.prompt_tokens.inc(len(toks))
            if r.prefilling:
                return
            tok = self._sample_one(r, lg[0])
            r.last_hidden = tp[0].numpy()
            r.first_token_at = r.last_token_at = now
            if self.metrics:
                self.metrics.ttft.observe(now - r.arrival)
            self._emit(r, [tok])
            return
        if self.metrics and r.last_token_at is not None:
            # One observation per step per request, like vLLM's inter-token latency (one SSE chunk).
            self.metrics.itl.observe(now - r.last_token_at)
        r.last_token_at = now
        drafts = r.drafts
        if drafts:
            emitted, acc = verify(lg, drafts, r.proposal, r.params, len(r.output), EOS, r.gen)
            keep = r.cache.length - len(toks) + 1 + acc
            r.cache.truncate(keep)
            if self.comm.tp > 1:
                self._truncs.append((r.request_id, keep))
            r.last_hidden = tp[acc].numpy()
            if self.metrics:
                self.metrics.spec_drafts.inc()
                self.metrics.spec_draft_tokens.inc(len(drafts))
                self.metrics.spec_accepted.inc(acc)
            r.drafts, r.proposal = [], None
            self._emit(r, emitted)
        else:
            tok = self._sample_one(r, lg[0])
            r.last_hidden = tp[0].numpy()
            self._emit(r, [tok])

    def _sample_one(self, r: Request, logits) -> int:
        import torch

        lg = process_logits(logits, r.params, len(r.output), EOS)
        if r.params.greedy:
            return int(torch.argmax(lg))
        return sample(probs_of(lg, r.params), r.gen)

    def _emit(self, r: Request, toks: list[int]) -> None:
        out, reason = [], None
        for t in toks:
            out.append(t)
            r.output.append(t)
            if t == EOS and not r.params.ignore_eos and len(r.output) > r.params.min_tokens - 1:
                reason = "stop"
                break
            if len(r.output) >= r.params.max_tokens:
                reason = "length"
                break
        r.pending = out[-1]
        if self.metrics:
            self.metrics.generation_tokens.inc(len(out))
        try:
            r.sink({"type": "tokens", "ids": out, "prompt_tokens": len(r.prompt), "completion_tokens": len(r.output)})
        except Exception:  # noqa: BLE001
            log.exception("request sink failed")
        if reason:
            self._finish(r, reason)


def worker_loop(model, comm, row_source, drain_flag: Callable[[], bool]) -> int:
    """Rank >= 1: follow rank 0's commands until ``shutdown``; returns the exit code.

    Raises ``PeerLost`` when rank 0 disappears (the caller prints one line and exits 1).
    """
    caches: dict = {}
    while True:
        cmd = comm.broadcast(None)
        for rid, n in cmd.get("truncate", ()):
            if rid in caches:
                caches[rid].truncate(n)
        for rid in cmd.get("free", ()):
            caches.pop(rid, None)
        op = cmd.get("op")
        if op == "shutdown":
            return 0
        if op == "step":
            items = []
            for rid, toks, cap in cmd["items"]:
                c = caches.get(rid)
                if c is None:
                    c = caches[rid] = model.new_cache(cap)
                items.append((c, toks))
            model.forward(items, [[] for _ in items], logits=False)
        comm.all_gather_obj({"counters": _rank_counters(model, row_source), "drain": bool(drain_flag())})
